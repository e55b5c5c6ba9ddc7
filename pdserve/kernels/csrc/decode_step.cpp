// A Llama-family decode step's layer loop in one call: the CPU's answer to capturing the step
// as a CUDA graph. At decode batch sizes each op of a layer is microseconds of arithmetic (or a
// weight stream the skinny product runs at memory speed), but walking 8 layers of nn.Modules in
// Python costs about 0.3 ms a layer on this project's machines: on a small model, more than
// the matmuls. Here the loop runs the same kernels' arithmetic, in the same order, as the module
// path (pdserve/serve/models/llama.py): its outputs are bit-identical. It writes into activation
// buffers allocated once per call (the norms, the SiLU and the panel products on raw rows), so
// a layer allocates only its attention's output: at decode shapes an allocator call is a
// noticeable share of an op's few microseconds.
//
// Where every product has panels and the caches are fp32 (the usual case on an AVX-512 host),
// the whole loop is one parallel region (the team loop): each op runs every thread's share of
// the split its own region would have made, and the threads meet at a barrier where an op reads
// what another wrote. The attention is planned once for all layers. A region per op pays its
// fork and join on every product, a visible share of a batch-1 product's few tens of
// microseconds. Elsewhere (plain weights, AMX products, other cache dtypes) the loop calls
// each op's own region, op by op.
//
// A DecodeLoop takes the model's side once: the weights, the rotary tables, the final norm
// and the LM head, checked when it is made. run() takes a step's side: the embedded rows, the
// pool's caches, and each row's sequence length and block table. Row t is its sequence's next
// token, at position p = len - 1: its slot in the pool and its rows of the rotary tables
// follow from that (the module path's metadata holds them as slot_mapping and positions, and
// pdserve/serve/attention.DecodeMetadata builds those only when read). Checking the weights and
// splitting the caches once, not per step, keeps the call's own overhead to tens of
// microseconds, which at batch 1 is a share of the step worth saving.
//
// Per layer, with T decode rows (one token per sequence):
//   x, r   = add_rms_norm(h, r, ln1)                 r: the residual stream
//   qkv    = x W_qkv^T (+ b)                         [T, (H + 2 Hkv) D]
//   q, k   = rotary (NeoX) in place on qkv's views, at each row's position
//   cache  <- k, v at each row's slot; a = paged attention of q over the cache
//   h      = a W_o^T (+ b)
//   x, r   = add_rms_norm(h, r, ln2)
//   h      = silu_and_mul(x W_gu^T (+ b)) W_down^T (+ b)
// Weights come 10 per layer: ln1, W_qkv, b_qkv, W_o, b_o, ln2, W_gu, b_gu, W_down, b_down; an
// empty tensor stands for an absent bias; a W is plain [N, K] or packed in panels (1-D). fp32
// math (panels may hold a half-precision checkpoint's weights), one tensor-parallel rank.
//
// After the layers: with final_norm (the model's last RMSNorm, [hidden] fp32), run returns the
// normed hidden states and, with head (the LM head's panels) on the one-region loop below, their
// logits [T, vocab] from the same panel product pdserve/serve/parallel.linear runs, so the LM head's
// weights stream inside the region too (else the logits come back empty, for the caller to
// compute). Without final_norm: the last layer's output and the residual stream. In the
// region the LM head's panels stream right after the layers', instead of from a cold cache
// in a region of their own after a trip through Python.
//
// phase_seconds (float64 [3]), where given, gains the call's wall time in the products, the
// attention (its KV write included) and the rest (norms, rotary, SiLU): what
// benchmarks/step_roofline.py sets each part against its own ceiling with. The
// engine passes none.
#include "cpu_ops.h"

#include <omp.h>

#include <chrono>
#include <cstring>

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

// Whether pdserve/serve/parallel.py linear sends `rows` rows times W to AMX: bf16 panels, from amx_rows
// rows on (0: never).
bool takes_amx(const torch::Tensor& w, int64_t rows, int64_t amx_rows) {
  return amx_rows > 0 && rows >= amx_rows && w.dim() == 1 &&
         w.scalar_type() == torch::kBFloat16;
}

// y <- x W^T + b as pdserve/serve/parallel.py linear computes it: W packed in panels (a flat tensor)
// or plain [N, K]; bf16 panels on AMX from amx_rows rows on (0: never), as linear sends them.
// Panels multiply straight into y; the other products return a tensor, copied in. The bias
// (empty: none) is added after the product, as every path adds it.
void project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
             int64_t amx_rows, torch::Tensor& y) {
  if (w.dim() != 1)
    y.copy_(skinny_linear(x, w, c10::nullopt));
  else if (takes_amx(w, x.size(0), amx_rows))
    y.copy_(amx_panel_linear(x, w, c10::nullopt));
  else
    panel_linear_into(x, w, y);
  if (bias.numel() != 0) add_bias(y, bias, "DecodeLoop");
}

