// A Llama-family decode step's layer loop in one call: the CPU's answer to capturing the step
// as a CUDA graph. At decode batch sizes each op of a layer is microseconds of arithmetic (or a
// weight stream the skinny product runs at memory speed), but walking 8 layers of nn.Modules in
// Python costs about 0.3 ms a layer on this project's machines: on a small model, more than
// the matmuls. Here the loop runs the same kernels' arithmetic, in the same order, as the module
// path (serve/models/llama.py): its outputs are bit-identical. It writes into activation
// buffers allocated once per call (the norms, the SiLU and the panel products on raw rows), so
// a layer allocates only its attention's output: an 8-layer call's own cost 195 -> 179 us at
// tiny shapes, decode steps of the llama-mid-like model 3.5-6% faster at batch 1 and 2-3.5% at
// batch 8 (interleaved A/B of the two builds, same bits).
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
//
// phase_seconds (float64 [3]), where given, gains the call's wall time in the products, the
// attention (its KV write included) and the rest (norms, rotary, SiLU): what
// benchmarks/step_roofline.py sets each part against its own ceiling with. The engine passes
// none.
#include "cpu_ops.h"

#include <chrono>

namespace {

constexpr size_t kWeightsPerLayer = 10;

// Adds the time since the last mark to one of phase_seconds' parts (nothing without them).
class PhaseClock {
 public:
  explicit PhaseClock(const c10::optional<torch::Tensor>& seconds)
      : parts_(seconds.has_value() ? seconds->data_ptr<double>() : nullptr) {
    if (parts_) last_ = std::chrono::steady_clock::now();
  }
  void mark(int part) {
    if (!parts_) return;
    const auto now = std::chrono::steady_clock::now();
    parts_[part] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  double* parts_;
  std::chrono::steady_clock::time_point last_;
};
enum Phase { kProducts = 0, kAttention = 1, kOther = 2 };

// y <- x W^T + b as serve/parallel.py linear computes it: W packed in panels (a flat tensor)
// or plain [N, K]; bf16 panels on AMX from amx_rows rows on (0: never), as linear sends them.
// Panels multiply straight into y; the other products return a tensor, copied in. The bias
// (empty: none) is added after the product, as every path adds it.
void project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
             int64_t amx_rows, torch::Tensor& y) {
  if (w.dim() != 1)
    y.copy_(skinny_linear(x, w, c10::nullopt));
  else if (amx_rows > 0 && x.size(0) >= amx_rows && w.scalar_type() == torch::kBFloat16)
    y.copy_(amx_panel_linear(x, w, c10::nullopt));
  else
    panel_linear_into(x, w, y);
  if (bias.numel() != 0) add_bias(y, bias, "llama_decode_layers");
}

}  // namespace

std::vector<torch::Tensor> llama_decode_layers(
    torch::Tensor hidden, std::vector<torch::Tensor> weights,
    std::vector<torch::Tensor> kv_caches, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor slot_mapping, torch::Tensor seq_lens, torch::Tensor block_tables, double eps,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
    double scale, int64_t amx_rows, c10::optional<torch::Tensor> phase_seconds) {
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
  // The step's activations, allocated once for every layer (fp32, rows contiguous): the
  // residual stream is updated in place, each layer's output goes to `out`.
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat && hidden.size(1) > 0 &&
              hidden.stride(1) == 1, "llama_decode_layers: hidden fp32 with contiguous rows");
  const int64_t D = hidden.size(1);
  const int64_t qkv_size = q_size + 2 * num_kv_heads * head_dim;
  auto options = hidden.options();
  auto residual = torch::empty({T, D}, options), normed = torch::empty({T, D}, options);
  auto out = torch::empty({T, D}, options), qkv = torch::empty({T, qkv_size}, options);
  // gate | up [T, 2I]: W_gu holds 2I x D values, plain or in panels
  const int64_t inter = weights.empty() ? 0 : weights[6].numel() / D / 2;
  auto gate_up = torch::empty({T, 2 * inter}, options), act = torch::empty({T, inter}, options);
  const float* x = hidden.data_ptr<float>();  // the layer's input: the embedding, then `out`
  int64_t ldx = hidden.stride(0);
  const float* r = nullptr;  // no residual before the first layer
  // q, k, v: views of qkv's heads (write_kv_cache takes them strided)
  auto heads = qkv.view({T, num_heads + 2 * num_kv_heads, head_dim})
                   .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
  TORCH_CHECK(!phase_seconds.has_value() ||
                  (phase_seconds->scalar_type() == torch::kDouble &&
                   phase_seconds->is_contiguous() && phase_seconds->numel() == 3),
              "llama_decode_layers: phase_seconds float64 [3]");
  PhaseClock clock(phase_seconds);
  for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    TORCH_CHECK(w[0].numel() == D && w[5].numel() == D && w[6].numel() == 2 * inter * D,
                "llama_decode_layers: layers of one shape");
    add_rms_norm_rows(x, ldx, r, D, w[0].data_ptr<float>(), normed.data_ptr<float>(),
                      residual.data_ptr<float>(), T, D, eps);
    r = residual.data_ptr<float>();
    clock.mark(kOther);
    project(normed, w[1], w[2], amx_rows, qkv);
    clock.mark(kProducts);
    rotary_neox_(heads[0], cos, sin, rotary_dim);
    rotary_neox_(heads[1], cos, sin, rotary_dim);
    clock.mark(kOther);
    write_kv_cache(heads[1], heads[2], kv_caches[layer], slot_mapping);
    auto attn = paged_last_token_attention(heads[0], k_caches[layer], v_caches[layer], lens,
                                           tables, scale);
    clock.mark(kAttention);
    project(attn.view({T, q_size}), w[3], w[4], amx_rows, out);
    clock.mark(kProducts);
    add_rms_norm_rows(out.data_ptr<float>(), D, r, D, w[5].data_ptr<float>(),
                      normed.data_ptr<float>(), residual.data_ptr<float>(), T, D, eps);
    clock.mark(kOther);
    project(normed, w[6], w[7], amx_rows, gate_up);
    clock.mark(kProducts);
    silu_and_mul_rows(gate_up.data_ptr<float>(), 2 * inter, act.data_ptr<float>(), T, inter);
    clock.mark(kOther);
    project(act, w[8], w[9], amx_rows, out);
    clock.mark(kProducts);
    x = out.data_ptr<float>();
    ldx = D;
  }
  if (kv_caches.empty()) return {hidden, hidden};
  return {out, residual};
}
