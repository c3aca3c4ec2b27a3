// fagen.hpp: header-only C++17 loader for a fagen bundle.
//
// Compile against one bundle's include/ directory (this header, params.h and the generated
// index.h, which mirrors that bundle's manifest.json as a static table) and point
// fagen::Bundle::open at the same bundle's directory at run time. The program does not link
// libcuda: the driver is dlopen'ed on first use and every entry point is resolved through
// cuGetProcAddress, so only cuda.h/cudaTypedefs.h are needed at build time. Opening and
// verifying a bundle never touches the driver.
//
// Integrity: open() refuses a directory whose schema or kernel ABI version this header does not
// speak, or whose manifest.json is not the one index.h was generated from, and reads every cubin,
// checking its path (inside the bundle) and its size and sha256 against index.h; after open()
// the directory is never read again, so rebuilding the bundle in place cannot reach an open
// Bundle (docs/bundle-format.md, "Rebuilding in place").
//
// Errors come back as fagen::Status / fagen::Result<T> values with a message; nothing here
// throws or exits.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "contract.h"
#include "index.h"
#include "params.h"

#if FAGEN_BUNDLE_ABI_VERSION != FAGEN_ABI_VERSION
#error "fagen: index.h and params.h were written for different kernel ABI versions; this include/ directory mixes two bundles"
#endif

namespace fagen {

// Newest manifest schema this header reads; the kernel ABI it speaks is params.h's.
constexpr int kSchemaVersion = 5;  // 3: index.h rows carry grid and workspace_floats_per_row; 4: block_n; 5: FagenBwdTmaMaps
constexpr int kAbiVersion = FAGEN_ABI_VERSION;

class [[nodiscard]] Status {
public:
    Status() = default;
    static Status error(std::string message) { return Status(std::move(message)); }
    bool ok() const { return !failed_; }
    explicit operator bool() const { return ok(); }
    const std::string& message() const { return message_; }

private:
    explicit Status(std::string message) : failed_(true), message_(std::move(message)) {}
    bool failed_ = false;
    std::string message_;
};

template <class T>
class [[nodiscard]] Result {
public:
    Result(T value) : value_(std::move(value)) {}
    Result(Status error) : status_(std::move(error)) {
        if (status_.ok()) status_ = Status::error("fagen: Result built from an OK status without a value");
    }
    bool ok() const { return value_.has_value(); }
    explicit operator bool() const { return ok(); }
    const Status& status() const { return status_; }
    T& value() { return *value_; }
    const T& value() const { return *value_; }
    T* operator->() { return &*value_; }
    T& operator*() { return *value_; }

private:
    std::optional<T> value_;
    Status status_;
};

// ---------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4), so that verifying a cubin needs nothing beyond the standard library.

namespace detail {

class Sha256 {
public:
    void update(const unsigned char* data, size_t size) {
        for (size_t i = 0; i < size; ++i) {
            block_[block_used_++] = data[i];
            if (block_used_ == 64) {
                compress();
                block_used_ = 0;
            }
        }
        bits_ += static_cast<uint64_t>(size) * 8;
    }

    std::string hex_digest() {
        const uint64_t message_bits = bits_;
        const unsigned char pad_start = 0x80;
        update(&pad_start, 1);
        const unsigned char zero = 0;
        while (block_used_ != 56) update(&zero, 1);
        unsigned char length[8];
        for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(message_bits >> (56 - 8 * i));
        update(length, 8);
        static const char* digits = "0123456789abcdef";
        std::string hex;
        for (uint32_t word : state_) {
            for (int shift = 28; shift >= 0; shift -= 4) hex += digits[(word >> shift) & 0xf];
        }
        return hex;
    }

private:
    static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

    void compress() {
        static const uint32_t k[64] = {
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
            0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
            0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
            0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
            0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
            0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
            0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
        };
        uint32_t w[64];
        for (int i = 0; i < 16; ++i) {
            w[i] = (uint32_t(block_[4 * i]) << 24) | (uint32_t(block_[4 * i + 1]) << 16) |
                   (uint32_t(block_[4 * i + 2]) << 8) | uint32_t(block_[4 * i + 3]);
        }
        for (int i = 16; i < 64; ++i) {
            const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
            const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
        uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
        for (int i = 0; i < 64; ++i) {
            const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
            const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1;
            d = c; c = b; b = a; a = t1 + t2;
        }
        state_[0] += a; state_[1] += b; state_[2] += c; state_[3] += d;
        state_[4] += e; state_[5] += f; state_[6] += g; state_[7] += h;
    }

    uint32_t state_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                          0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    unsigned char block_[64] = {};
    size_t block_used_ = 0;
    uint64_t bits_ = 0;
};

inline Result<std::vector<unsigned char>> read_file(const std::string& path) {
    std::ifstream stream(path, std::ios::binary);
    if (!stream) return Status::error(path + ": cannot open (missing or unreadable)");
    std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(stream)), std::istreambuf_iterator<char>());
    if (stream.bad()) return Status::error(path + ": read error");
    return bytes;
}

// Whether `path` resolves (links followed) inside `directory`; a path that does not resolve
// (missing) counts as inside, so that reading it reports it missing.
inline bool inside(const std::string& directory, const std::string& path) {
    char root[PATH_MAX];
    char target[PATH_MAX];
    if (realpath(directory.c_str(), root) == nullptr || realpath(path.c_str(), target) == nullptr) return true;
    const std::string prefix = std::string(root) + "/";
    return std::string(target).compare(0, prefix.size(), prefix) == 0;
}

// Value of `#define name VALUE` in C header text, without surrounding quotes; empty if absent.
inline std::string define_value(const std::string& text, const std::string& name) {
    const std::string prefix = "#define " + name + " ";
    size_t at = 0;
    while ((at = text.find(prefix, at)) != std::string::npos) {
        if (at == 0 || text[at - 1] == '\n') {
            const size_t begin = at + prefix.size();
            std::string value = text.substr(begin, text.find('\n', begin) - begin);
            if (value.size() >= 2 && value.front() == '"' && value.back() == '"') value = value.substr(1, value.size() - 2);
            return value;
        }
        at += prefix.size();
    }
    return "";
}

}  // namespace detail

inline std::string sha256_hex(const unsigned char* data, size_t size) {
    detail::Sha256 hash;
    hash.update(data, size);
    return hash.hex_digest();
}

// ---------------------------------------------------------------------------------------------
// The CUDA driver, resolved at run time. Each entry point is requested at the CUDA version of
// the cudaTypedefs.h prototype it is stored as, so the driver hands back the matching ABI
// variant (e.g. cuMemAlloc_v2 for 3020) whatever cuda.h version this was compiled with.

struct Driver {
    PFN_cuGetErrorName_v6000 get_error_name = nullptr;
    PFN_cuGetErrorString_v6000 get_error_string = nullptr;
    PFN_cuInit_v2000 init = nullptr;
    PFN_cuDeviceGet_v2000 device_get = nullptr;
    PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
    PFN_cuDevicePrimaryCtxRetain_v7000 device_primary_ctx_retain = nullptr;
    PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
    PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
    PFN_cuCtxGetDevice_v2000 ctx_get_device = nullptr;
    PFN_cuLibraryLoadData_v12000 library_load_data = nullptr;
    PFN_cuLibraryUnload_v12000 library_unload = nullptr;
    PFN_cuLibraryGetKernel_v12000 library_get_kernel = nullptr;
    PFN_cuKernelSetAttribute_v12000 kernel_set_attribute = nullptr;
    PFN_cuLaunchKernelEx_v11060 launch_kernel_ex = nullptr;
    PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encode_tiled = nullptr;
    // Memory and stream calls are not needed by the loader; programs without another way to
    // reach the driver (e.g. examples/cpp) use them.
    PFN_cuMemAlloc_v3020 mem_alloc = nullptr;
    PFN_cuMemFree_v3020 mem_free = nullptr;
    PFN_cuMemcpyHtoD_v3020 memcpy_htod = nullptr;
    PFN_cuMemcpyDtoH_v3020 memcpy_dtoh = nullptr;
    PFN_cuMemsetD16_v3020 memset_d16 = nullptr;
    PFN_cuStreamSynchronize_v2000 stream_synchronize = nullptr;

    // OK for CUDA_SUCCESS, else an error naming the call and the driver's error.
    Status check(CUresult result, const char* call) const {
        if (result == CUDA_SUCCESS) return Status();
        const char* name = nullptr;
        const char* text = nullptr;
        if (get_error_name == nullptr || get_error_name(result, &name) != CUDA_SUCCESS) name = nullptr;
        if (get_error_string == nullptr || get_error_string(result, &text) != CUDA_SUCCESS) text = nullptr;
        return Status::error(std::string(call) + " failed: " + (name ? name : "CUresult " + std::to_string(result)) +
                             " (" + (text ? text : "no description") + ")");
    }
};

namespace detail {

template <class Fn>
Status resolve(PFN_cuGetProcAddress_v12000 get_proc_address, Fn& fn, const char* symbol, int cuda_version) {
    void* address = nullptr;
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    const CUresult result = get_proc_address(symbol, &address, cuda_version, CU_GET_PROC_ADDRESS_DEFAULT, &found);
    if (result != CUDA_SUCCESS || found != CU_GET_PROC_ADDRESS_SUCCESS || address == nullptr) {
        return Status::error(std::string("fagen: the CUDA driver has no ") + symbol + " (version " +
                             std::to_string(cuda_version) + "); fagen needs a driver for CUDA 12.0 or newer");
    }
    fn = reinterpret_cast<Fn>(address);
    return Status();
}

inline Result<Driver> load_driver() {
    // Never dlclose'd: kernels and contexts handed out by the driver must outlive every caller.
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
        const char* why = dlerror();
        return Status::error(std::string("fagen: cannot load the CUDA driver libcuda.so.1 (") + (why ? why : "unknown") +
                             "); is an NVIDIA driver installed?");
    }
    auto get_proc_address = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(library, "cuGetProcAddress_v2"));
    if (get_proc_address == nullptr) {
        return Status::error("fagen: libcuda.so.1 has no cuGetProcAddress_v2; fagen needs a driver for CUDA 12.0 or newer");
    }
    Driver d;
    const Status lookups[] = {
        resolve(get_proc_address, d.get_error_name, "cuGetErrorName", 6000),
        resolve(get_proc_address, d.get_error_string, "cuGetErrorString", 6000),
        resolve(get_proc_address, d.init, "cuInit", 2000),
        resolve(get_proc_address, d.device_get, "cuDeviceGet", 2000),
        resolve(get_proc_address, d.device_get_attribute, "cuDeviceGetAttribute", 2000),
        resolve(get_proc_address, d.device_primary_ctx_retain, "cuDevicePrimaryCtxRetain", 7000),
        resolve(get_proc_address, d.ctx_get_current, "cuCtxGetCurrent", 4000),
        resolve(get_proc_address, d.ctx_set_current, "cuCtxSetCurrent", 4000),
        resolve(get_proc_address, d.ctx_get_device, "cuCtxGetDevice", 2000),
        resolve(get_proc_address, d.library_load_data, "cuLibraryLoadData", 12000),
        resolve(get_proc_address, d.library_unload, "cuLibraryUnload", 12000),
        resolve(get_proc_address, d.library_get_kernel, "cuLibraryGetKernel", 12000),
        resolve(get_proc_address, d.kernel_set_attribute, "cuKernelSetAttribute", 12000),
        resolve(get_proc_address, d.launch_kernel_ex, "cuLaunchKernelEx", 11060),
        resolve(get_proc_address, d.tensor_map_encode_tiled, "cuTensorMapEncodeTiled", 12000),
        resolve(get_proc_address, d.mem_alloc, "cuMemAlloc", 3020),
        resolve(get_proc_address, d.mem_free, "cuMemFree", 3020),
        resolve(get_proc_address, d.memcpy_htod, "cuMemcpyHtoD", 3020),
        resolve(get_proc_address, d.memcpy_dtoh, "cuMemcpyDtoH", 3020),
        resolve(get_proc_address, d.memset_d16, "cuMemsetD16", 3020),
        resolve(get_proc_address, d.stream_synchronize, "cuStreamSynchronize", 2000),
    };
    for (const Status& lookup : lookups) {
        if (!lookup.ok()) return lookup;
    }
    if (Status s = d.check(d.init(0), "cuInit"); !s.ok()) return s;
    return d;
}

}  // namespace detail

// The process-wide driver table, loaded on first call (thread-safe).
inline Result<const Driver*> driver() {
    static const Result<Driver> loaded = detail::load_driver();
    if (!loaded.ok()) return loaded.status();
    return &loaded.value();
}

// Make a context of device `ordinal` current on the calling thread: keeps the current context
// if it belongs to that device (e.g. one the CUDA runtime or torch made), otherwise makes the
// device's primary context current (retained once, never released: the runtime shares it).
inline Result<CUdevice> use_device(int ordinal) {
    auto d = driver();
    if (!d.ok()) return d.status();
    const Driver& cu = *d.value();
    CUdevice device = 0;
    if (Status s = cu.check(cu.device_get(&device, ordinal), "cuDeviceGet"); !s.ok()) return s;
    CUcontext current = nullptr;
    if (Status s = cu.check(cu.ctx_get_current(&current), "cuCtxGetCurrent"); !s.ok()) return s;
    if (current != nullptr) {
        CUdevice current_device = 0;
        if (Status s = cu.check(cu.ctx_get_device(&current_device), "cuCtxGetDevice"); !s.ok()) return s;
        if (current_device == device) return device;
    }
    CUcontext primary = nullptr;
    if (Status s = cu.check(cu.device_primary_ctx_retain(&primary, device), "cuDevicePrimaryCtxRetain"); !s.ok()) return s;
    if (Status s = cu.check(cu.ctx_set_current(primary), "cuCtxSetCurrent"); !s.ok()) return s;
    return device;
}

