"""The kernel-variant spec: one frozen, validated description per kernel."""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, field_validator, model_serializer,
                      model_validator)

from .algorithms import ALGORITHMS, algorithm_for
from .arch import ARCHS, Arch
from .tuning import resolve_tile, seqlen_bounds

MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # 16-byte vectors of fp16/bf16


class TileConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    block_m: int = Field(gt=0, description="query rows per CTA")
    block_n: int = Field(gt=0, description="key rows per K/V tile")
    warps: int = Field(gt=0, description="warps per CTA")
    stages: int = Field(gt=0, description="K/V shared-memory ring depth")
    warp_specialized: bool = Field(False, description="FA3: a producer warpgroup issues all loads")
    pingpong: bool = Field(False, description="FA3: consumer warpgroups take turns on the MMAs")
    intra_wg_overlap: bool = Field(False, description="FA3: softmax overlaps the next Q K^T")
    persistent: bool = Field(False, description="FA3: one CTA per SM walks many tiles")
    early_first_qk: bool = Field(
        False, description="FA3, persistent with intra_wg_overlap: a tile's first Q K^T runs "
        "under the previous tile's epilogue (two Q buffers)")
    peel_masked_blocks: bool = Field(
        False, description="FA3 with intra_wg_overlap: the key blocks that may need a mask run in "
        "a loop of their own, so that the main loop carries no mask code")
    mma_row_sum: bool = Field(
        False, description="FA3: the softmax row sums come out of P V (V gets a column of ones) "
        "instead of one add per score")
    exp2_emulation: float | None = Field(
        None, description="fraction 1/k of the softmax exponentials computed by a "
        "polynomial on the FMA pipe (every k-th column pair); omit for hardware exp2 only")
    rescale_threshold: float | None = Field(
        None, ge=0, description="rescale O and l only when the row maximum grows by "
        "more than this (base 2, scaled scores; FA4 uses 8 = log2 256); omit to always rescale")

    FLAG_SUFFIXES: ClassVar[dict[str, str]] = {
        "warp_specialized": "ws", "pingpong": "pp", "intra_wg_overlap": "ov", "persistent": "ps",
        "early_first_qk": "fq", "peel_masked_blocks": "pm", "mma_row_sum": "ms",
        "exp2_emulation": "e2p", "rescale_threshold": "rt"}

    @model_serializer(mode="wrap")
    def _omit_default_options(self, handler):
        """Flags and options at their defaults are left out of the dump, so the canonical JSON,
        and with it every kernel's hash and name, does not change when an option is added."""
        data = handler(self)
        return {k: v for k, v in data.items()
                if not (k in self.FLAG_SUFFIXES and v == type(self).model_fields[k].default)}

    @field_validator("exp2_emulation")
    @classmethod
    def _check_exp2_emulation(cls, value: float | None) -> float | None:
        if value is not None and not (0 < value <= 1 and abs(1 / value - round(1 / value)) < 1e-6):
            raise ValueError(f"exp2_emulation={value}: must be 1/k for a whole k >= 1 (every k-th "
                             "column pair uses the polynomial); omit it for hardware exp2 only")
        return value

    @property
    def exp2_emulation_period(self) -> int:
        """k of `exp2_emulation` = 1/k; 0 when every exponential uses the hardware unit."""
        return 0 if self.exp2_emulation is None else round(1 / self.exp2_emulation)

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(name for name in self.FLAG_SUFFIXES
                     if getattr(self, name) is not None and getattr(self, name) is not False)

    def _suffix(self, flag: str) -> str:
        if flag == "exp2_emulation":
            return f"{self.FLAG_SUFFIXES[flag]}{self.exp2_emulation_period}"
        if flag == "rescale_threshold":
            return f"{self.FLAG_SUFFIXES[flag]}{self.rescale_threshold:g}".replace(".", "p")
        return self.FLAG_SUFFIXES[flag]

    @property
    def short(self) -> str:
        suffix = "".join(f"_{self._suffix(f)}" for f in self.flags)
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}{suffix}"


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
    max_seqlen_k: int | None = Field(
        None, gt=0, description="the runtime prefers this kernel for calls with at most this "
        "many keys (the smallest covering bound of a key wins; unbounded kernels serve the "
        "rest); omit for a kernel that serves any length")

    @model_serializer(mode="wrap")
    def _omit_unbounded(self, handler):
        """An unbounded kernel dumps as before the field existed: same JSON, hash and name."""
        data = handler(self)
        if data.get("max_seqlen_k") is None:
            data.pop("max_seqlen_k", None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto_tile(cls, data: Any) -> Any:
        request = _auto_tile_request(data)
        if request is None:
            return data
        try:
            row = resolve_tile(*request, data.get("max_seqlen_k"))
        except (ValueError, TypeError, OverflowError) as exc:
            if "tile: auto" in str(exc):
                raise ValueError(str(exc)) from None
            return data  # a malformed field: field validation names it
        return {**data, "tile": row.tile_fields()}

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
        unknown_flags = [f for f in self.tile.flags if f not in algorithm.tile_flags]
        if unknown_flags:
            raise ValueError(
                f"tile.{unknown_flags[0]}: fa_version={self.fa_version} has no such option "
                f"(it takes: {', '.join(algorithm.tile_flags) or 'none'})"
            )
        problems = self.geometry.problems(ARCHS[self.arch].max_smem_per_block)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def geometry(self):
        """The algorithm's geometry (Fa2Geometry, Fa3Geometry): validation and derived constants."""
        return algorithm_for(self.fa_version, self.direction).geometry(self.head_dim, self.tile)

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
        bound = "" if self.max_seqlen_k is None else f"_upto{self.max_seqlen_k}"
        return (
            f"fa{self.fa_version}_{self.direction}_{self.arch.value}_{self.dtype}_"
            f"hd{self.head_dim}_{self.mask_name}_{self.tile.short}{bound}_{self.short_hash}"
        )

    @property
    def lookup_key(self) -> str:
        """What a caller asks for (architecture aside): the runtime matches this exactly."""
        return f"{self.direction}/{self.dtype}/hd{self.head_dim}/{self.mask_name}"


def _auto_tile_request(data: Any) -> tuple[int, Arch, int, bool] | None:
    """(fa_version, arch, head_dim, causal) of a `tile: auto` entry for the tuning table; None
    for an explicit tile, or for fields missing or too malformed to ask (field validation then
    names them)."""
    if not isinstance(data, dict) or data.get("tile", "auto") != "auto":
        return None
    try:
        return (int(data["fa_version"]), Arch(data["arch"]), int(data["head_dim"]),
                bool(data.get("causal", False)))
    except (KeyError, ValueError, TypeError, OverflowError):
        return None


def auto_seqlen_bounds(fields: dict[str, Any]) -> list[int]:
    """The extra seqlen_k bounds a `tile: auto` entry expands to (see tuning.seqlen_bounds);
    none for an explicit tile or bound, or fields too malformed to ask (validation names them)."""
    request = _auto_tile_request(fields)
    if request is None or "max_seqlen_k" in fields:
        return []
    try:
        return seqlen_bounds(*request)
    except (ValueError, TypeError, OverflowError):
        return []
