#include "cpu_ops.h"
#include "simd.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// Paged decode attention (see pdserve/kernels/cpu_attention.py for the picture). A work item is one
// sequence's chunk of context, whole blocks of it, with every KV head: a token's K (or V)
// rows for all heads lie side by side in the pool, so an item streams its blocks once per
// pass and the hardware prefetcher keeps up inside a block; the next block's rows, which lie
// anywhere, are prefetched by hand a block ahead. Long sequences split into several chunks
// (flash-decoding) so a small batch still uses every thread; their partial results merge at
// the end through their running max and sum.

namespace {

// Chunks are at least this many tokens (rounded up to whole blocks): shorter ones cost more
// to merge than they give back in parallelism.
constexpr int64_t kMinChunkTokens = 64;
// Aim for this many items per thread, so unequal sequence lengths still balance.
constexpr int64_t kItemsPerThread = 4;

#if defined(__AVX2__) && defined(__FMA__)

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  for (; d + 8 <= n; d += 8)
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
  float tail = 0.f;
  for (; d < n; ++d) tail += a[d] * b[d];
  return hsum(_mm256_add_ps(s0, s1)) + tail;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(y + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
  for (; d < n; ++d) y[d] += p * x[d];
}

// s[i] <- e^(s[i] - top); returns the sum.
inline float exp_shifted_sum(float* s, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), t));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - top));
  return sum;
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += p * x[d];
}

inline float exp_shifted_sum(float* s, int64_t n, float top) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - top));
  return sum;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Sums of 8 vectors, as one vector: lane i = sum of a[i]'s lanes.
inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                      __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[t] = q . k_t for 8 rows k_t = k + t * ts (dk a multiple of 8): q is loaded once per
// 8 columns for all 8 rows, and the 8 sums are reduced together.
inline void dot8(const float* q, const float* k, int64_t ts, int64_t dk, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < dk; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    const float* kd = k + d;
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd + ts), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd + 2 * ts), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd + 3 * ts), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd + 4 * ts), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd + 5 * ts), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd + 6 * ts), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kd + 7 * ts), a7);
  }
  _mm256_storeu_ps(out, reduce8(a0, a1, a2, a3, a4, a5, a6, a7));
}

// acc[0, 8 R) += sum_t p[t] v_t[0, 8 R) over n rows v_t = v + t * ts, acc held in registers.
template <int R>
inline void weighted_rows(const float* p, int64_t n, const float* v, int64_t ts, float* acc) {
  __m256 r[R];
  for (int j = 0; j < R; ++j) r[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pv = _mm256_set1_ps(p[t]);
    const float* vt = v + t * ts;
    for (int j = 0; j < R; ++j) r[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + 8 * j), r[j]);
  }
  for (int j = 0; j < R; ++j) _mm256_storeu_ps(acc + 8 * j, r[j]);
}

// Two query heads of one KV group at once, so every K (V) vector loaded serves both: a K
// row's load then feeds two FMAs, not one (load-bound -> FMA-bound). Each sum runs in the
// same order as its one-head counterpart's, so the results are the same bits.
// out0[j] = q0 . k_j, out1[j] = q1 . k_j for 4 rows k_j = k + j * ts (dk a multiple of 8).
inline void dot4x2(const float* q0, const float* q1, const float* k, int64_t ts, int64_t dk,
                   float* out0, float* out1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t d = 0; d < dk; d += 8) {
    const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
    const float* kd = k + d;
    const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + ts);
    const __m256 k2 = _mm256_loadu_ps(kd + 2 * ts), k3 = _mm256_loadu_ps(kd + 3 * ts);
    a0 = _mm256_fmadd_ps(x, k0, a0);
    b0 = _mm256_fmadd_ps(y, k0, b0);
    a1 = _mm256_fmadd_ps(x, k1, a1);
    b1 = _mm256_fmadd_ps(y, k1, b1);
    a2 = _mm256_fmadd_ps(x, k2, a2);
    b2 = _mm256_fmadd_ps(y, k2, b2);
    a3 = _mm256_fmadd_ps(x, k3, a3);
    b3 = _mm256_fmadd_ps(y, k3, b3);
  }
  const __m256 r = reduce8(a0, a1, a2, a3, b0, b1, b2, b3);
  _mm_storeu_ps(out0, _mm256_castps256_ps128(r));
  _mm_storeu_ps(out1, _mm256_extractf128_ps(r, 1));
}