// The device of the calling thread's current context; device 0 (made current) if there is none.
inline Result<CUdevice> current_device() {
    auto d = driver();
    if (!d.ok()) return d.status();
    const Driver& cu = *d.value();
    CUcontext current = nullptr;
    if (Status s = cu.check(cu.ctx_get_current(&current), "cuCtxGetCurrent"); !s.ok()) return s;
    if (current == nullptr) return use_device(0);
    CUdevice device = 0;
    if (Status s = cu.check(cu.ctx_get_device(&device), "cuCtxGetDevice"); !s.ok()) return s;
    return device;
}

// ---------------------------------------------------------------------------------------------
// Kernel selection: the rules of fagen.runtime.loader, on index.h rows.

// Whether a cubin runs on a device: SASS is compatible only within a major version, and
// arch-specific ("a") cubins only on exactly their compute capability.
inline bool runs_on(const FagenKernelInfo& info, int cc_major, int cc_minor) {
    if (info.arch_specific) return info.cc_major == cc_major && info.cc_minor == cc_minor;
    return info.cc_major == cc_major && cc_minor >= info.cc_minor;
}

// Newer algorithm first, then the closest (highest) compute capability, then the "a" build.
inline std::tuple<int, int, int, int> family_rank(const FagenKernelInfo& info) {
    return std::make_tuple(info.fa_version, info.cc_major, info.cc_minor, info.arch_specific);
}

// Within a family, larger is better: a seqlen_k bound that covers the call (the tightest
// first), then an unbounded kernel, then a bound below the call (the loosest first; every
// kernel is correct at any length). seqlen_k <= 0: length unknown, longer than any bound.
inline std::pair<int, long long> seqlen_fit(const FagenKernelInfo& info, long long seqlen_k) {
    if (info.max_seqlen_k <= 0) return {1, 0};
    if (seqlen_k > 0 && info.max_seqlen_k >= seqlen_k) return {2, -static_cast<long long>(info.max_seqlen_k)};
    return {0, info.max_seqlen_k};
}

inline bool preferred_over(const FagenKernelInfo& a, const FagenKernelInfo& b, long long seqlen_k) {
    if (family_rank(a) != family_rank(b)) return family_rank(a) > family_rank(b);
    return seqlen_fit(a, seqlen_k) > seqlen_fit(b, seqlen_k);
}

// The element types of q, k and v, in the order of contract.h's FAGEN_DTYPE_NAMES (its tables
// are indexed by them). e4m3 (OCP FP8, flash-attn's float8_e4m3fn; forward only) comes with
// descales (Attention::descales) and writes its output in bf16 (output_dtype).
enum class DType { fp16, bf16, e4m3 };

namespace detail {
inline constexpr const char* kDTypeNames[] = FAGEN_DTYPE_NAMES;
inline constexpr int kDTypeBytes[] = FAGEN_DTYPE_BYTES;
inline constexpr int kOutputDTypes[] = FAGEN_OUTPUT_DTYPES;
inline constexpr int kStrideMultiples[] = FAGEN_DTYPE_STRIDE_MULTIPLES;
inline constexpr int kTmaBoxColumns[] = FAGEN_DTYPE_TMA_BOX_COLUMNS;
constexpr bool same_text(const char* a, const char* b) { return *a == *b && (*a == '\0' || same_text(a + 1, b + 1)); }
}  // namespace detail

static_assert(std::size(detail::kDTypeNames) == 3 && detail::same_text(detail::kDTypeNames[int(DType::fp16)], "fp16") &&
                  detail::same_text(detail::kDTypeNames[int(DType::bf16)], "bf16") &&
                  detail::same_text(detail::kDTypeNames[int(DType::e4m3)], "e4m3"),
              "fagen: DType's members must be contract.h's FAGEN_DTYPE_NAMES, in its order");

// The name a kernel key spells (fagen/contract.py: DTYPES).
inline const char* dtype_name(DType dtype) { return detail::kDTypeNames[static_cast<int>(dtype)]; }
// Bytes of one element (contract.py: DTYPE_BYTES).
inline int element_bytes(DType dtype) { return detail::kDTypeBytes[static_cast<int>(dtype)]; }
// The element type a forward with inputs of `dtype` writes its output in (contract.py: output_dtype).
inline DType output_dtype(DType dtype) { return static_cast<DType>(detail::kOutputDTypes[static_cast<int>(dtype)]); }
// A tensor of `dtype` has strides that are multiples of this many elements, 16 bytes
// (contract.py: stride_multiple).
inline int stride_multiple(DType dtype) { return detail::kStrideMultiples[static_cast<int>(dtype)]; }
// Columns of a TMA box of `dtype`: one 128-byte swizzle row (contract.py: tma_box_columns).
inline int tma_box_columns(DType dtype) { return detail::kTmaBoxColumns[static_cast<int>(dtype)]; }

// Lookup key of a forward kernel, e.g. "fwd/bf16/hd128/causal" (contract.h's kernel_key);
// variant: a mask of FAGEN_MASK_NAMES, with the score modifiers (contract.h's variant_name);
// head_dim_v: v's head dim where it differs (0: the same), e.g. "fwd/bf16/hd192v128/causal".
// layout: one of FAGEN_LAYOUT_NAMES ("dense" is never spelled in a key).
inline std::string forward_key(DType dtype, int head_dim, const std::string& variant, int head_dim_v = 0,
                               const std::string& layout = "dense") {
    return kernel_key("fwd", dtype_name(dtype), head_dim, variant, head_dim_v, layout);
}

