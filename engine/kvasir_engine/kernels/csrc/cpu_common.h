// Helpers shared by the native CPU kernels (AVX2, and AVX-512 where the host has it):
// horizontal sums, float32/bfloat16 loads and stores, e^x.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#ifndef __AVX2__
#error "kvasir's native CPU kernels need AVX2 (the launcher falls back to torch ops without it)"
#endif

namespace kvasir_cpu {

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float32 -> bfloat16 rounded to nearest even, NaN to the quiet NaN 0x7FC0: exactly what
// c10::BFloat16's constructor does one value at a time (that scalar loop made the bfloat16
// row kernels 4-6x slower than their float32 twins).
inline __m128i to_bf16_8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // 32-bit lanes -> 16-bit: pack within each 128-bit half, then bring the halves together.
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
inline void store8(at::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_8(v));
}

// v rounded to T and back to float32 (a no-op for float32): the rounding an eager op's
// output in T goes through before the next op reads it.
template <typename T> inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_8(v)), 16));
  }
}

// e^x (Cephes' expf: range reduction by ln 2, degree-5 polynomial; relative error ~2e-7 over
// the float range, inputs clamped to +-kExpClamp): the constants of exp8 and exp16, which give
// lane for lane the same values.
constexpr float kExpClamp = 88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// e^x for 8 floats.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpClamp)), _mm256_set1_ps(-kExpClamp));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2High), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Low), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int j = 1; j < 6; ++j) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[j]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

#if defined(__AVX512F__)
// The same with 16 lanes (AVX-512 hosts): lane for lane the values of their 8-lane twins.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m256i to_bf16_16(__m512 v) {  // as to_bf16_8
#if defined(__AVX512BF16__)
  // One vcvtneps2bf16: round to nearest even, as below. Where it differs: a NaN stays a NaN
  // with its sign and top payload bits (below: 0x7FC0), and inputs below float32's normal
  // range (|v| < 1.2e-38) become zero where the code below keeps a bfloat16 subnormal.
  return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded,
                                    _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_16(v));
}
template <typename T> inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(v)), 16));
  }
}
inline __m512 exp16(__m512 x) {  // exp8's steps, 16 lanes
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpClamp)), _mm512_set1_ps(-kExpClamp));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Low), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int j = 1; j < 6; ++j) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[j]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(exponent));
}
// The first n lanes (n >= 16: all of them): a store of a last, partial block of 16.
inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
#endif

#if defined(__AVX512BF16__)
// acc += the pair products of w's 16 lanes (bfloat16 pairs) with the pair at x2, broadcast
// from memory (dpbf16_broadcast) or with x's lanes (dpbf16): vdpbf16ps, float32 sums. Written
// out because GCC 12 keeps an array of accumulators updated by _mm512_dpbf16_ps on the stack
// (a load and a store around every product).
inline void dpbf16_broadcast(__m512& acc, __m512i w, const at::BFloat16* x2) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x2)));
}
inline void dpbf16(__m512& acc, __m512i w, __m512i x) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
}
#endif

// The four horizontal sums of a, b, c, d, in that order.
inline __m128 hsum4_ps(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

}  // namespace kvasir_cpu
