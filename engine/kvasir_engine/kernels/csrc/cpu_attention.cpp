// Paged decode attention on the CPU (AVX2), float32 or bfloat16 caches.
//
// One call per layer replaces the torch path's K gather, score matmul, softmax and weighted V
// sum (attention/torch_backend.py): each request's K and V rows are read in place through its
// block table, scores and probabilities stay in a per-thread buffer, accumulation is float32.
// The twin is kernels/reference.py's paged_decode_attention.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

using kvasir_cpu::exp8;
using kvasir_cpu::hsum4_ps;
using kvasir_cpu::hsum_ps;
using kvasir_cpu::load8;
using kvasir_cpu::store8;

// One query token per request: out[n, h] = softmax(scale * q[n, h] . K[n]) V[n] over the
// request's seq_lens[n] cached positions, read through its block table (no gather copies).
// Work items are (request, KV head): the KV head's G query heads share every K and V load.
template <typename T>
void decode_attention_impl(const T* q, const T* k_cache, const T* v_cache,
                           const int32_t* block_tables, const int32_t* seq_lens, T* out,
                           int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t max_len, double scale) {
  const int64_t group = num_heads / num_kv_heads, vecs = head_dim / 8;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * max_len));
    std::vector<float> qf(static_cast<size_t>(group * head_dim));
    std::vector<__m256> acc(static_cast<size_t>(group * vecs));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / num_kv_heads, kvh = item % num_kv_heads, len = seq_lens[n];
      const int32_t* table = block_tables + n * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] =
              static_cast<float>(q[(n * num_heads + kvh * group + g) * head_dim + d]) * scale;
      // Scores four positions at a time: four independent FMA chains per query head.
      std::vector<float> top(static_cast<size_t>(group), -INFINITY);
      auto key_at = [&](int64_t t) {
        return k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride +
               kvh * head_dim;
      };
      int64_t t = 0;
      for (; t + 4 <= len; t += 4) {
        const T* keys[4] = {key_at(t), key_at(t + 1), key_at(t + 2), key_at(t + 3)};
        for (int64_t g = 0; g < group; ++g) {
          __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                           _mm256_setzero_ps()};
          for (int64_t v = 0; v < vecs; ++v) {
            const __m256 qv = _mm256_loadu_ps(&qf[g * head_dim + v * 8]);
            for (int j = 0; j < 4; ++j) dot[j] = _mm256_fmadd_ps(qv, load8(keys[j] + v * 8), dot[j]);
          }
          _mm_storeu_ps(&scores[g * max_len + t], hsum4_ps(dot[0], dot[1], dot[2], dot[3]));
        }
      }
      for (; t < len; ++t) {
        const T* key = key_at(t);
        for (int64_t g = 0; g < group; ++g) {
          __m256 dot = _mm256_setzero_ps();
          for (int64_t v = 0; v < vecs; ++v)
            dot = _mm256_fmadd_ps(_mm256_loadu_ps(&qf[g * head_dim + v * 8]), load8(key + v * 8),
                                  dot);
          scores[g * max_len + t] = hsum_ps(dot);
        }
      }
      std::vector<float> total(static_cast<size_t>(group), 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        float* row = &scores[g * max_len];
        for (int64_t i = 0; i < len; ++i) top[g] = std::max(top[g], row[i]);
        const __m256 top8 = _mm256_set1_ps(top[g]);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
          const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), top8));
          _mm256_storeu_ps(row + i, p);
          sum8 = _mm256_add_ps(sum8, p);
        }
        total[g] = hsum_ps(sum8);
        for (; i < len; ++i) {
          row[i] = std::exp(row[i] - top[g]);
          total[g] += row[i];
        }
        for (int64_t v = 0; v < vecs; ++v) acc[g * vecs + v] = _mm256_setzero_ps();
      }
      for (int64_t t = 0; t < len; ++t) {
        const T* value = v_cache + table[t / block_size] * block_stride +
                         (t % block_size) * token_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const __m256 p = _mm256_set1_ps(scores[g * max_len + t]);
          for (int64_t v = 0; v < vecs; ++v)
            acc[g * vecs + v] = _mm256_fmadd_ps(p, load8(value + v * 8), acc[g * vecs + v]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m256 inv = _mm256_set1_ps(len > 0 ? 1.0f / total[g] : 0.0f);
        T* o = out + (n * num_heads + kvh * group + g) * head_dim;
        for (int64_t v = 0; v < vecs; ++v) store8(o + v * 8, _mm256_mul_ps(acc[g * vecs + v], inv));
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t max_len, double scale) {
  // q [N, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [N, B] int32;
  // seq_lens [N] int32, each <= max_len -> [N, H, D]
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: q [N, H, D] and two caches [blocks, block_size, Hkv, D]");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && head_dim % 8 == 0 && num_heads % num_kv_heads == 0,
              "decode_attention: head_dim must match and be a multiple of 8");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type()
                  && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "decode_attention: q and caches must all be float32 or all bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == num_reqs &&
                  seq_lens.numel() == num_reqs && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "decode_attention: block_tables [N, B] and seq_lens [N] contiguous int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: caches must be contiguous");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t n = 0; n < num_reqs; ++n)
    TORCH_CHECK(lens[n] >= 0 && lens[n] <= max_len &&
                    lens[n] <= block_tables.size(1) * k_cache.size(1),
                "decode_attention: seq_lens[", n, "] = ", lens[n], " exceeds max_len ", max_len,
                " or the block table");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    decode_attention_impl<T>(qc.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                             block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                             out.data_ptr<T>(), num_reqs, num_heads, num_kv_heads, head_dim,
                             k_cache.size(1), block_tables.size(1), max_len, scale);
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor seq_lens, int max_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) {
  lib.impl("decode_attention", &decode_attention);
}
