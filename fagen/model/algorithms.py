"""The algorithms with a template: one spec class each (a union discriminated by fa_version and
direction), and how a field dict finds its class."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag, TypeAdapter, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from .. import contract
from .base import KernelSpec
from .fa1 import Fa1ForwardSpec
from .fa2 import Fa2ForwardSpec
from .fa2_bwd import Fa2BackwardSpec
from .fa2_split_kv import Fa2SplitKvSpec
from .fa3 import Fa3ForwardSpec
from .fa3_bwd import Fa3BackwardSpec
from .fa4 import Fa4ForwardSpec
from .fa4_bwd import Fa4BackwardSpec

SPEC_CLASSES: tuple[type[KernelSpec], ...] = (
    Fa1ForwardSpec, Fa2ForwardSpec, Fa3ForwardSpec, Fa4ForwardSpec, Fa2BackwardSpec,
    Fa3BackwardSpec, Fa4BackwardSpec, Fa2SplitKvSpec)
ALGORITHMS: dict[tuple[int, str, str], type[KernelSpec]] = {
    (c.FA_VERSION, c.DIRECTION, layout): c for c in SPEC_CLASSES for layout in c.LAYOUTS}
_DENSE = contract.LAYOUTS[0]


def _tag(fa_version: Any, direction: Any, layout: Any = _DENSE) -> str:
    return f"fa{fa_version}-{direction}" + ("" if layout == _DENSE else f"-{layout}")


def _discriminate(value: Any) -> str | None:
    """The tag of the class a value asks for: its first layout's (a class may take several)."""
    if isinstance(value, dict):
        asked = (value.get("fa_version"), value.get("direction", "fwd"), value.get("layout", _DENSE))
    else:
        asked = (getattr(value, "fa_version", None), getattr(value, "direction", None),
                 getattr(value, "layout", _DENSE))
    found = ALGORITHMS.get(asked) if not isinstance(asked[0], bool) else None
    return _tag(*asked) if found is None else _tag(found.FA_VERSION, found.DIRECTION, found.LAYOUTS[0])


def available() -> str:
    return ", ".join(f"fa{v} {d}" + ("" if layout == _DENSE else f" {layout}")
                     for (v, d, layout) in ALGORITHMS)


# The union itself, for pydantic models that hold a spec (SPEC_ADAPTER validates one alone).
AnyKernelSpec = Annotated[
    Union[tuple(Annotated[c, Tag(_tag(c.FA_VERSION, c.DIRECTION, c.LAYOUTS[0]))] for c in SPEC_CLASSES)],
    Discriminator(_discriminate, custom_error_type="algorithm",
                  custom_error_message=f"no algorithm with this fa_version and direction "
                  f"(available: {available()})"),
]
SPEC_ADAPTER: TypeAdapter = TypeAdapter(AnyKernelSpec)


def algorithm_for(fa_version: int, direction: str, layout: str = _DENSE) -> type[KernelSpec] | None:
    return ALGORITHMS.get((fa_version, direction, layout))


def _error(message: str, loc: tuple, value: Any) -> ValidationError:
    return ValidationError.from_exception_data("KernelSpec", [InitErrorDetails(
        type=PydanticCustomError("algorithm", message), loc=loc, input=value)])


def spec_class(fields: Any) -> type[KernelSpec]:
    """The spec class `fields` (a dict, or a spec) asks for by fa_version and direction; raises a
    ValidationError naming what exists when none does."""
    if isinstance(fields, KernelSpec):
        return type(fields)
    if not isinstance(fields, dict):
        raise _error(f"a kernel spec is a mapping of fields, got {type(fields).__name__}", (), fields)
    version, direction = fields.get("fa_version"), fields.get("direction", "fwd")
    layout = fields.get("layout", _DENSE)
    found = None if isinstance(version, bool) else ALGORITHMS.get((version, direction, layout))
    if found is None:
        asked = (f"fa_version={version!r}" + ("" if direction == "fwd" else f" direction={direction}")
                 + ("" if layout == _DENSE else f" layout={layout}"))
        raise _error(f"{asked}: fagen has no kernel template for it (available: {available()})",
                     (), version)
    return found
