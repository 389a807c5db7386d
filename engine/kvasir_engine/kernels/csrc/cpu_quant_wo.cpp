// Weight-only products (the W4A16 / W8A16 checkpoints' scheme): int4 or int8 codes times float
// activations as they are, with no activation quantization, float32 sums.
//
//   int4_linear_wo: packed [N, Kp / 2] uint8 (int4_linear's nibbles: byte j of a group's 16
//     holds element j in its low nibble and element j + 16 in its high one), scale [N, Kp / 32]
//     in the checkpoint's dtype, minimum [N, Kp / 32] float32: weight = scale * code + minimum.
//   int8_linear_wo: rows [N, Kp] int8 plain, scale [N] in the checkpoint's dtype: weight =
//     scale * code.
//
// A weight is what the checkpoint's library dequantizes it to: the product, exact in float32
// (an fma; a bfloat16 scale has 8 significant bits, a code 4 or 8), rounded to the scale's
// dtype (compressed-tensors computes `(q - zp) * scale` in it, vLLM's kernels multiply that);
// then, with bfloat16 activations, to bfloat16 (the compute dtype's weights). The minimum is
// float32 because -scale * (8 + zp) needs up to 13 bits, which float16 and bfloat16 round.
//
// Two paths:
// - streaming (float32 activations, and bfloat16 ones up to kMaxStreamRowsBf16 rows): each
//   thread streams its weight rows, per 4 activation rows, dequantizes a group of 32 in
//   registers (int4: a group's 16 possible weights computed and rounded once, its codes
//   looked up with a permute) and multiplies it with each row, float32 fmas with per-row
//   accumulators summed in one order at the end: a row's output does not depend on M;
// - chunked (bfloat16, more rows: prefill, many streams): each thread dequantizes a chunk of
//   its weight rows into a bfloat16 buffer that stays in its L2 cache and multiplies it with
//   at::mm (one thread each: nested in at::parallel_for), so prefill runs at oneDNN's
//   AVX512-BF16 GEMM speed.
// Vectors are 16 lanes where the build has AVX-512, 8 on AVX2-only hosts.

#include <ATen/ThreadLocalState.h>

#include "cpu_quant_common.h"

