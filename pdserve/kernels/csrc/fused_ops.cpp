// The small per-layer ops of a decoder block, fused: at decode batch sizes each is a few
// microseconds of arithmetic behind several torch dispatches, so one call replaces many.
// fp32 only (callers keep the torch path for other dtypes); each follows Hugging Face's
// order of operations.
#include "cpu_ops.h"
#include "simd.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>

// (x + residual) normalised: returns {weight * (s / rms(s)), s} with s = x + residual (or x).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() &&
              weight.numel() == x.size(1), "weight");
  const int64_t T = x.size(0), D = x.size(1);
  auto sum = torch::empty({T, D}, x.options());
  auto out = torch::empty({T, D}, x.options());
  const float* rp = nullptr;
  int64_t ldr = 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                residual->scalar_type() == torch::kFloat, "residual");
    rp = residual->data_ptr<float>();
    ldr = residual->stride(0);
  }
  add_rms_norm_rows(x.data_ptr<float>(), x.stride(0), rp, ldr, weight.data_ptr<float>(),
                    out.data_ptr<float>(), sum.data_ptr<float>(), T, D, eps);
  return {out, sum};
}

// add_rms_norm's arithmetic on rows: out and sum [T, D] contiguous; r may be null (no
// residual) or sum itself (the residual updated in place: each element is read, then written).
void add_rms_norm_rows(const float* xp, int64_t ldx, const float* rp, int64_t ldr,
                       const float* wp, float* op, float* sp, int64_t T, int64_t D, double eps,
                       const Team* team) {
  split_for(0, T, std::max<int64_t>(1, 4096 / D), team, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* s = sp + t * D;
      const float* xr = xp + t * ldx;
      float squares = 0.f;
      if (rp) {
        const float* rr = rp + t * ldr;
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < D; ++d) { s[d] = xr[d] + rr[d]; squares += s[d] * s[d]; }
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < D; ++d) { s[d] = xr[d]; squares += s[d] * s[d]; }
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(D) + static_cast<float>(eps));
      float* o = op + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = wp[d] * (s[d] * inv);
    }
  });
}

// [T, 2I] (gate | up) -> [T, I] = silu(gate) * up, silu(g) = g * sigmoid(g), with
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (never overflows).
// Vectorised: a scalar exp per element cost 50 us a layer at a batch of 8 (llama-mid-like).
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 &&
              x.size(1) % 2 == 0, "x");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  silu_and_mul_rows(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), T, I);
  return out;
}

// silu_and_mul's arithmetic on rows: x [T, 2I] (row stride ldx) -> out [T, I] contiguous.
void silu_and_mul_rows(const float* xp, int64_t ldx, float* op, int64_t T, int64_t I,
                       const Team* team) {
  split_for(0, T, std::max<int64_t>(1, 16384 / I), team, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = xp + t * ldx;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      for (; j + 8 <= I; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // exp(-|g|)
        const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), gv);  // by g's sign bit
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
      }
#endif
      for (; j < I; ++j) {
        const float e = std::exp(-std::fabs(g[j])), r = 1.f / (1.f + e);
        o[j] = g[j] * (g[j] >= 0.f ? r : e * r) * u[j];
      }
    }
  });
}

// In place on x [T, H, D] (last dim contiguous; rows may be strided views into a fused QKV
// output): the first rotary_dim of each head rotated NeoX-style by token t's angles:
//   x1, x2 = halves of x[..., :rotary_dim];  x <- [x1 cos - x2 sin | x2 cos + x1 sin]
// with cos/sin [T, rotary_dim] (rows contiguous) laid out [freqs | freqs].
void rotary_neox_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t rotary_dim) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1, "x");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
              cos.size(1) == rotary_dim && cos.stride(1) == 1 && sin.stride(1) == 1 &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
              rotary_dim % 2 == 0 && rotary_dim <= x.size(2), "cos/sin [T, rotary_dim] fp32");
  rotary_neox_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), x.size(0), x.size(1),
                   cos.data_ptr<float>(), cos.stride(0), sin.data_ptr<float>(), sin.stride(0),
                   rotary_dim);
}

void rotary_neox_rows(float* xp, int64_t s0, int64_t s1, int64_t T, int64_t H, const float* cp,
                      int64_t lc, const float* sp, int64_t ls, int64_t rotary_dim,
                      const Team* team) {
  const int64_t half = rotary_dim / 2;
  split_for(0, T * H, std::max<int64_t>(1, 4096 / rotary_dim), team, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H;
      float* r = xp + t * s0 + h * s1;
      const float* c = cp + t * lc;
      const float* s = sp + t * ls;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = r[d], x2 = r[d + half];
        r[d] = x1 * c[d] - x2 * s[d];
        r[d + half] = x2 * c[d + half] + x1 * s[d + half];
      }
    }
  });
}

// kv_cache [2, blocks, bs, Hkv, D] (contiguous); key/value [T, Hkv, D] (last dim contiguous);
// token t goes to slot slot_mapping[t] = block * bs + offset. A negative slot is a padding
// row (a decode graph's bucket, pdserve/serve/executor/cuda_graphs.py): skipped, as every backend does.
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() &&
              kv_cache.scalar_type() == key.scalar_type() &&
              key.scalar_type() == value.scalar_type(), "cache");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 &&
              value.stride(2) == 1 && key.size(1) == kv_cache.size(3) &&
              key.size(2) == kv_cache.size(4), "key/value");
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  TORCH_CHECK_VALUE(slots.numel() == T, "a slot per row: ", slots.numel(), " for ", T);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(sl[t] < num_slots, "slot out of range");
  const int64_t plane = num_slots * H * D, row = H * D;
  if (kv_cache.scalar_type() == torch::kFloat) {
    float* cache = kv_cache.data_ptr<float>();
    write_kv_rows(key.data_ptr<float>(), key.stride(0), key.stride(1), value.data_ptr<float>(),
                  value.stride(0), value.stride(1), cache, cache + plane, sl, T, H, D);
    return;
  }
  const int64_t elem = kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t k0 = key.stride(0), k1 = key.stride(1), v0 = value.stride(0), v1 = value.stride(1);
  for (int64_t t = 0; t < T; ++t) {
    if (sl[t] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(cache + (sl[t] * row + h * D) * elem, kp + (t * k0 + h * k1) * elem, D * elem);
      std::memcpy(cache + (plane + sl[t] * row + h * D) * elem, vp + (t * v0 + h * v1) * elem,
                  D * elem);
    }
  }
}

void write_kv_rows(const float* kp, int64_t k0, int64_t k1, const float* vp, int64_t v0,
                   int64_t v1, float* kc, float* vc, const int64_t* sl, int64_t T, int64_t H,
                   int64_t D, const Team* team) {
  split_for(0, T, std::max<int64_t>(1, 65536 / (2 * H * D * 4)), team, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (sl[t] < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kc + (sl[t] * H + h) * D, kp + t * k0 + h * k1, D * sizeof(float));
        std::memcpy(vc + (sl[t] * H + h) * D, vp + t * v0 + h * v1, D * sizeof(float));
      }
    }
  });
}
