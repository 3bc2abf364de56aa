// Paged attention for decode and short extends, called through XLA's FFI (built by jsgl/kernels/cpu.py).
//
// jsgl_paged_attention: each new token of a request attends over the request's slots up to its own position,
//   read in place from the token-granular pool [Hkv, N, D] (XLA gathers a [B, Hkv, L, D] copy of K and V
//   first). K/V rows are read again for each new token, so it serves decode and extends of a few tokens
//   (jump-forward); prefill stays on the native path.

#include <cmath>
#include <cstring>
#include <optional>

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

// The shapes both handlers take: q [T, Hq, D], pools [Hkv, N, D], block_table [B, L].
struct Shapes {
  int64_t num_tokens, q_heads, head_dim, kv_heads, num_slots, batch, max_len;
};

template <typename Dims>
std::optional<Shapes> CheckShapes(const Dims& qd, const Dims& kd, const Dims& bd) {
  if (qd.size() != 3 || kd.size() != 3 || bd.size() != 2 || kd[2] != qd[2] || qd[1] % kd[0] != 0 ||
      qd[2] % 16 != 0 || qd[2] > kMaxHeadDim || qd[1] / kd[0] > kMaxGroup) {
    return std::nullopt;
  }
  return Shapes{qd[0], qd[1], qd[2], kd[0], kd[1], bd[0], bd[1]};
}

constexpr const char* kShapeError =
    "jsgl_paged_attention: expected q [T, Hq, D], pools [Hkv, N, D], D % 16 == 0, D <= 256, GQA group <= 16";

// out = attention of the (roped) queries qs over the pools, for every new token of every request.
void Attend(const Shapes& shape, const float* qs, const float* ks, const float* vs, const int32_t* pos,
            const int32_t* table, const int32_t* lens, const int32_t* starts, const int32_t* counts, float scale,
            float* os) {
  const int64_t num_tokens = shape.num_tokens, q_heads = shape.q_heads, head_dim = shape.head_dim;
  const int64_t kv_heads = shape.kv_heads, num_slots = shape.num_slots, max_len = shape.max_len;
  const int64_t group = q_heads / kv_heads;
  std::memset(os, 0, sizeof(float) * num_tokens * q_heads * head_dim);  // padding rows stay zero

  ParallelFor(shape.batch * kv_heads, [&](int64_t item) {
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
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> block_table,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len,
                          float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto shape = CheckShapes(q.dimensions(), k_pool.dimensions(), block_table.dimensions());
  if (!shape) return ffi::Error::InvalidArgument(kShapeError);
  Attend(*shape, q.typed_data(), k_pool.typed_data(), v_pool.typed_data(), positions.typed_data(),
         block_table.typed_data(), kv_lens.typed_data(), q_start.typed_data(), q_len.typed_data(), scale,
         out->typed_data());
  return ffi::Error::Success();
}

// Rotate-half RoPE of one head: out = x * cos + roll(x, D/2) * signed_sin ([-sin, sin] per half).
inline void Rope(const float* x, const float* cos, const float* signed_sin, int64_t head_dim, float* out) {
  const int64_t half = head_dim / 2;
  if (half % 16 == 0) {
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + half + i);
      _mm512_storeu_ps(out + i, _mm512_fmadd_ps(hi, _mm512_loadu_ps(signed_sin + i),
                                                _mm512_mul_ps(lo, _mm512_loadu_ps(cos + i))));
      _mm512_storeu_ps(out + half + i, _mm512_fmadd_ps(lo, _mm512_loadu_ps(signed_sin + half + i),
                                                       _mm512_mul_ps(hi, _mm512_loadu_ps(cos + half + i))));
    }
    return;
  }
  for (int64_t i = 0; i < head_dim; ++i) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * signed_sin[i];
}

// The layer's whole attention block after the q|k|v matmul: RoPE on the new tokens' q and k, their k and
// v written into the pools at write_slots (in place: the pools are aliased to the results), then
// attention as above. One custom call, reading q|k|v straight from the matmul's output, instead of four
// XLA ops per layer (three slices or fusions and the attention).
ffi::Error RopeWriteAttention(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> signed_sin,
                              ffi::Buffer<ffi::S32> write_slots, ffi::Buffer<ffi::F32> k_pool_in,
                              ffi::Buffer<ffi::F32> v_pool_in, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len, float scale,
                              ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> k_pool,
                              ffi::ResultBuffer<ffi::F32> v_pool) {
  // out [T, Hq, D] has the queries' shape.
  const auto shape = CheckShapes(out->dimensions(), k_pool_in.dimensions(), block_table.dimensions());
  if (!shape) return ffi::Error::InvalidArgument(kShapeError);
  const int64_t num_tokens = shape->num_tokens, q_heads = shape->q_heads, head_dim = shape->head_dim;
  const int64_t kv_heads = shape->kv_heads, num_slots = shape->num_slots;
  const auto xd = qkv.dimensions();
  const int64_t width = (q_heads + 2 * kv_heads) * head_dim;
  if (xd.size() != 2 || xd[0] != num_tokens || xd[1] != width ||
      v_pool_in.element_count() != k_pool_in.element_count() || cos.element_count() != num_tokens * head_dim ||
      signed_sin.element_count() != num_tokens * head_dim || write_slots.element_count() != num_tokens) {
    return ffi::Error::InvalidArgument(
        "jsgl_rope_write_attention: qkv [T, (Hq + 2 Hkv) D], cos/sin [T, D], write_slots [T], pools alike");
  }
  const float *xs = qkv.typed_data(), *cs = cos.typed_data(), *sn = signed_sin.typed_data();
  const int32_t* slots = write_slots.typed_data();
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return ffi::Error::InvalidArgument("jsgl_rope_write_attention: bad slot");
  float *ks = k_pool->typed_data(), *vs = v_pool->typed_data();
  thread_local std::vector<float> roped_q;
  roped_q.resize(num_tokens * q_heads * head_dim);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float *row = xs + t * width, *c = cs + t * head_dim, *s = sn + t * head_dim;
    for (int64_t h = 0; h < q_heads; ++h)
      Rope(row + h * head_dim, c, s, head_dim, roped_q.data() + (t * q_heads + h) * head_dim);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = (h * num_slots + slots[t]) * head_dim;
      Rope(row + (q_heads + h) * head_dim, c, s, head_dim, ks + dst);
      std::memcpy(vs + dst, row + (q_heads + kv_heads + h) * head_dim, sizeof(float) * head_dim);
    }
  }
  // Attention over the pools as written (through the results, which alias them).
  Attend(*shape, roped_q.data(), ks, vs, positions.typed_data(), block_table.typed_data(), kv_lens.typed_data(),
         q_start.typed_data(), q_len.typed_data(), scale, out->typed_data());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jsgl_rope_write_attention, RopeWriteAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q|k|v [T, (Hq + 2 Hkv) D], before RoPE
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // signed sin [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_slots [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pool (aliased to the second result)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pool (aliased to the third)
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
