"""cuDNN's FP8 (e4m3) attention forward, as a peer for fagen's FP8 kernels in the same process.

torch SDPA has no FP8 path, so the peer is cuDNN's `sdpa_fp8` graph built through the
`nvidia-cudnn-frontend` package (`import cudnn`), on the cuDNN that torch itself loaded.
Inputs are flash-attn's layout (batch, seqlen, heads, head_dim) in float8_e4m3fn with one fp32
descale per tensor (x ~ x8 * descale); cuDNN is told the dims in its (b, h, s, d) order with the
strides of that layout, so no copy is timed.

What cuDNN's FP8 forward allows (the frontend's sdpa_support_surface.h, 1.32):
- O is bf16 only on Blackwell with cuDNN >= 9.13. On Hopper O is e4m3 (scale_o = 1 here), so
  an H200 timing writes 1 byte per output element where fagen's bf16 output writes 2.
- GQA: heads_q a multiple of heads_kv. Head dims: multiples of 16 up to 256 on Hopper, up to
  128 on Blackwell (192/128 and 256 with newer cuDNN). Causal: top-left only on Hopper, which
  is flash-attn's causal when seqlen_q == seqlen_k.
- P is quantised to e4m3 as P * scale_s with scale_s = 448: P <= 1, so the whole e4m3 range is
  used (the value the binding's docstring asks for without dropout). cuDNN also writes amax(S)
  and amax(O), two fp32 scalars; every cuDNN sample declares them, so they are kept.

An unsupported shape raises from the constructor with cuDNN's message, so a benchmark can
print it in that row. The smoke check below (accuracy against an fp32 reference, timings and
the e4m3 matmul ceiling) runs on a GPU with the wheel carried in .whl/:

    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python -m bench.cudnn_fp8

--no-deps is enough: the wheel's dependencies (nvidia-cutlass-dsl, apache-tvm-ffi) serve the
frontend's own CuTe DSL engines, none of which runs FP8 on Hopper; the graph here is lowered to
the cuDNN library. The frontend loads a libcudnn.so.9 found on LD_LIBRARY_PATH first, else the one
in the interpreter's site-packages (torch's nvidia-cudnn); the first line printed names its version.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bench import cuda_missing
from bench.attention import median_ms
from fagen.torch.quantize import quantize_e4m3

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
P_SCALE = E4M3_MAX  # scale_s: softmax probabilities (<= 1) onto the whole e4m3 range


def output_dtype(device="cuda") -> torch.dtype:
    """bf16 where cuDNN's FP8 forward can write it (Blackwell, cuDNN >= 9.13), else e4m3."""
    import cudnn

    blackwell = torch.cuda.get_device_capability(device)[0] >= 10
    return torch.bfloat16 if blackwell and cudnn.backend_version() >= 91300 else torch.float8_e4m3fn


