"""fagen.hpp and examples/cpp without a GPU: the example builds with CMake against a fresh bundle
and runs end to end on a fake libcuda.so.1 (tests/compile/cpp/fake_libcuda.cpp); the header
refuses tampered and other-ABI bundles; its kernel selection matches the Python loader's; its
calls (the e4m3 ones with their descales too) launch with the parameters and TMA maps that
fagen.runtime.call.prepare builds for the same call, and refuse what it refuses.

cuda.h comes from the pip wheel nvidia-cuda-runtime (the `dev` extra) or a CUDA toolkit."""

from __future__ import annotations

import ctypes.util
import dataclasses
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bundle_variants import OTHER_ABI_VERSION, copy_bundle, set_abi_version, tamper_cubin
from fagen import abi, contract
from fagen.bundle.cindex import INDEX_HEADER, render_index_header
from fagen.bundle.format import MANIFEST_NAME, SCHEMA_VERSION, Manifest, sha256_bytes
from fagen.runtime import e4m3
from fagen.runtime.loader import KernelNotFound, select

REPO = Path(__file__).resolve().parents[2]
CPP_TESTS = Path(__file__).resolve().parent / "cpp"
CXX = shutil.which("g++") or shutil.which("c++")
CMAKE = shutil.which("cmake")
WARNINGS = ["-Wall", "-Wextra", "-Wpedantic", "-Werror"]

pytestmark = pytest.mark.skipif(
    CXX is None or CMAKE is None, reason="needs cmake and g++ (or c++) on PATH to build C++ consumers"
)


def cuda_include_dir() -> Path | None:
    """A directory with cuda.h and cudaTypedefs.h: the pip wheel's, else a toolkit's."""
    try:
        import nvidia
        candidates = [Path(p) / sub / "include" for p in nvidia.__path__ for sub in ("cu13", "cu12")]
    except ImportError:
        candidates = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda.h").is_file() and (c / "cudaTypedefs.h").is_file()), None)


@pytest.fixture(scope="module")
def cuda_include():
    found = cuda_include_dir()
    if found is None:
        pytest.skip("no cuda.h: `pip install nvidia-cuda-runtime` (dev extra) or install a CUDA toolkit")
    return found


def compile_program(source: Path, bundle_dir: Path, cuda_include: Path, out: Path, *flags: str):
    return subprocess.run(
        [CXX, "-std=c++17", *flags, f"-I{bundle_dir / 'include'}", f"-I{cuda_include}", str(source), "-o", str(out), "-ldl"],
        capture_output=True, text=True,
    )


@pytest.fixture(scope="module")
def open_bundle(ci_small, cuda_include, tmp_path_factory):
    """The open/verify test program, compiled against the ci-small bundle with -Werror."""
    out = tmp_path_factory.mktemp("open-bundle") / "open_bundle"
    built = compile_program(CPP_TESTS / "open_bundle.cpp", ci_small[0], cuda_include, out, "-O1", *WARNINGS)
    assert built.returncode == 0, built.stderr
    return out


