// Test driver for the parts of fagen.hpp that need no GPU.
//   open_bundle DIR                     open + verify; exit 0, or 1 with the refusal on stderr
//   open_bundle DIR KEY MAJOR MINOR [SEQLEN_K]
//                                       also print the kernel selected for KEY on MAJOR.MINOR
//                                       (for calls with SEQLEN_K keys; "none")
#include <cstdio>
#include <cstdlib>

#include "fagen/fagen.hpp"

int main(int argc, char** argv) {
    if (argc != 2 && argc != 5 && argc != 6) return 2;
    auto bundle = fagen::Bundle::open(argv[1]);
    if (!bundle.ok()) {
        std::fprintf(stderr, "%s\n", bundle.status().message().c_str());
        return 1;
    }
    if (fagen::Status s = bundle->verify(); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.message().c_str());
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
