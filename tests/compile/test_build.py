"""Building bundles on the CPU: NVRTC, SASS checks, manifest, cache, integrity, CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from rich.console import Console

from bundle_variants import copy_bundle, tamper_cubin
from fagen import abi, paths
from fagen.bundle import format as bundle_format
from fagen.bundle.format import BundleError, read_manifest, read_verified_cubin
from fagen.build import build_bundle
from fagen.cli import main
from fagen.codegen import RenderedKernel
from fagen.compiler import CompileError
from fagen.compiler.sass import disassemble
from fagen.model import KernelSpec, algorithm_for, load_spec_file
from fagen.model.specfile import Expansion

JOBS = os.cpu_count() or 1


def test_every_kernel_has_its_algorithms_sass_and_no_local_memory(ci_small):
    out, report = ci_small
    for entry in report.manifest.kernels:
        required = KernelSpec.model_validate(entry.spec).required_sass
        assert set(required) <= set(entry.sass), entry.name
        assert not {"LDL", "STL"} & set(entry.sass), entry.name


def test_no_spills_and_sane_resources(ci_small):
    _, report = ci_small
    for entry in report.manifest.kernels:
        assert entry.resources.spill_bytes == 0, entry.name
        assert 0 < entry.resources.registers <= 255, entry.name
        assert entry.size > 0


def test_bundle_layout(ci_small):
    out, report = ci_small
    for entry in report.manifest.kernels:
        assert (out / entry.cubin).is_file() and (out / entry.source).is_file()
        assert entry.cubin == f"cubin/{entry.arch}/{entry.name}.cubin"
        assert read_verified_cubin(out, entry)
    assert (out / "include/fagen/params.h").read_bytes() == (
        paths.include_dir() / "fagen/params.h").read_bytes()


def test_manifest_round_trips(ci_small):
    out, _ = ci_small
    text = (out / "manifest.json").read_text()
    assert read_manifest(out).to_json() == text


def test_manifest_records_versions_and_toolchain(ci_small):
    _, report = ci_small
    m = report.manifest
    assert m.abi_version == abi.ABI_VERSION
    assert m.schema_version == bundle_format.SCHEMA_VERSION
    assert {"nvrtc", "cuda-bindings", "jinja2", "python"} <= set(m.toolchain)
    assert len(m.fingerprint) == 64


def test_c_index_mirrors_the_manifest(ci_small):
    out, report = ci_small
    header = (out / "include/fagen/index.h").read_text()
    assert f"#define FAGEN_KERNEL_COUNT {len(report.manifest.kernels)}" in header
    for entry in report.manifest.kernels:
        assert f'"{entry.name}"' in header and f'"{entry.sha256}"' in header


def test_rebuild_is_a_cache_hit_with_identical_output(ci_small, kernel_cache, tmp_path):
    out, first = ci_small
    assert first.compiled == len(first.kernels)
    again = build_bundle(load_spec_file(paths.specs_dir() / "ci-small.yaml"), tmp_path / "b",
                         jobs=JOBS, cache_dir=kernel_cache)
    assert again.compiled == 0 and all(k.cached for k in again.kernels)
    assert (tmp_path / "b/manifest.json").read_text() == (out / "manifest.json").read_text()


def test_rebuild_in_place_replaces_the_bundle(ci_small, kernel_cache, tmp_path):
    out = tmp_path / "bundle"
    shutil.copytree(ci_small[0], out)
    (out / "stale.txt").write_text("left over from an older build")
    build_bundle(load_spec_file(paths.specs_dir() / "ci-small.yaml"), out, jobs=JOBS,
                 cache_dir=kernel_cache)
    assert not (out / "stale.txt").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".bundle.")
                and not p.name.endswith(".lock")]


def test_tampered_cubin_is_refused(ci_small, tmp_path):
    out = copy_bundle(ci_small[0], tmp_path / "bundle")
    tamper_cubin(out)
    entry = read_manifest(out).kernels[0]
    with pytest.raises(BundleError, match="checksum mismatch"):
        read_verified_cubin(out, entry)


def _edit_manifest(src, dst, **changes):
    shutil.copytree(src, dst)
    d = json.loads((dst / "manifest.json").read_text())
    d.update(changes)
    (dst / "manifest.json").write_text(json.dumps(d))


def test_wrong_abi_version_is_refused_naming_both(ci_small, tmp_path):
    _edit_manifest(ci_small[0], tmp_path / "b", abi_version=abi.ABI_VERSION + 7)
    with pytest.raises(BundleError) as info:
        read_manifest(tmp_path / "b")
    assert str(abi.ABI_VERSION + 7) in str(info.value) and str(abi.ABI_VERSION) in str(info.value)


def test_newer_schema_is_refused(ci_small, tmp_path):
    newer = bundle_format.SCHEMA_VERSION + 1
    _edit_manifest(ci_small[0], tmp_path / "b", schema_version=newer)
    with pytest.raises(BundleError, match=f"schema_version {newer} is newer"):
        read_manifest(tmp_path / "b")


def test_failed_compile_keeps_source_and_old_bundle(ci_small, kernel_cache, tmp_path, monkeypatch):
    out = tmp_path / "bundle"
    shutil.copytree(ci_small[0], out)
    before = (out / "manifest.json").read_text()

    def broken(spec):
        return RenderedKernel(spec, spec.name, "extern \"C\" __global__ void f() { nope; }\n", "x")

    monkeypatch.setattr("fagen.build.render", broken)
    with pytest.raises(CompileError) as info:
        build_bundle(load_spec_file(paths.specs_dir() / "ci-small.yaml"), out, jobs=JOBS,
                     cache_dir=kernel_cache)
    assert "nope" in info.value.log_excerpt()
    assert info.value.source_path.is_file()
    assert info.value.source_path.is_relative_to(tmp_path / "bundle.failed")
    assert (out / "manifest.json").read_text() == before


def test_refuses_to_replace_a_directory_that_is_not_a_bundle(tmp_path, kernel_cache):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a fagen bundle"):
        build_bundle(load_spec_file(paths.specs_dir() / "ci-small.yaml"), tmp_path, jobs=1,
                     cache_dir=kernel_cache)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_cli_build_and_list(ci_small, kernel_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAGEN_CACHE", str(kernel_cache))
    monkeypatch.setattr("fagen.cli.output.out", Console(width=250))
    out = tmp_path / "cli"
    assert main(["build", str(paths.specs_dir() / "ci-small.yaml"), "-o", str(out), "-j", "1"]) == 0
    assert "cached" in capsys.readouterr().out
    assert main(["list", str(out)]) == 0
    listed = capsys.readouterr().out
    assert all(e.key in listed for e in read_manifest(out).kernels)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("bundle: b\nkernels:\n  - {fa_version: 2, arch: sm90a, dtype: fp16, head_dim: 64}\n")
    assert main(["build", str(bad), "-o", str(tmp_path / "out")]) == 1
    assert main(["list", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "arch=sm90a" in err and "Traceback" not in err


@pytest.mark.parametrize("spec_path", sorted(paths.specs_dir().glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_spec_builds(spec_path, kernel_cache, tmp_path):
    expansion = load_spec_file(spec_path)
    report = build_bundle(expansion, tmp_path / expansion.bundle, jobs=JOBS, cache_dir=kernel_cache)
    assert len(report.manifest.kernels) == len(expansion.specs)
    assert all(e.resources.spill_bytes == 0 for e in report.manifest.kernels)


def _exp2_between_mma_waits(sass: str) -> list[int]:
    """For each `wait_group 1` -> `wait_group 0` stretch of the SASS, the MUFU.EX2 inside it."""
    counts, inside = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            inside = 0
        elif inside is not None and "MUFU.EX2" in line:
            inside += 1
        elif inside is not None and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            counts.append(inside)
            inside = None
    return counts


def _main_loop(sass: str) -> list[str]:
    """The body of the shortest backward branch that issues a whole block of wgmma (Q K^T and
    P V, 12 or more HGMMA): an FA3 kernel's main loop."""
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    best: list[str] = []
    for index, line in enumerate(lines):
        target = re.search(r"BRA (0x[0-9a-f]+)", line)
        if target and int(target.group(1), 16) // 16 < index:
            body = lines[int(target.group(1), 16) // 16: index + 1]
            if sum("HGMMA" in op for op in body) >= 12 and (not best or len(body) < len(best)):
                best = body
    return best


def test_fa3_softmax_overlaps_the_previous_pv(kernel_cache, tmp_path):
    # Intra-warpgroup overlap only exists if ptxas leaves the softmax of block j between the
    # wait for Q K_j^T (wait_group 1) and the wait for P_{j-1} V_{j-1} (wait_group 0). ptxas
    # hoists the second wait to the top of its basic block; until the V wait moved in front of
    # it, every shipped FA3 kernel ran its whole softmax after it (0 exp2 in the stretch).
    expansion = load_spec_file(paths.specs_dir() / "hopper.yaml")
    bf16_fa3 = [s for s in expansion.specs if s.fa_version == 3 and s.dtype == "bf16"]
    report = build_bundle(Expansion("hopper-bf16", bf16_fa3), tmp_path / "hopper", jobs=JOBS,
                          cache_dir=kernel_cache)
    assert len(report.manifest.kernels) == len(bf16_fa3) >= 6
    # One cuobjdump process per cubin, JOBS at a time (the serial loop took ~5 s on 2 cores).
    with ThreadPoolExecutor(JOBS) as pool:
        listings = pool.map(lambda e: disassemble(read_verified_cubin(tmp_path / "hopper", e)),
                            report.manifest.kernels)
    for entry, sass in zip(report.manifest.kernels, listings):
        exp2_per_thread = entry.spec["tile"]["block_n"] // 2  # 64 x block_n scores, 128 threads
        stretches = sorted(_exp2_between_mma_waits(sass), reverse=True)
        # early_first_qk adds one stretch without a softmax: the epilogue, under the next
        # tile's first Q K^T, whose only exponentials are finalize()'s P_top (one per row, two
        # rows per thread; algo/online_softmax.cuh).
        if entry.spec["tile"].get("early_first_qk"):
            assert stretches[-1] <= 2, (entry.name, stretches)
            stretches = stretches[:-1]
        assert stretches and min(stretches) >= exp2_per_thread, (entry.name, stretches)
        # A masked score is a select of -inf: peel_masked_blocks leaves none in the main loop;
        # without it the loop carries the mask code (causal diagonal, seqlen_k bound).
        main_loop = _main_loop(sass)
        masks_in_loop = any("FSEL" in op and "-INF" in op for op in main_loop)
        assert masks_in_loop != bool(entry.spec["tile"].get("peel_masked_blocks")), entry.name
        # mma_row_sum: P V runs over head_dim + 8 columns and the softmax adds nothing up (the
        # only FADDs are the rescale's exponent m2_old - m2_new, one per row: two per thread);
        # the other kernels add each probability to their row sum (one FADD per score).
        head_dim = entry.spec["head_dim"]
        adds = sum(" FADD " in f" {op} " for op in main_loop)
        if entry.spec["tile"].get("mma_row_sum"):
            assert any(f"HGMMA.64x{head_dim + 8}x16" in op for op in main_loop), entry.name
            assert adds <= 2, (entry.name, adds)
        else:
            assert adds >= exp2_per_thread, (entry.name, adds)