@pytest.fixture(scope="module")
def example(ci_small, cuda_include, tmp_path_factory):
    """examples/cpp configured and built with CMake against the ci-small bundle."""
    build = tmp_path_factory.mktemp("example-build")
    configure = subprocess.run(
        [CMAKE, "-S", str(REPO / "examples" / "cpp"), "-B", str(build), f"-DFAGEN_BUNDLE_DIR={ci_small[0]}",
         f"-DFAGEN_CUDA_INCLUDE_DIR={cuda_include}", "-DCMAKE_BUILD_TYPE=Release"],
        capture_output=True, text=True,
    )
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run([CMAKE, "--build", str(build)], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert "warning" not in compiled.stdout + compiled.stderr
    return build / "fagen_attention"


@pytest.fixture(scope="module")
def fake_driver(ci_small, cuda_include, tmp_path_factory):
    """A directory holding the fake libcuda.so.1, for LD_LIBRARY_PATH."""
    directory = tmp_path_factory.mktemp("fake-driver")
    built = compile_program(CPP_TESTS / "fake_libcuda.cpp", ci_small[0], cuda_include, directory / "libcuda.so.1",
                            "-O2", "-shared", "-fPIC")
    assert built.returncode == 0, built.stderr
    return directory


def run(program: Path, *args: str, driver_dir: Path | None = None, cc: tuple[int, int] = (9, 0),
        record: bool = False):
    """`program` with `args`; on the fake driver in `driver_dir` (a device of compute capability
    `cc`), which with `record` prints the maps and launches it is asked for instead of running them."""
    env = {**os.environ, "FAKE_CC_MAJOR": str(cc[0]), "FAKE_CC_MINOR": str(cc[1])}
    if driver_dir is not None:
        env["LD_LIBRARY_PATH"] = str(driver_dir)
    if record:
        env["FAKE_RECORD"] = "1"
    return subprocess.run([str(program), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_example_does_not_link_libcuda(example):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf to list the example's shared-library dependencies")
    needed = subprocess.run([readelf, "-d", str(example)], capture_output=True, text=True, check=True).stdout
    assert "libcuda" not in needed


@pytest.mark.parametrize("cc, args", [
    ((9, 0), ["--causal"]),
    ((9, 0), ["--seqlen-q", "1", "--seqlen-k", "1000", "--heads-q", "3", "--heads-kv", "3"]),
    ((8, 6), ["--dtype", "fp16", "--head-dim", "128", "--causal", "--seqlen-q", "300", "--seqlen-k", "33"]),
], ids=["sm90-bf16-causal-gqa", "sm90-bf16-one-query", "sm86-fp16-causal-masked-rows"])
def test_example_runs_on_fake_driver(example, fake_driver, tmp_path, cc, args):
    result = run(example, *args, "--dump", tmp_path, driver_dir=fake_driver, cc=cc)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    problem = json.loads((tmp_path / "problem.json").read_text())
    q_elements = problem["batch"] * problem["seqlen_q"] * problem["heads_q"] * problem["head_dim"]
    assert (tmp_path / "q.bin").stat().st_size == 2 * q_elements
    assert (tmp_path / "out.bin").stat().st_size == 2 * q_elements
    assert (tmp_path / "lse.bin").stat().st_size == 4 * problem["batch"] * problem["heads_q"] * problem["seqlen_q"]


def test_example_names_what_the_bundle_holds(example, fake_driver):
    result = run(example, "--dtype", "bf16", driver_dir=fake_driver, cc=(8, 0))
    assert result.returncode == 2
    assert "no kernel for 'fwd/bf16/hd64/full' on a compute capability 8.0 device" in result.stderr
    assert "sm90 (fa2): fwd/bf16/hd64/full" in result.stderr and "fagen build" in result.stderr


def test_decode_example_names_the_paged_kernel(example, fake_driver):
    """fagen_decode_paged asks the bundle for the paged layout's kernel (ci-small has none)."""
    result = run(example.with_name("fagen_decode_paged"), driver_dir=fake_driver, cc=(9, 0))
    assert result.returncode == 2
    assert "no kernel for 'fwd/bf16/hd128/local/paged'" in result.stderr and "fagen build" in result.stderr


def test_example_without_driver(example, tmp_path):
    if ctypes.util.find_library("cuda"):
        pytest.skip("a real libcuda is installed here")
    result = run(example, driver_dir=tmp_path)
    assert result.returncode == 2
    assert "cannot load the CUDA driver libcuda.so.1" in result.stderr


def test_cpp_accepts_good_bundle(open_bundle, ci_small):
    result = run(open_bundle, ci_small[0])
    assert result.returncode == 0, result.stderr
    assert f"ok: {len(ci_small[1].manifest.kernels)} kernels verified" in result.stdout


def test_cpp_refuses_tampered_cubin(open_bundle, ci_small, tmp_path):
    tampered = copy_bundle(ci_small[0], tmp_path / "tampered")
    cubin = tamper_cubin(tampered)
    result = run(open_bundle, tampered)
    assert result.returncode == 1
    assert f"{cubin}: checksum mismatch" in result.stderr and "refusing to load it" in result.stderr


@pytest.mark.parametrize("bad", ("/etc/hostname", "../outside.cubin", "cubin/../../x.cubin"))
def test_cpp_refuses_paths_outside_the_bundle(open_bundle, ci_small, tmp_path, bad):
    # index.h (compiled in) and the directory's manifest agree on the bad path: only the path
    # rule stops it.
    edited = copy_bundle(ci_small[0], tmp_path / "edited")
    d = json.loads((edited / MANIFEST_NAME).read_text())
    d["kernels"][0]["cubin"] = bad
    manifest = Manifest.from_dict(d)
    (edited / MANIFEST_NAME).write_text(manifest.to_json())
    (edited / INDEX_HEADER).write_text(render_index_header(manifest))
    program = tmp_path / "open_edited"
    built = compile_program(CPP_TESTS / "open_bundle.cpp", edited, cuda_include_dir(), program, "-O1")
    assert built.returncode == 0, built.stderr
    result = run(program, edited)
    assert result.returncode == 1
    assert f"cubin '{bad}': not a normalised relative path" in result.stderr
    assert "bytes" not in result.stderr and "sha256" not in result.stderr


def test_cpp_refuses_a_cubin_linked_outside(open_bundle, ci_small, tmp_path):
    linked = copy_bundle(ci_small[0], tmp_path / "linked")
    cubin = linked / ci_small[1].manifest.kernels[0].cubin
    outside = tmp_path / "outside.cubin"
    cubin.rename(outside)
    cubin.symlink_to(outside)
    result = run(open_bundle, linked)
    assert result.returncode == 1
    assert "resolves outside the bundle" in result.stderr


@pytest.mark.parametrize("scale", ("default", "0.125", "0", "-0", "1e-45", "-0.5", "nan", "inf", "-inf", "1e38"))
@pytest.mark.parametrize("head_dim", (64, 96))
def test_cpp_scale_rule_matches_python(open_bundle, scale, head_dim):
    from fagen.contract import ScaleError, kernel_scale_log2

    value = None if scale == "default" else float(ctypes.c_float(float(scale)).value)
    try:
        expected = f"{ctypes.c_float(kernel_scale_log2(value, head_dim)).value:.9g}"
    except ScaleError as exc:
        expected = "error: " + str(exc).split(": ", 1)[1]
    result = run(open_bundle, "--scale", scale, head_dim)
    assert result.returncode == 0, result.stderr
    got = result.stdout.strip()
    if expected.startswith("error: "):
        assert got.startswith("error: fagen: softmax_scale=") and got.endswith(expected.removeprefix("error: "))
    else:
        assert got == expected


@pytest.mark.parametrize("scale", ("default", "0.125", "0", "-0.5"))
@pytest.mark.parametrize("softcap", ("0", "30", "50.5", "1e-3", "-1", "nan", "inf"))
def test_cpp_score_scale_rule_matches_python(open_bundle, scale, softcap):
    from fagen.contract import ScaleError, ScoreError, kernel_score_scale

    value = None if scale == "default" else float(ctypes.c_float(float(scale)).value)
    cap = float(ctypes.c_float(float(softcap)).value)
    try:
        if math.isnan(cap) or math.isinf(cap) or cap < 0:
            raise ScoreError(f"softcap={softcap}")
        found = kernel_score_scale(value, 128, cap)
        expected = " ".join(f"{ctypes.c_float(x).value:.9g}" for x in (found.scale_log2, found.softcap_scale))
    except (ScaleError, ScoreError):
        expected = "error"
    result = run(open_bundle, "--score-scale", scale, 128, softcap)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split(":")[0] == expected


@pytest.mark.parametrize("dtype", contract.DTYPES)
@pytest.mark.parametrize("data, strides, tma", [
    (4096, (8192, 64, 16), False), (0, (8, 8, 8), False), (4104, (8, 8, 8), False), (4096, (12, 8, 8), False),
    (4096, (-8, 8, 8), False), (4096, (0, 64, 8), False), (4096, (0, 64, 8), True), (4096, (64, 0, 8), True),
    (4096, (4096, 256, 128), True), (4096, (4096, 272, 16), True),
])
def test_cpp_tensor_rule_matches_python(open_bundle, data, strides, tma, dtype):
    from fagen.runtime.call import AttentionError, Tensor, _check_tensor

    try:
        _check_tensor("t", Tensor(data, *strides), tma, dtype)
        expected = "ok"
    except AttentionError as exc:
        expected = f"error: fagen: {exc}"
    result = run(open_bundle, "--tensor", data, *strides, int(tma), dtype)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


@pytest.mark.parametrize("dtype", contract.DTYPES)
def test_cpp_element_rules_match_python(open_bundle, dtype):
    """fagen.hpp's DType, by contract.h's tables: element bytes, the output's element, the stride
    multiple and the TMA box columns of contract.py."""
    result = run(open_bundle, "--dtype", dtype)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(contract.DTYPE_BYTES[dtype]), contract.output_dtype(dtype),
                                     str(contract.stride_multiple(dtype)), str(contract.tma_box_columns(dtype))]


@pytest.mark.parametrize("mask_mod", (None, "document"))
@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("direction", contract.DIRECTIONS)
@pytest.mark.parametrize("dtype", ("e4m3", "bf16"))
def test_cpp_e4m3_call_rule_matches_python(open_bundle, dtype, direction, layout, mask_mod):
    """Which calls an e4m3 kernel serves (fagen.runtime.e4m3.call_problem): the forward of the
    dense layout, without score modifiers or a custom mask; any call of another dtype."""
    for mods in ((), ("softcap",), ("alibi", "sinks"), contract.SCORE_MODS):
        found = e4m3.call_problem(direction, layout, mods, mask_mod) if dtype == "e4m3" else None
        expected = "ok" if found is None else f"error: fagen: {found}"
        flags = [30.0 if "softcap" in mods else 0.0, int("alibi" in mods), int("sinks" in mods)]
        result = run(open_bundle, "--e4m3-call", dtype, direction, layout, *flags, mask_mod or "-")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected, mods


DESCALES_CASES = {
    "none-bf16": ("bf16", e4m3.Descales()),
    "none-e4m3": ("e4m3", e4m3.Descales()),
    "per-kv-head": ("e4m3", e4m3.Descales(q=0x50000, k=0x50100, v=0x50200, q_batch_stride=2, q_head_stride=1,
                                          k_batch_stride=2, k_head_stride=1)),
    "one-of-three": ("e4m3", e4m3.Descales(v=0x50200)),
    "on-bf16": ("bf16", e4m3.Descales(v=0x50200)),
    "on-fp16-strides-only": ("fp16", e4m3.Descales(q_batch_stride=4)),
    "misaligned": ("e4m3", e4m3.Descales(q=0x50000, k=0x50102)),
    "negative-head-stride": ("e4m3", e4m3.Descales(v=0x50200, v_head_stride=-1)),
    "negative-batch-stride": ("e4m3", e4m3.Descales(q_batch_stride=-2)),
}


@pytest.mark.parametrize("dtype, descales", DESCALES_CASES.values(), ids=DESCALES_CASES.keys())
def test_cpp_descales_rule_matches_python(open_bundle, dtype, descales):
    found = e4m3.descales_problem(dtype, descales)
    result = run(open_bundle, "--descales", dtype, *(getattr(descales, f.name) for f in dataclasses.fields(descales)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("ok" if found is None else f"error: fagen: {found}")


@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("head_dim_v", (0, 96, 64))  # 0: the same as head_dim
@pytest.mark.parametrize("mods", ((), ("softcap",), ("alibi", "sinks"), contract.SCORE_MODS))
@pytest.mark.parametrize("mask", contract.MASKS)
def test_cpp_key_matches_python(open_bundle, mask, mods, head_dim_v, layout):
    flags = [int(mod in mods) for mod in contract.SCORE_MODS]
    result = run(open_bundle, "--key", "bwd", "bf16", 96, mask, *flags, head_dim_v, layout)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == contract.kernel_key("bwd", "bf16", 96, mask, mods, head_dim_v or None, layout)


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("window", ((-1, -1), (-1, 0), (0, 0), (5, -1), (-1, 7), (3, 4), (99, 2), (2, 99),
                                    (100, 100), (-2, 0), (0, -3)))
@pytest.mark.parametrize("seqlens", ((50, 99), (99, 50)))
def test_cpp_mask_rule_matches_python(open_bundle, causal, window, seqlens):
    from fagen.contract import MaskError, call_mask

    try:
        mask = call_mask(causal, window, *seqlens)
        expected = f"{mask.kind} {mask.window_left} {mask.window_right}"
    except MaskError as exc:
        expected = f"error: fagen: {exc}"
    result = run(open_bundle, "--mask", int(causal), *window, *seqlens)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


@pytest.mark.parametrize("grid", range(len(contract.GRIDS)))
def test_cpp_grid_rule_matches_python(open_bundle, grid):
    for block_m, block_n, seqlen_q, heads_q, batch, sms, seqlen_k, heads_kv in (
            (128, 128, 1, 1, 1, 132, 1, 1), (128, 176, 300, 4, 2, 132, 500, 1), (64, 64, 4097, 32, 3, 8, 999, 8),
            (192, 128, 16384, 16, 1, 132, 16384, 2), (64, 128, 100000, 64, 4, 108, 7, 1)):
        for num_splits in (1, 7):
            launch = contract.Launch(threads=128, block_m=block_m, dynamic_smem=0, grid=contract.GRIDS[grid],
                                     block_n=block_n)
            expected = launch.grid_dims(seqlen_q, heads_q, batch, sms, seqlen_k, heads_kv, num_splits)
            result = run(open_bundle, "--grid", grid, block_m, block_n, seqlen_q, heads_q, batch, sms, seqlen_k,
                         heads_kv, num_splits)
            assert result.returncode == 0, result.stderr
            assert tuple(int(x) for x in result.stdout.split()) == expected


@pytest.mark.parametrize("work", ((8, 65536, 132, 256), (16, 65536, 132, 256), (512, 4096, 132, 256),
                                  (100, 8192, 108, 256), (3, 100, 132, 256), (1, 1 << 20, 132, 64),
                                  (0, 10, 132, 256), (7, 3000, 1, 256)))
def test_cpp_split_rule_matches_python(open_bundle, work):
    ctas, keys, slots, min_keys = work
    for num_splits, batch, seqlen_q, heads_q, head_dim_v in ((1, 4, 1, 32, 128), (13, 3, 5, 8, 64)):
        w = contract.SplitWorkspace.of(num_splits, batch, seqlen_q, heads_q, head_dim_v)
        result = run(open_bundle, "--splits", *work, num_splits, batch, seqlen_q, heads_q, head_dim_v)
        assert result.returncode == 0, result.stderr
        assert tuple(int(x) for x in result.stdout.split()) == (
            contract.split_count(ctas, keys, slots, min_keys), w.o_partial, w.lse_partial, w.floats,
            *contract.companion_grid(batch, seqlen_q, heads_q))


@pytest.mark.parametrize("batch, seqlen_q, total_q", [
    (16, 1024, 16 * 1024), (4, 1024, 2152), (4, 1000, 3277), (4, 1000, 3199), (7, 4096, 9000), (1, 1, 1), (3, 5, 0)])
def test_cpp_varlen_walk_rule_matches_python(open_bundle, batch, seqlen_q, total_q):
    """varlen_walks_items (a varlen launch of mixed lengths gets a CTA per work item) in fagen.hpp
    as in fagen/runtime/call.py, at and around its 1.25x bound."""
    result = run(open_bundle, "--walk", batch, seqlen_q, total_q)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(int(contract.varlen_walks_items(batch, seqlen_q, total_q)))]


def test_cpp_cache_box_rule_matches_python(open_bundle):
    """cache_box_rows (keys per TMA box of a paged tile kernel's K/V tile) in fagen.hpp as in
    fagen/contract.py, for contiguous caches and pages smaller, equal and larger than tiles."""
    for page_size in (0, 16, 32, 48, 64, 80, 128, 176, 256, 512):
        for tile_rows in (64, 80, 128, 176):
            result = run(open_bundle, "--cache-box", page_size, tile_rows)
            assert result.returncode == 0, result.stderr
            assert result.stdout.split() == [str(contract.cache_box_rows(page_size, tile_rows))], (page_size, tile_rows)


@pytest.mark.parametrize("shape", ((1, 1, 128, 1), (2, 8, 128, 500), (3, 2, 256, 4097), (1, 16, 256, 16384),
                                   (5, 3, 128, 129)))
def test_cpp_vt_rules_match_python(open_bundle, shape):
    """An e4m3 forward's V^T (fagen/contract.py: vt_keys, vt_workspace_bytes) and its companion's
    grid and block (vt_grid, vt_threads) in fagen.hpp as in Python."""
    batch, heads_kv, head_dim_v, seqlen_k = shape
    result = run(open_bundle, "--vt", *shape)
    assert result.returncode == 0, result.stderr
    assert tuple(int(x) for x in result.stdout.split()) == (
        contract.vt_keys(seqlen_k), contract.vt_workspace_bytes(batch, heads_kv, head_dim_v, seqlen_k),
        *contract.vt_grid(seqlen_k, heads_kv, batch), contract.vt_threads(head_dim_v))
    assert contract.vt_keys(seqlen_k) % contract.VT_KEY_GROUP == 0 and contract.vt_keys(seqlen_k) - seqlen_k < 16


@pytest.mark.parametrize("shape", ((1, 1, 1, 64, 64), (2, 4, 300, 128, 64), (3, 7, 4097, 96, 128), (1, 64, 17, 256, 64)))
def test_cpp_workspace_rule_matches_python(open_bundle, shape):
    batch, heads_q, seqlen_q, head_dim, block_m = shape
    w = contract.BackwardWorkspace.of(batch, heads_q, seqlen_q, head_dim, block_m)
    result = run(open_bundle, "--workspace", *shape)
    assert result.returncode == 0, result.stderr
    assert tuple(int(x) for x in result.stdout.split()) == (
        w.dq_accum, w.softmax_d, w.lse_log2, w.sink_partials, w.floats, w.semaphores,
        *contract.bwd_row_grid(seqlen_q, heads_q, batch))


def test_cpp_refuses_other_abi(open_bundle, ci_small, tmp_path):
    other = copy_bundle(ci_small[0], tmp_path / "other-abi")
    set_abi_version(other)
    result = run(open_bundle, other)
    assert result.returncode == 1
    assert f"built for kernel ABI version {OTHER_ABI_VERSION}" in result.stderr
    assert f"compiled against ABI version {abi.ABI_VERSION}" in result.stderr


def test_cpp_refuses_newer_schema(open_bundle, ci_small, tmp_path):
    newer = copy_bundle(ci_small[0], tmp_path / "newer")
    index = newer / INDEX_HEADER
    current = f"#define FAGEN_BUNDLE_SCHEMA_VERSION {SCHEMA_VERSION}"
    assert current in index.read_text()
    index.write_text(index.read_text().replace(current, "#define FAGEN_BUNDLE_SCHEMA_VERSION 7"))
    result = run(open_bundle, newer)
    assert result.returncode == 1
    assert f"schema_version 7, newer than this fagen.hpp reads (up to {SCHEMA_VERSION})" in result.stderr


def test_cpp_refuses_a_bundle_it_was_not_compiled_against(open_bundle, ci_small, tmp_path):
    other = copy_bundle(ci_small[0], tmp_path / "other")
    d = json.loads((other / MANIFEST_NAME).read_text())
    d["bundle"] = "another-bundle"
    manifest = Manifest.from_dict(d)
    (other / MANIFEST_NAME).write_text(manifest.to_json())
    (other / INDEX_HEADER).write_text(render_index_header(manifest))
    result = run(open_bundle, other)
    assert result.returncode == 1
    assert "is not the bundle this program was compiled against" in result.stderr


def test_headers_mixing_two_abis_do_not_compile(ci_small, cuda_include, tmp_path):
    mixed = copy_bundle(ci_small[0], tmp_path / "mixed")
    set_abi_version(mixed)  # index.h says 99, params.h still 1
    built = compile_program(CPP_TESTS / "open_bundle.cpp", mixed, cuda_include, tmp_path / "open_bundle")
    assert built.returncode != 0
    assert "different kernel ABI versions" in built.stderr


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)], ids=lambda cc: f"cc{cc[0]}{cc[1]}")
def test_cpp_selection_matches_python(open_bundle, ci_small, cc):
    entries = ci_small[1].manifest.kernels
    assert any(e.max_seqlen_k for e in entries), "ci-small lost its seqlen-bounded kernel"
    for key in sorted({e.key for e in entries}):
        for seqlen_k in (None, 1, 512, 513):
            try:
                expected = select(entries, key, cc, seqlen_k).name
            except KernelNotFound:
                expected = "none"
            result = run(open_bundle, ci_small[0], key, *cc, *([] if seqlen_k is None else [seqlen_k]))
            assert result.returncode == 0, result.stderr
            assert result.stdout.strip() == expected, (key, cc, seqlen_k)


