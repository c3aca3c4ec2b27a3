"""fagen inside a real client: randomly initialised models of Hugging Face transformers with
attn_implementation="fagen": Llama-style; Mistral-style with a sliding window of 256 keys over
1024; Gemma-2-style (softcap 50 on every layer, a window of 256 on every other, head_dim 128);
gpt-oss-style (sinks on every layer, a window of 128 on every other, head_dim 64); DeepSeek-V3-style
(multi-head latent attention: q and k of 192 = 128 + 64 rotary, v of 128; MoE), and Llama on
packed sequences, against the same model in fp32 eager attention, with the noise of bf16 set by
"sdpa" (or, where sdpa has no softcap or sinks, eager attention under bf16 autocast). Skips
without transformers."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_backward import assert_grads_close, require_backward  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# DeepSeek-V3's attention at a small width: its head dims (q, k: 128 + 64 rotary; v: 128), low-rank
# K/V and Q projections; 4 routed experts (2 per token) in one group, the first layer dense.
DEEPSEEK_V3_ATTENTION = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=128,
                             q_lora_rank=256, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                             topk_group=1, first_k_dense_replace=1, moe_intermediate_size=256)


def model(attn: str, seqlen: int, family: str = "llama"):
    import fagen.integrations.transformers  # noqa: F401  (registers "fagen")

    sizes = dict(vocab_size=576, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1376, max_position_embeddings=seqlen,
                 attention_dropout=0.0, tie_word_embeddings=False)
    if family == "mistral":
        config = transformers.MistralConfig(**sizes, sliding_window=256)
    elif family == "gemma2":
        config = transformers.Gemma2Config(**sizes, head_dim=128, query_pre_attn_scalar=128, sliding_window=256,
                                           attn_logit_softcapping=50.0, final_logit_softcapping=None)
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(**sizes, head_dim=64, sliding_window=128, num_local_experts=4,
                                           num_experts_per_tok=2)
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(**{**sizes, "num_key_value_heads": 8}, **DEEPSEEK_V3_ATTENTION)
    else:
        config = transformers.LlamaConfig(**sizes)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).cuda()


def parameter_gradients(net, tokens, autocast: bool, **inputs) -> dict:
    """Every parameter's gradient after one next-token loss on `tokens` (bf16 autocast or fp32)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = net(input_ids=tokens[:, :-1], **inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return {n: p.grad.float() for n, p in net.named_parameters()}


def worst_gradient(grads: dict, ours: str, noise: str, reference: str = "eager") -> tuple:
    """(ratio, name, our error, the noise run's error) of the parameter whose gradient is
    furthest from `reference`'s relative to the noise run's distance."""
    worst = []
    for name, ref in grads[reference].items():
        scale = ref.norm().item() + 1e-12
        mine = (grads[ours][name] - ref).norm().item() / scale
        theirs = (grads[noise][name] - ref).norm().item() / scale
        worst.append((mine / max(theirs, 1e-3), name, mine, theirs))
    return max(worst)


def test_attention_gradients_at_the_models_shapes(bundle):
    # The layout transformers hands over: (batch, heads, seq, dim) views transposed to
    # flash-attn's layout, 8 query heads on 2 K/V heads, seqlen a multiple of every block.
    require_backward(bundle, torch.bfloat16, 64, True)
    torch.manual_seed(21)
    q, k, v = (torch.randn(16, heads, 1024, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .detach().requires_grad_(True) for heads in (8, 2, 2))
    dout = torch.randn(16, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert_grads_close(q, k, v, dout, True, scale=1 / math.sqrt(64))


# family: (the kernels it needs beside the causal ones: (head_dim, variant, score, head_dim_v), its
# noise run)
FAMILIES = {"llama": ((64, "causal", (), None), "sdpa"), "mistral": ((64, "local", (), None), "sdpa"),
            "gemma2": ((128, "local", ("softcap",), None), "eager-bf16"),
            "gpt_oss": ((64, "local", ("sinks",), None), "eager-bf16"),
            "deepseek_v3": ((192, "causal", (), 128), "sdpa")}


@pytest.mark.parametrize("family", FAMILIES)
def test_model_gradients_match_sdpa_within_the_noise_of_bf16(bundle, family):
    (head_dim, mask, score, head_dim_v), noise = FAMILIES[family]
    require_backward(bundle, torch.bfloat16, head_dim, mask, score, head_dim_v)
    require_backward(bundle, torch.bfloat16, head_dim, "causal", score, head_dim_v)
    seqlen = 1024
    tokens = torch.randint(0, 576, (4, seqlen + 1), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(3))
    grads = {run: parameter_gradients(model("eager" if run == "eager-bf16" else run, seqlen, family), tokens,
                                      run != "eager")
             for run in ("fagen", noise, "eager")}
    # fp32 eager is the reference; the noise run under bf16 autocast sets the noise each tensor
    # may have.
    ratio, name, ours, theirs = worst_gradient(grads, "fagen", noise)
    assert ratio <= 3, f"{name}: relative error {ours:.3e} against {noise}'s {theirs:.3e} (of fp32 eager)"


def test_packed_sequences_match_sdpa_within_the_noise_of_bf16(bundle):
    """Training on packed sequences (DataCollatorWithFlattening's form: rows of several sequences,
    position_ids restarting at each): fagen runs each layer as one varlen call over the rows'
    tokens; the gradients against fp32 eager attention over the same packing (transformers' block
    mask) within 3x those of sdpa under bf16 autocast."""
    key = contract.kernel_key("bwd", "bf16", 64, "causal", layout="varlen")
    try:
        bundle.select(key, torch.cuda.get_device_capability())
    except KernelNotFound as exc:
        pytest.skip(f"bundle has no {key}: {str(exc).splitlines()[0]}")
    lengths = [[300, 77, 520, 127], [1, 1023]]  # two rows of 1024 tokens
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths]).cuda()
    tokens = torch.randint(0, 576, (2, 1025), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    grads = {run: parameter_gradients(model(run, 1024), tokens, run != "eager", position_ids=positions,
                                      use_cache=False)
             for run in ("fagen", "sdpa", "eager")}
    ratio, name, ours, theirs = worst_gradient(grads, "fagen", "sdpa")
    assert ratio <= 3, f"{name}: relative error {ours:.3e} against sdpa's {theirs:.3e} (of fp32 eager)"
