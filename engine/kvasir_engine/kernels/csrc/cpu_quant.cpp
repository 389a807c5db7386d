// Quantized linear layers for x86 CPUs (AVX2; AVX-512 VNNI / AVX-VNNI when present).
//
// Two weight formats, both multiplied against activations quantized to int8 on the fly, so the
// inner loops are integer dot products of 32 bytes (one vpmaddubsw + vpmaddwd pair, or one
// vpdpbusd with VNNI) instead of eight float FMAs:
//
//   int8_linear: w [N, Kp] int8, one scale per output row (symmetric). Activations get one
//     scale per row: y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] * wq[n, k], exact in int32.
//   int4_linear: w [N, Kp / 2] uint8, 4-bit codes in groups of 32 along K with a float16 scale
//     and minimum each (llama.cpp's Q4_1: w = d * q + mn, q in 0..15); byte j of a group holds
//     element j in its low nibble and element j + 16 in its high one. Activations get one
//     scale per group of 32 (Q8_1): y[m, n] = sum_g d[n,g] * xd[m,g] * dot_g + mn[n,g] * xsum[m,g]
//     where xsum = xd * sum of the group's codes.
//
// Kp is K rounded up to 32; padding weights and activations are zero. Decode (M <= 2) streams
// the weights: each thread walks its output columns one whole weight row after another, a
// single stream the hardware prefetcher follows, plus a software prefetch ~1 KB ahead (measured
// on 2 AVX2 cores, cold weights: the int8 LM head 2.65 -> ~1.7 ms, 30 int4 layers 8.6 -> ~7.5
// ms, 30 int8 layers ~13.5 -> ~8.5 ms, against tiles of four rows read side by side). Larger M reads each weight tile once per
// tile of MR activation rows and reuses it from L1. Work is split over output columns with
// at::parallel_for, i.e. torch's own OpenMP pool (no second pool on the same cores).
// The pure-torch twins in kernels/reference.py compute the same quantities; the tests compare
// against them.

#include "cpu_quant_common.h"

namespace {

// ---- int8 weights, per-row activations ------------------------------------------------------

// Per row: codes xq (and, unless xa is null, |xq|: the unsigned operand of the rows layout's
// dot products) and the scale.
// x is float32 or bfloat16 (widened a row at a time, exactly, into a buffer in L1: the
// same codes as from x.to(float32), without that copy of the whole activation).
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, int8_t* xq, uint8_t* xa,
                   float* xs) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<T, float> ? 0 : static_cast<size_t>(k));
    for (int64_t i = begin; i < end; ++i) {
      const float* row;
      if constexpr (std::is_same_v<T, float>) {
        row = x + i * k;
      } else {
        for (int64_t j = 0; j < k; ++j) widened[j] = static_cast<float>(x[i * k + j]);
        row = widened.data();
      }
      const float amax = std::max(abs_max(row, k), 1e-12f);
      xs[i] = amax / 127.0f;
      quantize_span(row, k, kp, 127.0f / amax, xq + i * kp);
      if (xa == nullptr) continue;
      for (int64_t j = 0; j < kp; j += 32) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kp + j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xa + i * kp + j), _mm256_abs_epi8(v));
      }
    }
  });
}

template <int MR, int NR>
inline void int8_tile(const int8_t* xq, const uint8_t* xa, const int8_t* w, int64_t kp,
                      const float* xs, const float* ws, float* y, int64_t ldy) {
  __m256i acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
  for (int64_t k = 0; k < kp; k += 32) {
    __m256i wv[NR];
    for (int j = 0; j < NR; ++j) {
      // Two tiles ahead: a batched decode (M = 3..16) still reads every weight from memory
      // once, and the hardware prefetcher alone keeps too few lines in flight (measured when
      // tiles also ran M = 1: 30 layers of int8 weights 21.5 -> 13-14.5 ms).
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + 2 * NR) * kp + k), _MM_HINT_T0);
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * kp + k));
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kp + k));
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa + i * kp + k));
      // |x| * (w with x's sign) == x * w, with the unsigned operand first as the ISA wants.
      for (int j = 0; j < NR; ++j) acc[i][j] = dot_acc(acc[i][j], av, _mm256_sign_epi8(wv[j], xv));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      y[i * ldy + j] = static_cast<float>(hsum_i32(acc[i][j])) * xs[i] * ws[j];
}

// Decode: y[i, n] for the MR activation rows and weight rows [n0, n1), one row at a time.
template <int MR>
void int8_rows(const int8_t* xq, const uint8_t* xa, const int8_t* w, int64_t kp,
               const float* xs, const float* ws, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * kp;
    __m256i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t k = 0; k < kp; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k + kStreamAhead), _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * kp + k));
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa + i * kp + k));
        acc[i] = dot_acc(acc[i], av, _mm256_sign_epi8(wv, xv));
      }
    }
    for (int i = 0; i < MR; ++i)
      y[i * ldy + n] = static_cast<float>(hsum_i32(acc[i])) * xs[i] * ws[n];
  }
}

