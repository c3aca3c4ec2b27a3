"""contract.h: fagen/contract.py's definitions for fagen.hpp (the same values and rules, one
source), written into every bundle beside index.h and checked by `fagen verify-bundle`."""

from __future__ import annotations

import string

from ..contract import (
    ACCUM_BOX_COLUMNS, ACCUM_BYTES, ALIGNMENT_BYTES, BWD_CONVERT_SUFFIX, BWD_PREPROCESS_SUFFIX,
    BWD_ROWS_PER_CTA, BWD_ROW_THREADS, COMPANION_ROWS_PER_CTA, COMPANION_THREADS,
    CACHE_DTYPE_SEPARATOR, CACHE_TMA_BOX_ROWS, DQ_ACCUM_ROW_ALIGN, DTYPE_BYTES, DTYPES, GRIDS, HEAD_DIM_MULTIPLE, KEY_FORMAT, LAYOUTS,
    LAYOUT_SUFFIX, LOG2_E, MASKS, MASK_KINDS, MAX_GRID_YZ, MAX_HEAD_DIM, MAX_SPLITS,
    MIN_SCALE_LOG2, PAGED_TILE_MIN_QUERIES, SCORE_MODS, SINK_PARTIAL_ROWS, SPLIT_APPEND_SUFFIX, SPLIT_COMBINE_SUFFIX, SPLIT_MERGE_SUFFIX, SPLIT_WAVE_FILL, VARLEN_MIXED_ROWS,
    E4M3_VT_SUFFIX, VT_COLUMNS_PER_THREAD, VT_KEY_GROUP, VT_KEYS_PER_CTA,
    dtypes_name, kernel_key, output_dtype, stride_multiple, tma_box_columns, variant_name,
)

CONTRACT_HEADER = "include/fagen/contract.h"


def _cpp_key_expression() -> str:
    """KEY_FORMAT as a C++ expression over kernel_key()'s parameters."""
    fields = {"direction": "direction", "dtype": "dtype",
              "head_dims": "head_dims_name(head_dim, head_dim_v)", "variant": "variant"}
    parts = ['std::string()']
    for literal, field, _, _ in string.Formatter().parse(KEY_FORMAT):
        if literal:
            parts.append(f'"{literal}"')
        if field:
            parts.append(fields[field])
    return " + ".join(parts)


