"""Each raw PTX wrapper (templates/include/fagen/ptx/*.cuh) in a tiny probe kernel on the GPU,
checked against a CPU reference (issue 3).

The probes are the .cu files under probes/, one per probe; every test compiles its probe with
NVRTC (cuda.bindings.nvrtc, no fagen compiler stack: the GPU machine has no pydantic), loads and
launches it through fagen.runtime.driver and compares with torch on the CPU. The sm_80+ probes
are built for the device's own sm_XY (SASS runs only within its major version) and run on any
cc >= 8.0; the sm_90a probes (TMA, mbarrier, wgmma, setmaxnreg) run only on cc 9.0.

Matrix inputs are random multiples of 1/16 in [-4, 4]: exact in bf16 and fp16, so every
product and every partial sum is exact in fp32 and the reference does not depend on the
tensor cores' summation order. Outputs are poisoned (NaN, or all-ones bit patterns) before each
launch, so an element the kernel never writes fails.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[2]
INCLUDE_DIR = REPO / "templates" / "include"
PROBE_DIR = Path(__file__).resolve().parent / "probes"

SWIZZLE_ATOM_BYTES = 1024  # 8 rows x 128 bytes; the probes align their tiles to it by hand
BARRIER_BYTES = 64
TENSOR_MAP_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


# ---------------------------------------------------------------------------------- plumbing
@pytest.fixture
def sm80_arch() -> str:
    """NVRTC arch of the device for the sm_80+ probes: its own sm_XY."""
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        pytest.skip(f"needs compute capability >= 8.0, device has {major}.{minor}")
    return f"sm_{major}{minor}"


@pytest.fixture
def sm90a_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip(f"sm_90a probe needs compute capability 9.0, device has {major}.{minor}")
    return "sm_90a"


def cuda_include_dirs() -> list[Path]:
    """The CUDA toolkit's headers (cuda_fp8.h ..., which the e4m3 probe's algo/element.cuh
    includes): NVRTC 13 has no default include path; the GPU machine has a toolkit beside its
    NVRTC, the build machine NVRTC's bundled headers (fagen.compiler.headers)."""
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp8.h").is_file():
            return [Path(root) / "include"]
    try:
        from fagen.compiler.headers import bundled_include_dirs
    except ImportError:
        return []
    return list(bundled_include_dirs())


@functools.lru_cache(maxsize=None)
def compile_probe(name: str, arch: str) -> bytes:
    """Cubin of probes/<name>.cu for `arch`; fails the test with NVRTC's log on an error."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, program = nvrtc.nvrtcCreateProgram(
        (PROBE_DIR / f"{name}.cu").read_bytes(), f"{name}.cu".encode(), 0, [], []
    )
    assert err == ok, f"nvrtcCreateProgram: {err}"
    try:
        options = [f"-arch={arch}".encode(), b"-std=c++17", f"-I{INCLUDE_DIR}".encode(),
                   *(f"-I{d}".encode() for d in cuda_include_dirs())]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        result, size = nvrtc.nvrtcGetProgramLogSize(program)
        assert result == ok, f"nvrtcGetProgramLogSize: {result}"
        log = b" " * size
        (result,) = nvrtc.nvrtcGetProgramLog(program, log)
        assert result == ok, f"nvrtcGetProgramLog: {result}"
        log = log.rstrip(b"\0 ").decode(errors="replace")
        if err != ok:
            pytest.fail(f"NVRTC failed on probes/{name}.cu for {arch} ({err}):\n{log}")
        # ptxas warns (C7510-C7520) when it has to serialize wgmma: a wrapper or fence is wrong.
        if "wgmma" in log:
            pytest.fail(f"ptxas warned about wgmma in probes/{name}.cu:\n{log}")
        result, size = nvrtc.nvrtcGetCUBINSize(program)
        assert result == ok, f"nvrtcGetCUBINSize: {result}"
        cubin = b" " * size
        (result,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        assert result == ok, f"nvrtcGetCUBIN: {result}"
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    assert len(cubin) > 0, f"NVRTC gave an empty cubin for probes/{name}.cu ({arch})"
    return cubin


@functools.lru_cache(maxsize=None)
def probe_kernel(name: str, arch: str, symbol: str, dynamic_smem: int = 0):
    """The kernel `symbol` of probes/<name>.cu, opted into `dynamic_smem` bytes when above 48 KB.
    Cached, so the library stays loaded for the whole session."""
    from fagen.runtime import driver

    library = driver.load_library(compile_probe(name, arch))
    kernel = driver.get_kernel(library, symbol)
    if dynamic_smem > 48 * 1024:
        driver.set_max_dynamic_smem(kernel, dynamic_smem, torch.cuda.current_device())
    return kernel


def run(kernel, grid: int, block: int, dynamic_smem: int, *params) -> None:
    """Launch on torch's current stream and wait for it."""
    from fagen.runtime import driver

    stream = torch.cuda.current_stream().cuda_stream
    with driver.primary_context(torch.cuda.current_device()):
        driver.launch(kernel, (grid, 1, 1), (block, 1, 1), dynamic_smem, stream, tuple(params))
    torch.cuda.synchronize()


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    assert t.is_cuda and t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