// acc0[0, 8 R) += sum_t p0[t] v_t and acc1 likewise with p1, each v_t loaded once.
template <int R>
inline void weighted_rows2(const float* p0, const float* p1, int64_t n, const float* v,
                           int64_t ts, float* acc0, float* acc1) {
  __m256 r0[R], r1[R];
  for (int j = 0; j < R; ++j) {
    r0[j] = _mm256_loadu_ps(acc0 + 8 * j);
    r1[j] = _mm256_loadu_ps(acc1 + 8 * j);
  }
  for (int64_t t = 0; t < n; ++t) {
    const __m256 x = _mm256_set1_ps(p0[t]), y = _mm256_set1_ps(p1[t]);
    const float* vt = v + t * ts;
    for (int j = 0; j < R; ++j) {
      const __m256 w = _mm256_loadu_ps(vt + 8 * j);
      r0[j] = _mm256_fmadd_ps(x, w, r0[j]);
      r1[j] = _mm256_fmadd_ps(y, w, r1[j]);
    }
  }
  for (int j = 0; j < R; ++j) {
    _mm256_storeu_ps(acc0 + 8 * j, r0[j]);
    _mm256_storeu_ps(acc1 + 8 * j, r1[j]);
  }
}
#endif

#if defined(__AVX512F__)
// The AVX-512 forms (fp32 rows, dk and dv multiples of 16): a K or V vector holds 16 values,
// half the instructions of the AVX2 forms above for the same bytes. On a 2-core Zen 5 host,
// where memory reads ~110 GB/s, the AVX2 attention was bound by its instructions more than by
// memory: with every block table pointing into 128 KiB of KV (held in L2), 8 layers at batch
// 8 x 256 and 8 x 1024 took 80-90% of their time from memory. These forms (with the max below
// and the block prefetch as one range of lines) took 0.62-0.65 of the AVX2 time there, and
// 0.86-0.91 from memory, at batch 1-32 x 256-1024, the layers read between streams of weights.

// Lane i of the result = the sum of v[i]'s 16 lanes, for 8 vectors: halves, then quarters,
// of two vectors at a time are added, then the 4 lanes left of each.
inline __m256 reduce8x16(const __m512* v) {
  __m512 p[4];
  for (int i = 0; i < 4; ++i)  // [v_2i's 256-bit halves summed | v_2i+1's]
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  // 128-bit lane j of r0 (r1): v_j's (v_4+j's) quarters summed
  const __m512 r0 = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], 0x88),
                                  _mm512_shuffle_f32x4(p[0], p[1], 0xDD));
  const __m512 r1 = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], 0x88),
                                  _mm512_shuffle_f32x4(p[2], p[3], 0xDD));
  __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(r0, r1), _mm512_unpackhi_ps(r0, r1));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  // lane 4j holds v_j's sum, lane 4j + 1 v_4+j's
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, t));
}

// out[j] = q . k_j for 8 rows k_j = k + j * ts.
inline void dot8_512(const float* q, const float* k, int64_t ts, int64_t dk, float* out) {
  __m512 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dk; d += 16) {
    const __m512 x = _mm512_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + j * ts + d), a[j]);
  }
  _mm256_storeu_ps(out, reduce8x16(a));
}

// out0[j] = q0 . k_j and out1[j] = q1 . k_j for 8 rows, each K vector loaded once for both.
inline void dot8x2_512(const float* q0, const float* q1, const float* k, int64_t ts, int64_t dk,
                       float* out0, float* out1) {
  __m512 a[8], b[8];
  for (int j = 0; j < 8; ++j) a[j] = b[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dk; d += 16) {
    const __m512 x = _mm512_loadu_ps(q0 + d), y = _mm512_loadu_ps(q1 + d);
    for (int j = 0; j < 8; ++j) {
      const __m512 kv = _mm512_loadu_ps(k + j * ts + d);
      a[j] = _mm512_fmadd_ps(x, kv, a[j]);
      b[j] = _mm512_fmadd_ps(y, kv, b[j]);
    }
  }
  _mm256_storeu_ps(out0, reduce8x16(a));
  _mm256_storeu_ps(out1, reduce8x16(b));
}

