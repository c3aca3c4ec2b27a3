"""What every kernel spec shares; each algorithm (fa1.py ... fa4.py) subclasses it.

A spec is one frozen, validated description of a kernel variant: the fields every kernel has
(fa_version, arch, direction, dtype, head_dim, head_dim_v, mask, score, max_seqlen_k) and a `tile`, which is the
algorithm's own model. Each algorithm's spec class owns its tile model, its geometry (derived
constants and the limits it checks: shared memory, registers, TMEM), the constexprs its template
receives and its launch description; `KernelSpec.model_validate(fields)` picks the class by
(fa_version, direction) (algorithms.py).

Naming: the kernel symbol and its hash come from the canonical JSON of the spec, so they change
only when the kernel does.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, field_validator, model_serializer,
                      model_validator)

from .. import contract
from .arch import ARCHS, Arch
from .tuning import resolve_tile


@dataclass(frozen=True)
class EnumValue:
    """A member of a C++ enum class, e.g. fagen::algo::MaskKind::kCausal."""

    enum: str
    member: str


# The kernels' MaskKind (templates/include/fagen/algo/mask.cuh) of each contract.MASK_KINDS name.
MASK_KINDS = {"full": "kFull", "causal": "kCausal", "local": "kLocal", "custom": "kCustom"}
_CPP_TYPE = re.compile(r"^(::)?[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*$")


class CustomMask(BaseModel):
    """A user's mask, compiled into the kernel ahead of time: its header's text, the type in it
    that templates/include/fagen/algo/mask.cuh's CustomMask wraps, and the name a key spells it
    by. A spec file declares it under `masks:` (header path and type); the kernel's spec then
    carries the header's text itself, so that the kernel's name and hash follow its content."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="the mask's name in keys and calls (e.g. document)")
    type: str = Field(description="the C++ type in the header (e.g. DocumentMask)")
    source: str = Field(description="the header's text")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if problem := contract.custom_mask_name_problem(value):
            raise ValueError(problem)
        return value

    @field_validator("type")
    @classmethod
    def _check_type(cls, value: str) -> str:
        if not _CPP_TYPE.match(value):
            raise ValueError(f"type={value!r}: a C++ type name (e.g. DocumentMask or ns::DocumentMask)")
        return value


@dataclass(frozen=True)
class Constexpr:
    """One `static constexpr` of a template's Config."""

    name: str
    value: bool | int | float | EnumValue

    @property
    def c_type(self) -> str:
        if isinstance(self.value, EnumValue):
            return self.value.enum
        return {bool: "bool", int: "int", float: "float"}[type(self.value)]

    @property
    def c_value(self) -> str:
        if isinstance(self.value, EnumValue):
            return f"{self.value.enum}::{self.value.member}"
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return f"{self.value!r}f" if isinstance(self.value, float) else str(self.value)


class TileBase(BaseModel):
    """An algorithm's tile. Subclasses declare their fields and, in SUFFIXES, how the options
    among them (and their STRUCTURE) spell in the kernel name, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ALGORITHM: ClassVar[str] = ""  # e.g. "fa3 fwd", for messages
    # (field or structure name, name suffix), in name order.
    SUFFIXES: ClassVar[tuple[tuple[str, str], ...]] = ()
    # What every kernel of the algorithm does, as it appears in the canonical JSON (and so in
    # the names and hashes of kernels built while it was an option). Accepted on input only with
    # this value.
    STRUCTURE: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _accept_structure(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.STRUCTURE:
            return data
        data = dict(data)
        for name, value in cls.STRUCTURE.items():
            if name in data:
                if data.pop(name) != value:
                    raise ValueError(f"tile.{name}: every {cls.ALGORITHM} kernel has "
                                     f"{name}={value} (it is the kernel's structure, not an option)")
        return data

    @model_serializer(mode="wrap")
    def _canonical(self, handler):
        """Options at their defaults are left out of the dump, so adding an option changes no
        kernel's name; the structure goes in."""
        data = handler(self)
        options = {name for name, _ in self.SUFFIXES} - set(self.STRUCTURE)
        data = {k: v for k, v in data.items()
                if not (k in options and v == type(self).model_fields[k].default)}
        return {**data, **self.STRUCTURE}

    def _suffix(self, name: str) -> str | None:
        suffix = dict(self.SUFFIXES)[name]
        if name in self.STRUCTURE:
            return suffix
        value = getattr(self, name)
        if value == type(self).model_fields[name].default:
            return None  # as in the canonical dump: an option at its default is not spelled
        return suffix if value is True else self._valued_suffix(name, value, suffix)

    def _valued_suffix(self, name: str, value: Any, suffix: str) -> str:
        return f"{suffix}{value:g}".replace(".", "p")

    @property
    def sizes(self) -> str:
        """The tile's sizes in the kernel name, e.g. m128n64w4s2."""
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"

    @property
    def short(self) -> str:
        suffixes = (self._suffix(name) for name, _ in self.SUFFIXES)
        return self.sizes + "".join(f"_{s}" for s in suffixes if s is not None)


