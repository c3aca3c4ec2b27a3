"""fagen as a transformers attention implementation, on the CPU: fagen.torch.flash_attn_func is
replaced by an SDPA reference that checks what it receives (layout, causal flag, scale, GQA heads)
and computes flash-attn's semantics (bottom-right causal). transformers is optional: the model
tests skip without it (CI); the import checks run everywhere."""

from __future__ import annotations

import copy

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BATCH, SEQLEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2, 11, 4, 2, 16, 2


def _python(code: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


# ---------------------------------------------------------------- no transformers needed

def test_importing_fagen_torch_does_not_import_transformers():
    pytest.importorskip("torch")
    result = _python("import sys, fagen, fagen.torch\n"
                     "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
                     "print('ok')")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_missing_transformers_names_the_extra():
    result = _python(
        "import sys\n"
        "sys.modules['transformers'] = None  # as if it were not installed\n"
        "try:\n"
        "    import fagen.integrations.transformers\n"
        "except ImportError as error:\n"
        "    print(error)\n"
        "else:\n"
        "    print('imported')\n")
    assert result.returncode == 0, result.stderr
    assert "pip install 'fagen[transformers]'" in result.stdout, result.stdout


# ---------------------------------------------------------------- with transformers

@pytest.fixture
def tf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import fagen.integrations.transformers as integration

    return integration


@pytest.fixture
def kernel(tf, monkeypatch):
    """The kernel replaced by a checking SDPA reference (at the integration's one lookup of
    fagen.torch.flash_attn_func, so fagen.torch is not imported); its calls are recorded."""
    import torch
    import torch.nn.functional as F

    calls = []

    def reference(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), **options):
        calls.append({"q": q, "k": k, "v": v, "causal": causal, "scale": softmax_scale, "options": options})
        assert q.dim() == k.dim() == v.dim() == 4
        assert q.shape[0] == k.shape[0] == v.shape[0]
        assert q.shape[2] == HEADS and k.shape[2] == v.shape[2] == KV_HEADS, \
            "(batch, seq, heads, dim), k/v with their own heads (no repeat_kv)"
        assert q.shape[3] == k.shape[3] == HEAD_DIM
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert isinstance(causal, bool)
        assert softmax_scale == pytest.approx(HEAD_DIM ** -0.5)
        assert q.dtype == k.dtype == v.dtype
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        options = {**options, "window_size": window_size} if tuple(window_size) != (-1, -1) else options
        calls[-1]["options"] = options
        left, right = window_size
        right = 0 if causal else right
        row = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q  # flash-attn's bottom-right alignment
        col = torch.arange(seqlen_k)[None, :]
        mask = None
        if right >= 0 or left >= 0:
            mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
            if right >= 0:
                mask &= col <= row + right
            if left >= 0:
                mask &= col >= row - left
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous()

    def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                         softmax_scale=None, **options):
        """flash_attn_varlen_func: each sequence through `reference`, recorded as one call."""
        assert q.dim() == k.dim() == v.dim() == 3 and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert q.shape[0] == int(cu_seqlens_q[-1]) and k.shape[0] == int(cu_seqlens_k[-1])
        lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        assert max_seqlen_q == max(lengths_q) and max_seqlen_k == max(lengths_k)
        outs = [reference(q[a:a + n][None], k[b:b + m][None], v[b:b + m][None], causal=causal,
                          softmax_scale=softmax_scale, **options)[0]
                for a, n, b, m in zip(cu_seqlens_q[:-1].tolist(), lengths_q, cu_seqlens_k[:-1].tolist(), lengths_k)]
        del calls[-len(outs):]
        calls.append({"q": q, "k": k, "v": v, "causal": causal, "scale": softmax_scale, "options": options,
                      "cu_seqlens": (cu_seqlens_q, cu_seqlens_k)})
        return torch.cat(outs)

    monkeypatch.setattr(tf, "_flash_attn_func", lambda: reference)
    monkeypatch.setattr(tf, "_flash_attn_varlen_func", lambda: varlen_reference)
    return calls


def test_the_kernel_is_fagen_torch_flash_attn_func(tf):
    import fagen.torch

    assert tf._flash_attn_func() is fagen.torch.flash_attn_func