// acc0[0, 16 R) += sum_t p0[t] v_t (and acc1 with p1 where kTwo), each v_t loaded once.
template <int R, bool kTwo>
inline void weighted_rows_512(const float* p0, const float* p1, int64_t n, const float* v,
                              int64_t ts, float* acc0, float* acc1) {
  __m512 r0[R], r1[R];
  for (int j = 0; j < R; ++j) {
    r0[j] = _mm512_loadu_ps(acc0 + 16 * j);
    if constexpr (kTwo) r1[j] = _mm512_loadu_ps(acc1 + 16 * j);
  }
  for (int64_t t = 0; t < n; ++t) {
    const __m512 x = _mm512_set1_ps(p0[t]);
    const float* vt = v + t * ts;
    if constexpr (kTwo) {
      const __m512 y = _mm512_set1_ps(p1[t]);
      for (int j = 0; j < R; ++j) {
        const __m512 w = _mm512_loadu_ps(vt + 16 * j);
        r0[j] = _mm512_fmadd_ps(x, w, r0[j]);
        r1[j] = _mm512_fmadd_ps(y, w, r1[j]);
      }
    } else {
      for (int j = 0; j < R; ++j) r0[j] = _mm512_fmadd_ps(x, _mm512_loadu_ps(vt + 16 * j), r0[j]);
    }
  }
  for (int j = 0; j < R; ++j) {
    _mm512_storeu_ps(acc0 + 16 * j, r0[j]);
    if constexpr (kTwo) _mm512_storeu_ps(acc1 + 16 * j, r1[j]);
  }
}

// acc0 (and acc1 where kTwo) += the p-weighted rows, 64 then 16 columns at a time; the
// columns past the last multiple of 16 are left to the caller (returned).
template <bool kTwo>
inline int64_t block_values_512(const float* p0, const float* p1, const float* v, int64_t ts,
                                int64_t dv, int64_t n, float* acc0, float* acc1) {
  int64_t d = 0;
  for (; d + 64 <= dv; d += 64)
    weighted_rows_512<4, kTwo>(p0, p1, n, v + d, ts, acc0 + d, acc1 + d);
  for (; d + 16 <= dv; d += 16)
    weighted_rows_512<1, kTwo>(p0, p1, n, v + d, ts, acc0 + d, acc1 + d);
  return d;
}
#endif

// The largest of s[0, n): the same value in any order, so 8 lanes at a time (a scalar loop's
// chain of dependent maxima took a sixth of a hot decode attention's time; 16-lane loads
// across the 8-lane stores of the scores were slower than these).
inline float max_of(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + t));
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  m = _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#endif
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// scores[t] = q . k_t for t < n (rows k + t * ts).
inline void block_scores(const float* q, const float* k, int64_t ts, int64_t dk, int64_t n,
                         float* scores) {
  int64_t t = 0;
#if defined(__AVX512F__)
  if (dk % 16 == 0)
    for (; t + 8 <= n; t += 8) dot8_512(q, k + t * ts, ts, dk, scores + t);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (dk % 8 == 0)
    for (; t + 8 <= n; t += 8) dot8(q, k + t * ts, ts, dk, scores + t);
#endif
  for (; t < n; ++t) scores[t] = dot(q, k + t * ts, dk);
}

// acc[0, dv) += sum_{t < n} p[t] v_t (rows v + t * ts).
inline void block_values(const float* p, const float* v, int64_t ts, int64_t dv, int64_t n,
                         float* acc) {
  int64_t d = 0;
#if defined(__AVX512F__)
  d = block_values_512<false>(p, nullptr, v, ts, dv, n, acc, nullptr);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; d + 64 <= dv; d += 64) weighted_rows<8>(p, n, v + d, ts, acc + d);
  for (; d + 8 <= dv; d += 8) weighted_rows<1>(p, n, v + d, ts, acc + d);
#endif
  if (d < dv)
    for (int64_t t = 0; t < n; ++t) axpy(p[t], v + t * ts + d, acc + d, dv - d);
}

// block_scores for two query heads of one KV group.
inline void block_scores2(const float* q0, const float* q1, const float* k, int64_t ts,
                          int64_t dk, int64_t n, float* s0, float* s1) {
  int64_t t = 0;
#if defined(__AVX512F__)
  if (dk % 16 == 0)
    for (; t + 8 <= n; t += 8) dot8x2_512(q0, q1, k + t * ts, ts, dk, s0 + t, s1 + t);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (dk % 8 == 0)
    for (; t + 4 <= n; t += 4) dot4x2(q0, q1, k + t * ts, ts, dk, s0 + t, s1 + t);
#endif
  for (; t < n; ++t) {
    s0[t] = dot(q0, k + t * ts, dk);
    s1[t] = dot(q1, k + t * ts, dk);
  }
}

