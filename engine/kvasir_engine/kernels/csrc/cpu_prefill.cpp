// Causal prefill attention of one request on the CPU, bfloat16 queries and caches, with
// AVX512-BF16 dot products: the queries of a prefill chunk (the last Q of a context of L
// positions) against K and V read in place from the paged caches.
//
// The torch path (attention/torch_backend.py `_chunked_attend`) gathers the request's K and V,
// transposes them, and runs per chunk of queries a bias matmul, a softmax and a second matmul:
// scores and probabilities rounded to bfloat16, ~165 GFLOP/s at 500-token prompts on a 2-core
// AVX512-BF16 EPYC, a quarter of a prefill step. Here a work item is one KV head and a tile of
// queries (all the query heads of that KV head: the group's rows share each K and V tile); it
// walks the keys 16 at a time with an online softmax ("flash attention"), all in float32:
//   - the key tile is laid out once in pairs (16 keys x 2 dimensions a vector), so one
//     vdpbf16ps scores a row against all 16 keys; each row's query pairs are broadcast from
//     memory;
//   - probabilities stay float32, and V (converted once per tile) is summed with FMAs;
//   - key tiles past a row block's last query are skipped (the causal half is never computed),
//     masked lanes are exact zeros.
// Scores are exact products summed in float32 (the torch path rounds them to bfloat16), so
// results differ from it within bfloat16 rounding; the float32 SDPA twin is the reference the
// tests compare both against.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

constexpr int64_t kKeys = 16;  // keys a tile

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVASIR_PREFILL_ATTENTION 1

using kvasir_cpu::dpbf16_broadcast;

struct Request {
  const at::BFloat16* q;  // [Q, H, D], rows q_stride apart
  int64_t q_stride;
  const at::BFloat16* k_cache;  // [blocks, block_size, Hkv, D]
  const at::BFloat16* v_cache;
  const int32_t* table;
  int64_t num_queries, first;  // queries sit at positions first .. first + Q - 1
  int64_t num_heads, num_kv_heads, block_size;
  float scale;
  at::BFloat16* out;  // [Q, H, D] contiguous
};

// Per-thread buffers of one work item: the key tile in pairs, the V tile in float32, and the
// running maximum, sum and output of every row.
struct Scratch {
  std::vector<int32_t> key_pairs;  // [D / 2][16]
  std::vector<float> values;       // [16][D]
  std::vector<float> top, total, acc;  // [rows], [rows], [rows][D]
};

// Rows of a work item: (query, head of the group), query-major, kRowBlock<D> of them a block:
// their output vectors fit in registers through the V sum (kRowBlock<D> x D / 16 of them).
template <int D>
constexpr int kRowBlock = D == 32 ? 8 : D == 64 ? 6 : 3;