def _model(attn="fagen", **config):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    fields = dict(vocab_size=97, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=128,
                  max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**fields, **config}),
                                            attn_implementation=attn).eval()


def _tokens(batch=BATCH, seqlen=SEQLEN):
    import torch

    return torch.randint(0, 97, (batch, seqlen), generator=torch.Generator().manual_seed(1))


def test_logits_match_sdpa(kernel):
    import torch

    model, x = _model(), _tokens()
    assert model.config._attn_implementation == "fagen"
    with torch.no_grad():
        ours = model(x).logits
        assert len(kernel) == LAYERS
        assert all(c["causal"] and c["q"].shape == (BATCH, SEQLEN, HEADS, HEAD_DIM) for c in kernel)
        assert all(c[t]._is_view() for c in kernel for t in "qkv"), "views, no copies"
        model.set_attn_implementation("sdpa")
        theirs = model(x).logits
    assert len(kernel) == LAYERS, "sdpa must not call fagen"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_cached_decoding_matches_a_full_forward(kernel):
    """Prefill 7 tokens, then 4 more against the cache: the second call's causal mask is
    bottom-right aligned (4 queries, 11 keys), which the mask function lets through as None."""
    import torch

    model, x = _model(), _tokens()
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        prefill = model(x[:, :7], use_cache=True)
        rest = model(x[:, 7:], past_key_values=prefill.past_key_values, use_cache=True).logits
    assert kernel[-1]["q"].shape[1] == 4 and kernel[-1]["k"].shape[1] == SEQLEN and kernel[-1]["causal"]
    torch.testing.assert_close(rest, full[:, 7:], rtol=1e-5, atol=1e-5)


def test_gradients_flow(kernel):
    import torch

    model, x = _model(), _tokens()
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert kernel and all(c["q"].requires_grad for c in kernel)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "q_proj" in n)


def test_autocast_casts_fp32_qkv_to_the_autocast_dtype(kernel):
    import torch

    model, x = _model(), _tokens()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert kernel and all(c["q"].dtype == c["k"].dtype == c["v"].dtype == torch.bfloat16 for c in kernel)


def test_padding_mask_is_refused(kernel):
    import torch

    model, x = _model(), _tokens()
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding in the second row
    with pytest.raises(NotImplementedError, match=r"padding attention mask.*attn_implementation=\"sdpa\""):
        model(x, attention_mask=mask)
    assert not kernel


def test_all_ones_mask_is_accepted(kernel):
    import torch

    model, x = _model(), _tokens()
    with torch.no_grad():
        ours = model(x, attention_mask=torch.ones_like(x)).logits
        model.set_attn_implementation("sdpa")
        theirs = model(x).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_materialised_4d_masks(kernel):
    """A 4-D mask the caller built: the causal pattern runs (as causal), anything else is refused."""
    import torch

    model, x = _model(), _tokens()
    causal = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool).tril()[None, None].expand(BATCH, 1, -1, -1)
    with torch.no_grad():
        ours = model(x, attention_mask=causal).logits
        assert all(c["causal"] for c in kernel)
        model.set_attn_implementation("sdpa")
        theirs = model(x).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    holed = causal.clone()
    holed[0, 0, 5, 2] = False
    model.set_attn_implementation("fagen")
    with pytest.raises(NotImplementedError, match="other than the causal"):
        model(x, attention_mask=holed)


def test_packed_sequences_run_as_varlen_calls(kernel):
    """Sequences packed in rows (position_ids restarting, DataCollatorWithFlattening's form): one
    varlen call per layer over the flattened rows, each sequence attending within itself, the
    logits those of each sequence alone; the collator's cu_seq_lens_q/_k are taken too."""
    import torch

    model, x = _model(), _tokens(batch=2)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        packed = model(x, position_ids=positions, use_cache=False).logits
        assert len(kernel) == LAYERS
        assert all(c["cu_seqlens"][0].tolist() == [0, 5, 11, 14, 22] and c["causal"] for c in kernel)
        for row, begin, end in ((0, 0, 5), (0, 5, 11), (1, 0, 3), (1, 3, 11)):
            alone = model(x[row:row + 1, begin:end], use_cache=False).logits
            torch.testing.assert_close(packed[row:row + 1, begin:end], alone, rtol=1e-5, atol=1e-5)
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(packed, model(x, position_ids=positions, use_cache=False).logits,
                                   rtol=1e-5, atol=1e-5)