// block_values for two query heads of one KV group.
inline void block_values2(const float* p0, const float* p1, const float* v, int64_t ts,
                          int64_t dv, int64_t n, float* acc0, float* acc1) {
  int64_t d = 0;
#if defined(__AVX512F__)
  d = block_values_512<true>(p0, p1, v, ts, dv, n, acc0, acc1);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; d + 32 <= dv; d += 32) weighted_rows2<4>(p0, p1, n, v + d, ts, acc0 + d, acc1 + d);
  for (; d + 8 <= dv; d += 8) weighted_rows2<1>(p0, p1, n, v + d, ts, acc0 + d, acc1 + d);
#endif
  if (d < dv)
    for (int64_t t = 0; t < n; ++t) {
      axpy(p0[t], v + t * ts + d, acc0 + d, dv - d);
      axpy(p1[t], v + t * ts + d, acc1 + d, dv - d);
    }
}

// Ask for the cache line at p now, in a way the compiler keeps: GCC 12 deletes a loop whose
// body is only __builtin_prefetch calls, so Plane::prefetch below compiled to nothing (and
// the decode attention of a batch whose KV is not in the L3 read at ~27 GB/s, not ~36).
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

// One plane (K or V) of a paged cache: rows at (block, offset, kv head).
template <typename T>
struct Plane {
  const T* base;
  int64_t block_stride, token_stride, head_stride, dim;

  const T* row(int64_t block, int64_t offset, int64_t head) const {
    return base + block * block_stride + offset * token_stride + head * head_stride;
  }

  // Rows [0, n) of a block, every KV head, as fp32: the cache itself for fp32 (row of token
  // t, head h at ptr + t * ts + h * hs), else upcast into buf [n, num_kv_heads, dim].
  const float* block(int64_t id, int64_t n, int64_t num_kv_heads, std::vector<float>& buf,
                     int64_t* ts, int64_t* hs) const {
    if constexpr (std::is_same_v<T, float>) {
      *ts = token_stride;
      *hs = head_stride;
      return row(id, 0, 0);
    } else {
      buf.resize(n * num_kv_heads * dim);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* r = row(id, t, h);
          float* o = buf.data() + (t * num_kv_heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<float>(r[d]);
        }
      *ts = num_kv_heads * dim;
      *hs = dim;
      return buf.data();
    }
  }

