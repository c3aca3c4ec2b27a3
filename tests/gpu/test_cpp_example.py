"""examples/cpp on the GPU: build it against the bundle under test, run it on random inputs with
--dump, and hold its output to the rule of DESIGN.md (max error at most 2x that of plain torch in
the low precision, against an fp32 reference; e4m3: tests/gpu/test_fp8.py's bar, 2x the error of
an emulation of the kernel's FP8 steps against fp64 on the dequantised inputs), next to
fagen.torch.flash_attn_func on the same inputs. Skips without a GPU, cmake/g++ or a bundle;
needs no pydantic."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from attention_reference import Mods, attention_math, math_grads  # noqa: E402
from test_fa2_fwd import EVERY_KERNEL_WINDOW  # noqa: E402
from test_fp8 import E4M3, LSE_ATOL, OUT_ATOL, dequantise, emulate, reference  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound  # noqa: E402
from fagen.torch import flash_attn_func  # noqa: E402

# The softcap a variant kernel runs with here (the example makes its ALiBi slopes and sinks).
EXAMPLE_SOFTCAP = 30.0

REPO = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++")
CMAKE = shutil.which("cmake")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): GQA with seqlen_q > seqlen_k (causal rows that
# see no key), and a single query against many keys.
SIZES = ((2, 300, 257, 4, 2), (1, 1, 1000, 3, 3))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(CXX is None or CMAKE is None, reason="needs cmake and g++ to build examples/cpp"),
]


def cuda_include_override() -> list[str]:
    """-DFAGEN_CUDA_INCLUDE_DIR for the pip wheel's cuda.h when there is one; else CMake finds the toolkit."""
    try:
        import nvidia
    except ImportError:
        return []
    for root in nvidia.__path__:
        for sub in ("cu13", "cu12"):
            include = Path(root) / sub / "include"
            if (include / "cuda.h").is_file() and (include / "cudaTypedefs.h").is_file():
                return [f"-DFAGEN_CUDA_INCLUDE_DIR={include}"]
    return []


