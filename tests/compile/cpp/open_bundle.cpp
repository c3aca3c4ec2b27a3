// Test driver for the parts of fagen.hpp that need no GPU.
//   open_bundle DIR                     open (which verifies every cubin); exit 0, or 1 with
//                                       the refusal on stderr
//   open_bundle DIR KEY MAJOR MINOR [SEQLEN_K]
//                                       also print the kernel selected for KEY on MAJOR.MINOR
//                                       (for calls with SEQLEN_K keys; "none")
//   open_bundle --scale SCALE|default HEAD_DIM
//                                       print kernel_scale_log2's value (%.9g) or its error
//   open_bundle --score-scale SCALE|default HEAD_DIM SOFTCAP
//                                       print kernel_score_scale's two values (%.9g) or its error
//   open_bundle --key DIRECTION DTYPE HEAD_DIM MASK SOFTCAP ALIBI SINKS HEAD_DIM_V LAYOUT
//                                       print kernel_key of variant_name(MASK, ...)
//   open_bundle --tensor DATA BATCH_STRIDE ROW_STRIDE HEAD_STRIDE TMA [DTYPE]
//                                       print "ok" or tensor_status's error for a tensor "t" of
//                                       DTYPE elements (default bf16)
//   open_bundle --dtype DTYPE           print its element_bytes, output_dtype's name,
//                                       stride_multiple and tma_box_columns
//   open_bundle --e4m3-call DTYPE DIRECTION LAYOUT SOFTCAP ALIBI SINKS MASK_MOD
//                                       print "ok" or e4m3_call_status's error (MASK_MOD "-": none;
//                                       ALIBI, SINKS: 0 or 1)
//   open_bundle --descales DTYPE Q K V Q_BATCH Q_HEAD K_BATCH K_HEAD V_BATCH V_HEAD
//                                       print "ok" or descales_status's error
//   open_bundle --call DIR ENTRY NAME=VALUE...
//                                       open DIR and make one call (ENTRY: forward, backward,
//                                       kvcache or semaphores: Bundle::attention,
//                                       attention_backward, attention_kvcache,
//                                       backward_semaphore_bytes) of the Attention the NAME=VALUE
//                                       pairs describe (read_call); print "ok" or "error: ..."
//   open_bundle --mask CAUSAL LEFT RIGHT SEQLEN_Q SEQLEN_K
//                                       print call_mask's kind and window ("KIND LEFT RIGHT") or
//                                       its error
//   open_bundle --grid GRID BLOCK_M BLOCK_N SEQLEN_Q HEADS_Q BATCH SMS SEQLEN_K HEADS_KV NUM_SPLITS
//                                       print grid_dims' "X Y Z" (GRID: FAGEN_GRID_* index)
//   open_bundle --splits CTAS KEYS SLOTS MIN_SPLIT_KEYS NUM_SPLITS BATCH SEQLEN_Q HEADS_Q HEAD_DIM_V
//                                       print split_count's count, then split_workspace's offsets
//                                       and floats and the combine grid for NUM_SPLITS
//   open_bundle --vt BATCH HEADS_KV HEAD_DIM_V SEQLEN_K
//                                       print an e4m3 forward's vt_keys, vt_workspace_bytes, the
//                                       companion's vt_grid and vt_threads
//   open_bundle --workspace BATCH HEADS_Q SEQLEN_Q HEAD_DIM BLOCK_M
//                                       print backward_workspace's offsets, floats, semaphores
//                                       and the backward row grid
//   open_bundle --varlen-tma-maps DTYPE BATCH MAX_Q MAX_K HEADS_Q HEADS_KV HEAD_DIM HEAD_DIM_V Q_ROWS KV_ROWS
//               Q K V TOTAL_Q TOTAL_K [DOUT DQ_ACCUM]   (a varlen call's maps over the packed rows)
//   open_bundle --workspace-varlen BATCH HEADS_Q TOTAL_Q MAX_SEQLEN_Q HEAD_DIM BLOCK_M
//                                       print backward_workspace_varlen's offsets, floats, semaphores, rows
//   open_bundle --tma-maps DTYPE BATCH SEQLEN_Q SEQLEN_K HEADS_Q HEADS_KV HEAD_DIM HEAD_DIM_V Q_ROWS KV_ROWS
//                          Q K V [DOUT DQ_ACCUM]
//                                       print, one line per map (q, k, v; with DOUT and DQ_ACCUM,
//                                       a backward's, also dout and dq_accum), the arguments
//                                       fagen.hpp passes to cuTensorMapEncodeTiled (TensorMapArgs).
//                                       HEAD_DIM_V 0: head_dim; Q_ROWS / KV_ROWS: the kernel's
//                                       tma_q_rows / tma_kv_rows; each tensor ADDR (contiguous)
//                                       or ADDR:BATCH_STRIDE:ROW_STRIDE:HEAD_STRIDE in elements;
//                                       DQ_ACCUM: the accumulator's address
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fagen/fagen.hpp"