  // Ask for part `part` of `parts` of a block's first n rows (every KV head) now: blocks
  // lie anywhere, so no hardware prefetcher finds the next one. Spread over the current
  // block's work, the requests never queue up behind each other. Where a token's rows for
  // all KV heads lie side by side (the pool's layout), the block is one range of lines.
  void prefetch(int64_t id, int64_t n, int64_t num_kv_heads, int64_t part, int64_t parts) const {
    if (token_stride == num_kv_heads * dim && head_stride == dim) {
      const char* p = reinterpret_cast<const char*>(row(id, 0, 0));
      const int64_t lines = (n * token_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
      for (int64_t i = part * lines / parts, e = (part + 1) * lines / parts; i < e; ++i)
        prefetch_line(p + 64 * i);
      return;
    }
    const int64_t rows = n * num_kv_heads, row_bytes = dim * static_cast<int64_t>(sizeof(T));
    for (int64_t i = part * rows / parts; i < (part + 1) * rows / parts; ++i) {
      const char* r = reinterpret_cast<const char*>(row(id, i % n, i / n));
      for (int64_t b = 0; b < row_bytes; b += 64) prefetch_line(r + b);
    }
  }
};

struct Item {
  int64_t seq, begin, end;  // tokens [begin, end) of sequence seq; begin on a block edge
  int64_t slot;             // its partial result's slot, or -1: it is the whole sequence
};

struct Shape {
  int64_t num_heads, num_kv_heads, group, dk, dv, block_size;
};

// Attention of every query head of one sequence over tokens [begin, end): writes
// acc[h] = sum_t e^(s_t - top_h) V_t (unnormalised), top[h] and sum[h].
template <typename T>
void attend_chunk(const Item& item, const float* qf, const Plane<T>& keys,
                  const Plane<T>& values, const int32_t* table, const Shape& sh,
                  std::vector<float>& scores, std::vector<float>& rowbuf, float* acc,
                  float* top, float* sum) {
  const int64_t len = item.end - item.begin, bs = sh.block_size;
  scores.resize(sh.num_heads * len);
  const int64_t first_block = item.begin / bs, last_block = (item.end - 1) / bs;
  auto rows_in = [&](int64_t b) { return std::min(item.end, (b + 1) * bs) - b * bs; };
  int64_t ts = 0, hs = 0;
  // Query heads two at a time where a KV group holds an even number of them (GQA): a pair
  // always shares its KV head.
  const int64_t step = sh.group % 2 == 0 ? 2 : 1;
  // The item reads one stream of blocks, its K blocks then its V blocks, and asks for each
  // a block ahead, spread over the heads of the block before: the first K block now, the
  // first V block while the last K block computes: asking only within a pass would leave
  // each pass's first block to demand misses. One block ahead is enough to cover the
  // latency; asking further ahead only evicts lines still to be read.
  const int64_t num_blocks = last_block - first_block + 1;
  auto ask = [&](int64_t j, int64_t part, int64_t parts) {  // block j of the stream
    if (j >= 2 * num_blocks) return;
    const int64_t b = first_block + j % num_blocks;
    const Plane<T>& plane = j < num_blocks ? keys : values;
    plane.prefetch(table[b], rows_in(b), sh.num_kv_heads, part, parts);
  };
  ask(0, 0, 1);
  // pass 1: scores[h, t] = q_h . K_t, a block at a time
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t n = rows_in(b);
    const float* k = keys.block(table[b], n, sh.num_kv_heads, rowbuf, &ts, &hs);
    for (int64_t h = 0; h < sh.num_heads; h += step) {
      for (int64_t i = h; i < h + step; ++i) ask(b - first_block + 1, i, sh.num_heads);
      const float* kh = k + (h / sh.group) * hs;
      float* s = scores.data() + h * len + (b * bs - item.begin);
      if (step == 2)
        block_scores2(qf + h * sh.dk, qf + (h + 1) * sh.dk, kh, ts, sh.dk, n, s, s + len);
      else
        block_scores(qf + h * sh.dk, kh, ts, sh.dk, n, s);
    }
  }
  for (int64_t h = 0; h < sh.num_heads; ++h) {  // e^(s - max) per head
    float* s = scores.data() + h * len;
    const float m = max_of(s, len);
    top[h] = m;
    sum[h] = exp_shifted_sum(s, len, m);
  }
  std::fill(acc, acc + sh.num_heads * sh.dv, 0.f);
  // pass 2: acc[h] += p[h, t] V_t, a block at a time
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t n = rows_in(b);
    const float* v = values.block(table[b], n, sh.num_kv_heads, rowbuf, &ts, &hs);
    for (int64_t h = 0; h < sh.num_heads; h += step) {
      for (int64_t i = h; i < h + step; ++i)
        ask(num_blocks + b - first_block + 1, i, sh.num_heads);
      const float* vh = v + (h / sh.group) * hs;
      const float* p = scores.data() + h * len + (b * bs - item.begin);
      if (step == 2)
        block_values2(p, p + len, vh, ts, sh.dv, n, acc + h * sh.dv, acc + (h + 1) * sh.dv);
      else
        block_values(p, vh, ts, sh.dv, n, acc + h * sh.dv);
    }
  }
}

// How a step's attention splits: its items (whole sequences, or pieces of whole blocks) and
// each thread's contiguous run of them, [cut[t], cut[t + 1]). Partial results of split
// sequences go to slots: unnormalised acc, running max and sum per head.
struct Split {
  std::vector<Item> items;
  std::vector<int64_t> first_item;  // [num_seqs + 1]: each sequence's first item
  std::vector<int64_t> cut;         // [num_threads + 1]
  int64_t num_slots = 0, num_threads = 0;
  std::vector<float> part_acc, part_top, part_sum;
};

