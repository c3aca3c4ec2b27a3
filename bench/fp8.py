"""The FP8 (e4m3) forward against fagen's own bf16 forward and cuDNN's FP8 attention, same
process, same run, with the e4m3 matmul ceiling measured at the start (shared/BENCHMARKS.md:
FLOPs as for bf16, 16k tokens per batch, hidden 2048, rotating rounds, median of do_bench).

    python -m bench.fp8 [--seqlens 512,...,16384] [--head-dims 128,256] [--causal both|yes|no]
                        [--repeats N] [--bundle DIR] [--json PATH] [--no-cudnn] [--accuracy]

--accuracy prints, instead of the timings, the FP8 forward's relative error against fp64
attention of the unquantised inputs, with and without incoherent processing
(fagen.torch.incoherent_qk), on inputs without outliers and with FlashAttention-3's (N(0, 1)
plus N(0, 100) on 0.1 % or 1 % of the elements of q and k), beside the bf16 forward's.

cuDNN's FP8 graph comes from the `nvidia-cudnn-frontend` package (bench/cudnn_fp8.py), which the
GPU machine lacks: carry its wheel and put it on PYTHONPATH; without it the rows have no cuDNN
column. On Hopper cuDNN writes an e4m3 output (1 byte per element; fagen writes bf16, 2 bytes).
Inputs: random bf16 quantised per tensor (descale = amax / 448), never zeros.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench import cuda_missing, write_rows
from bench.attention import (
    HIDDEN, TOTAL_TOKENS, _int_list, attention_flops, median_ms, rotating_samples, tflops,
)
from fagen.torch import KernelNotFound, flash_attn_func, get_bundle, incoherent_qk, quantize_e4m3

def measure(head_dim: int, causal: bool, seqlen: int, bundle, repeats: int, cudnn_peer) -> dict:
    batch, heads = TOTAL_TOKENS // seqlen, HIDDEN // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)
    row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "nheads": heads,
           "errors": {}, "ms": {}, "tflops": {}}
    contenders = {
        "fp8": lambda: flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                       bundle=bundle),
        "bf16": lambda: flash_attn_func(q, k, v, causal=causal, bundle=bundle),
    }
    try:
        ours = contenders["fp8"]().float()
    except (RuntimeError, KernelNotFound, ValueError) as exc:
        row["errors"]["fp8"] = str(exc).splitlines()[0]
        return row
    try:
        reference = contenders["bf16"]().float()
        row["max_abs_diff_vs_bf16"] = (ours - reference).abs().max().item()
    except KernelNotFound as exc:  # a bundle of FP8 kernels alone (a tile sweep's)
        row["errors"]["bf16"] = str(exc).splitlines()[0]
        contenders.pop("bf16")
        reference = ours
    if cudnn_peer is not None:
        try:
            graph = cudnn_peer(batch, seqlen, seqlen, heads, heads, head_dim, causal, head_dim ** -0.5)
            contenders["cuDNN-fp8"] = lambda: graph(q8, k8, v8, qd, kd, vd)
            row["max_abs_diff_cudnn_vs_bf16"] = (contenders["cuDNN-fp8"]().float() - reference).abs().max().item()
        except Exception as exc:  # cuDNN refuses shapes with its own exception types
            row["errors"]["cuDNN-fp8"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            contenders.pop("cuDNN-fp8", None)
    samples = rotating_samples({name: (lambda fn=fn: median_ms(fn)) for name, fn in contenders.items()}, repeats,
                               row["errors"])
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
    for name, times in samples.items():
        row["ms"][name] = statistics.median(times)
        row["tflops"][name] = tflops(flops, row["ms"][name])
    return row


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).norm() / reference.norm()).item()


def accuracy_rows(bundle, head_dims, batch=2, seqlen=2048, heads=16) -> list[str]:
    lines = ["| hd | outliers | fp8 | fp8, incoherent | incoherent gain | bf16 |", "|---|---|---|---|---|---|"]
    for head_dim in head_dims:
        for share in (0.0, 0.001, 0.01):
            g = torch.Generator(device="cuda").manual_seed(head_dim)
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", generator=g) for _ in range(3))
            for x in (q, k):
                x += (torch.rand(x.shape, device="cuda", generator=g) < share) * torch.randn(
                    x.shape, device="cuda", generator=g) * 10
            qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
            reference = torch.softmax(qh @ kh.transpose(-1, -2) / head_dim ** 0.5, -1) @ vh
            reference = reference.transpose(1, 2)
            errors = []
            for rotate in (False, True):
                qr, kr = incoherent_qk(q, k) if rotate else (q, k)
                (q8, qd), (k8, kd), (v8, vd) = quantize_e4m3(qr), quantize_e4m3(kr), quantize_e4m3(v)
                out = flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, bundle=bundle)
                errors.append(relative_error(out, reference))
            bf16 = relative_error(flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), bundle=bundle), reference)
            lines.append(f"| {head_dim} | {share:.1%} | {errors[0]:.4f} | {errors[1]:.4f} | "
                         f"{errors[0] / errors[1]:.2f} | {bf16:.4f} |")
    return lines


def format_table(rows: list[dict], ceiling: float | None) -> str:
    lines = [f"FP8 forward TFLOP/s (16k tokens, hidden 2048); e4m3 matmul ceiling {ceiling or float('nan'):.0f}",
             "| hd | causal | seqlen | fp8 | bf16 | cuDNN-fp8 | fp8/bf16 | fp8/cuDNN | fp8/ceiling | maxdiff |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tflops"]
        fp8, bf16, peer = t.get("fp8"), t.get("bf16"), t.get("cuDNN-fp8")

        def cell(x, digits=0):
            return f"{x:.{digits}f}" if x else "-"
        lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | {cell(fp8)} | "
                     f"{cell(bf16)} | {cell(peer)} | {cell(fp8 and bf16 and fp8 / bf16, 2)} | "
                     f"{cell(fp8 and peer and fp8 / peer, 2)} | {cell(fp8 and ceiling and fp8 / ceiling, 2)} | "
                     f"{cell(r.get('max_abs_diff_vs_bf16'), 3)} |")
    for r in rows:
        for name, text in r["errors"].items():
            lines.append(f"  hd{r['head_dim']} {'causal' if r['causal'] else 'full'} s{r['seqlen']} {name}: {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8", description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=_int_list, default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=_int_list, default=[128, 256])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--no-cudnn", action="store_true")
    parser.add_argument("--accuracy", action="store_true")
    args = parser.parse_args(argv)
    if cuda_missing("bench.fp8"):
        return 2
    bundle = get_bundle(args.bundle)
    if args.accuracy:
        print("\n".join(accuracy_rows(bundle, args.head_dims)))
        return 0
    cudnn_peer = None
    if not args.no_cudnn:
        from bench import cudnn_fp8

        reason = cudnn_fp8.available()
        if reason is None:
            cudnn_peer = cudnn_fp8.CudnnFp8Attention
        else:
            print(f"cuDNN FP8: not measured ({reason})", flush=True)
    from bench.cudnn_fp8 import e4m3_matmul_tflops

    ceiling = e4m3_matmul_tflops()
    print(f"e4m3 matmul 8192^3: {ceiling:.0f} TFLOP/s", flush=True)
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    for head_dim in args.head_dims:
        for is_causal in causal:
            for seqlen in args.seqlens:
                rows.append(measure(head_dim, is_causal, seqlen, bundle, args.repeats, cudnn_peer))
                print(f"measured {rows[-1]}", flush=True)
    if args.json_path:
        write_rows(args.json_path, rows)
    print(format_table(rows, ceiling))
    return 0


if __name__ == "__main__":
    sys.exit(main())