template <int D>
void prefill_item(const Request& r, int64_t kvh, int64_t q0, int64_t q1, Scratch& s) {
  constexpr int kVecs = D / 16, kPairs = D / 2, kRows = kRowBlock<D>;
  const int64_t group = r.num_heads / r.num_kv_heads, rows = (q1 - q0) * group;
  const int64_t token_stride = r.num_kv_heads * D, block_stride = r.block_size * token_stride;
  s.top.assign(rows, -std::numeric_limits<float>::infinity());
  s.total.assign(rows, 0.0f);
  s.acc.assign(rows * D, 0.0f);
  const int64_t num_keys = r.first + q1;  // the last query sees every key before it
  auto query = [&](int64_t row) {
    return r.q + (q0 + row / group) * r.q_stride + (kvh * group + row % group) * D;
  };
  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeys) {
    const int64_t count = std::min(kKeys, num_keys - k0);
    // The tile's K in pairs and its V in float32; keys past the context are zeros.
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t t = k0 + j;
      if (j >= count) {
        for (int p = 0; p < kPairs; ++p) s.key_pairs[p * kKeys + j] = 0;
        for (int d = 0; d < D; ++d) s.values[j * D + d] = 0.0f;
        continue;
      }
      const int64_t offset = r.table[t / r.block_size] * block_stride +
                             (t % r.block_size) * token_stride + kvh * D;
      int32_t pairs[kPairs];
      std::memcpy(pairs, r.k_cache + offset, sizeof pairs);
      for (int p = 0; p < kPairs; ++p) s.key_pairs[p * kKeys + j] = pairs[p];
      for (int v = 0; v < kVecs; ++v)
        _mm512_storeu_ps(&s.values[j * D + v * 16], kvasir_cpu::load16(r.v_cache + offset + v * 16));
    }
    for (int64_t b0 = 0; b0 < rows; b0 += kRows) {
      const int64_t n = std::min<int64_t>(kRows, rows - b0);
      const int64_t last_position = r.first + q0 + (b0 + n - 1) / group;
      if (k0 > last_position) continue;  // no row of this block sees the tile
      // The block's query rows (a padding row repeats the last: computed, never used).
      const at::BFloat16* q_rows[kRows];
      for (int i = 0; i < kRows; ++i) q_rows[i] = query(b0 + std::min<int64_t>(i, n - 1));
      // Even and odd pairs in two sums: twice the independent chains of dot products (one
      // set kept the tile waiting on vdpbf16ps's latency).
      __m512 score[kRows], odd[kRows];
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) score[i] = odd[i] = _mm512_setzero_ps();
      for (int p = 0; p < kPairs; p += 2) {
        const __m512i kp = _mm512_loadu_si512(&s.key_pairs[p * kKeys]);
        const __m512i kq = _mm512_loadu_si512(&s.key_pairs[(p + 1) * kKeys]);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          dpbf16_broadcast(score[i], kp, q_rows[i] + 2 * p);
          dpbf16_broadcast(odd[i], kq, q_rows[i] + 2 * p + 2);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) score[i] = _mm512_add_ps(score[i], odd[i]);
      // Online softmax: p = e^(score - running max), masked lanes exactly 0.
      float probs[kRows][kKeys];
      __m512 rescale[kRows];
      const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(k0)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                               10, 11, 12, 13, 14, 15));
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        if (i >= n) {
          rescale[i] = _mm512_setzero_ps();
          _mm512_storeu_ps(probs[i], _mm512_setzero_ps());
          continue;
        }
        const int64_t row = b0 + i, position = r.first + q0 + row / group;
        const __mmask16 seen = _mm512_cmple_epi32_mask(
            lanes, _mm512_set1_epi32(static_cast<int32_t>(position)));
        const __m512 x = _mm512_mul_ps(score[i], _mm512_set1_ps(r.scale));
        const float tile_max = _mm512_mask_reduce_max_ps(seen, x);  // key 0 is always seen
        const float top = std::max(s.top[row], tile_max);
        const float alpha = std::exp(s.top[row] - top);  // 0 on the first tile (e^-inf)
        const __m512 p = _mm512_maskz_mov_ps(
            seen, kvasir_cpu::exp16(_mm512_sub_ps(x, _mm512_set1_ps(top))));
        s.total[row] = s.total[row] * alpha + _mm512_reduce_add_ps(p);
        s.top[row] = top;
        rescale[i] = _mm512_set1_ps(alpha);
        _mm512_storeu_ps(probs[i], p);
      }
      // out[row] = out[row] * alpha + sum over the tile's keys of p x V.
      __m512 o[kRows][kVecs];
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v)
          o[i][v] = i < n ? _mm512_mul_ps(_mm512_loadu_ps(&s.acc[(b0 + i) * D + v * 16]),
                                          rescale[i])
                          : _mm512_setzero_ps();
      for (int64_t j = 0; j < count; ++j) {
        __m512 x[kVecs];
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) x[v] = _mm512_loadu_ps(&s.values[j * D + v * 16]);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          const __m512 w = _mm512_set1_ps(probs[i][j]);
#pragma GCC unroll 8
          for (int v = 0; v < kVecs; ++v) o[i][v] = _mm512_fmadd_ps(w, x[v], o[i][v]);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i)
        if (i < n)