// Whether `key` is an e4m3 forward's (q, k and v e4m3; a KV cache's e4m3 spells "bf16-e4m3").
inline bool is_e4m3_forward_key(const std::string& key) {
    return key.rfind(std::string("fwd/") + dtype_name(DType::e4m3) + "/", 0) == 0;
}
// Whether `key` is a kernel of the paged layout (a KV cache's: its last part).
inline bool is_paged_key(const std::string& key) {
    const std::string suffix = "/paged";
    return key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Lookup key of a backward kernel, e.g. "bwd/bf16/hd128/causal".
inline std::string backward_key(DType dtype, int head_dim, const std::string& variant, int head_dim_v = 0,
                                const std::string& layout = "dense") {
    return kernel_key("bwd", dtype_name(dtype), head_dim, variant, head_dim_v, layout);
}

// The mask of a call: its kind (one of FAGEN_MASK_NAMES) and the window sizes its kernel is
// launched with (params.h: window_left, window_right).
struct CallMask {
    const char* kind;
    int window_left = 0;
    int window_right = 0;
};

// flash-attn's rule for causal and window_size = (left, right), as fagen/contract.py's call_mask
// (the same results and message): -1, or a size >= seqlen_k (a left one >= seqlen_k - 1), is
// unbounded; causal sets right = 0;
// no edge is the full mask, right = 0 alone the causal one, anything else local, with an
// unbounded edge launched as seqlen_q + seqlen_k.
inline Result<CallMask> call_mask(bool causal, int window_left, int window_right, int seqlen_q, int seqlen_k) {
    static const char* const names[] = FAGEN_MASK_NAMES;
    if (window_left < -1 || window_right < -1) {
        return Status::error("fagen: window_size=(" + std::to_string(window_left) + ", " + std::to_string(window_right) +
                             "): each size must be >= 0, or -1 for unbounded");
    }
    int left = window_left >= seqlen_k - 1 ? -1 : window_left;  // the last row's window starts at key 0
    int right = window_right >= seqlen_k ? -1 : window_right;
    if (causal) right = 0;
    if (left < 0 && right < 0) return CallMask{names[FAGEN_MASK_FULL]};
    if (left < 0 && right == 0) return CallMask{names[FAGEN_MASK_CAUSAL]};
    const int unbounded = seqlen_q + seqlen_k;
    return CallMask{names[FAGEN_MASK_LOCAL], left < 0 ? unbounded : left, right < 0 ? unbounded : right};
}

// The scale_log2 (params.h) a call with `softmax_scale` launches with (nullopt: 1/sqrt(head_dim)):
// fagen/contract.py's kernel_scale_log2, the same rule and messages. The kernels take the running
// maximum of the unscaled scores, so a negative scale is refused; 0 launches with the smallest
// normal scale_log2, where every exponential rounds to 1 (uniform attention).
inline Result<float> kernel_scale_log2(std::optional<float> softmax_scale, int head_dim) {
    const double scale = softmax_scale.has_value() ? static_cast<double>(*softmax_scale)
                                                   : 1.0 / std::sqrt(static_cast<double>(head_dim));
    char text[64];
    std::snprintf(text, sizeof text, "%g", scale);
    if (std::isnan(scale) || std::isinf(scale)) {
        return Status::error(std::string("fagen: softmax_scale=") + text + ": must be a finite number");
    }
    if (scale < 0) {
        return Status::error(std::string("fagen: softmax_scale=") + text +
                             ": must be >= 0 (fagen's kernels take the running maximum of the unscaled scores); "
                             "for a negative scale pass -q and softmax_scale=|scale|");
    }
    const double scale_log2 = scale * FAGEN_LOG2_E;
    if (scale_log2 > FLT_MAX) {
        return Status::error(std::string("fagen: softmax_scale=") + text + ": softmax_scale * log2(e) overflows float32");
    }
    return static_cast<float>(std::max(scale_log2, static_cast<double>(FAGEN_MIN_SCALE_LOG2)));
}

// What a call's softmax_scale and softcap launch with (params.h: scale_log2, softcap_scale):
// fagen/contract.py's kernel_score_scale, the same rule and messages. Without a softcap
// (softcap 0) kernel_scale_log2 alone; with one the kernels take tanh(softcap_scale * s) of the
// raw score s, softcap_scale = softmax_scale / softcap, and scale_log2 = softcap * log2(e).
struct KernelScale {
    float scale_log2 = 0.f;
    float softcap_scale = 0.f;
};
inline Result<KernelScale> kernel_score_scale(std::optional<float> softmax_scale, int head_dim, float softcap) {
    if (std::isnan(softcap) || std::isinf(softcap) || softcap < 0) {
        char text[64];
        std::snprintf(text, sizeof text, "%g", static_cast<double>(softcap));
        return Status::error(std::string("fagen: softcap=") + text + ": must be a finite number >= 0 (0: no softcap)");
    }
    const Result<float> scale_log2 = kernel_scale_log2(softmax_scale, head_dim);
    if (!scale_log2.ok()) return scale_log2.status();
    if (!(softcap > 0)) return KernelScale{scale_log2.value(), 0.f};
    const double scale = softmax_scale.has_value() ? static_cast<double>(*softmax_scale)
                                                   : 1.0 / std::sqrt(static_cast<double>(head_dim));
    return KernelScale{static_cast<float>(std::max(static_cast<double>(softcap) * FAGEN_LOG2_E,
                                                   static_cast<double>(FAGEN_MIN_SCALE_LOG2))),
                       static_cast<float>(scale / static_cast<double>(softcap))};
}

// Why `path` (a file index.h names) is not a normalised relative path inside the bundle: the
// rule of fagen/contract.py's path_problem. Empty when it is one.
inline std::string path_problem(const std::string& path) {
    if (path.empty()) return "not a path";
    if (path.front() == '/' || path.find('\\') != std::string::npos) return "not a normalised relative path";
    size_t begin = 0;
    while (begin <= path.size()) {
        const size_t end = std::min(path.find('/', begin), path.size());
        const std::string part = path.substr(begin, end - begin);
        if (part.empty() || part == "." || part == "..") return "not a normalised relative path";
        begin = end + 1;
    }
    return "";
}

// Strides in elements of a (batch, seqlen, heads, head_dim) tensor whose last dim is contiguous.
struct Strides {
    long long batch = 0;
    long long row = 0;
    long long head = 0;

    static Strides contiguous(int seqlen, int heads, int head_dim) {
        return {static_cast<long long>(seqlen) * heads * head_dim, static_cast<long long>(heads) * head_dim, head_dim};
    }
};

// The rules of params.h for one tensor of `dtype` elements, as fagen/runtime/call.py's
// _check_tensor (the same results and messages; tests/compile/test_cpp_loader.py holds them to
// each other): a non-null, 16-byte aligned pointer; strides that are non-negative multiples of
// 16 bytes (stride_multiple: 8 fp16/bf16 elements, 16 e4m3 ones); a tensor map (a TMA kernel's
// input) cannot describe a broadcast (stride 0) dimension.
inline Status tensor_status(const char* name, CUdeviceptr data, const Strides& s, bool tma, DType dtype = DType::bf16) {
    if (data == 0 || data % FAGEN_ALIGNMENT_BYTES != 0) {
        return Status::error(std::string("fagen: ") + name + " must be a non-null, " +
                             std::to_string(FAGEN_ALIGNMENT_BYTES) + "-byte aligned device pointer");
    }
    const int multiple = stride_multiple(dtype);
    for (long long stride : {s.batch, s.row, s.head}) {
        if (stride % multiple != 0 || stride < 0 || (tma && stride == 0)) {
            return Status::error(std::string("fagen: ") + name + " strides (" + std::to_string(s.batch) + ", " +
                                 std::to_string(s.row) + ", " + std::to_string(s.head) + ") must be multiples of " +
                                 std::to_string(multiple) + " elements" + (tma ? " and non-zero (TMA kernel)" : ""));
        }
    }
    return Status();
}

// An e4m3 call's descales (flash-attn's q_descale, k_descale, v_descale; fagen/runtime/e4m3.py:
// Descales): fp32 device arrays of the factors that turn the stored e4m3 elements back into the
// values they stand for, each read at [b * batch_stride + kv_head * head_stride] (kv_head: the K/V
// head a query head reads, for q's too, as flash-attn's (batch, heads_kv) descales; strides in
// floats, 0 gives every index the same value); an address of 0 is a descale of 1.0. The kernels
// take scores = q_descale * k_descale * softmax_scale * Q K^T and out = v_descale * P V of the
// stored values (params.h: FagenFwdParams q_descale ...). All 0, the default, is none.
struct Descales {
    CUdeviceptr q = 0, k = 0, v = 0;
    long long q_batch_stride = 0, q_head_stride = 0;
    long long k_batch_stride = 0, k_head_stride = 0;
    long long v_batch_stride = 0, v_head_stride = 0;

    bool empty() const {
        return q == 0 && k == 0 && v == 0 && q_batch_stride == 0 && q_head_stride == 0 && k_batch_stride == 0 &&
               k_head_stride == 0 && v_batch_stride == 0 && v_head_stride == 0;
    }
};

// Why a call of element `dtype` (and K/V cache element `kv_dtype`, none: dtype) cannot take
// `descales` (fagen/runtime/e4m3.py: descales_problem, the same messages): only calls with e4m3
// elements have descales (an empty Descales is none); an address must be 4-byte aligned (an
// fp32 array), a stride >= 0.
inline Status descales_status(DType dtype, const Descales& descales, std::optional<DType> kv_dtype = std::nullopt) {
    if (descales.empty()) return Status();
    if (dtype != DType::e4m3 && kv_dtype != DType::e4m3) {
        return Status::error(std::string("fagen: descales: for e4m3 problems only; a ") + dtype_name(dtype) +
                             " problem's elements are its values (give the call no descales)");
    }
    const std::tuple<const char*, CUdeviceptr, long long, long long> tensors[] = {
        {"q", descales.q, descales.q_batch_stride, descales.q_head_stride},
        {"k", descales.k, descales.k_batch_stride, descales.k_head_stride},
        {"v", descales.v, descales.v_batch_stride, descales.v_head_stride}};
    for (const auto& [name, address, batch_stride, head_stride] : tensors) {
        if (address % 4 != 0) {
            char hex[32];
            std::snprintf(hex, sizeof hex, "%#llx", static_cast<unsigned long long>(address));
            return Status::error(std::string("fagen: descales.") + name + "=" + hex +
                                 ": a 4-byte aligned fp32 device array, or 0 for a descale of 1.0");
        }
        for (const auto& [dim, stride] : {std::pair<const char*, long long>{"batch", batch_stride}, {"head", head_stride}}) {
            if (stride < 0) {
                return Status::error(std::string("fagen: descales.") + name + "_" + dim + "_stride=" +
                                     std::to_string(stride) + ": must be >= 0 (in floats; 0 gives every index the same value)");
            }
        }
    }
    return Status();
}

// One attention forward in flash-attn's layout: q (batch, seqlen_q, heads_q, head_dim), k (batch,
// seqlen_k, heads_kv, head_dim), v (batch, seqlen_k, heads_kv, head_dim_v), out (batch, seqlen_q,
// heads_q, head_dim_v), optional lse (batch, heads_q, seqlen_q)
// fp32, all device pointers; q, k, v of `dtype`, out of output_dtype(dtype). Strides (in elements
// of each tensor's type) default to contiguous. `causal` masks bottom-right aligned (query row i
// sees keys j <= i + seqlen_k - seqlen_q); window_left / window_right are flash-attn's
// window_size (call_mask; -1: unbounded); a row that sees no key gives zeros.
struct Attention {
    DType dtype = DType::bf16;
    bool causal = false;
    int window_left = -1, window_right = -1;
    int batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
    // v's and out's last dimension where it differs from head_dim (DeepSeek-V3: 192 / 128); 0:
    // head_dim.
    int head_dim_v = 0;
    CUdeviceptr q = 0, k = 0, v = 0, out = 0;
    CUdeviceptr lse = 0;  // 0: not written
    // Scratch for kernels that keep state in global memory, 16-byte aligned, of at least
    // Bundle::forward_workspace_bytes(*this) bytes; 0 where that is 0: FA1's fp32 rows, an e4m3
    // forward's V^T (fagen/contract.py: E4M3_VT_SUFFIX).
    CUdeviceptr workspace = 0;
    std::optional<Strides> q_strides, k_strides, v_strides, out_strides;
    // Unset: 1 / sqrt(head_dim). Any finite value >= 0 (0: uniform attention over the keys a row
    // sees); negative, inf and NaN are refused (kernel_scale_log2).
    std::optional<float> softmax_scale;
    // The score modifiers, flash-attn's semantics (each a kernel variant, variant_name): softcap
    // > 0 caps the scaled scores at softcap * tanh(score / softcap); alibi_slopes, fp32 of
    // (heads_q,) or, with alibi_per_batch, (batch, heads_q), adds -slope * |i + seqlen_k -
    // seqlen_q - j|; sinks, fp32 (heads_q,), a logit per query head in every row's softmax.
    float softcap = 0.f;
    CUdeviceptr alibi_slopes = 0;
    bool alibi_per_batch = false;
    CUdeviceptr sinks = 0;
    // A custom mask the bundle was built with (a spec's `masks:`), by its name, and the device
    // memory its type reads (mask_args); it replaces causal and the window (leave them unset).
    std::string mask_mod;
    CUdeviceptr mask_args = 0;
    // Packed sequences of different lengths (layout varlen, flash_attn_varlen_func): with
    // cu_seqlens_q and cu_seqlens_k, device int32 (batch + 1) offsets of each sequence's tokens,
    // q and out are (total_q, heads_q, d), k and v (total_k, heads_kv, d), their batch strides
    // ignored; seqlen_q and seqlen_k are the longest sequence's (they size the grid), total_q and
    // total_k the packed rows, lse (heads_q, total_q); seqused_k (int32 (batch,), optional)
    // caps each sequence's keys (forward only).
    CUdeviceptr cu_seqlens_q = 0, cu_seqlens_k = 0, seqused_k = 0;
    long long total_q = 0, total_k = 0;
    // dtype e4m3 only (forward, dense layout, the built-in masks, no score modifier): q's, k's and
    // v's descales; none (the default): each 1.0. out is then bf16 (output_dtype), its strides in
    // bf16 elements.
    Descales descales;

    bool varlen() const { return cu_seqlens_k != 0; }

    // The mask of this call: call_mask's, or the custom mask's.
    Result<CallMask> mask() const {
        if (mask_mod.empty()) return call_mask(causal, window_left, window_right, seqlen_q, seqlen_k);
        if (causal || window_left != -1 || window_right != -1) {
            return Status::error("fagen: mask_mod=" + mask_mod + " replaces causal and the window: leave them "
                                 "false and -1 (the custom mask decides which pairs attend)");
        }
        return CallMask{mask_mod.c_str(), 0, 0};
    }

    // The variant of this call's kernel: its mask and score modifiers.
    std::string variant(const CallMask& mask) const {
        return variant_name(mask.kind, softcap > 0, alibi_slopes != 0, sinks != 0);
    }

    int value_dim() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

// Why no e4m3 kernel serves a call of `a` in `direction` ("fwd" or "bwd") and `layout` (one of
// FAGEN_LAYOUT_NAMES), fagen/runtime/e4m3.py's call_problem (the same messages); OK for another
// dtype. Said before the kernel lookup, whose error would suggest a `fagen build` of a kernel
// that the spec models refuse.
// Why no kernel reads a KV cache of element `kv_dtype` under queries of `dtype` (they differ)
// (fagen/runtime/e4m3.py: cache_problem, the same messages; a KV-cache call's layout is paged).
inline Status cache_dtype_status(DType dtype, DType kv_dtype) {
    const std::string cache_element = dtype_name(DType::e4m3);
    if (kv_dtype != DType::e4m3) {
        return Status::error(std::string("fagen: kv_dtype '") + dtype_name(kv_dtype) + "': k and v are q's type (" +
                             dtype_name(dtype) + ") or, in a KV cache, " + cache_element);
    }
    if (dtype != DType::fp16 && dtype != DType::bf16) {
        return Status::error("fagen: kv_dtype " + cache_element + " under " + dtype_name(dtype) +
                             " queries: the cache kernels take fp16 or bf16 queries (e4m3 queries convert to bf16 "
                             "exactly; their q_descale still applies)");
    }
    return Status();
}

inline Status e4m3_call_status(const Attention& a, const std::string& direction, const std::string& layout) {
    if (a.dtype != DType::e4m3) return Status();
    if (direction != "fwd") {
        return Status::error("fagen: dtype e4m3: fagen's FP8 kernels are forward kernels; there is no e4m3 backward "
                             "(train in fp16 or bf16)");
    }
    static const char* const layouts[] = FAGEN_LAYOUT_NAMES;
    const std::string dense = layouts[0];
    if (layout != dense) {
        return Status::error("fagen: dtype e4m3: the e4m3 kernels take the " + dense + " layout, not '" + layout + "'");
    }
    // The call's modifiers as a key spells them after its mask ("+softcap+sinks"), as a list.
    const std::string modifiers = variant_name("", a.softcap > 0, a.alibi_slopes != 0, a.sinks != 0);
    if (!modifiers.empty()) {
        std::string asked, every;
        for (char c : modifiers.substr(1)) asked += c == '+' ? std::string(", ") : std::string(1, c);
        for (const char* mod : FAGEN_SCORE_MOD_NAMES) every += (every.empty() ? "" : ", ") + std::string(mod);
        return Status::error("fagen: dtype e4m3: the e4m3 kernels take no score modifier (" + asked +
                             " asked for; fp16 and bf16 kernels take " + every + ")");
    }
    if (!a.mask_mod.empty()) {
        return Status::error("fagen: dtype e4m3: the e4m3 kernels take the built-in masks only, not mask_mod='" +
                             a.mask_mod + "'");
    }
    return Status();
}

class Bundle;

// One kernel of a bundle, loaded into the driver; usable from any thread and context.
class Kernel {
public:
    const FagenKernelInfo& info() const { return *info_; }
    bool uses_tma() const { return info_->tma_q_rows > 0; }

    // Launch with a filled FagenFwdParams (and, for TMA kernels, maps of q, k, v; for kernels
    // with a workspace, a device buffer of workspace_bytes(params) bytes) on `stream` in the
    // calling thread's current context, whose device must have been prepared through
    // Bundle::kernel.
    Status launch(const FagenFwdParams& params, const FagenTmaMaps* maps, CUstream stream,
                  CUdeviceptr workspace = 0) const {
        auto d = driver();
        if (!d.ok()) return d.status();
        if (uses_tma() && maps == nullptr) {
            return Status::error(std::string("fagen: kernel ") + info_->name + " uses TMA and needs FagenTmaMaps");
        }
        if (info_->workspace_floats_per_row > 0 && workspace == 0) {
            return Status::error(std::string("fagen: kernel ") + info_->name + " needs a workspace of " +
                                 std::to_string(workspace_bytes(params)) + " bytes (Attention::workspace)");
        }
        CUlaunchConfig config{};
        int sms = 0;  // read only for a persistent grid
        if (info_->grid == FAGEN_GRID_PERSISTENT) {
            auto count = multiprocessor_count();
            if (!count.ok()) return count.status();
            sms = count.value();
            // Packed rows (a varlen call, a KV-cache prefill's packed q; the LSE's head stride: their
            // count) of mixed lengths: a CTA per work item.
            if (params.cu_seqlens_q != nullptr && varlen_walks_items(params.batch, params.seqlen_q, params.lse_head_stride)) {
                sms = 1 << 30;
            }
        }
        set_grid(config, grid_dims(info_->grid, info_->block_m, info_->block_n, params.seqlen_q, params.heads_q,
                                   params.batch, sms, params.seqlen_k, params.heads_kv,
                                   params.num_splits > 1 ? params.num_splits : 1));
        config.blockDimX = static_cast<unsigned>(info_->threads);
        config.blockDimY = config.blockDimZ = 1;
        config.sharedMemBytes = static_cast<unsigned>(info_->dynamic_smem);
        config.hStream = stream;
        void* arguments[3] = {const_cast<FagenFwdParams*>(&params)};
        int count = 1;
        if (uses_tma()) arguments[count++] = const_cast<FagenTmaMaps*>(maps);
        if (info_->workspace_floats_per_row > 0) arguments[count++] = &workspace;
        // A CUkernel is accepted wherever the launch API takes a CUfunction.
        return d.value()->check(
            d.value()->launch_kernel_ex(&config, reinterpret_cast<CUfunction>(kernel_), arguments, nullptr),
            "cuLaunchKernelEx");
    }

    static void set_grid(CUlaunchConfig& config, const GridDims& grid) {
        config.gridDimX = static_cast<unsigned>(grid.x);
        config.gridDimY = static_cast<unsigned>(grid.y);
        config.gridDimZ = static_cast<unsigned>(grid.z);
    }

    // SMs of the current context's device: the size of a persistent grid.
    static Result<int> multiprocessor_count() {
        auto d = driver();
        if (!d.ok()) return d.status();
        CUdevice device = 0;
        int sms = 0;
        if (Status s = d.value()->check(d.value()->ctx_get_device(&device), "cuCtxGetDevice"); !s.ok()) return s;
        if (Status s = d.value()->check(
                d.value()->device_get_attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
                "cuDeviceGetAttribute");
            !s.ok()) {
            return s;
        }
        return sms;
    }

    // Bytes of the fp32 workspace a launch with `params` needs (0: none).
    size_t workspace_bytes(const FagenFwdParams& params) const {
        return sizeof(float) * static_cast<size_t>(info_->workspace_floats_per_row) * params.seqlen_q *
               params.heads_q * params.batch;
    }

    // A split-KV kernel's entry points beside the main one (contract.h: FAGEN_SPLIT_*_SUFFIX),
    // each a warp per row on companion_grid, on `stream` after or before launch() as
    // Bundle::attention_kvcache orders them: the combine merges the params.num_splits partial
    // results into o and lse; the append writes params.k_new, v_new into the cache; the merge
    // merges two attention results (Bundle::merge_attention_states).
    Status launch_combine(const FagenFwdParams& params, CUstream stream) const {
        return launch_companion(combine_, &params, companion_grid(params.batch, params.seqlen_q, params.heads_q),
                                stream, "combine");
    }
    Status launch_append(const FagenFwdParams& params, CUstream stream) const {
        return launch_companion(append_, &params, companion_grid(params.batch, params.seqlen_new, params.heads_kv),
                                stream, "append");
    }
    Status launch_merge(const FagenMergeParams& params, CUstream stream) const {
        return launch_companion(merge_, &params, companion_grid(params.batch, params.seqlen, params.heads), stream,
                                "merge");
    }
    // An e4m3 forward's companion (contract.h: FAGEN_E4M3_VT_SUFFIX): V^T of params.v into `vt`
    // (vt_workspace_bytes), on `stream` before launch() with maps whose V map is over `vt`.
    bool transposes_v() const { return transpose_v_ != nullptr; }
    Status launch_transpose_v(const FagenFwdParams& params, int head_dim_v, CUdeviceptr vt, CUstream stream) const {
        return launch_companion(transpose_v_, &params, vt_grid(params.seqlen_k, params.heads_kv, params.batch), stream,
                                "vt", &vt, vt_threads(head_dim_v));
    }

    // A backward (index.h key "bwd/..."): its preprocess, main and dQ kernels (contract.h,
    // FAGEN_BWD_*) on `stream`, in the calling thread's current context; `maps` for a TMA
    // kernel (uses_tma()), else null.
    Status launch_backward(const FagenBwdParams& params, const FagenBwdTmaMaps* maps, CUstream stream) const {
        auto d = driver();
        if (!d.ok()) return d.status();
        if (preprocess_ == nullptr || convert_ == nullptr) {
            return Status::error(std::string("fagen: kernel ") + info_->name + " is not a backward kernel");
        }
        if (uses_tma() && maps == nullptr) {
            return Status::error(std::string("fagen: kernel ") + info_->name + " uses TMA and needs FagenBwdTmaMaps");
        }
        CUlaunchConfig rows{};
        set_grid(rows, bwd_row_grid(params.seqlen_q, params.heads_q, params.batch));
        rows.blockDimX = FAGEN_BWD_ROW_THREADS;
        rows.blockDimY = rows.blockDimZ = 1;
        rows.hStream = stream;
        CUlaunchConfig main{};
        set_grid(main, grid_dims(info_->grid, info_->block_m, info_->block_n, params.seqlen_q, params.heads_q,
                                 params.batch, 0, params.seqlen_k, params.heads_kv));
        main.blockDimX = static_cast<unsigned>(info_->threads);
        main.blockDimY = main.blockDimZ = 1;
        main.sharedMemBytes = static_cast<unsigned>(info_->dynamic_smem);
        main.hStream = stream;
        void* row_arguments[1] = {const_cast<FagenBwdParams*>(&params)};
        void* main_arguments[2] = {const_cast<FagenBwdParams*>(&params), const_cast<FagenBwdTmaMaps*>(maps)};
        const std::tuple<const CUlaunchConfig*, CUkernel, void**, const char*> steps[] = {
            {&rows, preprocess_, row_arguments, "cuLaunchKernelEx(preprocess)"},
            {&main, kernel_, main_arguments, "cuLaunchKernelEx"},
            {&rows, convert_, row_arguments, "cuLaunchKernelEx(dq)"}};
        for (const auto& [config, kernel, arguments, call] : steps) {
            if (Status s = d.value()->check(
                    d.value()->launch_kernel_ex(config, reinterpret_cast<CUfunction>(kernel), arguments, nullptr), call);
                !s.ok()) return s;
        }
        return Status();
    }

private:
    friend class Bundle;
    const FagenKernelInfo* info_ = nullptr;
    std::vector<unsigned char> image_;  // the driver may read it lazily, after cuLibraryLoadData returns
    CUlibrary library_ = nullptr;
    CUkernel kernel_ = nullptr;
    CUkernel preprocess_ = nullptr;  // backward kernels only
    CUkernel convert_ = nullptr;
    CUkernel combine_ = nullptr;  // split-KV kernels only
    CUkernel append_ = nullptr;
    CUkernel merge_ = nullptr;
    CUkernel transpose_v_ = nullptr;  // e4m3 forwards only
    std::set<CUdevice> prepared_devices_;

    Status launch_companion(CUkernel kernel, const void* params, const GridDims& grid, CUstream stream,
                            const char* what, CUdeviceptr* buffer = nullptr,
                            int threads = FAGEN_COMPANION_THREADS) const {
        auto d = driver();
        if (!d.ok()) return d.status();
        if (kernel == nullptr) {
            return Status::error(std::string("fagen: kernel ") + info_->name + " has no " + what + " entry point");
        }
        CUlaunchConfig config{};
        set_grid(config, grid);
        config.blockDimX = static_cast<unsigned>(threads);
        config.blockDimY = config.blockDimZ = 1;
        config.hStream = stream;
        void* arguments[2] = {const_cast<void*>(params), buffer};
        return d.value()->check(
            d.value()->launch_kernel_ex(&config, reinterpret_cast<CUfunction>(kernel), arguments, nullptr),
            (std::string("cuLaunchKernelEx(") + what + ")").c_str());
    }
};

// One attention backward: the forward's tensors (q, k, v, out, and its lse, which is required
// here), the output's gradient dout, and the gradients to write (dq like q, dk and dv like k and
// v; strides default to contiguous). `workspace`: an fp32 device buffer of
// Bundle::backward_workspace_bytes(); `semaphores`: 0, or a zeroed int32 buffer of
// Bundle::backward_semaphore_bytes() for the deterministic mode (the same gradients, bit for
// bit, on every run).
struct AttentionBackward : Attention {
    CUdeviceptr dout = 0, dq = 0, dk = 0, dv = 0;
    std::optional<Strides> dout_strides, dq_strides, dk_strides, dv_strides;
    CUdeviceptr semaphores = 0;
    CUdeviceptr dsinks = 0;  // with sinks: dL/dsink, fp32 (heads_q,), written
};

// Attention of new query tokens over a KV cache (flash_attn_with_kvcache; layout paged: the
// split-KV kernels, or a prefill's tile kernels, FA4 / FA3, from FAGEN_PAGED_TILE_MIN_QUERIES query tokens
// a row where the bundle has them and num_splits is 0 or 1). q: dense (batch, seqlen_q, heads_q,
// d), or packed by cu_seqlens_q ((total_q, heads_q, d), seqlen_q the longest row's, lse (heads_q,
// total_q)). k, v: the cache, (batch,
// seqlen_k, heads_kv, d) contiguous, or pages (pages, page_size, heads_kv, d) with block_table,
// int32 (batch, block_table_stride), key j of row b in row j % page_size of page
// block_table[b * block_table_stride + j / page_size] (page_size a multiple of 16); seqlen_k is
// each row's capacity (block_table columns x page_size when paged). cache_seqlens: int32
// (batch,) keys per row (0: seqlen_k each). `causal` aligns a row's tokens to its last key
// (bottom-right). num_splits: 0 chooses (split_count), n forces n; `workspace`: an fp32 device
// buffer of Bundle::kvcache_workspace_bytes(). k_new, v_new (batch, seqlen_new, heads_kv, d;
// strides default to contiguous; dense q only): appended into the cache at cache_seqlens
// (through the pages) before the attention, which then sees cache_seqlens + seqlen_new keys per
// row; cache_seqlens itself is not changed (flash-attn's k, v). A key past a row's capacity or a
// page outside [0, pages) is not written. kv_dtype: the cache's element where it differs from
// dtype (e4m3: an FP8 cache under fp16 / bf16 queries, k_new and v_new in e4m3 too; descales
// k's and v's, and q's where the queries were scaled).
struct KvCacheAttention : Attention {
    std::optional<DType> kv_dtype;
    CUdeviceptr block_table = 0;
    long long block_table_stride = 0;
    int page_size = 0, pages = 0;
    CUdeviceptr cache_seqlens = 0;
    int num_splits = 0;
    CUdeviceptr k_new = 0, v_new = 0;
    int seqlen_new = 0;
    std::optional<Strides> k_new_strides, v_new_strides;
};

// Two attention results over disjoint key sets of the same queries, merged into the attention
// over their union (merge_attention_states; what cascade attention and context parallelism do):
// out_a, out_b, out (batch, seqlen, heads, head_dim) of `dtype`, head_dim a multiple of 8,
// strides in elements (default contiguous; packed rows: batch 1); lse_a, lse_b, lse fp32 (batch,
// heads, seqlen) natural-log LSEs (default strides contiguous; lse may be 0: not written). out may
// be out_a or out_b. Runs in the merge entry point of a paged-layout kernel of `dtype`.
struct MergeStates {
    DType dtype = DType::bf16;
    int batch = 0, seqlen = 0, heads = 0, head_dim = 0;
    CUdeviceptr out_a = 0, lse_a = 0, out_b = 0, lse_b = 0, out = 0, lse = 0;
    std::optional<Strides> out_a_strides, out_b_strides, out_strides;
    // (batch, head) strides of each LSE, in floats; default (heads * seqlen, seqlen).
    std::optional<std::pair<long long, long long>> lse_a_strides, lse_b_strides, lse_strides;
};

// The arguments of one cuTensorMapEncodeTiled call, all but the CUtensorMap it writes: a tiled
// TMA map over a 4-D tensor (head_dim, seqlen, heads, batch), innermost first. A pure function
// of the call (tensor_map_args) so that tests/compile/test_cpp_loader.py can hold it to
// fagen/runtime/call.py's maps without a GPU.
struct TensorMapArgs {
    CUtensorMapDataType data_type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    cuuint32_t rank = 4;
    CUdeviceptr global_address = 0;
    cuuint64_t global_dim[4] = {};
    cuuint64_t global_strides[3] = {};  // bytes, of dims 1..3
    cuuint32_t box_dim[4] = {};
    cuuint32_t element_strides[4] = {};
    CUtensorMapInterleave interleave = CU_TENSOR_MAP_INTERLEAVE_NONE;
    CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B;
    CUtensorMapL2promotion l2_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
    CUtensorMapFloatOOBfill oob_fill = CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE;
};

// A tiled map of a (batch, seqlen, heads, head_dim) tensor of `dtype` elements (boxes of
// tma_box_columns(dtype) x box_rows: 128 bytes, the swizzle width; e4m3 as bytes, which TMA only
// moves), or with `accumulator` of a backward's fp32 dQ accumulator (boxes of
// FAGEN_ACCUM_BOX_COLUMNS x box_rows); 128-byte swizzle, out-of-bounds elements read as zeros.
inline TensorMapArgs tensor_map_args(DType dtype, CUdeviceptr data, int batch, int seqlen, int heads, int head_dim,
                                     const Strides& strides, int box_rows, bool accumulator = false) {
    const cuuint64_t bytes = accumulator ? FAGEN_ACCUM_BYTES : cuuint64_t(element_bytes(dtype));
    TensorMapArgs m;
    m.data_type = accumulator            ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                  : dtype == DType::e4m3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                  : dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    m.rank = 4;
    m.global_address = data;
    const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
    const cuuint64_t byte_strides[3] = {cuuint64_t(strides.row) * bytes, cuuint64_t(strides.head) * bytes,
                                        cuuint64_t(strides.batch) * bytes};
    const cuuint32_t box[4] = {cuuint32_t(accumulator ? FAGEN_ACCUM_BOX_COLUMNS : tma_box_columns(dtype)),
                               cuuint32_t(box_rows), 1, 1};
    for (int i = 0; i < 4; ++i) {
        m.global_dim[i] = dims[i];
        m.box_dim[i] = box[i];
        m.element_strides[i] = 1;
    }
    for (int i = 0; i < 3; ++i) m.global_strides[i] = byte_strides[i];
    return m;  // interleave, swizzle, L2 promotion, OOB fill: TensorMapArgs's defaults
}

// The Q, K and V maps of a TMA kernel (FagenTmaMaps, FagenBwdTmaMaps), given the tensors'
// strides: boxes of the kernel's tma_q_rows (Q) and tma_kv_rows (K, V) rows; V's columns are
// head_dim_v. A varlen call's maps span the packed rows as one batch row (algo/batch_row.cuh).
// An e4m3 forward's V map is over the V^T its companion writes into a.workspace (contract.h:
// vt_keys; fagen/contract.py: E4M3_VT_SUFFIX): (vt_keys, head_dim_v, heads_kv, batch), boxes of
// one 128-byte row of keys by head_dim_v rows.
inline std::array<TensorMapArgs, 3> qkv_map_args(const Attention& a, const Strides& q, const Strides& k,
                                                 const Strides& v, int tma_q_rows, int tma_kv_rows) {
    if (a.varlen()) {
        const long long rows_q = a.total_q > 1 ? a.total_q : 1, rows_k = a.total_k > 1 ? a.total_k : 1;
        const Strides pq{rows_q * q.row, q.row, q.head}, pk{rows_k * k.row, k.row, k.head}, pv{rows_k * v.row, v.row, v.head};
        return {tensor_map_args(a.dtype, a.q, 1, int(rows_q), a.heads_q, a.head_dim, pq, tma_q_rows),
                tensor_map_args(a.dtype, a.k, 1, int(rows_k), a.heads_kv, a.head_dim, pk, tma_kv_rows),
                tensor_map_args(a.dtype, a.v, 1, int(rows_k), a.heads_kv, a.value_dim(), pv, tma_kv_rows)};
    }
    if (a.dtype == DType::e4m3) {
        const long long keys = vt_keys(a.seqlen_k), columns = a.value_dim();
        const Strides vt{a.heads_kv * columns * keys, keys, columns * keys};
        return {tensor_map_args(a.dtype, a.q, a.batch, a.seqlen_q, a.heads_q, a.head_dim, q, tma_q_rows),
                tensor_map_args(a.dtype, a.k, a.batch, a.seqlen_k, a.heads_kv, a.head_dim, k, tma_kv_rows),
                tensor_map_args(a.dtype, a.workspace, a.batch, a.value_dim(), a.heads_kv, int(keys), vt, a.value_dim())};
    }
    return {tensor_map_args(a.dtype, a.q, a.batch, a.seqlen_q, a.heads_q, a.head_dim, q, tma_q_rows),
            tensor_map_args(a.dtype, a.k, a.batch, a.seqlen_k, a.heads_kv, a.head_dim, k, tma_kv_rows),
            tensor_map_args(a.dtype, a.v, a.batch, a.seqlen_k, a.heads_kv, a.value_dim(), v, tma_kv_rows)};
}

// The Q, K and V maps of a KV-cache call on a paged tile kernel (fagen/runtime/kvcache.py:
// _prepare_tiles): Q over the dense rows or, packed (cu_seqlens_q), over total_q rows as one batch
// row; K and V over the pages (page_size rows, `pages` batch rows) or the contiguous cache, in
// boxes of the runs of keys the kernel loads (cache_box_rows).
inline std::array<TensorMapArgs, 3> kvcache_map_args(const KvCacheAttention& a, const Strides& q, const Strides& k,
                                                     const Strides& v, const FagenKernelInfo& info) {
    const bool packed = a.cu_seqlens_q != 0, paged = a.block_table != 0;
    const long long q_rows = packed ? (a.total_q > 1 ? a.total_q : 1) : a.seqlen_q;
    const Strides q_map = packed ? Strides{q_rows * q.row, q.row, q.head} : q;
    const int kv_rows = paged ? a.page_size : a.seqlen_k, kv_batch = paged ? a.pages : a.batch;
    const int box = cache_box_rows(paged ? a.page_size : 0, info.tma_kv_rows);
    const DType cache = a.kv_dtype.value_or(a.dtype);
    return {tensor_map_args(a.dtype, a.q, packed ? 1 : a.batch, int(q_rows), a.heads_q, a.head_dim, q_map, info.tma_q_rows),
            tensor_map_args(cache, a.k, kv_batch, kv_rows, a.heads_kv, a.head_dim, k, box),
            tensor_map_args(cache, a.v, kv_batch, kv_rows, a.heads_kv, a.value_dim(), v, box)};
}

// A backward's maps beyond Q, K, V (FagenBwdTmaMaps): dO like the output (head_dim_v columns),
// and the fp32 dQ accumulator at `dq_accum`, (batch, heads_q, dq_accum_rows(seqlen_q),
// head_dim), both in boxes of tma_q_rows rows.
inline std::array<TensorMapArgs, 2> bwd_extra_map_args(const AttentionBackward& a, const Strides& dout,
                                                       CUdeviceptr dq_accum, int tma_q_rows) {
    if (a.varlen()) {  // over the packed rows, one batch row; the accumulator's varlen_accum_rows per head
        const long long rows_q = a.total_q > 1 ? a.total_q : 1, accum_rows = varlen_accum_rows(a.total_q, a.batch);
        const Strides packed{rows_q * dout.row, dout.row, dout.head};
        const Strides accum{a.heads_q * accum_rows * a.head_dim, a.head_dim, accum_rows * a.head_dim};
        return {tensor_map_args(a.dtype, a.dout, 1, int(rows_q), a.heads_q, a.value_dim(), packed, tma_q_rows),
                tensor_map_args(a.dtype, dq_accum, 1, int(accum_rows), a.heads_q, a.head_dim, accum, tma_q_rows, true)};
    }
    const Strides accum{a.heads_q * dq_accum_rows(a.seqlen_q) * a.head_dim, a.head_dim,
                        dq_accum_rows(a.seqlen_q) * a.head_dim};
    return {tensor_map_args(a.dtype, a.dout, a.batch, a.seqlen_q, a.heads_q, a.value_dim(), dout, tma_q_rows),
            tensor_map_args(a.dtype, dq_accum, a.batch, a.seqlen_q, a.heads_q, a.head_dim, accum, tma_q_rows, true)};
}

class Bundle {
public:
    // Open the bundle directory this program was compiled against (its include/ holds the
    // index.h compiled in): the versions, the manifest's digest, then every cubin (path inside
    // the bundle, size, sha256), read into memory. Reads files only; needs no driver or GPU.
    static Result<Bundle> open(const std::string& directory) {
        const std::string index_path = directory + "/include/fagen/index.h";
        auto index = detail::read_file(index_path);
        if (!index.ok()) return Status::error("fagen: " + directory + " is not a fagen bundle: " + index.status().message());
        const std::string text(index.value().begin(), index.value().end());
        const std::string schema = detail::define_value(text, "FAGEN_BUNDLE_SCHEMA_VERSION");
        const std::string abi = detail::define_value(text, "FAGEN_BUNDLE_ABI_VERSION");
        if (schema.empty() || abi.empty()) {
            return Status::error("fagen: " + index_path + " has no FAGEN_BUNDLE_SCHEMA_VERSION/FAGEN_BUNDLE_ABI_VERSION");
        }
        if (std::atoi(schema.c_str()) > kSchemaVersion) {
            return Status::error("fagen: bundle " + directory + " has manifest schema_version " + schema +
                                 ", newer than this fagen.hpp reads (up to " + std::to_string(kSchemaVersion) +
                                 "); rebuild the program against the bundle's include/ directory");
        }
        if (std::atoi(abi.c_str()) != kAbiVersion) {
            return Status::error("fagen: bundle " + directory + " was built for kernel ABI version " + abi +
                                 ", this program was compiled against ABI version " + std::to_string(kAbiVersion) +
                                 " (params.h); rebuild the bundle with a matching fagen or the program against "
                                 "the bundle's include/ directory");
        }
        auto manifest = detail::read_file(directory + "/manifest.json");
        if (!manifest.ok()) return Status::error("fagen: " + manifest.status().message());
        const std::string digest = sha256_hex(manifest.value().data(), manifest.value().size());
        if (digest != FAGEN_BUNDLE_MANIFEST_SHA256) {
            return Status::error("fagen: bundle " + directory + " is not the bundle this program was compiled against "
                                 "(manifest.json sha256 " + digest.substr(0, 16) + "…, compiled-in index.h of bundle \"" +
                                 FAGEN_BUNDLE_NAME + "\" expects " + std::string(FAGEN_BUNDLE_MANIFEST_SHA256).substr(0, 16) +
                                 "…); rebuild the program against " + directory + "/include");
        }
        Bundle bundle(directory);
        for (const FagenKernelInfo& info : fagen_kernels) {
            auto image = bundle.read_verified_cubin(info);
            if (!image.ok()) return image.status();
            bundle.state_->images.push_back(std::move(image.value()));
        }
        return bundle;
    }

    const std::string& directory() const { return state_->directory; }

    // The best kernel for `key` on a device of compute capability cc_major.cc_minor, for calls
    // with `seqlen_k` keys (0: unknown) (rules of runs_on/preferred_over), of launch grid `grid`
    // (FAGEN_GRID_*) when it is >= 0; the error says what the bundle holds and how to add the
    // kernel.
    Result<const FagenKernelInfo*> select(const std::string& key, int cc_major, int cc_minor,
                                          long long seqlen_k = 0, int grid = -1) const {
        const FagenKernelInfo* best = nullptr;
        for (const FagenKernelInfo& info : fagen_kernels) {
            if (key == info.key && runs_on(info, cc_major, cc_minor) && (grid < 0 || info.grid == grid) &&
                (best == nullptr || preferred_over(info, *best, seqlen_k))) {
                best = &info;
            }
        }
        if (best != nullptr) return best;
        const std::string cc = std::to_string(cc_major) + "." + std::to_string(cc_minor);
        std::string message = "fagen: no kernel for '" + key + "' on a compute capability " + cc + " device in bundle " +
                              directory() + ". The bundle holds:";
        for (const FagenKernelInfo& info : fagen_kernels) {
            message += std::string("\n  ") + info.arch + " (fa" + std::to_string(info.fa_version) + "): " + info.key;
        }
        message += "\nTo add it, put an entry for it (e.g. {fa_version: 2, arch: sm" + std::to_string(cc_major) +
                   std::to_string(cc_minor) + ", ...}) under `kernels:` in the bundle's spec, run `fagen build SPEC -o " +
                   directory() + "` and rebuild this program.";
        return Status::error(message);
    }

    // The loaded kernel for `key` and calls with `seqlen_k` keys (0: unknown) on the current
    // context's device (device 0 if none is current), with its dynamic shared-memory limit raised
    // on that device. Loads and verifies the cubin on first use; thread-safe.
    Result<const Kernel*> kernel(const std::string& key, long long seqlen_k = 0, int grid = -1) {
        auto d = driver();
        if (!d.ok()) return d.status();
        const Driver& cu = *d.value();
        auto device = current_device();
        if (!device.ok()) return device.status();
        auto cc = current_compute_capability();
        if (!cc.ok()) return cc.status();
        auto info = select(key, cc.value().first, cc.value().second, seqlen_k, grid);
        if (!info.ok()) return info.status();

        std::lock_guard<std::mutex> lock(state_->mutex);
        std::unique_ptr<Kernel>& slot = state_->kernels[info.value()->name];
        if (slot == nullptr) {
            auto loaded = load(*info.value(), cu);
            if (!loaded.ok()) return loaded.status();
            slot = std::move(loaded.value());
        }
        Kernel& kernel = *slot;
        if (kernel.prepared_devices_.count(device.value()) == 0) {
            // Device-wide and racy if done around launches: once per kernel and device, at load.
            if (Status s = cu.check(cu.kernel_set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                            kernel.info_->dynamic_smem, kernel.kernel_, device.value()),
                                    "cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
                !s.ok()) return s;
            kernel.prepared_devices_.insert(device.value());
        }
        return static_cast<const Kernel*>(&kernel);
    }

    // Run one attention forward on `stream` (in the current context): picks the kernel, checks
    // the arguments, fills FagenFwdParams (and the TMA maps) and launches. Asynchronous.
    Status attention(const Attention& a, CUstream stream) {
        if (a.batch < 0 || a.seqlen_q < 0 || a.heads_q < 0) return Status::error("fagen: negative size in Attention");
        if (Status s = check_element(a, "fwd", a.varlen() ? "varlen" : "dense"); !s.ok()) return s;
        if (a.batch == 0 || a.seqlen_q == 0 || a.heads_q == 0) return Status();
        if (a.seqlen_k <= 0 || a.heads_kv <= 0 || a.heads_q % a.heads_kv != 0) {
            return Status::error("fagen: need seqlen_k >= 1 and heads_q (" + std::to_string(a.heads_q) +
                                 ") a multiple of heads_kv (" + std::to_string(a.heads_kv) + ")");
        }
        if (Status s = check_grid_limits(a); !s.ok()) return s;
        const Result<KernelScale> scale = kernel_score_scale(a.softmax_scale, a.head_dim, a.softcap);
        if (!scale.ok()) return scale.status();
        if (Status s = check_score_arrays(a); !s.ok()) return s;
        if (Status s = check_varlen(a); !s.ok()) return s;
        const Result<CallMask> mask = a.mask();
        if (!mask.ok()) return mask.status();
        auto kernel = forward_kernel(a, mask.value());
        if (!kernel.ok()) return kernel.status();
        const bool tma = kernel.value()->uses_tma();

        auto [q, k, v, o] = strides_of(a);
        if (a.varlen()) q.batch = k.batch = v.batch = o.batch = 0;  // packed: never used
        if (Status s = check_forward_tensors(a, q, k, v, o, tma); !s.ok()) return s;
        FagenFwdParams p = forward_params(a, q, k, v, o, scale.value(), mask.value());
        if (a.varlen()) {
            p.lse_batch_stride = 0;
            p.lse_head_stride = a.total_q;
            p.cu_seqlens_q = reinterpret_cast<const int*>(a.cu_seqlens_q);
            p.cu_seqlens_k = reinterpret_cast<const int*>(a.cu_seqlens_k);
            p.seqused_k = reinterpret_cast<const int*>(a.seqused_k);
        }

        if (!tma) return kernel.value()->launch(p, nullptr, stream, a.workspace);
        if (kernel.value()->transposes_v() && (a.workspace == 0 || a.workspace % FAGEN_ALIGNMENT_BYTES != 0)) {
            return Status::error("fagen: an e4m3 forward needs a 16-byte aligned workspace of " +
                                 std::to_string(vt_workspace_bytes(a.batch, a.heads_kv, a.value_dim(), a.seqlen_k)) +
                                 " bytes for V^T (Bundle::forward_workspace_bytes)");
        }
        FagenTmaMaps maps{};
        if (Status s = encode_qkv_maps(&maps.q, &maps.k, &maps.v, a, q, k, v, kernel.value()->info()); !s.ok()) {
            return s;
        }
        if (kernel.value()->transposes_v()) {
            if (Status s = kernel.value()->launch_transpose_v(p, a.value_dim(), a.workspace, stream); !s.ok()) return s;
            return kernel.value()->launch(p, &maps, stream);
        }
        return kernel.value()->launch(p, &maps, stream, a.workspace);
    }

    // The kernel a forward of `a` under `mask` runs (its key: forward_key).
    Result<const Kernel*> forward_kernel(const Attention& a, const CallMask& mask) {
        return kernel(forward_key(a.dtype, a.head_dim, a.variant(mask), a.head_dim_v, a.varlen() ? "varlen" : "dense"),
                      a.seqlen_k);
    }

    // Bytes of the workspace (Attention::workspace) a forward of `a` needs: an e4m3 forward's
    // V^T (contract.h: vt_workspace_bytes), else the selected kernel's (FA1's fp32 rows; 0: none).
    Result<size_t> forward_workspace_bytes(const Attention& a) {
        if (a.dtype == DType::e4m3) {
            return static_cast<size_t>(vt_workspace_bytes(a.batch, a.heads_kv, a.value_dim(), a.seqlen_k));
        }
        const Result<CallMask> mask = a.mask();
        if (!mask.ok()) return mask.status();
        auto kernel = forward_kernel(a, mask.value());
        if (!kernel.ok()) return kernel.status();
        FagenFwdParams p{};
        p.seqlen_q = a.seqlen_q;
        p.heads_q = a.heads_q;
        p.batch = a.batch;
        return kernel.value()->workspace_bytes(p);
    }

    // The split count a KV-cache call of `a` runs (num_splits, else split_count from the shapes
    // and the device's SMs: the same for every call of these shapes, e.g. a graph's replays).
    Result<int> kvcache_splits(const KvCacheAttention& a) {
        if (a.num_splits < 0 || a.num_splits > FAGEN_MAX_SPLITS) {
            return Status::error("fagen: num_splits=" + std::to_string(a.num_splits) + ": 0 (chosen) or 1.." +
                                 std::to_string(FAGEN_MAX_SPLITS));
        }
        if (a.num_splits > 0) return a.num_splits;
        auto kernel = kvcache_kernel(a);
        if (!kernel.ok()) return kernel.status();
        if (kernel.value()->info().grid != FAGEN_GRID_SPLITS) return 1;  // a tile kernel (a prefill)
        auto sms = Kernel::multiprocessor_count();
        if (!sms.ok()) return sms.status();
        const FagenKernelInfo& info = kernel.value()->info();
        const GridDims one = grid_dims(info.grid, info.block_m, info.block_n, a.seqlen_q, a.heads_q, a.batch, 0,
                                       a.seqlen_k, a.heads_kv, 1);
        return split_count(one.y * one.z, a.seqlen_k, sms.value(), info.min_split_keys);
    }
    // Bytes of the fp32 workspace a KV-cache call of `a` needs (contract.h: split_workspace).
    Result<size_t> kvcache_workspace_bytes(const KvCacheAttention& a) {
        auto splits = kvcache_splits(a);
        if (!splits.ok()) return splits.status();
        return sizeof(float) *
               static_cast<size_t>(split_workspace(splits.value(), a.batch, a.seqlen_q, a.heads_q, a.value_dim()).floats);
    }

    // One attention over a KV cache on `stream` (in the current context), asynchronous: the
    // split-KV kernel, then its combine when the keys are split. Reads no device memory on the
    // host, so a captured launch replays with new cache contents, lengths and block tables.
    Status attention_kvcache(const KvCacheAttention& a, CUstream stream) {
        if (a.batch < 0 || a.seqlen_q < 0 || a.heads_q < 0) return Status::error("fagen: negative size in KvCacheAttention");
        if (Status s = check_cache_element(a); !s.ok()) return s;
        if (a.batch == 0 || a.seqlen_q == 0 || a.heads_q == 0) return Status();
        if (a.seqlen_k <= 0 || a.heads_kv <= 0 || a.heads_q % a.heads_kv != 0) {
            return Status::error("fagen: need a cache of seqlen_k >= 1 keys per row and heads_q (" +
                                 std::to_string(a.heads_q) + ") a multiple of heads_kv (" + std::to_string(a.heads_kv) + ")");
        }
        if (a.cu_seqlens_k != 0 || !a.mask_mod.empty()) {
            return Status::error("fagen: a KV-cache call takes no cu_seqlens_k (its rows' keys: cache_seqlens) and "
                                 "the built-in masks only");
        }
        if (a.block_table != 0 && (a.page_size <= 0 || a.page_size % 16 != 0 || a.pages <= 0 ||
                                   a.block_table_stride * a.page_size < a.seqlen_k)) {
            return Status::error("fagen: a paged cache needs page_size a multiple of 16, pages >= 1 and "
                                 "block_table_stride x page_size >= seqlen_k");
        }
        const std::pair<const char*, CUdeviceptr> arrays[] = {
            {"block_table", a.block_table}, {"cache_seqlens", a.cache_seqlens}, {"cu_seqlens_q", a.cu_seqlens_q}};
        for (const auto& [name, data] : arrays) {
            if (data % 4 != 0) return Status::error(std::string("fagen: ") + name + " must be a 4-byte aligned int32 array");
        }
        if (a.cu_seqlens_q != 0 && a.total_q < a.seqlen_q) {
            return Status::error("fagen: packed q needs total_q (its rows) >= seqlen_q (the longest row's tokens)");
        }
        const Result<KernelScale> scale = kernel_score_scale(a.softmax_scale, a.head_dim, a.softcap);
        if (!scale.ok()) return scale.status();
        if (Status s = check_score_arrays(a); !s.ok()) return s;
        const Result<CallMask> mask = kvcache_mask(a);
        if (!mask.ok()) return mask.status();
        auto kernel = kvcache_kernel(a);
        if (!kernel.ok()) return kernel.status();
        auto splits = kvcache_splits(a);
        if (!splits.ok()) return splits.status();
        auto [q, k, v, o] = strides_of(a);
        const bool tiles = kernel.value()->uses_tma();  // a prefill's tile kernel
        if (a.cu_seqlens_q != 0) {  // packed rows: q's checked as its map spans them (fagen/runtime/call.py: _map_tensor)
            q.batch = tiles ? (a.total_q > 1 ? a.total_q : 1) * q.row : 0;
            o.batch = 0;
        }
        if (Status s = check_forward_tensors(a, q, k, v, o, tiles, a.kv_dtype); !s.ok()) return s;
        if (a.cu_seqlens_q != 0) q.batch = 0;
        const SplitWorkspace layout = split_workspace(splits.value(), a.batch, a.seqlen_q, a.heads_q, a.value_dim());
        if (layout.floats > 0 && (a.workspace == 0 || a.workspace % 16 != 0)) {
            return Status::error("fagen: " + std::to_string(splits.value()) + " splits need a 16-byte aligned workspace of " +
                                 std::to_string(sizeof(float) * layout.floats) + " bytes (kvcache_workspace_bytes)");
        }
        FagenFwdParams p = forward_params(a, q, k, v, o, scale.value(), mask.value());
        if (a.cu_seqlens_q != 0) {
            p.lse_batch_stride = 0;
            p.lse_head_stride = a.total_q;
        }
        p.cu_seqlens_q = reinterpret_cast<const int*>(a.cu_seqlens_q);
        p.seqused_k = reinterpret_cast<const int*>(a.cache_seqlens);
        p.block_table = reinterpret_cast<const int*>(a.block_table);
        p.block_table_batch_stride = a.block_table_stride;
        p.page_size = a.block_table != 0 ? a.page_size : 0;
        p.pages = a.block_table != 0 ? a.pages : 0;
        p.num_splits = splits.value();
        float* workspace = reinterpret_cast<float*>(a.workspace);
        p.o_partial = layout.floats > 0 ? workspace + layout.o_partial : nullptr;
        p.lse_partial = layout.floats > 0 ? workspace + layout.lse_partial : nullptr;
        if (Status s = set_new_keys(a, p); !s.ok()) return s;
        if (p.seqlen_new > 0) {
            if (Status s = kernel.value()->launch_append(p, stream); !s.ok()) return s;
        }
        if (tiles) {
            FagenTmaMaps maps{};
            if (Status s = encode_maps(&maps.q, &maps.k, &maps.v, kvcache_map_args(a, q, k, v, kernel.value()->info()));
                !s.ok()) return s;
            return kernel.value()->launch(p, &maps, stream);
        }
        if (Status s = kernel.value()->launch(p, nullptr, stream); !s.ok()) return s;
        return splits.value() > 1 ? kernel.value()->launch_combine(p, stream) : Status();
    }

    // One merge of two attention results on `stream` (in the current context), asynchronous, in
    // the merge entry point of a paged-layout kernel of m.dtype for the current device.
    Status merge_attention_states(const MergeStates& m, CUstream stream) {
        if (m.batch < 0 || m.seqlen < 0 || m.heads < 0 || m.head_dim < 0) {
            return Status::error("fagen: negative size in MergeStates");
        }
        if (m.batch == 0 || m.seqlen == 0 || m.heads == 0) return Status();
        if (m.head_dim % 8 != 0) {
            return Status::error("fagen: head_dim=" + std::to_string(m.head_dim) + ": the merge needs a multiple of 8");
        }
        const Strides contiguous = Strides::contiguous(m.seqlen, m.heads, m.head_dim);
        const std::pair<long long, long long> rows{static_cast<long long>(m.heads) * m.seqlen, m.seqlen};
        const Strides a = m.out_a_strides.value_or(contiguous), b = m.out_b_strides.value_or(contiguous),
                      o = m.out_strides.value_or(contiguous);
        const std::tuple<const char*, CUdeviceptr, const Strides*> outs[] = {
            {"out_a", m.out_a, &a}, {"out_b", m.out_b, &b}, {"out", m.out, &o}};
        for (const auto& [name, data, strides] : outs) {
            if (Status s = tensor_status(name, data, *strides, false, m.dtype); !s.ok()) return s;
        }
        if (m.lse_a == 0 || m.lse_b == 0 || m.lse_a % 4 != 0 || m.lse_b % 4 != 0 || m.lse % 4 != 0) {
            return Status::error("fagen: lse_a and lse_b (and lse, if given) must be 4-byte aligned fp32 arrays");
        }
        auto key = merge_kernel_key(m.dtype);
        if (!key.ok()) return key.status();
        // The split-KV kernel of that key: a paged key is also a prefill's tile kernel (FA4, FA3).
        auto kernel = this->kernel(key.value(), 0, FAGEN_GRID_SPLITS);
        if (!kernel.ok()) return kernel.status();
        const auto la = m.lse_a_strides.value_or(rows), lb = m.lse_b_strides.value_or(rows),
                   lo = m.lse_strides.value_or(rows);
        FagenMergeParams p{};
        p.out_a = reinterpret_cast<const void*>(m.out_a);
        p.lse_a = reinterpret_cast<const float*>(m.lse_a);
        p.out_b = reinterpret_cast<const void*>(m.out_b);
        p.lse_b = reinterpret_cast<const float*>(m.lse_b);
        p.out = reinterpret_cast<void*>(m.out);
        p.lse = reinterpret_cast<float*>(m.lse);
        p.out_a_batch_stride = a.batch, p.out_a_row_stride = a.row, p.out_a_head_stride = a.head;
        p.out_b_batch_stride = b.batch, p.out_b_row_stride = b.row, p.out_b_head_stride = b.head;
        p.out_batch_stride = o.batch, p.out_row_stride = o.row, p.out_head_stride = o.head;
        p.lse_a_batch_stride = la.first, p.lse_a_head_stride = la.second;
        p.lse_b_batch_stride = lb.first, p.lse_b_head_stride = lb.second;
        p.lse_out_batch_stride = lo.first, p.lse_out_head_stride = lo.second;
        p.batch = m.batch, p.seqlen = m.seqlen, p.heads = m.heads, p.head_dim = m.head_dim;
        return kernel.value()->launch_merge(p, stream);
    }

    // Bytes of the fp32 workspace and of the deterministic mode's semaphores a backward of `a`
    // needs (fagen/contract.py, BackwardWorkspace): dQ's accumulator (its rows per head padded
    // to FAGEN_DQ_ACCUM_ROW_ALIGN), rowsum(dO * O) and the LSE in base 2 per query row; one
    // int32 per query block of the main kernel.
    // The workspace's layout (contract.h: backward_workspace, fagen/contract.py's BackwardWorkspace).
    static BackwardWorkspace workspace_layout(const Attention& a, int block_m = 1) {
        if (a.varlen()) return backward_workspace_varlen(a.batch, a.heads_q, a.total_q, a.seqlen_q, a.head_dim, block_m);
        return backward_workspace(a.batch, a.heads_q, a.seqlen_q, a.head_dim, block_m);
    }
    static size_t backward_workspace_bytes(const Attention& a) {
        return sizeof(float) * static_cast<size_t>(workspace_layout(a).floats);
    }
    Result<size_t> backward_semaphore_bytes(const Attention& a) {
        if (Status s = check_element(a, "bwd", a.varlen() ? "varlen" : "dense"); !s.ok()) return s;
        const Result<CallMask> mask = a.mask();
        if (!mask.ok()) return mask.status();
        auto kernel = this->kernel(backward_key(a.dtype, a.head_dim, a.variant(mask.value()), a.head_dim_v,
                                                a.varlen() ? "varlen" : "dense"),
                                   a.seqlen_k);
        if (!kernel.ok()) return kernel.status();
        return sizeof(int) * static_cast<size_t>(workspace_layout(a, kernel.value()->info().block_m).semaphores);
    }

    // dq, dk, dv of one attention on `stream` (in the current context), asynchronous: picks
    // the backward kernel, checks the arguments as attention() does, fills FagenBwdParams and
    // launches the three kernels.
    Status attention_backward(const AttentionBackward& a, CUstream stream) {
        if (Status s = check_element(a, "bwd", a.varlen() ? "varlen" : "dense"); !s.ok()) return s;
        if (a.seqused_k != 0) return Status::error("fagen: seqused_k has no backward (give the keys by cu_seqlens_k)");
        if (Status s = check_varlen(a); !s.ok()) return s;
        if (a.batch <= 0 || a.seqlen_q <= 0 || a.heads_q <= 0 || a.seqlen_k <= 0 || a.heads_kv <= 0 ||
            a.heads_q % a.heads_kv != 0) {
            return Status::error("fagen: the backward needs batch, seqlen_q, seqlen_k >= 1 and heads_q (" +
                                 std::to_string(a.heads_q) + ") a multiple of heads_kv (" + std::to_string(a.heads_kv) +
                                 ")");
        }
        if (Status s = check_grid_limits(a); !s.ok()) return s;
        if (a.lse == 0 || a.workspace == 0) {
            return Status::error("fagen: the backward needs the forward's lse and a workspace of " +
                                 std::to_string(backward_workspace_bytes(a)) + " bytes");
        }
        const Result<KernelScale> scale = kernel_score_scale(a.softmax_scale, a.head_dim, a.softcap);
        if (!scale.ok()) return scale.status();
        if (Status s = check_score_arrays(a); !s.ok()) return s;
        if (a.sinks != 0 && (a.dsinks == 0 || a.dsinks % 4 != 0)) {
            return Status::error("fagen: a backward with sinks needs dsinks, a 4-byte aligned fp32 device array of (" +
                                 std::to_string(a.heads_q) + ",)");
        }
        const Result<CallMask> mask = a.mask();
        if (!mask.ok()) return mask.status();
        if (!a.mask_mod.empty() && a.semaphores != 0) {
            return Status::error("fagen: mask_mod=" + a.mask_mod + ": the deterministic mode takes the built-in masks "
                                 "only (its dQ order follows their key ranges)");
        }
        auto kernel = this->kernel(backward_key(a.dtype, a.head_dim, a.variant(mask.value()), a.head_dim_v,
                                                a.varlen() ? "varlen" : "dense"),
                                   a.seqlen_k);
        if (!kernel.ok()) return kernel.status();
        auto [q, k, v, o] = strides_of(a);
        Strides dout = a.dout_strides.value_or(o);
        Strides dq = a.dq_strides.value_or(q);
        Strides dk = a.dk_strides.value_or(k);
        Strides dv = a.dv_strides.value_or(v);
        if (a.varlen()) {  // packed: no batch stride
            for (Strides* s : {&q, &k, &v, &o, &dout, &dq, &dk, &dv}) s->batch = 0;
        }
        const bool tma = kernel.value()->uses_tma();
        // (name, pointer, strides, read by TMA in a TMA kernel)
        const std::tuple<const char*, CUdeviceptr, Strides, bool> tensors[] = {
            {"q", a.q, q, true}, {"k", a.k, k, true}, {"v", a.v, v, true}, {"out", a.out, o, false},
            {"dout", a.dout, dout, true}, {"dq", a.dq, dq, false}, {"dk", a.dk, dk, false}, {"dv", a.dv, dv, false}};
        for (const auto& [name, data, strides, loaded] : tensors) {
            Strides checked = strides;
            if (a.varlen()) checked.batch = checked.row;  // a packed tensor has no batch stride to check
            if (Status s = check_tensor(name, data, checked, tma && loaded, a.dtype); !s.ok()) return s;
        }
        float* workspace = reinterpret_cast<float*>(a.workspace);
        FagenBwdParams p{};
        p.q = reinterpret_cast<const void*>(a.q);
        p.k = reinterpret_cast<const void*>(a.k);
        p.v = reinterpret_cast<const void*>(a.v);
        p.o = reinterpret_cast<const void*>(a.out);
        p.dout = reinterpret_cast<const void*>(a.dout);
        p.lse = reinterpret_cast<const float*>(a.lse);
        p.dq = reinterpret_cast<void*>(a.dq);
        p.dk = reinterpret_cast<void*>(a.dk);
        p.dv = reinterpret_cast<void*>(a.dv);
        const BackwardWorkspace layout = workspace_layout(a);
        p.dq_accum = workspace + layout.dq_accum;
        p.softmax_d = workspace + layout.softmax_d;
        p.lse_log2 = workspace + layout.lse_log2;
        p.sink_partials = workspace + layout.sink_partials;
        p.dsinks = reinterpret_cast<float*>(a.dsinks);
        p.dq_semaphore = reinterpret_cast<int*>(a.semaphores);
        const std::pair<long long*, const Strides*> strides[] = {
            {&p.q_batch_stride, &q}, {&p.k_batch_stride, &k}, {&p.v_batch_stride, &v}, {&p.o_batch_stride, &o},
            {&p.do_batch_stride, &dout}, {&p.dq_batch_stride, &dq}, {&p.dk_batch_stride, &dk}, {&p.dv_batch_stride, &dv}};
        for (const auto& [field, tensor] : strides) {  // each tensor's (batch, row, head) strides are adjacent
            field[0] = tensor->batch;
            field[1] = tensor->row;
            field[2] = tensor->head;
        }
        fill_problem(p, a, scale.value(), mask.value());
        if (a.varlen()) {
            p.lse_batch_stride = 0;
            p.lse_head_stride = a.total_q;
            p.cu_seqlens_q = reinterpret_cast<const int*>(a.cu_seqlens_q);
            p.cu_seqlens_k = reinterpret_cast<const int*>(a.cu_seqlens_k);
            p.total_q = static_cast<int>(a.total_q);
        }
        p.softmax_scale = a.softmax_scale.has_value() ? *a.softmax_scale
                                                      : static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)));
        if (!tma) return kernel.value()->launch_backward(p, nullptr, stream);
        FagenBwdTmaMaps maps{};
        const FagenKernelInfo& info = kernel.value()->info();
        if (Status s = encode_qkv_maps(&maps.q, &maps.k, &maps.v, a, q, k, v, info); !s.ok()) return s;
        const auto [dout_map, accum_map] =
            bwd_extra_map_args(a, dout, reinterpret_cast<CUdeviceptr>(p.dq_accum), info.tma_q_rows);
        if (Status s = encode_tensor_map(&maps.dout, dout_map); !s.ok()) return s;
        if (Status s = encode_tensor_map(&maps.dq_accum, accum_map); !s.ok()) return s;
        return kernel.value()->launch_backward(p, &maps, stream);
    }

    Bundle(Bundle&&) = default;
    Bundle& operator=(Bundle&&) = default;

    // Unloads the cubins: work launched from this bundle must have finished.
    ~Bundle() {
        if (state_ == nullptr) return;
        auto d = driver();
        if (!d.ok()) return;
        for (auto& entry : state_->kernels) {
            if (entry.second != nullptr && entry.second->library_ != nullptr) d.value()->library_unload(entry.second->library_);
        }
    }

