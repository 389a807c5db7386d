// Causal prefill attention of one request on the CPU, bfloat16 queries and caches, with
// AVX512-BF16 dot products: the queries of a prefill chunk (the last Q of a context of L
// positions) against K and V read in place from the paged caches.
//
// The torch path (attention/torch_backend.py `_chunked_attend`) gathers the request's K and V,
// transposes them, and runs per chunk of queries a bias matmul, a softmax and a second matmul:
// scores and probabilities rounded to bfloat16, ~165 GFLOP/s at 500-token prompts on a 2-core
// AVX512-BF16 EPYC, a quarter of a prefill step. Here a work item is one KV head and a tile of
// queries (all the query heads of that KV head: the group's rows share each K and V tile); it
// walks the keys 32 at a time with an online softmax ("flash attention"):
//   - every K and V tile is laid out once per call, before the work items run: K in pairs of
//     dimensions (16 keys x 2 dimensions a vector), so one vdpbf16ps scores a row against 16
//     keys (each row's query pairs are broadcast from memory); V in pairs of keys, so one
//     vdpbf16ps adds two keys' values, weighted by a pair of probabilities, to 16 dimensions;
//   - scores, the running maximum and the row sums are float32, the softmax in base 2 (a
//     cheap exp2 on the FMA pipes the dot products use); the probabilities enter the V sum
//     rounded to bfloat16, as flash attention multiplies P and V;
//   - key tiles past a row block's last query are skipped (the causal half is never computed),
//     masked lanes are exact zeros.
// At 6,000 keys on a 2-core Zen 5 EPYC: 290 GFLOP/s with 16-key tiles, float32 probabilities,
// exp and a layout per work item; 460-530 GFLOP/s now (the bfloat16 products of a linear layer
// run at ~900). The float32 SDPA twin is the reference the tests compare against.

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

constexpr int64_t kKeys = 32;  // keys a tile: two vectors of scores a row

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVASIR_PREFILL_ATTENTION 1

using kvasir_cpu::dpbf16_broadcast;

// 2^x for 16 floats (lanes that will be masked off may overflow): 2^n by vscalefps, 2^f for f
// in [-1/2, 1/2] by the degree-5 Taylor polynomial of e^(f ln 2), relative error < 3e-6, far
// below the bfloat16 rounding the probabilities take before the V sum. Softmax in base 2 over
// scores scaled by log2(e) is the softmax in base e; 8 operations where exp16 takes 16 (they
// shared the FMA pipes with the dot products: a quarter of the kernel's time at 6,000 keys).
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.3333558e-3f);  // ln2^4 / 24
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));  // ln2^3 / 6
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));  // ln2^2 / 2
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

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

// Per-thread buffers of one work item: the running maximum, sum and output of every row.
struct Scratch {
  std::vector<float> top, total, acc;  // [rows], [rows], [rows][D]
};

// The request's K and V tiles, laid out once per call for every work item to read: per KV
// head and tile of 32 keys, K in pairs of dimensions ([D / 2][32] int32: dimensions 2p, 2p + 1
// of key j), then V in pairs of keys ([16][D] int32: dimension d of keys 2j, 2j + 1).
template <int D>
constexpr int64_t kTileWords = D / 2 * kKeys + kKeys / 2 * D;

// Rows of a work item: (query, head of the group), query-major, kRowBlock<D> of them a block:
// their output vectors fit in registers through the V sum (kRowBlock<D> x D / 16 of them).
template <int D>
constexpr int kRowBlock = D == 32 ? 8 : D == 64 ? 6 : 3;

