// Paged decode attention on the CPU (AVX2, and AVX-512 where the build has it), float32 or
// bfloat16 caches.
//
// One call per layer replaces the torch path's K gather, score matmul, softmax and weighted V
// sum (attention/torch_backend.py): K and V rows are read in place through the block tables,
// scores and probabilities stay in a per-thread buffer, accumulation is float32. The twin is
// kernels/reference.py's paged_decode_attention.
//
// Decode attention is a memory stream: at a 220-token context one request reads 338 KB of
// float32 K and V per layer (SmolLM2 shapes), more than its share of the weights at C >= 4.
// So the work is cut to stream: a work item is one chunk of whole blocks of one request, all
// heads at once, so a thread reads each block's K (then V) as one contiguous run and
// prefetches the next block's rows while it scores the current one. Contexts are split into
// chunks of ~64 positions (split-K, "flash decoding") so both cores stream even at C=1; the
// chunks' partial sums are merged by their log-sum-exp afterwards. Measured on 2 AVX2
// cores, 30 layers of cold float32 caches, context 220: C=1 123 -> ~71 us a layer, C=16
// 2.0 -> ~0.77 ms (the previous kernel took one (request, KV head) an item: strided rows, one
// item a core at C=1).
//
// On AVX-512 hosts the same work items run `attend_chunk16` (head_dim 32, 64 or 128): 16-lane
// vectors, each K and V element converted once per KV head rather than once per query head,
// 16 positions' scores reduced together, and prefetches spread through the arithmetic (issued
// a tile at a time they stalled on the core's miss buffers). Measured on 2 AMD EPYC cores
// (avx512f, avx512_bf16), 30 layers of bfloat16 caches with scattered blocks: C=16 at context
// 360 ~12.5 -> ~7.5 ms a step (10 -> 17 GB/s), C=32 at context 700 53 -> 29 ms. Same merge,
// same chunking: a request's result still does not depend on the batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

using kvasir_cpu::exp8;
using kvasir_cpu::hsum4_ps;
using kvasir_cpu::hsum_ps;
using kvasir_cpu::load8;
#if defined(__AVX512F__)
using kvasir_cpu::load16;
#endif
using kvasir_cpu::store8;

constexpr int64_t kLine = 64;  // bytes

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t token_stride, block_stride;  // elements
};

constexpr int64_t kTile = 16;  // positions the wide item scores together

// A thread's scratch for the wide item: its positions' row offsets, and the K rows its next
// item starts with (fetched while this item's V is summed, so no item starts cold).
struct ItemScratch {
  int64_t* offsets;
  const char* next_rows[kTile];
  int64_t num_next_rows;
  // The request's query as given (bfloat16 queries only) and the scale: the wide item's
  // bfloat16 dot products take the unscaled query and scale the scores.
  const at::BFloat16* query;
  float scale;
};

template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += kLine) _mm_prefetch(p + off, _MM_HINT_T0);
}

// scores[h * stride + i] = q[h] . K[i, h's KV head] for the `count` positions of one block.
template <typename T>
void score_block(const float* qf, const T* keys, int64_t count, const Shape& s, float* scores,
                 int64_t stride) {
  const int64_t group = s.num_heads / s.num_kv_heads, vecs = s.head_dim / 8;
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) {
      const T* k0 = keys + i * s.token_stride + kvh * s.head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        const float* qh = qf + h * s.head_dim;
        __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
        for (int64_t v = 0; v < vecs; ++v) {
          const __m256 qv = _mm256_loadu_ps(qh + v * 8);
          d0 = _mm256_fmadd_ps(qv, load8(k0 + v * 8), d0);
          d1 = _mm256_fmadd_ps(qv, load8(k0 + s.token_stride + v * 8), d1);
          d2 = _mm256_fmadd_ps(qv, load8(k0 + 2 * s.token_stride + v * 8), d2);
          d3 = _mm256_fmadd_ps(qv, load8(k0 + 3 * s.token_stride + v * 8), d3);
        }
        _mm_storeu_ps(scores + h * stride + i, hsum4_ps(d0, d1, d2, d3));
      }
    }
  }
  for (; i < count; ++i) {
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const T* key = keys + i * s.token_stride + (h / group) * s.head_dim;
      const float* qh = qf + h * s.head_dim;
      __m256 dot = _mm256_setzero_ps();
      for (int64_t v = 0; v < vecs; ++v)
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(qh + v * 8), load8(key + v * 8), dot);
      scores[h * stride + i] = hsum_ps(dot);
    }
  }
}