// Columns of one block of the VNNI-packed int8 layout (kernels/cpu.py VNNI_BLOCK).
constexpr int64_t kVnniCols = 16;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 512-bit VNNI: the packed layout below. Its unsigned operand is the weight shifted by 128
// (w + 128 for |w| <= 127), the signed one the activation codes, so sum (w + 128) * x =
// sum w * x + 128 * sum x, and the row sums of the codes (`code_row_sums`) take the shift back
// out. Integer sums are exact in any order, so every output equals the rows layout's (int8_rows,
// int8_tile) bit for bit.
#define KVASIR_INT8_ZMM 1

// acc += the 4-byte dot products of u8 (unsigned) with the 4 signed codes at s8x4, broadcast
// from memory to every lane. Written out because GCC 12 compiles _mm512_dpbusd_epi32 on an
// array of accumulators into a copy of each accumulator before and after every product (and
// spills some to the stack): three instructions a product instead of one, which made the
// 8 x 2 and 16 x 1 tiles compute-bound at 16 rows.
inline void dpbusd_broadcast(__m512i& acc, __m512i u8, const int8_t* s8x4) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(u8), "m"(*reinterpret_cast<const int32_t*>(s8x4)));
}

// Row sums of the activation codes (the shift's correction above).
void code_row_sums(const int8_t* xq, int64_t m, int64_t kp, int32_t* xsum) {
  for (int64_t i = 0; i < m; ++i) {
    __m512i acc = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(1);
    int64_t k = 0;
    for (; k + 64 <= kp; k += 64)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_loadu_si512(xq + i * kp + k));
    if (k < kp)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq + i * kp + k));
    xsum[i] = _mm512_reduce_add_epi32(acc);
  }
}

// ---- int8 weights packed for VNNI (kernels/cpu.py pack_int8_vnni) --------------------------
//
// [ceil(N / 16), Kp / 4, 64] uint8: block b holds columns 16b .. 16b + 15; its 64 bytes at k4
// are those columns' weights at k = 4 k4 .. 4 k4 + 3 (a column's four bytes together), each shifted by
// 128, so one vpdpbusd takes 16 columns x 4 k against 4 activation codes broadcast to every
// lane, and the accumulator holds 16 finished column sums (no horizontal sums, no sign trick).
// The shift comes out with the codes' row sums (above), so the outputs equal the rows
// layout's bit for bit. A tile is up to 8 rows x 2 blocks: 16 accumulators, 2 weight registers
// and one broadcast (6 x 4 and 4 x 4 tiles measured slower on a 2-core EPYC: GCC spilled the
// 6 x 4 one; docs/performance.md).
constexpr int kVnniRows = 8, kVnniBlocks = 2;

// OutT: float32, or bfloat16 rounded from the same float32 sums (as y.to(bfloat16) would).
template <typename OutT, int MR, int NB, int64_t AHEAD = kStreamAhead>
void int8_vnni_tile(const int8_t* xq, const int32_t* xsum, const uint8_t* w, int64_t kp,
                    const float* xs, const float* ws, OutT* y, int64_t ldy, int64_t cols) {
  const int64_t block_bytes = kp * kVnniCols;
  // Every loop over the tile's rows and blocks fully unrolled, so the accumulators live in
  // registers (rolled, GCC 12 kept them in a stack array: a load and a store per product).
  __m512i acc[MR][NB];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_si512();
  for (int64_t k4 = 0; k4 < kp / 4; ++k4) {
    __m512i wv[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      const uint8_t* p = w + b * block_bytes + k4 * 64;
      // Streamed ahead at any tile height: the first row tile reads the weights from memory
      // (a 16-row decode step too: offline at C=16 its decode-only steps took 5-11% less with
      // this than with streaming for <= kMaxStreamRows rows only; docs/performance.md).
      _mm_prefetch(reinterpret_cast<const char*>(p + AHEAD), _MM_HINT_T0);
      wv[b] = _mm512_loadu_si512(p);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) dpbusd_broadcast(acc[i][b], wv[b], xq + i * kp + k4 * 4);
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    const __m512i shift = _mm512_set1_epi32(128 * xsum[i]);
    const __m512 sx = _mm512_set1_ps(xs[i]);
    for (int b = 0; b < NB; ++b) {
      const int64_t c0 = b * kVnniCols;
      if (c0 >= cols) break;
      const __mmask16 mask = kvasir_cpu::lanes16(cols - c0);
      // (float(d) * xs) * ws: the rows kernels' order of operations, so the same rounding.
      const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][b], shift));
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(d, sx), _mm512_maskz_loadu_ps(mask, ws + c0));
      if constexpr (std::is_same_v<OutT, float>) {
        _mm512_mask_storeu_ps(y + i * ldy + c0, mask, v);
      } else {
        _mm256_mask_storeu_epi16(y + i * ldy + c0, mask, kvasir_cpu::to_bf16_16(v));
      }
    }
  }
}