# The launch-shape and workspace rules above, in C++ for fagen.hpp (which calls these rather than
# re-deriving them): Launch.grid_dims, bwd_row_grid, vt_keys / vt_workspace_bytes / vt_grid / vt_threads,
# dq_accum_rows, BackwardWorkspace.of and .varlen.
# tests/compile/test_cpp_loader.py holds each to its Python twin over a grid of shapes.
_CPP_RULES = """\
/* Launch.grid_dims: the grid of a kernel (grid: FAGEN_GRID_*; sms: the device's multiprocessors,
   read only for a persistent grid). */
struct GridDims {
    long long x, y, z;
};
inline GridDims grid_dims(int grid, int block_m, int block_n, long long seqlen_q, long long heads_q, long long batch,
                          long long sms, long long seqlen_k, long long heads_kv, long long num_splits = 1) {
    const long long m_blocks = (seqlen_q + block_m - 1) / block_m;
    if (grid == FAGEN_GRID_PERSISTENT) return {m_blocks * heads_q * batch < sms ? m_blocks * heads_q * batch : sms, 1, 1};
    if (grid == FAGEN_GRID_HEADS) return {heads_q, batch, 1};
    if (grid == FAGEN_GRID_KEY_BLOCKS) return {(seqlen_k + block_n - 1) / block_n, heads_kv, batch};
    if (grid == FAGEN_GRID_SPLITS) {
        const long long packed_blocks = (seqlen_q * (heads_q / heads_kv) + block_m - 1) / block_m;
        return {num_splits, packed_blocks * heads_kv, batch};
    }
    return {m_blocks, heads_q, batch};
}
/* varlen_walks_items: whether a varlen forward on a persistent grid gets one CTA per work item. */
inline bool varlen_walks_items(long long batch, long long max_seqlen_q, long long total_q) {
    return double(batch * max_seqlen_q) > FAGEN_VARLEN_MIXED_ROWS * double(total_q > 1 ? total_q : 1);
}
/* split_count: the splits of a split-KV launch (slots: the device's SMs). */
inline int split_count(long long ctas, long long keys, long long slots, long long min_split_keys) {
    if (ctas <= 0 || keys <= 0 || slots <= 0) return 1;
    long long limit = keys / (min_split_keys > 1 ? min_split_keys : 1);
    limit = limit < FAGEN_MAX_SPLITS ? limit : FAGEN_MAX_SPLITS;
    limit = limit > 1 ? limit : 1;
    auto fill = [&](long long splits) {
        const double waves = double(ctas * splits) / double(slots);
        const long long whole = (ctas * splits + slots - 1) / slots;
        return waves / double(whole);
    };
    double best = 0.0;
    for (long long n = 1; n <= limit; ++n) best = fill(n) > best ? fill(n) : best;
    for (long long n = 1; n <= limit; ++n)
        if (fill(n) >= FAGEN_SPLIT_WAVE_FILL * best) return int(n);
    return 1;
}
/* SplitWorkspace.of: float offsets of o_partial and lse_partial in one fp32 buffer of `floats`. */
struct SplitWorkspace {
    long long o_partial, lse_partial, floats;
};
inline SplitWorkspace split_workspace(long long num_splits, long long batch, long long seqlen_q, long long heads_q,
                                      long long head_dim_v) {
    if (num_splits <= 1) return {0, 0, 0};
    const long long rows = num_splits * batch * seqlen_q * heads_q;
    return {0, rows * head_dim_v, rows * (head_dim_v + 1)};
}
/* cache_box_rows: keys per TMA box of a paged tile kernel's K/V tile of tile_rows keys over pages
   of page_size keys (0: a contiguous cache). */
inline int cache_box_rows(int page_size, int tile_rows) {
    if (page_size == 0 || page_size % tile_rows == 0) return tile_rows;
    return tile_rows % page_size == 0 ? page_size : FAGEN_CACHE_TMA_BOX_ROWS;
}
/* companion_grid: the grid of a split-KV kernel's combine, append and merge entry points. */
inline GridDims companion_grid(long long batch, long long rows, long long heads) {
    return {(batch * rows * heads + FAGEN_COMPANION_ROWS_PER_CTA - 1) / FAGEN_COMPANION_ROWS_PER_CTA, 1, 1};
}
/* bwd_row_grid: the grid of a backward's preprocess and dQ kernels. */
inline GridDims bwd_row_grid(long long seqlen_q, long long heads_q, long long batch) {
    return {(seqlen_q + FAGEN_BWD_ROWS_PER_CTA - 1) / FAGEN_BWD_ROWS_PER_CTA, heads_q, batch};
}
/* vt_keys, vt_workspace_bytes, vt_grid, vt_threads: an e4m3 forward's V^T (its row length in
   keys, the workspace it takes) and its companion's grid and block. */
inline long long vt_keys(long long seqlen_k) {
    return (seqlen_k + FAGEN_VT_KEY_GROUP - 1) / FAGEN_VT_KEY_GROUP * FAGEN_VT_KEY_GROUP;
}
inline long long vt_workspace_bytes(long long batch, long long heads_kv, long long head_dim_v, long long seqlen_k) {
    return batch * heads_kv * head_dim_v * vt_keys(seqlen_k);
}
inline GridDims vt_grid(long long seqlen_k, long long heads_kv, long long batch) {
    return {(seqlen_k + FAGEN_VT_KEYS_PER_CTA - 1) / FAGEN_VT_KEYS_PER_CTA, heads_kv, batch};
}
inline int vt_threads(int head_dim_v) {
    return FAGEN_VT_KEYS_PER_CTA / FAGEN_VT_KEY_GROUP * (head_dim_v / FAGEN_VT_COLUMNS_PER_THREAD);
}
/* dq_accum_rows: the dQ accumulator's rows per (batch, head). */
inline long long dq_accum_rows(long long seqlen_q) {
    return (seqlen_q + FAGEN_DQ_ACCUM_ROW_ALIGN - 1) / FAGEN_DQ_ACCUM_ROW_ALIGN * FAGEN_DQ_ACCUM_ROW_ALIGN;
}
/* BackwardWorkspace.of: float offsets of dq_accum, softmax_d, lse_log2, sink_partials in one fp32
   buffer of `floats`; `semaphores` ints for the deterministic mode (block_m: the main kernel's). */
struct BackwardWorkspace {
    long long dq_accum, softmax_d, lse_log2, sink_partials, floats, semaphores;
};
inline BackwardWorkspace backward_workspace(long long batch, long long heads_q, long long seqlen_q, long long head_dim,
                                            int block_m) {
    const long long rows = batch * heads_q * seqlen_q;
    const long long accum = batch * heads_q * dq_accum_rows(seqlen_q) * head_dim;
    const long long partials = batch * heads_q * ((seqlen_q + FAGEN_SINK_PARTIAL_ROWS - 1) / FAGEN_SINK_PARTIAL_ROWS);
    return {0, accum, accum + rows, accum + 2 * rows, accum + 2 * rows + partials,
            batch * heads_q * ((seqlen_q + block_m - 1) / block_m)};
}
/* varlen_accum_rows, BackwardWorkspace.varlen: the varlen layout's dQ accumulator rows per head and
   its workspace (total_q: the packed rows; max_seqlen_q: the longest sequence's). */
inline long long varlen_accum_rows(long long total_q, long long batch) {
    return dq_accum_rows(total_q) + FAGEN_DQ_ACCUM_ROW_ALIGN * batch;
}
inline BackwardWorkspace backward_workspace_varlen(long long batch, long long heads_q, long long total_q,
                                                   long long max_seqlen_q, long long head_dim, int block_m) {
    const long long rows = heads_q * total_q;
    const long long accum = heads_q * varlen_accum_rows(total_q, batch) * head_dim;
    const long long partials = batch * heads_q * ((max_seqlen_q + FAGEN_SINK_PARTIAL_ROWS - 1) / FAGEN_SINK_PARTIAL_ROWS);
    return {0, accum, accum + rows, accum + 2 * rows, accum + 2 * rows + partials,
            batch * heads_q * ((max_seqlen_q + block_m - 1) / block_m)};
}
"""