// In place: row[0, len) -> exp(row - max); returns (max, sum of the exps).
inline std::pair<float, float> softmax_numerators(float* row, int64_t len) {
  float top = -INFINITY;
  for (int64_t i = 0; i < len; ++i) top = std::max(top, row[i]);
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), top8));
    _mm256_storeu_ps(row + i, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  float total = hsum_ps(sum8);
  for (; i < len; ++i) {
    row[i] = std::exp(row[i] - top);
    total += row[i];
  }
  return {top, total};
}

// acc[0, VECS * 8) += sum over the block's positions of p[i] * V[i, kv head][dims].
template <int VECS, typename T>
inline void accumulate_values(const T* values, const float* p, int64_t count,
                              int64_t token_stride, __m256* acc) {
  for (int64_t i = 0; i < count; ++i) {
    const __m256 w = _mm256_set1_ps(p[i]);
    const T* row = values + i * token_stride;
    for (int v = 0; v < VECS; ++v) acc[v] = _mm256_fmadd_ps(w, load8(row + v * 8), acc[v]);
  }
}

// One work item: positions [t0, t1) of one request (t0 on a block edge), every head.
// Writes the unnormalised sums acc[h, D] and each head's (max, sum) for the merge.
template <typename T>
void attend_chunk(const float* qf, const T* k_cache, const T* v_cache, const int32_t* table,
                  int64_t t0, int64_t t1, const Shape& s, float* scores, float* acc, float* top,
                  float* total, ItemScratch& /*the wide item's*/) {
  const int64_t len = t1 - t0, group = s.num_heads / s.num_kv_heads;
  const int64_t row_bytes = s.token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t b0 = t0 / s.block_size, b1 = (t1 + s.block_size - 1) / s.block_size;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * s.block_size, count = std::min(s.block_size, t1 - start);
    const T* keys = k_cache + table[b] * s.block_stride;
    const T* values = v_cache + table[b] * s.block_stride;
    const T* next_keys = b + 1 < b1 ? k_cache + table[b + 1] * s.block_stride : nullptr;
    // This block's V (read after the softmax) and the next block's K (read next): both in
    // flight while this block is scored.
    for (int64_t i = 0; i < count; ++i) {
      prefetch_row(values + i * s.token_stride, row_bytes);
      if (next_keys != nullptr) prefetch_row(next_keys + i * s.token_stride, row_bytes);
    }
    score_block(qf, keys, count, s, scores + (start - t0), len);
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const auto [m, sum] = softmax_numerators(scores + h * len, len);
    top[h] = m;
    total[h] = sum;
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const int64_t kvh = h / group;
    for (int64_t d0 = 0; d0 < s.head_dim; d0 += 64) {
      const int64_t vecs = std::min<int64_t>(8, (s.head_dim - d0) / 8);
      __m256 a[8];
      for (int v = 0; v < 8; ++v) a[v] = _mm256_setzero_ps();
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * s.block_size, count = std::min(s.block_size, t1 - start);
        const T* values = v_cache + table[b] * s.block_stride + kvh * s.head_dim + d0;
        const float* p = scores + h * len + (start - t0);
        if (vecs == 8) accumulate_values<8>(values, p, count, s.token_stride, a);
        else if (vecs == 4) accumulate_values<4>(values, p, count, s.token_stride, a);
        else for (int64_t i = 0; i < count; ++i) {  // head_dim % 64 not in {0, 32}
          const __m256 w = _mm256_set1_ps(p[i]);
          for (int64_t v = 0; v < vecs; ++v)
            a[v] = _mm256_fmadd_ps(w, load8(values + i * s.token_stride + v * 8), a[v]);
        }
      }
      for (int64_t v = 0; v < vecs; ++v) _mm256_storeu_ps(acc + h * s.head_dim + d0 + v * 8, a[v]);
    }
  }
}

// The AVX-512 work item (attend_chunk16), where the build has AVX-512F.
#include "cpu_attention_wide.h"

