"""docs/spec-reference.md is `fagen spec-reference`'s output: the page follows the models."""

from __future__ import annotations

from pathlib import Path

from fagen.model.reference import REFERENCE_PATH, render_reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_page_is_the_models_output():
    page = (ROOT / REFERENCE_PATH).read_text()
    assert page == render_reference(), (
        f"{REFERENCE_PATH} is stale: regenerate it with `fagen spec-reference > {REFERENCE_PATH}`")


def test_the_reference_names_every_field_and_algorithm():
    from fagen.model import KernelSpec
    from fagen.model.algorithms import SPEC_CLASSES

    page = render_reference()
    for name in KernelSpec.model_fields:
        assert f"| `{name}` |" in page
    for spec in SPEC_CLASSES:
        assert f"### fa_version: {spec.FA_VERSION}, direction: {spec.DIRECTION}" in page
        for name in spec.model_fields["tile"].annotation.model_fields:
            assert f"| `{name}` |" in page
