"""Greedy generation from a transformers Llama with fagen's paged KV-cache attention in a CUDA graph.

    FAGEN_BUNDLE=generated/default python examples/generate_paged.py
    python examples/generate_paged.py --new-tokens 128 --page-size 32 --dtype fp16

A client of fagen's serving path. A small randomly initialised Llama (transformers' LlamaConfig: 4
layers, hidden 256, 8 query heads, 2 key/value heads, head_dim 64) generates --new-tokens tokens
greedily for four prompts of different lengths (5, 17, 33 and 60 random token ids), twice:

- the reference: the model's own generate() on its eager attention, one prompt at a time (no
  padding);
- fagen: a manual loop over the same modules, layer by layer, with K/V in a paged cache (pages of
  --page-size keys from one pool, handed to the rows in a random order through a block table) and
  attention by fagen.torch.flash_attn_with_kvcache, which appends each step's K/V at the rows'
  lengths. The prompts are prefilled together, packed into one batch of different lengths
  (fagen.torch.flash_attn_varlen_func, each prompt's K/V written into its pages); then the rows
  decode together, one token per row per step: the step is captured once in a CUDA graph and
  replayed, the next tokens and the cache lengths updated inside the graph, so nothing waits on
  the host.

The check: at every step, fagen's token must be the argmax of the logits the model's own forward
(eager attention) gives over the prompt and fagen's earlier tokens, or lie within NEAR_TIE_ULPS
units in the last place (ulp) of that best logit. Equality with generate() is printed but not
required: the logits are bf16 (fp16), where a random model's best two are often one ulp apart, so
any correct change of rounding (another attention kernel, 4 rows instead of 1 in the projections)
now and then picks the other one, and the sequences part there. Emulated on a CPU (12 seeds, bf16),
a correct paged attention and torch SDPA both parted from generate() in most seeds, with gaps of at
most 2 ulp; an off-by-one in the cache lengths gave gaps of 4 to 19 ulp.

Printed: per row, how far fagen's tokens equal generate()'s and the largest gap (exit status 1
if one exceeds NEAR_TIE_ULPS), the same for the SDPA loop below as a control, and the decode step
time (median over the steps, CUDA events around each replay) of fagen's graph and of
the same loop, also graphed, with torch SDPA over a contiguous (batch, capacity) cache masked by
each row's length. Needs a CUDA GPU and fagen kernels for it: --bundle, else $FAGEN_BUNDLE, else
fagen's default bundle.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys

import torch
import torch.nn.functional as F

PROMPT_LENGTHS = (5, 17, 33, 60)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_KEYS = 16  # fagen's paged kernels read the cache 16 keys at a time
NEAR_TIE_ULPS = 3  # a step's token may lie this many units in the last place below the best logit


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--page-size", type=int, default=16, help=f"keys per cache page, a multiple of {KERNEL_KEYS}")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--bundle", help="fagen's kernels (default: $FAGEN_BUNDLE, else fagen's default bundle)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the prompts and the page order")
    args = p.parse_args()
    if args.page_size <= 0 or args.page_size % KERNEL_KEYS:
        p.error(f"--page-size must be a positive multiple of {KERNEL_KEYS}")
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (one decode step after the prefill)")
    return args


def build_model(dtype: torch.dtype, device, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    # No end-of-sequence token, so that generate() never stops early, and no token suppressed.
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         bos_token_id=None, eos_token_id=None, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def reference_tokens(model, prompts: list[torch.Tensor], new_tokens: int) -> torch.Tensor:
    """(batch, new_tokens): the model's own greedy generation, one prompt at a time."""
    rows = [model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=new_tokens,
                           do_sample=False)[0, p.numel():] for p in prompts]
    return torch.stack(rows)


def gaps_to_best(model, prompts: list[torch.Tensor], generated: torch.Tensor) -> torch.Tensor:
    """(batch, new_tokens): at each step, how many units in the last place (of the best logit, in the
    model's dtype) the chosen token's logit lies below the best one, by the model's own forward over
    the prompt and the tokens before it; 0 where the token is the argmax."""
    finfo, rows = torch.finfo(model.dtype), []
    for prompt, tokens in zip(prompts, generated):
        logits = model(torch.cat([prompt, tokens[:-1]])[None], logits_to_keep=tokens.numel()).logits[0].float()
        best = logits.max(-1).values
        ulp = finfo.eps * torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(finfo.tiny))))
        rows.append((best - logits.gather(-1, tokens[:, None])[:, 0]) / ulp)
    return torch.stack(rows)