# ---------------------------------------------------------------------------- TMA maps

TMA_FIELDS = ("data_type", "rank", "address", "dims", "strides", "box", "element_strides", "interleave", "swizzle",
              "l2_promotion", "oob_fill")


@pytest.fixture
def recorded_tensor_maps(monkeypatch):
    """The arguments call.py's maps pass to cuTensorMapEncodeTiled, without a driver: the real
    fagen.runtime.driver.encode_tiled_tensor_map runs with cuTensorMapEncodeTiled replaced by a
    recorder (and the lru_cache of call._encode_tensor_map emptied around it). Yields the list
    the calls append to, as {field: value} in open_bundle --tma-maps's terms."""
    from fagen.runtime import call, driver

    calls = []
    blank = (ctypes.c_ubyte * driver.TENSOR_MAP_BYTES)()

    class FakeMap:
        def getPtr(self):
            return ctypes.addressof(blank)

    def encode(data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob):
        calls.append(dict(
            data_type=int(data_type), rank=int(rank), address=int(address), dims=tuple(int(d) for d in dims),
            strides=tuple(int(s) for s in strides), box=tuple(int(b) for b in box),
            element_strides=tuple(int(e) for e in element_strides), interleave=int(interleave),
            swizzle=int(swizzle), l2_promotion=int(l2), oob_fill=int(oob)))
        return driver.cu.CUresult.CUDA_SUCCESS, FakeMap()

    monkeypatch.setattr(driver, "_initialized", True)
    monkeypatch.setattr(driver.cu, "cuTensorMapEncodeTiled", encode)
    call._encode_tensor_map.cache_clear()
    yield calls
    call._encode_tensor_map.cache_clear()  # its maps are the recorder's blanks


