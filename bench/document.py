"""A custom mask compiled in ahead of time: fagen's worked example (examples/masks/document.cuh, a
document mask for packed sequences, causal within each document) against torch's FlexAttention
with the same mask as a BlockMask (JIT-compiled by torch.compile), and against fagen's own causal
kernel over the whole sequence, whose time the document mask's block skipping should cut to
about the documents' share of the causal pairs. Same process, same shapes.

    fagen build examples/masks/document.yaml -o DIR       # any machine, no GPU
    python -m bench.document --bundle DIR [--documents 512,2k,8k] [--direction fwd|bwd]

Protocol as bench.attention: bf16, one row of 16384 tokens packed with documents of one length,
16 heads of 128 (hidden 2048), median of triton's do_bench, rounds in rotating order; TFLOP/s of
the visible pairs (4 d FLOPs each forward, 2.5x that backward). The causal kernel comes from
--causal-bundle (default: fagen's default bundle).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from bench import cuda_missing, write_rows
from bench.attention import DIRECTION_FLOPS, HIDDEN, TOTAL_TOKENS, _int_list, median_ms, rotating_samples, tflops
from bench.window import timed
from fagen.torch import flash_attn_func, get_bundle

HEAD_DIM = 128


def flex_document_attention(documents: torch.Tensor):
    """FlexAttention (compiled) under the document mask, in flash-attn's layout, or the reason it
    is not available."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return None, str(exc)

    def document_causal(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seqlen = documents.shape
    block_mask = create_block_mask(document_causal, batch, None, seqlen, seqlen, device="cuda")
    compiled = torch.compile(flex_attention)

    def attention(q, k, v):
        out = compiled(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask)
        return out.transpose(1, 2)

    return attention, None


def measure(document_length: int, direction: str, bundle, causal_bundle, repeats: int) -> dict:
    batch, seqlen, heads = 1, TOTAL_TOKENS, HIDDEN // HEAD_DIM
    grad = direction != "fwd"
    q, k, v = (torch.randn(batch, seqlen, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=grad) for _ in range(3))
    dout = torch.randn_like(q)
    documents = (torch.arange(seqlen, device="cuda", dtype=torch.int32) // document_length).view(1, seqlen)
    row = {"document_length": document_length, "seqlen": seqlen, "direction": direction, "ms": {}, "errors": {}}

    def fagen_document(q, k, v):
        return flash_attn_func(q, k, v, mask_mod="document", mask_args=documents, bundle=bundle)

    contenders = {"fagen": timed(direction, fagen_document, q, k, v, dout),
                  "causal": timed(direction, lambda q, k, v: flash_attn_func(q, k, v, causal=True, bundle=causal_bundle),
                                  q, k, v, dout)}
    flex, why = flex_document_attention(documents)
    if flex is None:
        row["errors"]["flex"] = why
    else:
        try:
            with torch.no_grad():
                row["max_abs_diff_vs_flex"] = (fagen_document(q, k, v).float() - flex(q, k, v).float()).abs().max().item()
            contenders["flex"] = timed(direction, flex, q, k, v, dout)
        except Exception as exc:  # torch.compile's errors are of many types
            row["errors"]["flex"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    samples = rotating_samples({name: functools.partial(median_ms, fn) for name, fn in contenders.items()},
                               repeats, row["errors"])
    row["ms"] = {name: statistics.median(s) for name, s in samples.items() if s}
    full, part = divmod(seqlen, document_length)
    pairs = heads * (full * document_length * (document_length + 1) // 2 + part * (part + 1) // 2)
    causal_pairs = heads * seqlen * (seqlen + 1) // 2
    flops = 4.0 * HEAD_DIM * DIRECTION_FLOPS[direction]
    row["tflops"] = {name: tflops(flops * (causal_pairs if name == "causal" else pairs), ms)
                     for name, ms in row["ms"].items()}
    row["pair_share"] = pairs / causal_pairs
    return row


def format_table(rows: list[dict]) -> str:
    lines = ["| dir | document | seqlen | fagen TFLOP/s | flex TFLOP/s | fagen/flex | pairs / causal's | "
             "time / causal's |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, ms = r["tflops"], r["ms"]
        ratio = f"{t['fagen'] / t['flex']:.2f}" if "fagen" in t and "flex" in t else "-"
        share = f"{ms['fagen'] / ms['causal']:.3f}" if "fagen" in ms and "causal" in ms else "-"
        lines.append(f"| {r['direction']} | {r['document_length']} | {r['seqlen']} | {t.get('fagen', 0):.0f} | "
                     f"{t.get('flex', 0):.0f} | {ratio} | {r['pair_share']:.3f} | {share} |")
    for r in rows:
        for name, text in r["errors"].items():
            lines.append(f"  {r['direction']} document {r['document_length']} {name}: {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.document", description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True, help="a bundle with the document mask (examples/masks/document.yaml)")
    parser.add_argument("--causal-bundle", default=None, help="the causal kernel's (default: fagen's default bundle)")
    parser.add_argument("--documents", type=_int_list, default=[512, 2048, 8192], help="document lengths")
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if cuda_missing("bench.document"):
        return 2
    bundle, causal_bundle = get_bundle(args.bundle), get_bundle(args.causal_bundle)
    rows = []
    for length in args.documents:
        rows.append(measure(length, args.direction, bundle, causal_bundle, args.repeats))
        print(f"measured {rows[-1]}", flush=True)
    if args.json_path:
        write_rows(args.json_path, rows)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