class SoftmaxTricksTile(TileBase):
    """The two softmax options of algo/online_softmax.cuh: shipped by FA4 (Blackwell's MUFU is
    its bottleneck), kept on FA2 where the GPU tests run them on Hopper."""

    exp2_emulation: float | None = Field(
        None, description="fraction 1/k of the softmax exponentials computed by a "
        "polynomial on the FMA pipe (every k-th column pair); omit for hardware exp2 only")
    rescale_threshold: float | None = Field(
        None, ge=0, description="rescale O and l only when the row maximum grows by "
        "more than this (base 2, scaled scores; FA4 uses 8 = log2 256); omit to always rescale")

    SUFFIXES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("exp2_emulation", "e2p"), ("rescale_threshold", "rt"))

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

    def _valued_suffix(self, name: str, value: Any, suffix: str) -> str:
        if name == "exp2_emulation":
            return f"{suffix}{self.exp2_emulation_period}"
        return super()._valued_suffix(name, value, suffix)

    def softmax_constexprs(self) -> list[Constexpr]:
        """The Config names algo/online_softmax.cuh reads."""
        return [
            Constexpr("kExp2EmulationPeriod", self.exp2_emulation_period),
            Constexpr("kConditionalRescale", self.rescale_threshold is not None),
            Constexpr("kRescaleThreshold", float(self.rescale_threshold or 0.0)),
        ]