def forward(model, token_ids: torch.Tensor, positions: torch.Tensor, attend, last=None) -> torch.Tensor:
    """Logits (batch, vocab) of each row's last token: the model's decoder layers (LlamaDecoderLayer's
    order of operations) with attention by attend(layer, q, k, v), q (batch, seqlen, nheads_q, d) and
    k, v (batch, seqlen, nheads_kv, d), which also keeps k and v in its cache. `last`: the tokens
    (of batch row 0) whose logits to return instead, for a packed batch."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hidden = model.model.embed_tokens(token_ids)
    cos, sin = model.model.rotary_emb(hidden, positions)  # (batch, seqlen, head_dim)
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        heads = (*x.shape[:2], -1, attn.head_dim)  # flash-attn's layout: tokens before heads
        q, k, v = attn.q_proj(x).view(heads), attn.k_proj(x).view(heads), attn.v_proj(x).view(heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        hidden = hidden + attn.o_proj(attend(index, q, k, v).flatten(2))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden[:, -1] if last is None else hidden[0, last]))


class PagedCache:
    """Each layer's K and V pages (num_pages, page_size, nheads_kv, d) in one pool shared by the
    rows, the block table (batch, pages_per_row) handing each row its pages, and the row lengths."""

    def __init__(self, config, batch: int, capacity: int, page_size: int, dtype, device, generator, bundle):
        per_row = capacity // page_size
        shape = (batch * per_row, page_size, config.num_key_value_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        # A random page order, as in a server's pool: a row's pages are neither adjacent nor in order.
        order = torch.randperm(shape[0], generator=generator)
        self.table = order.view(batch, per_row).to(device=device, dtype=torch.int32)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.page_size = page_size
        self.bundle = bundle

    def prefill(self, model, prompts: list[torch.Tensor]) -> torch.Tensor:
        """The prompts packed into one batch of sequences (varlen, as a server prefills): attention
        over each prompt's own tokens, each token's K/V written into its row's page; the first new
        token of each row."""
        from fagen.torch import flash_attn_varlen_func

        device, lengths = self.lens.device, [p.numel() for p in prompts]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.tensor(lengths, device=device))
        pages, slots = self.table[rows, positions // self.page_size].long(), positions % self.page_size

        def attend(layer, q, k, v):
            self.k[layer][pages, slots], self.v[layer][pages, slots] = k[0], v[0]
            return flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max(lengths), max(lengths), causal=True,
                                          bundle=self.bundle)[None]

        logits = forward(model, torch.cat(prompts)[None], positions[None], attend, last=cu[1:].long() - 1)
        self.lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        return logits.argmax(-1)

    def attention(self, rows: slice):
        """attend() for these rows: appends k, v at their lengths (which the caller then advances)."""
        from fagen.torch import flash_attn_with_kvcache

        table, lens = self.table[rows], self.lens[rows]
        return lambda layer, q, k, v: flash_attn_with_kvcache(
            q, self.k[layer], self.v[layer], k=k, v=v, cache_seqlens=lens, block_table=table, causal=True,
            bundle=self.bundle)


class ContiguousCache:
    """The baseline: each layer's K and V (batch, capacity, nheads_kv, d), attention by torch SDPA."""

    def __init__(self, config, batch: int, capacity: int, dtype, device):
        shape = (batch, capacity, config.num_key_value_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)

    def prefill(self, model, prompts: list[torch.Tensor]) -> torch.Tensor:
        """Each prompt through the model on its own row of the cache; the first new token of each row."""
        first = []
        for row, prompt in enumerate(prompts):
            positions = torch.arange(prompt.numel(), device=prompt.device)[None]
            first.append(forward(model, prompt[None], positions, self.attention(slice(row, row + 1))).argmax(-1))
            self.lens[row] = prompt.numel()
        return torch.cat(first)

    def attention(self, rows: slice):
        lens = self.lens[rows]

        def attend(layer, q, k, v):
            k_cache, v_cache = self.k[layer][rows], self.v[layer][rows]
            batch, seqlen, heads_q, dim = q.shape
            heads_kv, capacity = k.shape[2], k_cache.shape[1]
            group = heads_q // heads_kv
            positions = lens.long()[:, None] + torch.arange(seqlen, device=q.device)
            row_ids = torch.arange(batch, device=q.device)[:, None]
            k_cache[row_ids, positions], v_cache[row_ids, positions] = k, v
            # Bottom-right causal: a new token sees the keys up to its own position, none past a row's length.
            visible = torch.arange(capacity, device=q.device) <= positions[..., None]  # (batch, seqlen, capacity)
            # GQA without enable_gqa, which not every masked SDPA kernel takes: a key head's query
            # heads become query rows of that head, so each key is read once per key head.
            q_rows = q.view(batch, seqlen, heads_kv, group, dim).permute(0, 2, 3, 1, 4)
            q_rows = q_rows.reshape(batch, heads_kv, group * seqlen, dim)
            mask = visible[:, None, None].expand(batch, 1, group, seqlen, capacity).reshape(batch, 1, -1, capacity)
            out = F.scaled_dot_product_attention(q_rows, k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                                 attn_mask=mask)
            return out.view(batch, heads_kv, group, seqlen, dim).permute(0, 3, 1, 2, 4).reshape(q.shape)

        return attend