// Lays out keys k0 .. k0 + count - 1 of KV head kvh (zeros past count): K in pairs of
// dimensions (one vdpbf16ps scores a row against 16 keys), V in pairs of keys (one vdpbf16ps
// adds two keys' values, weighted by a pair of probabilities, to 16 dimensions of a row).
template <int D>
void load_tile(const Request& r, int64_t kvh, int64_t k0, int64_t count, int32_t* key_pairs,
               int32_t* value_pairs) {
  constexpr int kPairs = D / 2;
  const int64_t token_stride = r.num_kv_heads * D, block_stride = r.block_size * token_stride;
  auto offset = [&](int64_t t) {
    return r.table[t / r.block_size] * block_stride + (t % r.block_size) * token_stride + kvh * D;
  };
  for (int64_t j = 0; j < kKeys; ++j) {
    if (j >= count) {
      for (int p = 0; p < kPairs; ++p) key_pairs[p * kKeys + j] = 0;
      continue;
    }
    int32_t pairs[kPairs];
    std::memcpy(pairs, r.k_cache + offset(k0 + j), sizeof pairs);
    for (int p = 0; p < kPairs; ++p) key_pairs[p * kKeys + j] = pairs[p];
  }
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    const int64_t a = 2 * j, b = 2 * j + 1;
    for (int v = 0; v < D / 16; ++v) {
      const __m256i zero = _mm256_setzero_si256();
      const __m256i va = a < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                         r.v_cache + offset(k0 + a) + v * 16))
                                   : zero;
      const __m256i vb = b < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                         r.v_cache + offset(k0 + b) + v * 16))
                                   : zero;
      const __m512i pair = _mm512_or_si512(
          _mm512_cvtepu16_epi32(va), _mm512_slli_epi32(_mm512_cvtepu16_epi32(vb), 16));
      _mm512_storeu_si512(&value_pairs[j * D + v * 16], pair);
    }
  }
}