def i32(value: int) -> ctypes.c_int32:
    return ctypes.c_int32(value)


def tensor_map(t: torch.Tensor, box_rows: int) -> ctypes.Array:
    """fagen::ptx::TensorMap (128 bytes, by value) over a contiguous (batch, seqlen, heads,
    head_dim) tensor: dims (head_dim, seqlen, heads, batch), boxes of 64 columns x `box_rows`,
    128-byte swizzle; the same encoding as fagen.torch.adapter's FA3 maps."""
    from fagen.runtime import driver

    assert t.dim() == 4 and t.is_contiguous() and t.data_ptr() % 16 == 0
    batch, seqlen, heads, head_dim = t.shape
    batch_stride, row_stride, head_stride, _ = t.stride()
    element = t.element_size()
    blob = driver.encode_tiled_tensor_map(
        TENSOR_MAP_DTYPES[t.dtype],
        t.data_ptr(),
        (head_dim, seqlen, heads, batch),
        (row_stride * element, head_stride * element, batch_stride * element),
        (64, box_rows, 1, 1),
    )
    assert len(blob) == 128
    return (ctypes.c_ubyte * len(blob)).from_buffer_copy(blob)


def exact_values(*shape: int) -> torch.Tensor:
    """Random multiples of 1/16 in [-4, 4] (fp32, CPU): exact in bf16 and fp16."""
    return torch.randint(-64, 65, shape, dtype=torch.int32).float() / 16