def parse_tma_maps(stdout: str) -> dict[str, dict]:
    maps = {}
    for line in stdout.splitlines():
        name, *fields = line.split()
        values = dict(field.split("=", 1) for field in fields)
        maps[name] = {key: tuple(int(x) for x in value.split(",")) if "," in value else int(value)
                      for key, value in values.items()}
    return maps


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v (None: head_dim), tma_q_rows, tma_kv_rows)
TMA_PROBLEMS = {
    "mha-hd128": (2, 256, 256, 4, 4, 128, None, 128, 128),
    "gqa-odd-seqlens": (3, 301, 77, 8, 2, 64, None, 64, 176),
    "mqa-one-query": (1, 1, 1000, 6, 1, 128, None, 128, 112),
    "hd192-hdv128": (2, 333, 129, 16, 4, 192, 128, 128, 80),
    "hd192-hdv128-gqa-odd": (1, 17, 4097, 32, 8, 192, 128, 64, 128),
}


@pytest.mark.parametrize("layout", ("contiguous", "strided"))
@pytest.mark.parametrize("dtype, backward", [("bf16", False), ("bf16", True), ("fp16", False), ("fp16", True),
                                             ("e4m3", False)],  # e4m3: 1-byte elements, 128-column boxes
                         ids=("bf16-fwd", "bf16-bwd", "fp16-fwd", "fp16-bwd", "e4m3-fwd"))
