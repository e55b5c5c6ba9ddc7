// Causal prefill attention on the CPU (fp32, AVX-512): flash attention's tiling, for the
// prompts of a prefill step (pdserve/kernels/cpu_attention.py prefill_attention). torch's SDPA (its
// CPU flash kernel) reached 69-142 GFLOP/s at 256-2048 tokens on 2 Zen 5 cores (8 heads of
// 64 over 4 KV heads), under 0.3 of the panel product's 490 there, and took half of a
// 2048-token prefill. This kernel reaches 256-303 GFLOP/s on the same shapes; the
// llama-mid-like model's prefill of 256-2048 fresh tokens took 0.72-0.83 of its time.
//
// A work item is 16 query rows of one head. It walks the key tiles its rows may see, 16 keys
// each. A tile's scores are 16 vectors, key j's for the 16 rows: the rows' values of one
// dimension (one vector) times key j's (one broadcast), over the dimensions, so no sum runs
// across lanes and each row's running max and sum (online softmax) are lane-wise, with one
// exponential per tile for all 16 rows' rescales. The output rows then accumulate P V four
// rows at a time. Query row i of q_len sits at position k_len - q_len + i and sees the keys
// at positions up to its own (bottom-right alignment, as a prefill after a cached prefix
// needs). K is packed once per call, per KV head, dimension-major per tile, and every query
// head of its group reads it. A row's sums run in a fixed order, whatever the threads.
#include "cpu_ops.h"
#include "simd.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
namespace {

constexpr int64_t kRows = 16;  // query rows per item
constexpr int64_t kKeys = 16;  // keys per tile: one vector of scores per row

struct Heads {  // a [heads, length, dim] operand: element (h, t, d) at h * hs + t * ts + d
  const float* data;
  int64_t hs, ts;
  const float* row(int64_t h, int64_t t) const { return data + h * hs + t * ts; }
};

// o[i, 0:16 R) = o[i, 0:16 R) * rescale[i] + sum_j p[j, i] v_j for 4 rows i and keys j < n
// (p key-major: a key's weights for the 16 rows lie together).
template <int R>
inline void weighted_keys(const float* p, const float* rescale, int64_t n, const float* v,
                          int64_t vts, float* o, int64_t ldo) {
  __m512 acc[4][R];
  for (int i = 0; i < 4; ++i) {
    const __m512 r = _mm512_set1_ps(rescale[i]);
    for (int c = 0; c < R; ++c) acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * ldo + 16 * c), r);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 w[R];
    for (int c = 0; c < R; ++c) w[c] = _mm512_loadu_ps(v + j * vts + 16 * c);
    for (int i = 0; i < 4; ++i) {
      const __m512 pij = _mm512_set1_ps(p[j * kRows + i]);
      for (int c = 0; c < R; ++c) acc[i][c] = _mm512_fmadd_ps(pij, w[c], acc[i][c]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < R; ++c) _mm512_storeu_ps(o + i * ldo + 16 * c, acc[i][c]);
}

// One item: rows [r0, r0 + rows) of query head h, into out (its first row; rows out_ts
// apart). kt: its KV head's keys packed [tiles][dk][kKeys]; qs, o, p: scratch.
void attend_rows(const Heads& q, const float* kt, const Heads& v, int64_t h, int64_t hkv,
                 int64_t r0, int64_t rows, int64_t q_len, int64_t k_len, int64_t dk, int64_t dv,
                 float scale, float* qs, float* o, float* p, float* out, int64_t out_ts) {
  const int64_t offset = k_len - q_len;  // row i's position is offset + i
  // the rows scaled, dimension-major: a dimension's values for the 16 rows are one vector
  for (int64_t i = 0; i < kRows; ++i)
    for (int64_t d = 0; d < dk; ++d)
      qs[d * kRows + i] = i < rows ? q.row(h, r0 + i)[d] * scale : 0.f;
  std::fill(o, o + kRows * dv, 0.f);
  // Per row, as the lanes of a vector: the running max (from a finite floor, so that the
  // first rescale is e^(floor - max) = 0 rather than e^(-inf - -inf)) and the running sum.
  __m512 top = _mm512_set1_ps(-1e30f), sum = _mm512_setzero_ps();
  alignas(64) float rescale[kRows];
  const __mmask16 live = rows >= kRows ? 0xFFFF : static_cast<__mmask16>((1u << rows) - 1u);
  const int64_t last_key = offset + r0 + rows - 1;  // the last row's position
  for (int64_t c = 0; c * kKeys <= last_key; ++c) {
    const int64_t k0 = c * kKeys, n = std::min(kKeys, k_len - k0);
    const float* tile = kt + c * dk * kKeys;
    // s[j]: key j's scores for the 16 rows, one dimension at a time (the rows' values one
    // vector, the key's one broadcast): a row's max and sum are then lane-wise, with no sums
    // across lanes and one exponential per tile for the 16 rescales
    __m512 s[kKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dk; ++d) {
      const __m512 qv = _mm512_loadu_ps(qs + d * kRows);
      const float* kd = tile + d * kKeys;
#pragma GCC unroll 16
      for (int j = 0; j < kKeys; ++j) s[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kd[j]), s[j]);
    }
    // row i sees key j where offset + r0 + i >= k0 + j (and j < n)
    __mmask16 seen[kKeys];
    __m512 m = top;
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) {
      const int64_t from = k0 + j - offset - r0;  // the first row that sees key j
      seen[j] = j >= n || from >= kRows ? 0
                : from <= 0             ? live
                                        : static_cast<__mmask16>(live & (0xFFFFu << from));
      s[j] = _mm512_mask_blend_ps(seen[j], _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                  s[j]);
      m = _mm512_max_ps(m, s[j]);
    }
    const __m512 r = exp_nonpositive16(_mm512_sub_ps(top, m));
    _mm512_store_ps(rescale, r);
    top = m;
    __m512 total = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) {
      const __m512 e = _mm512_maskz_mov_ps(  // keys not seen weigh exactly 0
          seen[j], exp_nonpositive16(_mm512_sub_ps(s[j], m)));
      total = _mm512_add_ps(total, e);
      _mm512_storeu_ps(p + j * kRows, e);
    }
    sum = _mm512_fmadd_ps(sum, r, total);
    const float* vk = v.row(hkv, k0);
    for (int64_t i = 0; i < rows; i += 4)  // rows past `rows` are never read out
      for (int64_t d = 0; d < dv; d += 64) {
        const int64_t width = std::min<int64_t>(64, dv - d);
        float* oi = o + i * dv + d;
        const float* pi = p + i;
        if (width == 64) weighted_keys<4>(pi, rescale + i, n, vk + d, v.ts, oi, dv);
        else if (width == 48) weighted_keys<3>(pi, rescale + i, n, vk + d, v.ts, oi, dv);
        else if (width == 32) weighted_keys<2>(pi, rescale + i, n, vk + d, v.ts, oi, dv);
        else weighted_keys<1>(pi, rescale + i, n, vk + d, v.ts, oi, dv);
      }
  }
  alignas(64) float sums[kRows];
  _mm512_store_ps(sums, sum);
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = 1.f / sums[i];
    for (int64_t d = 0; d < dv; ++d) out[i * out_ts + d] = o[i * dv + d] * inv;
  }
}

}  // namespace
#endif