class CudnnFp8Attention:
    """One cuDNN FP8 SDPA forward graph, built once for one shape; call it with e4m3 q, k, v.

    The output buffer is allocated once and returned by every call (its dtype is
    `self.out_dtype`): clone it to keep a result past the next call. An e4m3 output is written
    with scale_o = 1, so it holds |O| <= 448, which attention of the benchmark's inputs keeps to.
    """

    def __init__(self, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, softmax_scale,
                 device="cuda"):
        import cudnn

        if heads_q % heads_kv:
            raise ValueError(f"heads_q {heads_q} is not a multiple of heads_kv {heads_kv}")
        fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        self.out_dtype = output_dtype(device)
        self._handle = _handle(torch.device(device))
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32,
                              handle=self._handle)

        def layout(seqlen, heads):  # cuDNN's (b, h, s, d) dims over a contiguous (b, s, h, d) tensor
            return [batch, heads, seqlen, head_dim], [seqlen * heads * head_dim, head_dim, heads * head_dim, 1]

        def fp8_input(name, seqlen, heads):
            dim, stride = layout(seqlen, heads)
            return graph.tensor(name=name, dim=dim, stride=stride, data_type=fp8)

        def scalar(name):
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)

        self._q = fp8_input("q", seqlen_q, heads_q)
        self._k = fp8_input("k", seqlen_k, heads_kv)
        self._v = fp8_input("v", seqlen_k, heads_kv)
        self._descales = [scalar(name) for name in ("descale_q", "descale_k", "descale_v")]
        descale_s, scale_s, scale_o = scalar("descale_s"), scalar("scale_s"), scalar("scale_o")
        mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, right_bound=0) if causal else {}
        out, _stats, amax_s, amax_o = graph.sdpa_fp8(
            self._q, self._k, self._v, *self._descales, descale_s, scale_s, scale_o,
            generate_stats=False, attn_scale=softmax_scale, name="sdpa_fp8", **mask)
        dim, stride = layout(seqlen_q, heads_q)
        out_type = cudnn.data_type.BFLOAT16 if self.out_dtype == torch.bfloat16 else fp8
        out.set_output(True).set_dim(dim).set_stride(stride).set_data_type(out_type)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()

        def one_float(value):
            return torch.full((1,), value, dtype=torch.float32, device=device)

        self.out = torch.empty(batch, seqlen_q, heads_q, head_dim, dtype=self.out_dtype, device=device)
        # Every buffer cuDNN reads or writes besides q, k, v and their descales: held here so
        # that none is freed while a launched graph may still use it.
        self._fixed = {descale_s: one_float(1 / P_SCALE), scale_s: one_float(P_SCALE), scale_o: one_float(1.0),
                       out: self.out, amax_s: one_float(0.0), amax_o: one_float(0.0)}
        self._workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
        self._graph = graph
        self._set_stream = cudnn.set_stream

    def __call__(self, q8, k8, v8, descale_q, descale_k, descale_v):
        """q8, k8, v8: contiguous float8_e4m3fn (batch, seqlen, heads, head_dim) of the built shape;
        descales: one-element fp32 CUDA tensors (x ~ x8 * descale)."""
        # On the caller's stream, as a torch kernel would be (the handle remembers it).
        self._set_stream(self._handle, torch.cuda.current_stream().cuda_stream)
        pack = {self._q: q8, self._k: k8, self._v: v8, **dict(zip(self._descales, (descale_q, descale_k, descale_v))),
                **self._fixed}
        self._graph.execute(pack, self._workspace, handle=self._handle)
        return self.out


@functools.cache
def _handle(device: torch.device):
    """One cuDNN handle per device for every graph: a handle holds device resources, and the
    graphs here run one after another on one thread, which is all a shared handle needs."""
    import cudnn

    with torch.cuda.device(device):
        return cudnn.create_handle()


def available() -> str | None:
    """None when `import cudnn` works and a small FP8 graph builds here, else the reason."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        CudnnFp8Attention(1, 128, 128, 1, 1, 64, False, 0.125)
    except Exception as exc:  # noqa: BLE001 - any failure is the reason this peer is absent
        return f"{type(exc).__name__}: {exc}"
    return None


def _failure(exc: Exception) -> str:
    """A row's result when cuDNN refused its shape (or the run failed): the table shows why."""
    return f"cuDNN FP8: {type(exc).__name__}: {exc}"


def e4m3_matmul_tflops(n=8192) -> float:
    """TFLOP/s of an n x n x n e4m3 matmul (torch._scaled_mm, bf16 out): what FP8 tensor cores
    give here, the ceiling an FP8 attention's TFLOP/s is read against."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.tensor(1.0, device="cuda")
    ms = median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def reference(q, k, v, causal, softmax_scale):
    """fp32 attention of (batch, seqlen, heads, head_dim) tensors, GQA by repeating k and v."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * softmax_scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores.masked_fill_(future, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def bf16_sdpa(q, k, v, causal, softmax_scale):
    q, k, v = (x.to(torch.bfloat16).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                          enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)


