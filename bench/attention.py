"""fagen forward against torch SDPA's FlashAttention-2 and cuDNN backends, same process, same run.

Protocol (shared/BENCHMARKS.md): bf16, batch * seqlen = 16384 tokens, hidden 2048 (nheads =
2048 / head_dim), layout (batch, seqlen, nheads, head_dim), FLOPs 4*b*h*sq*sk*d (halved when
causal), median time of triton.testing.do_bench(warmup=25, rep=100).

    python -m bench.attention [--seqlens 512,1024,...] [--head-dims 64,128,256]
                              [--causal both|yes|no] [--json PATH] [--png PATH] [--bundle DIR]
                              [--baseline DIR | --deterministic-baseline] [--repeats N]
                              [--direction fwd|bwd|fwdbwd] [--heads 32:8,64:8] [--tokens N]
                              [--lineage]

--heads times grouped-query rows (query heads : KV heads) instead of the protocol's MHA rows of
hidden 2048; --tokens sets the tokens per row (batch = tokens // seqlen, at least 1: --tokens 1
with long seqlens gives batch-1 prefill rows). flash-attn-4 (its CuTe DSL flash_attn_func) is a
peer in every row where it is importable (../shared/BENCHMARKS.md says how to install it).

--baseline times a second bundle's kernels in the same rows (column "base"): a before/after
comparison of a kernel change within one run, since absolute numbers drift between runs.
--deterministic-baseline makes "base" the same bundle with deterministic=True (the cost of a
bitwise-reproducible backward).
--repeats N times every contender N times per row, in rounds whose order rotates (fagen first
in one round, cuDNN first in the next, ...), and reports the median of the N medians; the
table's last column is the range of the per-round fagen/cuDNN ratios. One sample of a short
row moved by up to 10 % between runs (docs/performance.md), more than the gaps it decides.
--lineage times FA1, FA2 and FA3 of one bundle instead (bench/lineage.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fagen
from bench import cuda_missing, flash_attn_4
from fagen.torch import KernelNotFound, flash_attn_func, get_bundle

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
TOTAL_TOKENS = 16384
HIDDEN = 2048
MAX_ABS_DIFF_FLAG = 2e-2
PEERS = {"FA2": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}


def _triton_do_bench():
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    return do_bench


def timer_name() -> str:
    if _triton_do_bench() is None:
        return "CUDA events, median of 100 runs after 25 warmup (triton not importable)"
    return "triton.testing.do_bench(warmup=25, rep=100, return_mode='median')"


def median_ms(fn) -> float:
    do_bench = _triton_do_bench()
    if do_bench is None:
        return _median_ms_cuda_events(fn)
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _median_ms_cuda_events(fn, warmup: int = 25, runs: int = 100) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def sdpa(q, k, v, causal):
    # SDPA takes (batch, heads, seq, dim); these are views of the flash-attn layout.
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                          enable_gqa=q.shape[2] != k.shape[2])


# FLOPs of each direction in units of the forward's (shared/BENCHMARKS.md: backward 2.5x).
DIRECTION_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


def _timed(direction: str, attention, q, k, v, dout, backend):
    """The function timed for `direction`: the forward; the backward of one forward (kept, so
    that only the gradients are timed: torch.autograd.grad leaves no .grad to accumulate); or
    forward and backward together."""
    if direction == "fwd":
        return lambda: attention(q, k, v)
    if direction == "fwdbwd":
        return lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout)
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = attention(q, k, v)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def measure_shape(head_dim: int, causal: bool, seqlen: int, bundle, baseline=None, repeats: int = 1,
                  direction: str = "fwd", deterministic_baseline: bool = False,
                  heads: tuple[int, int] | None = None, tokens: int = TOTAL_TOKENS, fa4=None) -> dict:
    """One row: `heads` (query, KV) heads, or the protocol's MHA heads of hidden 2048; `fa4`:
    flash-attn-4's function (bench.flash_attn_4) or None."""
    batch = max(1, tokens // seqlen)
    heads_q, heads_kv = heads or (HIDDEN // head_dim, HIDDEN // head_dim)
    q, k, v = (
        torch.randn(batch, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=direction != "fwd")
        for h in (heads_q, heads_kv, heads_kv)
    )
    dout = torch.randn_like(q)
    flops = attention_flops(batch, heads_q, seqlen, seqlen, head_dim, causal) * DIRECTION_FLOPS[direction]
    row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "nheads": heads_q,
           "nheads_kv": heads_kv, "direction": direction, "tflops": {}, "ms": {}, "samples_ms": {},
           "errors": {}}

    reference = None
    try:
        with sdpa_kernel(PEERS["FA2"]):
            reference = sdpa(q, k, v, causal).transpose(1, 2)
    except RuntimeError as exc:
        row["errors"]["reference"] = str(exc).splitlines()[0]
    try:
        out = flash_attn_func(q, k, v, causal=causal, bundle=bundle)
        if reference is not None:
            row["max_abs_diff_vs_FA2"] = (out.float() - reference.float()).abs().max().item()
        if direction != "fwd" and reference is not None:
            ours = torch.autograd.grad(out, (q, k, v), dout)
            with sdpa_kernel(PEERS["FA2"]):
                theirs = torch.autograd.grad(sdpa(q, k, v, causal).transpose(1, 2), (q, k, v), dout)
            row["max_abs_grad_diff_vs_FA2"] = max(
                (a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))
    except (RuntimeError, KernelNotFound) as exc:
        row["errors"]["fagen"] = str(exc).splitlines()[0]

    def fagen_attention(target, deterministic=False):
        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, bundle=target,
                                               deterministic=deterministic)

    def sdpa_attention(q, k, v):
        return sdpa(q, k, v, causal).transpose(1, 2)  # the flash-attn layout, like dout

    # name -> (function timed, context it is timed in: the SDPA backend for the peers)
    contenders = {}
    try:
        if "fagen" not in row["errors"]:
            contenders["fagen"] = (_timed(direction, fagen_attention(bundle), q, k, v, dout, None), None)
        if baseline is not None or deterministic_baseline:
            base = fagen_attention(bundle if deterministic_baseline else baseline, deterministic_baseline)
            contenders["base"] = (_timed(direction, base, q, k, v, dout, None), None)
    except (RuntimeError, KernelNotFound) as exc:
        row["errors"]["fagen"] = str(exc).splitlines()[0]
    for name, backend in PEERS.items():
        try:
            contenders[name] = (_timed(direction, sdpa_attention, q, k, v, dout, backend), backend)
        except RuntimeError as exc:
            row["errors"][name] = str(exc).splitlines()[0]
    if fa4 is not None:
        try:
            timed = _timed(direction, lambda q, k, v: fa4(q, k, v, causal=causal), q, k, v, dout, None)
            timed()  # its first call per variant compiles (~10 s): before the timing
            contenders["FA4"] = (timed, None)
        except Exception as exc:  # the DSL's compile errors are of its own types
            row["errors"]["FA4"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    def in_context(fn, backend):
        def timed():
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                return median_ms(fn)
        return timed

    row["samples_ms"] = rotating_samples({name: in_context(*c) for name, c in contenders.items()}, repeats,
                                         row["errors"])
    for name, samples in row["samples_ms"].items():
        row["ms"][name] = statistics.median(samples)
        row["tflops"][name] = tflops(flops, row["ms"][name])
    ours, theirs = row["samples_ms"].get("fagen"), row["samples_ms"].get("cuDNN")
    if ours and theirs and len(ours) == len(theirs) > 1:
        ratios = [c / f for f, c in zip(ours, theirs)]  # time ratio = TFLOP/s ratio fagen/cuDNN
        row["ratio_cudnn_range"] = [min(ratios), max(ratios)]
    return row


def rotating_samples(contenders: dict, repeats: int, errors: dict) -> dict[str, list[float]]:
    """name -> the times (ms) its function returned, one per round, the rounds in rotating order
    (the first contender of one round goes last in the next); a contender already in `errors`
    is left out, one that raises is recorded there and dropped."""
    samples: dict[str, list[float]] = {}
    names = list(contenders)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if name in errors:
                continue
            try:
                samples.setdefault(name, []).append(contenders[name]())
            except (RuntimeError, KernelNotFound) as exc:
                errors[name] = str(exc).splitlines()[0]
                samples.pop(name, None)
    return samples


def _fmt(value, width=7, digits=0):
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def _range(bounds) -> str:
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}" if bounds else "-"


