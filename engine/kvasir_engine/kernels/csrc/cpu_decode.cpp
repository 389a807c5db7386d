// The decoder layers of a Llama-family model for a decode-only batch, in one call (CPU):
// int8/int4 weights through the native products (with int8 activations, or float ones for a
// weight-only checkpoint's "int4wo" / "int8wo"), unquantized bfloat16 ones through oneDNN or
// the AVX512-BF16 products of cpu_bf16.cpp.
//
// A single-stream decode step of a 30-layer model is ~450 operator calls (norms, quantized
// products, rotary, the KV store, attention, the SwiGLU gate) plus the Python of 30 modules
// around them: measured on 2 AVX2 cores, about 9 of a 20 ms step went there, more than the
// weights took to stream. This chains the same native operators (cpu_ops.h) layer after layer
// with no return to Python; each does exactly what its torch.ops twin does, in the same order,
// so the outputs equal the eager path's. The LM head stays outside (the runner computes logits
// only for the rows it samples).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace {

enum class Method { kInt8, kInt4, kInt8Wo, kInt4Wo, kOneDnn, kBf16 };

// PyTorch's oneDNN product over a weight packed by mkldnn._reorder_linear_weight: the op the
// eager layers call (layers/onednn.py), reached through the dispatcher.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), c10::IValue(c10::string_view("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(c10::string_view(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One linear: its tensors in `weights` from `first` on (int8, int8wo: rows, scale; int4,
// int4wo: packed, scale, minimum; oneDNN: the packed bfloat16 weight).
struct Linear {
  at::TensorList weights;
  size_t first;
  Method method;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (method) {
      case Method::kInt4:
        return kvasir_cpu::int4_linear(x, weights[first], weights[first + 1],
                                       weights[first + 2], x.size(1));
      case Method::kInt4Wo:
        return kvasir_cpu::int4_linear_wo(x, weights[first], weights[first + 1],
                                          weights[first + 2], x.size(1));
      case Method::kInt8Wo:
        return kvasir_cpu::int8_linear_wo(x, weights[first], weights[first + 1], x.size(1));
      case Method::kOneDnn:
        return onednn_linear(x, weights[first]);
      case Method::kBf16:  // blocks of 16 columns: N is 16 x the blocks (layers/dense.py)
        return kvasir_cpu::bf16_linear(x, weights[first], 16 * weights[first].size(0));
      case Method::kInt8:
      default:
        return kvasir_cpu::int8_linear(x, weights[first], weights[first + 1], x.size(1));
    }
  }
};

}  // namespace

namespace kvasir_cpu {

at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& positions,
                         at::TensorList weights, c10::string_view method,
                         at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& slot_mapping,
                         int64_t max_len, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         double scale) {
  // hidden [M, H]: the decode tokens' embeddings; positions [M] int64; weights: per layer
  // input_norm [H], post_norm [H], qkv_bias ([0] when none), then the qkv, o, gate_up and
  // down products' tensors (quantized, or packed for oneDNN); then the final norm [H]. Caches
  // as decode_attention takes them, one pair per layer; slot_mapping [M] int64 -> the final
  // norm's output [M, H].
  TORCH_CHECK(method == "int8" || method == "int4" || method == "int8wo" || method == "int4wo" ||
                  method == "onednn" || method == "bf16",
              "decode_layers: method int8, int4, int8wo, int4wo, onednn or bf16");
  const Method kind = method == "int4"     ? Method::kInt4
                      : method == "int4wo" ? Method::kInt4Wo
                      : method == "int8wo" ? Method::kInt8Wo
                      : method == "onednn" ? Method::kOneDnn
                      : method == "bf16"   ? Method::kBf16
                                           : Method::kInt8;
  const size_t per_linear = kind == Method::kInt4 || kind == Method::kInt4Wo ? 3
                            : kind == Method::kOneDnn || kind == Method::kBf16 ? 1
                                                                               : 2;
  const size_t per_layer = 3 + 4 * per_linear;
  const size_t num_layers = k_caches.size();
  TORCH_CHECK(v_caches.size() == num_layers && weights.size() == num_layers * per_layer + 1,
              "decode_layers: ", weights.size(), " weights for ", num_layers, " layers of ",
              method);
  TORCH_CHECK(hidden.dim() == 2 && positions.numel() == hidden.size(0) &&
                  slot_mapping.numel() == hidden.size(0) && seq_lens.numel() == hidden.size(0),
              "decode_layers: one position, slot and context length per token");
  const int64_t m = hidden.size(0), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  at::Tensor x = hidden;
  c10::optional<at::Tensor> residual;
  for (size_t layer = 0; layer < num_layers; ++layer) {
    const size_t base = layer * per_layer;
    const Linear qkv_proj{weights, base + 3, kind};
    const Linear o_proj{weights, base + 3 + per_linear, kind};
    const Linear gate_up_proj{weights, base + 3 + 2 * per_linear, kind};
    const Linear down_proj{weights, base + 3 + 3 * per_linear, kind};
    auto [normed, new_residual] = rms_norm(x, weights[base], eps, residual);
    at::Tensor qkv = qkv_proj(normed);
    if (weights[base + 2].numel() > 0) qkv.add_(weights[base + 2]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({m, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({m, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({m, num_kv_heads, head_dim});
    rotary_(positions, q, k, cos, sin);
    const at::Tensor& k_cache = k_caches[layer];
    const at::Tensor& v_cache = v_caches[layer];
    k_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping,
                                                           k.to(k_cache.scalar_type()));
    v_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping,
                                                           v.to(v_cache.scalar_type()));
    at::Tensor attn = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_len,
                                       scale, 0);
    auto [post_normed, post_residual] =
        rms_norm(o_proj(attn.view({m, q_size})), weights[base + 1], eps, new_residual);
    x = down_proj(silu_and_mul(gate_up_proj(post_normed)));
    residual = post_residual;
  }
  return std::get<0>(rms_norm(x, weights.back(), eps, residual));
}

}  // namespace kvasir_cpu

TORCH_LIBRARY_FRAGMENT(kvasir_cpu, lib) {
  lib.def("decode_layers(Tensor hidden, Tensor positions, Tensor[] weights, str method, "
          "Tensor[] k_caches, Tensor[] v_caches, Tensor block_tables, Tensor seq_lens, "
          "Tensor slot_mapping, int max_len, Tensor cos, Tensor sin, int num_heads, "
          "int num_kv_heads, int head_dim, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvasir_cpu, CPU, lib) {
  lib.impl("decode_layers", &kvasir_cpu::decode_layers);
}

// oneDNN-packed weights are mkldnn tensors: a call holding them dispatches on MkldnnCPU.
TORCH_LIBRARY_IMPL(kvasir_cpu, MkldnnCPU, lib) {
  lib.impl("decode_layers", &kvasir_cpu::decode_layers);
}