namespace {

// bfloat16 activations: above this many rows the chunks through oneDNN's AVX512-BF16 products
// are faster (measured on 2 EPYC cores, the default model's four shapes: 16 rows 0.54 ms
// either way, 64 rows 2.1 ms streamed, 0.97 ms chunked). float32 ones always stream: MKL's
// float32 products over dequantized chunks were slower (256 rows: 9.9 ms against 8.3 ms).
constexpr int64_t kMaxStreamRowsBf16 = 16;
constexpr int64_t kChunkBytes = 512 << 10;  // a thread's dequantized chunk: about its L2 cache

// The vector the kernels work in: 16 lanes where the build has AVX-512, else 8 (AVX2); a
// group of 32 weights is kParts of them.
#if defined(__AVX512F__)
using Vec = __m512;
using VecI = __m512i;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec to_float(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecI as_int(Vec v) { return _mm512_castps_si512(v); }
inline Vec as_float(VecI v) { return _mm512_castsi512_ps(v); }
inline VecI iset(int32_t v) { return _mm512_set1_epi32(v); }
inline VecI iadd(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI iand(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI isrl16(VecI a) { return _mm512_srli_epi32(a, 16); }
inline Vec round_half(Vec v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store_weights(at::BFloat16* p, Vec v) {  // already rounded to bfloat16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(isrl16(as_int(v))));
}
#else
using Vec = __m256;
using VecI = __m256i;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline float vsum(Vec v) { return kvasir_cpu::hsum_ps(v); }
inline Vec to_float(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecI as_int(Vec v) { return _mm256_castps_si256(v); }
inline Vec as_float(VecI v) { return _mm256_castsi256_ps(v); }
inline VecI iset(int32_t v) { return _mm256_set1_epi32(v); }
inline VecI iadd(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI iand(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI isrl16(VecI a) { return _mm256_srli_epi32(a, 16); }
inline Vec round_half(Vec v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store_weights(at::BFloat16* p, Vec v) {  // already rounded to bfloat16
  const __m256i h = isrl16(as_int(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
#endif
constexpr int kParts = kGroup / kLanes;

// To bfloat16, nearest even, kept as float32 (finite weights: no NaN case, unlike
// cpu_common.h's to_bf16_8, and no packing: five integer operations).
inline Vec round_bf16(Vec v) {
  const VecI bits = as_int(v);
  const VecI lsb = iand(isrl16(bits), iset(1));
  const VecI high = iset(static_cast<int32_t>(0xFFFF0000u));
  return as_float(iand(iadd(bits, iadd(lsb, iset(0x7FFF))), high));
}

inline float scale_at(const float* s, int64_t i) { return s[i]; }
inline float scale_at(const at::BFloat16* s, int64_t i) { return static_cast<float>(s[i]); }
inline float scale_at(const at::Half* s, int64_t i) { return _cvtsh_ss(s[i].x); }

// v (exact products) rounded to the scale's dtype S, then to bfloat16 where X16 (bfloat16
// activations): the weights the library's dequantization gives, in the compute dtype.
template <typename S, bool X16>
inline Vec round_weights(Vec v) {
  if constexpr (std::is_same_v<S, at::Half>) v = round_half(v);
  if constexpr (X16 || std::is_same_v<S, at::BFloat16>) v = round_bf16(v);
  return v;
}

// Group g (32 weights) of weight row n as kParts vectors, in k order. A group's 16 possible
// weights are computed and rounded once, into a table its codes index (a permute).
template <typename S, bool X16>
struct Int4Rows {
  const uint8_t* packed;
  const S* scale;
  const float* minimum;
  int64_t kp;

  inline void prefetch(int64_t n, int64_t g) const {
    _mm_prefetch(reinterpret_cast<const char*>(packed + n * (kp / 2) + g * 16 + kStreamAhead),
                 _MM_HINT_T0);
  }
  inline void group(int64_t n, int64_t g, Vec w[kParts]) const {
    const int64_t at = n * (kp / kGroup) + g;
    const Vec d = vset(scale_at(scale, at)), m = vset(minimum[at]);
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + n * (kp / 2) + g * 16));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
#if defined(__AVX512F__)
    const Vec table = round_weights<S, X16>(vfma(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, m));
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(lo), table);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(hi), table);
#else
    const Vec iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const Vec table_lo = round_weights<S, X16>(vfma(iota, d, m));
    const Vec table_hi = round_weights<S, X16>(vfma(_mm256_add_ps(iota, vset(8.0f)), d, m));
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; ++j) {
      const __m256i code = _mm256_cvtepu8_epi32(parts[j]);
      // codes 8..15 (bit 3 set, moved to the sign bit) take the upper table
      w[j] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(table_lo, code),
                              _mm256_permutevar8x32_ps(table_hi, code),
                              as_float(_mm256_slli_epi32(code, 28)));
    }
#endif
  }
};

template <typename S, bool X16>
struct Int8Rows {
  const int8_t* rows;
  const S* scale;
  const float* minimum;  // unused: int8 is symmetric
  int64_t kp;

  inline void prefetch(int64_t n, int64_t g) const {
    _mm_prefetch(reinterpret_cast<const char*>(rows + n * kp + g * kGroup + kStreamAhead),
                 _MM_HINT_T0);
  }
  inline void group(int64_t n, int64_t g, Vec w[kParts]) const {
    const Vec d = vset(scale_at(scale, n));
    const int8_t* p = rows + n * kp + g * kGroup;
    for (int j = 0; j < kParts; ++j) {
#if defined(__AVX512F__)
      const VecI code =
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)));
#else
      const VecI code =
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
#endif
      w[j] = round_weights<S, X16>(vmul(to_float(code), d));
    }
  }
};

// Decode: y[i, n] for n in [n0, n1) and MR activation rows x [MR, Kp] float32 (zero past K).
// A row's sum has kParts accumulators, added in one order at the end whatever MR is.
template <int MR, typename Rows>
void stream_rows(const Rows& rows, const float* x, int64_t kp, float* y, int64_t ldy,
                 int64_t n0, int64_t n1) {
  const int64_t groups = kp / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    Vec acc[MR][kParts];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kParts; ++j) acc[i][j] = vzero();
    for (int64_t g = 0; g < groups; ++g) {
      rows.prefetch(n, g);
      Vec w[kParts];
      rows.group(n, g, w);
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < kParts; ++j)
          acc[i][j] = vfma(w[j], vload(x + i * kp + g * kGroup + kLanes * j), acc[i][j]);
    }
    for (int i = 0; i < MR; ++i) {
      Vec total = acc[i][0];
      for (int j = 1; j < kParts; ++j) total = vadd(total, acc[i][j]);
      y[i * ldy + n] = vsum(total);
    }
  }
}

