"""The custom-mask example (examples/masks/document.yaml) builds ahead of time like the built-in
masks: a kernel of each algorithm that takes custom masks compiles without spills, carries the
user's header verbatim and is found by the mask's name. No GPU (tests/gpu/test_custom_mask.py
runs them)."""

from __future__ import annotations

import os

from fagen import paths
from fagen.build import build_bundle
from fagen.bundle.format import read_manifest
from fagen.model import load_spec_file
from fagen.model.specfile import Expansion


def test_the_document_mask_example_builds(tmp_path, kernel_cache):
    example = paths.specs_dir().parent / "examples" / "masks"
    expansion = load_spec_file(example / "document.yaml")
    # One kernel per algorithm that takes custom masks: FA3 forward, FA2 forward and backward.
    wanted = {"fa3_fwd_sm90a_bf16_hd64", "fa2_fwd_sm80_bf16_hd128", "fa2_bwd_sm90_bf16_hd128"}
    specs = [s for s in expansion.specs if "_".join(s.name.split("_")[:5]) in wanted]
    assert len(specs) == 3
    build_bundle(Expansion(bundle="document", specs=specs), tmp_path / "b", jobs=os.cpu_count() or 1,
                          cache_dir=kernel_cache)
    manifest = read_manifest(tmp_path / "b")
    assert sorted(e.key for e in manifest.kernels) == ["bwd/bf16/hd128/document", "fwd/bf16/hd128/document",
                                                       "fwd/bf16/hd64/document"]
    header = (example / "document.cuh").read_text()
    for entry in manifest.kernels:
        assert entry.resources.spill_bytes == 0
        assert header in (tmp_path / "b" / entry.source).read_text()
