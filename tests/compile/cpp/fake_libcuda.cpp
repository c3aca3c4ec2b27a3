// A stand-in libcuda.so.1 for CPU-only tests of fagen.hpp: "device" memory is host memory and a
// "launch" runs a plain attention on the FagenFwdParams it is given (fp16, bf16, or e4m3 with its
// descales and a bf16 output), after checking the launch configuration against the kernel's
// index.h row; tensor maps encode to nothing (the fake launch reads the tensors directly). A
// program that passes its own reference check on top of this has filled the parameters
// (pointers, element strides, scale_log2, descales, sizes) and the grid the way the real kernels
// expect. Only what fagen.hpp and examples/cpp call exists.
//
// With FAKE_RECORD set in the environment it runs nothing and prints, on stdout, the arguments of
// each cuTensorMapEncodeTiled ("map data_type=... rank=... address=... dims=... strides=... box=...
// element_strides=... interleave=... swizzle=... l2_promotion=... oob_fill=...") and of each
// launch ("launch grid=X,Y,Z" and "params HEX", the FagenFwdParams bytes), for
// tests/compile/test_cpp_loader.py to hold to fagen.runtime.call's.
#include <cuda.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fagen/contract.h"
#include "fagen/index.h"
#include "fagen/params.h"

namespace {

struct FakeKernel {
    const FagenKernelInfo* info = nullptr;
    int max_dynamic_smem = 0;
    bool companion = false;
};

FakeKernel kernels[FAGEN_KERNEL_COUNT];
FakeKernel companions[FAGEN_KERNEL_COUNT];  // each kernel's <name>_... entry points, one stand-in
int fake_context = 1;
constexpr int kFakeMultiprocessors = 132;  // an H100's SMs: the size of a persistent grid

bool recording() { return std::getenv("FAKE_RECORD") != nullptr; }

// The element types of a kernel's q, k and v (its key's dtype); the output is bf16 for e4m3.
enum class Element { fp16, bf16, e4m3 };

float load_e4m3(const void* base, long long index) {
    const uint8_t bits = static_cast<const uint8_t*>(base)[index];
    const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;  // 0x7f, 0xff (NaN) never stored here
    const float magnitude = exponent == 0 ? std::ldexp(float(mantissa), -9) : std::ldexp(float(mantissa + 8), exponent - 10);
    return (bits & 0x80) ? -magnitude : magnitude;
}

float load(const void* base, long long index, Element element) {
    if (element == Element::e4m3) return load_e4m3(base, index);
    const bool bf16 = element == Element::bf16;
    uint16_t h;
    std::memcpy(&h, static_cast<const char*>(base) + 2 * index, 2);
    if (bf16) {
        const uint32_t bits = uint32_t(h) << 16;
        float x;
        std::memcpy(&x, &bits, 4);
        return x;
    }
    const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    const float magnitude = exponent == 0 ? std::ldexp(float(mantissa), -24) : std::ldexp(float(mantissa + 1024), exponent - 25);
    return (h & 0x8000) ? -magnitude : magnitude;
}

void store(void* base, long long index, float x, bool bf16) {
    uint16_t h;
    if (bf16) {
        uint32_t bits;
        std::memcpy(&bits, &x, 4);
        h = uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    } else {
        int exponent;
        const float mantissa = std::frexp(std::fabs(x), &exponent);
        h = std::fabs(x) < 6.103515625e-05f ? 0 : uint16_t(((exponent + 14) << 10) + (int(std::nearbyint(mantissa * 2048)) - 1024));
        if (x < 0) h |= 0x8000;
    }
    std::memcpy(static_cast<char*>(base) + 2 * index, &h, 2);
}

// An e4m3 kernel's descale of batch row b and KV head h (params.h; null: 1).
float descale(const float* values, long long batch_stride, long long head_stride, int b, int h) {
    return values == nullptr ? 1.0f : values[b * batch_stride + h * head_stride];
}

void attention(const FagenFwdParams& p, Element element, bool causal, int head_dim) {
    const int group = p.heads_q / p.heads_kv;
    const bool bf16_out = element != Element::fp16;
    float* scores = new float[p.seqlen_k];
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads_q; ++h)
            for (int i = 0; i < p.seqlen_q; ++i) {
                const int kv_head = h / group;
                const float score_descale = descale(p.q_descale, p.q_descale_batch_stride, p.q_descale_head_stride, b, kv_head) *
                                            descale(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride, b, kv_head);
                const float value_descale = descale(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride, b, kv_head);
                const long long q_row = b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride;
                const long long o_row = b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
                const int last = causal ? std::min(p.seqlen_k - 1, i + p.seqlen_k - p.seqlen_q) : p.seqlen_k - 1;
                float top = -INFINITY, total = 0;
                for (int j = 0; j <= last; ++j) {
                    const long long k_row = b * p.k_batch_stride + j * p.k_row_stride + kv_head * p.k_head_stride;
                    float dot = 0;
                    for (int c = 0; c < head_dim; ++c) dot += load(p.q, q_row + c, element) * load(p.k, k_row + c, element);
                    scores[j] = dot * score_descale * p.scale_log2;
                    top = std::fmax(top, scores[j]);
                }
                for (int j = 0; j <= last; ++j) total += (scores[j] = std::exp2(scores[j] - top));
                for (int c = 0; c < head_dim; ++c) {
                    float acc = 0;
                    for (int j = 0; j <= last; ++j) {
                        const long long v_row = b * p.v_batch_stride + j * p.v_row_stride + kv_head * p.v_head_stride;
                        acc += scores[j] * load(p.v, v_row + c, element);
                    }
                    store(p.o, o_row + c, last < 0 ? 0.0f : value_descale * acc / total, bf16_out);
                }
                if (p.lse) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] =
                    last < 0 ? -INFINITY : (top + std::log2(total)) / float(M_LOG2E);
            }
    delete[] scores;
}

