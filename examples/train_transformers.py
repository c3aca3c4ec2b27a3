"""Train a small Llama-style model with fagen's attention and with torch SDPA, same seed, same data.

    PYTHONPATH=. python examples/train_transformers.py --steps 1500 --json out.json --png out.png

The model (transformers' LlamaConfig, randomly initialised: 4 layers, hidden 512, 8 query heads,
2 key/value heads (GQA), head_dim 64) learns a copy task: a row holds 511 distinct random tokens,
a separator, and the same 511 tokens again; the loss counts only the copy (and the end token),
which the model can predict only by attending back across the sequence (seqlen 1024, causal).
Weights stay fp32 under torch.autocast(bfloat16), so attention gets bf16 q/k/v (fagen casts RoPE's
fp32 q/k to the autocast dtype, as transformers' flash-attention path does), AdamW.

Each --attn implementation trains in turn from the same initial weights on the same batches;
by default fagen, then SDPA twice. The second SDPA run is the noise: SDPA's backward adds dQ
with atomics in any order, so two runs of the same seed part ways where the task's learning
is abrupt, and fagen's distance from SDPA is read against that distance.
Printed: the loss every 100 steps, then per run the final loss (mean of the last 20 steps),
the token accuracy of the copy on held-out batches, the median step time (steps after
warm-up, each synchronised), the first step whose loss is below 1, and each run's distance
from the first SDPA run: the largest |loss - loss_sdpa| over the steps and the mean one of
the curves averaged over 25 steps. --json writes the curves, --png plots them (needs
matplotlib). Needs a CUDA GPU, transformers and fagen's kernels (forward and backward) for the
GPU's architecture ($FAGEN_BUNDLE or generated/default/).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

BOS, SEP, EOS, FIRST_WORD = 0, 1, 2, 3  # special tokens; the copied words are FIRST_WORD..vocab-1
WARMUP_STEPS = 10  # steps left out of the median step time
SMOOTHING = 25  # steps per point of the averaged curves the mean distance compares
LEARNED_LOSS = 1.0  # the plateaus before the copy is learned lie at 6.35 and 2.7-2.9 (run 69)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attn", nargs="+", choices=["fagen", "sdpa"], default=["fagen", "sdpa", "sdpa"],
                   help="attention implementations to train with, in turn; one may repeat "
                        "(default: fagen sdpa sdpa)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=1024, help="tokens per row (even)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--vocab", type=int, default=576,
                   help="at least seqlen/2 + 2: the copied words are distinct (default 576)")
    p.add_argument("--json", metavar="PATH", help="write both loss curves and the summary here")
    p.add_argument("--png", metavar="PATH", help="plot the loss curves here (matplotlib)")
    args = p.parse_args()
    if args.seqlen % 2 or args.vocab - FIRST_WORD < args.seqlen // 2 - 1:
        p.error("--seqlen must be even and --vocab at least seqlen/2 + 2")
    return args


def make_batch(generator: torch.Generator, batch: int, seqlen: int, vocab: int, device):
    """(batch, seqlen + 1) tokens: BOS, n distinct words, SEP, the same n words, EOS (2n + 3 =
    seqlen + 1). Inputs are [:, :-1], targets [:, 1:]; the loss is on the last n + 1 targets."""
    n = seqlen // 2 - 1
    words = torch.rand(batch, vocab - FIRST_WORD, generator=generator, device=device).argsort(dim=1)
    words = words[:, :n] + FIRST_WORD

    def column(token):
        return torch.full((batch, 1), token, dtype=words.dtype, device=device)

    return torch.cat([column(BOS), words, column(SEP), words, column(EOS)], dim=1)


def make_model(args, attn: str, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=1376, max_position_embeddings=args.seqlen,
        attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(args.seed)  # the same initial weights for every implementation
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(device)


def copy_loss(model, tokens: torch.Tensor):
    """Cross-entropy over the copied half (and EOS), with its logits and targets."""
    supervised = tokens.shape[1] // 2  # n + 1 targets: the n words after SEP, then EOS
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=tokens[:, :-1], logits_to_keep=supervised).logits
    targets = tokens[:, -supervised:]
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return loss, logits, targets


def train(args, attn: str, device) -> dict:
    model = make_model(args, attn, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    data = torch.Generator(device=device).manual_seed(args.seed)  # the same batches for every run
    losses, step_ms = [], []
    model.train()
    for step in range(1, args.steps + 1):
        tokens = make_batch(data, args.batch, args.seqlen, args.vocab, device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss, _, _ = copy_loss(model, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps:
            print(f"  [{attn}] step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"{step_ms[-1]:7.1f} ms/step", flush=True)

    model.eval()
    held_out = torch.Generator(device=device).manual_seed(args.seed + 1_000_003)
    correct = total = 0
    with torch.no_grad():
        for _ in range(args.eval_batches):
            _, logits, targets = copy_loss(model, make_batch(held_out, args.batch, args.seqlen,
                                                             args.vocab, device))
            correct += (logits.argmax(-1) == targets).sum().item()
            total += targets.numel()
    timed = step_ms[WARMUP_STEPS:] or step_ms
    learned = next((i + 1 for i, loss in enumerate(losses) if loss < LEARNED_LOSS), None)
    return {"loss": losses, "step_ms": step_ms, "final_loss": statistics.fmean(losses[-20:]),
            "accuracy": correct / total, "median_step_ms": statistics.median(timed),
            "learned_at_step": learned}


def smoothed(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[i:i + SMOOTHING]) for i in range(0, len(losses), SMOOTHING)]


def distances(runs: dict) -> dict:
    """Each run's distance from the first SDPA run: max |loss - loss_sdpa| over the steps and
    the mean |difference| of the curves averaged over SMOOTHING steps."""
    if "sdpa" not in runs:
        return {}
    reference = runs["sdpa"]["loss"]
    result = {}
    for label, run in runs.items():
        if label == "sdpa":
            continue
        diffs = [abs(x - y) for x, y in zip(run["loss"], reference)]
        smooth = [abs(x - y) for x, y in zip(smoothed(run["loss"]), smoothed(reference))]
        result[label] = {"max_abs_loss_diff": max(diffs), "at_step": diffs.index(max(diffs)) + 1,
                         "mean_abs_smoothed_diff": statistics.fmean(smooth)}
    return result


def summarize(runs: dict) -> dict:
    """Print the final table and each run's distance from the first SDPA run; return those."""
    print(f"\n{'run':<8} {'final loss':>10} {'accuracy':>9} {'median step':>12} {'loss < 1 at':>12}")
    for label, run in runs.items():
        learned = run["learned_at_step"]
        print(f"{label:<8} {run['final_loss']:>10.4f} {run['accuracy']:>9.2%} "
              f"{run['median_step_ms']:>9.1f} ms {learned if learned else 'never':>12}")
    result = distances(runs)
    for label, d in result.items():
        print(f"{label} vs sdpa: max |loss difference| {d['max_abs_loss_diff']:.4g} (step "
              f"{d['at_step']}), mean over {SMOOTHING}-step averages {d['mean_abs_smoothed_diff']:.4g}")
    return result


