#include "cpu_ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

// Rows this many positions ahead are prefetched: a memory latency's worth of rows.
constexpr int64_t kAhead = 8;

// One sequence's rows of one KV head in a paged cache plane (K or V): the row of position
// pos lies in block table[pos / block_size] at offset pos % block_size.
template <typename T>
struct PagedRows {
  const T* base;  // the plane, already offset to this KV head
  int64_t block_stride, token_stride;
  const int32_t* table;
  int64_t block_size, dim, len;

  const T* at(int64_t pos) const {
    return base + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
  }

  // Row pos as floats into out. Consecutive rows sit a token row apart and blocks anywhere,
  // so the hardware prefetcher falls behind: the row kAhead positions on is fetched now.
  void load(int64_t pos, float* out) const {
    if (pos + kAhead < len) {
      const char* ahead = reinterpret_cast<const char*>(at(pos + kAhead));
      for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64)
        __builtin_prefetch(ahead + b);
    }
    const T* row = at(pos);
    for (int64_t d = 0; d < dim; ++d) out[d] = as_float(row[d]);
  }
};

template <typename T>
void last_token_attention(
    const T* q, int64_t q_s, int64_t q_h,
    const T* k, int64_t k_b, int64_t k_t, int64_t k_h,
    const T* v, int64_t v_b, int64_t v_t, int64_t v_h,
    const int32_t* seq_lens, const int32_t* tables, int64_t table_stride,
    T* out, int64_t o_s, int64_t o_h,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t dk, int64_t dv,
    int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dk), acc(group * dv), inv_sum(group), scores,
        row(std::max(dk, dv));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, hk = item % num_kv_heads;
      const int64_t len = seq_lens[s];
      const int32_t* table = tables + s * table_stride;
      const PagedRows<T> keys{k + hk * k_h, k_b, k_t, table, block_size, dk, len};
      const PagedRows<T> values{v + hk * v_h, v_b, v_t, table, block_size, dv, len};
      for (int64_t g = 0; g < group; ++g) {
        const T* qr = q + s * q_s + (hk * group + g) * q_h;
        for (int64_t d = 0; d < dk; ++d) qf[g * dk + d] = as_float(qr[d]) * scale;
      }
      scores.assign(group * len, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {  // pass 1: every K row once
        keys.load(pos, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dk;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dk; ++d) dot += qg[d] * row[d];
          scores[g * len + pos] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax per query head
        float* sg = scores.data() + g * len;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t pos = 0; pos < len; ++pos) top = std::max(top, sg[pos]);
        float sum = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) {
          sg[pos] = std::exp(sg[pos] - top);
          sum += sg[pos];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {  // pass 2: every V row once
        values.load(pos, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + pos];
          float* ag = acc.data() + g * dv;
#pragma omp simd
          for (int64_t d = 0; d < dv; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* orow = out + s * o_s + (hk * group + g) * o_h;
        for (int64_t d = 0; d < dv; ++d) orow[d] = static_cast<T>(acc[g * dv + d] * inv_sum[g]);
      }
    }
  });
}

}  // namespace

// Paged decode attention reading the cache in place (see kernels/cpu_attention.py).
// query [S, H, Dk]; k_cache [blocks, bs, Hkv, Dk]; v_cache [blocks, bs, Hkv, Dv] (any strides
// with a unit last stride); seq_lens [S] int32 (>= 1); block_tables [S, max_blocks] int32.
torch::Tensor paged_last_token_attention(torch::Tensor query, torch::Tensor k_cache,
                                         torch::Tensor v_cache, torch::Tensor seq_lens,
                                         torch::Tensor block_tables, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "last dimensions must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
              k_cache.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 &&
              block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "seq_lens and block_tables must be int32 (tables row-contiguous)");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), dk = query.size(2);
  const int64_t num_kv_heads = k_cache.size(2), dv = v_cache.size(3);
  TORCH_CHECK(k_cache.size(3) == dk && num_heads % num_kv_heads == 0, "head shapes");
  auto seq_lens_c = seq_lens.contiguous();
  {  // bounds: a bad table must be an error, never a read outside the pool
    const int32_t* lens = seq_lens_c.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t bs = k_cache.size(1), max_blocks = block_tables.size(1);
    const int64_t num_blocks = std::min(k_cache.size(0), v_cache.size(0));
    TORCH_CHECK_VALUE(seq_lens.numel() == num_seqs && block_tables.size(0) == num_seqs,
                      "seq_lens and block_tables need one row per sequence");
    for (int64_t s = 0; s < num_seqs; ++s) {
      TORCH_CHECK_VALUE(lens[s] >= 1 && lens[s] <= max_blocks * bs, "sequence ", s,
                        " has length ", lens[s], " beyond its block table");
      for (int64_t b = 0; b < (lens[s] + bs - 1) / bs; ++b) {
        const int32_t id = tables[s * block_tables.stride(0) + b];
        TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block id ", id, " outside the pool");
      }
    }
  }
  auto out = torch::empty({num_seqs, num_heads, dv}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged", [&] {
    last_token_attention<scalar_t>(
        query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
        k_cache.data_ptr<scalar_t>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr<scalar_t>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        seq_lens_c.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
        block_tables.stride(0), out.data_ptr<scalar_t>(), out.stride(0), out.stride(1),
        num_seqs, num_heads, num_kv_heads, dk, dv, k_cache.size(1),
        static_cast<float>(scale));
  });
  return out;
}
