// Fused CPU layers (AVX2; 16 lanes where the host has AVX-512): residual add + RMSNorm, rotary
// embedding in place, SwiGLU's gate.
//
// In eager PyTorch each is 5 to 10 small operator calls per layer (add, cast, pow, mean, rsqrt,
// mul, ...), every one a few microseconds of dispatch and a pass over the row; a single-stream
// decode step of a 30-layer model spends milliseconds there. Here each is one call and one pass.
// They compute what layers/norm.py and layers/rotary.py compute (float32 arithmetic, rounding
// to the activation dtype at the same points); tests/engine/kernels/test_cpu_kernels.py compares.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

using kvasir_cpu::exp8;
using kvasir_cpu::load8;
using kvasir_cpu::round8;
using kvasir_cpu::store8;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
template <typename T> inline T from_float(float v) { return static_cast<T>(v); }

// out = weight * dtype(normed(x + residual)), new_residual = dtype(x + residual); one row,
// eight values at a time (the sum of squares in eight float32 lanes).
template <typename T>
void rms_norm_row(const T* x, const T* residual, const T* weight, int64_t hidden, float eps,
                  T* out, T* new_residual) {
#if defined(__AVX512F__)
  if (hidden % 16 == 0) {  // 16 lanes where the host has them (the sum in 16 float32 lanes)
    using kvasir_cpu::load16;
    __m512 acc16 = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
      __m512 v = load16(x + i);
      if (residual != nullptr) v = kvasir_cpu::round16<T>(_mm512_add_ps(v, load16(residual + i)));
      if (new_residual != nullptr) kvasir_cpu::store16(new_residual + i, v);
      acc16 = _mm512_fmadd_ps(v, v, acc16);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc16) / static_cast<float>(hidden)
                                       + eps);
    const __m512 inv16 = _mm512_set1_ps(inv);
    const T* src = new_residual != nullptr ? new_residual : x;
    for (int64_t i = 0; i < hidden; i += 16) {
      const __m512 normed = kvasir_cpu::round16<T>(_mm512_mul_ps(load16(src + i), inv16));
      kvasir_cpu::store16(out + i, _mm512_mul_ps(load16(weight + i), normed));
    }
    return;
  }
#endif
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= hidden; i += 8) {
    __m256 v = load8(x + i);
    if (residual != nullptr) v = round8<T>(_mm256_add_ps(v, load8(residual + i)));
    if (new_residual != nullptr) store8(new_residual + i, v);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = kvasir_cpu::hsum_ps(acc);
  for (; i < hidden; ++i) {
    float v = to_float(x[i]);
    if (residual != nullptr) v = to_float(from_float<T>(v + to_float(residual[i])));
    if (new_residual != nullptr) new_residual[i] = from_float<T>(v);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  const __m256 inv8 = _mm256_set1_ps(inv);
  const T* src = new_residual != nullptr ? new_residual : x;
  for (i = 0; i + 8 <= hidden; i += 8) {
    const __m256 normed = round8<T>(_mm256_mul_ps(load8(src + i), inv8));
    store8(out + i, _mm256_mul_ps(load8(weight + i), normed));
  }
  for (; i < hidden; ++i) {
    const float normed = to_float(from_float<T>(to_float(src[i]) * inv));
    out[i] = from_float<T>(to_float(weight[i]) * normed);
  }
}


// Rotate-half RoPE in place: x = x * cos + swap_halves(x) * signed_sin, with the tables of
// layers/rotary.py (cos over the whole head, sin with its first half negated), float32.
template <typename T>
void rotate_heads(T* x, int64_t num_tokens, int64_t num_heads, int64_t token_stride,
                  int64_t head_stride, int64_t head_dim, const int64_t* positions,
                  const T* cos, const T* sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + positions[t] * head_dim;
      const T* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = x + t * token_stride + h * head_stride;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {  // 16 lanes where the host has them, same values
          using kvasir_cpu::load16;
          const __m512 a = load16(v + i), b = load16(v + i + half);
          kvasir_cpu::store16(v + i, _mm512_add_ps(_mm512_mul_ps(a, load16(c + i)),
                                                   _mm512_mul_ps(b, load16(s + i))));
          kvasir_cpu::store16(v + i + half,
                              _mm512_add_ps(_mm512_mul_ps(b, load16(c + i + half)),
                                            _mm512_mul_ps(a, load16(s + i + half))));
        }
#endif
        for (; i + 8 <= half; i += 8) {
          const __m256 a = load8(v + i), b = load8(v + i + half);
          store8(v + i, _mm256_add_ps(_mm256_mul_ps(a, load8(c + i)),
                                      _mm256_mul_ps(b, load8(s + i))));
          store8(v + i + half, _mm256_add_ps(_mm256_mul_ps(b, load8(c + i + half)),
                                             _mm256_mul_ps(a, load8(s + i + half))));
        }
        for (; i < half; ++i) {
          const float a = to_float(v[i]), b = to_float(v[i + half]);
          v[i] = from_float<T>(a * to_float(c[i]) + b * to_float(s[i]));
          v[i + half] = from_float<T>(b * to_float(c[i + half]) + a * to_float(s[i + half]));
        }
      }
    }
  });
}


