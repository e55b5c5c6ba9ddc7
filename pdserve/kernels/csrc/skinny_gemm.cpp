// y = x W^T (+ b) for the few rows of a decode step: a matrix-vector product at heart, bound
// by reading W once. The weight stays in its checkpoint layout [N, K] (rows contiguous), and
// a register tile of MT rows of x by NT rows of W walks K one vector at a time: each W vector
// loaded is used MT times, each x vector NT times, and the MT x NT sums reduce once at the
// end. Threads split N, so each streams its own contiguous stretch of W, and every step
// prefetches the rows kPrefetchTiles tiles ahead: one core's hardware prefetcher alone keeps
// too few lines in flight to read at the memory's speed (measured on 2 AVX2 cores, the
// llama-mid-like model's 94 MB of weights at one row: 23 GB/s with it, 14 GB/s without, and
// oneDNN's packed layout 14-17 GB/s). The AVX-512 builds ask for L2 (prefetcht1): a line
// asked for L1 holds one of the core's few fill buffers until it arrives, and there the four
// products of a cold batch-8 step took 9% longer that way (the AVX2 tile, measured on its
// own hosts with L1 requests, keeps them). fp32 only.
//
// Two builds of the tile, chosen by the compiler's target (-march=native):
// - AVX-512 (32 vector registers): 8 rows of x by 3 of W, 24 sums + 3 W vectors + 1 x vector.
//   A batch of 8 reads each W tile once, in one pass; more rows reuse it from L1 8 at a time.
//   This keeps the kernel ahead of oneDNN up to 32 rows (skinny_max_rows). Such a host takes
//   the panel form below instead wherever the weights were packed (pdserve/serve/parallel.py).
// - AVX2 (16 registers): 4 rows by 3, 12 sums; past 4 rows a W tile is re-read from L1 for
//   each group of 4, and oneDNN's packed layout wins past 12 rows.
#include "cpu_ops.h"
#include "simd.h"
#include <ATen/Parallel.h>
#include <type_traits>
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
    for (int n = 0; n < NT; ++n) __builtin_prefetch(ahead + (k * NT + n * 16) * 4, 0, 2);
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

#if defined(__AVX512F__)
// ---- The panel form (AVX-512): W prepacked so that x is broadcast, not reduced ------------
// The dot form above ends every tile with 24 horizontal sums and re-reads x vectors as often
// as W vectors; measured on one AVX-512 core it reaches half the FMA peak. Here W is packed
// once, at load, into panels of kPanel columns: panel p holds columns [48p, 48p + w) of W^T,
// k-major ([K, w] contiguous, w = 48 but for the last panel's N mod 48). A tile of MT rows
// of x then walks K one scalar at a time: 3 W vectors loaded, MT x values broadcast (folded
// into the FMAs), MT x 3 FMAs, and the sums are the outputs themselves, stored once. Every
// output is one fp32 FMA chain over k = 0, 1, ..., K - 1, whatever the batch, the tiling or
// the threads, so a row's result does not depend on the rows beside it. A panel (96 KiB at
// K = 512) stays in L2 while every tile of rows walks it.
//
// With W in L2 this form keeps the FMA units about twice as busy as the dot form (no sums
// across lanes); at a few rows both stream W at the memory's speed. It serves a prefill's
// rows too, close to oneDNN.
//
// Panels may also store bf16 or fp16 (pdserve/serve/parallel.py panel_dtype: only where that holds
// every value of the weight exactly, as for a half-precision checkpoint run in float32). A
// tile widens each loaded vector exactly and multiplies in fp32 as before, so the sums are
// the same bits, from half the bytes: a win where the products stream W (few rows), a small
// loss at hundreds of rows, where the widening costs compute.
constexpr int64_t kPanel = 48;        // columns of W per panel: 3 vectors of 16
constexpr int kPanelRows = 8;         // rows of x per tile: 8 x 3 sums + 3 W vectors + 1 x
constexpr int64_t kPanelBlockRows = 128;  // rows of x per pass over the panels (a prefill's
                                          // 256 KiB at K = 512 stays in L2 across them)
constexpr int64_t kPanelAhead = 8192;     // bytes of the panel stream asked for ahead