// "ADDR" or "ADDR:BATCH:ROW:HEAD": the address, and the strides (nullopt: contiguous).
static std::pair<CUdeviceptr, std::optional<fagen::Strides>> parse_tensor(const char* text) {
    char* end = nullptr;
    const CUdeviceptr address = static_cast<CUdeviceptr>(std::strtoull(text, &end, 10));
    if (*end != ':') return {address, std::nullopt};
    fagen::Strides s;
    s.batch = std::strtoll(end + 1, &end, 10);
    s.row = std::strtoll(end + 1, &end, 10);
    s.head = std::strtoll(end + 1, &end, 10);
    return {address, s};
}

static fagen::DType parse_dtype(const std::string& name) {
    for (fagen::DType dtype : {fagen::DType::fp16, fagen::DType::bf16, fagen::DType::e4m3}) {
        if (name == fagen::dtype_name(dtype)) return dtype;
    }
    std::fprintf(stderr, "unknown dtype %s\n", name.c_str());
    std::exit(2);
}

// "ADDR" or "ADDR:BATCH:HEAD": a descale's address and its (batch, head) strides in floats.
static void parse_descale(const char* text, CUdeviceptr& address, long long& batch_stride, long long& head_stride) {
    char* end = nullptr;
    address = static_cast<CUdeviceptr>(std::strtoull(text, &end, 10));
    if (*end != ':') return;
    batch_stride = std::strtoll(end + 1, &end, 10);
    head_stride = std::strtoll(end + 1, &end, 10);
}

// --call's NAME=VALUE pairs as an AttentionBackward (the forward's fields, and a backward's):
// dtype, causal (0/1), batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, scale, softcap;
// the tensors q, k, v, out (ADDR or ADDR:BATCH:ROW:HEAD) and lse; alibi, sinks (array
// addresses); mask_mod; varlen (0/1: packed rows of equal lengths at two dummy offset arrays);
// descale_q, descale_k, descale_v (ADDR or ADDR:BATCH:HEAD).
static fagen::AttentionBackward read_call(int count, char** pairs) {
    fagen::AttentionBackward a;
    bool varlen = false;
    for (int i = 0; i < count; ++i) {
        const std::string pair = pairs[i];
        const size_t equals = pair.find('=');
        const std::string name = pair.substr(0, equals);
        const char* value = pairs[i] + equals + 1;
        const std::pair<const char*, int*> sizes[] = {
            {"batch", &a.batch}, {"seqlen_q", &a.seqlen_q}, {"seqlen_k", &a.seqlen_k}, {"heads_q", &a.heads_q},
            {"heads_kv", &a.heads_kv}, {"head_dim", &a.head_dim}};
        const std::pair<const char*, std::pair<CUdeviceptr*, std::optional<fagen::Strides>*>> tensors[] = {
            {"q", {&a.q, &a.q_strides}}, {"k", {&a.k, &a.k_strides}}, {"v", {&a.v, &a.v_strides}},
            {"out", {&a.out, &a.out_strides}}};
        const std::tuple<const char*, CUdeviceptr*, long long*, long long*> descales[] = {
            {"descale_q", &a.descales.q, &a.descales.q_batch_stride, &a.descales.q_head_stride},
            {"descale_k", &a.descales.k, &a.descales.k_batch_stride, &a.descales.k_head_stride},
            {"descale_v", &a.descales.v, &a.descales.v_batch_stride, &a.descales.v_head_stride}};
        bool known = true;
        if (name == "dtype") a.dtype = parse_dtype(value);
        else if (name == "causal") a.causal = std::atoi(value) != 0;
        else if (name == "scale") a.softmax_scale = std::strtof(value, nullptr);
        else if (name == "softcap") a.softcap = std::strtof(value, nullptr);
        else if (name == "lse") a.lse = std::strtoull(value, nullptr, 10);
        else if (name == "workspace") a.workspace = std::strtoull(value, nullptr, 10);
        else if (name == "alibi") a.alibi_slopes = std::strtoull(value, nullptr, 10);
        else if (name == "sinks") a.sinks = std::strtoull(value, nullptr, 10);
        else if (name == "mask_mod") a.mask_mod = value;
        else if (name == "varlen") varlen = std::atoi(value) != 0;
        else known = false;
        for (const auto& [size_name, size] : sizes) {
            if (name == size_name) *size = std::atoi(value), known = true;
        }
        for (const auto& [tensor_name, tensor] : tensors) {
            if (name == tensor_name) std::tie(*tensor.first, *tensor.second) = parse_tensor(value), known = true;
        }
        for (const auto& [descale_name, address, batch_stride, head_stride] : descales) {
            if (name == descale_name) parse_descale(value, *address, *batch_stride, *head_stride), known = true;
        }
        if (!known) {
            std::fprintf(stderr, "unknown call field %s\n", name.c_str());
            std::exit(2);
        }
    }
    if (varlen) {
        a.cu_seqlens_q = 4096, a.cu_seqlens_k = 8192;
        a.total_q = static_cast<long long>(a.batch) * a.seqlen_q;
        a.total_k = static_cast<long long>(a.batch) * a.seqlen_k;
    }
    return a;
}

