"""specs/blackwell.yaml (FA4, sm100a) builds on the CPU: tcgen05 SASS present, no spills, limits."""

from __future__ import annotations

import os

import pytest

from fagen import paths
from fagen.build import build_bundle
from fagen.model import algorithm_for, load_spec_file
from fagen.model.fa4 import TMEM_COLUMNS

JOBS = os.cpu_count() or 1
SM100_MAX_SMEM = 227 * 1024


@pytest.fixture(scope="session")
def blackwell(tmp_path_factory, kernel_cache):
    out = tmp_path_factory.mktemp("bundles") / "blackwell"
    expansion = load_spec_file(paths.specs_dir() / "blackwell.yaml")
    return expansion, build_bundle(expansion, out, jobs=JOBS, cache_dir=kernel_cache)


def test_covers_head_dims_masks_and_dtypes(blackwell):
    expansion, report = blackwell
    keys = {(e.spec["head_dim"], e.spec["causal"], e.spec["dtype"]) for e in report.manifest.kernels}
    assert {(d, c, "bf16") for d in (64, 128) for c in (False, True)} <= keys
    assert all(e.fa_version == 4 and e.arch == "sm100a" for e in report.manifest.kernels)
    variants = {(e.spec["head_dim"], tuple(e.spec.get("score", ()))) for e in report.manifest.kernels}
    assert {(128, ("softcap",)), (128, ("alibi",)), (64, ("sinks",))} <= variants


def test_sass_has_tcgen05_and_tma_and_no_local_memory(blackwell):
    _, report = blackwell
    for entry in report.manifest.kernels:
        required = algorithm_for(4, "fwd").REQUIRED_SASS
        assert {"UTCHMMA", "LDTM", "STTM", "UTCBAR", "UTMALDG", "USETMAXREG"} <= set(entry.sass)
        assert set(required) <= set(entry.sass), entry.name
        assert not {"LDL", "STL", "HGMMA", "HMMA"} & set(entry.sass), entry.name


def test_no_spills_and_limits(blackwell):
    _, report = blackwell
    for entry in report.manifest.kernels:
        assert entry.resources.spill_bytes == 0, entry.name
        assert 0 < entry.resources.registers <= 255, entry.name
        assert entry.launch.dynamic_smem <= SM100_MAX_SMEM, entry.name
        assert entry.launch.threads == 384 and entry.launch.tma_q_rows == 128


def test_tmem_allocation_fits(blackwell):
    expansion, _ = blackwell
    for spec in expansion.specs:
        g = spec.geometry
        assert g.tmem_columns_used <= g.tmem_columns <= TMEM_COLUMNS
        source = (paths.templates_dir() / "kernels" / "fa4_fwd_sm100.cu.j2").read_text()
        assert "kTmemColumns <= 512" in source
