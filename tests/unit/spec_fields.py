"""What the spec-model tests share: a KernelSpec from an algorithm's base fields plus overrides,
and the validation message of one the model refuses (pure Python)."""

from __future__ import annotations

import pydantic
import pytest

from fagen.model import KernelSpec


def spec_from(base: dict, **overrides) -> KernelSpec:
    return KernelSpec.model_validate({**base, **overrides})


def refusal_of(base: dict, **overrides) -> str:
    with pytest.raises(pydantic.ValidationError) as info:
        spec_from(base, **overrides)
    return str(info.value)