// --call: one call through the Bundle, on whatever libcuda.so.1 the loader finds.
static int make_call(int argc, char** argv) {
    auto bundle = fagen::Bundle::open(argv[2]);
    if (!bundle.ok()) {
        std::fprintf(stderr, "%s\n", bundle.status().message().c_str());
        return 1;
    }
    const std::string entry = argv[3];
    // A KV-cache call's own fields (KvCacheAttention: kv_dtype, block_table=ADDRESS:STRIDE,
    // page_size, pages, cache_seqlens, num_splits, packed q's cu_seqlens_q and total_q), the rest
    // every call's.
    std::vector<char*> fields;
    fagen::KvCacheAttention cache;
    for (int i = 4; i < argc; ++i) {
        const std::string pair = argv[i];
        const std::string name = pair.substr(0, pair.find('='));
        const char* value = argv[i] + name.size() + 1;
        if (name == "kv_dtype") cache.kv_dtype = parse_dtype(value);
        else if (name == "block_table") {
            char* end = nullptr;
            cache.block_table = std::strtoull(value, &end, 10);
            cache.block_table_stride = std::strtoll(end + 1, nullptr, 10);
        } else if (name == "page_size") cache.page_size = std::atoi(value);
        else if (name == "pages") cache.pages = std::atoi(value);
        else if (name == "cache_seqlens") cache.cache_seqlens = std::strtoull(value, nullptr, 10);
        else if (name == "num_splits") cache.num_splits = std::atoi(value);
        else if (name == "cu_seqlens_q") cache.cu_seqlens_q = std::strtoull(value, nullptr, 10);
        else if (name == "total_q") cache.total_q = std::atoll(value);
        else fields.push_back(argv[i]);
    }
    fagen::AttentionBackward a = read_call(static_cast<int>(fields.size()), fields.data());
    fagen::Status status = fagen::Status::error("unknown entry point " + entry);
    if (entry == "forward") {
        status = bundle->attention(a, nullptr);
    } else if (entry == "backward") {
        a.dout = a.dq = a.out;  // any addresses: the calls are refused before they are read
        a.dk = a.dv = a.k;
        a.workspace = a.lse;
        status = bundle->attention_backward(a, nullptr);
    } else if (entry == "semaphores") {
        const fagen::Result<size_t> bytes = bundle->backward_semaphore_bytes(a);
        if (!bytes.ok()) status = bytes.status();
    } else if (entry == "kvcache") {
        const CUdeviceptr cu_seqlens_q = cache.cu_seqlens_q;
        const long long total_q = cache.total_q;
        static_cast<fagen::Attention&>(cache) = a;
        cache.cu_seqlens_q = cu_seqlens_q, cache.total_q = total_q;
        status = bundle->attention_kvcache(cache, nullptr);
    }
    std::printf("%s\n", status.ok() ? "ok" : ("error: " + status.message()).c_str());
    return 0;
}