def format_table(rows: list[dict]) -> str:
    with_base = any("base" in row["tflops"] for row in rows)
    with_range = any("ratio_cudnn_range" in row for row in rows)
    with_fa4 = any("FA4" in row["tflops"] for row in rows)
    with_heads = any(row.get("nheads_kv", row["nheads"]) != row["nheads"] or row["batch"] == 1 for row in rows)
    header = ((f"{'heads':>6} {'batch':>5} " if with_heads else "")
              + f"{'hd':>4} {'causal':>6} {'seqlen':>6} {'fagen':>7} {'FA2':>7} {'cuDNN':>7} "
              + (f"{'FA4':>7} " if with_fa4 else "")
              + f"{'f/FA2':>6} {'f/cuDNN':>7} " + (f"{'f/FA4':>6} " if with_fa4 else "") + f"{'maxdiff':>8}"
              + (f" {'base':>7} {'f/base':>6}" if with_base else "")
              + (f" {'f/cuDNN range':>13}" if with_range else ""))
    what = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}[rows[0].get("direction", "fwd")] if rows else "forward"
    tokens = sorted({row["batch"] * row["seqlen"] for row in rows})
    lines = [f"{what} TFLOP/s (bf16, {'/'.join(map(str, tokens))} tokens a row)", header, "-" * len(header)]
    for row in rows:
        t = row["tflops"]
        fagen_t, fa2, cudnn, fa4, base = t.get("fagen"), t.get("FA2"), t.get("cuDNN"), t.get("FA4"), t.get("base")
        diff = row.get("max_abs_diff_vs_FA2")
        flag = " !" if diff is not None and diff > MAX_ABS_DIFF_FLAG else ""
        heads = f"{row['nheads']}:{row.get('nheads_kv', row['nheads'])}"
        lines.append(
            (f"{heads:>6} {row['batch']:>5} " if with_heads else "")
            + f"{row['head_dim']:>4} {'yes' if row['causal'] else 'no':>6} {row['seqlen']:>6} "
            f"{_fmt(fagen_t)} {_fmt(fa2)} {_fmt(cudnn)} "
            + (f"{_fmt(fa4)} " if with_fa4 else "")
            + f"{_fmt(fagen_t / fa2 if fagen_t and fa2 else None, 6, 2)} "
            f"{_fmt(fagen_t / cudnn if fagen_t and cudnn else None, 7, 2)} "
            + (f"{_fmt(fagen_t / fa4 if fagen_t and fa4 else None, 6, 2)} " if with_fa4 else "")
            + f"{_fmt(diff, 8, 4)}"
            + (f" {_fmt(base)} {_fmt(fagen_t / base if fagen_t and base else None, 6, 2)}" if with_base else "")
            + (f" {_range(row.get('ratio_cudnn_range')):>13}" if with_range else "")
            + flag
        )
    errors = [(row, name, text) for row in rows for name, text in row["errors"].items()]
    for row, name, text in errors:
        lines.append(f"  hd{row['head_dim']} {'causal' if row['causal'] else 'full'} s{row['seqlen']} {name}: {text}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
    for ax, (head_dim, causal) in zip(axes[0], groups):
        selected = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal]
        for name in ("fagen", "FA2", "cuDNN"):
            points = [(r["seqlen"], r["tflops"][name]) for r in selected if name in r["tflops"]]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"hd{head_dim} {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _heads_list(text: str) -> list[tuple[int, int]]:
    """'32:8,64:8' -> [(32, 8), (64, 8)]: query heads a multiple of the KV heads."""
    pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    for pair in pairs:
        if len(pair) != 2 or pair[0] % pair[1]:
            raise argparse.ArgumentTypeError(f"{pair}: query:KV heads, query heads a multiple of the KV heads")
    return pairs


