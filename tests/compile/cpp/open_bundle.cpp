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
//   open_bundle --key DIRECTION DTYPE HEAD_DIM MASK SOFTCAP ALIBI SINKS HEAD_DIM_V
//                                       print kernel_key of variant_name(MASK, ...)
//   open_bundle --tensor DATA BATCH_STRIDE ROW_STRIDE HEAD_STRIDE TMA
//                                       print "ok" or tensor_status's error for a tensor "t"
//   open_bundle --mask CAUSAL LEFT RIGHT SEQLEN_Q SEQLEN_K
//                                       print call_mask's kind and window ("KIND LEFT RIGHT") or
//                                       its error
//   open_bundle --grid GRID BLOCK_M BLOCK_N SEQLEN_Q HEADS_Q BATCH SMS SEQLEN_K HEADS_KV
//                                       print grid_dims' "X Y Z" (GRID: FAGEN_GRID_* index)
//   open_bundle --workspace BATCH HEADS_Q SEQLEN_Q HEAD_DIM BLOCK_M
//                                       print backward_workspace's offsets, floats, semaphores
//                                       and the backward row grid
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fagen/fagen.hpp"

int main(int argc, char** argv) {
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
    if (argc == 10 && std::strcmp(argv[1], "--key") == 0) {
        const std::string variant = fagen::variant_name(argv[5], std::atoi(argv[6]) != 0, std::atoi(argv[7]) != 0,
                                                        std::atoi(argv[8]) != 0);
        std::printf("%s\n", fagen::kernel_key(argv[2], argv[3], std::atoi(argv[4]), variant, std::atoi(argv[9])).c_str());
        return 0;
    }
    if (argc == 11 && std::strcmp(argv[1], "--grid") == 0) {
        long long v[9];
        for (int i = 0; i < 9; ++i) v[i] = std::atoll(argv[2 + i]);
        const fagen::GridDims g = fagen::grid_dims(static_cast<int>(v[0]), static_cast<int>(v[1]), static_cast<int>(v[2]),
                                                   v[3], v[4], v[5], v[6], v[7], v[8]);
        std::printf("%lld %lld %lld\n", g.x, g.y, g.z);
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