template <typename OutT>
using VnniTile = void (*)(const int8_t*, const int32_t*, const uint8_t*, int64_t, const float*,
                          const float*, OutT*, int64_t, int64_t);

// kVnniTiles<OutT>[rows - 1][blocks - 1]: the tile of that shape.
template <typename OutT, int MR, int... Bs>
constexpr std::array<VnniTile<OutT>, kVnniBlocks> vnni_tiles_of_rows(
    std::integer_sequence<int, Bs...>) {
  return {&int8_vnni_tile<OutT, MR, Bs + 1>...};
}
template <typename OutT, int... Rs>
constexpr std::array<std::array<VnniTile<OutT>, kVnniBlocks>, kVnniRows> vnni_tiles(
    std::integer_sequence<int, Rs...>) {
  return {vnni_tiles_of_rows<OutT, Rs + 1>(std::make_integer_sequence<int, kVnniBlocks>{})...};
}
template <typename OutT>
constexpr auto kVnniTiles = vnni_tiles<OutT>(std::make_integer_sequence<int, kVnniRows>{});

// Up to kVnniColumnRows rows (a decode step's batch) take one block of 16 columns at a time
// with every row in the tile: each weight byte is read once, as the stream reaches it, and used
// for all of them. Cold, 30 SmolLM2 layers at 16 rows (106 MB of weights, ~3.3 ms to stream):
// 6.1-6.8 ms in 8 x 2 tiles before the unrolling above, 5.7 ms in them after, 3.8-4.7 ms in
// these (docs/performance.md).
constexpr int kVnniColumnRows = 16;
// Weights prefetched this far ahead of a column tile (measured 1-4 KB: 2 KB or more best).
constexpr int64_t kColumnAhead = 2048;
template <typename OutT, int... Rs>
constexpr std::array<VnniTile<OutT>, kVnniColumnRows> vnni_column_tiles(
    std::integer_sequence<int, Rs...>) {
  return {&int8_vnni_tile<OutT, Rs + 1, 1, kColumnAhead>...};
}
template <typename OutT>
constexpr auto kVnniColumnTiles =
    vnni_column_tiles<OutT>(std::make_integer_sequence<int, kVnniColumnRows>{});

// y [M, N] = codes xq [M, Kp] (scales xs, code row sums xsum) times packed w; columns split
// across threads in tiles of kVnniBlocks blocks, rows in blocks of kRowBlock that reuse a
// thread's weight tiles from cache.
template <typename OutT>
void int8_vnni(const int8_t* xq, const int32_t* xsum, const float* xs, const uint8_t* w,
               const float* ws, int64_t m, int64_t n, int64_t kp, OutT* y) {
  const int64_t num_blocks = (n + kVnniCols - 1) / kVnniCols;
  if (m <= kVnniColumnRows) {
    at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t c0 = b * kVnniCols;
        kVnniColumnTiles<OutT>[m - 1](xq, xsum, w + b * kp * kVnniCols, kp, xs, ws + c0, y + c0, n,
                                std::min<int64_t>(kVnniCols, n - c0));
      }
    });
    return;
  }
  const int64_t num_tiles = (num_blocks + kVnniBlocks - 1) / kVnniBlocks;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t m1 = std::min(m, m0 + kRowBlock);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = t * kVnniBlocks;
        const int64_t blocks = std::min<int64_t>(kVnniBlocks, num_blocks - b0);
        const int64_t c0 = b0 * kVnniCols, cols = std::min<int64_t>(blocks * kVnniCols, n - c0);
        for (int64_t i = m0; i < m1; i += kVnniRows) {
          const int64_t rows = std::min<int64_t>(kVnniRows, m1 - i);
          kVnniTiles<OutT>[rows - 1][blocks - 1](xq + i * kp, xsum + i, w + b0 * kp * kVnniCols, kp,
                                           xs + i, ws + c0, y + i * n + c0, n, cols);
        }
      }
    }
  });
}

#endif

}  // namespace

