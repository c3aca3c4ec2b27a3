"""The paged layout's cubin builds with its entry points: no GPU (tests/gpu/test_kvcache.py and
tests/gpu/test_merge_kernel.py run them)."""

from __future__ import annotations

from fagen.build import build_bundle
from fagen.bundle.format import read_manifest
from fagen.model.specfile import Expansion


def test_a_paged_kernel_carries_its_append_combine_and_merge_entry_points(tmp_path, kernel_cache):
    """The paged layout's cubin holds the split-KV kernel and the three entry points beside it
    (fagen/contract.py: SPLIT_*_SUFFIX), each without spills; FagenMergeParams' offsets are
    asserted in the source as FagenFwdParams' are."""
    import subprocess

    from fagen import contract
    from fagen.compiler.sass import cuobjdump_path
    from fagen.model import KernelSpec

    spec = KernelSpec.model_validate(dict(fa_version=2, arch="sm80", dtype="fp16", head_dim=64, layout="paged",
                                          mask="local"))
    build_bundle(Expansion(bundle="paged", specs=[spec]), tmp_path / "b", jobs=1, cache_dir=kernel_cache)
    (entry,) = read_manifest(tmp_path / "b").kernels
    assert "__builtin_offsetof(FagenMergeParams, head_dim)" in (tmp_path / "b" / entry.source).read_text()
    usage = subprocess.run([str(cuobjdump_path()), "-res-usage", str(tmp_path / "b" / entry.cubin)],
                           capture_output=True, text=True, check=True).stdout
    functions = {line.split("Function ")[1].rstrip(":") for line in usage.splitlines() if "Function " in line}
    suffixes = ("", contract.SPLIT_APPEND_SUFFIX, contract.SPLIT_COMBINE_SUFFIX, contract.SPLIT_MERGE_SUFFIX)
    assert functions == {entry.name + suffix for suffix in suffixes}
    assert "LOCAL:0" in usage and all(f"LOCAL:{n}" not in usage for n in range(1, 10))