def plot(runs: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, run), style in zip(runs.items(), ("-", "--", ":", "-.")):
        ax.plot(range(1, len(run["loss"]) + 1), run["loss"], style, label=label, linewidth=1)
    ax.set(xlabel="step", ylabel="copy loss (cross-entropy)", yscale="log", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("train_transformers.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "fagen's kernels run on NVIDIA GPUs only")
    try:
        import transformers
    except ImportError:
        sys.exit("train_transformers.py needs Hugging Face transformers: "
                 "pip install 'fagen[transformers]'")
    if "fagen" in args.attn:
        import fagen.integrations.transformers  # noqa: F401  (registers "fagen")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; batch {args.batch} x seqlen {args.seqlen}, "
          f"{args.steps} steps, seed {args.seed}")

    runs = {}
    for attn in args.attn:
        label = attn if attn not in runs else f"{attn}#{sum(k.split('#')[0] == attn for k in runs) + 1}"
        print(f"training with attn_implementation={attn!r} ({label})", flush=True)
        runs[label] = train(args, attn, device)

    distance = summarize(runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(device),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "runs": runs, "distance_from_sdpa": distance}, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        plot(runs, args.png, f"Llama-style model, copy task, batch {args.batch} x seqlen "
                             f"{args.seqlen}, bf16 autocast")
    return 0


if __name__ == "__main__":
    sys.exit(main())