// out[n, h] = merge of its chunks' (acc, top, total): sum_c e^(top_c - M) acc_c over
// sum_c e^(top_c - M) total_c, M the largest top; zeros for an empty context.
template <typename T>
void merge_chunks(const float* acc, const float* top, const float* total, int64_t first,
                  int64_t num_chunks, int64_t h, const Shape& s, T* out) {
  float m = -INFINITY;
  for (int64_t c = first; c < first + num_chunks; ++c) m = std::max(m, top[c * s.num_heads + h]);
  const int64_t vecs = s.head_dim / 8;
  std::vector<__m256> sum(static_cast<size_t>(vecs), _mm256_setzero_ps());
  float denom = 0.0f;
  for (int64_t c = first; c < first + num_chunks; ++c) {
    const int64_t ch = c * s.num_heads + h;
    if (total[ch] == 0.0f) continue;
    const float w = std::exp(top[ch] - m);
    denom += w * total[ch];
    const __m256 w8 = _mm256_set1_ps(w);
    for (int64_t v = 0; v < vecs; ++v)
      sum[v] = _mm256_fmadd_ps(w8, _mm256_loadu_ps(acc + ch * s.head_dim + v * 8), sum[v]);
  }
  const __m256 inv = _mm256_set1_ps(denom > 0.0f ? 1.0f / denom : 0.0f);
  for (int64_t v = 0; v < vecs; ++v) store8(out + v * 8, _mm256_mul_ps(sum[v], inv));
}

// TQ: the query's and output's type; TC: the caches' (a bfloat16 cache under float32 compute
// halves the bytes this kernel streams).
template <typename TQ, typename TC>
void decode_attention_impl(const TQ* q, const TC* k_cache, const TC* v_cache,
                           const int32_t* block_tables, const int32_t* seq_lens, TQ* out,
                           int64_t num_reqs, const Shape& s, double scale,
                           int64_t chunk_blocks, bool wide) {
  const int64_t chunk_len = chunk_blocks * s.block_size, hd = s.num_heads * s.head_dim;
  using Item = void (*)(const float*, const TC*, const TC*, const int32_t*, int64_t, int64_t,
                        const Shape&, float*, float*, float*, float*, ItemScratch&);
  Item attend = attend_chunk<TC>;
  bool is_wide = false;  // the wide item: it reads ItemScratch (offsets, next rows, query)
#if defined(__AVX512F__)
  if (wide && s.num_heads / s.num_kv_heads <= kMaxGroup16) {
    // bfloat16 queries over bfloat16 caches: the scores as bfloat16 dot products where the
    // host has them (exact products, float32 sums, like the float32 path up to their order).
    constexpr bool kPairs = kHasBf16Dot && std::is_same_v<TQ, at::BFloat16> &&
                            std::is_same_v<TC, at::BFloat16>;
    if (s.head_dim == 32) attend = attend_chunk16<2, TC, kPairs>;
    else if (s.head_dim == 64) attend = attend_chunk16<4, TC, kPairs>;
    else if (s.head_dim == 128) attend = attend_chunk16<8, TC, kPairs>;
    is_wide = attend != attend_chunk<TC>;
  }
#else
  (void)wide;
#endif
  // Work items: (request, chunk of chunk_blocks blocks); an empty context is one empty chunk.
  std::vector<int64_t> first_item(static_cast<size_t>(num_reqs + 1), 0);
  for (int64_t n = 0; n < num_reqs; ++n)
    first_item[n + 1] = first_item[n] + std::max<int64_t>(1, (seq_lens[n] + chunk_len - 1) /
                                                                  chunk_len);
  const int64_t num_items = first_item[num_reqs];
  std::vector<int64_t> item_req(static_cast<size_t>(num_items));
  for (int64_t n = 0; n < num_reqs; ++n)
    for (int64_t i = first_item[n]; i < first_item[n + 1]; ++i) item_req[i] = n;
  std::unique_ptr<float[]> acc(new float[num_items * hd]);
  std::unique_ptr<float[]> top(new float[num_items * s.num_heads]);
  std::unique_ptr<float[]> total(new float[num_items * s.num_heads]);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> scores(new float[s.num_heads * chunk_len]);
    std::unique_ptr<float[]> qf(new float[hd]);
    std::unique_ptr<int64_t[]> offsets(new int64_t[chunk_len]);
    ItemScratch scratch{offsets.get(), {}, 0, nullptr, static_cast<float>(scale)};
    int64_t scaled_req = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item_req[item], c = item - first_item[n];
      if (n != scaled_req) {
        for (int64_t i = 0; i < hd; ++i) qf[i] = static_cast<float>(q[n * hd + i]) * scale;
        if constexpr (std::is_same_v<TQ, at::BFloat16>) scratch.query = q + n * hd;
        scaled_req = n;
      }
      const int64_t t0 = c * chunk_len, t1 = std::min<int64_t>(seq_lens[n], t0 + chunk_len);
      float* item_top = top.get() + item * s.num_heads;
      float* item_total = total.get() + item * s.num_heads;
      if (t1 <= t0) {
        std::fill(item_top, item_top + s.num_heads, -INFINITY);
        std::fill(item_total, item_total + s.num_heads, 0.0f);
        continue;
      }
      scratch.num_next_rows = 0;  // the rows of this thread's next item's first tile
      if (is_wide && item + 1 < end) {
        const int64_t next = item_req[item + 1];
        const int32_t* next_table = block_tables + next * s.max_blocks;
        const int64_t u0 = (item + 1 - first_item[next]) * chunk_len;
        const int64_t u1 = std::min<int64_t>(seq_lens[next], u0 + kTile);
        for (int64_t t = u0; t < u1; ++t)
          scratch.next_rows[scratch.num_next_rows++] = reinterpret_cast<const char*>(
              k_cache + next_table[t / s.block_size] * s.block_stride +
              (t % s.block_size) * s.token_stride);
      }
      attend(qf.get(), k_cache, v_cache, block_tables + n * s.max_blocks, t0, t1, s,
             scores.get(), acc.get() + item * hd, item_top, item_total, scratch);
    }
  });
  at::parallel_for(0, num_reqs * s.num_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / s.num_heads, h = i % s.num_heads;
      merge_chunks(acc.get(), top.get(), total.get(), first_item[n],
                   first_item[n + 1] - first_item[n], h, s, out + n * hd + h * s.head_dim);
    }
  });
}