CUresult get_error_name(CUresult, const char** text) { *text = "CUDA_ERROR_FAKE"; return CUDA_SUCCESS; }
CUresult get_error_string(CUresult, const char** text) { *text = "rejected by the fake driver"; return CUDA_SUCCESS; }
CUresult init(unsigned) { return CUDA_SUCCESS; }
CUresult device_get(CUdevice* device, int ordinal) { *device = ordinal; return ordinal == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }
CUresult device_get_attribute(int* value, CUdevice_attribute attribute, CUdevice) {
    if (attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) *value = std::atoi(std::getenv("FAKE_CC_MAJOR"));
    else if (attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) *value = std::atoi(std::getenv("FAKE_CC_MINOR"));
    else if (attribute == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) *value = kFakeMultiprocessors;
    else return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
thread_local CUcontext current = nullptr;
CUresult primary_ctx_retain(CUcontext* context, CUdevice) { *context = reinterpret_cast<CUcontext>(&fake_context); return CUDA_SUCCESS; }
CUresult ctx_get_current(CUcontext* context) { *context = current; return CUDA_SUCCESS; }
CUresult ctx_set_current(CUcontext context) { current = context; return CUDA_SUCCESS; }
CUresult ctx_get_device(CUdevice* device) { *device = 0; return current ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }
CUresult library_load_data(CUlibrary* library, const void* image, CUjit_option*, void**, unsigned, CUlibraryOption*, void**, unsigned) {
    *library = reinterpret_cast<CUlibrary>(const_cast<void*>(image));
    return CUDA_SUCCESS;
}
CUresult library_unload(CUlibrary) { return CUDA_SUCCESS; }
// A kernel's companion entry points (<name>_append, <name>_vt, ...) resolve to one stand-in
// whose launches do nothing: the fake records and runs main launches only.
CUresult library_get_kernel(CUkernel* kernel, CUlibrary, const char* name) {
    for (int i = 0; i < FAGEN_KERNEL_COUNT; ++i) {
        const size_t length = std::strlen(fagen_kernels[i].name);
        if (std::strncmp(fagen_kernels[i].name, name, length) == 0 && (name[length] == '\0' || name[length] == '_')) {
            FakeKernel& found = name[length] == '\0' ? kernels[i] : companions[i];
            found.info = &fagen_kernels[i];
            found.companion = name[length] == '_';
            *kernel = reinterpret_cast<CUkernel>(&found);
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}
CUresult kernel_set_attribute(CUfunction_attribute attribute, int value, CUkernel kernel, CUdevice) {
    if (attribute != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_ERROR_INVALID_VALUE;
    reinterpret_cast<FakeKernel*>(kernel)->max_dynamic_smem = value;
    return CUDA_SUCCESS;
}
CUresult launch_kernel_ex(const CUlaunchConfig* config, CUfunction function, void** params, void**) {
    const FakeKernel& kernel = *reinterpret_cast<FakeKernel*>(function);
    if (kernel.companion) return current != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    const FagenKernelInfo& info = *kernel.info;
    const FagenFwdParams& p = *static_cast<const FagenFwdParams*>(params[0]);
    // The grid of a tiles or persistent launch (the shapes forwards on this fake take).
    const long long tiles = (p.seqlen_q + info.block_m - 1) / info.block_m;
    const bool persistent = info.grid == FAGEN_GRID_PERSISTENT;
    const long long grid_x = persistent ? std::min<long long>(tiles * p.heads_q * p.batch, kFakeMultiprocessors) : tiles;
    const bool launch_ok = current != nullptr && int(config->sharedMemBytes) == info.dynamic_smem &&
                           kernel.max_dynamic_smem >= info.dynamic_smem && int(config->blockDimX) == info.threads &&
                           config->blockDimY == 1 && config->blockDimZ == 1 && static_cast<long long>(config->gridDimX) == grid_x &&
                           int(config->gridDimY) == (persistent ? 1 : p.heads_q) &&
                           int(config->gridDimZ) == (persistent ? 1 : p.batch);
    if (!launch_ok) return CUDA_ERROR_INVALID_VALUE;
    if (recording()) {
        std::printf("launch grid=%u,%u,%u\nparams ", config->gridDimX, config->gridDimY, config->gridDimZ);
        for (size_t i = 0; i < sizeof(FagenFwdParams); ++i) std::printf("%02x", static_cast<const unsigned char*>(params[0])[i]);
        std::printf("\n");
        return CUDA_SUCCESS;
    }
    const std::string key = info.key;
    const int head_dim = std::atoi(key.c_str() + key.find("/hd") + 3);
    const Element element = key.find("/e4m3/") != std::string::npos   ? Element::e4m3
                            : key.find("/bf16/") != std::string::npos ? Element::bf16
                                                                      : Element::fp16;
    attention(p, element, key.find("/causal") != std::string::npos, head_dim);
    return CUDA_SUCCESS;
}
CUresult tensor_map_encode_tiled(CUtensorMap*, CUtensorMapDataType data_type, cuuint32_t rank, void* address,
                                 const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                 const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                 CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
                                 CUtensorMapFloatOOBfill oob_fill) {
    if (!recording()) return CUDA_SUCCESS;
    const auto list = [](const auto* values, unsigned count) {
        std::string text;
        for (unsigned i = 0; i < count; ++i) text += (i ? "," : "") + std::to_string(values[i]);
        return text;
    };
    std::printf("map data_type=%d rank=%u address=%" PRIuPTR " dims=%s strides=%s box=%s element_strides=%s "
                "interleave=%d swizzle=%d l2_promotion=%d oob_fill=%d\n",
                static_cast<int>(data_type), static_cast<unsigned>(rank), reinterpret_cast<uintptr_t>(address),
                list(dims, rank).c_str(), list(strides, rank - 1).c_str(), list(box, rank).c_str(),
                list(element_strides, rank).c_str(), static_cast<int>(interleave), static_cast<int>(swizzle),
                static_cast<int>(l2_promotion), static_cast<int>(oob_fill));
    return CUDA_SUCCESS;
}
CUresult mem_alloc(CUdeviceptr* pointer, size_t bytes) {
    *pointer = reinterpret_cast<CUdeviceptr>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
    return CUDA_SUCCESS;
}
CUresult mem_free(CUdeviceptr pointer) { std::free(reinterpret_cast<void*>(pointer)); return CUDA_SUCCESS; }
CUresult memcpy_htod(CUdeviceptr to, const void* from, size_t bytes) { std::memcpy(reinterpret_cast<void*>(to), from, bytes); return CUDA_SUCCESS; }
CUresult memcpy_dtoh(void* to, CUdeviceptr from, size_t bytes) { std::memcpy(to, reinterpret_cast<void*>(from), bytes); return CUDA_SUCCESS; }
CUresult memset_d16(CUdeviceptr to, unsigned short value, size_t count) {
    for (size_t i = 0; i < count; ++i) std::memcpy(reinterpret_cast<char*>(to) + 2 * i, &value, 2);
    return CUDA_SUCCESS;
}
CUresult stream_synchronize(CUstream) { return CUDA_SUCCESS; }

struct Entry { const char* name; int version; void* function; };
const Entry entries[] = {
    {"cuGetErrorName", 6000, (void*)get_error_name}, {"cuGetErrorString", 6000, (void*)get_error_string},
    {"cuInit", 2000, (void*)init}, {"cuDeviceGet", 2000, (void*)device_get},
    {"cuDeviceGetAttribute", 2000, (void*)device_get_attribute}, {"cuDevicePrimaryCtxRetain", 7000, (void*)primary_ctx_retain},
    {"cuCtxGetCurrent", 4000, (void*)ctx_get_current}, {"cuCtxSetCurrent", 4000, (void*)ctx_set_current},
    {"cuCtxGetDevice", 2000, (void*)ctx_get_device}, {"cuLibraryLoadData", 12000, (void*)library_load_data},
    {"cuLibraryUnload", 12000, (void*)library_unload}, {"cuLibraryGetKernel", 12000, (void*)library_get_kernel},
    {"cuKernelSetAttribute", 12000, (void*)kernel_set_attribute}, {"cuLaunchKernelEx", 11060, (void*)launch_kernel_ex},
    {"cuTensorMapEncodeTiled", 12000, (void*)tensor_map_encode_tiled}, {"cuMemAlloc", 3020, (void*)mem_alloc},
    {"cuMemFree", 3020, (void*)mem_free}, {"cuMemcpyHtoD", 3020, (void*)memcpy_htod},
    {"cuMemcpyDtoH", 3020, (void*)memcpy_dtoh}, {"cuMemsetD16", 3020, (void*)memset_d16},
    {"cuStreamSynchronize", 2000, (void*)stream_synchronize},
};

}  // namespace

// The real driver picks the ABI variant by version; here each name exists at one version, and a
// request for any other fails so that a wrong version in fagen.hpp shows up.
extern "C" CUresult cuGetProcAddress_v2(const char* symbol, void** function, int version, cuuint64_t,
                                        CUdriverProcAddressQueryResult* found) {
    for (const Entry& entry : entries) {
        if (std::strcmp(entry.name, symbol) == 0 && entry.version == version) {
            *function = entry.function;
            *found = CU_GET_PROC_ADDRESS_SUCCESS;
            return CUDA_SUCCESS;
        }
    }
    *found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}
