// x W^T for many rows (a prefill, or a decode step of many sequences) on Intel AMX, where W
// is a half-precision checkpoint's weight held in bf16 panels (skinny_gemm.cpp panel_linear,
// pdserve/serve/parallel.py panel_dtype) and x is fp32. AMX multiplies bf16 tiles into fp32 sums
// (TDPBF16PS, 16 x 16 outputs from 16 x 32 by 32 x 16 inputs), far past what the fp32 FMAs
// do; the catch is that x is fp32.
// So x is split into three bf16 pieces, x = x0 + x1 + x2 to within fp32's rounding (each
// piece the rounded remainder of the ones before), and every tile of W meets all three:
// products of two bf16 numbers are exact in fp32, so the sums carry x's full precision (the
// same error as an fp32 product against float64, or less; kernels' tests check it). Three
// passes on AMX still come out about twice as fast as the fp32 panels on the llama-mid-like
// model's products at 256-2048 rows (2 cores), and no second copy of W is kept: each task
// turns one 48-column panel into AMX's pair-interleaved (VNNI) layout in a thread-local
// buffer, then runs a chunk of rows against it (for many rows, every panel is repacked once
// per call instead: see amx_panel_linear).
//
// Rows are independent: a row's sums do not depend on the rows beside it, so a prompt gets
// the same bits whatever it is batched with on this path. They are not the panels' bits
// (the sums run in another order); pdserve/serve/parallel.py linear, and the fused decode loop
// (decode_step.cpp) alike, send only steps of at least amx_min_rows() rows here.
#include "cpu_ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PDSERVE_AMX 1
#endif

namespace {

// Fewer rows keep the panels: below about 32 rows the products stream W at the memory's
// speed on either path, and the tiles' set-up and the split of x into three pieces do not pay.
constexpr int64_t kAmxMinRows = 32;

#if defined(PDSERVE_AMX)
constexpr int64_t kPanel = 48;       // panel_linear's panel width: 3 tiles of 16 columns
constexpr int64_t kPieces = 3;       // bf16 pieces of x
constexpr int64_t kTileRows = 16;
constexpr int64_t kChunkRows = 128;  // rows run against one repacked panel (x stays in L2)
constexpr int64_t kRepackOnceChunks = 2;  // more chunks: repack every panel once per call

// Linux hands out AMX's tile state only to a process that asks (arch_prctl), once.
bool request_tiles() {
  static const bool granted =
      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2: sums for 16 rows x 3 x 16 columns; 3-5: W's 3 column tiles; 6: 16 rows of x.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Split rows [m0, m1) of x [M, K] into pieces [3][Mp][Kp] bf16, columns K..Kp zero.
void split_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t Mp,
                int64_t Kp, uint16_t* pieces) {
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t k = 0; k < Kp; k += 16) {  // past K the masked load reads zeros
      const __mmask16 mask = static_cast<__mmask16>(
          K - k >= 16 ? 0xFFFF : K > k ? (1u << (K - k)) - 1 : 0);
      __m512 rest = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
      for (int64_t p = 0; p < kPieces; ++p) {
        const __m256i piece = (__m256i)_mm512_cvtneps_pbh(rest);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pieces + (p * Mp + m) * Kp + k), piece);
        rest = _mm512_sub_ps(
            rest, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(piece), 16)));
      }
    }
  }
}

// One panel (k-major [K, width] bf16) as AMX B tiles: out[j][r][n][e] = panel[2r + e][16j + n],
// 3 column tiles x Kp / 2 pairs x 16 columns x 2; zero past width and K.
void repack_panel(const uint16_t* panel, int64_t width, int64_t K, int64_t Kp, uint16_t* out) {
  alignas(64) static const uint16_t order[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                 37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t j = 0; j < kPanel / 16; ++j) {
    const int64_t cols = std::clamp<int64_t>(width - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>(cols == 16 ? 0xFFFF : (1u << cols) - 1);
    for (int64_t r = 0; r < Kp / 2; ++r) {
      const int64_t k = 2 * r;
      const __m256i a = k < K ? _mm256_maskz_loadu_epi16(mask, panel + k * width + 16 * j)
                              : _mm256_setzero_si256();
      const __m256i b = k + 1 < K ? _mm256_maskz_loadu_epi16(mask, panel + (k + 1) * width + 16 * j)
                                  : _mm256_setzero_si256();
      _mm512_storeu_si512(out + (j * (Kp / 2) + r) * 32,
                          _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), interleave,
                                                    _mm512_castsi256_si512(b)));
    }
  }
}
#endif

}  // namespace

bool amx_available() {
#if defined(PDSERVE_AMX)
  return request_tiles();
#else
  return false;
#endif
}