def bit_patterns(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit patterns of `values` in `dtype`, on the GPU (the probes read unsigned short)."""
    converted = values.to(dtype)
    assert torch.equal(converted.float(), values), "input not exact in the low precision"
    return converted.view(torch.int16).cuda()


def nan_tensor(*shape: int) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=torch.float32, device="cuda")


def assert_matrix_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    # Exact inputs make the fp32 result exact; the 1e-6 slack only forgives a last-bit rounding.
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)


DTYPE_PARAMS = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="f16")]
SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16"}


# ---------------------------------------------------------------------------------- sm_80+
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_mma_sync_ldmatrix(sm80_arch, dtype):
    """ldmatrix x4 (A) and x4.trans (B, K x N) feed two mma.sync m16n8k16 onto C:
    D = A @ B + C for 16x16 tiles."""
    torch.manual_seed(0)
    a, b = exact_values(16, 16), exact_values(16, 16)
    c = exact_values(16, 16)
    d = nan_tensor(16, 16)
    kernel = probe_kernel("mma_sync_ldmatrix", sm80_arch, f"probe_mma_{SUFFIX[dtype]}")
    a_dev, b_dev, c_dev = bit_patterns(a, dtype), bit_patterns(b, dtype), c.cuda()
    run(kernel, 1, 32, 0, ptr(a_dev), ptr(b_dev), ptr(c_dev), ptr(d))
    assert_matrix_equal(d, a @ b + c)


def test_cp_async_zero_fill(sm80_arch):
    """cp.async.cg 16-byte copies in two commit groups (wait_group 1, then 0); rows flagged
    invalid and rows past the tensor (source past its end, src-size 0) arrive as zeros."""
    torch.manual_seed(0)
    rows, n_rows = 32, 27  # rows 27..31 lie past the end of `src`
    src = torch.randint(-(2**31), 2**31 - 1, (n_rows, 32), dtype=torch.int32)
    row_valid = torch.ones(rows, dtype=torch.int32)
    row_valid[[3, 15, 16, 22]] = 0  # one in each group and at both sides of the group boundary
    out = torch.full((rows, 32), -1, dtype=torch.int32, device="cuda")
    kernel = probe_kernel("cp_async", sm80_arch, "probe_cp_async")
    src_dev, valid_dev = src.cuda(), row_valid.cuda()
    run(kernel, 1, 128, 0, ptr(src_dev), ptr(valid_dev), i32(n_rows), ptr(out))

    expected = torch.zeros(rows, 32, dtype=torch.int32)
    expected[:n_rows] = src
    expected[row_valid == 0] = 0
    assert torch.equal(out.cpu(), expected), (
        f"rows differing: {sorted(set((out.cpu() != expected).nonzero()[:, 0].tolist()))}"
    )


def test_ex2_approx_ftz(sm80_arch):
    """ex2.approx.ftz.f32 against exp2 in float64: ~1e-6 relative on the normal range, +0 for
    -inf and for results below the smallest normal (ftz), +inf above the largest float, NaN in
    NaN out."""
    torch.manual_seed(0)
    finite = torch.cat([
        torch.linspace(-125.0, 127.0, 4001),
        torch.rand(4000) * 252.0 - 125.0,
        torch.randn(2000) * 4.0,
        torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-30, -1e-30, 1e-40, 126.0, 127.0, -125.0]),
    ])
    to_zero = torch.tensor([-math.inf, -127.5, -140.0, -149.0, -150.0, -200.0, -1000.0, -1e30,
                            -3.4e38])
    to_inf = torch.tensor([math.inf, 128.5, 200.0, 1e30, 3.4e38])
    x = torch.cat([finite, to_zero, to_inf, torch.tensor([math.nan])]).float()
    y = torch.full_like(x, math.nan, device="cuda")
    x_dev = x.cuda()
    kernel = probe_kernel("ex2", sm80_arch, "probe_ex2")
    run(kernel, math.ceil(x.numel() / 256), 256, 0, ptr(x_dev), ptr(y), i32(x.numel()))
    y = y.cpu()

    n_finite, n_zero, n_inf = finite.numel(), to_zero.numel(), to_inf.numel()
    ref = torch.exp2(finite.double())
    got = y[:n_finite].double()
    rel = ((got - ref).abs() / ref).max().item()
    worst = int(((got - ref).abs() / ref).argmax())
    assert rel <= 1e-6, f"max relative error {rel:.3g} at x = {finite[worst].item()!r}"
    zeros = y[n_finite:n_finite + n_zero]
    assert torch.equal(zeros.view(torch.int32), torch.zeros(n_zero, dtype=torch.int32)), (
        f"expected +0 for {to_zero.tolist()}, got {zeros.tolist()}"
    )
    infs = y[n_finite + n_zero:n_finite + n_zero + n_inf]
    assert torch.all(infs == math.inf), f"expected +inf for {to_inf.tolist()}, got {infs.tolist()}"
    assert torch.isnan(y[-1]), f"expected NaN for NaN, got {y[-1].item()}"


# ---------------------------------------------------------------------------------- sm_90a
def swizzled_128b(block: torch.Tensor) -> torch.Tensor:
    """A (rows, 64) 16-bit block as TMA writes it with the 128-byte swizzle into a 1024-byte
    aligned tile: element (r, c) at byte r*128 + ((c*2/16) ^ (r%8))*16 + (c*2)%16."""
    rows = block.shape[0]
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(64).view(1, -1)
    byte = r * 128 + (((c * 2) // 16) ^ (r % 8)) * 16 + (c * 2) % 16
    out = torch.empty(rows * 64, dtype=block.dtype)
    out[(byte // 2).flatten()] = block.flatten()
    return out


def test_tma_mbarrier(sm90a_arch):
    """One mbarrier, two phases, one TMA box each (bf16, 64 columns x 64 rows, 128-byte
    swizzle): the shared bytes match the swizzle formula, rows past the tensor are zero, and the
    barrier's parity-1 phase is not complete before anyone arrived on it."""
    torch.manual_seed(0)
    seqlen, heads, head_dim = 100, 2, 128
    x = torch.randn(1, seqlen, heads, head_dim, dtype=torch.bfloat16)
    x_dev = x.cuda()
    tmap = tensor_map(x_dev, box_rows=64)
    out = torch.full((2 * 64 * 128 // 4 + 1,), -1, dtype=torch.int32, device="cuda")
    smem = SWIZZLE_ATOM_BYTES + 2 * 64 * 128 + BARRIER_BYTES
    kernel = probe_kernel("tma_mbarrier", sm90a_arch, "probe_tma")
    # Phase 0: columns 64..127 of rows 0..63, head 1 (in bounds). Phase 1: columns 0..63 of
    # rows 64..127, head 0: rows 100..127 lie past the tensor.
    box_a, box_b = (64, 0, 1), (0, 64, 0)
    run(kernel, 1, 128, smem, tmap, ptr(out), *map(i32, box_a), *map(i32, box_b))
    out = out.cpu()
    assert out[-1].item() == -1, "mbarrier phase 1 looked complete before any arrival"
    tiles = out[:-1].view(torch.int16).view(2, 64 * 64)

    bits = x.view(torch.int16)[0]  # (seqlen, heads, head_dim)
    for tile, (c0, r0, head) in zip(tiles, (box_a, box_b)):
        block = torch.zeros(64, 64, dtype=torch.int16)
        valid = min(64, seqlen - r0)
        block[:valid] = bits[r0:r0 + valid, head, c0:c0 + 64]
        expected = swizzled_128b(block)
        if not torch.equal(tile, expected):
            wrong = (tile != expected).view(64, 64).nonzero()[:, 0].unique().tolist()
            pytest.fail(f"box at (col {c0}, row {r0}, head {head}): shared rows differ: {wrong}")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_wgmma_ss_k_major(sm90a_arch, dtype):
    """wgmma m64n128k16, both operands K-major in shared memory (TMA, 128-byte swizzle, two
    64-column chunks): D = A @ B^T for A 64x128 and B 128x128 (N x K), like S = Q K^T at
    head_dim 128; accumulators start as NaN (scale-d 0 on the first k-step must overwrite)."""
    torch.manual_seed(0)
    a, b = exact_values(64, 128), exact_values(128, 128)
    a_dev = a.to(dtype).view(1, 64, 1, 128).cuda()
    b_dev = b.to(dtype).view(1, 128, 1, 128).cuda()
    assert torch.equal(a_dev.float().cpu().view(64, 128), a)
    assert torch.equal(b_dev.float().cpu().view(128, 128), b)
    map_a, map_b = tensor_map(a_dev, box_rows=64), tensor_map(b_dev, box_rows=128)
    d = nan_tensor(64, 128)
    smem = SWIZZLE_ATOM_BYTES + 64 * 128 * 2 + 128 * 128 * 2 + BARRIER_BYTES
    kernel = probe_kernel("wgmma_ss", sm90a_arch, f"probe_wgmma_ss_{SUFFIX[dtype]}", smem)
    run(kernel, 1, 128, smem, map_a, map_b, ptr(d))
    assert_matrix_equal(d, a @ b.T)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_wgmma_rs_transposed_b(sm90a_arch, dtype):
    """wgmma m64n128k16 with A from registers (mma.sync A-fragment layout) and B MN-major
    (tnspB 1) in shared memory, two 64-column chunks LBO = 64*128 bytes apart: D = C + A @ B for
    A 64x64 and B 64x128 (K x N), like O += P V with block_n 64 and head_dim 128."""
    torch.manual_seed(0)
    a, b, c = exact_values(64, 64), exact_values(64, 128), exact_values(64, 128)
    b_dev = b.to(dtype).view(1, 64, 1, 128).cuda()
    assert torch.equal(b_dev.float().cpu().view(64, 128), b)
    map_b = tensor_map(b_dev, box_rows=64)
    a_dev, c_dev = bit_patterns(a, dtype), c.cuda()
    d = nan_tensor(64, 128)
    smem = SWIZZLE_ATOM_BYTES + 64 * 128 * 2 + BARRIER_BYTES
    kernel = probe_kernel("wgmma_rs", sm90a_arch, f"probe_wgmma_rs_{SUFFIX[dtype]}", smem)
    run(kernel, 1, 128, smem, map_b, ptr(a_dev), ptr(c_dev), ptr(d))
    assert_matrix_equal(d, c + a @ b)


def test_setmaxnreg_named_barriers(sm90a_arch):
    """Three warpgroups: 0 drops to 24 registers, 1 and 2 rise to 240; every thread gets past
    its setmaxnreg, and warpgroups 1 and 2 alternate 4 turns each through bar.sync/bar.arrive."""
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    log = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    roles = torch.zeros(3, dtype=torch.int32, device="cuda")
    kernel = probe_kernel("setmaxnreg_bar", sm90a_arch, "probe_setmaxnreg_bar")
    run(kernel, 1, 384, 0, ptr(counter), ptr(log), ptr(roles))
    assert roles.tolist() == [128, 128, 128], f"threads past setmaxnreg: {roles.tolist()}"
    assert counter.item() == 8, f"{counter.item()} turns taken, expected 8"
    assert log.tolist() == [1, 2] * 4, f"turn order {log.tolist()}"


# ------------------------------------------------------------------------- sm_90a, e4m3
def e4m3_exact(*shape: int) -> torch.Tensor:
    """Random multiples of 1/8 in [-4, 4] rounded to e4m3 (fp32, CPU): every product is a
    multiple of 1/64 below 16, so 128-term sums are exact in fp32."""
    return (torch.randint(-32, 33, shape, dtype=torch.int32).float() / 8).to(torch.float8_e4m3fn).float()


def e4m3_map(t: torch.Tensor, box_rows: int) -> ctypes.Array:
    """A TMA map over a contiguous (rows, columns) e4m3 matrix as (columns, rows, 1, 1), boxes of
    128 one-byte columns x `box_rows`, 128-byte swizzle (the FP8 forward's maps)."""
    from fagen.runtime import driver

    rows, columns = t.shape
    assert t.dtype == torch.float8_e4m3fn and t.is_contiguous()
    blob = driver.encode_tiled_tensor_map("e4m3", t.data_ptr(), (columns, rows, 1, 1),
                                          (columns, rows * columns, rows * columns), (128, box_rows, 1, 1))
    return (ctypes.c_ubyte * len(blob)).from_buffer_copy(blob)


def test_wgmma_ss_e4m3(sm90a_arch):
    """wgmma m64n128k32 e4m3 with both operands K-major in shared memory (Q K^T's shape at
    head_dim 128, block_n 128): D = A @ B^T; D starts as NaN, so the first k-step must overwrite."""
    torch.manual_seed(0)
    a, b = e4m3_exact(64, 128), e4m3_exact(128, 128)
    a_dev, b_dev = a.to(torch.float8_e4m3fn).cuda(), b.to(torch.float8_e4m3fn).cuda()
    d = nan_tensor(64, 128)
    smem = SWIZZLE_ATOM_BYTES + 64 * 128 + 128 * 128 + BARRIER_BYTES
    kernel = probe_kernel("wgmma_e4m3", sm90a_arch, "probe_wgmma_ss_e4m3", smem)
    run(kernel, 1, 128, smem, e4m3_map(a_dev, 64), e4m3_map(b_dev, 128), ptr(d))
    assert_matrix_equal(d, a @ b.T)


@pytest.mark.parametrize("columns", [128, 256])
def test_wgmma_rs_e4m3_through_v_transpose(sm90a_arch, columns):
    """O += P V as the FP8 forward computes it: P (64 x 128 keys) from the fp32 accumulator layout
    through pack_a_fragment<e4m3>, V (128 keys x `columns`) turned into V^T by the companion's
    transpose_v_block (keys permuted within every 16 to match P's registers: V^T column 4q+i holds
    key {2q, 2q+1, 8+2q, 9+2q}[i]), TMA-loaded, wgmma m64nNk32 with A from registers:
    D = C + P @ V, exactly."""
    from fagen import abi

    torch.manual_seed(columns)
    p = e4m3_exact(64, 128).abs()  # probabilities are non-negative
    v, c = e4m3_exact(128, columns), exact_values(64, columns)
    v_dev, p_dev, c_dev = v.to(torch.float8_e4m3fn).cuda(), p.cuda(), c.cuda()
    vt_dev = torch.full((columns, 128), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    params = abi.FwdParams(v=v_dev.data_ptr(), v_row_stride=columns, seqlen_k=128, heads_kv=1, batch=1)
    run(probe_kernel("wgmma_e4m3", sm90a_arch, f"probe_transpose_v_n{columns}"), 1, columns // 2, 0, params,
        ptr(vt_dev))
    within = torch.tensor([2 * (i // 4) + (i % 2) + 8 * ((i % 4) // 2) for i in range(16)])
    keys = 16 * torch.arange(8).view(8, 1) + within
    assert torch.equal(vt_dev.view(torch.uint8).cpu(), v_dev.view(torch.uint8).cpu()[keys.flatten()].T)
    d = nan_tensor(64, columns)
    smem = SWIZZLE_ATOM_BYTES + 128 * columns + BARRIER_BYTES
    kernel = probe_kernel("wgmma_e4m3", sm90a_arch, f"probe_wgmma_rs_e4m3_n{columns}", smem)
    run(kernel, 1, 128, smem, e4m3_map(vt_dev, columns), ptr(p_dev), ptr(c_dev), ptr(d))
    assert_matrix_equal(d, c + p @ v)