def _dtype_table(value_of) -> str:
    """A C initializer of value_of(dtype) for each of DTYPES, in its order."""
    return "{" + ", ".join(str(value_of(dtype)) for dtype in DTYPES) + "}"


def render_contract_header() -> str:
    """contract.h: this module's definitions for fagen.hpp (the same values, one source)."""
    return "\n".join([
        "/* Generated by fagen from fagen/contract.py: the contract between build and run. Do not",
        "   edit; every bundle carries the copy its fagen wrote. */",
        "#ifndef FAGEN_CONTRACT_H",
        "#define FAGEN_CONTRACT_H",
        "",
        f"#define FAGEN_MAX_HEAD_DIM {MAX_HEAD_DIM}",
        f"#define FAGEN_HEAD_DIM_MULTIPLE {HEAD_DIM_MULTIPLE}",
        f"#define FAGEN_ALIGNMENT_BYTES {ALIGNMENT_BYTES}",
        f"#define FAGEN_MAX_GRID_YZ {MAX_GRID_YZ}",
        f"#define FAGEN_ACCUM_BYTES {ACCUM_BYTES}",
        f"#define FAGEN_ACCUM_BOX_COLUMNS {ACCUM_BOX_COLUMNS}",
        f"#define FAGEN_LOG2_E {LOG2_E!r}",
        "/* The element types of q, k and v, in the order of fagen/contract.py's DTYPES (fagen.hpp's",
        "   DType), and per type: its bytes (DTYPE_BYTES), the type of a forward's output (an index",
        "   into FAGEN_DTYPE_NAMES; output_dtype), the multiple of elements its strides must be",
        "   (stride_multiple: 16 bytes) and the columns of its TMA boxes (tma_box_columns: one",
        "   128-byte swizzle row). */",
        "#define FAGEN_DTYPE_NAMES {" + ", ".join(f'"{name}"' for name in DTYPES) + "}",
        f"#define FAGEN_DTYPE_BYTES {_dtype_table(DTYPE_BYTES.get)}",
        f"#define FAGEN_OUTPUT_DTYPES {_dtype_table(lambda dtype: DTYPES.index(output_dtype(dtype)))}",
        f"#define FAGEN_DTYPE_STRIDE_MULTIPLES {_dtype_table(stride_multiple)}",
        f"#define FAGEN_DTYPE_TMA_BOX_COLUMNS {_dtype_table(tma_box_columns)}",
        "/* The kinds of mask, in MaskKind's order (algo/mask.cuh); fagen/contract.py, MASK_KINDS. A",
        "   custom mask's key spells the user's name for it. */",
        *(f"#define FAGEN_MASK_{name.upper()} {index}" for index, name in enumerate(MASK_KINDS)),
        "#define FAGEN_MASK_NAMES {" + ", ".join(f'"{name}"' for name in MASKS) + "}",
        "/* The score modifiers, in the order a key spells them; fagen/contract.py, SCORE_MODS. */",
        "#define FAGEN_SCORE_MOD_NAMES {" + ", ".join(f'"{name}"' for name in SCORE_MODS) + "}",
        "/* The smallest scale_log2 a kernel is launched with (softmax_scale 0 -> uniform",
        "   attention; see fagen/contract.py, kernel_scale_log2). */",
        f"#define FAGEN_MIN_SCALE_LOG2 {MIN_SCALE_LOG2!r}",
        "/* FagenKernelInfo.grid (index.h): the shape of a kernel's grid; fagen/contract.py, GRIDS. */",
        *(f"#define FAGEN_GRID_{name.upper()} {index}" for index, name in enumerate(GRIDS)),
        "/* Backward: the preprocess and dQ kernels beside the main one (fagen/contract.py). */",
        f"#define FAGEN_BWD_PREPROCESS_SUFFIX \"{BWD_PREPROCESS_SUFFIX}\"",
        f"#define FAGEN_BWD_CONVERT_SUFFIX \"{BWD_CONVERT_SUFFIX}\"",
        f"#define FAGEN_BWD_ROWS_PER_CTA {BWD_ROWS_PER_CTA}",
        f"#define FAGEN_BWD_ROW_THREADS {BWD_ROW_THREADS}",
        f"#define FAGEN_DQ_ACCUM_ROW_ALIGN {DQ_ACCUM_ROW_ALIGN}",
        f"#define FAGEN_SINK_PARTIAL_ROWS {SINK_PARTIAL_ROWS}",
        "/* e4m3 forwards: the V^T companion run before the main kernel (fagen/contract.py). */",
        f"#define FAGEN_E4M3_VT_SUFFIX \"{E4M3_VT_SUFFIX}\"",
        f"#define FAGEN_VT_KEY_GROUP {VT_KEY_GROUP}",
        f"#define FAGEN_VT_KEYS_PER_CTA {VT_KEYS_PER_CTA}",
        f"#define FAGEN_VT_COLUMNS_PER_THREAD {VT_COLUMNS_PER_THREAD}",
        "/* Split-KV kernels: the combine, append and merge entry points and split_count's limits",
        "   (fagen/contract.py). */",
        f"#define FAGEN_SPLIT_COMBINE_SUFFIX \"{SPLIT_COMBINE_SUFFIX}\"",
        f"#define FAGEN_SPLIT_APPEND_SUFFIX \"{SPLIT_APPEND_SUFFIX}\"",
        f"#define FAGEN_SPLIT_MERGE_SUFFIX \"{SPLIT_MERGE_SUFFIX}\"",
        f"#define FAGEN_COMPANION_ROWS_PER_CTA {COMPANION_ROWS_PER_CTA}",
        f"#define FAGEN_VARLEN_MIXED_ROWS {VARLEN_MIXED_ROWS!r}",
        f"#define FAGEN_COMPANION_THREADS {COMPANION_THREADS}",
        f"#define FAGEN_MAX_SPLITS {MAX_SPLITS}",
        f"#define FAGEN_SPLIT_WAVE_FILL {SPLIT_WAVE_FILL!r}",
        "/* A KV-cache call of this many query tokens a row or more prefers a tile kernel of the",
        "   paged layout (FA3), whose K/V boxes hold FAGEN_CACHE_TMA_BOX_ROWS keys at least. */",
        f"#define FAGEN_PAGED_TILE_MIN_QUERIES {PAGED_TILE_MIN_QUERIES}",
        f"#define FAGEN_CACHE_TMA_BOX_ROWS {CACHE_TMA_BOX_ROWS}",
        "/* The tensor layouts, in the order of fagen/contract.py's LAYOUTS (dense: no key suffix). */",
        "#define FAGEN_LAYOUT_NAMES {" + ", ".join(f'"{name}"' for name in LAYOUTS) + "}",
        "",
        "#ifdef __cplusplus",
        "#include <string>",
        "namespace fagen {",
        "/* variant_name: the mask (FAGEN_MASK_NAMES) and the score modifiers a key spells, e.g.",
        f"   \"{variant_name('local', ('softcap',))}\" (FAGEN_SCORE_MOD_NAMES, in their order). */",
        "inline std::string variant_name(const char* mask, bool softcap, bool alibi, bool sinks) {",
        "    std::string variant = mask;",
        *(f'    if ({mod}) variant += "+{mod}";' for mod in SCORE_MODS),
        "    return variant;",
        "}",
        "/* dtypes_name: q's element type, and the K/V cache's after a `" + CACHE_DTYPE_SEPARATOR + "` where it differs",
        "   (empty: the same), e.g. \"" + dtypes_name("bf16", "e4m3") + "\". */",
        "inline std::string dtypes_name(const std::string& dtype, const std::string& kv_dtype) {",
        "    if (kv_dtype.empty() || kv_dtype == dtype) return dtype;",
        f"    return dtype + \"{CACHE_DTYPE_SEPARATOR}\" + kv_dtype;",
        "}",
        "/* head_dims_name: q/k's head dim, and v's after a `v` where it differs (0: the same). */",
        "inline std::string head_dims_name(int head_dim, int head_dim_v) {",
        "    if (head_dim_v == 0 || head_dim_v == head_dim) return std::to_string(head_dim);",
        "    return std::to_string(head_dim) + \"v\" + std::to_string(head_dim_v);",
        "}",
        f"/* The lookup key of a kernel, e.g. \"{kernel_key('fwd', 'bf16', 128, 'causal')}\" or",
        f"   \"{kernel_key('bwd', 'bf16', 192, 'causal', (), 128)}\" (variant: variant_name; head_dim_v 0: the",
        "   same as head_dim). */",
        "inline std::string kernel_key(const char* direction, const char* dtype, int head_dim, "
        "const std::string& variant, int head_dim_v = 0, const std::string& layout = "
        f"\"{LAYOUTS[0]}\") {{",
        f"    const std::string key = {_cpp_key_expression()};",
        f"    return layout == \"{LAYOUTS[0]}\" ? key : key + \"{LAYOUT_SUFFIX.split('{')[0]}\" + layout;",
        "}",
        _CPP_RULES.rstrip("\n"),
        "}  // namespace fagen",
        "#endif",
        "",
        "#endif /* FAGEN_CONTRACT_H */",
        "",
    ])
