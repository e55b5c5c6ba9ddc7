// y = x W^T (+ b) for the few rows of a decode step: a matrix-vector product at heart, bound
// by reading W once. The weight stays in its checkpoint layout [N, K] (rows contiguous), and
// a register tile of MT rows of x by NT rows of W walks K one vector at a time: each W vector
// loaded is used MT times, each x vector NT times, and the MT x NT sums reduce once at the
// end. Threads split N, so each streams its own contiguous stretch of W, and every step
// prefetches the rows kPrefetchTiles tiles ahead: one core's hardware prefetcher alone keeps
// too few lines in flight to read at the memory's speed (measured on 2 AVX2 cores, the
// llama-mid-like model's 94 MB of weights at one row: 23 GB/s with it, 14 GB/s without, and
// oneDNN's packed layout 14-17 GB/s). fp32 only.
//
// Two builds of the tile, chosen by the compiler's target (-march=native):
// - AVX-512 (32 vector registers): 8 rows of x by 3 of W, 24 sums + 3 W vectors + 1 x vector.
//   A batch of 8 reads each W tile once, in one pass; more rows reuse it from L1 8 at a time.
//   This keeps the kernel ahead of oneDNN up to 32 rows (kSkinnyMaxRows).
// - AVX2 (16 registers): 4 rows by 3, 12 sums; past 4 rows a W tile is re-read from L1 for
//   each group of 4, and oneDNN's packed layout wins past 12 rows.
#include "cpu_ops.h"
#include "simd.h"
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kNT = 3;             // rows of W per tile
constexpr int kPrefetchTiles = 2;  // how far ahead W is requested (12 KiB at K = 512)

#if defined(__AVX512F__)
constexpr int kMaxMT = 8;  // rows of x per tile: 8 x 3 sums + 3 W vectors + 1 x of 32 registers

template <int MT, int NT>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                 float* y, int64_t ldy) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t k16 = K / 16 * 16;
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchTiles * NT * ldw);
  for (int64_t k = 0; k < k16; k += 16) {
    // NT * 64 bytes of the W rows kPrefetchTiles tiles on, per step (see the AVX2 tile)
    for (int n = 0; n < NT; ++n) __builtin_prefetch(ahead + (k * NT + n * 16) * 4, 0, 3);
    __m512 wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = _mm512_loadu_ps(w + n * ldw + k);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = _mm512_reduce_add_ps(acc[m][n]);
      for (int64_t k = k16; k < K; ++k) s += x[m * ldx + k] * w[n * ldw + k];
      y[m * ldy + n] = s;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMaxMT = 4;  // rows of x per tile: 4 x 3 sums + 3 W vectors fit 16 registers

// y[m, n] = x_m . w_n for MT rows of x and NT rows of W (K a multiple of 8 up to k8, then
// a scalar tail).
template <int MT, int NT>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                 float* y, int64_t ldy) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t k8 = K / 8 * 8;
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchTiles * NT * ldw);
  for (int64_t k = 0; k < k8; k += 8) {
    // the W rows kPrefetchTiles tiles on lie right after these (W is contiguous): ask for
    // NT * 32 bytes of them per step, so they stream in while this tile computes
    __builtin_prefetch(ahead + k * 4 * NT, 0, 3);
    __builtin_prefetch(ahead + k * 4 * NT + 64, 0, 3);
    __m256 wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = _mm256_loadu_ps(w + n * ldw + k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t k = k8; k < K; ++k) s += x[m * ldx + k] * w[n * ldw + k];
      y[m * ldy + n] = s;
    }
}
#else
constexpr int kMaxMT = 4;

template <int MT, int NT>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                 float* y, int64_t ldy) {
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += x[m * ldx + k] * w[n * ldw + k];
      y[m * ldy + n] = s;
    }
}
#endif

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);

template <int MT>
constexpr TileFn pick(int nt) {
  return nt == 3 ? tile<MT, 3> : nt == 2 ? tile<MT, 2> : tile<MT, 1>;
}

TileFn tile_for(int mt, int nt) {
  switch (mt) {
#if defined(__AVX512F__)
    case 8: return pick<8>(nt);
    case 7: return pick<7>(nt);
    case 6: return pick<6>(nt);
    case 5: return pick<5>(nt);
#endif
    case 4: return pick<4>(nt);
    case 3: return pick<3>(nt);
    case 2: return pick<2>(nt);
    default: return pick<1>(nt);
  }
}

}  // namespace

int64_t skinny_max_rows() {
#if defined(__AVX512F__)
  return 32;
#else
  return 12;
#endif
}

// x [M, K] (unit last stride), weight [N, K] contiguous, bias [N] or None -> [M, N].
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "skinny_linear: fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "skinny_linear: contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t num_tiles = (N + kNT - 1) / kNT;
  // About 64 KiB of W per task: enough to hide a thread hand-off, small enough to balance.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kNT * K * 4));
  at::parallel_for(0, num_tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kNT;
      const int nt = static_cast<int>(std::min<int64_t>(kNT, N - n0));
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMT) {
        const int mt = static_cast<int>(std::min<int64_t>(kMaxMT, M - m0));
        tile_for(mt, nt)(xp + m0 * ldx, ldx, wp + n0 * K, K, K, yp + m0 * N + n0, N);
      }
    }
  });
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat,
                "skinny_linear: bias [N] fp32");
    y.add_(*bias);
  }
  return y;
}