def _int_list(text: str) -> list[int]:
    return [int(x.lower().replace("k", "")) * (1024 if x.lower().endswith("k") else 1) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fagen bench", description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=_int_list, default=list(SEQLENS), help="e.g. 512,1k,16k")
    parser.add_argument("--head-dims", type=_int_list, default=list(HEAD_DIMS))
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--bundle", default=None, help="bundle directory (default: $FAGEN_BUNDLE, then fagen's default)")
    parser.add_argument("--baseline", default=None, help="a second bundle timed in the same rows")
    parser.add_argument("--deterministic-baseline", action="store_true",
                        help='"base" is the same bundle with deterministic=True')
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per row, contenders in rotating order; medians reported")
    parser.add_argument("--json", dest="json_path", default=None, help="write the rows as JSON here")
    parser.add_argument("--png", dest="png_path", default=None, help="plot here (needs matplotlib)")
    parser.add_argument("--table", dest="table_path", default=None, help="also write the table here")
    parser.add_argument("--direction", choices=tuple(DIRECTION_FLOPS), default="fwd",
                        help="fwd, bwd (the backward of one kept forward; FLOPs 2.5x) or fwdbwd")
    parser.add_argument("--heads", type=_heads_list, default=None,
                        help="grouped-query rows, query:KV heads, e.g. 32:8,28:4,64:8 (default: MHA, hidden 2048)")
    parser.add_argument("--tokens", type=int, default=TOTAL_TOKENS,
                        help="tokens per row: batch = tokens // seqlen, at least 1")
    parser.add_argument("--lineage", action="store_true",
                        help="FA1 -> FA2 -> FA3 of one bundle (default: generated/lineage, built "
                        "from specs/lineage.yaml) instead of fagen against the peers "
                        "(head dims default to 64,128)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.baseline and args.deterministic_baseline:
        parser.error("--baseline and --deterministic-baseline both name the 'base' column")
    if args.lineage:
        from bench import lineage

        if args.head_dims == list(HEAD_DIMS):
            args.head_dims = [64, 128]
        return lineage.main(args)

    if cuda_missing("bench.attention"):
        return 2
    bundle = get_bundle(args.bundle)
    baseline = get_bundle(args.baseline) if args.baseline else None
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    fa4 = flash_attn_4()
    if fa4 is None:
        print("flash-attn-4 not importable: no FA4 column", file=sys.stderr)
    rows = []
    for heads in args.heads or [None]:
        for head_dim in args.head_dims:
            for causal in causal_values:
                for seqlen in args.seqlens:
                    row = measure_shape(head_dim, causal, seqlen, bundle, baseline, args.repeats, args.direction,
                                        args.deterministic_baseline, heads, args.tokens, fa4)
                    rows.append(row)
                    print(f"measured {row['nheads']}:{row['nheads_kv']} hd{head_dim} "
                          f"{'causal' if causal else 'full'} s{seqlen}: "
                          + ", ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items()), flush=True)

    table = format_table(rows)
    if args.json_path:
        meta = {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "fagen": fagen.__version__, "bundle": str(bundle.path),
            "baseline": (str(baseline.path) if baseline
                         else "deterministic" if args.deterministic_baseline else None),
            "python": platform.python_version(),
            "timer": timer_name(), "repeats": args.repeats,
        }
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.png_path and not plot(rows, args.png_path):
        print("fagen bench: matplotlib not importable, no plot written", file=sys.stderr)
    if args.table_path:
        with open(args.table_path, "w") as f:
            f.write(table + "\n")
    print(table)
    flagged = [r for r in rows if r.get("max_abs_diff_vs_FA2", 0) > MAX_ABS_DIFF_FLAG]
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