namespace kvasir_cpu {

bool int8_vnni_supported() {
#ifdef KVASIR_INT8_ZMM
  return true;
#else
  return false;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       int64_t k) {
  // x [M, K] float; w [N, Kp] int8 or packed [ceil(N / 16), Kp / 4, 64] uint8;
  // w_scale [N] float32 -> [M, N] in x's dtype
  const bool packed = w.dim() == 3;
  if (packed) {
    TORCH_CHECK(int8_vnni_supported(), "int8_linear: packed weights need AVX-512 VNNI, which "
                "this build of the kernels lacks");
    TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == 4 * kVnniCols,
                "int8_linear: packed w must be a contiguous [ceil(N / 16), Kp / 4, 64] uint8 "
                "tensor");
    TORCH_CHECK(w_scale.dim() == 1, "int8_linear: w_scale must be [N] float32");
    TORCH_CHECK(w.size(0) == (w_scale.numel() + kVnniCols - 1) / kVnniCols,
                "int8_linear: packed w has ", w.size(0), " blocks of 16 columns for N = ",
                w_scale.numel());
  } else {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
                "int8_linear: w must be a contiguous [N, Kp] int8 tensor");
  }
  const int64_t n = packed ? w_scale.numel() : w.size(0);
  const int64_t kp = packed ? 4 * w.size(1) : w.size(1);
  TORCH_CHECK(kp % kGroup == 0 && kp >= k && kp - k < kGroup, "int8_linear: Kp = ", kp,
              " must be K = ", k, " rounded up to 32");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == n &&
                  w_scale.is_contiguous(), "int8_linear: w_scale must be [N] float32");
  // bfloat16 activations are read and, for the packed layout, written as they are: the
  // codes and the outputs equal those through float32 copies (x.to(float32), y.to(bfloat16)),
  // which cost a third of a 50-row product on a 2-core EPYC.
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xf = is_bf16 ? checked_rows(x, k).contiguous() : as_float_rows(x, k);
  const int64_t m = xf.size(0);
  const auto options = xf.options().dtype(at::kFloat);
  at::Tensor xq = at::empty({m, kp}, options.dtype(at::kChar));
  // |codes|: the unsigned operand of the rows layout's dot products only.
  at::Tensor xa = packed ? at::Tensor() : at::empty({m, kp}, options.dtype(at::kByte));
  at::Tensor xs = at::empty({m}, options);
  if (m > 0 && is_bf16) {
    quantize_rows(xf.data_ptr<at::BFloat16>(), m, k, kp, xq.data_ptr<int8_t>(),
                  packed ? nullptr : xa.data_ptr<uint8_t>(), xs.data_ptr<float>());
  } else if (m > 0) {
    quantize_rows(xf.data_ptr<float>(), m, k, kp, xq.data_ptr<int8_t>(),
                  packed ? nullptr : xa.data_ptr<uint8_t>(), xs.data_ptr<float>());
  }
  const int8_t* q = xq.data_ptr<int8_t>();
  const float* s = xs.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  if (packed) {
    at::Tensor y = at::empty({m, n}, options.dtype(is_bf16 ? at::kBFloat16 : at::kFloat));
#ifdef KVASIR_INT8_ZMM
    if (m > 0) {
      std::vector<int32_t> xsum(static_cast<size_t>(m));
      code_row_sums(q, m, kp, xsum.data());
      if (is_bf16) {
        int8_vnni(q, xsum.data(), s, w.data_ptr<uint8_t>(), ws, m, n, kp,
                  y.data_ptr<at::BFloat16>());
      } else {
        int8_vnni(q, xsum.data(), s, w.data_ptr<uint8_t>(), ws, m, n, kp, y.data_ptr<float>());
      }
    }
#endif
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }
  at::Tensor y = at::empty({m, n}, options);
  if (m == 0) return y.to(x.scalar_type());
  float* out = y.data_ptr<float>();
  const uint8_t* a = xa.data_ptr<uint8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  if (m <= kMaxStreamRows) {
    for_each_row_range(n, [&](int64_t n0, int64_t n1) {
      if (m == 1) int8_rows<1>(q, a, wp, kp, s, ws, out, n, n0, n1);
      else int8_rows<2>(q, a, wp, kp, s, ws, out, n, n0, n1);
    });
  } else {
    for_each_tile(m, n, [&](int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
      KVASIR_TILE_CASES(int8_tile, (q + m0 * kp, a + m0 * kp, wp + n0 * kp, kp, s + m0, ws + n0,
                                    out + m0 * n + n0, n))
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
}  // namespace kvasir_cpu

TORCH_LIBRARY(kvasir_cpu, lib) {
  lib.def("int8_linear(Tensor x, Tensor w, Tensor w_scale, int k) -> Tensor");
  lib.def("int8_vnni_supported() -> bool");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) { lib.impl("int8_linear", &kvasir_cpu::int8_linear); }

TORCH_LIBRARY_IMPL(kvasir_cpu, CatchAll, lib) {
  lib.impl("int8_vnni_supported", &kvasir_cpu::int8_vnni_supported);
}