@pytest.mark.parametrize("shape", TMA_PROBLEMS.values(), ids=TMA_PROBLEMS.keys())
def test_cpp_tma_maps_match_python(open_bundle, recorded_tensor_maps, shape, dtype, layout, backward):
    from fagen.runtime import call

    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, q_rows, kv_rows = shape
    problem = call.Problem(dtype, False, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v=head_dim_v)
    value_dim = problem.value_dim
    # (address, seqlen, heads, columns) of q, k, v, dout
    specs = {"q": (1 << 20, seqlen_q, heads_q, head_dim), "k": (2 << 20, seqlen_k, heads_kv, head_dim),
             "v": (3 << 20, seqlen_k, heads_kv, value_dim), "dout": (4 << 20, seqlen_q, heads_q, value_dim)}
    tensors, cli = {}, {}
    for i, (name, (address, seqlen, heads, columns)) in enumerate(specs.items()):
        address += 256 * i
        if layout == "contiguous":
            tensors[name] = call.Tensor.contiguous(address, seqlen, heads, columns)
            cli[name] = str(address)
        else:
            # heads outermost within a batch, rows padded, a gap between batches: strides that
            # differ from the contiguous ones in every position
            row = columns + 8 * (i + 1)
            head = row * (seqlen + 3)
            batch_stride = head * heads + 64
            tensors[name] = call.Tensor(address, batch_stride, row, head)
            cli[name] = f"{address}:{batch_stride}:{row}:{head}"
    dq_accum = 5 << 20
    launch = contract.Launch(threads=128, block_m=q_rows, dynamic_smem=0, tma_q_rows=q_rows, tma_kv_rows=kv_rows)
    if backward:
        t = tensors
        bwd = call.BackwardTensors(q=t["q"], k=t["k"], v=t["v"], out=t["dout"], dout=t["dout"], dq=t["q"],
                                   dk=t["k"], dv=t["v"], lse=6 << 20)
        call.bwd_tma_maps(problem, bwd, launch, dq_accum)
        names = ("q", "k", "v", "dout", "dq_accum")
        extra = [cli["dout"], dq_accum]
    else:
        # e4m3: the V map is over the V^T in the workspace, at open_bundle's kE4m3Workspace
        call.tma_maps(problem, tensors["q"], tensors["k"], tensors["v"], launch, workspace=9 << 20)
        names = ("q", "k", "v")
        extra = []
    assert len(recorded_tensor_maps) == len(names)
    expected = dict(zip(names, recorded_tensor_maps))

    result = run(open_bundle, "--tma-maps", dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                 head_dim_v or 0, q_rows, kv_rows, cli["q"], cli["k"], cli["v"], *extra)
    assert result.returncode == 0, result.stderr
    got = parse_tma_maps(result.stdout)
    assert list(got) == list(names)
    for name in names:
        assert set(got[name]) == set(TMA_FIELDS), name
        for field in TMA_FIELDS:
            assert got[name][field] == expected[name][field], (name, field)


@pytest.mark.parametrize("shape", ((1, 1, 1, 1, 64, 64), (3, 4, 769, 300, 128, 64), (7, 32, 5000, 4097, 256, 64)))
def test_cpp_varlen_workspace_rule_matches_python(open_bundle, shape):
    batch, heads_q, total_q, max_seqlen_q, head_dim, block_m = shape
    w = contract.BackwardWorkspace.varlen(batch, heads_q, total_q, max_seqlen_q, head_dim, block_m)
    result = run(open_bundle, "--workspace-varlen", *shape)
    assert result.returncode == 0, result.stderr
    assert tuple(int(x) for x in result.stdout.split()) == (
        w.dq_accum, w.softmax_d, w.lse_log2, w.sink_partials, w.floats, w.semaphores,
        contract.varlen_accum_rows(total_q, batch))


@pytest.mark.parametrize("backward", (False, True), ids=("fwd", "bwd"))
@pytest.mark.parametrize("totals", [(600, 900), (1, 5)], ids=["packed", "one-token"])
def test_cpp_varlen_tma_maps_match_python(open_bundle, recorded_tensor_maps, totals, backward):
    """A varlen call's maps span the packed rows as one batch row, in C++ as in Python."""
    from fagen.runtime import call

    total_q, total_k = totals
    batch, max_q, max_k, heads_q, heads_kv, head_dim = 3, min(300, total_q), min(400, total_k), 8, 2, 128
    problem = call.Problem("bf16", True, batch, max_q, max_k, heads_q, heads_kv, head_dim, layout="varlen")
    varlen = call.Varlen(4096, 4096, total_q, total_k)
    tensors = {"q": call.Tensor(1 << 20, 0, heads_q * head_dim, head_dim),
               "k": call.Tensor(2 << 20, 0, heads_kv * head_dim, head_dim),
               "v": call.Tensor(3 << 20, 0, heads_kv * head_dim, head_dim)}
    launch = contract.Launch(threads=128, block_m=128, dynamic_smem=0, tma_q_rows=128, tma_kv_rows=128)
    extra = []
    if backward:
        t = dict(tensors, dout=call.Tensor(4 << 20, 0, heads_q * head_dim, head_dim))
        bwd = call.BackwardTensors(q=t["q"], k=t["k"], v=t["v"], out=t["dout"], dout=t["dout"], dq=t["q"],
                                   dk=t["k"], dv=t["v"], lse=6 << 20)
        call.bwd_tma_maps(problem, bwd, launch, 5 << 20, varlen)
        names, extra = ("q", "k", "v", "dout", "dq_accum"), [4 << 20, 5 << 20]
    else:
        call.tma_maps(problem, tensors["q"], tensors["k"], tensors["v"], launch, varlen)
        names = ("q", "k", "v")
    expected = dict(zip(names, recorded_tensor_maps))
    result = run(open_bundle, "--varlen-tma-maps", "bf16", batch, max_q, max_k, heads_q, heads_kv, head_dim, 0, 128, 128,
                 1 << 20, 2 << 20, 3 << 20, total_q, total_k, *extra)
    assert result.returncode == 0, result.stderr
    got = parse_tma_maps(result.stdout)
    for name in expected:
        for field in TMA_FIELDS:
            assert got[name][field] == expected[name][field], (name, field)


