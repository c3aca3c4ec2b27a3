// Decoding from a paged KV cache in C++ with a fagen bundle: a server's step, checked.
//
//   fagen_decode_paged [--bundle DIR] [--batch 4] [--heads-q 32] [--heads-kv 8] [--head-dim 128]
//                      [--page-size 16] [--steps 8] [--num-splits 0] [--seed 0] [--tolerance T]
//                      [--fp8-cache 1] [--prefill N]
//
// Each row of the batch holds a prompt of a random length (1 ... 700 keys) in pages of
// --page-size keys, taken from one pool in a random order through a block table (bf16). Then
// --steps decode steps: per row one new token, whose key and value the call appends into the
// row's next page slot and whose query attends to every key of its row, causal
// (Bundle::attention_kvcache: the append, the split-KV kernel and, when it splits the keys, its
// combine). Every step's output is checked against a CPU fp32 reference over the row's keys.
// After the last step, cascade attention: each row's keys as a head (its first pages) and a tail
// (the rest, through a second block table), attended separately and merged
// (Bundle::merge_attention_states), checked against the whole row's output.
// --fp8-cache 1 keeps the cache (and the appended rows) in e4m3 with one descale each for K and
// V (KvCacheAttention::kv_dtype, Descales), the reference over the values they stand for.
// --prefill N first appends N tokens a row whose N queries attend causally (bottom-right): from
// 128 tokens on, the paged layout's tile kernels (FA3 on Hopper) where the bundle has them.
// Exit status: 0 when every step's max error (relative to the reference's largest |value|) is
// within the tolerance, 1 when one is not, 2 when the run could not happen.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "elements.hpp"
#include "fagen/fagen.hpp"

#ifndef FAGEN_DEFAULT_BUNDLE_DIR
#define FAGEN_DEFAULT_BUNDLE_DIR ""
#endif

namespace {

struct Options {
    std::string bundle = FAGEN_DEFAULT_BUNDLE_DIR;
    int batch = 4, heads_q = 32, heads_kv = 8, head_dim = 128, page_size = 16, steps = 8, num_splits = 0;
    bool fp8_cache = false;
    int prefill = 0;
    unsigned seed = 0;
    double tolerance = 1.0 / 64;  // bf16 outputs: a few units in the last place of values near 1
};

bool parse(int argc, char** argv, Options& o) {
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        const char* value = argv[i + 1];
        if (flag == "--bundle") o.bundle = value;
        else if (flag == "--batch") o.batch = std::atoi(value);
        else if (flag == "--heads-q") o.heads_q = std::atoi(value);
        else if (flag == "--heads-kv") o.heads_kv = std::atoi(value);
        else if (flag == "--head-dim") o.head_dim = std::atoi(value);
        else if (flag == "--page-size") o.page_size = std::atoi(value);
        else if (flag == "--steps") o.steps = std::atoi(value);
        else if (flag == "--num-splits") o.num_splits = std::atoi(value);
        else if (flag == "--seed") o.seed = static_cast<unsigned>(std::atoi(value));
        else if (flag == "--tolerance") o.tolerance = std::atof(value);
        else if (flag == "--fp8-cache") o.fp8_cache = std::atoi(value) != 0;
        else if (flag == "--prefill") o.prefill = std::atoi(value);
        else return false;
    }
    return argc % 2 == 1 && !o.bundle.empty() && o.batch > 0 && o.heads_kv > 0 && o.heads_q % o.heads_kv == 0 &&
           o.page_size > 0 && o.page_size % 16 == 0 && o.steps > 0 && o.head_dim > 0 && o.prefill >= 0;
}

int fail(const std::string& message) {
    std::fprintf(stderr, "error: %s\n", message.c_str());
    return 2;
}

// Random bf16 values and their fp32 twins.
void fill_random(std::vector<uint16_t>& bits, std::vector<float>& values, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < bits.size(); ++i) {
        bits[i] = to_bf16(normal(rng));
        values[i] = from_bf16(bits[i]);
    }
}

