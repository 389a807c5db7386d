// The wide decode-attention work item (`attend_chunk16`, AVX-512): the AVX2 item's work with
// 16-lane vectors. A part of cpu_attention.cpp kept in its own file for size: it is included
// inside that file's unnamed namespace, after the AVX2 item, and uses its definitions
// (Shape, ItemScratch, kTile, prefetch_row, softmax_numerators); it includes nothing itself.
#pragma once

#if defined(__AVX512F__)
// The same work item with 16-lane vectors, for head_dim 32, 64 or 128 (VECS = head_dim / 16)
// and at most kMaxGroup16 query heads per KV head. The AVX2 item above converts every K and V
// element once per query head reading it (three times under SmolLM2's 3:1 grouping), reduces
// every score on its own, finds each row through a division, and issues a block's prefetches
// at once; it streamed ~10 GB/s on an AVX-512 host whose cores read ~32 GB/s. This one
// converts each element once per KV head and shares it across the heads of its group, reduces
// 16 positions' scores together (`sum16`), walks the rows block by block, and spreads its
// prefetches through the arithmetic (all at once, they stall on the core's miss buffers).
constexpr int64_t kMaxGroup16 = 16;  // query heads per KV head
#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;  // vdpbf16ps: bfloat16 pairs multiplied, float32 sums
#else
constexpr bool kHasBf16Dot = false;
#endif

// r[p] = the sum of v[p]'s 16 lanes, for p in [0, 16): halves, then quarters, then pairs of
// lanes are added across vectors, and the lanes come out as 4k + j -> position 4j + k.
inline __m512 sum16(const __m512* v) {
  __m512 s[8], t[4], u[2];
  for (int j = 0; j < 8; ++j)
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// out[j][0, NV * 16) = sum over the chunk's positions i < len of p[j * len + i] x V[i]: HEADS
// query heads sharing one KV head, NV vectors of its dimensions (`values` points at the first
// of them in the cache's first row; position i's row is `offsets[i]` elements on); each V row
// is converted once for all HEADS. Meanwhile the `num_ahead` rows `ahead` are prefetched, one
// a position.
template <int HEADS, int NV, typename T>
void accumulate16(const T* values, const float* p, int64_t len, const int64_t* offsets,
                  const Shape& s, float* out, const char* const* ahead, int64_t num_ahead,
                  int64_t ahead_bytes) {
  __m512 a[HEADS][NV];
  for (int j = 0; j < HEADS; ++j)
    for (int v = 0; v < NV; ++v) a[j][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    if (i < num_ahead) prefetch_row(ahead[i], ahead_bytes);
    const T* value = values + offsets[i];
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load16(value + v * 16);
    for (int j = 0; j < HEADS; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * len + i]);
      for (int v = 0; v < NV; ++v) a[j][v] = _mm512_fmadd_ps(w, x[v], a[j][v]);
    }
  }
  for (int j = 0; j < HEADS; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + j * s.head_dim + v * 16, a[j][v]);
}