// The team loop applies where every product is a panel product on this build (no plain W, no
// AMX at this many rows) and the caches are fp32: each of its ops has a form that runs one
// thread's share (see Team in cpu_ops.h).
bool team_loop_applies(const std::vector<torch::Tensor>& weights,
                       const std::vector<torch::Tensor>& kv_caches, int64_t T,
                       int64_t amx_rows) {
  if (panel_width() == 0) return false;
  for (size_t i = 0; i < weights.size(); ++i) {
    const size_t j = i % kWeightsPerLayer;
    const bool matrix = j == 1 || j == 3 || j == 6 || j == 8;
    if (matrix && (weights[i].dim() != 1 || takes_amx(weights[i], T, amx_rows))) return false;
  }
  for (const auto& cache : kv_caches)
    if (cache.scalar_type() != torch::kFloat || cache.dim() != 5 || !cache.is_contiguous())
      return false;
  return true;
}

const float* bias_of(const torch::Tensor& bias, int64_t n) {
  if (bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n && bias.scalar_type() == torch::kFloat &&
                  bias.is_contiguous(), "DecodeLoop: bias [N] fp32");
  return bias.data_ptr<float>();
}

}  // namespace

DecodeLoop::DecodeLoop(std::vector<torch::Tensor> weights, int64_t num_layers,
                       torch::Tensor cos_cache, torch::Tensor sin_cache, double eps,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t rotary_dim, double scale, int64_t amx_rows,
                       c10::optional<torch::Tensor> final_norm,
                       c10::optional<torch::Tensor> head)
    : weights_(std::move(weights)), num_layers_(num_layers),
      cos_cache_(std::move(cos_cache)), sin_cache_(std::move(sin_cache)), eps_(eps),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      rotary_dim_(rotary_dim), scale_(scale), amx_rows_(amx_rows),
      final_norm_(std::move(final_norm)), head_(std::move(head)) {
  TORCH_CHECK(num_layers > 0 &&
                  weights_.size() == static_cast<size_t>(num_layers) * kWeightsPerLayer,
              "DecodeLoop: ", kWeightsPerLayer, " weights per layer, one layer at least");
  TORCH_CHECK(weights_[0].dim() == 1 && weights_[0].scalar_type() == torch::kFloat,
              "DecodeLoop: fp32 norms");
  D_ = weights_[0].numel();
  q_size_ = num_heads * head_dim;
  qkv_size_ = q_size_ + 2 * num_kv_heads * head_dim;
  inter_ = weights_[6].numel() / D_ / 2;  // W_gu holds 2I x D values, plain or in panels
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const torch::Tensor* w = weights_.data() + layer * kWeightsPerLayer;
    TORCH_CHECK(w[0].numel() == D_ && w[5].numel() == D_ && w[6].numel() == 2 * inter_ * D_ &&
                    w[1].numel() == qkv_size_ * D_ && w[3].numel() == D_ * q_size_ &&
                    w[8].numel() == D_ * inter_ && w[0].scalar_type() == torch::kFloat &&
                    w[5].scalar_type() == torch::kFloat,
                "DecodeLoop: layers of one shape, fp32 norms");
    biases_.insert(biases_.end(), {bias_of(w[2], qkv_size_), bias_of(w[4], D_),
                                   bias_of(w[7], 2 * inter_), bias_of(w[9], D_)});
  }
  TORCH_CHECK(cos_cache_.dim() == 2 && cos_cache_.sizes() == sin_cache_.sizes() &&
                  cos_cache_.size(1) == rotary_dim && cos_cache_.is_contiguous() &&
                  sin_cache_.is_contiguous() && cos_cache_.scalar_type() == torch::kFloat &&
                  sin_cache_.scalar_type() == torch::kFloat && rotary_dim % 2 == 0 &&
                  rotary_dim <= head_dim,
              "DecodeLoop: cos / sin tables [positions, rotary_dim] fp32");
  TORCH_CHECK(!final_norm_.has_value() || (final_norm_->scalar_type() == torch::kFloat &&
                                           final_norm_->is_contiguous() &&
                                           final_norm_->numel() == D_),
              "DecodeLoop: final_norm [hidden] fp32");
  TORCH_CHECK(!head_.has_value() || final_norm_.has_value(),
              "DecodeLoop: the LM head needs the final norm");
}