def accuracy_rows(batch=2, seqlen=1024):
    """Max abs error of cuDNN FP8 and of bf16 SDPA against fp32 attention of the same dequantised
    inputs, and the error of rounding that fp32 answer to cuDNN's output dtype (the floor any
    kernel writing that dtype has)."""
    cases = [(hd, causal, 8, 8) for hd in (64, 128, 256) for causal in (False, True)] + [(128, False, 8, 2)]
    rows = []
    for head_dim, causal, heads_q, heads_kv in cases:
        name = f"hd{head_dim} {'causal' if causal else 'full'} {heads_q}:{heads_kv}"
        softmax_scale = head_dim**-0.5
        try:
            attn = CudnnFp8Attention(batch, seqlen, seqlen, heads_q, heads_kv, head_dim, causal, softmax_scale)
        except Exception as exc:  # noqa: BLE001 - the reason is this row's result
            rows.append((name, "", _failure(exc)))
            print(*rows[-1])
            continue
        for magnitude in (1, 4):
            try:
                shapes = [(batch, seqlen, heads, head_dim) for heads in (heads_q, heads_kv, heads_kv)]
                quantized = [quantize_e4m3(torch.randn(s, device="cuda", dtype=torch.bfloat16) * magnitude) for s in shapes]
                q, k, v = (x8.float() * descale for x8, descale in quantized)
                expected = reference(q, k, v, causal, softmax_scale)
                out = attn(*(x8 for x8, _ in quantized), *(descale for _, descale in quantized)).float()
                errors = [(out - expected).abs().max().item(),
                          (bf16_sdpa(q, k, v, causal, softmax_scale).float() - expected).abs().max().item(),
                          (expected.to(attn.out_dtype).float() - expected).abs().max().item()]
                rows.append((name, f"x{magnitude}", "  ".join(f"{e:10.5f}" for e in errors)))
            except Exception as exc:  # noqa: BLE001
                rows.append((name, f"x{magnitude}", _failure(exc)))
            print(*rows[-1])
    return rows


def timing_rows(tokens=16384, heads=16, head_dim=128):
    """Median ms and TFLOP/s (4*b*h*s^2*d, halved when causal) at seqlen 4096 and 8192."""
    rows = []
    for seqlen in (4096, 8192):
        batch = tokens // seqlen
        for causal in (False, True):
            name = f"s{seqlen} b{batch} {'causal' if causal else 'full'}"
            try:
                attn = CudnnFp8Attention(batch, seqlen, seqlen, heads, heads, head_dim, causal, head_dim**-0.5)
                args = [quantize_e4m3(torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16))
                        for _ in range(3)]
                q8, k8, v8 = (x8 for x8, _ in args)
                descales = [descale for _, descale in args]
                ms = median_ms(lambda: attn(q8, k8, v8, *descales))
                flops = 4 * batch * heads * seqlen**2 * head_dim / (2 if causal else 1)
                rows.append((name, f"{ms:8.3f} ms  {flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s"))
            except Exception as exc:  # noqa: BLE001
                rows.append((name, _failure(exc)))
            print(*rows[-1])
    return rows


def main() -> int:
    if cuda_missing("bench.cudnn_fp8"):
        return 2
    reason = available()
    if reason is not None:
        print(f"cuDNN FP8: {reason}")
        return 1
    import cudnn

    print(f"{torch.cuda.get_device_name()}, cuDNN {cudnn.backend_version_string()}, "
          f"frontend {cudnn.__version__}, torch {torch.__version__}, cuDNN FP8 output {output_dtype()}")
    accuracy = accuracy_rows()
    timing = timing_rows()
    try:
        matmul = f"{e4m3_matmul_tflops():.1f} TFLOP/s"
    except Exception as exc:  # noqa: BLE001
        matmul = f"{type(exc).__name__}: {exc}"

    print("\nmax abs error vs fp32 attention of the dequantised inputs (batch 2, seqlen 1024)")
    print(f"{'case':22s} {'input':5s}  {'cuDNN FP8':>10s}  {'bf16 SDPA':>10s}  {'O rounding':>10s}")
    for name, magnitude, result in accuracy:
        print(f"{name:22s} {magnitude:5s}  {result}")
    print("\ncuDNN FP8 forward, 16384 tokens, 16 heads, head_dim 128")
    for name, result in timing:
        print(f"{name:22s} {result}")
    print(f"\ne4m3 matmul 8192^3 (torch._scaled_mm): {matmul}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
