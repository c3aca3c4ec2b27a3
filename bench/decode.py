"""Decode (one to a few new query tokens over a KV cache): fagen's flash_attn_with_kvcache,
contiguous and paged, against SDPA's FlashAttention-2 and cuDNN in the same process, and
flash-attn-4 (CuTe DSL; its flash_attn_varlen_func with seqused_k, and page_table for the paged
rows, its own split heuristic) where it is importable (../shared/BENCHMARKS.md installs it).

GB/s of K and V read (../shared/BENCHMARKS.md: 2 * batch * seqlen_k * nheads_kv * head_dim *
element bytes / time). Every contender runs as a replayed CUDA graph (what a decoding server
runs), so the host's time per call is out of the comparison; three rounds in rotating order,
the median.

    FAGEN_BUNDLE=generated/default python -m bench.decode
    python -m bench.decode --rows 64x4096 --heads 32:8 --head-dims 128 --pages 0,16

`--fp8-cache` adds fagen over an FP8 (e4m3) copy of the same cache (descales per (batch, KV
head)), contiguous and paged: `fagen-e4m3*`. Its GB/s are counted at bf16's two bytes per
element like every other column, so they are K/V tokens per second on a common scale, and its
ratio to `fagen` (column ÷bf16) is the FP8 cache's gain in tokens per second.

    python -m bench.decode --fp8-cache --rows 1x65536,64x4096,64x16384 --head-dims 64,128,256

`--sweep DIR` times every paged-layout kernel of the bundle at DIR instead (contiguous cache,
each row's shape at its head dim, for each split count of --splits; 0: the runtime's choice),
to pick tiles and check the split heuristic.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import flash_attn_4_function
from bench.attention import median_ms, rotating_samples, timer_name
from fagen import contract
from fagen.runtime import call, kvcache, runs_on
from fagen.torch import flash_attn_with_kvcache, get_bundle, quantize_e4m3
from fagen.torch.adapter import _current_stream

ROWS = ((1, 65536), (16, 65536), (64, 1024), (64, 4096), (64, 16384), (128, 4096))
PEERS = {"FA2": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}


def graphed(fn):
    """`fn` captured in a CUDA graph (after a warm-up call), as a function that replays it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def paged(k, page_size, generator):
    """k (batch, seqlen, heads, d) as pages in a random order and its block table."""
    batch, seqlen, heads, dim = k.shape
    per_row = seqlen // page_size
    order = torch.randperm(batch * per_row, device=k.device, generator=generator)
    pages = torch.empty(batch * per_row, page_size, heads, dim, device=k.device, dtype=k.dtype)
    pages[order] = k.reshape(batch * per_row, page_size, heads, dim)
    return pages, order.view(batch, per_row).to(torch.int32)


