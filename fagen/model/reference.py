"""The spec-file reference, written from the models themselves: every field of a spec file and of
each algorithm's kernel entries (type, default, what it means), and what each algorithm takes
(targets, masks, head dims). `fagen spec-reference` prints it; docs/spec-reference.md is its
output, which tests/unit/test_spec_reference.py holds equal to it, so it cannot go stale."""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .. import contract
from .algorithms import SPEC_CLASSES
from .base import KernelSpec
from .specfile import SpecFile

REFERENCE_PATH = "docs/spec-reference.md"
# The head dims a reference lists: every size the contract allows.
_HEAD_DIMS = range(contract.HEAD_DIM_MULTIPLE, contract.MAX_HEAD_DIM + 1, contract.HEAD_DIM_MULTIPLE)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if origin is tuple and typing.get_args(annotation)[1:] == (Ellipsis,):
        # A set of options, written as a key spells them (KernelSpec.score: softcap+sinks).
        return f"`none`, or of {_type_name(typing.get_args(annotation)[0])} joined by `+`"
    if origin is not None:
        args = ", ".join(_type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{member.value}`" for member in annotation)
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null (omit)"
    if value == "":
        return '`""`'
    if value == ():
        return "`none`"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _field_rows(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        meaning = " ".join((field.description or "").split()) or "—"
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {meaning} |")
    return rows


def _ranges(values: list[int], step: int) -> str:
    """16, 32, 48, 96 with step 16 -> "16-48, 96"."""
    if not values:
        return "none"
    runs, start, last = [], values[0], values[0]
    for value in values[1:]:
        if value != last + step:
            runs.append((start, last))
            start = value
        last = value
    runs.append((start, last))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _algorithm_section(spec: type[KernelSpec]) -> list[str]:
    tile = spec.model_fields["tile"].annotation
    head_dims = [d for d in _HEAD_DIMS if spec.head_dim_problem(d) is None]
    step = sorted({b - a for a, b in zip(head_dims, head_dims[1:])} or {contract.HEAD_DIM_MULTIPLE})[0]
    lines = [
        f"### fa_version: {spec.FA_VERSION}, direction: {spec.DIRECTION}",
        "",
        f"- `arch`: {', '.join(f'`{a.value}`' for a in spec.ARCHS)} ({spec.WHY_ARCHS})",
        f"- `mask`: {', '.join(f'`{m}`' for m in spec.MASKS)}"
        + (f" ({spec.WHY_MASKS})" if spec.WHY_MASKS else ""),
        f"- `score`: {', '.join(f'`{m}`' for m in spec.SCORE_MODS) or 'none'}"
        + (f" ({spec.WHY_SCORE_MODS})" if spec.WHY_SCORE_MODS else ""),
        f"- `head_dim`: {_ranges(head_dims, step)}, multiples of {step}",
        f"- `tile` ({tile.__name__}; `auto` or omitted: the tuning table's choice):",
        "",
        *_field_rows(tile),
    ]
    if tile.STRUCTURE:
        lines += ["", "Structure (every kernel has it; accepted in a spec only with this value): "
                  + ", ".join(f"`{k}: {str(v).lower() if isinstance(v, bool) else v}`"
                              for k, v in tile.STRUCTURE.items())]
    return lines + [""]


def render_reference() -> str:
    lines = [
        "# Spec file reference",
        "",
        "Generated from fagen's spec models by `fagen spec-reference` (tests/unit/test_spec_reference.py",
        "checks that this page is its output). A spec file is YAML: the fields below, and under",
        "`kernels:` a list of entries whose fields may be lists, which expand to their product",
        "(a combination an algorithm refuses is skipped with its reason; an entry without lists",
        "must be valid).",
        "",
        "## The file",
        "",
        *_field_rows(SpecFile),
        "",
        "## Every kernel entry",
        "",
        *_field_rows(KernelSpec, skip=("tile",)),
        "| `causal` | bool | — | shorthand: `true` is `mask: causal`, `false` is `mask: full` |",
        "| `tile` | the algorithm's tile, below | `auto` | `auto` (or omitted): the tuning table's "
        "tile for the target, head dim and mask, plus its kernels for short sequences |",
        "",
        "## Per algorithm",
        "",
        "`fa_version` and `direction` pick the algorithm; what each takes:",
        "",
    ]
    for spec in SPEC_CLASSES:
        lines += _algorithm_section(spec)
    return "\n".join(lines).rstrip() + "\n"
