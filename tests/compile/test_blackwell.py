"""specs/blackwell.yaml builds on the CPU: its FA4 kernels (sm100a) with tcgen05 SASS, no spills,
within the limits; its FA2 kernels for sm120 (RTX 50-series) and sm100a within those targets'
shared memory, a sample of them compiled (the whole spec: `fagen build specs/blackwell.yaml`)."""

from __future__ import annotations

import os

import pytest

from fagen import paths
from fagen.build import build_bundle
from fagen.model import algorithm_for, load_spec_file
from fagen.model.arch import ARCHS, Arch
from fagen.model.fa4 import TMEM_COLUMNS
from fagen.model.specfile import Expansion

JOBS = os.cpu_count() or 1
SM100_MAX_SMEM = 227 * 1024


@pytest.fixture(scope="session")
def blackwell_spec():
    return load_spec_file(paths.specs_dir() / "blackwell.yaml")


@pytest.fixture(scope="session")
def blackwell(blackwell_spec, tmp_path_factory, kernel_cache):
    """The spec's FA4 kernels, built."""
    out = tmp_path_factory.mktemp("bundles") / "blackwell"
    expansion = Expansion(bundle="blackwell-fa4", specs=[s for s in blackwell_spec.specs if s.fa_version == 4])
    return expansion, build_bundle(expansion, out, jobs=JOBS, cache_dir=kernel_cache)


def test_fa2_covers_sm120_and_fits_its_shared_memory(blackwell_spec):
    """FA2 for sm120 forward and backward at head dims 64/128/256 under every built-in mask, and
    its split-KV kernels; every FA2 tile within its target's shared memory (99 KB on sm120);
    nothing of the spec skipped."""
    fa2 = [s for s in blackwell_spec.specs if s.fa_version == 2]
    have = {(s.arch.value, s.direction, s.layout, s.head_dim, s.mask) for s in fa2}
    for direction in ("fwd", "bwd"):
        assert {("sm120", direction, "dense", d, m) for d in (64, 128, 256)
                for m in ("full", "causal", "local")} <= have
    assert {("sm120", "fwd", "paged", d, "local") for d in (64, 128, 256)} <= have
    assert {("sm100a", "fwd", "dense", 256, "local"), ("sm100a", "fwd", "paged", 128, "local")} <= have
    assert {("sm100a", "bwd", "dense", d, m) for d in (64, 128, 256) for m in ("full", "causal", "local")} <= have
    for spec in fa2:
        assert spec.geometry.smem_bytes <= ARCHS[spec.arch].max_smem_per_block, spec.name
    assert ARCHS[Arch.sm120].max_smem_per_block == 99 * 1024
    assert blackwell_spec.skipped == []


def test_fa2_sm120_sample_compiles_without_local_memory(blackwell_spec, tmp_path, kernel_cache):
    """One sm120 kernel of each kind (forward, backward, split-KV, varlen both ways; bf16, head dim
    128): mma.sync (HMMA) SASS, no local memory, registers and shared memory within sm120's limits."""
    sample = [s for s in blackwell_spec.specs if s.fa_version == 2 and s.arch == Arch.sm120 and s.dtype == "bf16"
              and s.head_dim == 128 and not s.score and s.mask == ("local" if s.layout == "paged" else "causal")]
    assert {(s.direction, s.layout) for s in sample} == {("fwd", "dense"), ("bwd", "dense"), ("fwd", "paged"),
                                                         ("fwd", "varlen"), ("bwd", "varlen")}
    report = build_bundle(Expansion(bundle="sm120", specs=sample), tmp_path / "b", jobs=JOBS, cache_dir=kernel_cache)
    for entry in report.manifest.kernels:
        assert entry.arch == "sm120" and tuple(entry.compute_capability) == (12, 0) and not entry.arch_specific
        assert "HMMA" in entry.sass and not {"LDL", "STL"} & set(entry.sass), entry.name
        assert entry.resources.spill_bytes == 0 and entry.resources.registers <= 255, entry.name
        assert entry.launch.dynamic_smem <= 99 * 1024, entry.name


def test_fa2_sm100a_backward_compiles_without_local_memory(blackwell_spec, tmp_path, kernel_cache):
    """FA2's backward for sm100a (bf16, head dim 128, causal): ptxas put the preprocess's
    accumulator in local memory there while it was indexed by a lane value (2026-12-04)."""
    sample = [s for s in blackwell_spec.specs if s.fa_version == 2 and s.arch == Arch.sm100a and s.direction == "bwd"
              and s.dtype == "bf16" and s.head_dim == 128 and s.mask == "causal" and not s.score]
    assert len(sample) == 1
    report = build_bundle(Expansion(bundle="sm100a-fa2-bwd", specs=sample), tmp_path / "b", jobs=JOBS,
                          cache_dir=kernel_cache)
    for entry in report.manifest.kernels:
        assert "HMMA" in entry.sass and not {"LDL", "STL"} & set(entry.sass), entry.name
        assert entry.resources.spill_bytes == 0, entry.name


