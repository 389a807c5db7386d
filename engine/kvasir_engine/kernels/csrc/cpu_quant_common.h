// Shared by the quantized linear layers (cpu_quant.cpp: int8; cpu_quant_int4.cpp: int4):
// activation quantization, the tile dispatch and the thread split. Everything here is inline
// or a template in an unnamed namespace, so each file gets its own copies and the hot loops
// inline exactly as they did when both lived in one file.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

using kvasir_cpu::hsum_i32;
using kvasir_cpu::hsum_ps;

constexpr int64_t kGroup = 32;
constexpr int64_t kRowBlock = 64;  // activation rows per pass over a thread's weight columns
constexpr int64_t kStreamAhead = 1024;  // bytes of weights prefetched ahead by decode (M <= 2)
constexpr int64_t kMaxStreamRows = 2;  // up to this many activation rows stream the weights

// acc + sum over 4-byte groups of u8 * s8 (no overflow for |s8| <= 127: pairs fit int16).
inline __m256i dot_acc(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u8, s8);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8),
                                                 _mm256_set1_epi16(1)));
#endif
}

// 32 floats times inv, rounded half to even (as torch.round), to 32 int8 in order.
inline __m256i quantize32(const float* x, __m256 inv) {
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inv));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), inv));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), inv));
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  // The packs interleave 128-bit lanes; put the eight 4-byte pieces back in order.
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float abs_max(const float* x, int64_t n) {
  __m256 m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  float r = _mm_cvtss_f32(s);
  for (; k < n; ++k) r = std::max(r, std::fabs(x[k]));
  return r;
}

// One span of n <= Kp floats to int8 codes x * inv (zero past n, up to kp).
inline void quantize_span(const float* x, int64_t n, int64_t kp, float inv, int8_t* q) {
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t k = 0;
  for (; k + kGroup <= n; k += kGroup)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), quantize32(x + k, vinv));
  for (; k < n; ++k) q[k] = static_cast<int8_t>(std::nearbyint(x[k] * inv));
  for (; k < kp; ++k) q[k] = 0;
}

// Tiles of up to 4 x 2 outputs (M > 2): every (rows, cols) a tile can be.
#define KVASIR_TILE_CASES(KERNEL, ARGS)                                         \
  switch (rows * 8 + cols) {                                                     \
    case 1 * 8 + 1: KERNEL<1, 1> ARGS; break;                                    \
    case 1 * 8 + 2: KERNEL<1, 2> ARGS; break;                                    \
    case 2 * 8 + 1: KERNEL<2, 1> ARGS; break;                                    \
    case 2 * 8 + 2: KERNEL<2, 2> ARGS; break;                                    \
    case 3 * 8 + 1: KERNEL<3, 1> ARGS; break;                                    \
    case 3 * 8 + 2: KERNEL<3, 2> ARGS; break;                                    \
    case 4 * 8 + 1: KERNEL<4, 1> ARGS; break;                                    \
    case 4 * 8 + 2: KERNEL<4, 2> ARGS; break;                                    \
    default: TORCH_CHECK(false, "cpu_quant: no tile of ", rows, " x ", cols);    \
  }

// Decode: rows(n0, n1) over the weight rows [0, n), split across threads.
template <typename Rows>
void for_each_row_range(int64_t n, Rows rows) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { rows(begin, end); });
}

// Calls tile(m0, rows, n0, cols) over [0, m) x [0, n), columns split across threads.
template <typename Tile>
void for_each_tile(int64_t m, int64_t n, Tile tile) {
  const int64_t mr = 4, nr = 2;
  const int64_t num_col_tiles = (n + nr - 1) / nr;
  at::parallel_for(0, num_col_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t m1 = std::min(m, m0 + kRowBlock);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * nr, cols = std::min(nr, n - n0);
        for (int64_t i = m0; i < m1; i += mr) tile(i, std::min(mr, m1 - i), n0, cols);
      }
    }
  });
}

inline const at::Tensor& checked_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "cpu_quant: x must be [M, ", k, "], got ",
              x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "cpu_quant: x must be on the CPU");
  return x;
}

inline at::Tensor as_float_rows(const at::Tensor& x, int64_t k) {
  return checked_rows(x, k).to(at::kFloat).contiguous();
}


}  // namespace
