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
//   open_bundle --tensor DATA BATCH_STRIDE ROW_STRIDE HEAD_STRIDE TMA
//                                       print "ok" or tensor_status's error for a tensor "t"
//   open_bundle --mask CAUSAL LEFT RIGHT SEQLEN_Q SEQLEN_K
//                                       print call_mask's kind and window ("KIND LEFT RIGHT") or
//                                       its error
//   open_bundle --grid GRID BLOCK_M BLOCK_N SEQLEN_Q HEADS_Q BATCH SMS SEQLEN_K HEADS_KV NUM_SPLITS
//                                       print grid_dims' "X Y Z" (GRID: FAGEN_GRID_* index)
//   open_bundle --splits CTAS KEYS SLOTS MIN_SPLIT_KEYS NUM_SPLITS BATCH SEQLEN_Q HEADS_Q HEAD_DIM_V
//                                       print split_count's count, then split_workspace's offsets
//                                       and floats and the combine grid for NUM_SPLITS
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
// strides defaulting as there (q, k, v contiguous; dout like out, contiguous).
static int print_tma_maps(int argc, char** argv) {
    fagen::AttentionBackward a;
    a.dtype = std::strcmp(argv[2], "bf16") == 0 ? fagen::DType::bf16 : fagen::DType::fp16;
    a.batch = std::atoi(argv[3]);
    a.seqlen_q = std::atoi(argv[4]);
    a.seqlen_k = std::atoi(argv[5]);
    a.heads_q = std::atoi(argv[6]);
    a.heads_kv = std::atoi(argv[7]);
    a.head_dim = std::atoi(argv[8]);
    a.head_dim_v = std::atoi(argv[9]);
    const int q_rows = std::atoi(argv[10]), kv_rows = std::atoi(argv[11]);
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
    if (argc == 7 && std::strcmp(argv[1], "--tensor") == 0) {
        const fagen::Strides strides{std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5])};
        const fagen::Status s = fagen::tensor_status("t", static_cast<CUdeviceptr>(std::strtoull(argv[2], nullptr, 10)),
                                                     strides, std::atoi(argv[6]) != 0);
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