template <int D>
void prefill_item(const Request& r, const int32_t* tiles, int64_t kvh, int64_t q0, int64_t q1,
                  Scratch& s) {
  constexpr int kVecs = D / 16, kPairs = D / 2, kRows = kRowBlock<D>;
  const int64_t group = r.num_heads / r.num_kv_heads, rows = (q1 - q0) * group;
  s.top.assign(rows, -std::numeric_limits<float>::infinity());
  s.total.assign(rows, 0.0f);
  s.acc.assign(rows * D, 0.0f);
  const int64_t num_keys = r.first + q1;  // the last query sees every key before it
  const float scale2 = r.scale * 1.44269504088896341f;  // scores in base 2: scale x log2(e)
  auto query = [&](int64_t row) {
    return r.q + (q0 + row / group) * r.q_stride + (kvh * group + row % group) * D;
  };
  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeys) {
    const int64_t count = std::min(kKeys, num_keys - k0);
    const int32_t* key_pairs = tiles + (k0 / kKeys) * kTileWords<D>;
    const int32_t* value_pairs = key_pairs + kPairs * kKeys;
    for (int64_t b0 = 0; b0 < rows; b0 += kRows) {
      const int64_t n = std::min<int64_t>(kRows, rows - b0);
      const int64_t last_position = r.first + q0 + (b0 + n - 1) / group;
      if (k0 > last_position) continue;  // no row of this block sees the tile
      // The block's query rows (a padding row repeats the last: computed, never used).
      const at::BFloat16* q_rows[kRows];
      for (int i = 0; i < kRows; ++i) q_rows[i] = query(b0 + std::min<int64_t>(i, n - 1));
      // Scores of keys k0 .. k0 + 15 and k0 + 16 .. k0 + 31: two independent chains a row.
      __m512 lo[kRows], hi[kRows];
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
      for (int p = 0; p < kPairs; ++p) {
        const __m512i kl = _mm512_loadu_si512(&key_pairs[p * kKeys]);
        const __m512i kh = _mm512_loadu_si512(&key_pairs[p * kKeys + 16]);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          dpbf16_broadcast(lo[i], kl, q_rows[i] + 2 * p);
          dpbf16_broadcast(hi[i], kh, q_rows[i] + 2 * p);
        }
      }
      // Online softmax in base 2: p = 2^(score - running max) in float32, masked lanes exactly 0; the
      // row sum is taken in float32, the V sum over the probabilities rounded to bfloat16
      // pairs (as flash attention multiplies P and V).
      alignas(64) at::BFloat16 probs[kRows][kKeys];
      __m512 rescale[kRows];
      const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(k0)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                               10, 11, 12, 13, 14, 15));
      const __m512i lanes_hi = _mm512_add_epi32(lanes, _mm512_set1_epi32(16));
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        if (i >= n) {
          rescale[i] = _mm512_setzero_ps();
          _mm512_store_si512(probs[i], _mm512_setzero_si512());
          continue;
        }
        const int64_t row = b0 + i, position = r.first + q0 + row / group;
        const __m512i where = _mm512_set1_epi32(static_cast<int32_t>(position));
        const __mmask16 seen_lo = _mm512_cmple_epi32_mask(lanes, where);
        const __mmask16 seen_hi = _mm512_cmple_epi32_mask(lanes_hi, where);
        const __m512 xl = _mm512_mul_ps(lo[i], _mm512_set1_ps(scale2));
        const __m512 xh = _mm512_mul_ps(hi[i], _mm512_set1_ps(scale2));
        // A row may see none of the tile (-inf: its running maximum stays).
        const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(
            _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                               seen_lo, xl),
            _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                               seen_hi, xh)));
        const float top = std::max(s.top[row], tile_max);
        // 0 on the first tile (2^-inf), 1 while the maximum stays (most tiles)
        const float alpha = top > s.top[row] ? std::exp2(s.top[row] - top) : 1.0f;
        const __m512 m = _mm512_set1_ps(top);
        const __m512 pl = _mm512_maskz_mov_ps(seen_lo, exp2_16(_mm512_sub_ps(xl, m)));
        const __m512 ph = _mm512_maskz_mov_ps(seen_hi, exp2_16(_mm512_sub_ps(xh, m)));
        s.total[row] = s.total[row] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(pl, ph));
        s.top[row] = top;
        rescale[i] = _mm512_set1_ps(alpha);
        // Keys in order: the 32-bit lane j holds the probabilities of keys 2j and 2j + 1.
        _mm512_store_si512(probs[i], (__m512i)_mm512_cvtne2ps_pbh(ph, pl));
      }
      // out[row] = out[row] * alpha + sum over the tile's key pairs of (p, p') x (V, V').
      __m512 o[kRows][kVecs];
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v)
          o[i][v] = i < n ? _mm512_mul_ps(_mm512_loadu_ps(&s.acc[(b0 + i) * D + v * 16]),
                                          rescale[i])
                          : _mm512_setzero_ps();
      for (int64_t j = 0; 2 * j < count; ++j) {
        __m512i x[kVecs];
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) x[v] = _mm512_loadu_si512(&value_pairs[j * D + v * 16]);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
          for (int v = 0; v < kVecs; ++v) dpbf16_broadcast(o[i][v], x[v], &probs[i][2 * j]);
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
  // Every tile of every KV head laid out once (it used to be once per work item: a sixth of
  // the time at 6,000 keys); the buffer is the calling thread's, kept between calls.
  const int64_t num_keys = r.first + r.num_queries;
  const int64_t num_tiles = (num_keys + kKeys - 1) / kKeys;
  thread_local std::vector<int32_t> buffer;
  buffer.resize(static_cast<size_t>(r.num_kv_heads * num_tiles * kTileWords<D>));
  int32_t* tiles = buffer.data();
  at::parallel_for(0, r.num_kv_heads * num_tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / num_tiles, k0 = (item % num_tiles) * kKeys;
      int32_t* key_pairs = tiles + item * kTileWords<D>;
      load_tile<D>(r, kvh, k0, std::min(kKeys, num_keys - k0), key_pairs,
                   key_pairs + D / 2 * kKeys);
    }
  });
  // Queries a work item: ~96 rows (a few KB of running output per row), at least one query.
  const int64_t tile = std::max<int64_t>(1, 96 / group);
  const int64_t tiles_q = (r.num_queries + tile - 1) / tile, items = r.num_kv_heads * tiles_q;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t item = begin; item < end; ++item) {
      // Query tiles in the order first, last, second, second to last, ...: later tiles see
      // more keys, so each thread's contiguous range of items gets a like share of the work.
      const int64_t kvh = item / tiles_q, k = item % tiles_q;
      const int64_t t = k % 2 == 0 ? k / 2 : tiles_q - 1 - k / 2;
      prefill_item<D>(r, tiles + kvh * num_tiles * kTileWords<D>, kvh, t * tile,
                      std::min(r.num_queries, (t + 1) * tile), s);
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