// A panel's 16 columns at row k as fp32: stored fp32, or bf16 / fp16 widened exactly (bf16 is
// fp32's upper half; fp16 converts in hardware), so a half-precision checkpoint's weights are
// read in half the bytes and multiplied as the very same fp32 values.
template <typename W>
inline __m512 load_columns(const W* p, __mmask16 mask, bool masked) {
  if constexpr (std::is_same_v<W, float>) {
    return masked ? _mm512_maskz_loadu_ps(mask, p) : _mm512_loadu_ps(p);
  } else {
    const __m256i h = masked ? _mm256_maskz_loadu_epi16(mask, p)
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<W, at::Half>) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// y[m, 0:width) = x[m, :] . panel[:, 0:width) for MT rows of x, NV vectors of 16 columns.
// kMasked: the last vector is partial (width not a multiple of 16; a masked load every step
// is much slower, so only such a panel pays it). Each step also asks for `lines` cache
// lines at `fetch`, then moves `fetch` on by `fetch_step` bytes (see panel_linear): into L2,
// or, where `once` (no other tile reads this panel), non-temporally (see panel_product).
template <int MT, int NV, bool kMasked, typename W>
void panel_tile(const float* x, int64_t ldx, const W* panel, int64_t width, int64_t K,
                float* y, int64_t ldy, __mmask16 last, const char* fetch, int64_t fetch_step,
                int lines, bool once) {
  __m512 acc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NV; ++n) acc[m][n] = _mm512_setzero_ps();
  const W* row = panel;
  for (int64_t k = 0; k < K; ++k, row += width, fetch += fetch_step) {
    if (once)
      for (int j = 0; j < lines; ++j) __builtin_prefetch(fetch + 64 * j, 0, 0);
    else
      for (int j = 0; j < lines; ++j) __builtin_prefetch(fetch + 64 * j, 0, 2);
    __m512 wv[NV];
    for (int n = 0; n < NV; ++n)
      wv[n] = load_columns(row + 16 * n, last, kMasked && n == NV - 1);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int n = 0; n < NV; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NV; ++n)
      _mm512_mask_storeu_ps(y + m * ldy + 16 * n, n == NV - 1 ? last : 0xFFFF, acc[m][n]);
}

template <typename W>
using PanelTileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t,
                             __mmask16, const char*, int64_t, int, bool);

template <int MT, typename W>
PanelTileFn<W> panel_pick(int nv, bool masked) {
  if (masked) return nv == 3 ? panel_tile<MT, 3, true, W> : nv == 2 ? panel_tile<MT, 2, true, W>
                                                                    : panel_tile<MT, 1, true, W>;
  return nv == 3 ? panel_tile<MT, 3, false, W> : nv == 2 ? panel_tile<MT, 2, false, W>
                                                         : panel_tile<MT, 1, false, W>;
}

template <typename W>
PanelTileFn<W> panel_tile_for(int mt, int nv, bool masked) {
  switch (mt) {
    case 8: return panel_pick<8, W>(nv, masked);
    case 7: return panel_pick<7, W>(nv, masked);
    case 6: return panel_pick<6, W>(nv, masked);
    case 5: return panel_pick<5, W>(nv, masked);
    case 4: return panel_pick<4, W>(nv, masked);
    case 3: return panel_pick<3, W>(nv, masked);
    case 2: return panel_pick<2, W>(nv, masked);
    default: return panel_pick<1, W>(nv, masked);
  }
}