class KernelSpec(BaseModel):
    """One kernel variant. Subclassed per algorithm; `KernelSpec.model_validate(fields)` returns
    the algorithm's subclass. `tile: auto` (or no tile) resolves through the tuning table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Per algorithm (subclasses): the template, the targets, the SASS every cubin must contain.
    FA_VERSION: ClassVar[int]
    DIRECTION: ClassVar[str]
    # Why no tile of the algorithm can take a head_dim (None where some can): its module's
    # head_dim_problem, which its geometry's problems() reports too.
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]]
    # Why the algorithm cannot take v's head dim `head_dim_v` beside q/k's `head_dim` where they
    # differ (None where it can); by default it cannot.
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(
        lambda head_dim, head_dim_v: "its kernels take one head dim for q, k and v")
    TEMPLATE: ClassVar[str]  # path under templates/kernels/
    ARCHS: ClassVar[tuple[Arch, ...]]
    WHY_ARCHS: ClassVar[str]
    REQUIRED_SASS: ClassVar[tuple[str, ...]]
    # The algorithm's tuning rows (fagen/model/tuning.py resolves `tile: auto` from them).
    TUNING_ROWS: ClassVar[tuple] = ()
    # The masks (contract.MASK_KINDS) the algorithm's kernels implement, and why not the others;
    # `custom` (a user's mask) only where an algorithm says so.
    MASKS: ClassVar[tuple[str, ...]] = contract.MASKS
    WHY_MASKS: ClassVar[str] = ""
    # The score modifiers (contract.SCORE_MODS) the algorithm's kernels implement, and why not
    # the others.
    SCORE_MODS: ClassVar[tuple[str, ...]] = contract.SCORE_MODS
    WHY_SCORE_MODS: ClassVar[str] = ""
    # The tensor layouts (contract.LAYOUTS) the algorithm's kernels take; algorithms.py finds a
    # spec's class by (fa_version, direction, layout).
    LAYOUTS: ClassVar[tuple[str, ...]] = contract.LAYOUTS[:1]
    # The element types (contract.DTYPES) the algorithm's kernels take, and why not the others.
    DTYPES: ClassVar[tuple[str, ...]] = ("fp16", "bf16")
    WHY_DTYPES: ClassVar[str] = "e4m3 (FP8) runs on the FA3 and FA4 forwards (fa_version 3, sm90a; 4, sm100a) only"
    # The K/V element types (contract.CACHE_DTYPES) the algorithm reads besides dtype, and why not.
    KV_DTYPES: ClassVar[tuple[str, ...]] = ()
    WHY_KV_DTYPES: ClassVar[str] = ("an e4m3 cache under fp16 / bf16 queries is read by the split-KV "
                                    "kernels (fa_version 2, layout paged) only")

    fa_version: int = Field(description="the algorithm: 1-4 (FlashAttention's versions; with "
                            "`direction` it picks the template, below)")
    arch: Arch = Field(description="the target the cubin is built for; a cubin runs on its own major "
                       "version only, an `a` target on exactly its compute capability")
    direction: Literal["fwd", "bwd"] = Field("fwd", description="the forward, or the backward (dQ, "
                                             "dK, dV from the forward's output and LSE)")
    dtype: Literal[contract.DTYPES] = Field(
        description="the element type of q, k, v, the output and the gradients: fp16, bf16, or "
        "e4m3 (FP8, the FA3 and FA4 forwards only: q, k and v in e4m3 with descales given at run time, "
        "the output in bf16)")
    kv_dtype: Literal[contract.DTYPES] | None = Field(
        None, description="the element type of k and v where it differs from dtype: e4m3, an FP8 "
        "KV cache under fp16 / bf16 queries (layout paged, fa_version 2; its descales given at run "
        "time, the output in dtype); omit for k and v of dtype")
    head_dim: int = Field(description="q and k's last dimension (and v's, unless head_dim_v)")
    head_dim_v: int | None = Field(
        None, description="v's and the output's last dimension where it differs from head_dim "
        "(DeepSeek-V3's prefill: head_dim 192, head_dim_v 128); omit (or give head_dim) for the "
        "same. FA2 and FA3 take head_dim_v <= head_dim, each a head dim of the algorithm")
    mask: Literal[contract.MASK_KINDS] = Field(
        "full", description="which (query, key) pairs attend (templates/include/fagen/algo/"
        "mask.cuh): full, causal (bottom-right aligned) or local (a sliding window, its sizes "
        "given at run time; causal with a window is local too), or in a spec file the name of "
        "one of its `masks:` (a user's mask, compiled in: kind custom). `causal: true` is "
        "shorthand for mask: causal, `causal: false` for mask: full")
    custom_mask: CustomMask | None = Field(
        None, description="with mask: custom, the user's mask (a spec file fills it in from its "
        "`masks:` section)")
    score: tuple[Literal[contract.SCORE_MODS], ...] = Field(
        (), description="the score modifiers built in (templates/include/fagen/algo/score.cuh), "
        "joined by + as a key spells them, e.g. softcap+sinks: softcap (scores -> softcap * "
        "tanh(scores / softcap), the value given at run time), alibi (ALiBi's distance bias, "
        "the slopes given at run time), sinks (a learnable logit per head in each row's "
        "softmax, with its gradient); none (the default) for plain scores. A list builds one "
        "kernel per entry, like every other field")
    layout: Literal[contract.LAYOUTS] = Field(
        contract.LAYOUTS[0], description="how a call lays out its tensors: dense (flash_attn_func: "
        "(batch, seqlen, heads, head_dim)), paged (flash_attn_with_kvcache: K/V in a cache of "
        "pages or one block per sequence, each sequence's length at run time, split-KV decoding; "
        "fa_version 2 forward only) or varlen (flash_attn_varlen_func: sequences of different "
        "lengths packed as (total, heads, head_dim) by cu_seqlens; fa_version 2 and 3, forward "
        "and backward)")
    tile: TileBase
    max_seqlen_k: int | None = Field(
        None, gt=0, description="the runtime prefers this kernel for calls with at most this "
        "many keys (the smallest covering bound of a key wins; unbounded kernels serve the "
        "rest); omit for a kernel that serves any length")

    @classmethod
    def model_validate(cls, obj: Any, **kwargs) -> "KernelSpec":
        """Validate `obj`; called on KernelSpec itself, as the algorithm's subclass."""
        if cls is KernelSpec:
            from .algorithms import spec_class

            return spec_class(obj).model_validate(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @model_serializer(mode="wrap")
    def _canonical_fields(self, handler):
        """An unbounded kernel, and one of the full or causal mask, dumps as before those fields
        existed (max_seqlen_k; mask, then `causal: bool`): same JSON, hash and name."""
        data = handler(self)
        if data.get("max_seqlen_k") is None:
            data.pop("max_seqlen_k", None)
        if not data.get("score"):
            data.pop("score", None)
        if data.get("head_dim_v") is None:
            data.pop("head_dim_v", None)
        if data.get("custom_mask") is None:
            data.pop("custom_mask", None)
        if data.get("layout") == contract.LAYOUTS[0]:
            data.pop("layout", None)
        if data.get("kv_dtype") is None:
            data.pop("kv_dtype", None)
        if data.get("mask") in ("full", "causal"):
            data["causal"] = data.pop("mask") == "causal"
        return data

    @model_validator(mode="before")
    @classmethod
    def _causal_shorthand(cls, data: Any) -> Any:
        """`causal: true / false` (the field before masks had kinds) as mask: causal / full."""
        if not isinstance(data, dict) or "causal" not in data:
            return data
        data = dict(data)
        causal = data.pop("causal")
        if not isinstance(causal, bool):
            raise ValueError(f"causal={causal!r}: must be true or false (or give mask: "
                             f"{' / '.join(contract.MASKS)})")
        mask = "causal" if causal else "full"
        if data.setdefault("mask", mask) != mask:
            raise ValueError(f"causal={str(causal).lower()} and mask={data['mask']} disagree: give one of them")
        return data

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto_tile(cls, data: Any) -> Any:
        if cls is KernelSpec:
            raise TypeError("KernelSpec(...) is the base of the algorithms' specs: use "
                            "KernelSpec.model_validate(fields), which picks the algorithm")
        if not isinstance(data, dict) or data.get("tile", "auto") != "auto":
            return data
        data = cls._causal_shorthand(data)  # the tile depends on the mask
        try:
            arch, head_dim = Arch(data["arch"]), int(data["head_dim"])
            head_dim_v = None if data.get("head_dim_v") is None else int(data["head_dim_v"])
            mask = data.get("mask", "full")
            score = tuple(cls._parse_score(data.get("score", ())))
        except (KeyError, ValueError, TypeError, OverflowError):
            return data  # a field missing or malformed: field validation names it
        # A field's own limit comes first: the tuning table's "give the tile explicitly" would
        # mislead where no tile can work.
        if problem := cls.head_dim_problem(head_dim):
            raise ValueError(problem)
        if head_dim_v == head_dim:
            head_dim_v = None
        if head_dim_v is not None and (problem := cls.head_dim_v_problem(head_dim, head_dim_v)):
            raise ValueError(problem)
        cls._check_arch(arch)
        if mask in contract.MASK_KINDS:
            cls._check_mask(mask)
        dtype = data.get("dtype")
        if dtype in contract.DTYPES:
            cls._check_dtype(dtype)
        else:
            return data  # field validation names it
        kv_dtype = data.get("kv_dtype")
        if kv_dtype is not None and kv_dtype != dtype:
            if kv_dtype not in contract.DTYPES:
                return data  # field validation names it
            cls._check_kv_dtype_of(kv_dtype)
        tile = resolve_tile(cls, arch, head_dim, mask, data.get("max_seqlen_k"), score, head_dim_v,
                            data.get("layout", contract.LAYOUTS[0]), contract.dtypes_name(dtype, kv_dtype))
        return {**data, "tile": tile.model_dump()}

    @classmethod
    def head_dim_problem(cls, head_dim: int) -> str | None:
        """Why no tile of this algorithm can take `head_dim` (its HEAD_DIM_RULE, which names what
        it takes), else why no fagen kernel can; None where it can."""
        return cls.HEAD_DIM_RULE(head_dim) or contract.head_dim_problem(head_dim)

    @classmethod
    def head_dim_v_problem(cls, head_dim: int, head_dim_v: int) -> str | None:
        """Why this algorithm cannot take v's head dim `head_dim_v` beside `head_dim` (they
        differ), or None."""
        if problem := contract.head_dim_problem(head_dim_v, "head_dim_v"):
            return problem
        if problem := cls.HEAD_DIM_V_RULE(head_dim, head_dim_v):
            return (f"head_dim_v={head_dim_v} (head_dim={head_dim}): fa_version={cls.FA_VERSION} "
                    f"{cls.DIRECTION} cannot take it: {problem}")
        return None

    @field_validator("head_dim")
    @classmethod
    def _check_head_dim(cls, value: int) -> int:
        if problem := cls.head_dim_problem(value):
            raise ValueError(problem)
        return value

    @field_validator("head_dim_v")
    @classmethod
    def _check_head_dim_v(cls, value: int | None, info) -> int | None:
        head_dim = info.data.get("head_dim")
        if value is None or head_dim is None or value == head_dim:
            return None  # one head dim: spelled once, so that the kernel's name stays
        if problem := cls.head_dim_v_problem(head_dim, value):
            raise ValueError(problem)
        return value

    @field_validator("arch")
    @classmethod
    def _check_arch(cls, value: Arch) -> Arch:
        if value not in cls.ARCHS:
            raise ValueError(
                f"arch={value.value}: fa_version={cls.FA_VERSION} {cls.DIRECTION} runs on "
                f"{', '.join(a.value for a in cls.ARCHS)} only ({cls.WHY_ARCHS})")
        return value

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        if value not in cls.DTYPES:
            raise ValueError(f"dtype={value}: fa_version={cls.FA_VERSION} {cls.DIRECTION} takes "
                             f"{', '.join(cls.DTYPES)} ({cls.WHY_DTYPES})")
        return value

    @classmethod
    def _check_kv_dtype_of(cls, value: str) -> str:
        if value not in cls.KV_DTYPES:
            takes = " or ".join(("dtype's",) + cls.KV_DTYPES)
            raise ValueError(f"kv_dtype={value}: fa_version={cls.FA_VERSION} {cls.DIRECTION} reads k and v "
                             f"of {takes} element ({cls.WHY_KV_DTYPES})")
        return value

    @field_validator("kv_dtype")
    @classmethod
    def _check_kv_dtype(cls, value: str | None, info) -> str | None:
        if value is None or value == info.data.get("dtype"):
            return None  # k and v of dtype: spelled once, so that the kernel's name stays
        return cls._check_kv_dtype_of(value)

    @field_validator("mask")
    @classmethod
    def _check_mask(cls, value: str) -> str:
        if value not in cls.MASKS:
            why = f" ({cls.WHY_MASKS})" if cls.WHY_MASKS else ""
            raise ValueError(f"mask={value}: fa_version={cls.FA_VERSION} {cls.DIRECTION} has the "
                             f"{', '.join(cls.MASKS)} masks only{why}")
        return value

    @field_validator("score", mode="before")
    @classmethod
    def _parse_score(cls, value: Any) -> Any:
        """`softcap+sinks` (the key's spelling) or `none`; a list of modifiers as dumped."""
        if isinstance(value, str):
            return () if value in ("", "none") else tuple(value.split("+"))
        return value

    @field_validator("score")
    @classmethod
    def _check_score(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"score={list(value)}: each modifier once")
        missing = [mod for mod in value if mod not in cls.SCORE_MODS]
        if missing:
            takes = ", ".join(cls.SCORE_MODS) or "none"
            raise ValueError(f"score: {', '.join(missing)}: fa_version={cls.FA_VERSION} {cls.DIRECTION} "
                             f"takes {takes} ({cls.WHY_SCORE_MODS})")
        return tuple(mod for mod in contract.SCORE_MODS if mod in value)

    @model_validator(mode="after")
    def _check_custom_mask(self) -> "KernelSpec":
        if (self.mask == "custom") != (self.custom_mask is not None):
            raise ValueError("mask: custom and custom_mask come together (a spec file's `masks:` "
                             "entry gives both)")
        return self

    @model_validator(mode="after")
    def _check_geometry(self) -> "KernelSpec":
        problems = self.geometry.problems(ARCHS[self.arch].max_smem_per_block)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---- per algorithm ----

    @staticmethod
    def geometry_of(head_dim: int, tile: TileBase, head_dim_v: int | None = None, dtype: str = "bf16"):
        """The algorithm's derived constants and limits for the head dims, a tile and the
        element types (contract.dtypes_name; the tuning table asks before a spec exists)."""
        raise NotImplementedError

    @property
    def dtypes(self) -> str:
        """q's element type, and k's and v's where they differ (contract.dtypes_name)."""
        return contract.dtypes_name(self.dtype, self.kv_dtype)

    @property
    def geometry(self):
        """geometry_of this spec's head dims, tile and element types."""
        return self.geometry_of(self.head_dim, self.tile, self.head_dim_v, self.dtypes)

    @property
    def value_dim(self) -> int:
        """v's and the output's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def algorithm_constexprs(self) -> list[Constexpr]:
        """The constexprs of the algorithm's template beyond the common ones."""
        raise NotImplementedError

    def launch(self) -> contract.Launch:
        raise NotImplementedError

    def e4m3_variant_problem(self) -> str | None:
        """Why this e4m3 spec has no kernel, or None: e4m3 forwards (FA3, FA4) exist for the dense
        layout with the built-in masks and no score modifier (their descales scale the scores,
        which the modifiers' code does not yet take)."""
        if self.layout != "dense":
            return f"layout={self.layout}: e4m3 kernels take the dense layout only"
        if self.score:
            return f"score={'+'.join(self.score)}: e4m3 kernels take no score modifier"
        if self.mask == "custom":
            return "mask: a custom mask is not built for e4m3 kernels"
        return None

    @property
    def required_sass(self) -> tuple[str, ...]:
        """The SASS families this kernel's cubin must contain (REQUIRED_SASS, where the element
        type does not change the instructions)."""
        return self.REQUIRED_SASS

    # ---- shared ----

    def constexprs(self) -> list[Constexpr]:
        """Everything the template's Config declares (codegen renders them in this order)."""
        return [
            Constexpr("kIsBf16", self.dtype == "bf16"),
            Constexpr("kMask", EnumValue("fagen::algo::MaskKind", MASK_KINDS[self.mask])),
            *(Constexpr(f"k{mod.capitalize()}", mod in self.score) for mod in contract.SCORE_MODS),
            Constexpr("kHeadDim", self.head_dim),
            Constexpr("kHeadDimV", self.value_dim),
            *([Constexpr("kVarlen", self.layout == "varlen")] if "varlen" in self.LAYOUTS else []),
            *self.algorithm_constexprs(),
        ]

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def short_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:8]

    @property
    def name(self) -> str:
        """The kernel symbol: unmangled, `extern "C"`, unique per canonical spec."""
        bound = "" if self.max_seqlen_k is None else f"_upto{self.max_seqlen_k}"
        layout = "" if self.layout == contract.LAYOUTS[0] else f"_{self.layout}"
        return (
            f"fa{self.fa_version}_{self.direction}_{self.arch.value}_{self.dtypes.replace('-', '_')}_"
            f"hd{contract.head_dims_name(self.head_dim, self.head_dim_v)}_"
            f"{self.variant.replace('+', '_')}{layout}_{self.tile.short}{bound}_{self.short_hash}"
        )

    @property
    def lookup_key(self) -> str:
        """What a caller asks for (architecture aside): the runtime matches this exactly."""
        return contract.kernel_key(self.direction, self.dtype, self.head_dim, self.mask_name, self.score,
                                   self.head_dim_v, self.layout, self.kv_dtype)

    @property
    def mask_name(self) -> str:
        """The mask as keys spell it: a built-in mask, or a custom mask's name."""
        return self.custom_mask.name if self.custom_mask is not None else self.mask

    @property
    def mask_type(self) -> str:
        """The C++ type of the kernel's mask (its Config::Mask)."""
        if self.custom_mask is not None:
            return f"fagen::algo::CustomMask<{self.custom_mask.type}>"
        return "fagen::algo::AttentionMask<kMask>"

    @property
    def variant(self) -> str:
        """The mask and score modifiers, as the key spells them (e.g. local+softcap)."""
        return contract.variant_name(self.mask_name, self.score)
