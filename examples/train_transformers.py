"""Train a small Llama-style model with fagen's attention and with torch SDPA, same seed, same data.

    PYTHONPATH=. python examples/train_transformers.py --json out.json --png out.png
    python examples/train_transformers.py --device cpu --batch 2 --seqlen 128 --steps 20

The model (transformers' LlamaConfig, randomly initialised: 4 layers, hidden 512, 8 query heads, 2
key/value heads (GQA), head_dim 64) learns a key-value lookup. Each row (seqlen 1024, causal) draws
a random function f from 32 keys to 16 values and opens with its dictionary: BOS, the 32 pair
tokens (k, f(k)) in random order (one token id per pair), SEP. The rest of the row asks questions,
495 of them, the key drawn at random each time: a query token naming k, then the answer, the pair
token (k, f(k)). The loss counts only the answers. The key part of an answer is in the query just
before it; its value part only earlier in the row: in the dictionary, up to a thousand positions
back, and in the earlier answers to the same key (the last of them 64 positions back on average,
the first questions of a row have none), so the model must attend across the sequence. Learned:
answer loss near 0, held-out answer accuracy near 100 %. Weights stay fp32 under
torch.autocast(bfloat16), so attention gets bf16 q/k/v (fagen casts RoPE's fp32 q/k to the autocast
dtype, as transformers' flash-attention path does), AdamW.

Why this task and not the copy task this example used before (511 distinct random tokens, a
separator, the same tokens again): the copy task is learned by an induction circuit, a head that
matches the current token with an earlier one only after another head has moved each token's
predecessor into it. Neither head helps without the other, so every run sat on a plateau at loss
ln(vocab) until rounding tipped it off; the step at which it left (150 with SDPA, 750 with fagen,
same seed; on other seeds the other way round) decided the distance between the curves, and one
pair of runs could not show that they agree. Here one head suffices: it matches the query's key
with the key part of the earlier pair tokens and reads their value part, and every step of the way
pays: the answer's key part (from the query), the row's values (from the near-uniform attention of
the initial weights), then the lookup. The loss falls from ln 547 without a long plateau (it slows
for 50-100 steps near 3, just above ln 16 = 2.77, the loss with the answer's key part learned;
printed with it: about 2.5, the row's values known but the key not looked up), and runs that differ
only in rounding stay together. At reduced scale on a CPU (bf16 autocast, the same seed and data;
mean |difference| of the 25-step averages from the SDPA run): hidden 128, seqlen 256, batch 8:
eager attention 0.0009 and a 1e-3 relative perturbation of the initial weights 0.0028 over 600
steps, where the copy task's runs part by 1.48 and 1.41 over 1000 (they leave its plateau at steps
450-550 and end at losses 0.008, 3.27 and 2.63); the model above at seqlen 256, batch 8: 0.0002 and
0.0012, loss 0.08 by step 200; at seqlen 1024, batch 4: loss 0.27, accuracy 94 % after 300 steps.

Each --attn implementation trains in turn from the same initial weights on the same batches: by
default fagen, SDPA, SDPA restricted to its memory-efficient backend ("sdpa-efficient", key/value
heads repeated) and SDPA again. The last two are the noise: correct implementations that differ
from the first SDPA run only in rounding, as fagen does (the memory-efficient kernels round
differently from the flash ones; SDPA's flash backward adds dQ with atomics in any order, so two of
its runs differ too). "eager" is transformers' plain attention. Printed: the loss every 100 steps,
then per run the final loss (mean of the last 20 steps), the answer accuracy on held-out batches,
the median step time (steps after warm-up, each synchronised), the first step whose loss is below
0.1, and each run's distance from the first SDPA run: the largest |loss - loss_sdpa| over the steps
and the mean one of the curves averaged over 25 steps; last a verdict line: fagen's mean distance
against the largest of the references' ("within noise" up to NOISE_FACTOR times it) and whether
every run learned the lookup (held-out accuracy >= 99 %). The comparison is a check that fagen
trains like SDPA, not a fine test of its gradients: at reduced scale a backward that scales dQ by
0.7 parted from SDPA by 0.0043, 4-20x the references, and one adding 5 % noise to dQ by 0.0012, as
much as they. --json writes the curves, --png plots them (needs matplotlib). fagen needs a CUDA GPU
and its kernels (forward and backward) for the GPU's architecture ($FAGEN_BUNDLE or
generated/default/); --device cpu runs sdpa and eager only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

BOS, SEP, END, FIRST_PAIR = 0, 1, 2, 3  # special tokens; END fills a row's last slot if it is odd
WARMUP_STEPS = 10  # steps left out of the median step time
SMOOTHING = 25  # steps per point of the averaged curves the mean distance compares
LEARNED_LOSS = 0.1  # a first step below it: the lookup is (nearly) learned
NOISE_FACTOR = 3.0  # fagen's mean distance from SDPA is "within noise" up to this many times the
#                     largest one of the references that differ from SDPA only in rounding (at
#                     reduced scale two such references' distances differed by up to 6x)
IMPLEMENTATIONS = ["fagen", "sdpa", "sdpa-efficient", "eager", "flex_attention"]
# --family: the model's attention. llama: plain causal; gemma2: softcap 50 on every layer, a
# sliding window of 256 on every other, head_dim 128; gpt_oss: a learned sink per head on every
# layer, a window of 128 on every other, head_dim 64 (4 experts, 2 per token). transformers has
# no SDPA path for those two (softcap, sinks): their references are eager attention and
# flex_attention (a second implementation that differs only in rounding). deepseek_v3: multi-head
# latent attention, q and k of 192 (128 + 64 rotary), v of 128 (4 experts, 2 per token); its
# references sdpa and eager.
FAMILIES = ("llama", "gemma2", "gpt_oss", "deepseek_v3")
DEFAULT_RUNS = {"llama": ["fagen", "sdpa", "sdpa-efficient", "sdpa"],
                "gemma2": ["fagen", "eager", "flex_attention"],
                "gpt_oss": ["fagen", "eager", "flex_attention"],
                "deepseek_v3": ["fagen", "sdpa", "eager"]}
CUDA_ONLY = {"fagen", "sdpa-efficient"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attn", nargs="+", choices=IMPLEMENTATIONS,
                   help="attention implementations to train with, in turn; one may repeat; the "
                        "first one that is not fagen is the reference the others are measured "
                        "from (default: fagen sdpa sdpa-efficient sdpa, for gemma2 and gpt_oss "
                        "fagen eager flex_attention, for deepseek_v3 fagen sdpa eager; on --device "
                        "cpu: sdpa eager)")
    p.add_argument("--family", choices=FAMILIES, default="llama",
                   help="the model's attention: llama (causal), gemma2 (softcap, sliding window), "
                        "gpt_oss (sinks, sliding window), deepseek_v3 (head dims 192 / 128)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke test of the task and the loop, sdpa and eager only")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=1024, help="tokens per row")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--keys", type=int, default=32, help="keys per row's dictionary (default 32)")
    p.add_argument("--values", type=int, default=16, help="values a key may map to (default 16)")
    p.add_argument("--json", metavar="PATH", help="write the loss curves and the summary here")
    p.add_argument("--png", metavar="PATH", help="plot the loss curves here (matplotlib)")
    args = p.parse_args()
    if args.attn is None:
        args.attn = ["sdpa", "eager"] if args.device == "cpu" else DEFAULT_RUNS[args.family]
    if args.device == "cpu" and CUDA_ONLY & set(args.attn):
        p.error("--device cpu runs sdpa and eager only, not "
                + " ".join(sorted(CUDA_ONLY & set(args.attn))))
    if args.keys < 1 or args.values < 2 or args.seqlen < args.keys + 4:
        p.error("need --keys >= 1, --values >= 2 and --seqlen >= keys + 4 (one question)")
    return args


def vocab_size(args) -> int:
    """BOS, SEP, END, a pair token per (key, value), a query token per key: 3 + 32 * 16 + 32 =
    547 by default."""
    return FIRST_PAIR + args.keys * args.values + args.keys


def make_batch(generator: torch.Generator, args, device):
    """(batch, seqlen + 1) tokens and the (batch, seqlen) mask of the targets the loss counts.

    A row: BOS, the dictionary (the pair token of every key, FIRST_PAIR + k * values + f(k),
    in random order), SEP, then questions: a query token (key k) and the answer, the pair token
    of (k, f(k)), with k drawn at random; END fills an odd last slot. f, a random function from
    the keys to the values, is drawn per row. Inputs are [:, :-1], targets [:, 1:]; the loss
    counts the answers (the targets whose input is a query)."""
    batch, keys, values, seqlen = args.batch, args.keys, args.values, args.seqlen
    f = torch.randint(0, values, (batch, keys), generator=generator, device=device)
    order = torch.rand(batch, keys, generator=generator, device=device).argsort(dim=1)
    questions = (seqlen + 1 - keys - 2) // 2
    asked = torch.randint(0, keys, (batch, questions), generator=generator, device=device)

    def pair(k):
        return FIRST_PAIR + k * values + f.gather(1, k)

    def column(token, width=1):
        return torch.full((batch, width), token, dtype=f.dtype, device=device)

    first_query = FIRST_PAIR + keys * values
    body = torch.stack([first_query + asked, pair(asked)], dim=2).flatten(1)
    tokens = torch.cat([column(BOS), pair(order), column(SEP), body,
                        column(END, seqlen + 1 - keys - 2 - 2 * questions)], dim=1)
    supervised = torch.zeros(batch, seqlen, dtype=torch.bool, device=device)
    supervised[:, keys + 2:keys + 2 + 2 * questions:2] = True
    return tokens, supervised


def unasked_loss(tokens: torch.Tensor, supervised: torch.Tensor, args) -> float:
    """The answer loss of the best guess that knows the row's dictionary and which key is asked
    but does not look the key up: -log(share of the dictionary's keys with the answer's value)."""
    values = (tokens[:, 1:1 + args.keys] - FIRST_PAIR) % args.values
    counts = torch.nn.functional.one_hot(values, args.values).sum(1).float()  # (batch, values)
    answers = (tokens[:, 1:][supervised].view(tokens.shape[0], -1) - FIRST_PAIR) % args.values
    return -(counts.gather(1, answers) / args.keys).log().mean().item()


def register_sdpa_efficient() -> None:
    """'sdpa-efficient': torch SDPA restricted to its memory-efficient backend, the key/value
    heads repeated for GQA (that backend takes no enable_gqa), the causal mask by is_causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                is_causal=None, **kwargs):
        repeat = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if attention_mask is not None:
            attention_mask, causal = attention_mask[:, :, :, :key.shape[-2]], False
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                is_causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sdpa-efficient", forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # transformers < 4.53: the model builds its mask itself
        return
    AttentionMaskInterface.register("sdpa-efficient", sdpa_mask)