Split split_items(const int32_t* seq_lens, int64_t num_seqs, const Shape& sh, int64_t threads) {
  // Whole sequences, or pieces of whole blocks (as even as the blocks allow) when there are
  // fewer long sequences than threads can share.
  Split sp;
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += seq_lens[s];
  const int64_t want = kItemsPerThread * threads;
  int64_t chunk = std::max(kMinChunkTokens, (total + want - 1) / want);
  chunk = (chunk + sh.block_size - 1) / sh.block_size * sh.block_size;
  sp.first_item.resize(num_seqs + 1);
  for (int64_t s = 0; s < num_seqs; ++s) {
    sp.first_item[s] = static_cast<int64_t>(sp.items.size());
    const int64_t len = seq_lens[s];
    if (len <= chunk) {
      sp.items.push_back({s, 0, len, -1});
      continue;
    }
    const int64_t blocks = (len + sh.block_size - 1) / sh.block_size;
    const int64_t pieces = (len + chunk - 1) / chunk;  // at most `blocks`
    for (int64_t j = 0; j < pieces; ++j)
      sp.items.push_back({s, j * blocks / pieces * sh.block_size,
                          std::min(len, (j + 1) * blocks / pieces * sh.block_size),
                          sp.num_slots++});
  }
  sp.first_item[num_seqs] = static_cast<int64_t>(sp.items.size());
  // Each thread's items: a contiguous run of them (a thread then reads on from one sequence's
  // blocks into the next's), cut where the runs' tokens come closest to even shares. Runs of
  // equal item counts left a batch of unequal lengths unequal halves (a 1000- and a 900-token
  // sequence beside six short ones: 1675 tokens against 585). Which thread computes an item
  // does not change its result.
  const int64_t num_items = static_cast<int64_t>(sp.items.size());
  sp.num_threads = std::min<int64_t>(threads, num_items);
  sp.cut.assign(sp.num_threads + 1, num_items);
  if (sp.num_threads > 0) {
    sp.cut[0] = 0;
    int64_t done = 0, t = 1;
    for (int64_t i = 0; i < num_items; ++i) {
      const int64_t len = sp.items[i].end - sp.items[i].begin;
      // cut before item i where that lands nearer the share's end than cutting after it
      while (t < sp.num_threads && 2 * done * sp.num_threads + len * sp.num_threads >= 2 * t * total)
        sp.cut[t++] = i;
      done += len;
    }
  }
  sp.part_acc.resize(sp.num_slots * sh.num_heads * sh.dv);
  sp.part_top.resize(sp.num_slots * sh.num_heads);
  sp.part_sum.resize(sp.num_slots * sh.num_heads);
  return sp;
}

// Threads [t0, t1)'s items of a split: whole sequences to out, pieces to their slots.
// T: the query's and output's type; C: the cache's (T, or float8_e4m3fn for an FP8 cache,
// whose rows Plane::block upcasts like any other non-fp32 type).
template <typename T, typename C>
void attend_items(Split& sp, int64_t t0, int64_t t1, const T* q, int64_t q_s, int64_t q_h,
                  const Plane<C>& keys, const Plane<C>& values, const int32_t* tables,
                  int64_t table_stride, T* out, int64_t o_s, int64_t o_h, const Shape& sh,
                  float scale) {
  const int64_t H = sh.num_heads, dv = sh.dv;
  std::vector<float> qf(H * sh.dk), scores, rowbuf, acc(H * dv), top(H), sum(H);
  int64_t q_seq = -1;
  for (int64_t i = sp.cut[t0]; i < sp.cut[t1]; ++i) {
    const Item& item = sp.items[i];
    if (item.seq != q_seq) {
      q_seq = item.seq;
      for (int64_t h = 0; h < H; ++h) {
        const T* qr = q + item.seq * q_s + h * q_h;
        for (int64_t d = 0; d < sh.dk; ++d) qf[h * sh.dk + d] = static_cast<float>(qr[d]) * scale;
      }
    }
    const bool whole = item.slot < 0;
    float* a = whole ? acc.data() : sp.part_acc.data() + item.slot * H * dv;
    float* m = whole ? top.data() : sp.part_top.data() + item.slot * H;
    float* l = whole ? sum.data() : sp.part_sum.data() + item.slot * H;
    attend_chunk(item, qf.data(), keys, values, tables + item.seq * table_stride, sh, scores,
                 rowbuf, a, m, l);
    if (whole) {
      for (int64_t h = 0; h < H; ++h) {
        T* orow = out + item.seq * o_s + h * o_h;
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < dv; ++d) orow[d] = static_cast<T>(a[h * dv + d] * inv);
      }
    }
  }
}

