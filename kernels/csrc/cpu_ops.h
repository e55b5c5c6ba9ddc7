// pdserve's CPU kernels: one extension, built once per machine by kernels/cpu_ops.py.
#pragma once
#include <torch/extension.h>

// paged_attention.cpp
torch::Tensor paged_last_token_attention(torch::Tensor query, torch::Tensor k_cache,
                                         torch::Tensor v_cache, torch::Tensor seq_lens,
                                         torch::Tensor block_tables, double scale);
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
void add_rms_norm_rows(const float* x, int64_t ldx, const float* r, int64_t ldr,
                       const float* weight, float* out, float* sum, int64_t T, int64_t D,
                       double eps);
void silu_and_mul_rows(const float* x, int64_t ldx, float* out, int64_t T, int64_t I);
void rotary_neox_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t rotary_dim);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                    torch::Tensor slot_mapping);
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
// amx_gemm.cpp: x W^T on AMX for bf16 panels, steps of at least amx_min_rows() rows.
bool amx_available();
int64_t amx_min_rows();
torch::Tensor amx_panel_linear(torch::Tensor x, torch::Tensor panels,
                               c10::optional<torch::Tensor> bias);
// decode_step.cpp
std::vector<torch::Tensor> llama_decode_layers(
    torch::Tensor hidden, std::vector<torch::Tensor> weights,
    std::vector<torch::Tensor> kv_caches, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor slot_mapping, torch::Tensor seq_lens, torch::Tensor block_tables, double eps,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
    double scale, int64_t amx_rows, c10::optional<torch::Tensor> phase_seconds);
// threads.cpp
void pin_openmp_threads(std::vector<int64_t> cores);