def make_model(args, attn: str, device):
    import transformers

    sizes = dict(vocab_size=vocab_size(args), hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1376, max_position_embeddings=args.seqlen,
                 attention_dropout=0.0, tie_word_embeddings=False)
    if args.family == "gemma2":
        config = transformers.Gemma2Config(**sizes, head_dim=128, query_pre_attn_scalar=128, sliding_window=256,
                                           attn_logit_softcapping=50.0, final_logit_softcapping=None)
    elif args.family == "gpt_oss":
        config = transformers.GptOssConfig(**sizes, head_dim=64, sliding_window=128, num_local_experts=4,
                                           num_experts_per_tok=2)
    elif args.family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **{**sizes, "num_key_value_heads": 8}, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            kv_lora_rank=128, q_lora_rank=256, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, moe_intermediate_size=256)
    else:
        config = transformers.LlamaConfig(**sizes)
    torch.manual_seed(args.seed)  # the same initial weights for every implementation
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(device)


def answer_loss(model, tokens: torch.Tensor, supervised: torch.Tensor):
    """Cross-entropy over the answers, with their logits and targets."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=tokens[:, :-1]).logits[supervised]
    targets = tokens[:, 1:][supervised]
    loss = torch.nn.functional.cross_entropy(logits.float(), targets)
    return loss, logits, targets


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args, attn: str, label: str, device) -> dict:
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
        tokens, supervised = make_batch(data, args, device)
        synchronize(device)
        start = time.perf_counter()
        loss, _, _ = answer_loss(model, tokens, supervised)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps:
            print(f"  [{label}] step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"{step_ms[-1]:7.1f} ms/step", flush=True)

    model.eval()
    held_out = torch.Generator(device=device).manual_seed(args.seed + 1_000_003)
    correct = total = 0
    unasked = []
    with torch.no_grad():
        for _ in range(args.eval_batches):
            tokens, supervised = make_batch(held_out, args, device)
            _, logits, targets = answer_loss(model, tokens, supervised)
            correct += (logits.argmax(-1) == targets).sum().item()
            total += targets.numel()
            unasked.append(unasked_loss(tokens, supervised, args))
    timed = step_ms[WARMUP_STEPS:] or step_ms
    learned = next((i + 1 for i, loss in enumerate(losses) if loss < LEARNED_LOSS), None)
    return {"loss": losses, "step_ms": step_ms, "final_loss": statistics.fmean(losses[-20:]),
            "accuracy": correct / total, "median_step_ms": statistics.median(timed),
            "learned_at_step": learned, "unasked_loss": statistics.fmean(unasked)}


def smoothed(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[i:i + SMOOTHING]) for i in range(0, len(losses), SMOOTHING)]


def reference_run(runs: dict) -> str | None:
    """The run the others are measured from: the first that is not fagen's."""
    return next((label for label in runs if label.split("#")[0] != "fagen"), None)


