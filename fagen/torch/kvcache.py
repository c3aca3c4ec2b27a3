"""flash_attn_with_kvcache: flash-attn's decoding call on fagen's paged-layout kernels
(fagen.runtime.kvcache), and vLLM's shape of it (packed queries, a block table), over a cache of
q's dtype or an FP8 (float8_e4m3fn) one with its descales.

The call reads no device memory on the host and allocates only what the shapes decide, so a
decoding step can be captured in a CUDA graph and replayed with new cache contents, lengths and
block tables (the split count follows the cache's capacity, not its lengths).
"""

# No `from __future__ import annotations`: torch.library reads the op's annotations as objects.
from typing import Optional

import torch

from .. import contract
from ..runtime import driver
from ..runtime import call as runtime_call
from ..runtime import kvcache as runtime_kvcache
from . import e4m3
from .adapter import (
    _DTYPE_NAMES, _current_stream, _score_arrays, bundle_argument, define_op, eager_call, get_bundle,
)

_NAME = "fagen.flash_attn_with_kvcache"


def _fail(message: str, error: type[Exception] = ValueError) -> Exception:
    return error(f"{_NAME}: {message}")


def _rows_ready(t: torch.Tensor, name: str, dims: int) -> torch.Tensor:
    """`t` with a contiguous last dimension, 16-byte aligned rows and strides in multiples of 8
    elements (params.h), copied when it is not; refuses a copy of a cache (appends would land in
    the copy)."""
    if t.dim() != dims:
        raise _fail(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    multiple = contract.ALIGNMENT_BYTES // t.element_size()
    aligned = (t.stride(-1) == 1 and t.data_ptr() % contract.ALIGNMENT_BYTES == 0
               and all(s % multiple == 0 or size == 1 for s, size in zip(t.stride()[:-1], t.shape[:-1])))
    if aligned:
        return t
    if name in ("k_cache", "v_cache"):
        raise _fail(f"{name} must have a contiguous last dimension, 16-byte aligned rows and strides in "
                    f"multiples of {multiple} elements (a copy would not see appends)")
    return t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch or page, row, head) element strides of a 4-D tensor, or of a packed 3-D one (no
    batch stride); a dimension of size 1 is never indexed, so it takes its contiguous stride
    (which a tensor map of the tile kernels can describe, where 0 cannot)."""
    if t.dim() == 3:
        return (0, t.stride(0), t.stride(1))
    _, seqlen, heads, head_dim = t.shape
    contiguous = (seqlen * heads * head_dim, heads * head_dim, head_dim)
    return tuple(fallback if size == 1 else stride
                 for size, stride, fallback in zip(t.shape[:3], t.stride()[:3], contiguous))


def _tensor(t: torch.Tensor) -> runtime_call.Tensor:
    return runtime_call.Tensor(t.data_ptr(), *_strides(t))


def _int32(t, name: str, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != device:
        raise _fail(f"{name} must be an int32 tensor on {device}", TypeError)
    return t.contiguous()


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    cache_seqlens=None,
    block_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    scheduler_metadata: Optional[torch.Tensor] = None,
    return_softmax_lse: bool = False,
    return_lse: bool = False,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    bundle=None,
    **flash_attn_options,
):
    """Attention of new query tokens over a KV cache, with flash-attn's names and semantics.

    q: (batch, seqlen_q, nheads_q, d), or packed (total_q, nheads_q, d) with cu_seqlens_q int32
    (batch + 1) and max_seqlen_q (vLLM's call). k_cache, v_cache: (batch, capacity, nheads_kv, d)
    for a contiguous cache, or (num_pages, page_size, nheads_kv, d) with block_table int32
    (batch, max_pages_per_row) (page_size a multiple of the kernel's 16 keys; pages in any order
    and shared between rows). cache_seqlens: int32 (batch,) or an int, each row's cached keys
    (default: the whole capacity). k, v (batch, seqlen_new, nheads_kv, d), optional: appended
    into the cache at cache_seqlens (through the pages) before attending, so a row then sees
    cache_seqlens + seqlen_new keys; cache_seqlens itself is not changed. `causal`, window_size,
    softcap, alibi_slopes and learnable_sink as in fagen.flash_attn_func, aligned to each row's
    last key (bottom-right: new token i of n sees keys up to cache_len - n + i). num_splits: 0
    chooses how many CTAs share one row's keys from the shapes and the GPU (split-KV), n forces
    n; scheduler_metadata (get_scheduler_metadata's, made before a graph's capture) gives it
    when num_splits is 0. Returns out (like q, with v's head dim) and, with return_softmax_lse (or return_lse), the
    natural-log LSE (batch, nheads_q, seqlen_q), packed: (nheads_q, total_q). No gradient.

    An FP8 cache: k_cache, v_cache (and k, v) in torch.float8_e4m3fn under float16 / bfloat16
    q, each stored value times its descale (k_descale, v_descale: float32 (batch, nheads_kv) or
    broadcasting to it, as flash-attn's; None: 1) being the value; the kernels read the cache's
    bytes as they are. float8_e4m3fn q (with q_descale) runs as bfloat16 q (exact) and returns
    bfloat16.
    """
    for name, value in flash_attn_options.items():
        off = {"rotary_cos": None, "rotary_sin": None, "cache_batch_idx": None, "cache_leftpad": None,
               "rotary_interleaved": True}
        if name not in off:
            raise _fail(f"unexpected keyword argument {name!r}", TypeError)
        if value is not off[name] and value != off[name]:
            raise _fail(f"{name} is not supported (fagen applies no rotary embedding and takes the "
                        "cache rows in batch order)", NotImplementedError)
    if not isinstance(causal, bool):
        raise _fail(f"causal must be True or False, got {causal!r}", TypeError)
    descales = (q_descale, k_descale, v_descale)
    if q.dtype in e4m3.FP8_DTYPE_NAMES:
        if k_cache.dtype not in e4m3.FP8_DTYPE_NAMES:
            raise _fail(f"float8_e4m3fn q takes an FP8 cache (k_cache is {k_cache.dtype})", TypeError)
        q = q.to(torch.bfloat16)  # exact; q_descale still applies in the kernel
    if q.dtype not in _DTYPE_NAMES:
        raise _fail(f"q has dtype {q.dtype}; supported: float16, bfloat16, float8_e4m3fn", TypeError)
    fp8_cache = k_cache.dtype in e4m3.FP8_DTYPE_NAMES
    cache_dtype = k_cache.dtype if fp8_cache else q.dtype
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and (t.dtype != cache_dtype or t.device != q.device):
            raise _fail(f"{name} must have the cache's dtype {cache_dtype} (q's, or float8_e4m3fn for an FP8 "
                        f"cache; k, v new rows too) and q's device {q.device}; got {t.dtype}, {t.device}", TypeError)
    if not fp8_cache and any(t is not None for t in descales):
        raise _fail("q_descale, k_descale and v_descale are for an FP8 cache (float8_e4m3fn k_cache, v_cache): "
                    f"this cache is {k_cache.dtype}; leave them None")
    if q.device.type != "cuda":
        raise _fail(f"the tensors must be on a CUDA device, got {q.device}")
    packed = cu_seqlens_q is not None
    for name, t, dims in (("q", q, 3 if packed else 4), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if t.dim() != dims:
            raise _fail(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise _fail(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree but "
                    "for the head dim")
    heads_q, head_dim = q.shape[-2:]
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise _fail(f"q's head dim {head_dim} and k_cache's {k_cache.shape[3]} differ")
    if heads_kv == 0 or heads_q % heads_kv:
        raise _fail(f"nheads_q={heads_q} must be a multiple of nheads_kv={heads_kv}")
    if packed:
        cu_seqlens_q = _int32(cu_seqlens_q, "cu_seqlens_q", q.device)
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
            raise _fail("cu_seqlens_q must be 1-D with batch + 1 entries")
        batch = cu_seqlens_q.numel() - 1
        if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
            raise _fail("packed q (cu_seqlens_q) needs max_seqlen_q, the longest row's tokens", TypeError)
        seqlen_q = max_seqlen_q
    else:
        batch, seqlen_q = q.shape[:2]
    if block_table is not None:
        block_table = _int32(block_table, "block_table", q.device)
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise _fail(f"block_table must be (batch={batch}, max_pages), got {tuple(block_table.shape)}")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise _fail(f"a contiguous cache has one row per batch row: k_cache's {k_cache.shape[0]} != {batch} "
                        "(a paged cache comes with block_table)")
        capacity = k_cache.shape[1]
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None:
        cache_seqlens = _int32(cache_seqlens, "cache_seqlens", q.device)
        if cache_seqlens.shape != (batch,):
            raise _fail(f"cache_seqlens must be (batch={batch},), got {tuple(cache_seqlens.shape)}")
    if (k is None) != (v is None):
        raise _fail("k and v are appended together: give both or neither")
    if k is not None:
        if cache_seqlens is None:
            raise _fail("appending k, v needs cache_seqlens (where each row's new keys go)")
        if packed or k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] or v.shape[:3] != k.shape[:3] \
                or v.shape[3] != v_cache.shape[3]:
            raise _fail(f"k, v must be (batch, seqlen_new, nheads_kv, d) like the cache rows, got {tuple(k.shape)}, "
                        f"{tuple(v.shape)} (and q dense)")
    if scheduler_metadata is not None and num_splits == 0:
        num_splits = _metadata_splits(scheduler_metadata)
    if return_lse and not return_softmax_lse:
        return_softmax_lse = True
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise _fail(f"softcap must be a number, got {softcap!r}", TypeError)

    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise _fail(f"num_splits must be an int, got {num_splits!r}", TypeError)
    if fp8_cache:
        e4m3.check_descales(q, k_cache, descales, batch, _NAME)
    try:
        contract.Score(float(softcap))
    except contract.ScoreError as error:
        raise _fail(str(error)) from None
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    bundle = bundle_argument(bundle)
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q, alibi_slopes, learnable_sink,
               *descales)
    options = (seqlen_q, capacity, causal, int(window_size[0]), int(window_size[1]), softmax_scale, float(softcap),
               num_splits, bundle)
    eager = eager_call(*tensors, k, v)
    if k is None:
        out, lse = (_attend if eager else flash_attn_kvcache)(*tensors, *options)
    else:
        out, lse = (_attend_appending if eager else flash_attn_kvcache_append)(k, v, *tensors, *options)
    return (out, lse) if return_softmax_lse else out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqused_k: Optional[torch.Tensor],
            block_table: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
            alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
            q_descale: Optional[torch.Tensor], k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor],
            seqlen_q: int, capacity: int, causal: bool, window_left: int, window_right: int,
            softmax_scale: Optional[float], softcap: float, num_splits: int,
            bundle: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse of the checked call (the custom op fagen::flash_attn_kvcache): the kernels
    over the cache as it is."""
    return _run(q, k_cache, v_cache, seqused_k, block_table, cu_seqlens_q, alibi_slopes, learnable_sink,
                (q_descale, k_descale, v_descale), seqlen_q, capacity, causal, window_left, window_right,
                softmax_scale, softcap, num_splits, bundle)


def _attend_appending(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                      cu_seqlens_q: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                      learnable_sink: Optional[torch.Tensor], q_descale: Optional[torch.Tensor],
                      k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], seqlen_q: int,
                      capacity: int, causal: bool, window_left: int, window_right: int,
                      softmax_scale: Optional[float], softcap: float, num_splits: int,
                      bundle: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same after appending k, v (batch, seqlen_new, nheads_kv, d) into the cache at
    cache_seqlens, through its pages (the custom op fagen::flash_attn_kvcache_append, which
    writes k_cache and v_cache): one prepared launch, whose append entry point runs first and
    whose attention then sees cache_seqlens + seqlen_new keys per row."""
    return _run(q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q, alibi_slopes, learnable_sink,
                (q_descale, k_descale, v_descale), seqlen_q, capacity, causal, window_left, window_right,
                softmax_scale, softcap, num_splits, bundle, (k, v) if k.numel() else None)


def _run(q, k_cache, v_cache, seqused_k, block_table, cu_seqlens_q, alibi_slopes, learnable_sink, descales,
         seqlen_q, capacity, causal, window_left, window_right, softmax_scale, softcap, num_splits, bundle, new=None):
    """Both ops: the runtime's prepared launch of the checked call (`new`: the keys and values
    it appends first), enqueued on the current stream."""
    packed = cu_seqlens_q is not None
    q = _rows_ready(q, "q", 3 if packed else 4)
    k_cache = _rows_ready(k_cache, "k_cache", 4)
    v_cache = _rows_ready(v_cache, "v_cache", 4)
    batch = cu_seqlens_q.numel() - 1 if packed else q.shape[0]
    heads_q, head_dim = q.shape[-2:]
    head_dim_v = v_cache.shape[3]
    out = q.new_empty((*q.shape[:-1], head_dim_v))
    lse = torch.empty(_lse_shape(q, packed, batch), dtype=torch.float32, device=q.device)
    if out.numel() == 0 and new is None:
        return out, lse
    problem = runtime_call.Problem(
        _DTYPE_NAMES[q.dtype], causal, batch, seqlen_q, capacity, heads_q, k_cache.shape[2], head_dim,
        (window_left, window_right), contract.Score(softcap, alibi_slopes is not None, learnable_sink is not None),
        None if head_dim_v == head_dim else head_dim_v, layout="paged",
        kv_dtype=e4m3.FP8_DTYPE_NAMES.get(k_cache.dtype))
    arrays, kept = _score_arrays(alibi_slopes, learnable_sink, None)
    cache = runtime_kvcache.KvCache(
        seqused_k=0 if seqused_k is None else seqused_k.data_ptr(),
        block_table=0 if block_table is None else block_table.data_ptr(),
        block_table_batch_stride=0 if block_table is None else block_table.stride(0),
        page_size=k_cache.shape[1] if block_table is not None else 0,
        pages=k_cache.shape[0] if block_table is not None else 0,
        cu_seqlens_q=0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
        total_q=q.shape[0] if packed else 0)
    new_keys = None
    if new is not None:
        k, v = (_rows_ready(t, name, 4) for t, name in zip(new, ("k", "v")))
        new_keys = runtime_kvcache.NewKeys(_tensor(k), _tensor(v), k.shape[1])
    device = q.device.index
    with driver.primary_context(device):
        prepared = runtime_kvcache.prepare_kvcache(
            get_bundle(bundle), problem, _tensor(q), _tensor(k_cache), _tensor(v_cache), _tensor(out), cache,
            softmax_scale, device, num_splits, score_tensors=arrays, new_keys=new_keys,
            descales=e4m3.runtime_descales(descales) if problem.kv_dtype else None)
        stream = _current_stream(device)
        if out.numel() == 0:  # no queries: the append alone
            prepared.enqueue_append(stream)
            return out, lse
        workspace = torch.empty(prepared.workspace.floats, dtype=torch.float32, device=q.device)
        prepared.enqueue(out.data_ptr(), lse.data_ptr(), stream, workspace.data_ptr() if prepared.workspace.floats else 0)
    del kept, workspace  # the caching allocator keeps their memory for this stream's work
    return out, lse


def _lse_shape(q: torch.Tensor, packed: bool, batch: int) -> tuple[int, ...]:
    return (q.shape[-2], q.shape[0]) if packed else (batch, q.shape[2], q.shape[1])


def _attend_fake(q, k_cache, v_cache, seqused_k, block_table, cu_seqlens_q, alibi_slopes, learnable_sink, q_descale,
                 k_descale, v_descale, seqlen_q, capacity, causal, window_left, window_right, softmax_scale, softcap,
                 num_splits, bundle):
    packed = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    return (q.new_empty((*q.shape[:-1], v_cache.shape[3])),
            q.new_empty(_lse_shape(q, packed, batch), dtype=torch.float32))


def _attend_appending_fake(k, v, *arguments):
    return _attend_fake(*arguments)


flash_attn_kvcache = define_op("flash_attn_kvcache", _attend, _attend_fake)
flash_attn_kvcache_append = define_op("flash_attn_kvcache_append", _attend_appending, _attend_appending_fake,
                                      mutates_args=("k_cache", "v_cache"))


def _metadata_splits(metadata) -> int:
    if not isinstance(metadata, torch.Tensor) or metadata.device.type != "cpu" or metadata.dtype != torch.int32 \
            or metadata.numel() != 1:
        raise _fail("scheduler_metadata must be get_scheduler_metadata's result (a CPU int32 tensor of one "
                    "split count; reading a device tensor would synchronise the host)", TypeError)
    return int(metadata[0])


def get_scheduler_metadata(
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    headdim: int,
    cache_seqlens: Optional[torch.Tensor] = None,
    qkv_dtype: torch.dtype = torch.bfloat16,
    headdim_v: Optional[int] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    page_size: Optional[int] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    has_softcap: bool = False,
    num_splits: int = 0,
    *,
    device=None,
    bundle=None,
) -> torch.Tensor:
    """flash-attn's call that a server makes once per batch shape, before capturing a decode
    step: the split count flash_attn_with_kvcache(..., scheduler_metadata=this) then uses, as a
    CPU int32 tensor of one element. max_seqlen_k: the keys a row may reach (the cache's
    capacity per row, block_table.shape[1] * page_size for a paged one). fagen's choice depends
    on these shapes and the GPU alone (never on cache_seqlens' values), so the count holds for
    every replay; num_splits > 0 is returned as given. qkv_dtype: the cache's (float8_e4m3fn:
    an FP8 cache, whose count is the same under float16 and bfloat16 queries)."""
    del cache_seqlens, cu_seqlens_q, page_size  # the count does not depend on them
    kv_dtype = e4m3.FP8_DTYPE_NAMES.get(qkv_dtype)
    if kv_dtype is not None:
        qkv_dtype = torch.bfloat16
    if qkv_dtype not in _DTYPE_NAMES:
        raise _fail(f"qkv_dtype {qkv_dtype}; supported: float16, bfloat16, float8_e4m3fn", TypeError)
    if num_splits:
        return torch.tensor([num_splits], dtype=torch.int32)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    problem = runtime_call.Problem(
        _DTYPE_NAMES[qkv_dtype], causal, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
        tuple(window_size), contract.Score(1.0 if has_softcap else 0.0),
        None if headdim_v in (None, headdim) else headdim_v, layout="paged", kv_dtype=kv_dtype)
    index = device.index if device.index is not None else torch.cuda.current_device()
    splits = runtime_kvcache.split_count_for(get_bundle(bundle), problem, index)
    return torch.tensor([splits], dtype=torch.int32)