// K and V elements as stored: bf16, or e4m3 that stand for their values times `descale`.
struct CacheElements {
    bool e4m3 = false;
    float descale = 1.0f;
    size_t bytes_per_element() const { return e4m3 ? 1 : 2; }
    // Random elements (bytes, element_bytes each) and the fp32 values they stand for.
    void fill(std::vector<uint8_t>& bytes, std::vector<float>& values, std::mt19937& rng) const {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (size_t i = 0; i < values.size(); ++i) {
            if (e4m3) {
                bytes[i] = to_e4m3(normal(rng) / descale);
                values[i] = from_e4m3(bytes[i]) * descale;
            } else {
                const uint16_t bits = to_bf16(normal(rng));
                std::memcpy(&bytes[2 * i], &bits, 2);
                values[i] = from_bf16(bits);
            }
        }
    }
};

}  // namespace

// Cascade attention over the cache as the last step left it (`whole`: that step's output, bf16
// bits): each row's first `head_pages` pages and the rest attended separately (the rest through a
// block table shifted by head_pages), merged, compared with `whole`. Returns the max error
// relative to max |whole|.
fagen::Result<double> check_merge(fagen::Bundle& bundle, const fagen::Driver& cu, const fagen::KvCacheAttention& a,
                                  const std::vector<int>& table, const std::vector<int>& lengths, int per_row,
                                  const Options& o, const std::vector<uint16_t>& whole) {
    const int head_pages = std::max(1, *std::min_element(lengths.begin(), lengths.end()) / 2 / o.page_size);
    std::vector<int> head_lengths(o.batch), tail_lengths(o.batch), tail_table(table.size(), 0);
    for (int b = 0; b < o.batch; ++b) {
        head_lengths[b] = std::min(lengths[b], head_pages * o.page_size);
        tail_lengths[b] = lengths[b] - head_lengths[b];
        for (int j = head_pages; j < per_row; ++j) tail_table[size_t(b) * per_row + j - head_pages] = table[size_t(b) * per_row + j];
    }
    const size_t out_bytes = size_t(o.batch) * o.heads_q * o.head_dim * 2, lse_bytes = size_t(o.batch) * o.heads_q * 4;
    fagen::KvCacheAttention head = a, tail = a;
    head.seqlen_new = tail.seqlen_new = 0;  // the last step appended its keys already
    CUdeviceptr merged = 0, tail_table_device = 0;
    const std::pair<CUdeviceptr*, size_t> allocations[] = {
        {&head.out, out_bytes}, {&head.lse, lse_bytes}, {&tail.out, out_bytes}, {&tail.lse, lse_bytes},
        {&head.cache_seqlens, lse_bytes}, {&tail.cache_seqlens, lse_bytes}, {&tail_table_device, table.size() * 4},
        {&merged, out_bytes}};
    for (const auto& [pointer, bytes] : allocations) {
        if (fagen::Status s = cu.check(cu.mem_alloc(pointer, bytes), "cuMemAlloc"); !s.ok()) return s;
    }
    tail.block_table = tail_table_device;
    const std::tuple<CUdeviceptr, const void*, size_t> uploads[] = {
        {head.cache_seqlens, head_lengths.data(), head_lengths.size() * 4},
        {tail.cache_seqlens, tail_lengths.data(), tail_lengths.size() * 4},
        {tail_table_device, tail_table.data(), tail_table.size() * 4}};
    for (const auto& [to, from, bytes] : uploads) {
        if (fagen::Status s = cu.check(cu.memcpy_htod(to, from, bytes), "cuMemcpyHtoD"); !s.ok()) return s;
    }
    if (fagen::Status s = bundle.attention_kvcache(head, nullptr); !s.ok()) return s;
    if (fagen::Status s = bundle.attention_kvcache(tail, nullptr); !s.ok()) return s;
    fagen::MergeStates m;
    m.dtype = a.dtype;
    m.batch = o.batch;
    m.seqlen = 1;
    m.heads = o.heads_q;
    m.head_dim = o.head_dim;
    m.out_a = head.out, m.lse_a = head.lse, m.out_b = tail.out, m.lse_b = tail.lse, m.out = merged;
    if (fagen::Status s = bundle.merge_attention_states(m, nullptr); !s.ok()) return s;
    std::vector<uint16_t> merged_bits(whole.size());
    if (fagen::Status s = cu.check(cu.memcpy_dtoh(merged_bits.data(), merged, out_bytes), "cuMemcpyDtoH(merged)"); !s.ok())
        return s;
    for (const auto& [pointer, bytes] : allocations) cu.mem_free(*pointer);
    double error = 0.0, size = 1e-30;
    for (size_t i = 0; i < whole.size(); ++i) {
        const double want = from_bf16(whole[i]), e = std::fabs(from_bf16(merged_bits[i]) - want);
        error = std::isnan(e) ? INFINITY : std::max(error, e);
        size = std::max(size, std::fabs(want));
    }
    std::printf("merge: head of %d page(s) + tail per row, max error %.3g against the whole rows' output\n",
                head_pages, error / size);
    return error / size;
}

