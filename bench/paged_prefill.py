"""Prefill over a KV cache: flash_attn_with_kvcache with many new query tokens per row (vLLM's
prefill and chunked-prefill calls: packed queries, a paged cache) against fagen's varlen call
over the same keys packed contiguously, same process (bench.attention's protocol: bf16, rotating
rounds, median of triton's do_bench).

    python -m bench.paged_prefill [--head-dims 64,128] [--heads 32:8] [--rows 4x4096+0,2x2048+14336]
                                  [--pages 16,64,256] [--repeats N] [--bundle DIR] [--json PATH]

A row `BxN+C`: B requests, each N new query tokens over C keys already cached (the cache then
holds C + N keys per request, the new ones bottom-right, causal). Contenders: `varlen`
(flash_attn_varlen_func, K/V packed), `contiguous` (the cache as (batch, capacity) rows), `pN`
(pages of N keys in a random order; each call on the kernel fagen.runtime.kvcache.select_kvcache
picks), and at the first page size `split` and `tiles`, the same call with the choice forced
onto the split-KV decode kernels (what a prefill ran before the tile kernels) or onto the tile
kernels (contract.PAGED_TILE_MIN_QUERIES set past or below the row's new tokens: the rows under
it show where the choice should turn). TFLOP/s of the (query, key) pairs each request computes.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

from unittest import mock

import torch

from bench import cuda_missing, write_rows
from fagen import contract
from bench.attention import _int_list, median_ms, rotating_samples, tflops
from fagen.torch import flash_attn_varlen_func, flash_attn_with_kvcache, get_bundle


def pairs(new: int, cached: int) -> int:
    """Causal pairs of `new` queries bottom-right over cached + new keys."""
    return new * cached + new * (new + 1) // 2


def _row(text: str) -> tuple[int, int, int]:
    shape, cached = text.split("+")
    batch, new = shape.split("x")
    return int(batch), int(new), int(cached)


def _heads(text: str) -> tuple[int, int]:
    q, kv = text.split(":")
    return int(q), int(kv)


def paged(k: torch.Tensor, v: torch.Tensor, page_size: int, seed: int = 0):
    """(batch, capacity, heads, d) rows as pages of page_size keys in a random order."""
    batch, capacity, heads, dim = k.shape
    per_row = -(-capacity // page_size)
    pages = batch * per_row
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).to(k.device)
    table = order.view(batch, per_row).to(torch.int32)
    k_pages = torch.empty(pages, page_size, heads, dim, device=k.device, dtype=k.dtype)
    v_pages = torch.empty_like(k_pages)
    padded = per_row * page_size
    for source, target in ((k, k_pages), (v, v_pages)):
        rows = torch.zeros(batch, padded, heads, dim, device=k.device, dtype=k.dtype)
        rows[:, :capacity] = source
        target[table.view(-1).long()] = rows.view(pages, page_size, heads, dim)
    return k_pages, v_pages, table


def measure(head_dim: int, heads: tuple[int, int], batch: int, new: int, cached: int, page_sizes: list[int],
            bundle, repeats: int) -> dict:
    heads_q, heads_kv = heads
    keys = cached + new
    dtype = torch.bfloat16
    q = torch.randn(batch * new, heads_q, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, keys, heads_kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * new
    cu_k = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * keys
    lengths = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    k_packed, v_packed = k.reshape(-1, heads_kv, head_dim), v.reshape(-1, heads_kv, head_dim)

    def cache_call(k_cache, v_cache, table, **options):
        return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                               cu_seqlens_q=cu_q, max_seqlen_q=new, causal=True, bundle=bundle,
                                               **options)

    contenders = {
        "varlen": lambda: flash_attn_varlen_func(q, k_packed, v_packed, cu_q, cu_k, new, keys, causal=True,
                                                 bundle=bundle),
        "contiguous": cache_call(k, v, None),
    }
    for page_size in page_sizes:
        contenders[f"p{page_size}"] = cache_call(*paged(k, v, page_size))
    if page_sizes:
        first = cache_call(*paged(k, v, page_sizes[0]))
        for name, threshold in (("split", new + 1), ("tiles", 1)):
            contenders[name] = functools.partial(_choosing, first, threshold)
    row = {"head_dim": head_dim, "heads": f"{heads_q}:{heads_kv}", "batch": batch, "new": new, "cached": cached,
           "errors": {}}
    reference = contenders["varlen"]().float()
    row["max_abs_diff"] = {n: float((fn().float() - reference).abs().max()) for n, fn in contenders.items()
                           if n != "varlen"}
    samples = rotating_samples({n: functools.partial(median_ms, fn) for n, fn in contenders.items()},
                               repeats, row["errors"])
    row["ms"] = {n: statistics.median(s) for n, s in samples.items() if s}
    flops = 4.0 * head_dim * heads_q * batch * pairs(new, cached)
    row["tflops"] = {n: tflops(flops, ms) for n, ms in row["ms"].items()}
    return row


def _choosing(call, threshold: int):
    with mock.patch.object(contract, "PAGED_TILE_MIN_QUERIES", threshold):
        return call()


def format_table(rows: list[dict]) -> str:
    names = [n for n in rows[0]["tflops"]] if rows else []
    header = "| hd | heads | batch x new + cached | " + " | ".join(names) + " | paged ÷ varlen |"
    lines = [header, "|" + "---|" * (4 + len(names))]
    for r in rows:
        t = r["tflops"]
        paged_names = [n for n in t if n.startswith("p")]
        ratio = (f"{min(t[n] for n in paged_names) / t['varlen']:.2f}-{max(t[n] for n in paged_names) / t['varlen']:.2f}"
                 if paged_names and "varlen" in t else "-")
        cells = " | ".join(f"{t[n]:.0f}" if n in t else "-" for n in names)
        lines.append(f"| {r['head_dim']} | {r['heads']} | {r['batch']}x{r['new']}+{r['cached']} | {cells} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.paged_prefill", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=_int_list, default=[64, 128])
    parser.add_argument("--heads", type=_heads, default=(32, 8))
    parser.add_argument("--rows", type=lambda s: [_row(r) for r in s.split(",")],
                        default=[(4, 4096, 0), (16, 1024, 0), (2, 2048, 14336), (1, 16384, 0)])
    parser.add_argument("--pages", type=_int_list, default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if cuda_missing("bench.paged_prefill"):
        return 2
    bundle = get_bundle(args.bundle)
    rows = []
    for head_dim in args.head_dims:
        for batch, new, cached in args.rows:
            rows.append(measure(head_dim, args.heads, batch, new, cached, args.pages, bundle, args.repeats))
            print(f"measured {rows[-1]}", flush=True)
    if args.json_path:
        write_rows(args.json_path, rows)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
