// pdserve's CPU kernels: one extension, built once per machine by pdserve/kernels/cpu_ops.py.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <memory>

// One thread of the team that runs a whole decode step inside one parallel region
// (decode_step.cpp). A kernel given one runs only this thread's share of its work, with no
// region of its own; the caller puts a barrier wherever the next op reads what others wrote.
struct Team {
  int64_t rank, size;
};

// at::parallel_for(begin, end, grain, f); with a team, f over this thread's share of the very
// split at::parallel_for makes with `size` threads (ATen/ParallelOpenMP.h: min(size,
// ceil(n / grain)) threads, equal chunks), so results never depend on which path ran.
template <typename F>
void split_for(int64_t begin, int64_t end, int64_t grain, const Team* team, const F& f) {
  if (team == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (begin >= end) return;
  int64_t threads = team->size;
  if (grain > 0) threads = std::min(threads, (end - begin + grain - 1) / grain);
  const int64_t chunk = (end - begin + threads - 1) / threads;
  const int64_t first = begin + team->rank * chunk;
  if (team->rank < threads && first < end) f(first, std::min(end, first + chunk));
}

// paged_attention.cpp
torch::Tensor paged_last_token_attention(torch::Tensor query, torch::Tensor k_cache,
                                         torch::Tensor v_cache, torch::Tensor seq_lens,
                                         torch::Tensor block_tables, double scale);
// The same attention for every layer of one decode step, fp32 query and caches (each layer's
// [2, blocks, bs, Hkv, D], K plane then V): planned once (the lengths and tables are the
// step's; checked here, so nothing throws in the region), then
// run by a team: attend() each thread's items, a barrier, merge() its share of the sequences
// split into several items (where needs_merge()). out [S, H, dv] contiguous.
class DecodeAttention {
 public:
  DecodeAttention(const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& seq_lens,
                  const torch::Tensor& block_tables, int64_t num_heads, double scale,
                  int64_t num_threads);
  ~DecodeAttention();
  bool needs_merge() const;
  void attend(const Team& team, size_t layer, const float* q, int64_t q_s, int64_t q_h,
              float* out) const;
  void merge(const Team& team, float* out) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};
// prefill_attention.cpp: causal attention of a prefill's rows (q [H, Lq, D] over k / v
// [Hkv, Lk, D], row i at position Lk - Lq + i), where the build has AVX-512.
bool causal_attention_available();
torch::Tensor causal_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale);
// fused_ops.cpp
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
// The two above on raw fp32 rows (outputs contiguous), as the fused decode loop calls them into
// its own buffers: the same arithmetic, so the same bits. r may be null, or sum itself.
// With a team, each runs its thread's share (see Team).
void add_rms_norm_rows(const float* x, int64_t ldx, const float* r, int64_t ldr,
                       const float* weight, float* out, float* sum, int64_t T, int64_t D,
                       double eps, const Team* team = nullptr);
void silu_and_mul_rows(const float* x, int64_t ldx, float* out, int64_t T, int64_t I,
                       const Team* team = nullptr);
void rotary_neox_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t rotary_dim);
// rotary_neox_ on raw rows: x [T, H, >= rotary_dim] with strides s0, s1; cos / sin rows of
// rotary_dim with strides lc, ls.
void rotary_neox_rows(float* x, int64_t s0, int64_t s1, int64_t T, int64_t H, const float* cos,
                      int64_t lc, const float* sin, int64_t ls, int64_t rotary_dim,
                      const Team* team = nullptr);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                    torch::Tensor slot_mapping);
// write_kv_cache's copy, fp32, with slots already checked: key / value rows [T, H, D] (strides
// k0, k1 / v0, v1), the cache's K plane at kc and V plane at vc ([slots, H, D] each); a row
// whose slot is negative (padding) is skipped.
void write_kv_rows(const float* key, int64_t k0, int64_t k1, const float* value, int64_t v0,
                   int64_t v1, float* kc, float* vc, const int64_t* slots, int64_t T,
                   int64_t H, int64_t D, const Team* team = nullptr);
// skinny_gemm.cpp
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight,
                            c10::optional<torch::Tensor> bias);
// y [M, N] += bias [N] fp32 where given (the products' shared epilogue); `op` names the
// caller in the error.
void add_bias(torch::Tensor& y, const c10::optional<torch::Tensor>& bias, const char* op);
// Up to how many rows skinny_linear beats the matmul library's packed weights, for this build.
int64_t skinny_max_rows();
// W packed in panels of panel_width() columns (0: this build has no panel kernel), stored in
// fp32, bf16 or fp16 and multiplied in fp32.
int64_t panel_width();
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels,
                           c10::optional<torch::Tensor> bias);
// panel_linear without a bias, into y [M, N] (fp32, rows contiguous).
void panel_linear_into(const torch::Tensor& x, const torch::Tensor& panels, torch::Tensor& y);
// The same on raw rows, already checked (decode_step.cpp): x [M, K] (row stride ldx), panels
// of `panels`' type packing W [N, K], into y [M, N]; with a team, this thread's share. The
// bias, where not empty, is added to the share's columns, as add_bias adds it after.
void panel_linear_rows(const float* x, int64_t ldx, const torch::Tensor& panels, int64_t M,
                       int64_t N, int64_t K, float* y, const float* bias, const Team* team);
// amx_gemm.cpp: x W^T on AMX for bf16 panels, steps of at least amx_min_rows() rows.
bool amx_available();
int64_t amx_min_rows();
torch::Tensor amx_panel_linear(torch::Tensor x, torch::Tensor panels,
                               c10::optional<torch::Tensor> bias);
// decode_step.cpp: a Llama-family decode step's layer loop (see there). The weights, caches and
// rotary tables are taken and checked once; run() takes a step's rows.
class DecodeLoop {
 public:
  DecodeLoop(std::vector<torch::Tensor> weights, int64_t num_layers, torch::Tensor cos_cache,
             torch::Tensor sin_cache, double eps, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, int64_t rotary_dim, double scale, int64_t amx_rows,
             c10::optional<torch::Tensor> final_norm, c10::optional<torch::Tensor> head);
  std::vector<torch::Tensor> run(torch::Tensor hidden, std::vector<torch::Tensor> kv_caches,
                                 torch::Tensor seq_lens, torch::Tensor block_tables,
                                 c10::optional<torch::Tensor> phase_seconds) const;

 private:
  std::vector<torch::Tensor> weights_;
  int64_t num_layers_;
  torch::Tensor cos_cache_, sin_cache_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double scale_;
  int64_t amx_rows_;
  c10::optional<torch::Tensor> final_norm_, head_;
  int64_t D_ = 0, q_size_ = 0, qkv_size_ = 0, inter_ = 0;
  std::vector<const float*> biases_;  // 4 a layer, null where absent
};
// threads.cpp
void pin_openmp_threads(std::vector<int64_t> cores);
