// int4_linear: Q4_1 weights (groups of 32 along K, a float16 scale and minimum each) against
// activations quantized per group to int8 (Q8_1). The format, the decode streaming and the
// tiles are described at the top of cpu_quant.cpp, which holds int8_linear; both share
// cpu_quant_common.h.

#include "cpu_quant_common.h"

namespace {

void quantize_groups(const float* x, int64_t m, int64_t k, int64_t kp, int8_t* xq, float* xd,
                     float* xsum) {
  const int64_t groups = kp / kGroup;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t start = g * kGroup, n = std::max<int64_t>(0, std::min(kGroup, k - start));
        const float amax = n > 0 ? std::max(abs_max(x + i * k + start, n), 1e-12f) : 1e-12f;
        int8_t* q = xq + i * kp + start;
        quantize_span(x + i * k + start, n, kGroup, 127.0f / amax, q);
        int32_t total = 0;
        for (int64_t j = 0; j < kGroup; ++j) total += q[j];
        xd[i * groups + g] = amax / 127.0f;
        xsum[i * groups + g] = amax / 127.0f * static_cast<float>(total);
      }
    }
  });
}

template <int MR, int NR>
inline void int4_tile(const int8_t* xq, const float* xd, const float* xsum, const uint8_t* w,
                      const uint16_t* wd, const uint16_t* wmin, int64_t kp, float* y,
                      int64_t ldy) {
  const int64_t groups = kp / kGroup;
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[MR][NR];
  float mins[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps(), mins[i][j] = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[NR];
    float d[NR], mn[NR];
    for (int j = 0; j < NR; ++j) {  // prefetch as in int8_tile
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + 2 * NR) * (kp / 2) + g * 16),
                   _MM_HINT_T0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * (kp / 2) + g * 16));
      wv[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
      d[j] = _cvtsh_ss(wd[j * groups + g]);  // float16 scales, as in GGUF's Q4_1 blocks
      mn[j] = _cvtsh_ss(wmin[j * groups + g]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kp + g * kGroup));
      const float dx = xd[i * groups + g], sx = xsum[i * groups + g];
      for (int j = 0; j < NR; ++j) {
        const __m256i dot = dot_acc(_mm256_setzero_si256(), wv[j], xv);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[j] * dx), acc[i][j]);
        mins[i][j] = std::fma(mn[j], sx, mins[i][j]);  // as int4_rows, rounding included
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum_ps(acc[i][j]) + mins[i][j];
}

// Decode: as int8_rows, over Q4_1 rows (codes, then the row's float16 scales and minima).
// Per row, the scales times the activations' group scales are computed eight groups at a time
// first, so the loop over the codes does only the integer dot, one conversion and one FMA a
// group. Every sum runs in int4_tile's order (group after group), so a row's result does not
// depend on how many rows the product had (M-invariant, as the int8 kernels are exactly).
template <int MR>
void int4_rows(const int8_t* xq, const float* xd, const float* xsum, const uint8_t* w,
               const uint16_t* wd, const uint16_t* wmin, int64_t kp, float* y, int64_t ldy,
               int64_t n0, int64_t n1) {
  const int64_t groups = kp / kGroup;
  const __m128i low = _mm_set1_epi8(0x0F);
  std::vector<float> scales(static_cast<size_t>(MR * groups));  // [MR, G]: d[g] * xd[i, g]
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * (kp / 2);
    const uint16_t* d = wd + n * groups;
    const uint16_t* mn = wmin + n * groups;
    float mins[MR];
    for (int i = 0; i < MR; ++i) mins[i] = 0.0f;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g)));
      for (int i = 0; i < MR; ++i)
        _mm256_storeu_ps(&scales[i * groups + g],
                         _mm256_mul_ps(d8, _mm256_loadu_ps(xd + i * groups + g)));
    }
    for (; g < groups; ++g)
      for (int i = 0; i < MR; ++i) scales[i * groups + g] = _cvtsh_ss(d[g]) * xd[i * groups + g];
    for (g = 0; g < groups; ++g) {
      const float mg = _cvtsh_ss(mn[g]);
      for (int i = 0; i < MR; ++i) mins[i] = std::fma(mg, xsum[i * groups + g], mins[i]);
    }
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    for (g = 0; g < groups; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(row + g * 16 + kStreamAhead), _MM_HINT_T0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
      const __m256i wv =
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
      for (int i = 0; i < MR; ++i) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kp + g * kGroup));
        const __m256i dot = dot_acc(_mm256_setzero_si256(), wv, xv);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_broadcast_ss(&scales[i * groups + g]), acc[i]);
      }
    }
    for (int i = 0; i < MR; ++i) y[i * ldy + n] = hsum_ps(acc[i]) + mins[i];
  }
}

}  // namespace

namespace kvasir_cpu {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_min, int64_t k) {
  // x [M, K] float; w [N, Kp / 2] uint8; w_scale, w_min [N, Kp / 32] float16 -> [M, N]
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "int4_linear: w must be a contiguous [N, Kp / 2] uint8 tensor");
  const int64_t n = w.size(0), kp = 2 * w.size(1), groups = kp / kGroup;
  TORCH_CHECK(kp % kGroup == 0 && kp >= k && kp - k < kGroup, "int4_linear: Kp = ", kp,
              " must be K = ", k, " rounded up to 32");
  for (const at::Tensor* t : {&w_scale, &w_min})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == groups && t->is_contiguous(),
                "int4_linear: w_scale and w_min must be [N, Kp / 32] float16");
  const at::Tensor xf = as_float_rows(x, k);
  const int64_t m = xf.size(0);
  at::Tensor y = at::empty({m, n}, xf.options());
  if (m == 0) return y.to(x.scalar_type());
  at::Tensor xq = at::empty({m, kp}, xf.options().dtype(at::kChar));
  at::Tensor xd = at::empty({m, groups}, xf.options());
  at::Tensor xsum = at::empty({m, groups}, xf.options());
  quantize_groups(xf.data_ptr<float>(), m, k, kp, xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                  xsum.data_ptr<float>());
  const int8_t* q = xq.data_ptr<int8_t>();
  const float* d = xd.data_ptr<float>();
  const float* sx = xsum.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto* wd = reinterpret_cast<const uint16_t*>(w_scale.data_ptr<at::Half>());
  const auto* wm = reinterpret_cast<const uint16_t*>(w_min.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  if (m <= kMaxStreamRows) {
    for_each_row_range(n, [&](int64_t n0, int64_t n1) {
      if (m == 1) int4_rows<1>(q, d, sx, wp, wd, wm, kp, out, n, n0, n1);
      else int4_rows<2>(q, d, sx, wp, wd, wm, kp, out, n, n0, n1);
    });
  } else {
    for_each_tile(m, n, [&](int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
      KVASIR_TILE_CASES(int4_tile, (q + m0 * kp, d + m0 * groups, sx + m0 * groups,
                                    wp + n0 * (kp / 2), wd + n0 * groups, wm + n0 * groups, kp,
                                    out + m0 * n + n0, n))
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace kvasir_cpu

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("int4_linear(Tensor x, Tensor w, Tensor w_scale, Tensor w_min, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) { lib.impl("int4_linear", &kvasir_cpu::int4_linear); }
