// bfloat16 products with AVX512-BF16 dot products (vdpbf16ps), weights packed once at load.
//
// oneDNN's packed bfloat16 products (layers/onednn.py) run near the host's peak at prefill
// sizes, but a decode step's 16-row products read their weights at ~24 GB/s on a host whose
// memory gives ~32: 120 calls a step, each too short for oneDNN's blocking to stream. Here a
// decode-sized product (<= kColumnRows rows) takes one block of 16 output columns at a time
// with every row in the tile, so each weight byte is read once, as a prefetched stream reaches
// it; larger products take tiles of 8 rows x 2 blocks.
//
// Layout (kernels/cpu.py pack_bf16_pairs): [ceil(N / 16), K / 2, 32] bfloat16; block b at step
// k2 holds columns 16b .. 16b + 15 at k = 2 k2, 2 k2 + 1 (a column's pair together), so one
// vdpbf16ps multiplies 16 columns' pairs with one activation pair broadcast to every lane.
// Products are exact and summed in float32 along k in order, one lane per (row, column): the
// same sums whatever the tile, so a row's output does not depend on the rows beside it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

constexpr int64_t kCols = 16;  // columns of a packed block

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVASIR_BF16_DOT 1

using kvasir_cpu::dpbf16;
using kvasir_cpu::dpbf16_broadcast;

// Bytes of weights prefetched ahead of a tile: 2,048, twice that for 12 rows or more (a 16-row
// decode tile spends long enough on each line that 2,048 came too late: 30 layers' products at
// 16 rows 6.05-6.21 ms against 6.64-6.89, one row unchanged, 2 EPYC cores).
constexpr int64_t kStreamAhead = 2048;
template <int MR> constexpr int64_t kAhead = MR >= 12 ? 2 * kStreamAhead : kStreamAhead;

// y[MR rows, NB blocks] = x[MR, K] times the packed blocks at w (K / 2 steps each).
template <int MR, int NB>
void bf16_tile(const at::BFloat16* x, int64_t k, const uint16_t* w, at::BFloat16* y,
               int64_t ldy, int64_t cols) {
  const int64_t steps = k / 2, block_elems = steps * 2 * kCols;
  __m512 acc[MR][NB];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < steps; ++k2) {
    __m512i wv[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      const uint16_t* p = w + b * block_elems + k2 * 2 * kCols;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAhead<MR>, _MM_HINT_T0);
      wv[b] = _mm512_loadu_si512(p);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      if constexpr (NB == 1) {
        dpbf16_broadcast(acc[i][0], wv[0], x + i * k + 2 * k2);
      } else {  // one broadcast into a register, used by every block
        int32_t pair;
        std::memcpy(&pair, x + i * k + 2 * k2, sizeof pair);
        const __m512i xv = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
        for (int b = 0; b < NB; ++b) dpbf16(acc[i][b], wv[b], xv);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      const int64_t c0 = b * kCols;
      if (c0 >= cols) break;
      _mm256_mask_storeu_epi16(y + i * ldy + c0, kvasir_cpu::lanes16(cols - c0),
                               kvasir_cpu::to_bf16_16(acc[i][b]));
    }
}

using Tile = void (*)(const at::BFloat16*, int64_t, const uint16_t*, at::BFloat16*, int64_t,
                      int64_t);

constexpr int kColumnRows = 16;  // up to this many rows: one tile of every row, a block wide
// Past it, 8 rows x 2 blocks (12 x 2 measured no faster), the activation pair broadcast once
// into a register for both blocks (from memory per product, the loads outnumbered the
// products and the tile ran ~15% slower than oneDNN at 512 rows; now within ~5%).
constexpr int kTileRows = 8, kTileBlocks = 2;  // past it
constexpr int64_t kRowBlock = 64;  // rows per pass over a chunk of a thread's weight columns
constexpr int64_t kChunkBytes = 256 * 1024;  // weights of such a chunk