def test_tma_map_enums_are_the_drivers(recorded_tensor_maps):
    """The integers both sides print are cuda.bindings' enums of what driver.py means to pass
    (so the parity test compares the right thing, not two equal mistakes)."""
    from fagen.runtime import call, driver

    cu = driver.cu
    problem = call.Problem("bf16", False, 1, 100, 100, 2, 2, 64)
    q = call.Tensor.contiguous(1 << 20, 100, 2, 64)
    call.tma_maps(problem, q, q, q, contract.Launch(threads=128, block_m=128, dynamic_smem=0, tma_q_rows=128,
                                                     tma_kv_rows=128))
    m = recorded_tensor_maps[0]
    assert m["data_type"] == int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    assert m["interleave"] == int(cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE)
    assert m["swizzle"] == int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
    assert m["l2_promotion"] == int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B)
    assert m["oob_fill"] == int(cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    assert (m["dims"], m["strides"], m["box"]) == ((64, 100, 2, 1), (256, 128, 25600), (64, 128, 1, 1))


# ---------------------------------------------------------------------------- calls: C++ vs Python

# FA3 forwards of e4m3 and bf16 with the default bundle's launch shapes (sm90a, persistent grid,
# TMA), added to ci-small with stand-in cubins: the fake libcuda runs or records their launches.
FA3_STAND_INS = {"fwd/e4m3/hd128/causal": (128, 128), "fwd/bf16/hd128/causal": (128, 176),
                 "fwd/bf16/hd128/local/paged": (128, 128)}  # key: TMA box rows
BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, HEAD_DIM = 2, 300, 500, 8, 2, 128
LSE, DESCALE, ARRAY = 6 << 20, 7 << 20, 8 << 20  # addresses of the LSE, fp32 descales, other fp32 arrays
WORKSPACE = 12 << 20  # an e4m3 forward's V^T


@pytest.fixture(scope="module")
def fa3_bundle(ci_small, tmp_path_factory):
    """ci-small plus the FA3_STAND_INS kernels (manifest, index.h and cubins consistent)."""
    bundle_dir = copy_bundle(ci_small[0], tmp_path_factory.mktemp("fa3") / "fa3")
    d = json.loads((bundle_dir / MANIFEST_NAME).read_text())
    template = next(k for k in d["kernels"] if k["arch"] == "sm90a")
    for key, (q_rows, kv_rows) in FA3_STAND_INS.items():
        name = "fa3_" + key.replace("/", "_") + "_stand_in"
        cubin, data = f"cubin/sm90a/{name}.cubin", f"stand-in cubin of {name}".encode()
        (bundle_dir / cubin).write_bytes(data)
        d["kernels"].append({
            **template, "name": name, "key": key, "cubin": cubin, "source": f"src/sm90a/{name}.cu",
            "sha256": sha256_bytes(data), "size": len(data), "max_seqlen_k": None,
            "launch": {"threads": 384, "block_m": 128, "dynamic_smem": 165032, "grid": "persistent",
                       "tma_q_rows": q_rows, "tma_kv_rows": kv_rows}})
    manifest = Manifest.from_dict(d)
    (bundle_dir / MANIFEST_NAME).write_text(manifest.to_json())
    (bundle_dir / INDEX_HEADER).write_text(render_index_header(manifest))
    return bundle_dir


@pytest.fixture(scope="module")
def fa3_programs(fa3_bundle, cuda_include, tmp_path_factory):
    """(open_bundle, fagen_attention, the fake driver's directory), built against fa3_bundle."""
    directory = tmp_path_factory.mktemp("fa3-programs")
    builds = [(CPP_TESTS / "open_bundle.cpp", directory / "open_bundle", ("-O1", *WARNINGS)),
              (REPO / "examples" / "cpp" / "attention.cpp", directory / "fagen_attention", ("-O2", *WARNINGS)),
              (CPP_TESTS / "fake_libcuda.cpp", directory / "libcuda.so.1", ("-O2", "-shared", "-fPIC"))]
    for source, out, flags in builds:
        built = compile_program(source, fa3_bundle, cuda_include, out, *flags)
        assert built.returncode == 0, built.stderr
    return directory / "open_bundle", directory / "fagen_attention", directory


@pytest.fixture
def python_calls(fa3_bundle, recorded_tensor_maps, monkeypatch):
    """fa3_bundle opened by fagen.runtime, whose prepare() runs without a driver: cubins are not
    handed to one, a device has the fake's 132 SMs, maps are recorded (recorded_tensor_maps)."""
    from fagen.runtime import driver, load

    monkeypatch.setattr(driver, "load_library", lambda image: None)
    monkeypatch.setattr(driver, "multiprocessor_count", lambda ordinal: 132)
    return load(fa3_bundle)


def padded(address: int, seqlen: int, heads: int, pad: int = 0):
    """A (batch, seqlen, heads, HEAD_DIM) tensor whose rows are `pad` elements apart (0: contiguous)."""
    from fagen.runtime.call import Tensor

    row = heads * HEAD_DIM + pad
    return Tensor(address, seqlen * row, row, HEAD_DIM)


def cli_call(problem, tensors: dict, descales=None, **fields) -> list[str]:
    """open_bundle --call's NAME=VALUE pairs for a call of `problem` on `tensors` (q, k, v, out;
    a contiguous one by its address alone, so fagen.hpp's default strides are the ones used)."""
    from fagen.runtime.call import Tensor

    shapes = {"q": (problem.seqlen_q, problem.heads_q), "k": (problem.seqlen_k, problem.heads_kv),
              "v": (problem.seqlen_k, problem.heads_kv), "out": (problem.seqlen_q, problem.heads_q)}
    pairs = {"dtype": problem.dtype, "causal": int(problem.causal), "batch": problem.batch,
             "seqlen_q": problem.seqlen_q, "seqlen_k": problem.seqlen_k, "heads_q": problem.heads_q,
             "heads_kv": problem.heads_kv, "head_dim": problem.head_dim, "lse": LSE}
    for name, t in tensors.items():
        contiguous = t == Tensor.contiguous(t.data, *shapes[name], problem.head_dim)
        pairs[name] = t.data if contiguous else f"{t.data}:{t.batch_stride}:{t.row_stride}:{t.head_stride}"
    for tensor in "qkv" if descales else "":
        address, batch_stride, head_stride = (getattr(descales, tensor + suffix)
                                              for suffix in ("", "_batch_stride", "_head_stride"))
        if address or batch_stride or head_stride:
            pairs[f"descale_{tensor}"] = f"{address}:{batch_stride}:{head_stride}"
    pairs.update(fields)
    return [f"{name}={value}" for name, value in pairs.items()]


def parse_record(stdout: str) -> tuple[list[dict], tuple, bytes | None, str]:
    """The fake driver's record (maps, launch grid, FagenFwdParams bytes) and the call's last line."""
    maps, grid, params = [], None, None
    lines = stdout.splitlines()
    for line in lines[:-1]:
        kind, *fields = line.split()
        values = dict(field.split("=", 1) for field in fields) if kind != "params" else {}
        if kind == "map":
            maps.append({key: tuple(int(x) for x in value.split(",")) if "," in value else int(value)
                         for key, value in values.items()})
        elif kind == "launch":
            grid = tuple(int(x) for x in values["grid"].split(","))
        elif kind == "params":
            params = bytes.fromhex(fields[0])
    return maps, grid, params, lines[-1] if lines else ""


def assert_launch_as_prepared(result, grid, expected, recorded_maps) -> list[dict]:
    """open_bundle --call's recorded launch is Python's prepared one: it succeeded with the same
    grid, FagenFwdParams field by field and TMA maps (q, k, v in order; none without TMA).
    Returns the maps."""
    assert result.returncode == 0, result.stderr
    maps, got_grid, params, last = parse_record(result.stdout)
    assert last == "ok"
    assert got_grid == grid
    got = abi.FwdParams.from_buffer_copy(params)
    for field, _ in abi.FwdParams._fields_:
        assert getattr(got, field) == getattr(expected, field), field
    assert maps == recorded_maps
    return maps


def forward_calls():
    """(problem, tensors, descales, compute capability) of the forward calls held to Python's."""
    from fagen.runtime.call import Problem, Tensor

    e4m3_problem = Problem("e4m3", True, BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, HEAD_DIM)
    contiguous = {"q": padded(1 << 20, SEQLEN_Q, HEADS_Q), "k": padded(2 << 20, SEQLEN_K, HEADS_KV),
                  "v": padded(3 << 20, SEQLEN_K, HEADS_KV), "out": padded(4 << 20, SEQLEN_Q, HEADS_Q)}
    # Strides of whole 16-byte vectors of each tensor's element (16 e4m3 ones, 8 of the bf16
    # output), none of them the contiguous ones.
    e4m3_strided = {"q": padded(1 << 20, SEQLEN_Q, HEADS_Q, 16), "k": padded(2 << 20, SEQLEN_K, HEADS_KV, 48),
                    "v": Tensor(3 << 20, SEQLEN_K * 512, 512, 256), "out": padded(4 << 20, SEQLEN_Q, HEADS_Q, 8)}
    bf16_strided = {**e4m3_strided, "q": padded(1 << 20, SEQLEN_Q, HEADS_Q, 8)}
    per_kv_head = e4m3.Descales(q=DESCALE, k=DESCALE + 64, v=DESCALE + 128, q_batch_stride=HEADS_KV, q_head_stride=1,
                                k_batch_stride=HEADS_KV, k_head_stride=1)
    return {
        "e4m3-descales-per-kv-head": (e4m3_problem, contiguous, per_kv_head, (9, 0)),
        "e4m3-without-descales": (e4m3_problem, contiguous, None, (9, 0)),
        "e4m3-strided-one-descale": (e4m3_problem, e4m3_strided, e4m3.Descales(v=DESCALE), (9, 0)),
        "bf16-fa3-strided": (dataclasses.replace(e4m3_problem, dtype="bf16"), bf16_strided, None, (9, 0)),
        "fp16-fa2": (dataclasses.replace(e4m3_problem, dtype="fp16"), contiguous, None, (8, 0)),
    }


@pytest.mark.parametrize("case", forward_calls())
def test_cpp_forward_launches_as_python_prepares(fa3_programs, python_calls, recorded_tensor_maps, case):
    """Bundle::attention and fagen.runtime.call.prepare on the same call: the same FagenFwdParams
    field by field (an e4m3 call's descales, its bf16 output's strides), grid and TMA maps (e4m3:
    UINT8 in boxes of 128 columns); fp16 and bf16 calls as before e4m3 existed."""
    from fagen.runtime import driver
    from fagen.runtime.call import prepare

    problem, tensors, descales, cc = forward_calls()[case]
    entry = python_calls.select(problem.key, cc, problem.seqlen_k)
    prepared = prepare(python_calls, problem, *tensors.values(), softmax_scale=0.1, entry=entry, descales=descales)
    expected = abi.FwdParams.from_buffer_copy(prepared.params)
    expected.o, expected.lse = tensors["out"].data, LSE  # what launch() adds
    fields = {"scale": 0.1}
    if prepared.vt is not None:  # e4m3: the maps over V^T in the workspace, made at launch
        assert prepared.workspace_bytes == contract.vt_workspace_bytes(BATCH, HEADS_KV, HEAD_DIM, SEQLEN_K)
        prepared.vt.maps(WORKSPACE)
        fields["workspace"] = WORKSPACE

    open_bundle, _, driver_dir = fa3_programs
    result = run(open_bundle, "--call", python_calls.path, "forward", *cli_call(problem, tensors, descales, **fields),
                 driver_dir=driver_dir, cc=cc, record=True)
    maps = assert_launch_as_prepared(result, prepared.grid, expected, recorded_tensor_maps)
    if problem.dtype == "e4m3":  # bytes, in boxes of 128 of them
        uint8 = int(driver.cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8)
        assert {m["data_type"] for m in maps} == {uint8} and {m["box"][0] for m in maps} == {128}


@pytest.mark.parametrize("page_size, packed", [(64, False), (256, False), (16, False), (0, False), (64, True)],
                         ids=["p64", "p256", "p16", "contiguous", "p64-packed-q"])
def test_cpp_kvcache_prefill_launches_as_python_prepares(fa3_programs, python_calls, recorded_tensor_maps,
                                                          page_size, packed):
    """Bundle::attention_kvcache and fagen.runtime.kvcache.prepare_kvcache on a prefill (300 new
    tokens a row): both on the paged tile kernel (FA3), with the same FagenFwdParams, grid and
    maps (K/V boxes of whole tiles, whole pages or 16 keys; packed q over its total rows)."""
    from fagen.runtime.call import Problem, Tensor
    from fagen.runtime.kvcache import KvCache, prepare_kvcache

    capacity, per_row = 1024, (1024 // page_size if page_size else 0)
    pages = BATCH * per_row + 3
    problem = Problem("bf16", True, BATCH, SEQLEN_Q, capacity, HEADS_Q, HEADS_KV, HEAD_DIM, layout="paged")
    row = HEADS_KV * HEAD_DIM
    cache_rows = page_size or capacity
    tensors = {"q": padded(1 << 20, SEQLEN_Q, HEADS_Q), "k": Tensor(16 << 20, cache_rows * row, row, HEAD_DIM),
               "v": Tensor(32 << 20, cache_rows * row, row, HEAD_DIM), "out": padded(4 << 20, SEQLEN_Q, HEADS_Q)}
    lengths, table, offsets = 9 << 20, 10 << 20, 11 << 20
    fields = {"scale": 0.1, "cache_seqlens": lengths}
    cache = KvCache(seqused_k=lengths)
    if page_size:
        cache = KvCache(seqused_k=lengths, block_table=table, block_table_batch_stride=per_row, page_size=page_size,
                        pages=pages)
        fields.update(block_table=f"{table}:{per_row}", page_size=page_size, pages=pages)
    if packed:  # rows of up to SEQLEN_Q tokens, BATCH * SEQLEN_Q - 7 of them in all
        total_q = BATCH * SEQLEN_Q - 7
        tensors["q"], tensors["out"] = (Tensor(t.data, 0, HEADS_Q * HEAD_DIM, HEAD_DIM) for t in (tensors["q"], tensors["out"]))
        cache = KvCache(**{**cache.__dict__, "cu_seqlens_q": offsets, "total_q": total_q})
        fields.update(cu_seqlens_q=offsets, total_q=total_q)
    entry = python_calls.select(problem.key, (9, 0), capacity)
    assert entry.launch.grid == "persistent"
    prepared = prepare_kvcache(python_calls, problem, *tensors.values(), cache, softmax_scale=0.1, entry=entry)
    expected = abi.FwdParams.from_buffer_copy(prepared.params)
    expected.o, expected.lse = tensors["out"].data, LSE

    open_bundle, _, driver_dir = fa3_programs
    result = run(open_bundle, "--call", python_calls.path, "kvcache", *cli_call(problem, tensors, None, **fields),
                 driver_dir=driver_dir, cc=(9, 0), record=True)
    maps = assert_launch_as_prepared(result, prepared.grid, expected, recorded_tensor_maps)
    box = maps[1]["box"][1]
    assert box == contract.cache_box_rows(page_size, 128) == {64: 64, 256: 128, 16: 16, 0: 128}[page_size]


def refused_calls():
    """(entry point, problem, tensors, descales, --call's extra fields, Python's refusal of the
    same call) of calls fagen.hpp must refuse with Python's message."""
    from fagen.runtime import call
    from fagen.runtime.call import Problem, ScoreTensors, Varlen

    problem = Problem("e4m3", True, BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, HEAD_DIM)
    tensors = {"q": padded(1 << 20, SEQLEN_Q, HEADS_Q), "k": padded(2 << 20, SEQLEN_K, HEADS_KV),
               "v": padded(3 << 20, SEQLEN_K, HEADS_KV), "out": padded(4 << 20, SEQLEN_Q, HEADS_Q)}
    bf16 = dataclasses.replace(problem, dtype="bf16")

    def forward(problem, tensors=tensors, descales=None, **options):
        return lambda bundle: call.prepare(bundle, problem, *tensors.values(), descales=descales,
                                           entry=bundle.select(f"fwd/{problem.dtype}/hd128/causal", (9, 0)), **options)

    def backward(problem):
        t = call.BackwardTensors(**tensors, dout=tensors["out"], dq=tensors["q"], dk=tensors["k"], dv=tensors["v"],
                                 lse=LSE)
        return lambda bundle: call.attention_backward(bundle, problem, t, workspace=LSE)

    descale_on_bf16 = e4m3.Descales(v=DESCALE)
    return {
        "softcap": ("forward", problem, tensors, None, {"softcap": 30},
                    forward(dataclasses.replace(problem, score=contract.Score(softcap=30.0)))),
        "alibi-sinks": ("forward", problem, tensors, None, {"alibi": ARRAY, "sinks": ARRAY + 256},
                        forward(dataclasses.replace(problem, score=contract.Score(alibi=True, sinks=True)),
                                score_tensors=ScoreTensors(alibi_slopes=ARRAY, sinks=ARRAY + 256))),
        "mask-mod": ("forward", problem, tensors, None, {"causal": 0, "mask_mod": "document"},
                     forward(dataclasses.replace(problem, causal=False, mask_mod="document"))),
        "varlen": ("forward", problem, tensors, None, {"varlen": 1},
                   forward(dataclasses.replace(problem, layout="varlen"),
                           varlen=Varlen(4096, 8192, BATCH * SEQLEN_Q, BATCH * SEQLEN_K))),
        "descales-on-bf16": ("forward", bf16, tensors, descale_on_bf16, {}, forward(bf16, descales=descale_on_bf16)),
        "misaligned-descale": ("forward", problem, tensors, e4m3.Descales(k=DESCALE + 2), {},
                               forward(problem, descales=e4m3.Descales(k=DESCALE + 2))),
        "negative-descale-stride": ("forward", problem, tensors, e4m3.Descales(q=DESCALE, q_head_stride=-1), {},
                                    forward(problem, descales=e4m3.Descales(q=DESCALE, q_head_stride=-1))),
        "q-strides-of-8-e4m3": ("forward", problem, {**tensors, "q": padded(1 << 20, SEQLEN_Q, HEADS_Q, 8)}, None, {},
                                forward(problem, {**tensors, "q": padded(1 << 20, SEQLEN_Q, HEADS_Q, 8)})),
        "out-strides-of-4-bf16": ("forward", problem, {**tensors, "out": padded(4 << 20, SEQLEN_Q, HEADS_Q, 4)}, None,
                                  {}, forward(problem, {**tensors, "out": padded(4 << 20, SEQLEN_Q, HEADS_Q, 4)})),
        "backward": ("backward", problem, tensors, None, {}, backward(problem)),
        "semaphore-bytes": ("semaphores", problem, tensors, None, {}, backward(problem)),
        "kvcache": ("kvcache", problem, tensors, None, {},
                    lambda bundle: call.check_problem(dataclasses.replace(problem, layout="paged"))),
        "kvcache-fp16-cache-under-bf16": ("kvcache", bf16, tensors, None, {"kv_dtype": "fp16"},
                                          lambda bundle: call.check_problem(
                                              dataclasses.replace(bf16, layout="paged", kv_dtype="fp16"))),
        "kvcache-descales-on-bf16-cache": ("kvcache", bf16, tensors, descale_on_bf16, {},
                                           lambda bundle: call._check_descales(
                                               dataclasses.replace(bf16, layout="paged"), descale_on_bf16)),
        "descales-on-bf16-backward": ("backward", bf16, tensors, descale_on_bf16, {},
                                      lambda bundle: call._check_descales(bf16, descale_on_bf16)),
    }


@pytest.mark.parametrize("case", refused_calls())
def test_cpp_refuses_the_calls_python_refuses(fa3_programs, python_calls, case):
    """e4m3 backward, KV-cache, varlen calls, e4m3 with score modifiers or a custom mask, descales
    on other dtypes or malformed, strides of another element's rule: each refused by fagen.hpp's
    entry point with fagen.runtime's message, nothing launched."""
    from fagen.runtime.call import AttentionError

    entry_point, problem, tensors, descales, fields, python_call = refused_calls()[case]
    with pytest.raises(AttentionError) as refusal:
        python_call(python_calls)
    open_bundle, _, driver_dir = fa3_programs
    result = run(open_bundle, "--call", python_calls.path, entry_point, *cli_call(problem, tensors, descales, **fields),
                 driver_dir=driver_dir, record=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"error: fagen: {refusal.value}"]  # and no map or launch recorded


@pytest.mark.parametrize("args", [
    ["--dtype", "e4m3", "--head-dim", "128", "--causal"],
    ["--dtype", "e4m3", "--head-dim", "128", "--causal", "--seqlen-q", "1", "--seqlen-k", "1000", "--heads-q", "3",
     "--heads-kv", "1"],
    ["--dtype", "bf16", "--head-dim", "128", "--causal"],
], ids=["e4m3-causal-gqa", "e4m3-one-query-mqa", "bf16-fa3"])
def test_example_runs_fa3_kernels_on_fake_driver(fa3_programs, fa3_bundle, tmp_path, args):
    """fagen_attention through the FA3 stand-ins (TMA maps, a persistent grid): e4m3 inputs with
    their descales, a bf16 output, checked against the CPU reference on the dequantised inputs
    (the fake computes without rounding P, so this checks the plumbing, not the tolerance)."""
    _, example, driver_dir = fa3_programs
    result = run(example, "--bundle", fa3_bundle, *args, "--dump", tmp_path, driver_dir=driver_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    problem = json.loads((tmp_path / "problem.json").read_text())
    element = contract.DTYPE_BYTES[problem["dtype"]]
    q_elements = problem["batch"] * problem["seqlen_q"] * problem["heads_q"] * problem["head_dim"]
    assert (tmp_path / "q.bin").stat().st_size == element * q_elements
    assert (tmp_path / "out.bin").stat().st_size == 2 * q_elements  # bf16 for e4m3 inputs
    if problem["dtype"] == "e4m3":
        assert len(problem["descales"]) == 3 and all(d > 0 for d in problem["descales"])
        assert "descales q" in result.stdout and "bf16 output" in result.stdout
    else:
        assert problem["descales"] == []


@pytest.mark.parametrize("args, message", [
    (["--backward"], "--backward: fagen's e4m3 kernels are forward kernels"),
    (["--softcap", "30"], "the e4m3 kernels take no score modifier (softcap asked for"),
    (["--varlen"], "the e4m3 kernels take the dense layout, not 'varlen'"),
])
def test_example_refuses_what_e4m3_cannot_run(fa3_programs, fa3_bundle, args, message):
    _, example, driver_dir = fa3_programs
    result = run(example, "--bundle", fa3_bundle, "--dtype", "e4m3", "--head-dim", "128", "--causal", *args,
                 driver_dir=driver_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr


def test_example_e4m3_conversions_match_torch(tmp_path):
    """examples/cpp/elements.hpp's e4m3 <-> fp32 against torch.float8_e4m3fn: every encoding
    decoded, and values, the midpoints between neighbours (ties to even) and random ones encoded
    (past 448 saturating, where torch's cast gives NaN)."""
    torch = pytest.importorskip("torch")
    program = tmp_path / "e4m3_elements"
    built = subprocess.run([CXX, "-std=c++17", "-O1", *WARNINGS, f"-I{REPO / 'examples' / 'cpp'}",
                            str(CPP_TESTS / "e4m3_elements.cpp"), "-o", str(program)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    decoded = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = sorted(set(decoded[decoded.isfinite()].tolist()))
    generator = torch.Generator().manual_seed(0)
    inputs = torch.tensor(finite + [(a + b) / 2 for a, b in zip(finite, finite[1:])] + [447.9, 464.0, 1e6, -1e6, 1e-10]
                          + (torch.randn(2000, generator=generator) * torch.logspace(-3, 2, 2000)).tolist())
    result = subprocess.run([str(program), *(repr(x) for x in inputs.tolist())], capture_output=True, text=True,
                            check=True)
    lines = result.stdout.split()
    got_decoded = torch.tensor([float(x) for x in lines[:256]])
    assert torch.equal(got_decoded.isnan(), decoded.isnan())
    assert torch.equal(got_decoded[~decoded.isnan()], decoded[~decoded.isnan()])
    expected = inputs.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert [int(x) for x in lines[256:]] == expected.tolist()