int64_t amx_min_rows() { return kAmxMinRows; }

// x [M, K] fp32 (unit last stride), panels: W [N, K] in bf16 panels (panel_linear's layout),
// bias [N] or None -> [M, N] fp32.
torch::Tensor amx_panel_linear(torch::Tensor x, torch::Tensor panels,
                               c10::optional<torch::Tensor> bias) {
#if defined(PDSERVE_AMX)
  TORCH_CHECK(amx_available(), "amx_panel_linear: this process may not use AMX");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat,
              "amx_panel_linear: x [M, K] fp32 with contiguous rows");
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == torch::kBFloat16,
              "amx_panel_linear: contiguous bf16 panels");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && panels.numel() % K == 0, "amx_panel_linear: panels of ", panels.numel(),
              " values do not hold rows of K = ", K);
  const int64_t N = panels.numel() / K;
  const int64_t Kp = (K + 31) / 32 * 32, Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  // Every value is written once: rows [0, M) by split_rows, the padding rows [M, Mp) here.
  std::unique_ptr<uint16_t[]> pieces(new uint16_t[kPieces * Mp * Kp]);
  for (int64_t p = 0; p < kPieces; ++p)
    std::memset(pieces.get() + (p * Mp + M) * Kp, 0, (Mp - M) * Kp * sizeof(uint16_t));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    split_rows(xp, x.stride(0), m0, m1, K, Mp, Kp, pieces.get());
  });
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t num_chunks = (Mp + kChunkRows - 1) / kChunkRows;
  // Each panel in AMX's layout: repacked by the task that uses it, into a thread-local buffer
  // it then reads from L1/L2, or, past kRepackOnceChunks chunks of rows, once per call for
  // all of them before any product: a panel is otherwise repacked once per chunk, which at
  // many chunks is a large share of the call; at one or two chunks the thread-local copy,
  // still in cache, is the cheaper.
  // The call-wide buffer holds one W in bf16, for this call only.
  const int64_t panel_values = kPanel * Kp;
  std::unique_ptr<uint16_t[]> packed;
  if (num_chunks > kRepackOnceChunks) {
    packed.reset(new uint16_t[num_panels * panel_values]);
    at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        repack_panel(wp + p * kPanel * K, std::min(kPanel, N - p * kPanel), K, Kp,
                     packed.get() + p * panel_values);
    });
  }
  // Tasks: (chunk of rows, panel), panels inner, so a thread's run of tasks reads its chunk's
  // pieces from L2.
  at::parallel_for(0, num_chunks * num_panels, 1, [&](int64_t t0, int64_t t1) {
    configure_tiles();
    std::vector<uint16_t> tiles(packed ? 0 : panel_values);
    alignas(64) float sums[kTileRows][kPanel];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t chunk = t / num_panels, p = t % num_panels;
      const int64_t width = std::min(kPanel, N - p * kPanel);
      const uint16_t* b = packed ? packed.get() + p * panel_values : tiles.data();
      if (!packed) repack_panel(wp + p * kPanel * K, width, K, Kp, tiles.data());
      for (int64_t m0 = chunk * kChunkRows; m0 < std::min(Mp, (chunk + 1) * kChunkRows);
           m0 += kTileRows) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t kk = 0; kk < Kp / 32; ++kk) {
          _tile_loadd(3, b + (0 * (Kp / 2) + kk * 16) * 32, 64);
          _tile_loadd(4, b + (1 * (Kp / 2) + kk * 16) * 32, 64);
          _tile_loadd(5, b + (2 * (Kp / 2) + kk * 16) * 32, 64);
          for (int64_t piece = 0; piece < kPieces; ++piece) {
            _tile_loadd(6, pieces.get() + (piece * Mp + m0) * Kp + kk * 32, Kp * 2);
            _tile_dpbf16ps(0, 6, 3);
            _tile_dpbf16ps(1, 6, 4);
            _tile_dpbf16ps(2, 6, 5);
          }
        }
        _tile_stored(0, &sums[0][0], kPanel * 4);
        _tile_stored(1, &sums[0][16], kPanel * 4);
        _tile_stored(2, &sums[0][32], kPanel * 4);
        for (int64_t i = 0; i < std::min(kTileRows, M - m0); ++i)
          std::memcpy(yp + (m0 + i) * N + p * kPanel, sums[i], width * 4);
      }
    }
    _tile_release();
  });
  add_bias(y, bias, "amx_panel_linear");
  return y;
#else
  TORCH_CHECK(false, "amx_panel_linear: this build has no AMX (amx_available() is false)");
  return x;
#endif
}