std::vector<torch::Tensor> DecodeLoop::run(torch::Tensor hidden,
                                           std::vector<torch::Tensor> kv_caches,
                                           torch::Tensor seq_lens, torch::Tensor block_tables,
                                           c10::optional<torch::Tensor> phase_seconds) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat &&
                  hidden.size(1) == D_ && hidden.stride(1) == 1,
              "DecodeLoop: hidden [T, hidden] fp32 with contiguous rows");
  TORCH_CHECK(!phase_seconds.has_value() ||
                  (phase_seconds->scalar_type() == torch::kDouble &&
                   phase_seconds->is_contiguous() && phase_seconds->numel() == 3),
              "DecodeLoop: phase_seconds float64 [3]");
  TORCH_CHECK(kv_caches.size() == static_cast<size_t>(num_layers_),
              "DecodeLoop: a cache per layer");
  const auto& cache = kv_caches[0];
  TORCH_CHECK(cache.dim() == 5 && cache.size(3) == num_kv_heads_ && cache.size(4) == head_dim_,
              "DecodeLoop: caches [planes, blocks, block_size, num_kv_heads, head_dim]");
  for (const auto& c : kv_caches)
    TORCH_CHECK(c.sizes() == cache.sizes() && c.scalar_type() == cache.scalar_type(),
                "DecodeLoop: caches of one shape and dtype");
  const int64_t T = hidden.size(0), D = D_, inter = inter_;
  const int64_t q_size = q_size_, qkv_size = qkv_size_, head_dim = head_dim_;
  const int64_t num_heads = num_heads_, num_kv_heads = num_kv_heads_;
  const int64_t rotary_dim = rotary_dim_, amx_rows = amx_rows_;
  const double eps = eps_;
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt32).contiguous();
  // Each row is one sequence's next token, at position len - 1: its slot in the pool and its
  // rows of the rotary tables follow from the lengths and the tables (what the module path's
  // metadata holds as slot_mapping and positions).
  TORCH_CHECK_VALUE(lens.dim() == 1 && lens.numel() == T && tables.dim() == 2 &&
                        tables.size(0) == T,
                    "DecodeLoop: a length and a block table per row");
  const int64_t bs = cache.size(2), num_blocks = cache.size(1);
  const int64_t num_slots = num_blocks * bs;
  auto options = hidden.options();
  auto slot_mapping = torch::empty({T}, options.dtype(torch::kLong));
  auto cos = torch::empty({T, rotary_dim}, options), sin = torch::empty({T, rotary_dim}, options);
  {
    const int32_t* len = lens.data_ptr<int32_t>();
    const int32_t* table = tables.data_ptr<int32_t>();
    int64_t* slot = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = static_cast<int64_t>(len[t]) - 1;
      TORCH_CHECK_VALUE(pos >= 0 && pos < cos_cache_.size(0) && pos / bs < tables.size(1),
                        "DecodeLoop: row ", t, " at position ", pos,
                        " outside its block table or the rotary tables");
      const int64_t id = table[t * tables.stride(0) + pos / bs];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block id ", id, " outside the pool");
      slot[t] = id * bs + pos % bs;
      std::memcpy(cos.data_ptr<float>() + t * rotary_dim,
                  cos_cache_.data_ptr<float>() + pos * rotary_dim, rotary_dim * sizeof(float));
      std::memcpy(sin.data_ptr<float>() + t * rotary_dim,
                  sin_cache_.data_ptr<float>() + pos * rotary_dim, rotary_dim * sizeof(float));
    }
  }
  // The step's activations, allocated once for every layer (fp32, rows contiguous): the
  // residual stream is updated in place, each layer's output goes to `out`.
  auto residual = torch::empty({T, D}, options), normed = torch::empty({T, D}, options);
  auto out = torch::empty({T, D}, options), qkv = torch::empty({T, qkv_size}, options);
  auto gate_up = torch::empty({T, 2 * inter}, options), act = torch::empty({T, inter}, options);
  PhaseClock clock(phase_seconds);
  const float* pf = final_norm_.has_value() ? final_norm_->data_ptr<float>() : nullptr;
  // The LM head multiplies here only on the one-region loop, as a panel product that
  // pdserve/serve/parallel.linear would also send to the panels (not to AMX).
  const c10::optional<torch::Tensor>& head = head_;
  const bool with_head = head.has_value() && head->dim() == 1 && head->is_contiguous() &&
                         head->numel() % D == 0 &&
                         (head->scalar_type() == torch::kFloat ||
                          head->scalar_type() == torch::kBFloat16 ||
                          head->scalar_type() == torch::kHalf) &&
                         !takes_amx(*head, T, amx_rows);
  const int64_t vocab = with_head ? head->numel() / D : 0;
  const auto& weights = weights_;

  const bool team = team_loop_applies(weights, kv_caches, T, amx_rows);
  auto logits = torch::empty({team && with_head ? T : 0, vocab}, options);
  if (team) {
    // One parallel region for the whole loop, a barrier wherever an op reads what another
    // thread wrote: no fork and join per op. Every op splits its work as its own region
    // would, so the bits are the same.
    const int64_t* sl = slot_mapping.data_ptr<int64_t>();
    const int threads = at::get_num_threads();
    const DecodeAttention attention(kv_caches, lens, tables, num_heads, scale_, threads);
    auto attn = torch::empty({T, q_size}, options);
    float *pn = normed.data_ptr<float>(), *pr = residual.data_ptr<float>();
    float *po = out.data_ptr<float>(), *pq = qkv.data_ptr<float>();
    float *pg = gate_up.data_ptr<float>(), *pa = act.data_ptr<float>();
    float* pt = attn.data_ptr<float>();
    const float *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
    const float* x0 = hidden.data_ptr<float>();
    const int64_t ld0 = hidden.stride(0), kv_size = num_kv_heads * head_dim;
#pragma omp parallel num_threads(threads)
    {
      const Team team{omp_get_thread_num(), omp_get_num_threads()};
      auto sync = [&](int part) {  // every thread waits for all; thread 0 times the part
#pragma omp barrier
        if (team.rank == 0) clock.mark(part);
      };
      const float* x = x0;  // the layer's input: the embedding, then `out`
      int64_t ldx = ld0;
      const float* r = nullptr;  // no residual before the first layer
      for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
        const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
        const float* const* b = biases_.data() + layer * 4;
        float* k_plane = kv_caches[layer].data_ptr<float>();
        add_rms_norm_rows(x, ldx, r, D, w[0].data_ptr<float>(), pn, pr, T, D, eps, &team);
        r = pr;
        sync(kOther);
        panel_linear_rows(pn, D, w[1], T, qkv_size, D, pq, b[0], &team);
        sync(kProducts);
        rotary_neox_rows(pq, qkv_size, head_dim, T, num_heads, pc, rotary_dim, ps, rotary_dim,
                         rotary_dim, &team);
        rotary_neox_rows(pq + q_size, qkv_size, head_dim, T, num_kv_heads, pc, rotary_dim, ps,
                         rotary_dim, rotary_dim, &team);
        sync(kOther);
        write_kv_rows(pq + q_size, qkv_size, head_dim, pq + q_size + kv_size, qkv_size,
                      head_dim, k_plane, k_plane + num_slots * kv_size, sl, T, num_kv_heads,
                      head_dim, &team);
#pragma omp barrier
        attention.attend(team, layer, pq, qkv_size, head_dim, pt);
        if (attention.needs_merge()) {
#pragma omp barrier
          attention.merge(team, pt);
        }
        sync(kAttention);
        panel_linear_rows(pt, q_size, w[3], T, D, q_size, po, b[1], &team);
        sync(kProducts);
        add_rms_norm_rows(po, D, r, D, w[5].data_ptr<float>(), pn, pr, T, D, eps, &team);
        sync(kOther);
        panel_linear_rows(pn, D, w[6], T, 2 * inter, D, pg, b[2], &team);
        sync(kProducts);
        silu_and_mul_rows(pg, 2 * inter, pa, T, inter, &team);
        sync(kOther);
        panel_linear_rows(pa, inter, w[8], T, D, inter, po, b[3], &team);
        sync(kProducts);
        x = po;
        ldx = D;
      }
      if (pf != nullptr) {
        add_rms_norm_rows(po, D, pr, D, pf, pn, pr, T, D, eps, &team);
        sync(kOther);
        if (logits.numel() != 0) {
          panel_linear_rows(pn, D, *head, T, vocab, D, logits.data_ptr<float>(), nullptr,
                            &team);
          sync(kProducts);
        }
      }
    }
    if (pf != nullptr) return {normed, logits};
    return {out, residual};
  }

  // Op by op: a parallel region per op, for plain weights (no AVX-512 panels), AMX products
  // and caches of other dtypes.
  const float* x = hidden.data_ptr<float>();  // the layer's input: the embedding, then `out`
  int64_t ldx = hidden.stride(0);
  const float* r = nullptr;  // no residual before the first layer
  // q, k, v: views of qkv's heads (write_kv_cache takes them strided)
  auto heads = qkv.view({T, num_heads + 2 * num_kv_heads, head_dim})
                   .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
  for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
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
    auto attn = paged_last_token_attention(heads[0], kv_caches[layer][0], kv_caches[layer][1],
                                           lens, tables, scale_);
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
  if (pf == nullptr) return {out, residual};
  add_rms_norm_rows(out.data_ptr<float>(), D, residual.data_ptr<float>(), D, pf,
                    normed.data_ptr<float>(), residual.data_ptr<float>(), T, D, eps);
  clock.mark(kOther);
  return {normed, logits};
}