template <int NB, int... Rs>
constexpr auto tiles_of(std::integer_sequence<int, Rs...>) {
  return std::array<Tile, sizeof...(Rs)>{&bf16_tile<Rs + 1, NB>...};
}
constexpr auto kColumnTiles = tiles_of<1>(std::make_integer_sequence<int, kColumnRows>{});
constexpr auto kWideTiles = tiles_of<kTileBlocks>(std::make_integer_sequence<int, kTileRows>{});

void bf16_matmul(const at::BFloat16* x, const uint16_t* w, int64_t m, int64_t n, int64_t k,
                 at::BFloat16* y) {
  const int64_t num_blocks = (n + kCols - 1) / kCols, block_elems = k * kCols;
  if (m <= kColumnRows) {
    at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        kColumnTiles[m - 1](x, k, w + b * block_elems, y + b * kCols, n,
                            std::min(kCols, n - b * kCols));
    });
    return;
  }
  const int64_t num_tiles = (num_blocks + kTileBlocks - 1) / kTileBlocks;
  // A thread's columns in chunks whose weights stay in L2 while every row block passes over
  // them (unchunked, SmolLM2's gate_up at 2048 rows re-read 1.7 MB per row block: 9.6 ms
  // against oneDNN's 7.4).
  const int64_t chunk = std::max<int64_t>(
      1, kChunkBytes / (kTileBlocks * block_elems * static_cast<int64_t>(sizeof(uint16_t))));
  at::parallel_for(0, num_tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t begin = first; begin < last; begin += chunk) {
      const int64_t end = std::min(last, begin + chunk);
      for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
        const int64_t m1 = std::min(m, m0 + kRowBlock);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t b0 = t * kTileBlocks;
          const int64_t blocks = std::min<int64_t>(kTileBlocks, num_blocks - b0);
          const int64_t c0 = b0 * kCols, cols = std::min(blocks * kCols, n - c0);
          for (int64_t i = m0; i < m1; i += kTileRows) {
            const int64_t rows = std::min<int64_t>(kTileRows, m1 - i);
            Tile tile = blocks == kTileBlocks ? kWideTiles[rows - 1] : kColumnTiles[rows - 1];
            tile(x + i * k, k, w + b0 * block_elems, y + i * n + c0, n, cols);
          }
        }
      }
    }
  });
}
#endif

}  // namespace

namespace kvasir_cpu {

bool bf16_dot_supported() {
#ifdef KVASIR_BF16_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  // x [M, K] bfloat16, K even; w [ceil(N / 16), K / 2, 32] bfloat16 (pack_bf16_pairs)
  // -> [M, N] bfloat16
  TORCH_CHECK(bf16_dot_supported(), "bf16_linear: this build of the kernels lacks AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_linear: x must be [M, K] bfloat16 on the CPU");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 2 == 0, "bf16_linear: K must be even, got ", k);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                  w.size(0) == (n + kCols - 1) / kCols && w.size(1) == k / 2 &&
                  w.size(2) == 2 * kCols,
              "bf16_linear: w must be a contiguous [", (n + kCols - 1) / kCols, ", ", k / 2,
              ", 32] bfloat16 tensor for N = ", n, ", K = ", k, ", got ", w.sizes());
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef KVASIR_BF16_DOT
  if (m > 0) {
    const at::Tensor xc = x.contiguous();
    bf16_matmul(xc.data_ptr<at::BFloat16>(), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                m, n, k, y.data_ptr<at::BFloat16>());
  }
#endif
  return y;
}

}  // namespace kvasir_cpu

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("bf16_linear(Tensor x, Tensor w, int n) -> Tensor");
  lib.def("bf16_dot_supported() -> bool");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) { lib.impl("bf16_linear", &kvasir_cpu::bf16_linear); }

TORCH_LIBRARY_IMPL(kvasir_cpu, CatchAll, lib) {
  lib.impl("bf16_dot_supported", &kvasir_cpu::bf16_dot_supported);
}