private:
    struct State {
        std::string directory;
        std::vector<std::vector<unsigned char>> images;  // per fagen_kernels row, verified at open
        std::mutex mutex;
        std::map<std::string, std::unique_ptr<Kernel>> kernels;
    };

    explicit Bundle(std::string directory) : state_(std::make_unique<State>()) { state_->directory = std::move(directory); }

    Result<std::vector<unsigned char>> read_verified_cubin(const FagenKernelInfo& info) const {
        const std::string problem = path_problem(info.cubin);
        if (!problem.empty()) {
            return Status::error(std::string("fagen: index.h: kernel ") + info.name + ": cubin '" + info.cubin + "': " +
                                 problem + " (a bundle names files inside itself only); refusing the bundle");
        }
        const std::string path = directory() + "/" + info.cubin;
        if (!detail::inside(directory(), path)) {
            return Status::error("fagen: " + path + ": resolves outside the bundle (through a link); refusing it");
        }
        auto image = detail::read_file(path);
        if (!image.ok()) return Status::error("fagen: cubin listed in index.h is missing: " + image.status().message());
        const std::string digest = sha256_hex(image.value().data(), image.value().size());
        if (image.value().size() != info.size || digest != info.sha256) {
            return Status::error("fagen: " + path + ": checksum mismatch (index.h: " + std::to_string(info.size) +
                                 " bytes, sha256 " + std::string(info.sha256).substr(0, 16) + "…; file: " +
                                 std::to_string(image.value().size()) + " bytes, sha256 " + digest.substr(0, 16) +
                                 "…); the bundle was modified after it was built — refusing to load it");
        }
        return image;
    }

    Result<std::unique_ptr<Kernel>> load(const FagenKernelInfo& info, const Driver& cu) const {
        auto kernel = std::make_unique<Kernel>();
        kernel->info_ = &info;
        kernel->image_ = state_->images[static_cast<size_t>(&info - fagen_kernels)];
        if (Status s = cu.check(cu.library_load_data(&kernel->library_, kernel->image_.data(), nullptr, nullptr, 0, nullptr,
                                                     nullptr, 0),
                                "cuLibraryLoadData");
            !s.ok()) return s;
        if (Status s = cu.check(cu.library_get_kernel(&kernel->kernel_, kernel->library_, info.name),
                                (std::string("cuLibraryGetKernel(") + info.name + ")").c_str());
            !s.ok()) {
            cu.library_unload(kernel->library_);
            return s;
        }
        // A backward: the two kernels beside the main one; a split-KV kernel: its combine.
        std::vector<std::pair<CUkernel*, const char*>> companions;
        if (info.grid == FAGEN_GRID_KEY_BLOCKS) {
            companions = {{&kernel->preprocess_, FAGEN_BWD_PREPROCESS_SUFFIX}, {&kernel->convert_, FAGEN_BWD_CONVERT_SUFFIX}};
        } else if (info.grid == FAGEN_GRID_SPLITS) {
            companions = {{&kernel->combine_, FAGEN_SPLIT_COMBINE_SUFFIX},
                          {&kernel->append_, FAGEN_SPLIT_APPEND_SUFFIX},
                          {&kernel->merge_, FAGEN_SPLIT_MERGE_SUFFIX}};
        } else if (is_paged_key(info.key)) {  // a paged tile kernel (a prefill): its append
            companions = {{&kernel->append_, FAGEN_SPLIT_APPEND_SUFFIX}};
        } else if (is_e4m3_forward_key(info.key)) {  // its V^T
            companions = {{&kernel->transpose_v_, FAGEN_E4M3_VT_SUFFIX}};
        }
        {
            for (const auto& [slot, suffix] : companions) {
                const std::string symbol = std::string(info.name) + suffix;
                if (Status s = cu.check(cu.library_get_kernel(slot, kernel->library_, symbol.c_str()),
                                        ("cuLibraryGetKernel(" + symbol + ")").c_str());
                    !s.ok()) {
                    cu.library_unload(kernel->library_);
                    return s;
                }
            }
        }
        return kernel;
    }

    // The current context's device's compute capability (device 0 if no context is current).
    static Result<std::pair<int, int>> current_compute_capability() {
        auto d = driver();
        if (!d.ok()) return d.status();
        auto device = current_device();
        if (!device.ok()) return device.status();
        int major = 0, minor = 0;
        for (auto [value, attribute] : {std::pair<int*, CUdevice_attribute>{&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR},
                                        {&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR}}) {
            if (Status s = d.value()->check(d.value()->device_get_attribute(value, attribute, device.value()),
                                            "cuDeviceGetAttribute");
                !s.ok()) return s;
        }
        return std::make_pair(major, minor);
    }

    // A KV-cache call's new keys into p (fagen/runtime/kvcache.py: _check_new_keys's rules).
    static Status set_new_keys(const KvCacheAttention& a, FagenFwdParams& p) {
        if (a.seqlen_new < 0) return Status::error("fagen: seqlen_new must be >= 0");
        if (a.seqlen_new == 0) return Status();
        if (a.cache_seqlens == 0) {
            return Status::error("fagen: appending keys needs cache_seqlens (where each row's new keys go)");
        }
        if (a.cu_seqlens_q != 0) return Status::error("fagen: appending keys takes dense q, not packed rows");
        if (a.seqlen_new > a.seqlen_k) {
            return Status::error("fagen: seqlen_new=" + std::to_string(a.seqlen_new) +
                                 " new keys do not fit a cache of seqlen_k=" + std::to_string(a.seqlen_k) + " keys per row");
        }
        const Strides k = a.k_new_strides.value_or(Strides::contiguous(a.seqlen_new, a.heads_kv, a.head_dim));
        const Strides v = a.v_new_strides.value_or(Strides::contiguous(a.seqlen_new, a.heads_kv, a.value_dim()));
        const DType cache_dtype = a.kv_dtype.value_or(a.dtype);
        if (Status s = tensor_status("k_new", a.k_new, k, false, cache_dtype); !s.ok()) return s;
        if (Status s = tensor_status("v_new", a.v_new, v, false, cache_dtype); !s.ok()) return s;
        p.k_new = reinterpret_cast<const void*>(a.k_new);
        p.v_new = reinterpret_cast<const void*>(a.v_new);
        p.k_new_batch_stride = k.batch, p.k_new_row_stride = k.row, p.k_new_head_stride = k.head;
        p.v_new_batch_stride = v.batch, p.v_new_row_stride = v.row, p.v_new_head_stride = v.head;
        p.seqlen_new = a.seqlen_new;
        return Status();
    }

    // The key of a paged-layout kernel of `dtype` that runs on the current device, whose merge
    // entry point serves every head dim (fagen/runtime/merge.py: merge_kernel).
    Result<std::string> merge_kernel_key(DType dtype) const {
        auto cc = current_compute_capability();
        if (!cc.ok()) return cc.status();
        const auto [major, minor] = cc.value();
        const std::string prefix = std::string("fwd/") + dtype_name(dtype) + "/";
        const FagenKernelInfo* best = nullptr;
        for (const FagenKernelInfo& info : fagen_kernels) {
            if (info.grid == FAGEN_GRID_SPLITS && std::string(info.key).rfind(prefix, 0) == 0 &&
                runs_on(info, major, minor) && (best == nullptr || preferred_over(info, *best, 0))) {
                best = &info;
            }
        }
        if (best != nullptr) return std::string(best->key);
        return Status::error("fagen: merge_attention_states runs in a paged-layout kernel's cubin, and bundle " +
                             directory() + " has none of dtype " + dtype_name(dtype) + " for compute capability " +
                             std::to_string(major) + "." + std::to_string(minor) + "; build one, e.g. {fa_version: 2, "
                             "arch: sm" + std::to_string(major) + std::to_string(minor) + ", dtype: " +
                             dtype_name(dtype) + ", head_dim: 128, layout: paged, mask: local}");
    }

    static Status check_grid_limits(const Attention& a) {
        if (a.heads_q > FAGEN_MAX_GRID_YZ || a.batch > FAGEN_MAX_GRID_YZ) {
            return Status::error("fagen: heads_q and batch must each be at most " + std::to_string(FAGEN_MAX_GRID_YZ) +
                                 " (CUDA grid limit)");
        }
        return Status();
    }

    // q, k, v, out strides: the given ones, else contiguous.
    static std::array<Strides, 4> strides_of(const Attention& a) {
        return {a.q_strides.value_or(Strides::contiguous(a.seqlen_q, a.heads_q, a.head_dim)),
                a.k_strides.value_or(Strides::contiguous(a.seqlen_k, a.heads_kv, a.head_dim)),
                a.v_strides.value_or(Strides::contiguous(a.seqlen_k, a.heads_kv, a.value_dim())),
                a.out_strides.value_or(Strides::contiguous(a.seqlen_q, a.heads_q, a.value_dim()))};
    }

    // The band a KV-cache call's kernels take every built-in mask as (contract.py: banded).
    static Result<CallMask> kvcache_mask(const KvCacheAttention& a) {
        const Result<CallMask> mask = call_mask(a.causal, a.window_left, a.window_right, a.seqlen_q, a.seqlen_k);
        if (!mask.ok() || std::string(mask.value().kind) == "local") return mask;
        const int unbounded = a.seqlen_q + a.seqlen_k;
        return CallMask{"local", unbounded, std::string(mask.value().kind) == "causal" ? 0 : unbounded};
    }
    // The kernel of a KV-cache call (fagen/runtime/kvcache.py: select_kvcache): a prefill (rows
    // of FAGEN_PAGED_TILE_MIN_QUERIES query tokens or more, not asked for splits) prefers a tile
    // kernel of the paged layout (FA4's tile grid or FA3's persistent one), anything else the split-KV
    // kernels; either takes the other where the bundle has only that.
    Result<const Kernel*> kvcache_kernel(const KvCacheAttention& a) {
        const Result<CallMask> mask = kvcache_mask(a);
        if (!mask.ok()) return mask.status();
        const std::string dtypes = dtypes_name(dtype_name(a.dtype), a.kv_dtype ? dtype_name(*a.kv_dtype) : "");
        const std::string key = kernel_key("fwd", dtypes.c_str(), a.head_dim, a.variant(mask.value()), a.head_dim_v,
                                           "paged");
        const bool prefill = a.seqlen_q >= FAGEN_PAGED_TILE_MIN_QUERIES && a.num_splits <= 1;
        const int tiles[] = {FAGEN_GRID_PERSISTENT, FAGEN_GRID_TILES};
        std::vector<int> order;
        if (prefill) order.insert(order.end(), std::begin(tiles), std::end(tiles));
        order.push_back(FAGEN_GRID_SPLITS);
        if (!prefill) order.insert(order.end(), std::begin(tiles), std::end(tiles));
        for (int grid : order) {
            auto found = kernel(key, a.seqlen_k, grid);
            if (found.ok()) return found;
        }
        return kernel(key, a.seqlen_k);  // none: the error, saying what the bundle holds
    }

    // A varlen call's offsets and sizes (fagen/runtime/call.py: _check_varlen).
    static Status check_varlen(const Attention& a) {
        if ((a.cu_seqlens_q != 0) != (a.cu_seqlens_k != 0)) {
            return Status::error("fagen: a varlen call needs both cu_seqlens_q and cu_seqlens_k");
        }
        if (!a.varlen()) return Status();
        if (a.cu_seqlens_q % 4 != 0 || a.cu_seqlens_k % 4 != 0 || a.seqused_k % 4 != 0) {
            return Status::error("fagen: cu_seqlens_q, cu_seqlens_k and seqused_k must be 4-byte aligned int32 arrays");
        }
        if (a.total_q < a.seqlen_q || a.total_k < a.seqlen_k) {
            return Status::error("fagen: seqlen_q=" + std::to_string(a.seqlen_q) + " / seqlen_k=" +
                                 std::to_string(a.seqlen_k) + " (the longest sequence's) cannot exceed the packed rows "
                                 "total_q=" + std::to_string(a.total_q) + " / total_k=" + std::to_string(a.total_k));
        }
        return Status();
    }

    // The score modifiers' arrays: fp32, 4-byte aligned (their presence picks the variant).
    static Status check_score_arrays(const Attention& a) {
        const std::pair<const char*, CUdeviceptr> arrays[] = {{"alibi_slopes", a.alibi_slopes}, {"sinks", a.sinks}};
        for (const auto& [name, data] : arrays) {
            if (data % 4 != 0) return Status::error(std::string("fagen: ") + name + " must be a 4-byte aligned fp32 device array");
        }
        return Status();
    }

    // q, k, v (of the call's dtype, k and v of kv_dtype where given; read by TMA in a TMA kernel)
    // and out (of its output dtype) of a forward (a varlen call's packed tensors have no batch
    // stride to check).
    static Status check_forward_tensors(const Attention& a, const Strides& q, const Strides& k, const Strides& v,
                                        const Strides& o, bool tma, std::optional<DType> kv_dtype = std::nullopt) {
        const DType cache_dtype = kv_dtype.value_or(a.dtype);
        const std::tuple<const char*, CUdeviceptr, Strides, bool, DType> tensors[] = {
            {"q", a.q, q, tma, a.dtype}, {"k", a.k, k, tma, cache_dtype}, {"v", a.v, v, tma, cache_dtype},
            {"out", a.out, o, false, output_dtype(a.dtype)}};
        for (const auto& [name, data, strides, loaded, dtype] : tensors) {
            Strides checked = strides;
            if (a.varlen()) checked.batch = checked.row;
            if (Status s = check_tensor(name, data, checked, loaded, dtype); !s.ok()) return s;
        }
        return Status();
    }

    // The element's rules (fagen/runtime/e4m3.py): which e4m3 calls exist, and descales for e4m3
    // calls only.
    static Status check_element(const Attention& a, const char* direction, const char* layout) {
        if (Status s = e4m3_call_status(a, direction, layout); !s.ok()) return s;
        return descales_status(a.dtype, a.descales);
    }
    // The same for a KV-cache call, whose cache may be of another element (kv_dtype).
    static Status check_cache_element(const KvCacheAttention& a) {
        if (Status s = e4m3_call_status(a, "fwd", "paged"); !s.ok()) return s;
        if (a.kv_dtype && *a.kv_dtype != a.dtype) {
            if (Status s = cache_dtype_status(a.dtype, *a.kv_dtype); !s.ok()) return s;
        }
        return descales_status(a.dtype, a.descales, a.kv_dtype);
    }

    // FagenFwdParams of a forward: the tensors, their strides, an e4m3 call's descales and
    // fill_problem's fields.
    static FagenFwdParams forward_params(const Attention& a, const Strides& q, const Strides& k, const Strides& v,
                                         const Strides& o, const KernelScale& scale, const CallMask& mask) {
        FagenFwdParams p{};
        p.q = reinterpret_cast<const void*>(a.q);
        p.k = reinterpret_cast<const void*>(a.k);
        p.v = reinterpret_cast<const void*>(a.v);
        p.o = reinterpret_cast<void*>(a.out);
        p.lse = reinterpret_cast<float*>(a.lse);
        p.q_batch_stride = q.batch; p.q_row_stride = q.row; p.q_head_stride = q.head;
        p.k_batch_stride = k.batch; p.k_row_stride = k.row; p.k_head_stride = k.head;
        p.v_batch_stride = v.batch; p.v_row_stride = v.row; p.v_head_stride = v.head;
        p.o_batch_stride = o.batch; p.o_row_stride = o.row; p.o_head_stride = o.head;
        const Descales& d = a.descales;
        p.q_descale = reinterpret_cast<const float*>(d.q);
        p.k_descale = reinterpret_cast<const float*>(d.k);
        p.v_descale = reinterpret_cast<const float*>(d.v);
        p.q_descale_batch_stride = d.q_batch_stride; p.q_descale_head_stride = d.q_head_stride;
        p.k_descale_batch_stride = d.k_batch_stride; p.k_descale_head_stride = d.k_head_stride;
        p.v_descale_batch_stride = d.v_batch_stride; p.v_descale_head_stride = d.v_head_stride;
        fill_problem(p, a, scale, mask);
        return p;
    }

    // The fields FagenFwdParams and FagenBwdParams share: the LSE's layout (batch, heads_q,
    // seqlen_q contiguous), the sizes, the scale, the mask's window and the score modifiers.
    template <class Params>
    static void fill_problem(Params& p, const Attention& a, const KernelScale& scale, const CallMask& mask) {
        p.lse_batch_stride = static_cast<long long>(a.heads_q) * a.seqlen_q;
        p.lse_head_stride = a.seqlen_q;
        p.batch = a.batch;
        p.heads_q = a.heads_q;
        p.heads_kv = a.heads_kv;
        p.seqlen_q = a.seqlen_q;
        p.seqlen_k = a.seqlen_k;
        p.scale_log2 = scale.scale_log2;
        p.window_left = mask.window_left;
        p.window_right = mask.window_right;
        p.softcap_scale = scale.softcap_scale;
        p.alibi_slopes = reinterpret_cast<const float*>(a.alibi_slopes);
        p.alibi_batch_stride = a.alibi_per_batch ? a.heads_q : 0;
        p.sinks = reinterpret_cast<const float*>(a.sinks);
        p.mask_args = reinterpret_cast<const void*>(a.mask_args);
    }

    static Status check_tensor(const char* name, CUdeviceptr data, const Strides& s, bool tma, DType dtype) {
        return tensor_status(name, data, s, tma, dtype);
    }

    // The Q, K and V maps of a TMA kernel (FagenTmaMaps, FagenBwdTmaMaps): qkv_map_args's.
    static Status encode_qkv_maps(FagenTensorMap* q_map, FagenTensorMap* k_map, FagenTensorMap* v_map,
                                  const Attention& a, const Strides& q, const Strides& k, const Strides& v,
                                  const FagenKernelInfo& info) {
        return encode_maps(q_map, k_map, v_map, qkv_map_args(a, q, k, v, info.tma_q_rows, info.tma_kv_rows));
    }

    // `args` (Q's, K's, V's) into the three maps.
    static Status encode_maps(FagenTensorMap* q_map, FagenTensorMap* k_map, FagenTensorMap* v_map,
                              const std::array<TensorMapArgs, 3>& args) {
        FagenTensorMap* const maps[3] = {q_map, k_map, v_map};
        for (int i = 0; i < 3; ++i) {
            if (Status s = encode_tensor_map(maps[i], args[i]); !s.ok()) return s;
        }
        return Status();
    }

    // cuTensorMapEncodeTiled with tensor_map_args's arguments, into a params.h FagenTensorMap.
    static Status encode_tensor_map(FagenTensorMap* out, const TensorMapArgs& m) {
        auto d = driver();
        if (!d.ok()) return d.status();
        CUtensorMap map;
        Status s = d.value()->check(
            d.value()->tensor_map_encode_tiled(
                &map, m.data_type, m.rank, reinterpret_cast<void*>(m.global_address), m.global_dim, m.global_strides,
                m.box_dim, m.element_strides, m.interleave, m.swizzle, m.l2_promotion, m.oob_fill),
            "cuTensorMapEncodeTiled");
        if (!s.ok()) return s;
        static_assert(sizeof(CUtensorMap) == sizeof(FagenTensorMap), "params.h FagenTensorMap must match CUtensorMap");
        // CUtensorMap is over-aligned in recent cuda.h; FagenTensorMap keeps the 64 bytes the kernels need.
        std::memcpy(out, &map, sizeof(FagenTensorMap));
        return Status();
    }

    std::unique_ptr<State> state_;
};

}  // namespace fagen