def test_covers_head_dims_masks_and_dtypes(blackwell):
    expansion, report = blackwell
    forwards = [e for e in report.manifest.kernels if e.spec["direction"] == "fwd"]
    keys = {(e.spec["head_dim"], e.spec.get("mask", "causal" if e.spec.get("causal") else "full"), e.spec["dtype"])
            for e in forwards}
    assert {(d, m, t) for d in (64, 128) for m in ("full", "causal", "local") for t in ("bf16", "fp16")} <= keys
    assert {(256, m, t) for m in ("causal", "local") for t in ("bf16", "fp16")} <= keys
    assert all(e.fa_version == 4 and e.arch == "sm100a" for e in report.manifest.kernels)
    variants = {(e.spec["head_dim"], tuple(e.spec.get("score", ()))) for e in forwards}
    assert {(128, ("softcap",)), (128, ("alibi",)), (64, ("sinks",))} <= variants


def test_e4m3_forwards_as_on_hopper(blackwell):
    """FP8: FA4 e4m3 forwards at head dims 128 and 256 under the built-in masks (the default
    spec's FA3 set), each cubin with its V^T companion and a bf16 output."""
    expansion, report = blackwell
    have = {(s.head_dim, s.mask) for s in expansion.specs if s.dtype == "e4m3"}
    assert {(d, m) for d in (128, 256) for m in ("full", "causal", "local")} == have
    for spec in expansion.specs:
        if spec.dtype == "e4m3":
            assert spec.tile.rescale_threshold is None and spec.geometry.element_bytes == 1


def test_varlen_kernels_in_both_directions(blackwell):
    """FA4 takes packed variable-length batches (flash_attn_varlen_func) forward at head dims
    64/128/256 and backward at 64/128, full and causal, and Mistral's window at 128."""
    expansion, _ = blackwell
    have = {(s.direction, s.dtype, s.head_dim, s.mask) for s in expansion.specs if s.layout == "varlen"}
    for direction, head_dims in (("fwd", (64, 128, 256)), ("bwd", (64, 128))):
        assert {(direction, t, d, m) for t in ("bf16", "fp16") for d in head_dims for m in ("full", "causal")} <= have
        assert (direction, "bf16", 128, "local") in have


def test_backward_covers_head_dims_masks_and_dtypes(blackwell):
    """The FA4 backward: head dims 64 and 128, fp16 and bf16, every built-in mask, ALiBi and sinks."""
    expansion, _ = blackwell
    backward = [s for s in expansion.specs if s.direction == "bwd"]
    have = {(s.dtype, s.head_dim, s.mask, s.score) for s in backward}
    assert {(t, d, m, ()) for t in ("bf16", "fp16") for d in (64, 128) for m in ("full", "causal", "local")} <= have
    assert {("bf16", 128, "causal", ("alibi",)), ("bf16", 64, "causal", ("sinks",)), ("bf16", 64, "local", ("sinks",))} <= have


def test_sass_has_tcgen05_and_tma_and_no_local_memory(blackwell):
    _, report = blackwell
    for entry in report.manifest.kernels:
        required = set(algorithm_for(4, entry.spec["direction"]).REQUIRED_SASS)
        if entry.spec["dtype"] == "e4m3":  # kind::f8f6f4's MMA is UTCQMMA
            required = required - {"UTCHMMA"} | {"UTCQMMA"}
        assert required | {"LDTM", "STTM", "UTCBAR", "UTMALDG", "USETMAXREG"} <= set(entry.sass), entry.name
        # A backward's cubin holds its preprocess, whose D = rowsum(dO * O) is mma.sync (HMMA).
        forbidden = {"LDL", "STL", "HGMMA"} | ({"HMMA"} if entry.spec["direction"] == "fwd" else set())
        assert not forbidden & set(entry.sass), entry.name


def test_no_spills_and_limits(blackwell):
    _, report = blackwell
    for entry in report.manifest.kernels:
        assert entry.resources.spill_bytes == 0, entry.name
        assert 0 < entry.resources.registers <= 255, entry.name
        assert entry.launch.dynamic_smem <= SM100_MAX_SMEM, entry.name
        assert entry.launch.threads == 384
        # A Q tile per step: 128 rows, 64 in the backward at head dims 192 / 128 (its TMEM) and
        # with the softcap (its compute threads' registers).
        short = entry.spec["direction"] == "bwd" and (entry.spec["head_dim"] == 192 or "softcap" in entry.spec.get("score", ()))
        assert entry.launch.tma_q_rows == entry.launch.block_m == (64 if short else 128), entry.name


def test_tmem_allocation_fits(blackwell):
    expansion, _ = blackwell
    for spec in expansion.specs:
        g = spec.geometry
        assert g.tmem_columns_used <= g.tmem_columns <= TMEM_COLUMNS
        source = (paths.templates_dir() / "kernels" / "fa4_fwd_sm100.cu.j2").read_text()
        assert "kTmemColumns <= 512" in source