// Sequences [s0, s1)'s pieces merged:
// out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
template <typename T>
void merge_items(const Split& sp, int64_t s0, int64_t s1, T* out, int64_t o_s, int64_t o_h,
                 const Shape& sh) {
  const int64_t H = sh.num_heads, dv = sh.dv;
  std::vector<float> merged(dv);
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t c0 = sp.first_item[s], c1 = sp.first_item[s + 1];
    if (sp.items[c0].slot < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      float top_all = -std::numeric_limits<float>::infinity();
      for (int64_t c = c0; c < c1; ++c)
        top_all = std::max(top_all, sp.part_top[sp.items[c].slot * H + h]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total_sum = 0.f;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t slot = sp.items[c].slot;
        const float w = std::exp(sp.part_top[slot * H + h] - top_all);
        total_sum += w * sp.part_sum[slot * H + h];
        axpy(w, sp.part_acc.data() + (slot * H + h) * dv, merged.data(), dv);
      }
      T* orow = out + s * o_s + h * o_h;
      const float inv = 1.f / total_sum;
      for (int64_t d = 0; d < dv; ++d) orow[d] = static_cast<T>(merged[d] * inv);
    }
  }
}

template <typename T, typename C>
void last_token_attention(
    const T* q, int64_t q_s, int64_t q_h, const Plane<C>& keys, const Plane<C>& values,
    const int32_t* seq_lens, const int32_t* tables, int64_t table_stride,
    T* out, int64_t o_s, int64_t o_h, int64_t num_seqs, const Shape& sh, float scale) {
  Split sp = split_items(seq_lens, num_seqs, sh, at::get_num_threads());
  at::parallel_for(0, sp.num_threads, 1, [&](int64_t t0, int64_t t1) {
    attend_items(sp, t0, t1, q, q_s, q_h, keys, values, tables, table_stride, out, o_s, o_h,
                 sh, scale);
  });
  if (sp.num_slots == 0) return;
  at::parallel_for(0, num_seqs, 1, [&](int64_t s0, int64_t s1) {
    merge_items(sp, s0, s1, out, o_s, o_h, sh);
  });
}

// A bad table must be an error, never a read outside the pool.
void check_tables(const int32_t* lens, const torch::Tensor& block_tables, int64_t num_seqs,
                  int64_t bs, int64_t num_blocks) {
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK_VALUE(lens[s] >= 1 && lens[s] <= max_blocks * bs, "sequence ", s,
                      " has length ", lens[s], " beyond its block table");
    for (int64_t b = 0; b < (lens[s] + bs - 1) / bs; ++b) {
      const int32_t id = tables[s * block_tables.stride(0) + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block id ", id, " outside the pool");
    }
  }
}

}  // namespace

// Paged decode attention reading the cache in place (see pdserve/kernels/cpu_attention.py).
// query [S, H, Dk]; k_cache [blocks, bs, Hkv, Dk]; v_cache [blocks, bs, Hkv, Dv] (any strides
// with a unit last stride); seq_lens [S] int32 (>= 1); block_tables [S, max_blocks] int32.
torch::Tensor paged_last_token_attention(torch::Tensor query, torch::Tensor k_cache,
                                         torch::Tensor v_cache, torch::Tensor seq_lens,
                                         torch::Tensor block_tables, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "last dimensions must be contiguous");
  const bool is_fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
              (is_fp8 || query.scalar_type() == k_cache.scalar_type()), "dtypes differ");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 &&
              block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "seq_lens and block_tables must be int32 (tables row-contiguous)");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), dk = query.size(2);
  const int64_t num_kv_heads = k_cache.size(2), dv = v_cache.size(3);
  TORCH_CHECK(k_cache.size(3) == dk && num_heads % num_kv_heads == 0, "head shapes");
  auto seq_lens_c = seq_lens.contiguous();
  TORCH_CHECK_VALUE(seq_lens.numel() == num_seqs && block_tables.size(0) == num_seqs,
                    "seq_lens and block_tables need one row per sequence");
  check_tables(seq_lens_c.data_ptr<int32_t>(), block_tables, num_seqs, k_cache.size(1),
               std::min(k_cache.size(0), v_cache.size(0)));
  auto out = torch::empty({num_seqs, num_heads, dv}, query.options());
  const Shape shape{num_heads, num_kv_heads, num_heads / num_kv_heads, dk, dv, k_cache.size(1)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged", [&] {
    auto run = [&](auto cache_type) {
      using C = decltype(cache_type);
      const Plane<C> keys{static_cast<const C*>(k_cache.data_ptr()), k_cache.stride(0),
                          k_cache.stride(1), k_cache.stride(2), dk};
      const Plane<C> values{static_cast<const C*>(v_cache.data_ptr()), v_cache.stride(0),
                            v_cache.stride(1), v_cache.stride(2), dv};
      last_token_attention<scalar_t, C>(
          query.data_ptr<scalar_t>(), query.stride(0), query.stride(1), keys, values,
          seq_lens_c.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
          block_tables.stride(0), out.data_ptr<scalar_t>(), out.stride(0), out.stride(1),
          num_seqs, shape, static_cast<float>(scale));
    };
    if (is_fp8)
      run(at::Float8_e4m3fn());
    else
      run(scalar_t());
  });
  return out;
}