// out[t] = dtype(dtype(silu(gate[t])) * up[t]) over x[t] = [gate | up], as layers/activation.py
// computes it (silu rounded to the dtype before the product); e^-g vectorized (exp8).
template <typename T>
void silu_and_mul_row(const T* x, int64_t inter, T* out) {
  const T* up = x + inter;
  int64_t i = 0;
#if defined(__AVX512F__)
  // 16 lanes where the host has them: the same values as the 8-lane loop (2-3x as fast).
  const __m512 one16 = _mm512_set1_ps(1.0f);
  for (; i + 16 <= inter; i += 16) {
    const __m512 g = kvasir_cpu::load16(x + i);
    const __m512 silu = kvasir_cpu::round16<T>(_mm512_div_ps(
        g, _mm512_add_ps(one16, kvasir_cpu::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    kvasir_cpu::store16(out + i, _mm512_mul_ps(silu, kvasir_cpu::load16(up + i)));
  }
#endif
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= inter; i += 8) {
    const __m256 g = load8(x + i);
    // rounded to the dtype, as F.silu's output is
    const __m256 silu = round8<T>(_mm256_div_ps(
        g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
    store8(out + i, _mm256_mul_ps(silu, load8(up + i)));
  }
  for (; i < inter; ++i) {
    const float g = to_float(x[i]);
    const float silu = to_float(from_float<T>(g / (1.0f + std::exp(-g))));
    out[i] = from_float<T>(silu * to_float(up[i]));
  }
}


}  // namespace

namespace kvasir_cpu {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual) {
  // x [T, H]; weight [H]; residual [T, H] or None -> (normed [T, H], new residual [T, H])
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x must be contiguous [T, H] and weight [H] of x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm: float32 or bfloat16 only");
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be contiguous and match x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty_like(x);
  at::Tensor new_residual = has_residual ? at::empty_like(x) : x;
  const at::Tensor w = weight.contiguous();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<T>(x.data_ptr<T>() + r * hidden,
                        has_residual ? residual->data_ptr<T>() + r * hidden : nullptr,
                        w.data_ptr<T>(), hidden, static_cast<float>(eps),
                        out.data_ptr<T>() + r * hidden,
                        has_residual ? new_residual.data_ptr<T>() + r * hidden : nullptr);
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
  return {out, new_residual};
}

void rotary_(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
             const at::Tensor& cos, const at::Tensor& sin) {
  // positions [T] int64; query [T, H, D], key [T, Hkv, D] (last dim contiguous, any row
  // stride: they may be views of one fused qkv output); cos, sin [max_position, D] in their dtype
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(), "rotary: positions must be contiguous [T] int64");
  const int64_t tokens = positions.size(0), head_dim = query.size(2);
  for (const at::Tensor* t : {&query, &key})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(2) == head_dim &&
                    t->stride(2) == 1 && t->scalar_type() == query.scalar_type(),
                "rotary: query and key must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.scalar_type() == query.scalar_type() && sin.scalar_type() == cos.scalar_type()
                  && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(1) == head_dim && head_dim % 2 == 0,
              "rotary: cos and sin must be contiguous [max_position, D] in query's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary: position ", pos[t],
                " outside the table of ", cos.size(0));
  auto run = [&](auto zero) {
    using T = decltype(zero);
    for (at::Tensor* t : {&query, &key})
      rotate_heads<T>(t->data_ptr<T>(), tokens, t->size(1), t->stride(0), t->stride(1),
                      head_dim, pos, cos.data_ptr<T>(), sin.data_ptr<T>());
  };
  if (query.scalar_type() == at::kFloat) run(float{});
  else if (query.scalar_type() == at::kBFloat16) run(at::BFloat16{});
  else TORCH_CHECK(false, "rotary: float32 or bfloat16 only");
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  // x [T, 2 * I] contiguous -> [T, I]
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be contiguous [T, 2 * I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  auto run = [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_and_mul_row<T>(x.data_ptr<T>() + r * 2 * inter, inter,
                            out.data_ptr<T>() + r * inter);
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else if (x.scalar_type() == at::kBFloat16) run(at::BFloat16{});
  else TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  return out;
}

}  // namespace kvasir_cpu

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("silu_and_mul(Tensor x) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  lib.def("rotary_(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) "
          "-> ()");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) {
  lib.impl("rms_norm", &kvasir_cpu::rms_norm);
  lib.impl("rotary_", &kvasir_cpu::rotary_);
  lib.impl("silu_and_mul", &kvasir_cpu::silu_and_mul);
}
