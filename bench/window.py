"""Sliding windows: fagen's local kernels against torch's FlashAttention-2 kernel with the same
window (aten's _flash_attention_forward / _backward, which take window_size_left / right), and
against fagen's own dense kernel over as many keys as the window holds, same process.

Protocol as bench.attention (bf16, 16384 * 2 tokens per batch at 32k, hidden 2048, median of
triton's do_bench), with the FLOPs of the (query, key) pairs the window lets through:
4 * d per visible pair forward, 2.5x that backward.

    python -m bench.window [--seqlens 16k,32k] [--windows 1k,4k] [--head-dims 64,128]
                           [--direction fwd|bwd] [--repeats N] [--bundle DIR] [--json PATH]

Columns: TFLOP/s of fagen (window, causal: keys i - left ... i), of torch's FA2 kernel with
the same window, their ratio, and `dense`: fagen's causal kernel over `left` + 1 keys per query
row (seqlen_k = window + 1 ... the same rows), whose time a window's should approach; the
issue's bar is window time <= 1.2x dense time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch

from bench import cuda_missing, write_rows
from bench.attention import DIRECTION_FLOPS, HIDDEN, _int_list, median_ms, rotating_samples, tflops
from fagen.torch import flash_attn_func, get_bundle

TOKENS = 32768


def visible_pairs(seqlen: int, left: int) -> int:
    """(query, key) pairs of a causal window of `left` keys back over seqlen x seqlen."""
    full = min(seqlen, left + 1)
    return full * (full + 1) // 2 + (seqlen - full) * (left + 1)


class _TorchFlashWindow(torch.autograd.Function):
    """torch's FA2 kernel, causal, window (left, 0), with its own backward."""

    @staticmethod
    def forward(ctx, q, k, v, left):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False,
            window_size_left=left, window_size_right=0)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.left = left
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, True, seed, offset,
            window_size_left=ctx.left, window_size_right=0)
        return dq, dk, dv, None


def timed(direction, attention, q, k, v, dout):
    if direction == "fwd":
        return lambda: attention(q, k, v)
    out = attention(q, k, v)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def measure(head_dim: int, seqlen: int, left: int, bundle, direction: str, repeats: int) -> dict:
    batch, heads = max(1, TOKENS // seqlen), HIDDEN // head_dim
    grad = direction != "fwd"

    def inputs(keys):
        return [torch.randn(batch, n, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                for n in (seqlen, keys, keys)]

    q, k, v = inputs(seqlen)
    dout = torch.randn_like(q)
    pairs = batch * heads * visible_pairs(seqlen, left)
    dense_q, dense_k, dense_v = inputs(left + 1)
    row = {"head_dim": head_dim, "seqlen": seqlen, "window": left, "direction": direction, "ms": {}, "errors": {}}
    contenders = {
        "fagen": timed(direction, lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(left, 0),
                                                                  bundle=bundle), q, k, v, dout),
        "dense": timed(direction, lambda q, k, v: flash_attn_func(q, k, v, bundle=bundle),
                       dense_q, dense_k, dense_v, dout),
    }
    try:
        contenders["FA2"] = timed(direction, lambda q, k, v: _TorchFlashWindow.apply(q, k, v, left), q, k, v, dout)
        with torch.no_grad():
            reference = _TorchFlashWindow.apply(q, k, v, left)
        ours = flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True, window_size=(left, 0), bundle=bundle)
        row["max_abs_diff_vs_FA2"] = (ours.float() - reference.float()).abs().max().item()
    except (RuntimeError, TypeError) as exc:
        row["errors"]["FA2"] = str(exc).splitlines()[0]
    samples = rotating_samples({name: functools.partial(median_ms, fn) for name, fn in contenders.items()},
                               repeats, row["errors"])
    row["ms"] = {name: statistics.median(s) for name, s in samples.items() if s}
    dense_pairs = batch * heads * seqlen * (left + 1)
    flops = {"fagen": pairs, "FA2": pairs, "dense": dense_pairs}
    row["tflops"] = {name: tflops(4.0 * head_dim * flops[name] * DIRECTION_FLOPS[direction], ms)
                     for name, ms in row["ms"].items()}
    return row


def format_table(rows: list[dict]) -> str:
    lines = ["| dir | hd | seqlen | window | fagen TFLOP/s | FA2 TFLOP/s | fagen/FA2 | time / dense time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, ms = r["tflops"], r["ms"]
        ratio = f"{t['fagen'] / t['FA2']:.2f}" if "fagen" in t and "FA2" in t else "-"
        dense = f"{ms['fagen'] / ms['dense']:.2f}" if "fagen" in ms and "dense" in ms else "-"
        lines.append(f"| {r['direction']} | {r['head_dim']} | {r['seqlen']} | {r['window']} | "
                     f"{t.get('fagen', 0):.0f} | {t.get('FA2', 0):.0f} | {ratio} | {dense} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.window", description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=_int_list, default=[16384, 32768])
    parser.add_argument("--windows", type=_int_list, default=[1024, 4096])
    parser.add_argument("--head-dims", type=_int_list, default=[64, 128])
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if cuda_missing("bench.window"):
        return 2
    bundle = get_bundle(args.bundle)
    rows = []
    for head_dim in args.head_dims:
        for seqlen in args.seqlens:
            for window in args.windows:
                rows.append(measure(head_dim, seqlen, window, bundle, args.direction, args.repeats))
                print(f"measured {rows[-1]}", flush=True)
    if args.json_path:
        write_rows(args.json_path, rows)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