def distances(runs: dict) -> dict:
    """Each run's distance from the reference run: max |loss - loss_reference| over the steps and
    the mean |difference| of the curves averaged over SMOOTHING steps."""
    base = reference_run(runs)
    if base is None:
        return {}
    reference = runs[base]["loss"]
    result = {}
    for label, run in runs.items():
        if label == base:
            continue
        diffs = [abs(x - y) for x, y in zip(run["loss"], reference)]
        smooth = [abs(x - y) for x, y in zip(smoothed(run["loss"]), smoothed(reference))]
        result[label] = {"max_abs_loss_diff": max(diffs), "at_step": diffs.index(max(diffs)) + 1,
                         "mean_abs_smoothed_diff": statistics.fmean(smooth)}
    return result


def verdict(distance: dict) -> dict | None:
    """fagen's mean distance from SDPA against the largest of the references' (the noise)."""
    mean = {label: d["mean_abs_smoothed_diff"] for label, d in distance.items()}
    fagen = [value for label, value in mean.items() if label.split("#")[0] == "fagen"]
    noise = {label: value for label, value in mean.items() if label.split("#")[0] != "fagen"}
    if not fagen or not noise:
        return None
    worst = max(fagen)
    noise_label = max(noise, key=noise.get)
    noise_value = noise[noise_label]
    ratio = worst / noise_value if noise_value > 0 else math.inf
    return {"fagen": worst, "noise": noise_value, "noise_run": noise_label, "ratio": ratio,
            "within_noise": ratio <= NOISE_FACTOR}