int main(int argc, char** argv) {
    Options o;
    if (!parse(argc, argv, o)) {
        std::fprintf(stderr, "usage: %s [--bundle DIR] [--batch N] [--heads-q N] [--heads-kv N] [--head-dim N] "
                             "[--page-size 16k] [--steps N] [--num-splits N] [--seed N] [--tolerance T] "
                             "[--fp8-cache 0|1] [--prefill N]\n", argv[0]);
        return 2;
    }
    auto bundle = fagen::Bundle::open(o.bundle);
    if (!bundle.ok()) return fail(bundle.status().message());
    auto device = fagen::use_device(0);
    if (!device.ok()) return fail(device.status().message());
    const fagen::Driver& cu = *fagen::driver().value();

    std::mt19937 rng(o.seed);
    std::vector<int> lengths(o.batch);
    std::uniform_int_distribution<int> prompt(1, 700);
    for (int& n : lengths) n = prompt(rng);
    const int capacity = (*std::max_element(lengths.begin(), lengths.end()) + o.prefill + o.steps + o.page_size - 1) /
                         o.page_size * o.page_size;
    const int per_row = capacity / o.page_size, pages = o.batch * per_row + 3;  // spare pages nobody uses
    std::vector<int> table(size_t(o.batch) * per_row);
    std::vector<int> order(pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::copy(order.begin(), order.begin() + table.size(), table.begin());

    const int d = o.head_dim, group = o.heads_q / o.heads_kv;
    const size_t row_elements = size_t(o.heads_kv) * d;  // one key (or value) of every K/V head
    const size_t cache_elements = size_t(pages) * o.page_size * row_elements;
    // e4m3: N(0, 1) samples over 5 / 448, so that e4m3's range covers |x| <= 5 (the rest saturates).
    const CacheElements elements{o.fp8_cache, o.fp8_cache ? 5.0f / 448.0f : 1.0f};
    const size_t element_bytes = elements.bytes_per_element();
    std::vector<uint8_t> k_bytes(cache_elements * element_bytes), v_bytes(cache_elements * element_bytes);
    std::vector<float> k_values(cache_elements), v_values(cache_elements);
    elements.fill(k_bytes, k_values, rng);
    elements.fill(v_bytes, v_values, rng);
    auto slot = [&](int b, int key) {  // element offset of key `key` of row b in the pool
        return (size_t(table[size_t(b) * per_row + key / o.page_size]) * o.page_size + key % o.page_size) * row_elements;
    };

    fagen::KvCacheAttention a;
    a.dtype = fagen::DType::bf16;
    if (o.fp8_cache) a.kv_dtype = fagen::DType::e4m3;
    a.causal = true;
    a.batch = o.batch;
    a.seqlen_q = 1;
    a.seqlen_k = capacity;
    a.heads_q = o.heads_q;
    a.heads_kv = o.heads_kv;
    a.head_dim = d;
    a.page_size = o.page_size;
    a.pages = pages;
    a.block_table_stride = per_row;
    a.num_splits = o.num_splits;
    // The pool as (pages, page_size, heads_kv, d): the "batch" stride of k and v is a page's.
    const fagen::Strides pool{static_cast<long long>(o.page_size) * o.heads_kv * d, static_cast<long long>(o.heads_kv) * d, d};
    a.k_strides = a.v_strides = pool;
    const int most_tokens = std::max(o.prefill, 1);  // new tokens a row in one step
    const size_t q_elements = size_t(o.batch) * most_tokens * o.heads_q * d;
    size_t workspace_bytes = 0;
    for (int tokens : {most_tokens, 1}) {
        a.seqlen_q = tokens;
        auto bytes = bundle->kvcache_workspace_bytes(a);
        if (!bytes.ok()) return fail(bytes.status().message());
        workspace_bytes = std::max(workspace_bytes, bytes.value());
    }
    auto splits = bundle->kvcache_splits(a);  // a decode step's
    if (!splits.ok()) return fail(splits.status().message());
    const size_t new_elements = size_t(o.batch) * most_tokens * row_elements;  // new keys (values)
    CUdeviceptr descales = 0;  // k's, then v's (e4m3)
    const std::pair<CUdeviceptr*, size_t> allocations[] = {
        {&a.q, q_elements * 2}, {&a.out, q_elements * 2}, {&a.k, cache_elements * element_bytes},
        {&a.v, cache_elements * element_bytes}, {&a.block_table, table.size() * 4}, {&a.cache_seqlens, size_t(o.batch) * 4},
        {&a.workspace, std::max<size_t>(workspace_bytes, 16)}, {&a.k_new, new_elements * element_bytes},
        {&a.v_new, new_elements * element_bytes}, {&a.lse, size_t(o.batch) * most_tokens * o.heads_q * 4}, {&descales, 8}};
    for (const auto& [pointer, bytes] : allocations) {
        if (fagen::Status s = cu.check(cu.mem_alloc(pointer, bytes), "cuMemAlloc"); !s.ok()) return fail(s.message());
    }
    const float descale_values[2] = {elements.descale, elements.descale};
    if (o.fp8_cache) a.descales.k = descales, a.descales.v = descales + 4;  // strides 0: one value each
    const fagen::Status setup[] = {
        cu.check(cu.memcpy_htod(a.k, k_bytes.data(), k_bytes.size()), "cuMemcpyHtoD(k)"),
        cu.check(cu.memcpy_htod(a.v, v_bytes.data(), v_bytes.size()), "cuMemcpyHtoD(v)"),
        cu.check(cu.memcpy_htod(descales, descale_values, 8), "cuMemcpyHtoD(descales)"),
        cu.check(cu.memcpy_htod(a.block_table, table.data(), table.size() * 4), "cuMemcpyHtoD(block_table)")};
    for (const fagen::Status& s : setup) {
        if (!s.ok()) return fail(s.message());
    }
    std::printf("fagen_decode_paged: %d rows of %d..%d cached keys, pages of %d (%d in the pool, random order), "
                "%d:%d heads, head_dim %d, bf16 queries over a %s cache; %d split(s)\n",
                o.batch, *std::min_element(lengths.begin(), lengths.end()),
                *std::max_element(lengths.begin(), lengths.end()), o.page_size, pages, o.heads_q, o.heads_kv, d,
                o.fp8_cache ? "e4m3" : "bf16", splits.value());

    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<uint16_t> q_bits(q_elements), out_bits(q_elements);
    std::vector<uint8_t> new_k(new_elements * element_bytes), new_v(new_elements * element_bytes);
    std::vector<float> q_values(q_elements), new_k_values(new_elements), new_v_values(new_elements), probs;
    double worst = 0.0;
    for (int step = 0; step < o.steps + (o.prefill > 0); ++step) {
        // The step's new tokens of every row (the prefill's, then one a step): the call appends
        // their keys and values at the row's length (cache_seqlens, uploaded before the append);
        // the reference's copy goes there too.
        const int tokens = o.prefill > 0 && step == 0 ? o.prefill : 1;
        const size_t step_q = size_t(o.batch) * tokens * o.heads_q * d, step_new = size_t(o.batch) * tokens * row_elements;
        a.seqlen_q = a.seqlen_new = tokens;
        new_k_values.resize(step_new), new_v_values.resize(step_new), q_values.resize(step_q);
        new_k.resize(step_new * element_bytes), new_v.resize(step_new * element_bytes), q_bits.resize(step_q);
        elements.fill(new_k, new_k_values, rng);
        elements.fill(new_v, new_v_values, rng);
        for (int b = 0; b < o.batch; ++b) {
            for (int t = 0; t < tokens; ++t) {
                const size_t at = slot(b, lengths[b] + t), from = (size_t(b) * tokens + t) * row_elements;
                std::copy_n(new_k_values.begin() + from, row_elements, k_values.begin() + at);
                std::copy_n(new_v_values.begin() + from, row_elements, v_values.begin() + at);
            }
        }
        fill_random(q_bits, q_values, rng);
        const std::tuple<CUdeviceptr, const void*, size_t, const char*> uploads[] = {
            {a.q, q_bits.data(), step_q * 2, "cuMemcpyHtoD(q)"},
            {a.k_new, new_k.data(), new_k.size(), "cuMemcpyHtoD(k_new)"},
            {a.v_new, new_v.data(), new_v.size(), "cuMemcpyHtoD(v_new)"},
            {a.cache_seqlens, lengths.data(), lengths.size() * 4, "cuMemcpyHtoD(cache_seqlens)"}};
        for (const auto& [to, from, bytes, what] : uploads) {
            if (fagen::Status s = cu.check(cu.memcpy_htod(to, from, bytes), what); !s.ok()) return fail(s.message());
        }
        for (int& n : lengths) n += tokens;
        if (fagen::Status s = cu.check(cu.memset_d16(a.out, 0x7fc0, step_q), "cuMemsetD16(out)"); !s.ok())
            return fail(s.message());  // NaN first: an element never written fails the check
        if (fagen::Status s = bundle->attention_kvcache(a, nullptr); !s.ok()) return fail(s.message());
        if (fagen::Status s = cu.check(cu.stream_synchronize(nullptr), "cuStreamSynchronize"); !s.ok())
            return fail(s.message());
        out_bits.resize(step_q);
        if (fagen::Status s = cu.check(cu.memcpy_dtoh(out_bits.data(), a.out, step_q * 2), "cuMemcpyDtoH(out)");
            !s.ok()) return fail(s.message());

        double error = 0.0, size = 1e-30;
        for (int b = 0; b < o.batch; ++b) {
            for (int t = 0; t < tokens; ++t) {
                const int seen = lengths[b] - tokens + t + 1;  // causal, bottom-right: keys 0 .. seen - 1
                probs.assign(seen, 0.0f);
                for (int h = 0; h < o.heads_q; ++h) {
                    const size_t qi = ((size_t(b) * tokens + t) * o.heads_q + h) * d, head = size_t(h / group) * d;
                    float top = -INFINITY, total = 0.0f;
                    for (int j = 0; j < seen; ++j) {
                        float dot = 0.0f;
                        for (int c = 0; c < d; ++c) dot += q_values[qi + c] * k_values[slot(b, j) + head + c];
                        top = std::max(top, probs[j] = dot * scale);
                    }
                    for (int j = 0; j < seen; ++j) total += (probs[j] = std::exp(probs[j] - top));
                    for (int c = 0; c < d; ++c) {
                        float want = 0.0f;
                        for (int j = 0; j < seen; ++j) want += probs[j] / total * v_values[slot(b, j) + head + c];
                        const double e = std::fabs(static_cast<double>(from_bf16(out_bits[qi + c])) - want);
                        error = std::isnan(e) ? INFINITY : std::max(error, e);
                        size = std::max(size, std::fabs(static_cast<double>(want)));
                    }
                }
            }
        }
        worst = std::max(worst, error / size);
        std::printf("step %d (%d new token%s a row): max error %.3g (relative to max |reference| %.3g)\n", step,
                    tokens, tokens == 1 ? "" : "s", error / size, size);
    }
    auto merged = check_merge(*bundle, cu, a, table, lengths, per_row, o, out_bits);
    if (!merged.ok()) return fail(merged.status().message());
    for (const auto& [pointer, bytes] : allocations) cu.mem_free(*pointer);
    const bool ok = worst <= o.tolerance && merged.value() <= o.tolerance;
    std::printf("%s: worst step error %.3g, merge error %.3g, tolerance %.3g\n", ok ? "OK" : "FAILED", worst,
                merged.value(), o.tolerance);
    return ok ? 0 : 1;
}
