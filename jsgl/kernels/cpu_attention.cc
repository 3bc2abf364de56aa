// Paged attention for decode and short extends, called through XLA's FFI (built by jsgl/kernels/cpu.py).
//
// jsgl_paged_attention: each new token of a request attends over the request's slots up to its own position,
//   read in place from the token-granular pool [Hkv, N, D] (XLA gathers a [B, Hkv, L, D] copy of K and V
//   first). K/V rows are read again for each new token, so it serves decode and extends of a few tokens
//   (jump-forward); prefill stays on the native path.

#include <cmath>
#include <cstring>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jsgl::Exp;
using jsgl::ParallelFor;

namespace {

// Lane i of the result is the sum of v[i]'s 16 lanes: a transpose-and-add tree, ~4x fewer shuffles than
// reducing the 16 vectors one by one.
inline __m512 SumLanes16(const __m512 v[16]) {
  __m512 u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1]
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's sums of v[4i .. 4i+3]
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // add 128-bit lanes pairwise, then once more across pairs
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t kMaxHeadDim = 256;
// Rows of K or V requested this many keys ahead: slots are scattered over the pool, so the hardware
// prefetcher cannot follow; one row ahead left a core at ~11 GB/s. V rows are requested
// while the scores are computed.
constexpr int64_t kPrefetchKeys = 16;

inline void PrefetchRow(const float* row, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

constexpr int64_t kMaxGroup = 16;

ffi::Error PagedAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> block_table,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len,
                          float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), bd = block_table.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || bd.size() != 2 || kd[2] != qd[2] || qd[1] % kd[0] != 0 ||
      qd[2] % 16 != 0 || qd[2] > kMaxHeadDim || qd[1] / kd[0] > kMaxGroup) {
    return ffi::Error::InvalidArgument(
        "jsgl_paged_attention: expected q [T, Hq, D], pools [Hkv, N, D], D % 16 == 0, D <= 256");
  }
  const int64_t num_tokens = qd[0], q_heads = qd[1], head_dim = qd[2];
  const int64_t kv_heads = kd[0], num_slots = kd[1], batch = bd[0], max_len = bd[1];
  const int64_t group = q_heads / kv_heads;
  const float *qs = q.typed_data(), *ks = k_pool.typed_data(), *vs = v_pool.typed_data();
  const int32_t *table = block_table.typed_data(), *lens = kv_lens.typed_data(), *pos = positions.typed_data();
  const int32_t *starts = q_start.typed_data(), *counts = q_len.typed_data();
  float* os = out->typed_data();
  std::memset(os, 0, sizeof(float) * num_tokens * q_heads * head_dim);  // padding rows stay zero

  ParallelFor(batch * kv_heads, [&](int64_t item) {
    const int64_t b = item / kv_heads, h = item % kv_heads;
    const int32_t* slots = table + b * max_len;
    const float* k_head = ks + h * num_slots * head_dim;
    const float* v_head = vs + h * num_slots * head_dim;
    for (int64_t t = 0; t < counts[b]; ++t) {  // a request's new tokens: keys up to each one's position
      const int64_t row = starts[b] + t;
      if (row < 0 || row >= num_tokens) continue;
      const int64_t len = std::min<int64_t>({pos[row] + 1, lens[b], max_len});
      if (len <= 0) continue;
      const float* q_rows = qs + (row * q_heads + h * group) * head_dim;  // this kv head's query group
      const int64_t vecs = head_dim / 16, padded = (len + 15) / 16 * 16;
      __m512 query[kMaxGroup][kMaxHeadDim / 16];  // pre-scaled
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < vecs; ++i)
          query[g][i] = _mm512_mul_ps(_mm512_loadu_ps(q_rows + g * head_dim + 16 * i), _mm512_set1_ps(scale));
      // Scores, 16 keys at a time: each key leaves one vector of partial products per query head, and
      // SumLanes16 finishes the 16 dot products together. Keys past len score -inf (weight 0).
      thread_local std::vector<float> scores;
      scores.resize(group * padded);
      for (int64_t j = 0; j < std::min(len, kPrefetchKeys); ++j) PrefetchRow(k_head + slots[j] * head_dim, head_dim);
      for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t n = std::min<int64_t>(16, len - j0);
        __m512 partial[kMaxGroup][16];
        for (int64_t jj = 0; jj < 16; ++jj) {
          const int64_t j = j0 + jj;
          if (j + kPrefetchKeys < len) PrefetchRow(k_head + slots[j + kPrefetchKeys] * head_dim, head_dim);
          if (j < len) PrefetchRow(v_head + slots[j] * head_dim, head_dim);  // for the weighted sum below
          for (int64_t g = 0; g < group; ++g) partial[g][jj] = _mm512_setzero_ps();
          if (jj >= n) continue;
          const float* key = k_head + static_cast<int64_t>(slots[j]) * head_dim;
          for (int64_t i = 0; i < vecs; ++i) {
            const __m512 k = _mm512_loadu_ps(key + 16 * i);
            for (int64_t g = 0; g < group; ++g) partial[g][jj] = _mm512_fmadd_ps(query[g][i], k, partial[g][jj]);
          }
        }
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
        for (int64_t g = 0; g < group; ++g)
          _mm512_storeu_ps(scores.data() + g * padded + j0,
                           _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), SumLanes16(partial[g])));
      }
      float inv_sum[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * padded;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < padded; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < padded; j += 16) {
          const __m512 x = _mm512_loadu_ps(s + j);
          const __m512 e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                                _mm512_setzero_ps(), Exp(_mm512_sub_ps(x, shift)));
          _mm512_storeu_ps(s + j, e);
          sum = _mm512_add_ps(sum, e);
        }
        inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
      }
      __m512 acc[kMaxGroup][kMaxHeadDim / 16];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < vecs; ++i) acc[g][i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < len; ++j) {
        const float* value = v_head + static_cast<int64_t>(slots[j]) * head_dim;
        for (int64_t i = 0; i < vecs; ++i) {
          const __m512 v = _mm512_loadu_ps(value + 16 * i);
          for (int64_t g = 0; g < group; ++g)
            acc[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * padded + j]), v, acc[g][i]);
        }
      }
      float* o_rows = os + (row * q_heads + h * group) * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < vecs; ++i)
          _mm512_storeu_ps(o_rows + g * head_dim + 16 * i, _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv_sum[g])));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jsgl_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
