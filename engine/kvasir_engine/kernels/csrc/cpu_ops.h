// The native CPU operators, callable from C++ as well as through torch.ops.kvasir_cpu (the
// fused decode forward in cpu_decode.cpp chains them without a trip through Python).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace kvasir_cpu {

// cpu_quant.cpp: x [M, K] -> [M, N] in x's dtype. int8_linear takes w as [N, Kp] int8 rows or,
// where int8_vnni_supported() (a build with AVX-512 VNNI), packed by kernels/cpu.py's
// pack_int8_vnni into [ceil(N / 16), Kp / 4, 64] uint8.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       int64_t k);
bool int8_vnni_supported();
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& w_min, int64_t k);

// cpu_quant_wo.cpp: weight-only products, x [M, K] float32 | bfloat16 as it is (no activation
// quantization) -> [M, N] in x's dtype; scale in the checkpoint's dtype, the int4 minimum
// float32.
at::Tensor int4_linear_wo(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& minimum, int64_t k);
at::Tensor int8_linear_wo(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& scale,
                          int64_t k);

// cpu_bf16.cpp: x [M, K] bfloat16 -> [M, N] bfloat16 over w packed by kernels/cpu.py's
// pack_bf16_pairs ([ceil(N / 16), K / 2, 32] bfloat16), where bf16_dot_supported().
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t n);
bool bf16_dot_supported();

// cpu_layers.cpp
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual);
void rotary_(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
             const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);

// cpu_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t max_len, double scale,
                            int64_t chunk_blocks, bool wide = true);

// cpu_prefill.cpp: one request's causal prefill, bfloat16, where prefill_attention_supported()
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t seq_len, double scale);
bool prefill_attention_supported();

}  // namespace kvasir_cpu