def measure(batch, seqlen_k, heads_q, heads_kv, head_dim, page_sizes, bundle, repeats, seqlen_q=1,
            fp8_cache=False) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen)
    lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    contenders, outputs, errors = {}, {}, {}

    def fagen_call(k_cache, v_cache, table, **descales):
        return lambda: outputs.__setitem__(
            "last", flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                            causal=True, bundle=bundle, **descales))

    fa4 = flash_attn_4_function("flash_attn_varlen_func")

    def fa4_call(k_cache, v_cache, table):
        def call():
            out = fa4(q, k_cache, v_cache, seqused_k=lengths, page_table=table, causal=True, num_splits=0)
            return out[0] if isinstance(out, tuple) else out
        return call

    calls = {"fagen": fagen_call(k, v, None)}
    for page_size in page_sizes:
        k_pages, table = paged(k, page_size, gen)
        v_pages = torch.empty_like(k_pages)
        v_pages[table.view(-1).long()] = v.reshape(-1, page_size, heads_kv, head_dim)
        calls[f"fagen-p{page_size}"] = fagen_call(k_pages, v_pages, table)
        if fa4 is not None:
            calls[f"FA4-p{page_size}"] = fa4_call(k_pages, v_pages, table)
    if fp8_cache:
        (k8, k_descale), (v8, v_descale) = quantize_e4m3(k, heads_kv), quantize_e4m3(v, heads_kv)
        descales = {"k_descale": k_descale, "v_descale": v_descale}
        calls["fagen-e4m3"] = fagen_call(k8, v8, None, **descales)
        for page_size in page_sizes:
            k_pages, table = paged(k8.view(torch.uint8), page_size, gen)
            v_pages = torch.empty_like(k_pages)
            v_pages[table.view(-1).long()] = v8.view(torch.uint8).reshape(-1, page_size, heads_kv, head_dim)
            calls[f"fagen-e4m3-p{page_size}"] = fagen_call(k_pages.view(k8.dtype), v_pages.view(k8.dtype), table,
                                                           **descales)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for name, backend in PEERS.items():
        def peer(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=seqlen_q > 1,
                                                      enable_gqa=heads_q != heads_kv).transpose(1, 2)
        calls[name] = peer
    if fa4 is not None:
        calls["FA4"] = fa4_call(k, v, None)
    reference = None
    for name, fn in calls.items():
        try:
            replay = graphed(fn)
            replay()
            torch.cuda.synchronize()
            contenders[name] = lambda replay=replay: median_ms(replay)
            if name == "fagen":
                reference = outputs["last"].float()
            elif not name.startswith("fagen"):
                out = fn().float()
                if reference is not None and (out - reference).abs().max().item() > 2e-2:
                    errors[name + " differs"] = f"{(out - reference).abs().max().item():.3g}"
            elif name.startswith("fagen-e4m3"):  # quantised keys and values: a looser match
                if reference is not None and (outputs["last"].float() - reference).abs().max().item() > 0.1:
                    errors[name + " differs"] = "from the bf16 cache's output by more than 0.1"
            elif reference is not None and (outputs["last"].float() - reference).abs().max().item() > 2e-2:
                errors[name + " differs"] = "from the contiguous cache's output"
        except (RuntimeError, ValueError, AssertionError, TypeError) as exc:
            errors[name] = str(exc).splitlines()[0][:120]
    samples = rotating_samples(contenders, repeats, errors)
    bytes_read = 2 * batch * seqlen_k * heads_kv * head_dim * 2
    return {"batch": batch, "seqlen_k": seqlen_k, "heads": f"{heads_q}:{heads_kv}", "head_dim": head_dim,
            "seqlen_q": seqlen_q,
            "gbps": {name: bytes_read / (statistics.median(ms) * 1e-3) / 1e9 for name, ms in samples.items()},
            "errors": errors}


def sweep(bundle_dir: str, rows, heads_q: int, heads_kv: int, splits: list[int], head_dims: list[int]) -> None:
    """Each paged fp16 / bf16 kernel of the bundle (over a cache of its type or an e4m3 one) at `head_dims`, `rows`
    ((batch, seqlen_k) pairs) and split counts; GB/s at two bytes per cached element, as the
    main table counts them."""
    bundle = get_bundle(bundle_dir)
    cc = torch.cuda.get_device_capability()
    print("| kernel | batch | seqlen_k | splits | GB/s |\n|---|---|---|---|---|")
    for entry in bundle.kernels:
        key = contract.KernelKey.parse(entry.key)
        if (key.layout != "paged" or key.mods or key.dtype not in ("bf16", "fp16") or key.head_dim not in head_dims
                or not runs_on(entry, cc)):
            continue
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[key.dtype]
        cache_dtype = torch.float8_e4m3fn if key.kv_dtype == "e4m3" else dtype
        for batch, seqlen_k in rows:
            q = torch.randn(batch, 1, heads_q, key.head_dim, device="cuda", dtype=dtype)
            k, v = (torch.randn(batch, seqlen_k, heads_kv, key.head_dim, device="cuda").to(cache_dtype) for _ in "kv")
            out = torch.empty_like(q)
            problem = call.Problem(key.dtype, True, batch, 1, seqlen_k, heads_q, heads_kv, key.head_dim,
                                   layout="paged", kv_dtype=key.kv_dtype)
            tensors = [call.Tensor(t.data_ptr(), *t.stride()[:3]) for t in (q, k, v, out)]
            for count in splits:
                prepared = kvcache.prepare_kvcache(bundle, problem, *tensors, kvcache.KvCache(), device=0,
                                                   num_splits=count, entry=entry)
                workspace = torch.empty(max(prepared.workspace.floats, 1), device="cuda")
                stream = _current_stream(0)
                ms = median_ms(lambda: prepared.launch(out.data_ptr(), 0, stream, workspace.data_ptr()))
                gbps = 2 * batch * seqlen_k * heads_kv * key.head_dim * 2 / (ms * 1e-3) / 1e9
                print(f"| {entry.name} | {batch} | {seqlen_k} | {prepared.num_splits}{'*' if count == 0 else ''} "
                      f"| {gbps:.0f} |", flush=True)