@pytest.fixture(scope="module")
def example(bundle, tmp_path_factory):
    build = tmp_path_factory.mktemp("cpp-example")
    configure = subprocess.run(
        [CMAKE, "-S", str(REPO / "examples" / "cpp"), "-B", str(build), f"-DFAGEN_BUNDLE_DIR={bundle.path}",
         "-DCMAKE_BUILD_TYPE=Release", *cuda_include_override()],
        capture_output=True, text=True,
    )
    if configure.returncode != 0 and "cuda.h not found" in configure.stdout + configure.stderr:
        pytest.skip("no cuda.h for the example: install a CUDA toolkit or `pip install nvidia-cuda-runtime`")
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run([CMAKE, "--build", str(build)], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return build / "fagen_attention"


def runnable_keys(bundle, direction: str = "fwd", layout: str = "dense", dtypes=tuple(DTYPES)) -> list[str]:
    """The keys of `direction`, `layout` and one of `dtypes` that run on this GPU (the example
    calls the dense and, with --varlen, the varlen layout; decode_paged.cpp the paged one)."""
    cc = torch.cuda.get_device_capability()
    keys = sorted({e.key for e in bundle.kernels if e.key.startswith(f"{direction}/")
                   and contract.KernelKey.parse(e.key).layout == layout
                   and contract.KernelKey.parse(e.key).dtype in dtypes})
    runnable = []
    for key in keys:
        try:
            bundle.select(key, cc)
        except LookupError:
            continue
        runnable.append(key)
    if not runnable:
        pytest.skip(f"the bundle has no {direction} {'/'.join(dtypes)} kernel for compute capability {cc[0]}.{cc[1]}")
    return runnable


def read_dump(directory: Path, name: str, shape, dtype) -> torch.Tensor:
    data = bytearray((directory / f"{name}.bin").read_bytes())
    return torch.frombuffer(data, dtype=dtype).view(shape).cuda()


def run_example(example, key: str, size, seed: int, dump: Path, *extra: str) -> dict:
    parsed = contract.KernelKey.parse(key)
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = size
    args = [str(example), "--dtype", parsed.dtype, "--head-dim", parsed.head_dim, "--batch", batch, "--seqlen-q",
            seqlen_q, "--seqlen-k", seqlen_k, "--heads-q", heads_q, "--heads-kv", heads_kv, "--seed", seed,
            "--dump", dump, *extra]
    if parsed.head_dim_v:
        args += ["--head-dim-v", parsed.head_dim_v]
    if parsed.mask == "causal":
        args.append("--causal")
    if parsed.layout == "varlen":
        args.append("--varlen")
    if parsed.mask == "local":  # the window test_fa2_fwd runs every local kernel with
        args += ["--window", *EVERY_KERNEL_WINDOW]
    if "softcap" in parsed.mods:
        args += ["--softcap", EXAMPLE_SOFTCAP]
    args += [f"--{mod}" for mod in ("alibi", "sinks") if mod in parsed.mods]
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{key} {size}: exit {result.returncode}\n{result.stdout}{result.stderr}"
    return json.loads((dump / "problem.json").read_text())


def mods_of(problem: dict) -> Mods:
    """The modifiers the example ran with (problem.json)."""
    def array(name):
        return torch.tensor(problem[name], device="cuda") if problem[name] else None
    return Mods(softcap=problem["softcap"], alibi=array("alibi_slopes"), sink=array("sinks"))


def options_of(mods: Mods) -> dict:
    return dict(softcap=mods.softcap, alibi_slopes=mods.alibi, learnable_sink=mods.sink)


@pytest.mark.parametrize("layout", ("dense", "varlen"))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_cpp_example_matches_reference_and_torch(bundle, example, tmp_path, size, layout):
    cc = torch.cuda.get_device_capability()
    for seed, key in enumerate(runnable_keys(bundle, "fwd", layout)):
        dump = tmp_path / key.replace("/", "_") / "x".join(map(str, size))
        dump.mkdir(parents=True)
        problem = run_example(example, key, size, seed, dump)
        selected = bundle.select(key, cc, problem["seqlen_k"])
        assert problem["kernel"] == selected.name, "C++ and Python selected different kernels"

        dtype = DTYPES[problem["dtype"]]
        batch, seqlen_q, seqlen_k = problem["batch"], problem["seqlen_q"], problem["seqlen_k"]
        heads_q, heads_kv, head_dim = problem["heads_q"], problem["heads_kv"], problem["head_dim"]
        head_dim_v = problem["head_dim_v"]
        causal, scale, window = problem["causal"], problem["softmax_scale"], tuple(problem["window_size"])
        q = read_dump(dump, "q", (batch, seqlen_q, heads_q, head_dim), dtype)
        k = read_dump(dump, "k", (batch, seqlen_k, heads_kv, head_dim), dtype)
        v = read_dump(dump, "v", (batch, seqlen_k, heads_kv, head_dim_v), dtype)
        out_cpp = read_dump(dump, "out", (batch, seqlen_q, heads_q, head_dim_v), dtype)
        lse_cpp = read_dump(dump, "lse", (batch, heads_q, seqlen_q), torch.float32)

        mods = mods_of(problem)
        out_torch, lse_torch = flash_attn_func(q, k, v, causal=causal, window_size=window, softmax_scale=scale, return_lse=True,
                                               bundle=bundle, **options_of(mods))
        ref, _ = attention_math(q, k, v, causal, scale, torch.float32, window, mods)
        low, _ = attention_math(q, k, v, causal, scale, dtype, window, mods)
        low_error = (low.float() - ref).abs().max().item()
        cpp_error = (out_cpp.float() - ref).abs().max().item()
        torch_error = (out_torch.float() - ref).abs().max().item()
        between = (out_cpp.float() - out_torch.float()).abs().max().item()
        context = (f"{key} {size}: C++ {cpp_error:.3e}, flash_attn_func {torch_error:.3e}, torch {dtype} "
                   f"{low_error:.3e}, C++ vs flash_attn_func {between:.3e}")
        assert not out_cpp.isnan().any(), f"{context}: C++ output has NaN (unwritten elements)"
        assert cpp_error <= 2 * low_error + 1e-5, context
        assert torch_error <= 2 * low_error + 1e-5, context
        assert between <= 2 * low_error + 1e-5, context
        assert torch.equal(torch.isfinite(lse_cpp), torch.isfinite(lse_torch)), f"{context}: LSE -inf rows differ"
        finite = torch.isfinite(lse_torch)
        if finite.any():
            lse_gap = (lse_cpp - lse_torch)[finite].abs().max().item()
            assert lse_gap <= 1e-3, f"{context}: LSE differs by {lse_gap:.3e}"


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_cpp_example_e4m3_matches_reference_and_torch(bundle, example, tmp_path, size):
    """--dtype e4m3: the example quantises q, k, v with one descale each and runs the FP8 forward
    through Bundle::attention with its descales; its bf16 output is held to test_fp8.py's bar
    (fp64 attention over the dequantised inputs; 2x the larger error of the two emulations of
    the kernel's FP8 steps, plus an ulp of bf16) and to flash_attn_func's FP8 forward on the same
    stored values and descales."""
    cc = torch.cuda.get_device_capability()
    for seed, key in enumerate(runnable_keys(bundle, "fwd", "dense", ("e4m3",))):
        dump = tmp_path / key.replace("/", "_") / "x".join(map(str, size))
        dump.mkdir(parents=True)
        problem = run_example(example, key, size, seed, dump)
        selected = bundle.select(key, cc, problem["seqlen_k"])
        assert problem["kernel"] == selected.name, "C++ and Python selected different kernels"
        batch, seqlen_q, seqlen_k = problem["batch"], problem["seqlen_q"], problem["seqlen_k"]
        heads_q, heads_kv, head_dim = problem["heads_q"], problem["heads_kv"], problem["head_dim"]
        causal, scale, window = problem["causal"], problem["softmax_scale"], tuple(problem["window_size"])
        q8 = read_dump(dump, "q", (batch, seqlen_q, heads_q, head_dim), torch.uint8).view(E4M3)
        k8 = read_dump(dump, "k", (batch, seqlen_k, heads_kv, head_dim), torch.uint8).view(E4M3)
        v8 = read_dump(dump, "v", (batch, seqlen_k, heads_kv, head_dim), torch.uint8).view(E4M3)
        out_cpp = read_dump(dump, "out", (batch, seqlen_q, heads_q, head_dim), torch.bfloat16)
        lse_cpp = read_dump(dump, "lse", (batch, heads_q, seqlen_q), torch.float32)
        descales = [torch.tensor([d], device="cuda") for d in problem["descales"]]  # one per tensor, (1,)

        out_torch, lse_torch = flash_attn_func(q8, k8, v8, causal=causal, window_size=window, softmax_scale=scale,
                                               q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                                               return_lse=True, bundle=bundle)
        ref, _ = reference(*(dequantise(x8, d) for x8, d in zip((q8, k8, v8), descales)), causal, scale, window)
        floor = max((emu.double() - ref).abs().max().item()
                    for emu, _ in (emulate(q8, k8, v8, descales, causal, scale, window, tc) for tc in (False, True)))
        cpp_error = (out_cpp.double() - ref).abs().max().item()
        between = (out_cpp.double() - out_torch.double()).abs().max().item()
        context = (f"{key} {size}: C++ {cpp_error:.3e}, FP8 emulation {floor:.3e}, "
                   f"C++ vs flash_attn_func {between:.3e}")
        assert not out_cpp.isnan().any(), f"{context}: C++ output has NaN (unwritten elements)"
        assert cpp_error <= 2 * floor + OUT_ATOL, context
        assert between <= 2 * floor + OUT_ATOL, context
        assert torch.equal(torch.isfinite(lse_cpp), torch.isfinite(lse_torch)), f"{context}: LSE -inf rows differ"
        finite = torch.isfinite(lse_torch)
        if finite.any():
            lse_gap = (lse_cpp - lse_torch)[finite].abs().max().item()
            assert lse_gap <= LSE_ATOL, f"{context}: LSE differs by {lse_gap:.3e}"


@pytest.mark.parametrize("layout", ("dense", "varlen"))
@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
def test_cpp_example_backward_matches_reference_and_torch(bundle, example, tmp_path, deterministic, layout):
    """--backward: dq, dk, dv of Bundle::attention_backward within 3x the error of plain torch of
    an fp32 reference, and close to flash_attn_func's autograd on the same inputs."""
    size = SIZES[0]
    keys = runnable_keys(bundle, "bwd", layout)
    for seed, key in enumerate(keys if not deterministic else keys[:2]):
        dump = tmp_path / key.replace("/", "_")
        dump.mkdir(parents=True)
        extra = ("--backward", "--deterministic") if deterministic else ("--backward",)
        problem = run_example(example, key.replace("bwd/", "fwd/", 1), size, seed, dump, *extra)
        assert problem["backward"] and problem["deterministic"] == deterministic
        dtype = DTYPES[problem["dtype"]]
        batch, seqlen_q, seqlen_k = problem["batch"], problem["seqlen_q"], problem["seqlen_k"]
        heads_q, heads_kv, head_dim = problem["heads_q"], problem["heads_kv"], problem["head_dim"]
        head_dim_v = problem["head_dim_v"]
        causal, scale, window = problem["causal"], problem["softmax_scale"], tuple(problem["window_size"])
        q_shape, kv_shape = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_kv, head_dim)
        o_shape, v_shape = (*q_shape[:3], head_dim_v), (*kv_shape[:3], head_dim_v)
        q, dq_cpp = (read_dump(dump, name, q_shape, dtype) for name in ("q", "dq"))
        k, dk_cpp = (read_dump(dump, name, kv_shape, dtype) for name in ("k", "dk"))
        dout = read_dump(dump, "dout", o_shape, dtype)
        v, dv_cpp = (read_dump(dump, name, v_shape, dtype) for name in ("v", "dv"))

        mods = mods_of(problem)
        ref = [g.float() for g in math_grads(q, k, v, dout, causal, scale, torch.float32, window, mods)[2]]
        low = [g.float() for g in math_grads(q, k, v, dout, causal, scale, dtype, window, mods)[2]]
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        sink = None if mods.sink is None else mods.sink.clone().requires_grad_(True)
        out = flash_attn_func(*leaves, causal=causal, window_size=window, softmax_scale=scale, bundle=bundle,
                              **options_of(dataclasses.replace(mods, sink=sink)))
        ours = [g.float() for g in torch.autograd.grad(out, leaves + ([sink] if sink is not None else []), dout)]
        cpp_grads = [dq_cpp, dk_cpp, dv_cpp]
        if sink is not None:
            cpp_grads.append(read_dump(dump, "dsinks", (heads_q,), torch.float32))
        for name, cpp, r, lo, t in zip(("dq", "dk", "dv", "dsinks"), cpp_grads, ref, low, ours):
            low_error = (lo - r).abs().max().item()
            cpp_error = (cpp.float() - r).abs().max().item()
            between = (cpp.float() - t).abs().max().item()
            context = (f"{key} {name}: C++ {cpp_error:.3e}, torch {dtype} {low_error:.3e}, "
                       f"C++ vs flash_attn_func {between:.3e}")
            assert not cpp.isnan().any(), f"{context}: NaN (unwritten elements)"
            assert cpp_error <= 3 * low_error + 1e-4, context
            assert between <= 3 * low_error + 1e-4, context


