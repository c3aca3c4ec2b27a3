"""Rendering is deterministic and leaves no Jinja behind."""

from __future__ import annotations

import json

import pytest

from fagen.codegen import render
from fagen.model import KernelSpec

SPECS = [
    KernelSpec.model_validate({"fa_version": version, "arch": arch, "dtype": dtype,
                               "head_dim": head_dim, "causal": causal})
    for version, arch, dtype, head_dim, causal in (
        (2, "sm90", "bf16", 64, False), (2, "sm80", "fp16", 128, True), (2, "sm86", "bf16", 256, True),
        (1, "sm90", "bf16", 128, True), (3, "sm90a", "fp16", 64, False), (4, "sm100a", "bf16", 128, True))
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_render_is_byte_identical_twice(spec):
    assert render(spec).source == render(spec).source


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_no_jinja_markers_remain(spec):
    source = render(spec).source
    for marker in ("{{", "{%", "{#", "%}", "#}"):
        assert marker not in source


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_banner_holds_spec_json_and_symbol(spec):
    source = render(spec).source
    banner = source[: source.index("#include")]
    assert json.dumps(spec.model_dump(mode="json"), sort_keys=True) in banner
    assert spec.name in banner
    assert f"\n{spec.name}(" in source or f" {spec.name}(" in source


def test_variants_render_differently():
    sources = {render(s).source for s in SPECS}
    assert len(sources) == len(SPECS)
