// examples/cpp/elements.hpp's e4m3 conversions, for tests/compile/test_cpp_loader.py to hold to
// torch.float8_e4m3fn:
//   e4m3_elements X...   print from_e4m3 of every encoding 0..255 (%.9g), then to_e4m3 of each X
#include <cstdio>
#include <cstdlib>

#include "elements.hpp"

int main(int argc, char** argv) {
    for (int bits = 0; bits < 256; ++bits) std::printf("%.9g\n", static_cast<double>(from_e4m3(static_cast<uint8_t>(bits))));
    for (int i = 1; i < argc; ++i) std::printf("%d\n", to_e4m3(std::strtof(argv[i], nullptr)));
    return 0;
}
