"""fagen as a Hugging Face transformers attention implementation ("fagen").

    import fagen.integrations.transformers  # registers "fagen"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fagen")
    # or: model.set_attn_implementation("fagen")

Works for every model whose attention layers call ``ALL_ATTENTION_FUNCTIONS[...]`` (Llama, Qwen2,
Mistral, ...). Two registrations, both under the same name:

- the attention function (``AttentionInterface``): transformers hands it q, k, v as
  (batch, heads, seq, head_dim); it calls ``fagen.torch.flash_attn_func`` on transposed views
  (batch, seq, heads, head_dim), k/v with their own heads (GQA without repeat_kv),
  ``causal`` from ``is_causal`` (the call's, else the module's), ``softmax_scale=scaling``,
  the model's ``sliding_window`` (Mistral, Qwen2, Gemma-2, gpt-oss), ``softcap`` (Gemma-2's
  attn_logit_softcapping) and ``s_aux`` as ``learnable_sink`` (gpt-oss's sinks), and returns (attn_output (batch, seq, heads, head_dim), None) like transformers' own;
- the mask function (``AttentionMaskInterface``, transformers >= 4.53): the model's
  ``create_causal_mask`` asks it for the mask of each forward. It returns None (no mask is
  built) when the mask is the plain causal or full pattern with no padding, and refuses
  anything else. Without it transformers would skip mask creation for an unknown
  implementation and pass None: a padded batch would silently attend to the padding.

Packed sequences (several per row, position_ids restarting at each, as transformers'
DataCollatorWithFlattening makes them): the mask function returns a ``PackedSequences`` (the
sequences' offsets, found once per forward) instead of a mask, and the attention function runs
``fagen.torch.flash_attn_varlen_func`` over the flattened rows, each sequence attending within
itself; the collator's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``max_length_q`` / ``_k``), where
a model passes them on, do the same.

What fagen's kernels cannot do is refused with NotImplementedError (naming it and pointing at
``attn_implementation="sdpa"``), never ignored: dropout > 0, padding or any mask beyond the
causal/full pattern (a StaticCache's unfilled slots, custom masks; packed sequences over a
cache), chunked attention that masks something, position biases,
output_attentions=True, and head dims fagen has no kernel for. Masks that arrive already
materialised (4-D, e.g. passed by the caller or built by transformers < 4.53) are accepted when
they are all-ones or exactly the bottom-right causal pattern; that check reads the mask (a
device sync per layer), so prefer 2-D masks or none.

fp32 q/k/v under ``torch.autocast`` (transformers' RoPE promotes q and k to fp32) are cast to the
autocast dtype, as transformers' flash-attention integration does; without autocast the model
must run in fp16/bf16.

Importing this module imports transformers; ``import fagen`` and ``import fagen.torch`` never do.
fagen.torch itself is imported at the first attention call.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401  (fails here, with the hint, when it is missing)
except ImportError as error:
    raise ImportError(
        "fagen.integrations.transformers needs Hugging Face transformers: "
        "pip install 'fagen[transformers]' (or pip install 'transformers>=4.48')"
    ) from error

import torch

from .. import contract

__all__ = [
    "NAME", "TESTED_TRANSFORMERS_VERSIONS", "PackedSequences", "fagen_attention_forward", "fagen_mask",
    "make_attention_forward", "register",
]

NAME = "fagen"

# transformers versions this module was run against, and how.
TESTED_TRANSFORMERS_VERSIONS = {
    "5.24.0": "CPU, torch 2.13: tests/unit/test_transformers_integration.py (an SDPA stand-in for "
              "the kernels: logits, cached decoding and gradients against 'sdpa'; the refusals)",
    "5.17.0": "CPU, torch 2.13: the same tests (the GPU machine's version)",
    "4.57.6": "CPU, torch 2.13: the same tests (mask interface called with cache_position)",
}
# Not run: 4.48-4.52 (no AttentionMaskInterface: the models build a 4-D mask, which the
# attention function checks at a device sync per layer), and any version on a GPU with the real
# kernels (examples/train_transformers.py is the run for that).

_SDPA_HINT = 'use attn_implementation="sdpa" (or "eager") for this model'


def _refuse(what: str, module=None, hint: str = "") -> NotImplementedError:
    """The error for a feature fagen lacks: what it is, where, and what to do instead."""
    where = f" in {type(module).__name__}" if module is not None else ""
    hint = f" ({hint})" if hint else ""
    return NotImplementedError(
        f"fagen attention{where}: {what} is not supported by fagen's kernels{hint}; {_SDPA_HINT}")


def _flash_attn_func():
    """fagen.torch.flash_attn_func, looked up at every call: patchable, and fagen.torch is
    imported at the first call, not with this module."""
    import fagen.torch

    return fagen.torch.flash_attn_func


def _flash_attn_varlen_func():
    """fagen.torch.flash_attn_varlen_func, looked up as _flash_attn_func."""
    import fagen.torch

    return fagen.torch.flash_attn_varlen_func


class PackedSequences:
    """The mask of packed sequences, as fagen_mask returns it: `cu_seqlens`, int32 (sequences + 1)
    on the device, the offsets of the sequences in the rows' tokens flattened (batch * seq), and
    `max_seqlen`, the longest one's tokens."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int):
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = max_seqlen

    @classmethod
    def of(cls, sequence_ids: torch.Tensor) -> "PackedSequences":
        """From transformers' packed-sequence indices (batch, seq): equal neighbours share a
        sequence, and every row starts one. Reads the device once (the offsets' count and the
        longest length)."""
        starts = torch.ones_like(sequence_ids, dtype=torch.bool)
        starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
        begins = starts.reshape(-1).nonzero().view(-1)
        cu_seqlens = torch.cat([begins, begins.new_tensor([sequence_ids.numel()])]).to(torch.int32)
        return cls(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))


