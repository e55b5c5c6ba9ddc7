// A Llama-family decode step's layer loop in one call: the CPU's answer to capturing the step
// as a CUDA graph. At decode batch sizes each op of a layer is microseconds of arithmetic (or a
// weight stream the skinny product runs at memory speed), but walking 8 layers of nn.Modules in
// Python costs about 0.3 ms a layer on this project's machines: on a small model, more than
// the matmuls. Here the loop calls the same kernels, in the same order and on the same
// tensors, as the module path (serve/models/llama.py): its outputs are bit-identical.
//
// Per layer, with T decode rows (one token per sequence):
//   x, r   = add_rms_norm(h, r, ln1)                 r: the residual stream
//   qkv    = x W_qkv^T (+ b)                         [T, (H + 2 Hkv) D]
//   q, k   = rotary (NeoX) in place on qkv's views
//   cache  <- k, v at slot_mapping; a = paged attention of q over the cache
//   h      = a W_o^T (+ b)
//   x, r   = add_rms_norm(h, r, ln2)
//   h      = silu_and_mul(x W_gu^T (+ b)) W_down^T (+ b)
// Weights come 10 per layer: ln1, W_qkv, b_qkv, W_o, b_o, ln2, W_gu, b_gu, W_down, b_down; an
// empty tensor stands for an absent bias; a W is plain [N, K] or packed in panels (1-D). fp32
// math (panels may hold a half-precision checkpoint's weights), one tensor-parallel rank.
#include "cpu_ops.h"

namespace {

constexpr size_t kWeightsPerLayer = 10;

torch::Tensor with_bias(torch::Tensor y, const torch::Tensor& bias) {
  return bias.numel() == 0 ? y : y + bias;  // the module path adds it after the product
}

c10::optional<torch::Tensor> optional_bias(const torch::Tensor& bias) {
  if (bias.numel() == 0) return c10::nullopt;
  return bias;
}

// x W^T (+ b) as serve/parallel.py linear computes it: W packed in panels (a flat tensor) or
// plain [N, K]; bf16 panels on AMX from amx_rows rows on (0: never), as linear sends them.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w,
                      c10::optional<torch::Tensor> bias, int64_t amx_rows) {
  if (w.dim() != 1) return skinny_linear(x, w, bias);
  if (amx_rows > 0 && x.size(0) >= amx_rows && w.scalar_type() == torch::kBFloat16)
    return amx_panel_linear(x, w, bias);
  return panel_linear(x, w, bias);
}

}  // namespace

std::vector<torch::Tensor> llama_decode_layers(
    torch::Tensor hidden, std::vector<torch::Tensor> weights,
    std::vector<torch::Tensor> kv_caches, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor slot_mapping, torch::Tensor seq_lens, torch::Tensor block_tables, double eps,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
    double scale, int64_t amx_rows) {
  TORCH_CHECK(weights.size() == kv_caches.size() * kWeightsPerLayer,
              "llama_decode_layers: ", kWeightsPerLayer, " weights per layer");
  TORCH_CHECK(hidden.dim() == 2, "llama_decode_layers: hidden [T, hidden]");
  const int64_t T = hidden.size(0);
  const int64_t q_size = num_heads * head_dim;
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt32);
  std::vector<torch::Tensor> k_caches, v_caches;  // each layer's planes, views of its pool
  for (const auto& cache : kv_caches) {
    auto planes = cache.unbind(0);
    k_caches.push_back(planes[0]);
    v_caches.push_back(planes[1]);
  }
  c10::optional<torch::Tensor> residual;
  for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const torch::Tensor& cache = kv_caches[layer];
    auto normed = add_rms_norm(hidden, residual, w[0], eps);
    residual = normed[1];
    // q, k, v: views of the product's heads (write_kv_cache takes them strided)
    auto heads = project(normed[0], w[1], optional_bias(w[2]), amx_rows)
                     .view({T, num_heads + 2 * num_kv_heads, head_dim})
                     .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
    rotary_neox_(heads[0], cos, sin, rotary_dim);
    rotary_neox_(heads[1], cos, sin, rotary_dim);
    write_kv_cache(heads[1], heads[2], cache, slot_mapping);
    auto attn = paged_last_token_attention(heads[0], k_caches[layer], v_caches[layer], lens,
                                           tables, scale);
    hidden = with_bias(project(attn.reshape({T, q_size}), w[3], c10::nullopt, amx_rows), w[4]);
    normed = add_rms_norm(hidden, residual, w[5], eps);
    residual = normed[1];
    auto gate_up = project(normed[0], w[6], optional_bias(w[7]), amx_rows);
    hidden = with_bias(project(silu_and_mul(gate_up), w[8], c10::nullopt, amx_rows), w[9]);
  }
  return {hidden, residual.has_value() ? *residual : hidden};
}
