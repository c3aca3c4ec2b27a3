"""The kernel-variant spec: one frozen, validated description per kernel."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .algorithms import ALGORITHMS, algorithm_for
from .arch import ARCHS, Arch
from .fa2 import Fa2Geometry
from .tuning import resolve_tile

MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # 16-byte vectors of fp16/bf16


class TileConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    block_m: int = Field(gt=0, description="query rows per CTA")
    block_n: int = Field(gt=0, description="key rows per K/V tile")
    warps: int = Field(gt=0, description="warps per CTA")
    stages: int = Field(gt=0, description="K/V shared-memory ring depth")

    @property
    def short(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"


class KernelSpec(BaseModel):
    """One kernel variant. `tile: auto` (or no tile) resolves through the tuning table."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    fa_version: Literal[1, 2, 3, 4]
    arch: Arch
    direction: Literal["fwd", "bwd"] = "fwd"
    dtype: Literal["fp16", "bf16"]
    head_dim: int
    causal: bool = False
    tile: TileConfig

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto_tile(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("tile", "auto") != "auto":
            return data
        needed = ("fa_version", "arch", "head_dim")
        if not all(k in data for k in needed):
            return data  # field validation reports what is missing
        try:
            arch = Arch(data["arch"])
            head_dim = int(data["head_dim"])
            row = resolve_tile(int(data["fa_version"]), arch, head_dim)
        except (ValueError, TypeError) as exc:
            if "tile: auto" in str(exc):
                raise ValueError(str(exc)) from None
            return data  # a malformed arch/head_dim: field validation names it
        return {**data, "tile": {"block_m": row.block_m, "block_n": row.block_n,
                                 "warps": row.warps, "stages": row.stages}}

    @field_validator("head_dim")
    @classmethod
    def _check_head_dim(cls, value: int) -> int:
        if value <= 0 or value > MAX_HEAD_DIM or value % HEAD_DIM_MULTIPLE:
            raise ValueError(
                f"head_dim={value}: must be a multiple of {HEAD_DIM_MULTIPLE} in "
                f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]"
            )
        return value

    @model_validator(mode="after")
    def _check_variant(self) -> "KernelSpec":
        algorithm = algorithm_for(self.fa_version, self.direction)
        if algorithm is None:
            available = ", ".join(f"fa{v} {d}" for (v, d) in ALGORITHMS)
            raise ValueError(
                f"fa_version={self.fa_version} direction={self.direction}: no template yet "
                f"(available: {available})"
            )
        if self.arch not in algorithm.archs:
            raise ValueError(
                f"arch={self.arch.value}: fa_version={self.fa_version} {self.direction} runs on "
                f"{', '.join(a.value for a in algorithm.archs)} only ({algorithm.why_archs})"
            )
        problems = self.geometry.problems(ARCHS[self.arch].max_smem_per_block)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def geometry(self) -> Fa2Geometry:
        t = self.tile
        return Fa2Geometry(self.head_dim, t.block_m, t.block_n, t.warps, t.stages)

    # ---- naming: stable, derived from the canonical spec only ----

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def short_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:8]

    @property
    def mask_name(self) -> str:
        return "causal" if self.causal else "full"

    @property
    def name(self) -> str:
        """The kernel symbol: unmangled, `extern "C"`, unique per canonical spec."""
        return (
            f"fa{self.fa_version}_{self.direction}_{self.arch.value}_{self.dtype}_"
            f"hd{self.head_dim}_{self.mask_name}_{self.tile.short}_{self.short_hash}"
        )

    @property
    def lookup_key(self) -> str:
        """What a caller asks for (architecture aside): the runtime matches this exactly."""
        return f"{self.direction}/{self.dtype}/hd{self.head_dim}/{self.mask_name}"