#pragma GCC unroll 8
          for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(&s.acc[(b0 + i) * D + v * 16], o[i][v]);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const __m512 inv = _mm512_set1_ps(1.0f / s.total[row]);
    at::BFloat16* dst = r.out + ((q0 + row / group) * r.num_heads + kvh * group + row % group) * D;
    for (int v = 0; v < kVecs; ++v)
      kvasir_cpu::store16(dst + v * 16, _mm512_mul_ps(_mm512_loadu_ps(&s.acc[row * D + v * 16]), inv));
  }
}

template <int D>
void prefill(const Request& r) {
  const int64_t group = r.num_heads / r.num_kv_heads;
  // Queries a work item: ~96 rows (a few KB of running output per row), at least one query.
  const int64_t tile = std::max<int64_t>(1, 96 / group);
  const int64_t tiles = (r.num_queries + tile - 1) / tile, items = r.num_kv_heads * tiles;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    s.key_pairs.resize(D / 2 * kKeys);
    s.values.resize(kKeys * D);
    for (int64_t item = begin; item < end; ++item) {
      // Query tiles in the order first, last, second, second to last, ...: later tiles see
      // more keys, so each thread's contiguous range of items gets a like share of the work.
      const int64_t kvh = item / tiles, k = item % tiles;
      const int64_t t = k % 2 == 0 ? k / 2 : tiles - 1 - k / 2;
      prefill_item<D>(r, kvh, t * tile, std::min(r.num_queries, (t + 1) * tile), s);
    }
  });
}
#endif

}  // namespace

namespace kvasir_cpu {

bool prefill_attention_supported() {
#ifdef KVASIR_PREFILL_ATTENTION
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t seq_len, double scale) {
  // q [Q, H, D] bfloat16 (heads contiguous, any row stride): the queries at positions
  // seq_len - Q .. seq_len - 1 of one request, whose K and V (new tokens included) are in the
  // caches [blocks, block_size, Hkv, D] bfloat16 through block_table [B] int32 -> [Q, H, D]
  TORCH_CHECK(prefill_attention_supported(),
              "prefill_attention: this build of the kernels lacks AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "prefill_attention: q [Q, H, D] and two caches [blocks, block_size, Hkv, D]");
  const int64_t num_queries = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: q and both caches must be bfloat16");
  TORCH_CHECK(k_cache.size(3) == head_dim && (head_dim == 32 || head_dim == 64 || head_dim == 128),
              "prefill_attention: head_dim must be 32, 64 or 128 and match the caches, got ",
              head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0,
              "prefill_attention: query heads must be a multiple of the KV heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim,
              "prefill_attention: q's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "prefill_attention: caches must be contiguous");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt &&
                  block_table.is_contiguous(),
              "prefill_attention: block_table must be contiguous [B] int32");
  TORCH_CHECK(seq_len >= num_queries && seq_len <= block_table.size(0) * block_size,
              "prefill_attention: seq_len ", seq_len, " must be >= Q = ", num_queries,
              " and fit the block table");
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < k_cache.size(0), "prefill_attention: block ",
                table[b], " outside the caches");
  at::Tensor out = at::empty({num_queries, num_heads, head_dim}, q.options());
#ifdef KVASIR_PREFILL_ATTENTION
  if (num_queries == 0) return out;
  const Request r{q.data_ptr<at::BFloat16>(), q.stride(0), k_cache.data_ptr<at::BFloat16>(),
                  v_cache.data_ptr<at::BFloat16>(), table, num_queries, seq_len - num_queries,
                  num_heads, num_kv_heads, block_size, static_cast<float>(scale),
                  out.data_ptr<at::BFloat16>()};
  if (head_dim == 32) prefill<32>(r);
  else if (head_dim == 64) prefill<64>(r);
  else prefill<128>(r);
#endif
  return out;
}

}  // namespace kvasir_cpu

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
          "int seq_len, float scale) -> Tensor");
  lib.def("prefill_attention_supported() -> bool");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) {
  lib.impl("prefill_attention", &kvasir_cpu::prefill_attention);
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CatchAll, lib) {
  lib.impl("prefill_attention_supported", &kvasir_cpu::prefill_attention_supported);
}
