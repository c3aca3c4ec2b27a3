"""Score modifiers (softcap, attention sinks, ALiBi) and split head dims: fagen's variant kernels
against flash-attn-4 (CuTe DSL, its Hopper path: softcap and learnable_sink, not ALiBi) where it
is importable and takes the variant, cuDNN (torch's SDPA) for the split head dims, and fagen's
own kernel of the same mask without the modifier (what the modifier costs), same process.

Protocol as bench.attention (bf16, 16384 tokens per batch, hidden 2048, median of triton's
do_bench; rounds in rotating order), the model families' shapes: softcap 50 at head dims 128 and
256 (Gemma-2) causal and with its window of 4096 keys; sinks at head dim 64 (gpt-oss) causal and
with its window of 128; ALiBi at 128 causal (BLOOM, MPT); q, k of 192 and v of 128 causal
(split: DeepSeek-V3's prefill). FLOPs per visible (query, key) pair: 2 (d + d_v) forward (Q K^T
and P V), 6 d + 4 d_v backward (the scores again, dP, dV, dQ, dK): 4 d and 2.5x that where
d_v = d.

    python -m bench.score [--variants softcap,sinks,alibi,window,split] [--seqlens 4k,16k]
                          [--direction fwd|bwd] [--repeats N] [--bundle DIR] [--json PATH]

flash-attn-4 runs with PYTHONPATH and CUTE_DSL_LIBS set as ../shared/BENCHMARKS.md says; a row
without it (or where it refuses the variant) says so.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch

from bench import cuda_missing, flash_attn_4, write_rows
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.attention import HIDDEN, TOTAL_TOKENS, _int_list, median_ms, rotating_samples, tflops
from bench.window import timed, visible_pairs
from fagen.torch import flash_attn_func, get_bundle

# variant: (head dims, the windows (left sizes; None: causal without one), the call's options)
VARIANTS = {
    "softcap": ((128, 256), (None, 4095), {"softcap": 50.0}),
    "sinks": ((64,), (None, 127), {"learnable_sink": True}),
    "alibi": ((128,), (None,), {"alibi_slopes": True}),
    "window": ((64, 128), (1023, 4095), {}),  # no modifier: the sliding window alone against FA4
    "split": ((192,), (None,), {}),  # head_dim 192, head_dim_v SPLIT_HEAD_DIM_V (DeepSeek-V3)
}
SPLIT_HEAD_DIM_V = 128


def pair_flops(direction: str, head_dim: int, head_dim_v: int) -> float:
    """FLOPs per visible (query, key) pair (the module's docstring)."""
    return 2.0 * (head_dim + head_dim_v) if direction == "fwd" else 6.0 * head_dim + 4.0 * head_dim_v


def options_of(variant: str, heads: int) -> dict:
    """The call's keyword options, tensors made for `heads` query heads."""
    options = dict(VARIANTS[variant][2])
    if options.pop("learnable_sink", False):
        options["learnable_sink"] = torch.randn(heads, device="cuda", dtype=torch.float32)
    if options.pop("alibi_slopes", False):
        options["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device="cuda")
    return options


def measure(variant: str, head_dim: int, window: int | None, seqlen: int, bundle, direction: str,
            repeats: int, fa4) -> dict:
    batch, heads = max(1, TOTAL_TOKENS // seqlen), HIDDEN // head_dim
    head_dim_v = SPLIT_HEAD_DIM_V if variant == "split" else head_dim
    grad = direction != "fwd"
    q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for dim in (head_dim, head_dim, head_dim_v))
    dout = torch.randn(batch, seqlen, heads, head_dim_v, device="cuda", dtype=torch.bfloat16)
    options = options_of(variant, heads)
    mask = {"causal": True} if window is None else {"causal": True, "window_size": (window, 0)}
    row = {"variant": variant, "head_dim": head_dim, "window": window, "seqlen": seqlen, "direction": direction,
           "ms": {}, "errors": {}}

    contenders = {"fagen": timed(direction, lambda q, k, v: flash_attn_func(q, k, v, **mask, **options, bundle=bundle),
                                 q, k, v, dout)}
    if variant != "split":  # no kernel of the same shape without the split to compare with
        contenders["plain"] = timed(direction, lambda q, k, v: flash_attn_func(q, k, v, **mask, bundle=bundle),
                                    q, k, v, dout)
    else:
        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            return out.transpose(1, 2)

        try:
            with torch.no_grad():
                theirs = cudnn(q, k, v)
                ours = flash_attn_func(q, k, v, **mask, bundle=bundle)
            row["max_abs_diff_vs_cuDNN"] = (ours.float() - theirs.float()).abs().max().item()
            contenders["cuDNN"] = timed(direction, cudnn, q, k, v, dout)
        except RuntimeError as exc:  # SDPA's "no kernel for these inputs"
            row["errors"]["cuDNN"] = str(exc).splitlines()[0]
    if fa4 is None:
        row["errors"]["FA4"] = "flash-attn-4 not importable"
    elif "alibi_slopes" in options:
        row["errors"]["FA4"] = "flash-attn-4 has no ALiBi"
    else:
        fa4_mask = {"causal": True} if window is None else {"causal": True, "window_size": (window, 0)}
        try:
            def theirs_of(q, k, v):
                return fa4(q, k, v, **fa4_mask, **options)

            contenders["FA4"] = timed(direction, theirs_of, q, k, v, dout)
            with torch.no_grad():
                theirs = theirs_of(q, k, v)
                ours = flash_attn_func(q, k, v, **mask, **options, bundle=bundle)
            row["max_abs_diff_vs_FA4"] = (ours.float() - theirs.float()).abs().max().item()
        except Exception as exc:  # the DSL's compile errors are of its own types
            row["errors"]["FA4"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            contenders.pop("FA4", None)
    samples = rotating_samples({name: functools.partial(median_ms, fn) for name, fn in contenders.items()},
                               repeats, row["errors"])
    row["ms"] = {name: statistics.median(s) for name, s in samples.items() if s}
    pairs = batch * heads * visible_pairs(seqlen, seqlen if window is None else window)
    row["tflops"] = {name: tflops(pair_flops(direction, head_dim, head_dim_v) * pairs, ms)
                     for name, ms in row["ms"].items()}
    return row


def format_table(rows: list[dict]) -> str:
    lines = ["| dir | variant | hd | window | seqlen | fagen TFLOP/s | FA4 TFLOP/s | fagen/FA4 | "
             "cuDNN TFLOP/s | fagen/cuDNN | time / plain time |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(t, peer):
        return f"{t['fagen'] / t[peer]:.2f}" if "fagen" in t and peer in t else "-"

    for r in rows:
        t, ms = r["tflops"], r["ms"]
        cost = f"{ms['fagen'] / ms['plain']:.2f}" if "fagen" in ms and "plain" in ms else "-"
        dims = f"{r['head_dim']}/{SPLIT_HEAD_DIM_V}" if r["variant"] == "split" else r["head_dim"]
        lines.append(f"| {r['direction']} | {r['variant']} | {dims} | {r['window'] or '-'} | {r['seqlen']} | "
                     f"{t.get('fagen', 0):.0f} | {t.get('FA4', 0):.0f} | {ratio(t, 'FA4')} | "
                     f"{t.get('cuDNN', 0):.0f} | {ratio(t, 'cuDNN')} | {cost} |")
    for r in rows:
        for name, text in r["errors"].items():
            lines.append(f"  {r['direction']} {r['variant']} hd{r['head_dim']} s{r['seqlen']} {name}: {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.score", description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    parser.add_argument("--seqlens", type=_int_list, default=[4096, 16384])
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}: of {', '.join(VARIANTS)}")
    if cuda_missing("bench.score"):
        return 2
    bundle = get_bundle(args.bundle)
    fa4 = flash_attn_4()
    rows = []
    for variant in variants:
        head_dims, windows, _ = VARIANTS[variant]
        for head_dim in head_dims:
            for window in windows:
                for seqlen in args.seqlens:
                    rows.append(measure(variant, head_dim, window, seqlen, bundle, args.direction, args.repeats, fa4))
                    print(f"measured {rows[-1]}", flush=True)
    if args.json_path:
        write_rows(args.json_path, rows)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