def capture(step, state: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
    """step() captured in a CUDA graph after a warm-up run on a side stream (torch's recipe: it loads
    the kernels and settles the allocator outside the capture). The warm-up advances the `state`
    tensors, which are restored; the K/V it appended sits past the rows' lengths, unread until the
    first replay writes over it."""
    saved = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t, value in zip(state, saved):
        t.copy_(value)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def generate(model, prompts: list[torch.Tensor], new_tokens: int, cache) -> tuple[torch.Tensor, float]:
    """(batch, new_tokens) greedy tokens and the median decode step time in ms: the cache's prefill,
    then all rows together, one token each per replay of the captured step."""
    tokens = cache.prefill(model, prompts)  # the step's input and, after a replay, its output
    attend = cache.attention(slice(None))

    def step():
        logits = forward(model, tokens[:, None], cache.lens[:, None], attend)  # a row's position: its length
        tokens.copy_(logits.argmax(-1))
        cache.lens += 1

    graph = capture(step, [tokens, cache.lens])
    generated = torch.empty(len(prompts), new_tokens, dtype=torch.long, device=tokens.device)
    generated[:, 0] = tokens
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(new_tokens - 1)]
    for index, (start, end) in enumerate(events, start=1):
        start.record()
        graph.replay()
        end.record()
        generated[:, index] = tokens
    torch.cuda.synchronize()
    return generated, statistics.median(start.elapsed_time(end) for start, end in events)


def agreement(got: torch.Tensor, want: torch.Tensor, gaps: torch.Tensor) -> str:
    """One row's tokens against generate()'s and the reference's best logits."""
    differs = (got != want).nonzero()
    same = "equals generate()" if not differs.numel() else f"equals generate() for {int(differs[0])} tokens"
    return (f"{same}; {int((gaps > 0).sum())} of {gaps.numel()} steps off the argmax, "
            f"largest gap {gaps.max():.1f} ulp")


@torch.no_grad()
def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("generate_paged.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to do")
        return 0
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    model = build_model(dtype, device, args.seed)
    config = model.config
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(config.vocab_size, (n,), generator=generator).to(device) for n in PROMPT_LENGTHS]
    # Whole pages; a multiple of 16 keys also keeps SDPA's mask aligned for its memory-efficient kernel.
    batch = len(prompts)
    capacity = math.ceil((max(PROMPT_LENGTHS) + args.new_tokens) / args.page_size) * args.page_size
    print(f"Llama: {config.num_hidden_layers} layers, {config.num_attention_heads}:{config.num_key_value_heads} "
          f"heads, head_dim {config.head_dim}, {args.dtype}; prompts of {', '.join(map(str, PROMPT_LENGTHS))} "
          f"tokens, {args.new_tokens} new tokens each, pages of {args.page_size}")

    want = reference_tokens(model, prompts, args.new_tokens)
    paged = PagedCache(config, batch, capacity, args.page_size, dtype, device, generator, args.bundle)
    got, fagen_ms = generate(model, prompts, args.new_tokens, paged)
    contiguous = ContiguousCache(config, batch, capacity, dtype, device)
    control, sdpa_ms = generate(model, prompts, args.new_tokens, contiguous)
    gaps, control_gaps = gaps_to_best(model, prompts, got), gaps_to_best(model, prompts, control)

    for row, n in enumerate(PROMPT_LENGTHS):
        label = f"row {row} (prompt {n:2d} tokens)"
        verdict = "" if gaps[row].max() <= NEAR_TIE_ULPS else f"  FAILED (> {NEAR_TIE_ULPS} ulp)"
        print(f"{label}  fagen: {agreement(got[row], want[row], gaps[row])}{verdict}")
        print(f"{'':{len(label)}}  SDPA:  {agreement(control[row], want[row], control_gaps[row])}")
    print(f"decode step (batch {batch}, CUDA graph, median of {args.new_tokens - 1}): "
          f"fagen paged {fagen_ms:.3f} ms, SDPA contiguous {sdpa_ms:.3f} ms")
    failed = bool(gaps.max() > NEAR_TIE_ULPS)
    print(f"FAILED: a token of fagen's loop lies more than {NEAR_TIE_ULPS} ulp below the model's best logit"
          if failed else "OK: every token of fagen's loop is the model's own greedy choice (up to near-ties)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
