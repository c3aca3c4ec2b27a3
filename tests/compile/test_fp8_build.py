"""The FP8 forward's cubin builds with its V^T companion: no GPU (tests/gpu/test_fp8.py and
tests/gpu/test_ptx_probes.py run them)."""

from __future__ import annotations

import subprocess

from fagen import contract
from fagen.build import build_bundle
from fagen.bundle.format import read_manifest
from fagen.compiler.sass import cuobjdump_path
from fagen.model import KernelSpec
from fagen.model.specfile import Expansion


def test_an_e4m3_forward_carries_its_vt_companion(tmp_path, kernel_cache):
    """An e4m3 FA3 forward's cubin holds the forward and <name>_vt (fagen/contract.py:
    E4M3_VT_SUFFIX), neither spilling; the companion turns its blocks around in registers (no
    shared memory tile) and is built for vt_threads(head_dim_v) threads; the forward reads V^T tiles
    with TMA and wgmma on e4m3 (QGMMA) and holds no transposing code (no STSM)."""
    spec = KernelSpec.model_validate(dict(fa_version=3, arch="sm90a", dtype="e4m3", head_dim=256, causal=True))
    build_bundle(Expansion(bundle="fp8", specs=[spec]), tmp_path / "b", jobs=1, cache_dir=kernel_cache)
    (entry,) = read_manifest(tmp_path / "b").kernels
    cubin = str(tmp_path / "b" / entry.cubin)
    usage = subprocess.run([str(cuobjdump_path()), "-res-usage", cubin], capture_output=True, text=True,
                           check=True).stdout
    functions = {line.split("Function ")[1].rstrip(":"): next_line
                 for line, next_line in zip(usage.splitlines(), usage.splitlines()[1:]) if "Function " in line}
    assert set(functions) == {entry.name, entry.name + contract.E4M3_VT_SUFFIX}
    assert all("LOCAL:0" in line for line in functions.values())
    # No shared tile: what it reports is the module's 1024-byte alignment of the forward's window.
    shared = int(functions[entry.name + contract.E4M3_VT_SUFFIX].split("SHARED:")[1].split()[0])
    assert shared <= 1024
    source = (tmp_path / "b" / entry.source).read_text()
    assert f"kVtThreads = {contract.vt_threads(256)}" in source
    sass = subprocess.run([str(cuobjdump_path()), "-sass", "-fun", entry.name, cubin], capture_output=True,
                          text=True, check=True).stdout
    assert "QGMMA" in sass and "UTMALDG" in sass and "STSM" not in sass