static void print_map(const char* name, const fagen::TensorMapArgs& m) {
    std::printf("%s data_type=%d rank=%u address=%llu dims=%llu,%llu,%llu,%llu strides=%llu,%llu,%llu "
                "box=%u,%u,%u,%u element_strides=%u,%u,%u,%u interleave=%d swizzle=%d l2_promotion=%d oob_fill=%d\n",
                name, static_cast<int>(m.data_type), static_cast<unsigned>(m.rank),
                static_cast<unsigned long long>(m.global_address),
                static_cast<unsigned long long>(m.global_dim[0]), static_cast<unsigned long long>(m.global_dim[1]),
                static_cast<unsigned long long>(m.global_dim[2]), static_cast<unsigned long long>(m.global_dim[3]),
                static_cast<unsigned long long>(m.global_strides[0]), static_cast<unsigned long long>(m.global_strides[1]),
                static_cast<unsigned long long>(m.global_strides[2]), static_cast<unsigned>(m.box_dim[0]),
                static_cast<unsigned>(m.box_dim[1]), static_cast<unsigned>(m.box_dim[2]),
                static_cast<unsigned>(m.box_dim[3]), static_cast<unsigned>(m.element_strides[0]),
                static_cast<unsigned>(m.element_strides[1]), static_cast<unsigned>(m.element_strides[2]),
                static_cast<unsigned>(m.element_strides[3]), static_cast<int>(m.interleave),
                static_cast<int>(m.swizzle), static_cast<int>(m.l2_promotion), static_cast<int>(m.oob_fill));
}