def summarize(runs: dict, args) -> dict:
    """Print the final table, each run's distance from the first SDPA run and the verdict;
    return those."""
    unasked = statistics.fmean(run["unasked_loss"] for run in runs.values())
    print(f"\n{'run':<16} {'final loss':>10} {'accuracy':>9} {'median step':>12} "
          f"{f'loss < {LEARNED_LOSS:g} at':>14}")
    for label, run in runs.items():
        learned = run["learned_at_step"]
        print(f"{label:<16} {run['final_loss']:>10.4f} {run['accuracy']:>9.2%} "
              f"{run['median_step_ms']:>9.1f} ms {learned if learned else 'never':>14}")
    print(f"(answer loss of a uniform guess {math.log(vocab_size(args)):.3f}; with the key part "
          f"known {math.log(args.values):.3f}; with the row's values known too, the key not looked "
          f"up {unasked:.3f}; the lookup learned 0)")
    result = distances(runs)
    for label, d in result.items():
        print(f"{label} vs {reference_run(runs)}: max |loss difference| {d['max_abs_loss_diff']:.4g} (step "
              f"{d['at_step']}), mean over {SMOOTHING}-step averages {d['mean_abs_smoothed_diff']:.4g}")
    v = verdict(result)
    if v:
        learned = all(run["accuracy"] >= 0.99 for run in runs.values())
        base = reference_run(runs)
        print(f"verdict: fagen vs {base}: mean distance {v['fagen']:.4g}, noise ({v['noise_run']} vs "
              f"{base}): {v['noise']:.4g}, ratio {v['ratio']:.2f}: "
              f"{'within' if v['within_noise'] else 'OUTSIDE'} noise (up to {NOISE_FACTOR:g}x); "
              f"{'every run learned the lookup' if learned else 'NOT every run learned the lookup'}"
              f" (held-out accuracy >= 99%)")
        result = {**result, "verdict": {**v, "all_learned": learned}}
    elif result:
        print("verdict: no fagen run; the distances above are those of the references alone")
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
    ax.set(xlabel="step", ylabel="answer loss (cross-entropy)", yscale="log", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("train_transformers.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "fagen's kernels run on NVIDIA GPUs only (--device cpu runs sdpa and eager)")
    try:
        import transformers
    except ImportError:
        sys.exit("train_transformers.py needs Hugging Face transformers: "
                 "pip install 'fagen[transformers]'")
    if "fagen" in args.attn:
        import fagen.integrations.transformers  # noqa: F401  (registers "fagen")
    if "sdpa-efficient" in args.attn:
        register_sdpa_efficient()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"batch {args.batch} x seqlen {args.seqlen}, {args.keys} keys -> {args.values} values "
          f"(vocab {vocab_size(args)}), {args.steps} steps, seed {args.seed}")

    runs = {}
    for attn in args.attn:
        label = attn if attn not in runs else f"{attn}#{sum(k.split('#')[0] == attn for k in runs) + 1}"
        print(f"training with attn_implementation={attn!r} ({label})", flush=True)
        runs[label] = train(args, attn, label, device)

    distance = summarize(runs, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": name, "torch": torch.__version__,
                       "transformers": transformers.__version__, "vocab": vocab_size(args),
                       "runs": runs, "reference": reference_run(runs), "distance_from_reference": distance},
                      f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        plot(runs, args.png, f"{args.family} model, key-value lookup, batch {args.batch} x seqlen "
                             f"{args.seqlen}, bf16 autocast")
    return 0


if __name__ == "__main__":
    sys.exit(main())