# ------------------------------------------------------------------------------ mask function

try:
    from transformers import masking_utils as _masking_utils
except ImportError:  # transformers < 4.53: the models build their masks themselves
    _masking_utils = None

_CAUSAL = getattr(_masking_utils, "causal_mask_function", None)
_FULL = getattr(_masking_utils, "bidirectional_mask_function", None)


def _as_int(value) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _closure(function) -> dict:
    code = getattr(function, "__code__", None)
    cells = getattr(function, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code else {}


def _split_packed(mask_function):
    """A mask function without transformers' packed-sequence check, and the sequence indices
    (batch, seq) of that check where it finds several sequences in a row (else None). transformers
    4.5x wraps every cache-less mask in the check, even when position_ids show one sequence per
    row; 5.x only when they show more."""
    parts = _closure(mask_function).get("mask_functions")
    if (getattr(mask_function, "__name__", "") != "and_mask" or not isinstance(parts, tuple)
            or len(parts) != 2):
        return mask_function, None
    base, check = parts
    packed = _closure(check).get("packed_sequence_mask")
    if (not getattr(check, "__qualname__", "").startswith("packed_sequence_mask_function.")
            or not isinstance(packed, torch.Tensor)):
        return mask_function, None
    return base, packed if bool((packed[:, -1] != 0).any()) else None


def _is_causal_window(mask_function, size: int) -> bool:
    """Whether `mask_function` is the causal sliding window of `size` keys (transformers'
    sliding_window_causal_mask_function: query q sees keys q - size + 1 ... q), checked at the
    window's edges of a few queries, in one call on index tensors (the mask functions take
    them; called per pair, the probe of a window of 256 keys took ~30 ms per forward, more than
    the model's attention, 2026-12-02), else pair by pair."""
    pairs = sorted({(q, kv) for q in (0, 1, size - 1, size, size + 1, 3 * size + 2)
                    for kv in (q - size - 1, q - size, q - size + 1, q - 1, q, q + 1, q + 2) if kv >= 0})
    queries = torch.tensor([q for q, _ in pairs])
    keys = torch.tensor([kv for _, kv in pairs])
    expected = (queries - size < keys) & (keys <= queries)
    zero = torch.tensor(0)
    try:
        allowed = torch.as_tensor(mask_function(zero, zero, queries, keys))
        if allowed.shape != expected.shape:
            raise ValueError("not elementwise")
    except Exception:  # not elementwise on index tensors: one pair at a time
        try:
            allowed = torch.tensor([bool(mask_function(zero, zero, torch.tensor(q), torch.tensor(kv)))
                                    for q, kv in pairs])
        except Exception:  # a mask function that needs other arguments is no plain window
            return False
    return bool(torch.equal(allowed.bool(), expected))


def fagen_mask(**kwargs):
    """transformers' mask interface for "fagen" (called with keywords by create_causal_mask and
    friends): None when the attention is the plain causal or full pattern, or a causal sliding
    window, over keys without padding, which the attention function then runs with its
    is_causal and sliding_window; the same patterns over packed sequences (without a cache) as
    a PackedSequences; NotImplementedError for every other pattern. Never builds a mask.

    transformers 5.x passes q_length/q_offset, 4.53-4.57 cache_position; both are read.
    """
    mask_function, sequence_ids = _split_packed(kwargs.get("mask_function", _CAUSAL))
    padding = kwargs.get("attention_mask")
    kv_length = _as_int(kwargs["kv_length"])
    kv_offset = _as_int(kwargs.get("kv_offset", 0))
    if kwargs.get("q_length") is not None:
        q_length = _as_int(kwargs["q_length"])
        last_query = _as_int(kwargs.get("q_offset", 0)) + q_length - 1
    else:
        cache_position = kwargs["cache_position"]
        q_length = int(cache_position.shape[0])
        last_query = _as_int(cache_position[-1])

    local_size = kwargs.get("local_size")
    chunked = getattr(kwargs.get("config"), "attention_chunk_size", None) is not None
    if mask_function is _CAUSAL and _CAUSAL is not None:
        causal = True
    elif mask_function is _FULL and _FULL is not None:
        causal = False
    elif (local_size is not None and kwargs.get("allow_is_causal_skip", False)
          and kv_length <= local_size and (kv_offset == 0 or not chunked)):
        # A causal sliding window (or chunk) no smaller than the keys: masks nothing more.
        causal = True
    elif local_size is not None and not chunked and _is_causal_window(mask_function, _as_int(local_size)):
        causal = True  # the attention function gets the window as its sliding_window
    elif local_size is not None and kwargs.get("allow_is_causal_skip", False):
        raise _refuse(f"a sliding-window or chunked attention mask of size {local_size} over {kv_length} "
                      "keys other than transformers' causal sliding window")
    else:
        raise _refuse(
            "an attention pattern other than plain causal or full attention (a sliding window or "
            "chunk, or a model's mask overlay such as bidirectional image tokens)")

    if padding is not None:
        end = kv_offset + kv_length
        if padding.shape[-1] < end:
            raise _refuse(f"keys beyond the attention mask ({padding.shape[-1]} mask columns, keys "
                          f"up to position {end - 1})",
                          hint="e.g. a StaticCache's unfilled slots: use the default DynamicCache")
        if not bool(padding[:, kv_offset:end].all()):
            raise _refuse("a padding attention mask (attention_mask has zeros)",
                          hint="batches without padding run on fagen: pass attention_mask=None")
    if causal and last_query != kv_offset + kv_length - 1:
        raise _refuse(f"a causal mask whose last query (position {last_query}) is not the last key "
                      f"(position {kv_offset + kv_length - 1})",
                      hint="fagen aligns causal masks bottom-right; keys after the queries are, "
                           "e.g., a StaticCache's unfilled slots: use the default DynamicCache")
    if sequence_ids is not None:
        if kv_offset != 0 or kv_length != q_length or tuple(sequence_ids.shape[-1:]) != (q_length,):
            raise _refuse("packed sequences over a cache (queries after cached keys)",
                          hint="packed sequences run without a cache, e.g. in training")
        return PackedSequences.of(sequence_ids)
    return None


# ------------------------------------------------------------------------------ attention function

def _causal_from_mask(mask, q_length: int, kv_length: int, is_causal: bool, module) -> bool:
    """The causal flag equivalent to a mask that arrived materialised, or NotImplementedError.
    Reads the mask (a device sync)."""
    if not isinstance(mask, torch.Tensor):
        raise _refuse(f"an attention mask of type {type(mask).__name__}", module)
    if mask.dim() == 2:  # flash-attention style (batch, kv) padding mask
        if mask.shape[-1] == kv_length and bool(mask.bool().all()):
            return is_causal
        raise _refuse("a padding attention mask", module)
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_length, kv_length):
        raise _refuse(f"an attention mask of shape {tuple(mask.shape)}", module)
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        if not bool((allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            raise _refuse("an additive attention bias (a float mask with values other than 0 and "
                          "-inf/min)", module)
    else:
        raise _refuse(f"an attention mask of dtype {mask.dtype}", module)
    if bool(allowed.all()):
        return False
    rows = torch.arange(q_length, device=mask.device)[:, None] + (kv_length - q_length)
    if bool((allowed == (torch.arange(kv_length, device=mask.device)[None, :] <= rows)).all()):
        return True
    raise _refuse("an attention mask other than the causal (bottom-right) or full pattern "
                  "(padding, packed sequences, a sliding window, a cache's unfilled slots or a "
                  "custom mask)", module)


# Keyword arguments some models pass to their attention function for features fagen lacks.
_UNSUPPORTED_KWARGS = {
    "position_bias": "a position bias",
}


def _packing(attention_mask, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of packed sequences (the mask
    function's PackedSequences, else the collator's cu_seq_lens_q / _k), or None."""
    if isinstance(attention_mask, PackedSequences):
        p = attention_mask
        return p.cu_seqlens, p.cu_seqlens, p.max_seqlen, p.max_seqlen
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    maxima = [_as_int(given) if given is not None else int((cu[1:] - cu[:-1]).max())
              for cu, given in ((cu_q, kwargs.get("max_length_q")), (cu_k, kwargs.get("max_length_k")))]
    return cu_q.to(torch.int32), cu_k.to(torch.int32), *maxima


def _forward(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
             is_causal, kwargs, options):
    if dropout:
        raise _refuse(f"attention dropout (dropout={dropout})", module,
                      hint="set config.attention_dropout=0.0, or model.eval()")
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise _refuse(f"{what} ({name}=...)", module)
    if kwargs.get("output_attentions"):
        raise _refuse("output_attentions=True", module,
                      hint="fagen never materialises the attention weights")
    q_length, kv_length = query.shape[2], key.shape[2]
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    if key.shape[-1] != head_dim:
        raise _refuse(f"different q and k head dims ({head_dim}, {key.shape[-1]})", module)
    if problem := contract.head_dim_problem(head_dim):
        raise _refuse(f"head_dim={head_dim}", module, hint=problem.split(": ", 1)[-1])
    # v's may differ (DeepSeek-V3's 192 / 128: kernels built with head_dim_v).
    if problem := contract.head_dim_problem(head_dim_v, "head_dim_v"):
        raise _refuse(f"v's head_dim={head_dim_v}", module, hint=problem.split(": ", 1)[-1])

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal)
    packing = _packing(attention_mask, kwargs)
    if packing is None and attention_mask is not None:
        causal = _causal_from_mask(attention_mask, q_length, kv_length, causal, module)

    device_type = query.device.type
    if (torch.is_autocast_enabled(device_type)
            and torch.float32 in (query.dtype, key.dtype, value.dtype)):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) if t.dtype != dtype else t for t in (query, key, value))

    extra = {}
    if options.get("bundle") is not None:
        extra["bundle"] = options["bundle"]
    if options.get("deterministic"):
        extra["deterministic"] = True
    if sliding_window is not None:
        # transformers' window of W keys is q - W + 1 ... q (flash-attn's window_size W - 1, as
        # transformers' own flash-attention integration passes it).
        extra["window_size"] = (int(sliding_window) - 1, int(sliding_window) - 1)
    if softcap:  # Gemma-2's attn_logit_softcapping: softcap * tanh(scores / softcap)
        extra["softcap"] = float(softcap)
    # gpt-oss's sinks (its attention passes s_aux=self.sinks): a logit per head in the softmax.
    sink = kwargs.get("s_aux", kwargs.get("sinks"))
    if sink is not None:
        extra["learnable_sink"] = sink
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if packing is not None:  # the rows' tokens flattened, each sequence attending within itself
        batch = q.shape[0]
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        out = _flash_attn_varlen_func()(q, k, v, *packing, causal=causal, softmax_scale=scaling, **extra)
        return out.view(batch, q_length, *out.shape[1:]), None
    out = _flash_attn_func()(q, k, v, causal=causal, softmax_scale=scaling, **extra)
    return out, None


def make_attention_forward(*, bundle=None, deterministic: bool = False):
    """An attention function for AttentionInterface that runs fagen with these options
    (`bundle`: a bundle directory, packed file or loaded Bundle; `deterministic`: passed to
    flash_attn_func for the backward pass)."""
    options = {"bundle": bundle, "deterministic": deterministic}

    def fagen_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention-function convention: q/k/v (batch, heads, seq, head_dim),
        returns (attn_output (batch, seq, heads, head_dim), None)."""
        return _forward(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                        softcap, is_causal, kwargs, options)

    return fagen_attention_forward


fagen_attention_forward = make_attention_forward()


def register(name: str = NAME, *, bundle=None, deterministic: bool = False) -> str:
    """Register fagen under `name` in transformers' attention (and mask) interfaces; returns
    `name`. Called on import with the defaults; call it again for another name with other
    options, e.g. ``register("fagen_det", deterministic=True)``."""
    forward = (fagen_attention_forward if bundle is None and not deterministic
               else make_attention_forward(bundle=bundle, deterministic=deterministic))
    try:
        from transformers import AttentionInterface
    except ImportError:  # transformers < 4.50: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = forward
    else:
        AttentionInterface.register(name, forward)
    mask_interface = getattr(_masking_utils, "AttentionMaskInterface", None)
    if mask_interface is not None:
        mask_interface.register(name, fagen_mask)
    return name


register()
