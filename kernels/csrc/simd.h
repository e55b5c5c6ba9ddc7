// Small AVX2 helpers shared by pdserve's CPU kernels (compiled only where the CPU has AVX2 and
// FMA; every kernel keeps a plain C++ path for the others).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