@pytest.mark.parametrize("args", [
    [],
    ["--page-size", "64", "--heads-q", "8", "--heads-kv", "1", "--batch", "3", "--seed", "1"],
    ["--page-size", "16", "--num-splits", "1", "--head-dim", "64", "--heads-q", "16", "--heads-kv", "4"],
    ["--fp8-cache", "1"],
    ["--fp8-cache", "1", "--page-size", "64", "--head-dim", "256", "--heads-q", "16", "--heads-kv", "2"],
    ["--prefill", "300", "--batch", "2", "--heads-q", "8", "--heads-kv", "2", "--steps", "2"],
    ["--prefill", "200", "--page-size", "64", "--batch", "2", "--heads-q", "8", "--heads-kv", "2", "--steps", "2",
     "--head-dim", "64"],
    ["--prefill", "150", "--fp8-cache", "1", "--batch", "2", "--heads-q", "8", "--heads-kv", "2", "--steps", "2"],
], ids=["gqa4-p16", "mqa8-p64", "hd64-one-split", "fp8-cache-p16", "fp8-cache-hd256-p64", "prefill-p16",
        "prefill-hd64-p64", "prefill-fp8-cache"])
def test_cpp_decode_from_paged_cache(bundle, example, args):
    """examples/cpp/decode_paged.cpp: decode steps over a paged cache (bf16, or e4m3 with its
    descales), after a prefill where asked (the paged tile kernels, FA3, from 128 tokens a row; an
    e4m3 cache's on the split-KV kernels), through Bundle::attention_kvcache, each checked against
    its CPU reference."""
    head_dim = int(args[args.index("--head-dim") + 1]) if "--head-dim" in args else 128
    dtypes = "bf16-e4m3" if "--fp8-cache" in args else "bf16"
    key = f"fwd/{dtypes}/hd{head_dim}/local/paged"
    try:
        bundle.select(key, torch.cuda.get_device_capability())
    except KernelNotFound as exc:
        pytest.skip(f"bundle has no {key}: {str(exc).splitlines()[0]}")
    result = subprocess.run([str(example.with_name("fagen_decode_paged")), "--bundle", str(bundle.path), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout and "merge:" in result.stdout