def test_the_collators_offsets_are_taken(tf, kernel):
    import torch

    module = torch.nn.Module()
    q = torch.randn(1, HEADS, 9, HEAD_DIM)
    k = v = torch.randn(1, KV_HEADS, 9, HEAD_DIM)
    offsets = torch.tensor([0, 4, 9])
    out, _ = tf.fagen_attention_forward(module, q, k, v, None, scaling=HEAD_DIM ** -0.5, cu_seq_lens_q=offsets,
                                        cu_seq_lens_k=offsets, max_length_q=5, max_length_k=5)
    assert out.shape == (1, 9, HEADS, HEAD_DIM) and kernel[-1]["cu_seqlens"][0].tolist() == [0, 4, 9]
    first, _ = tf.fagen_attention_forward(module, q[:, :, :4], k[:, :, :4], v[:, :, :4], None,
                                          scaling=HEAD_DIM ** -0.5)
    torch.testing.assert_close(out[:, :4], first)


def test_packed_sequences_over_a_cache_are_refused(tf):
    import torch
    from transformers import masking_utils

    ids = torch.tensor([[0, 0, 1, 1]])
    packed = masking_utils.and_masks(masking_utils.causal_mask_function,
                                     masking_utils.packed_sequence_mask_function(ids))
    mask = tf.fagen_mask(batch_size=1, q_length=4, kv_length=4, q_offset=0, kv_offset=0, mask_function=packed)
    assert isinstance(mask, tf.PackedSequences) and mask.cu_seqlens.tolist() == [0, 2, 4] and mask.max_seqlen == 2
    with pytest.raises(NotImplementedError, match="packed sequences over a cache"):
        tf.fagen_mask(batch_size=1, q_length=4, kv_length=8, q_offset=4, kv_offset=0, mask_function=packed)


def test_dropout_in_training_is_refused(kernel):
    model, x = _model(attention_dropout=0.1), _tokens()
    model.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        model(x)
    model.eval()  # the module passes dropout=0.0 in eval mode
    model(x)


def test_unsupported_head_dim_is_refused(kernel):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=97, hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)  # head_dim 12
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fagen")
    with pytest.raises(NotImplementedError, match="head_dim=12.*multiple of 8"):
        model(_tokens())


