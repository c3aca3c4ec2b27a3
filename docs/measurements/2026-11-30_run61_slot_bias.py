"""Does the contender timed right before a measurement change it? Two copies of the same fagen
kernel (A, B) and the two SDPA peers, in random orders, 16 rounds per shape; each sample is
recorded with the contender that ran just before it."""
import json, random, statistics, sys, time
import torch
from torch.nn.attention import sdpa_kernel
from bench.attention import PEERS, TOTAL_TOKENS, HIDDEN, median_ms, sdpa
from fagen.torch import flash_attn_func, get_bundle

bundle = get_bundle(sys.argv[1])
out = []
rng = random.Random(0)
for head_dim, causal, seqlen in ((64, True, 2048), (128, False, 4096), (128, False, 8192), (256, False, 2048)):
    batch, heads = TOTAL_TOKENS // seqlen, HIDDEN // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns = {"A": (lambda: flash_attn_func(q, k, v, causal=causal, bundle=bundle), None),
           "B": (lambda: flash_attn_func(q, k, v, causal=causal, bundle=bundle), None)}
    for name, backend in PEERS.items():
        fns[name] = (lambda: sdpa(q, k, v, causal), backend)
    prev = None
    samples = []
    for r in range(16):
        order = list(fns); rng.shuffle(order)
        for name in order:
            fn, backend = fns[name]
            with sdpa_kernel(backend) if backend else torch.no_grad():
                ms = median_ms(fn)
            samples.append((name, prev, ms))
            prev = name
    key = f"hd{head_dim} {'causal' if causal else 'full'} {seqlen}"
    out.append({"shape": key, "samples": samples})
    for who in ("A", "B", "cuDNN"):
        by_prev = {}
        for name, p, ms in samples:
            if name == who:
                by_prev.setdefault(p, []).append(ms)
        print(key, who, " ".join(f"after {p}: {statistics.median(v):.4f} ms (n={len(v)})" for p, v in sorted(by_prev.items(), key=lambda kv: str(kv[0]))))
json.dump(out, open(sys.argv[2], "w"))