bool causal_attention_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// q [H, q_len, dk], k [Hkv, k_len, dk], v [Hkv, k_len, dv] (fp32, any strides with a unit
// last one; H a multiple of Hkv, dk and dv multiples of 16, q_len <= k_len) -> [H, q_len, dv].
torch::Tensor causal_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(causal_attention_available(), "causal_attention: this build has no AVX-512");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "causal_attention: 3-D operands");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
                  v.scalar_type() == torch::kFloat, "causal_attention: fp32 operands");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "causal_attention: contiguous last dimensions");
  const int64_t H = q.size(0), q_len = q.size(1), dk = q.size(2);
  const int64_t Hkv = k.size(0), k_len = k.size(1), dv = v.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && v.size(0) == Hkv && k.size(2) == dk &&
                  v.size(1) == k_len && q_len <= k_len && dk % 16 == 0 && dv % 16 == 0,
              "causal_attention: shapes q [H, Lq, 16m], k [Hkv, Lk, 16m], v [Hkv, Lk, 16n], "
              "Lq <= Lk");
  auto out = torch::empty({H, q_len, dv}, q.options());
#if defined(__AVX512F__)
  if (q_len == 0) return out;
  const int64_t tiles = (k_len + kKeys - 1) / kKeys;
  // K per KV head as [tiles][dk][kKeys] (keys past k_len zero): a tile's dimension d is one
  // vector, 4 KiB a tile at dk = 64.
  std::vector<float> kt(Hkv * tiles * dk * kKeys, 0.f);
  const Heads keys{k.data_ptr<float>(), k.stride(0), k.stride(1)};
  at::parallel_for(0, Hkv * tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const int64_t hk = w / tiles, c = w % tiles;
      float* tile = kt.data() + w * dk * kKeys;
      for (int64_t j = 0; j < std::min(kKeys, k_len - c * kKeys); ++j) {
        const float* row = keys.row(hk, c * kKeys + j);
        for (int64_t d = 0; d < dk; ++d) tile[d * kKeys + j] = row[d];
      }
    }
  });
  const Heads queries{q.data_ptr<float>(), q.stride(0), q.stride(1)};
  const Heads values{v.data_ptr<float>(), v.stride(0), v.stride(1)};
  float* const output = out.data_ptr<float>();
  const int64_t blocks = (q_len + kRows - 1) / kRows, group = H / Hkv;
  at::parallel_for(0, H * blocks, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qs(kRows * dk), o(kRows * dv), p(kRows * kKeys);
    for (int64_t w = b; w < e; ++w) {
      const int64_t h = w / blocks, r0 = (w % blocks) * kRows;
      attend_rows(queries, kt.data() + (h / group) * tiles * dk * kKeys, values, h, h / group,
                  r0, std::min(kRows, q_len - r0), q_len, k_len, dk, dv,
                  static_cast<float>(scale), qs.data(), o.data(), p.data(),
                  output + h * out.stride(0) + r0 * out.stride(1), out.stride(1));
    }
  });
#endif
  return out;
}