// Blocks per work item by default: chunks of about 64 positions. Fixed, not derived from the
// batch, so a request's output does not depend on what else is in the batch (the merge order
// of its chunks is its own): greedy decoding gives the same tokens alone and under load. Short
// enough that one request's context keeps both cores busy, long enough that merging is cheap.
constexpr int64_t kChunkPositions = 64;


}  // namespace

namespace kvasir_cpu {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t max_len, double scale,
                            int64_t chunk_blocks, bool wide) {
  // q [N, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [N, B] int32;
  // seq_lens [N] int32, each <= max_len; chunk_blocks: blocks per work item (0: chosen here);
  // wide: the AVX-512 work item where the build has it and the shapes fit (false: AVX2's, to
  // test one against the other) -> [N, H, D]
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: q [N, H, D] and two caches [blocks, block_size, Hkv, D]");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && head_dim % 8 == 0 && num_heads % num_kv_heads == 0,
              "decode_attention: head_dim must match and be a multiple of 8");
  const auto is_supported = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16;
  };
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && is_supported(q.scalar_type()) &&
                  is_supported(k_cache.scalar_type()),
              "decode_attention: q and the caches must each be float32 or bfloat16 (both caches "
              "alike), got ", q.scalar_type(), " and ", k_cache.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == num_reqs &&
                  seq_lens.numel() == num_reqs && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "decode_attention: block_tables [N, B] and seq_lens [N] contiguous int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: caches must be contiguous");
  TORCH_CHECK(chunk_blocks >= 0, "decode_attention: chunk_blocks must be >= 0");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t n = 0; n < num_reqs; ++n)
    TORCH_CHECK(lens[n] >= 0 && lens[n] <= max_len &&
                    lens[n] <= block_tables.size(1) * block_size,
                "decode_attention: seq_lens[", n, "] = ", lens[n], " exceeds max_len ", max_len,
                " or the block table");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (num_reqs == 0) return out;
  const Shape shape{num_heads, num_kv_heads, head_dim, block_size, block_tables.size(1),
                    num_kv_heads * head_dim, block_size * num_kv_heads * head_dim};
  if (chunk_blocks == 0) chunk_blocks = std::max<int64_t>(1, kChunkPositions / block_size);
  auto run = [&](auto q_zero, auto cache_zero) {
    using TQ = decltype(q_zero);
    using TC = decltype(cache_zero);
    decode_attention_impl<TQ, TC>(qc.data_ptr<TQ>(), k_cache.data_ptr<TC>(),
                                  v_cache.data_ptr<TC>(), block_tables.data_ptr<int32_t>(), lens,
                                  out.data_ptr<TQ>(), num_reqs, shape, scale, chunk_blocks,
                                  wide);
  };
  const bool float_q = q.scalar_type() == at::kFloat;
  if (k_cache.scalar_type() == at::kFloat) {
    if (float_q) run(float{}, float{});
    else run(at::BFloat16{}, float{});
  } else {
    if (float_q) run(float{}, at::BFloat16{});
    else run(at::BFloat16{}, at::BFloat16{});
  }
  return out;
}

}  // namespace kvasir_cpu

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor seq_lens, int max_len, float scale, int chunk_blocks=0, bool wide=True) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) {
  lib.impl("decode_attention", &kvasir_cpu::decode_attention);
}