// panel_linear's body for panels stored as W (float, at::BFloat16 or at::Half).
// With a bias (else null), each task adds it to the columns it computed, as add_bias would
// after the product; with a team, this thread's tasks only (see Team).
template <typename W>
void panel_product(const float* xp, int64_t ldx, const W* wp, int64_t M, int64_t N, int64_t K,
                   float* yp, const float* bias = nullptr, const Team* team = nullptr) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t num_blocks = (M + kPanelBlockRows - 1) / kPanelBlockRows;
  const int64_t size = static_cast<int64_t>(sizeof(W));
  const int64_t row_bytes = kPanel * size;  // a full panel's row
  // Rows [b0, b1) times columns [16 va, 16 vb) of panel p (a panel's vectors of 16 columns:
  // all of them, or a thread's share of a panel split between two threads). `fetched`: the
  // task before, on this thread, asked for this panel's lines; `next`: this thread goes on to
  // panel p + 1.
  auto task = [&](int64_t b0, int64_t b1, int64_t p, int64_t va, int64_t vb, bool fetched,
                  bool next) {
    const int64_t width = std::min(kPanel, N - p * kPanel);
    const int64_t panel_vectors = (width + 15) / 16;
    const int nv = static_cast<int>(vb - va);
    // the panel's last vector is partial where width is not a multiple of 16
    const bool masked = width % 16 != 0 && vb == panel_vectors;
    const __mmask16 last = masked ? static_cast<__mmask16>((1u << (width % 16)) - 1u) : 0xFFFF;
    const W* panel = wp + p * kPanel * K;  // every panel before it is full
    // The tiles of rows after the first find the panel in L2. Up to 3 tiles ask for the
    // next panel's lines, split evenly, a line or more a step, so that memory streams while
    // they compute: from tile 0 where an earlier task fetched this panel (the task before,
    // panel p - 1), else from tile 1, tile 0 then asking for its own columns kPanelAhead
    // bytes ahead (their lines of a row a step), as a panel of one tile always does. Tile 0
    // shares the next panel's lines rather than asking again for its own, which are already
    // in L2 when the task before fetched them.
    const int64_t tiles = (b1 - b0 + kPanelRows - 1) / kPanelRows;
    // A panel that one tile walks (a decode step of up to 8 rows) is read once: its lines are
    // asked for non-temporally, so the weights' stream (97 MB a step, the llama-mid-like
    // model) leaves the rest of the cache hierarchy to what the step reads again: its KV, its
    // activations, the engine's own Python between steps. Tiles after the first re-read the
    // panel from L2: there it is asked for L2 as before.
    fetched = fetched && tiles > 1;
    next = next && tiles > 1;
    const int64_t first = fetched ? 0 : 1;  // the first tile that fetches the next panel
    const int64_t fetchers = std::min<int64_t>(tiles - first, 3);  // a row is 3 lines
    const int64_t share =  // lines of the next panel per fetching tile
        next && fetchers > 0 ? (row_bytes * K / 64 + fetchers - 1) / fetchers : 0;
    const int lines = static_cast<int>((share + K - 1) / K);  // per step
    const int64_t own_begin = 16 * va * size / 64 * 64, own_end = 16 * vb * size;
    const int own_lines = static_cast<int>((own_end - own_begin + 63) / 64);
    const char* own = reinterpret_cast<const char*>(panel) + own_begin + kPanelAhead;
    const char* next_panel = reinterpret_cast<const char*>(panel + kPanel * K);
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t m0 = b0 + i * kPanelRows;
      const int mt = static_cast<int>(std::min<int64_t>(kPanelRows, b1 - m0));
      const bool streams_own = i == 0 && !fetched;
      panel_tile_for<W>(mt, nv, masked)(
          xp + m0 * ldx, ldx, panel + 16 * va, width, K, yp + m0 * N + p * kPanel + 16 * va,
          N, last, streams_own ? own : next_panel + (i - first) * share * 64,
          streams_own ? width * size : lines * 64,
          streams_own ? own_lines : next && i < first + fetchers ? lines : 0, tiles == 1);
    }
    if (bias == nullptr) return;
    const int64_t c0 = p * kPanel + 16 * va, c1 = p * kPanel + std::min(width, 16 * vb);
    for (int64_t m = b0; m < b1; ++m)
      for (int64_t c = c0; c < c1; ++c) yp[m * N + c] += bias[c];
  };
  if (num_blocks == 1) {
    // A decode step's rows: threads split the columns 16 at a time, so each streams its own
    // stretch of W and the two take equal shares where a split by panels could not (11
    // panels at N = 512 went 6 and 5, and the fifth partial: a product 12% longer than its
    // threads' mean). A column's sum is the same whichever thread computes it.
    static_assert(kPanel == 3 * 16, "a panel is 3 vectors");
    const int64_t num_vectors = (N + 15) / 16;  // the last panel's last may be partial
    const int64_t grain = 3 * std::max<int64_t>(1, (64 << 10) / (row_bytes * K));  // ~64 KiB
    split_for(0, num_vectors, grain, team, [&](int64_t v0, int64_t v1) {
      const int64_t p0 = v0 / 3, p1 = (v1 - 1) / 3;
      for (int64_t p = p0; p <= p1; ++p)
        task(0, M, p, std::max(v0, 3 * p) - 3 * p, std::min(v1, 3 * p + 3) - 3 * p, p > p0,
             p < p1);
    });
    return;
  }
  // A prefill's rows: tasks are (block of rows, panel) pairs, panels inner, and the blocks
  // split too, which keeps the threads level where the panels are few (11 at N = 512).
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (row_bytes * K));  // ~64 KiB of W
  split_for(0, num_blocks * num_panels, grain, team, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t / num_panels * kPanelBlockRows, p = t % num_panels;
      const int64_t width = std::min(kPanel, N - p * kPanel);
      task(b0, std::min(M, b0 + kPanelBlockRows), p, 0, (width + 15) / 16,
           t > t0 && p > 0, t + 1 < t1 && p + 1 < num_panels);
    }
  });
}
#endif

}  // namespace