struct DecodeAttention::State {
  std::vector<Plane<float>> keys, values;
  torch::Tensor lens, tables;  // kept alive for the raw pointers below
  const int32_t* table_rows;
  int64_t table_stride, num_seqs;
  Shape shape;
  float scale;
  mutable Split split;  // its partial-result buffers are written by attend()
};

DecodeAttention::DecodeAttention(const std::vector<torch::Tensor>& kv_caches,
                                 const torch::Tensor& seq_lens, const torch::Tensor& block_tables,
                                 int64_t num_heads, double scale, int64_t num_threads)
    : state_(std::make_unique<State>()) {
  TORCH_CHECK(!kv_caches.empty(), "DecodeAttention: layers");
  State& st = *state_;
  const auto& c0 = kv_caches[0];
  for (const auto& c : kv_caches) {
    TORCH_CHECK(c.dim() == 5 && c.size(0) == 2 && c.scalar_type() == torch::kFloat &&
                    c.stride(4) == 1 && c.sizes() == c0.sizes(),
                "DecodeAttention: fp32 caches [2, blocks, bs, Hkv, D] of one shape");
    // the K and V planes, without a tensor for each
    const float* k = c.data_ptr<float>();
    st.keys.push_back({k, c.stride(1), c.stride(2), c.stride(3), c.size(4)});
    st.values.push_back({k + c.stride(0), c.stride(1), c.stride(2), c.stride(3), c.size(4)});
  }
  st.lens = seq_lens.to(torch::kInt32).contiguous();
  st.tables = block_tables.to(torch::kInt32).contiguous();
  st.num_seqs = st.lens.numel();
  TORCH_CHECK_VALUE(st.tables.dim() == 2 && st.tables.size(0) == st.num_seqs,
                    "seq_lens and block_tables need one row per sequence");
  const int64_t num_kv_heads = c0.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "head shapes");
  check_tables(st.lens.data_ptr<int32_t>(), st.tables, st.num_seqs, c0.size(2), c0.size(1));
  st.table_rows = st.tables.data_ptr<int32_t>();
  st.table_stride = st.tables.stride(0);
  st.shape = {num_heads, num_kv_heads, num_heads / num_kv_heads, c0.size(4), c0.size(4),
              c0.size(2)};
  st.scale = static_cast<float>(scale);
  st.split = split_items(st.lens.data_ptr<int32_t>(), st.num_seqs, st.shape, num_threads);
}

DecodeAttention::~DecodeAttention() = default;

bool DecodeAttention::needs_merge() const { return state_->split.num_slots > 0; }

void DecodeAttention::attend(const Team& team, size_t layer, const float* q, int64_t q_s,
                             int64_t q_h, float* out) const {
  const State& st = *state_;
  const Shape& sh = st.shape;
  split_for(0, st.split.num_threads, 1, &team, [&](int64_t t0, int64_t t1) {
    attend_items(st.split, t0, t1, q, q_s, q_h, st.keys[layer], st.values[layer],
                 st.table_rows, st.table_stride, out, sh.num_heads * sh.dv, sh.dv, sh,
                 st.scale);
  });
}

void DecodeAttention::merge(const Team& team, float* out) const {
  const State& st = *state_;
  const Shape& sh = st.shape;
  split_for(0, st.num_seqs, 1, &team, [&](int64_t s0, int64_t s1) {
    merge_items(st.split, s0, s1, out, sh.num_heads * sh.dv, sh.dv, sh);
  });
}