// --tma-maps: the maps attention() / attention_backward() encode for a TMA kernel, with their
// strides defaulting as there (q, k, v contiguous; dout like out, contiguous); an e4m3 forward's
// V map over the V^T at kE4m3Workspace.
constexpr CUdeviceptr kE4m3Workspace = 9ull << 20;
static int print_tma_maps(int argc, char** argv) {
    fagen::AttentionBackward a;
    a.dtype = parse_dtype(argv[2]);
    a.batch = std::atoi(argv[3]);
    a.seqlen_q = std::atoi(argv[4]);
    a.seqlen_k = std::atoi(argv[5]);
    a.heads_q = std::atoi(argv[6]);
    a.heads_kv = std::atoi(argv[7]);
    a.head_dim = std::atoi(argv[8]);
    a.head_dim_v = std::atoi(argv[9]);
    const int q_rows = std::atoi(argv[10]), kv_rows = std::atoi(argv[11]);
    a.workspace = kE4m3Workspace;
    std::tie(a.q, a.q_strides) = parse_tensor(argv[12]);
    std::tie(a.k, a.k_strides) = parse_tensor(argv[13]);
    std::tie(a.v, a.v_strides) = parse_tensor(argv[14]);
    const bool varlen = std::strcmp(argv[1], "--varlen-tma-maps") == 0;
    if (varlen) {  // packed by (any non-null) offsets, the rows given
        a.cu_seqlens_q = a.cu_seqlens_k = 4096;
        a.total_q = std::atoll(argv[15]);
        a.total_k = std::atoll(argv[16]);
    }
    const fagen::Strides q = a.q_strides.value_or(fagen::Strides::contiguous(a.seqlen_q, a.heads_q, a.head_dim));
    const fagen::Strides k = a.k_strides.value_or(fagen::Strides::contiguous(a.seqlen_k, a.heads_kv, a.head_dim));
    const fagen::Strides v = a.v_strides.value_or(fagen::Strides::contiguous(a.seqlen_k, a.heads_kv, a.value_dim()));
    const std::array<fagen::TensorMapArgs, 3> qkv = fagen::qkv_map_args(a, q, k, v, q_rows, kv_rows);
    print_map("q", qkv[0]);
    print_map("k", qkv[1]);
    print_map("v", qkv[2]);
    if ((argc == 17 && !varlen) || argc == 19) {
        std::tie(a.dout, a.dout_strides) = parse_tensor(argv[varlen ? 17 : 15]);
        const fagen::Strides dout =
            a.dout_strides.value_or(fagen::Strides::contiguous(a.seqlen_q, a.heads_q, a.value_dim()));
        const CUdeviceptr dq_accum = static_cast<CUdeviceptr>(std::strtoull(argv[varlen ? 18 : 16], nullptr, 10));
        const std::array<fagen::TensorMapArgs, 2> extra = fagen::bwd_extra_map_args(a, dout, dq_accum, q_rows);
        print_map("dout", extra[0]);
        print_map("dq_accum", extra[1]);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 4 && std::strcmp(argv[1], "--call") == 0) return make_call(argc, argv);
    if ((argc == 15 || argc == 17) && std::strcmp(argv[1], "--tma-maps") == 0) return print_tma_maps(argc, argv);
    if ((argc == 17 || argc == 19) && std::strcmp(argv[1], "--varlen-tma-maps") == 0) return print_tma_maps(argc, argv);
    if (argc == 4 && std::strcmp(argv[1], "--scale") == 0) {
        std::optional<float> scale;
        if (std::strcmp(argv[2], "default") != 0) scale = std::strtof(argv[2], nullptr);
        const fagen::Result<float> scale_log2 = fagen::kernel_scale_log2(scale, std::atoi(argv[3]));
        if (!scale_log2.ok()) {
            std::printf("error: %s\n", scale_log2.status().message().c_str());
        } else {
            std::printf("%.9g\n", static_cast<double>(scale_log2.value()));
        }
        return 0;
    }
    if (argc == 5 && std::strcmp(argv[1], "--score-scale") == 0) {
        std::optional<float> scale;
        if (std::strcmp(argv[2], "default") != 0) scale = std::strtof(argv[2], nullptr);
        const fagen::Result<fagen::KernelScale> s =
            fagen::kernel_score_scale(scale, std::atoi(argv[3]), std::strtof(argv[4], nullptr));
        if (!s.ok()) {
            std::printf("error: %s\n", s.status().message().c_str());
        } else {
            std::printf("%.9g %.9g\n", static_cast<double>(s.value().scale_log2), static_cast<double>(s.value().softcap_scale));
        }
        return 0;
    }
    if ((argc == 7 || argc == 8) && std::strcmp(argv[1], "--tensor") == 0) {
        const fagen::Strides strides{std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5])};
        const fagen::Status s =
            fagen::tensor_status("t", static_cast<CUdeviceptr>(std::strtoull(argv[2], nullptr, 10)), strides,
                                 std::atoi(argv[6]) != 0, argc == 8 ? parse_dtype(argv[7]) : fagen::DType::bf16);
        std::printf("%s\n", s.ok() ? "ok" : ("error: " + s.message()).c_str());
        return 0;
    }
    if (argc == 3 && std::strcmp(argv[1], "--dtype") == 0) {
        const fagen::DType dtype = parse_dtype(argv[2]);
        std::printf("%d %s %d %d\n", fagen::element_bytes(dtype), fagen::dtype_name(fagen::output_dtype(dtype)),
                    fagen::stride_multiple(dtype), fagen::tma_box_columns(dtype));
        return 0;
    }
    if (argc == 9 && std::strcmp(argv[1], "--e4m3-call") == 0) {
        fagen::Attention a;
        a.dtype = parse_dtype(argv[2]);
        a.softcap = std::strtof(argv[5], nullptr);
        a.alibi_slopes = std::atoi(argv[6]) != 0 ? 4096 : 0;
        a.sinks = std::atoi(argv[7]) != 0 ? 4096 : 0;
        if (std::strcmp(argv[8], "-") != 0) a.mask_mod = argv[8];
        const fagen::Status s = fagen::e4m3_call_status(a, argv[3], argv[4]);
        std::printf("%s\n", s.ok() ? "ok" : ("error: " + s.message()).c_str());
        return 0;
    }
    if (argc == 12 && std::strcmp(argv[1], "--descales") == 0) {
        long long v[9];
        for (int i = 0; i < 9; ++i) v[i] = std::atoll(argv[3 + i]);
        fagen::Descales d;
        d.q = static_cast<CUdeviceptr>(v[0]), d.k = static_cast<CUdeviceptr>(v[1]), d.v = static_cast<CUdeviceptr>(v[2]);
        d.q_batch_stride = v[3], d.q_head_stride = v[4], d.k_batch_stride = v[5], d.k_head_stride = v[6];
        d.v_batch_stride = v[7], d.v_head_stride = v[8];
        const fagen::Status s = fagen::descales_status(parse_dtype(argv[2]), d);
        std::printf("%s\n", s.ok() ? "ok" : ("error: " + s.message()).c_str());
        return 0;
    }
    if (argc == 11 && std::strcmp(argv[1], "--key") == 0) {
        const std::string variant = fagen::variant_name(argv[5], std::atoi(argv[6]) != 0, std::atoi(argv[7]) != 0,
                                                        std::atoi(argv[8]) != 0);
        std::printf("%s\n",
                    fagen::kernel_key(argv[2], argv[3], std::atoi(argv[4]), variant, std::atoi(argv[9]), argv[10]).c_str());
        return 0;
    }
    if (argc == 12 && std::strcmp(argv[1], "--grid") == 0) {
        long long v[10];
        for (int i = 0; i < 10; ++i) v[i] = std::atoll(argv[2 + i]);
        const fagen::GridDims g = fagen::grid_dims(static_cast<int>(v[0]), static_cast<int>(v[1]), static_cast<int>(v[2]),
                                                   v[3], v[4], v[5], v[6], v[7], v[8], v[9]);
        std::printf("%lld %lld %lld\n", g.x, g.y, g.z);
        return 0;
    }
    if (argc == 6 && std::strcmp(argv[1], "--vt") == 0) {
        const long long batch = std::atoll(argv[2]), heads_kv = std::atoll(argv[3]), columns = std::atoll(argv[4]),
                        seqlen_k = std::atoll(argv[5]);
        const fagen::GridDims g = fagen::vt_grid(seqlen_k, heads_kv, batch);
        std::printf("%lld %lld %lld %lld %lld %d\n", fagen::vt_keys(seqlen_k),
                    fagen::vt_workspace_bytes(batch, heads_kv, columns, seqlen_k), g.x, g.y, g.z,
                    fagen::vt_threads(static_cast<int>(columns)));
        return 0;
    }
    if (argc == 4 && std::strcmp(argv[1], "--cache-box") == 0) {
        std::printf("%d\n", fagen::cache_box_rows(std::atoi(argv[2]), std::atoi(argv[3])));
        return 0;
    }
    if (argc == 5 && std::strcmp(argv[1], "--walk") == 0) {
        std::printf("%d\n", fagen::varlen_walks_items(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4])) ? 1 : 0);
        return 0;
    }
    if (argc == 11 && std::strcmp(argv[1], "--splits") == 0) {
        long long v[9];
        for (int i = 0; i < 9; ++i) v[i] = std::atoll(argv[2 + i]);
        const fagen::SplitWorkspace w = fagen::split_workspace(v[4], v[5], v[6], v[7], v[8]);
        const fagen::GridDims g = fagen::companion_grid(v[5], v[6], v[7]);
        std::printf("%d %lld %lld %lld %lld %lld %lld\n", fagen::split_count(v[0], v[1], v[2], v[3]), w.o_partial,
                    w.lse_partial, w.floats, g.x, g.y, g.z);
        return 0;
    }
    if (argc == 8 && std::strcmp(argv[1], "--workspace-varlen") == 0) {
        const fagen::BackwardWorkspace w = fagen::backward_workspace_varlen(
            std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]), std::atoll(argv[6]),
            std::atoi(argv[7]));
        std::printf("%lld %lld %lld %lld %lld %lld %lld\n", w.dq_accum, w.softmax_d, w.lse_log2, w.sink_partials,
                    w.floats, w.semaphores, fagen::varlen_accum_rows(std::atoll(argv[4]), std::atoll(argv[2])));
        return 0;
    }
    if (argc == 7 && std::strcmp(argv[1], "--workspace") == 0) {
        const fagen::BackwardWorkspace w = fagen::backward_workspace(
            std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]), std::atoi(argv[6]));
        const fagen::GridDims rows = fagen::bwd_row_grid(std::atoll(argv[4]), std::atoll(argv[3]), std::atoll(argv[2]));
        std::printf("%lld %lld %lld %lld %lld %lld %lld %lld %lld\n", w.dq_accum, w.softmax_d, w.lse_log2,
                    w.sink_partials, w.floats, w.semaphores, rows.x, rows.y, rows.z);
        return 0;
    }
    if (argc == 7 && std::strcmp(argv[1], "--mask") == 0) {
        const fagen::Result<fagen::CallMask> mask = fagen::call_mask(
            std::atoi(argv[2]) != 0, std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]));
        if (!mask.ok()) {
            std::printf("error: %s\n", mask.status().message().c_str());
        } else {
            std::printf("%s %d %d\n", mask.value().kind, mask.value().window_left, mask.value().window_right);
        }
        return 0;
    }
    if (argc != 2 && argc != 5 && argc != 6) return 2;
    auto bundle = fagen::Bundle::open(argv[1]);
    if (!bundle.ok()) {
        std::fprintf(stderr, "%s\n", bundle.status().message().c_str());
        return 1;
    }
    if (argc >= 5) {
        const long long seqlen_k = argc == 6 ? std::atoll(argv[5]) : 0;
        auto selected = bundle->select(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), seqlen_k);
        std::printf("%s\n", selected.ok() ? selected.value()->name : "none");
        return 0;
    }
    std::printf("ok: %d kernels verified\n", FAGEN_KERNEL_COUNT);
    return 0;
}