void add_bias(torch::Tensor& y, const c10::optional<torch::Tensor>& bias, const char* op) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == y.size(1) &&
                  bias->scalar_type() == torch::kFloat,
              op, ": bias [N] fp32");
  y.add_(*bias);
}

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
  add_bias(y, bias, "skinny_linear");
  return y;
}

int64_t panel_width() {
#if defined(__AVX512F__)
  return kPanel;
#else
  return 0;
#endif
}

// N of the W [N, K] that `panels` packs, for x [M, K]: its values must hold whole rows of K.
static int64_t panel_columns(const torch::Tensor& x, const torch::Tensor& panels) {
  const int64_t K = x.dim() == 2 ? x.size(1) : -1;
  TORCH_CHECK(K > 0 && panels.numel() % K == 0, "panel_linear: panels of ", panels.numel(),
              " values do not hold rows of K = ", K);
  return panels.numel() / K;
}

// x [M, K] (unit last stride), panels: W [N, K] packed by pdserve/serve/parallel.py pack_panels (N * K
// values, fp32, bf16 or fp16; N read off the size), bias [N] or None -> [M, N].
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels,
                           c10::optional<torch::Tensor> bias) {
  auto y = torch::empty({x.dim() == 2 ? x.size(0) : 0, panel_columns(x, panels)}, x.options());
  panel_linear_into(x, panels, y);
  add_bias(y, bias, "panel_linear");
  return y;
}

void panel_linear_into(const torch::Tensor& x, const torch::Tensor& panels, torch::Tensor& y) {
#if defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat,
              "panel_linear: x [M, K] fp32 with contiguous rows");
  const auto type = panels.scalar_type();
  TORCH_CHECK(panels.is_contiguous() && (type == torch::kFloat || type == torch::kBFloat16 ||
                                         type == torch::kHalf),
              "panel_linear: contiguous fp32, bf16 or fp16 panels");
  const int64_t M = x.size(0), K = x.size(1), N = panel_columns(x, panels);
  TORCH_CHECK(y.scalar_type() == torch::kFloat && y.is_contiguous() && y.dim() == 2 &&
              y.size(0) == M && y.size(1) == N, "panel_linear: y [M, N] fp32, contiguous");
  panel_linear_rows(x.data_ptr<float>(), x.stride(0), panels, M, N, K, y.data_ptr<float>(),
                    nullptr, nullptr);
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX-512 (panel_width() == 0)");
#endif
}

void panel_linear_rows(const float* x, int64_t ldx, const torch::Tensor& panels, int64_t M,
                       int64_t N, int64_t K, float* y, const float* bias, const Team* team) {
#if defined(__AVX512F__)
  const void* w = panels.data_ptr();
  if (panels.scalar_type() == torch::kFloat)
    panel_product(x, ldx, static_cast<const float*>(w), M, N, K, y, bias, team);
  else if (panels.scalar_type() == torch::kBFloat16)
    panel_product(x, ldx, static_cast<const at::BFloat16*>(w), M, N, K, y, bias, team);
  else
    panel_product(x, ldx, static_cast<const at::Half*>(w), M, N, K, y, bias, team);
#endif
}