def test_sliding_window_runs_as_flash_attns_window(kernel):
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(vocab_size=97, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=1,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=64,
                           sliding_window=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fagen").eval()
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(model.state_dict())
    tokens = _tokens(seqlen=21)
    with torch.no_grad():
        got, expected = model(tokens).logits, sdpa(tokens).logits
    assert kernel[-1]["causal"] is True and kernel[-1]["options"]["window_size"] == (7, 7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_direct_call_refusals(tf, kernel):
    import torch

    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, HEADS, 5, HEAD_DIM)
    k = v = torch.randn(1, KV_HEADS, 5, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    out, weights = tf.fagen_attention_forward(module, q, k, v, None, scaling=scale)
    assert out.shape == (1, 5, HEADS, HEAD_DIM) and weights is None and kernel[-1]["causal"]
    received = kernel[-1]["q"]
    assert received.data_ptr() == q.data_ptr() and received.stride() == q.transpose(1, 2).stride(), \
        "q must arrive as a transposed view of the caller's tensor, not a copy"
    tf.fagen_attention_forward(module, q, k, v, None, scaling=scale, is_causal=False)
    assert kernel[-1]["causal"] is False, "the call's is_causal wins over the module's"
    module.is_causal = False
    tf.fagen_attention_forward(module, q, k, v, None, scaling=scale)
    assert kernel[-1]["causal"] is False, "the module's is_causal, when the call has none"
    module.is_causal = True
    sinks = torch.zeros(HEADS)
    tf.fagen_attention_forward(module, q, k, v, None, scaling=scale, softcap=30.0, s_aux=sinks)
    assert kernel[-1]["options"]["softcap"] == 30.0 and kernel[-1]["options"]["learnable_sink"] is sinks, \
        "Gemma-2's softcap and gpt-oss's sinks (s_aux) go to the kernel"
    for options, match in [({"dropout": 0.1}, "dropout"),
                           ({"position_bias": torch.zeros(1)}, "position bias"),
                           ({"output_attentions": True}, "output_attentions")]:
        with pytest.raises(NotImplementedError, match=match):
            tf.fagen_attention_forward(module, q, k, v, None, scaling=scale, **options)


def test_register_with_options(tf, kernel):
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert tf.register("fagen_test_det", deterministic=True) == "fagen_test_det"
    module = torch.nn.Module()
    q = torch.randn(1, HEADS, 3, HEAD_DIM)
    k = v = torch.randn(1, KV_HEADS, 3, HEAD_DIM)
    ALL_ATTENTION_FUNCTIONS["fagen_test_det"](module, q, k, v, None, scaling=HEAD_DIM ** -0.5)
    assert kernel[-1]["options"] == {"deterministic": True}
    ALL_ATTENTION_FUNCTIONS["fagen"](module, q, k, v, None, scaling=HEAD_DIM ** -0.5)
    assert kernel[-1]["options"] == {}


def test_mask_function(tf):
    """The mask interface: None for plain causal/full attention over unpadded keys (causal: the
    last query is the last key), NotImplementedError otherwise; 4.5x's cache_position form too."""
    import torch
    from transformers import masking_utils

    causal = masking_utils.causal_mask_function
    decode = dict(batch_size=2, q_length=4, kv_length=11, q_offset=7, kv_offset=0, mask_function=causal)
    assert tf.fagen_mask(**decode) is None
    assert tf.fagen_mask(**decode, attention_mask=torch.ones(2, 11, dtype=torch.bool)) is None
    assert tf.fagen_mask(batch_size=2, cache_position=torch.arange(7, 11), kv_length=11, kv_offset=0,
                         mask_function=causal) is None
    with pytest.raises(NotImplementedError, match="not the last key"):
        tf.fagen_mask(**{**decode, "q_offset": 0})
    with pytest.raises(NotImplementedError, match="keys beyond the attention mask"):
        tf.fagen_mask(**decode, attention_mask=torch.ones(2, 9, dtype=torch.bool))
    padded = torch.ones(2, 11, dtype=torch.bool)
    padded[0, 0] = False
    with pytest.raises(NotImplementedError, match="padding"):
        tf.fagen_mask(**decode, attention_mask=padded)
    if hasattr(masking_utils, "bidirectional_mask_function"):  # transformers >= 5
        full = {**decode, "q_offset": 0, "mask_function": masking_utils.bidirectional_mask_function}
        assert tf.fagen_mask(**full) is None  # full attention needs no alignment
    window = {**decode, "allow_is_causal_skip": True,
              "mask_function": masking_utils.sliding_window_causal_mask_function(11)}
    assert tf.fagen_mask(**window, local_size=11) is None  # a window of 11 over 11 keys masks nothing
    narrow = {**window, "mask_function": masking_utils.sliding_window_causal_mask_function(10)}
    assert tf.fagen_mask(**narrow, local_size=10) is None  # a window the attention function runs
    with pytest.raises(NotImplementedError, match="sliding-window or chunked"):  # not the window of local_size
        tf.fagen_mask(**window, local_size=10)
    overlay = masking_utils.and_masks(causal, lambda b, h, q, kv: kv >= 0)
    with pytest.raises(NotImplementedError, match="other than plain causal"):
        tf.fagen_mask(**{**decode, "mask_function": overlay})


def test_the_window_probe_is_one_call_on_index_tensors(tf):
    """A causal sliding window is recognised from one call of its mask function on index tensors
    (pair by pair it was ~1500 calls, ~55 ms per forward at a window of 256), and a mask function
    that only takes scalars still gets the pair-by-pair answer."""
    import torch
    from transformers import masking_utils

    calls = []
    window = masking_utils.sliding_window_causal_mask_function(256)

    def counted(*args):
        calls.append(args)
        return window(*args)

    assert tf._is_causal_window(counted, 256) and len(calls) == 1
    assert not tf._is_causal_window(counted, 255)

    def scalar_only(b, h, q, kv):
        return bool(q - 256 < kv <= q)  # bool() of a many-element tensor raises

    assert tf._is_causal_window(scalar_only, 256)
    assert not tf._is_causal_window(lambda b, h, q, kv: torch.ones_like(q, dtype=torch.bool), 256)
