"""Host time per call: how long fagen and torch SDPA keep the CPU busy before the kernels are
queued, on shapes small enough that the GPU is never the limit: the forward, the forward and
backward, both under torch.compile, and a whole training step of a small transformers model.

A call that costs the host more than its kernel costs the GPU leaves the GPU idle between
kernels; do_bench (bench/attention.py) hides host time only up to the ~0.1 ms its L2 flush
takes, so for short rows this number also bounds what the benchmark can show, and for a small
model it is the step time.

    python -m bench.launch_overhead [--bundle DIR] [--calls 2000] [--profile PATH] [--no-compile]

--profile writes the cProfile statistics of fagen's forward and forward + backward calls (the top
entries by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import json
import pstats
import time

import torch
from torch.nn.attention import sdpa_kernel

from bench import cuda_missing
from bench.attention import PEERS, sdpa
from fagen.torch import flash_attn_func, get_bundle

SHAPE = (1, 128, 2, 128)  # batch, seqlen, heads, head_dim: a kernel of a few microseconds
# The training step's model: a 2-layer Llama of width 256 (4:2 heads of 64) on 128 tokens, whose
# kernels take microseconds each: the step is host time.
MODEL_SIZES = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128,
                   attention_dropout=0.0, tie_word_embeddings=False)


def host_us_per_call(fn, calls: int, synchronize=torch.cuda.synchronize) -> float:
    """Median over 5 bursts of `calls` calls of the host time per call (no synchronization
    inside a burst, so only the CPU side is timed while the GPU keeps up); `synchronize`: None
    where no device runs the calls (bench.host_model)."""
    samples = []
    for _ in range(5):
        if synchronize:
            synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        if synchronize:
            synchronize()
    return sorted(samples)[len(samples) // 2]


def attention_calls(bundle, compiled: bool) -> dict:
    """name -> (call, SDPA backend or None) of the forward and the forward + backward."""
    q, k, v = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16)
    functions = {"fagen": (lambda q, k, v: flash_attn_func(q, k, v, causal=True, bundle=bundle), None)}
    functions.update({f"SDPA {name}": (lambda q, k, v: sdpa(q, k, v, True), backend)
                      for name, backend in PEERS.items()})
    calls = {}
    for name, (fn, backend) in functions.items():
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        suffix = ", compiled" if compiled else ""

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v)

        def forward_backward(fn=fn):
            out = fn(q, k, v)  # SDPA's is a (batch, heads, seq, dim) view
            out.backward(grad if out.shape == grad.shape else grad.transpose(1, 2))

        calls[f"fwd{suffix}: {name}"] = (forward, backend)
        calls[f"fwd+bwd{suffix}: {name}"] = (forward_backward, backend)
    return calls


def training_steps() -> dict:
    """name -> (one training step of the small Llama: forward, loss, backward, AdamW step, None)
    for attn_implementation "fagen" and "sdpa"; {} without transformers."""
    try:
        import transformers
    except ImportError:
        return {}
    import fagen.integrations.transformers  # noqa: F401  (registers "fagen")

    tokens = torch.randint(0, MODEL_SIZES["vocab_size"], (1, 129), device="cuda")
    steps = {}
    for attn in ("fagen", "sdpa"):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**MODEL_SIZES)
        net = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(
            device="cuda", dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def step(net=net, optimizer=optimizer):
            loss = net(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[f"train step: {attn}"] = (step, None)
    return steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--profile", help="write fagen's cProfile top entries here")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if cuda_missing("bench.launch_overhead"):
        return 2
    bundle = get_bundle(args.bundle)
    contenders = attention_calls(bundle, compiled=False)
    if not args.no_compile:
        contenders.update(attention_calls(bundle, compiled=True))
    contenders.update(training_steps())
    results = {}
    for name, (fn, backend) in contenders.items():
        calls = args.calls if not name.startswith("train") else max(args.calls // 10, 20)
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            for _ in range(20):
                fn()
            results[name] = host_us_per_call(fn, calls)
        print(f"{name:28s} {results[name]:8.1f} us per call (host)", flush=True)
    if args.profile:
        text = io.StringIO()
        for name in ("fwd: fagen", "fwd+bwd: fagen"):
            profiler = cProfile.Profile()
            fn = contenders[name][0]
            profiler.enable()
            for _ in range(args.calls):
                fn()
            profiler.disable()
            torch.cuda.synchronize()
            text.write(f"==== {name}\n")
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        with open(args.profile, "w") as f:
            f.write(text.getvalue())
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"shape": SHAPE, "calls": args.calls, "host_us_per_call": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