template <int VECS, typename T, bool DP = false>
void attend_chunk16(const float* qf, const T* k_cache, const T* v_cache, const int32_t* table,
                    int64_t t0, int64_t t1, const Shape& s, float* scores, float* acc,
                    float* top, float* total, ItemScratch& scratch) {
  const int64_t len = t1 - t0, group = s.num_heads / s.num_kv_heads;
  const int64_t head_bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
  // Each position's row in the caches, in elements, walked block by block (a division per
  // lookup cost more than the arithmetic it fed).
  int64_t* offsets = scratch.offsets;
  for (int64_t t = t0, b = t0 / s.block_size, j = t0 % s.block_size; t < t1; ++t) {
    offsets[t - t0] = table[b] * s.block_stride + j * s.token_stride;
    if (++j == s.block_size) j = 0, ++b;
  }
  auto row = [&](const T* cache, int64_t t) { return cache + offsets[t - t0]; };
  // Scores, 16 positions at a time: partial[g][i] holds position i's products with head g of
  // the KV head, lane by lane, from one conversion of its K row; sum16 reduces a head's 16.
  __m512 partial[kMaxGroup16][kTile];
  for (int64_t p0 = t0; p0 < t1; p0 += kTile) {
    const int64_t count = std::min(kTile, t1 - p0);
    const int64_t next_count = std::min(kTile, std::max<int64_t>(0, t1 - p0 - kTile));
    for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) {
      const float* q0 = qf + kvh * group * s.head_dim;
      for (int64_t i = 0; i < kTile; ++i) {
        if (i >= count) {
          for (int64_t g = 0; g < group; ++g) partial[g][i] = _mm512_setzero_ps();
          continue;
        }
        // In flight while this head's scores are computed, a few lines at a time (issued all
        // at once, they stall on the core's miss buffers): this position's V for the same KV
        // head and the next tile's K.
        prefetch_row(row(v_cache, p0 + i) + kvh * s.head_dim, head_bytes);
        if (i < next_count)
          prefetch_row(row(k_cache, p0 + kTile + i) + kvh * s.head_dim, head_bytes);
        const T* key = row(k_cache, p0 + i) + kvh * s.head_dim;
#if defined(__AVX512BF16__)
        if constexpr (DP) {  // bfloat16 pairs straight from the cache, no conversion
          constexpr int kPairs = VECS / 2;
          __m512bh k[kPairs];
          for (int v = 0; v < kPairs; ++v)
            k[v] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const char*>(key) + v * 64);
          const at::BFloat16* qb = scratch.query + kvh * group * s.head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const char* qh = reinterpret_cast<const char*>(qb + g * s.head_dim);
            __m512 d = _mm512_setzero_ps();
            for (int v = 0; v < kPairs; ++v)
              d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(qh + v * 64), k[v]);
            partial[g][i] = d;
          }
          continue;
        }
#endif
        __m512 k[VECS];
        for (int v = 0; v < VECS; ++v) k[v] = load16(key + v * 16);
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = q0 + g * s.head_dim;
          __m512 d0 = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]), d1 = _mm512_setzero_ps();
          for (int v = 1; v < VECS; ++v) {
            if (v % 2) d1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + v * 16), k[v], d1);
            else d0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + v * 16), k[v], d0);
          }
          partial[g][i] = _mm512_add_ps(d0, d1);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        alignas(64) float tile[kTile];
        const __m512 sums = sum16(partial[g]);
        _mm512_store_ps(tile, DP ? _mm512_mul_ps(sums, _mm512_set1_ps(scratch.scale)) : sums);
        std::copy(tile, tile + count, scores + (kvh * group + g) * len + (p0 - t0));
      }
    }
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const auto [m, sum] = softmax_numerators(scores + h * len, len);
    top[h] = m;
    total[h] = sum;
  }
  // acc[h] = sum_i p[h][i] V[i]: each V row converted once per KV head, for up to 4 heads of
  // its group at a time and 64 dimensions (16 accumulators).
  constexpr int kNv = VECS < 4 ? VECS : 4;
  const char* ahead_rows[kTile];
  for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int64_t h0 = kvh * group + g0;
      for (int64_t v0 = 0; v0 < VECS; v0 += kNv) {
        const T* values = v_cache + kvh * s.head_dim + v0 * 16;
        float* out = acc + h0 * s.head_dim + v0 * 16;
        const float* p = scores + h0 * len;
        // The next item's first K rows, this KV head's part, on the first pass over V.
        const char* const* ahead = scratch.next_rows;
        const int64_t num_ahead = g0 == 0 && v0 == 0 ? scratch.num_next_rows : 0;
        for (int64_t i = 0; i < num_ahead; ++i) ahead_rows[i] = ahead[i] + kvh * head_bytes;
        auto accumulate = [&](auto heads) {
          accumulate16<decltype(heads)::value, kNv>(values, p, len, offsets, s, out, ahead_rows,
                                                    num_ahead, head_bytes);
        };
        switch (std::min<int64_t>(4, group - g0)) {
          case 1: accumulate(std::integral_constant<int, 1>{}); break;
          case 2: accumulate(std::integral_constant<int, 2>{}); break;
          case 3: accumulate(std::integral_constant<int, 3>{}); break;
          default: accumulate(std::integral_constant<int, 4>{});
        }
      }
    }
  }
}
#endif