def format_table(rows: list[dict]) -> str:
    names = []
    for row in rows:
        names += [n for n in row["gbps"] if n not in names]
    # Ratios of the contiguous cache's rows (FA4's paged rows are columns of their own).
    peers = [n for n in names if not n.startswith("fagen") and "-p" not in n]
    fp8 = "fagen-e4m3" in names
    header = ["hd", "heads", "sq", "batch", "seqlen_k", *names, *(f"÷{p}" for p in peers),
              *(["e4m3÷bf16"] if fp8 else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        g = row["gbps"]
        cells = [str(row["head_dim"]), row["heads"], str(row["seqlen_q"]), str(row["batch"]), str(row["seqlen_k"])]
        cells += [f"{g[n]:.0f}" if n in g else "—" for n in names]
        cells += [f"{g['fagen'] / g[p]:.2f}" if "fagen" in g and p in g else "—" for p in peers]
        if fp8:
            cells.append(f"{g['fagen-e4m3'] / g['fagen']:.2f}" if "fagen" in g and "fagen-e4m3" in g else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(f"{b}x{s}" for b, s in ROWS),
                        help="batch x seqlen_k pairs, e.g. 64x4096,1x65536")
    parser.add_argument("--heads", default="32:8", help="query:KV heads, comma-separated")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--pages", default="16,64,256", help="page sizes of the paged rows (0: none)")
    parser.add_argument("--seqlen-q", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp8-cache", action="store_true", help="add fagen over an e4m3 copy of the cache")
    parser.add_argument("--sweep", metavar="DIR", help="time every paged kernel of this bundle instead")
    parser.add_argument("--splits", default="0,1,2,4", help="--sweep's split counts (0: the runtime's)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.decode needs a CUDA device", file=sys.stderr)
        return 1
    row_pairs = [tuple(int(x) for x in pair.split("x")) for pair in args.rows.split(",")]
    if args.sweep:
        heads_q, heads_kv = (int(h) for h in args.heads.split(",")[0].split(":"))
        sweep(args.sweep, row_pairs, heads_q, heads_kv, [int(n) for n in args.splits.split(",")],
              [int(h) for h in args.head_dims.split(",")])
        return 0
    bundle = get_bundle()
    page_sizes = [int(p) for p in args.pages.split(",") if int(p)]
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {timer_name()} of CUDA-graph replays; "
          f"bf16, GB/s of K and V read", flush=True)
    for head_dim in (int(h) for h in args.head_dims.split(",")):
        for heads in args.heads.split(","):
            heads_q, heads_kv = (int(h) for h in heads.split(":"))
            for batch, seqlen_k in row_pairs:
                row = measure(batch, seqlen_k, heads_q, heads_kv, head_dim, page_sizes, bundle, args.repeats,
                              args.seqlen_q, args.fp8_cache)
                rows.append(row)
                print(f"hd{head_dim} {heads} b{batch} sk{seqlen_k}: "
                      + ", ".join(f"{n} {g:.0f}" for n, g in row["gbps"].items())
                      + (f"  errors: {row['errors']}" if row["errors"] else ""), flush=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