template <typename Rows>
at::Tensor stream(const Rows& rows, const at::Tensor& x, int64_t n, int64_t k, int64_t kp) {
  const int64_t m = x.size(0);
  at::Tensor xf = at::zeros({m, kp}, x.options().dtype(at::kFloat));
  xf.narrow(1, 0, k).copy_(x);
  at::Tensor y = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for_each_row_range(n, [&](int64_t n0, int64_t n1) {
    for (int64_t i = 0; i < m; i += 4) {
      const float* xi = xp + i * kp;
      float* yi = out + i * n;
      switch (std::min<int64_t>(4, m - i)) {
        case 1: stream_rows<1>(rows, xi, kp, yi, n, n0, n1); break;
        case 2: stream_rows<2>(rows, xi, kp, yi, n, n0, n1); break;
        case 3: stream_rows<3>(rows, xi, kp, yi, n, n0, n1); break;
        default: stream_rows<4>(rows, xi, kp, yi, n, n0, n1); break;
      }
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Prefill in bfloat16: chunks of weight rows dequantized into a [C, Kp] bfloat16 buffer, each
// multiplied with at::mm on the thread that made it.
template <typename Rows>
at::Tensor chunked(const Rows& rows, const at::Tensor& x, int64_t n, int64_t k, int64_t kp) {
  const int64_t m = x.size(0);
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const int64_t per_row = kp * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t cols =
      std::max<int64_t>(16, std::min<int64_t>(256, kChunkBytes / per_row)) / 16 * 16;
  const int64_t num_chunks = (n + cols - 1) / cols;
  // The workers call ATen ops: they take the caller's thread-local state (inference mode above
  // all: y is an inference tensor when the engine runs, and writing it elsewhere is an error).
  const at::ThreadLocalState state;
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    at::Tensor buffer = at::empty({cols, kp}, x.options());
    at::BFloat16* w = buffer.data_ptr<at::BFloat16>();
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * cols, width = std::min(cols, n - n0);
      for (int64_t r = 0; r < width; ++r)
        for (int64_t g = 0; g < kp / kGroup; ++g) {
          Vec v[kParts];
          rows.group(n0 + r, g, v);
          for (int j = 0; j < kParts; ++j)
            store_weights(w + r * kp + g * kGroup + kLanes * j, v[j]);
        }
      const at::Tensor weights = buffer.narrow(0, 0, width).narrow(1, 0, k);
      y.narrow(1, n0, width).copy_(at::mm(xc, weights.t()));
    }
  });
  return y;
}

template <typename S, template <typename, bool> class Rows, typename Codes>
at::Tensor run(const at::Tensor& x, const Codes* codes, const at::Tensor& scale,
               const float* minimum, int64_t n, int64_t k, int64_t kp) {
  const S* s = scale.data_ptr<S>();
  if (x.scalar_type() == at::kBFloat16) {
    const Rows<S, true> rows{codes, s, minimum, kp};
    return x.size(0) <= kMaxStreamRowsBf16 ? stream(rows, x, n, k, kp)
                                           : chunked(rows, x, n, k, kp);
  }
  return stream(Rows<S, false>{codes, s, minimum, kp}, x, n, k, kp);
}

template <template <typename, bool> class Rows, typename Codes>
at::Tensor dispatch(const char* name, const at::Tensor& x, const Codes* codes,
                    const at::Tensor& scale, const float* minimum, int64_t n, int64_t k,
                    int64_t kp) {
  checked_rows(x, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
  switch (scale.scalar_type()) {
    case at::kBFloat16: return run<at::BFloat16, Rows>(x, codes, scale, minimum, n, k, kp);
    case at::kHalf: return run<at::Half, Rows>(x, codes, scale, minimum, n, k, kp);
    default: return run<float, Rows>(x, codes, scale, minimum, n, k, kp);  // checked: float32
  }
}

void check_scale(const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  const auto type = t.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) &&
                  t.sizes() == shape && t.is_contiguous(),
              name, " must be a contiguous ", shape, " float32, bfloat16 or float16 tensor, got ",
              type, " ", t.sizes());
}

