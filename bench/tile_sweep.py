"""Every kernel of a bundle, timed against the peers on one shape per key: picks tiles and
measures ablations, since the adapter itself only ever runs the kernel the bundle selects.

    fagen build bench/sweep_example.yaml -o DIR      # any machine, no GPU
    python -m bench.tile_sweep --bundle DIR [--seqlen 4096] [--json PATH]

Backward kernels (keys bwd/...) are timed the same way on the forward of the default bundle
(or --forward-bundle), against the SDPA peers' backward (FLOPs 2.5x the forward's).

Shape per key: bf16/fp16 as the key says, batch * seqlen = 16384 tokens, nheads = 2048 /
head_dim (shared/BENCHMARKS.md). Each kernel's output is compared with SDPA's flash backend.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.nn.attention import sdpa_kernel

from bench.attention import (HIDDEN, MAX_ABS_DIFF_FLAG, PEERS, TOTAL_TOKENS, attention_flops,
                             median_ms, sdpa, tflops)
from fagen.runtime import call, runs_on
from fagen.torch import flash_attn_func
from fagen.torch.adapter import _current_stream, _problem, _tensor, get_bundle, prepare_launch


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _parse_key(key: str) -> tuple[torch.dtype, int, bool]:
    _, dtype, hd, mask = key.split("/")
    return DTYPES[dtype], int(hd[2:]), mask == "causal"


def _tile(entry) -> str:
    return entry.name.split(f"_{entry.key.split('/')[-1]}_", 1)[1].rsplit("_", 1)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--forward-bundle", default=None,
                        help="forward kernels for the backward keys (default: $FAGEN_BUNDLE, then fagen's default)")
    args = parser.parse_args(argv)

    bundle = get_bundle(args.bundle)
    cc = torch.cuda.get_device_capability()
    by_key = defaultdict(list)
    for entry in bundle.kernels:
        if runs_on(entry, cc):
            by_key[entry.key].append(entry)

    rows = []
    for key in sorted(by_key):
        if key.startswith("bwd/"):
            rows += _sweep_backward(bundle, key, by_key[key], args.seqlen, args.forward_bundle)
            continue
        dtype, head_dim, causal = _parse_key(key)
        seqlen = args.seqlen
        batch, heads = TOTAL_TOKENS // seqlen, HIDDEN // head_dim
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3))
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
        peer_tflops = {}
        with sdpa_kernel(PEERS["FA2"]):
            reference = sdpa(q, k, v, causal).transpose(1, 2)
        for name, backend in PEERS.items():
            with sdpa_kernel(backend):
                peer_tflops[name] = tflops(flops, median_ms(lambda: sdpa(q, k, v, causal)))
        for entry in sorted(by_key[key], key=lambda e: (e.fa_version, e.name)):
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
            run = prepare_launch(bundle, entry, q, k, v, out, lse)
            run()
            torch.cuda.synchronize()
            diff = (out.float() - reference.float()).abs().max().item()
            value = tflops(flops, median_ms(run)) if diff <= MAX_ABS_DIFF_FLAG else float("nan")
            rows.append({"key": key, "fa": entry.fa_version, "tile": _tile(entry), "seqlen": seqlen,
                         "tflops": value, "max_abs_diff": diff, **{f"{n}_tflops": t for n, t in peer_tflops.items()}})
            r = rows[-1]
            print(f"{key:24s} fa{r['fa']} {r['tile']:28s} {value:7.1f} TFLOP/s  "
                  f"x{value / peer_tflops['FA2']:.2f} FA2  x{value / peer_tflops['cuDNN']:.2f} cuDNN  "
                  f"(FA2 {peer_tflops['FA2']:.0f}, cuDNN {peer_tflops['cuDNN']:.0f}; diff {diff:.2e})",
                  flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _sweep_backward(bundle, key, entries, seqlen, forward_bundle) -> list[dict]:
    dtype, head_dim, causal = _parse_key(key)
    batch, heads = TOTAL_TOKENS // seqlen, HIDDEN // head_dim
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(4))
    flops = 2.5 * attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, bundle=forward_bundle)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    peer_tflops, reference = {}, None
    for name, backend in PEERS.items():
        with sdpa_kernel(backend):
            kept = sdpa(*leaves, causal).transpose(1, 2)
            grads = torch.autograd.grad(kept, leaves, dout, retain_graph=True)
            reference = reference or grads
            peer_tflops[name] = tflops(flops, median_ms(
                lambda: torch.autograd.grad(kept, leaves, dout, retain_graph=True)))
    problem = _problem(q, k, causal, (-1, -1))
    rows = []
    for entry in sorted(entries, key=lambda e: (e.fa_version, e.name)):
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        sizes = call.backward_workspace(entry, problem)
        workspace = torch.empty(sizes.floats, device="cuda", dtype=torch.float32)
        tensors = call.BackwardTensors(q=_tensor(q), k=_tensor(k), v=_tensor(v), out=_tensor(out),
                                       dout=_tensor(dout), dq=_tensor(dq), dk=_tensor(dk), dv=_tensor(dv),
                                       lse=lse.data_ptr())

        def run(entry=entry, tensors=tensors, workspace=workspace):
            call.attention_backward(bundle, problem, tensors, workspace=workspace.data_ptr(),
                                    stream=_current_stream(0), entry=entry)

        run()
        torch.cuda.synchronize()
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip((dq, dk, dv), reference))
        value = tflops(flops, median_ms(run)) if diff <= 8 * MAX_ABS_DIFF_FLAG else float("nan")
        rows.append({"key": key, "fa": entry.fa_version, "tile": _tile(entry), "seqlen": seqlen,
                     "tflops": value, "max_abs_diff": diff, **{f"{n}_tflops": t for n, t in peer_tflops.items()}})
        print(f"{key:24s} fa{entry.fa_version} {rows[-1]['tile']:28s} {value:7.1f} TFLOP/s  "
              f"x{value / peer_tflops['FA2']:.2f} FA2  x{value / peer_tflops['cuDNN']:.2f} cuDNN  "
              f"(FA2 {peer_tflops['FA2']:.0f}, cuDNN {peer_tflops['cuDNN']:.0f}; diff {diff:.2e})",
              flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
