"""Rendering is deterministic and leaves no Jinja behind."""

from __future__ import annotations

import json

import pytest

from fagen.codegen import render
from fagen.spec import KernelSpec

SPECS = [
    KernelSpec(fa_version=2, arch="sm90", dtype="bf16", head_dim=64, causal=False),
    KernelSpec(fa_version=2, arch="sm80", dtype="fp16", head_dim=128, causal=True),
    KernelSpec(fa_version=2, arch="sm86", dtype="bf16", head_dim=256, causal=True),
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