void check_kp(const char* name, int64_t kp, int64_t k) {
  TORCH_CHECK(kp % kGroup == 0 && kp >= k && kp - k < kGroup, name, ": Kp = ", kp,
              " must be K = ", k, " rounded up to 32");
}

}  // namespace

namespace kvasir_cpu {

at::Tensor int4_linear_wo(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& minimum, int64_t k) {
  // x [M, K] float32 | bfloat16; packed [N, Kp / 2] uint8; scale [N, Kp / 32] (float32,
  // bfloat16 or float16); minimum [N, Kp / 32] float32 -> [M, N] in x's dtype
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_linear_wo: packed must be a contiguous [N, Kp / 2] uint8 tensor");
  const int64_t n = packed.size(0), kp = 2 * packed.size(1);
  check_kp("int4_linear_wo", kp, k);
  check_scale("int4_linear_wo: scale", scale, {n, kp / kGroup});
  TORCH_CHECK(minimum.scalar_type() == at::kFloat && minimum.sizes() == scale.sizes() &&
                  minimum.is_contiguous(),
              "int4_linear_wo: minimum must be a contiguous [N, Kp / 32] float32 tensor");
  return dispatch<Int4Rows>("int4_linear_wo", x, packed.data_ptr<uint8_t>(), scale,
                            minimum.data_ptr<float>(), n, k, kp);
}

at::Tensor int8_linear_wo(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& scale,
                          int64_t k) {
  // x [M, K] float32 | bfloat16; rows [N, Kp] int8; scale [N] (float32, bfloat16 or float16)
  // -> [M, N] in x's dtype
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kChar && rows.is_contiguous(),
              "int8_linear_wo: rows must be a contiguous [N, Kp] int8 tensor");
  const int64_t n = rows.size(0), kp = rows.size(1);
  check_kp("int8_linear_wo", kp, k);
  check_scale("int8_linear_wo: scale", scale, {n});
  return dispatch<Int8Rows>("int8_linear_wo", x, rows.data_ptr<int8_t>(), scale, nullptr, n, k,
                            kp);
}

}  // namespace kvasir_cpu

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("int4_linear_wo(Tensor x, Tensor packed, Tensor scale, Tensor minimum, int k) -> Tensor");
  lib.def("int8_linear_wo(Tensor x, Tensor rows, Tensor scale, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) {
  lib.impl("int4_linear_wo", &kvasir_cpu::int4_linear_wo);
  lib.impl("int8_linear_wo", &kvasir_cpu::int8_linear_wo);
}
