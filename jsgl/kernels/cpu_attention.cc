// Paged attention for decode and short extends, called through XLA's FFI (built by jsgl/kernels/cpu.py).
//
// jsgl_paged_attention: each new token of a request attends over the request's slots up to its own position,
//   read in place from the token-granular pool [Hkv, N, D] (XLA gathers a [B, Hkv, L, D] copy of K and V
//   first). K/V rows are read again for each new token, so it serves decode and extends of a few tokens
//   (jump-forward); prefill stays on the native path.

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace jsgl;  // Vec and its operations (cpu_simd.h), Exp, ParallelFor

namespace {

// Lane i of the result is the sum of v[i]'s 16 lanes: a transpose-and-add tree, ~4x fewer shuffles than
// reducing the 16 vectors one by one.
#if JSGL_AVX512
inline Vec SumLanes16(const Vec v[16]) {
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
#else
// AVX2: each vector's halves added, then per eight of them two rounds of hadd (a 128-bit lane's sums of four
// vectors) and the two lanes added.
inline __m256 SumLanes8(const __m256 w[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(w[0], w[1]), _mm256_hadd_ps(w[2], w[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(w[4], w[5]), _mm256_hadd_ps(w[6], w[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline Vec SumLanes16(const Vec v[16]) {
  __m256 u[16];
  for (int i = 0; i < 16; ++i) u[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {SumLanes8(u), SumLanes8(u + 8)};
}
#endif

constexpr int64_t kMaxHeadDim = 256;
// Rows of K or V requested this many keys ahead: slots are scattered over the pool, so the hardware
// prefetcher cannot follow; one row ahead left a core at ~11 GB/s. V rows are requested
// while the scores are computed.
constexpr int64_t kPrefetchKeys = 16;

inline void PrefetchRow(const float* row, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kTokensPerItem = 16;

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

// ---------------------------------------------------------------------------------------------- prefill
// Extends of kBlockedMinTokens or more new tokens (prefill chunks): a block of new tokens of one request
// and all G query heads of one kv head (R = tokens x G rows) meets the keys 32 at a time, with an online
// softmax (flash attention), so each K/V row is read once per block rather than once per token and the
// inner loops are plain FMAs over a transposed key block. Per layer on MMLU-shaped extends (8 x 64 new
// tokens over 400 cached) this is ~4x the per-token loop above.
constexpr int64_t kBlockedMinTokens = 8;

// kt[d * ld + j] = rows[j][d] for 16 rows (d < head_dim): four 16x16 in-register transposes for D = 64.
#if JSGL_AVX512
inline void TransposeKeys(const float* const rows[16], int64_t head_dim, float* kt, int64_t ld) {
  for (int64_t c = 0; c < head_dim; c += 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows[i] + c);
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
      r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
      r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
      r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    // r[4a + b] now holds, per 128-bit lane L, elements (row 4a..4a+3, column 4L + b'), with b' = 0, 1, 2, 3
    // for b = 0, 1, 2, 3. Gather the four lanes of each column group across the four row groups.
    for (int b = 0; b < 4; ++b) {
      const __m512 x0 = _mm512_shuffle_f32x4(r[b], r[4 + b], _MM_SHUFFLE(2, 0, 2, 0));
      const __m512 x1 = _mm512_shuffle_f32x4(r[b], r[4 + b], _MM_SHUFFLE(3, 1, 3, 1));
      const __m512 y0 = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], _MM_SHUFFLE(2, 0, 2, 0));
      const __m512 y1 = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], _MM_SHUFFLE(3, 1, 3, 1));
      _mm512_storeu_ps(kt + (c + b) * ld, _mm512_shuffle_f32x4(x0, y0, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_storeu_ps(kt + (c + 4 + b) * ld, _mm512_shuffle_f32x4(x1, y1, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_storeu_ps(kt + (c + 8 + b) * ld, _mm512_shuffle_f32x4(x0, y0, _MM_SHUFFLE(3, 1, 3, 1)));
      _mm512_storeu_ps(kt + (c + 12 + b) * ld, _mm512_shuffle_f32x4(x1, y1, _MM_SHUFFLE(3, 1, 3, 1)));
    }
  }
}
#else
// AVX2: 8 x 8 transposes (r[i] holds row i before, column i after), two row groups per 8 columns.
inline void Transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // per 128-bit lane: rows i, i + 1 interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // per lane: column 0..3 of rows i..i+3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // the low lanes hold columns 0-3, the high ones 4-7
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
inline void TransposeKeys(const float* const rows[16], int64_t head_dim, float* kt, int64_t ld) {
  for (int64_t c = 0; c < head_dim; c += 8)
    for (int64_t j0 = 0; j0 < 16; j0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[j0 + i] + c);
      Transpose8x8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (c + i) * ld + j0, r[i]);
    }
}
#endif

// Keys per block of the prefill kernel, transposed into kt [D][32]. The block's rows (new token x query head
// of the group) lie in the vector lanes: scores are s[j][r] = sum_d k[j][d] q_t[d][r], a matmul tile whose key
// weights are broadcast from kt, and the online softmax's maxima and sums run down the lanes, with no
// horizontal reduction. (With rows as vectors' outer index, the per-row horizontal max and sum of every block
// cost about as much as its score FMAs: 94 GFLOP/s on MMLU-shaped extends.)
constexpr int64_t kKeyBlock = 32;
#if JSGL_AVX512
constexpr int kTileKeys = 8;     // keys of one score tile: up to 3 row vectors x 8 keys = 24 accumulators
constexpr int kMaxRowVecs = 3;
constexpr int kValueVecs = 4;    // o += p v: 4 rows x 64 columns, 16 accumulators
#else
constexpr int kTileKeys = 4;     // AVX2: 4 keys x 1 row vector = 8 of the 16 registers
constexpr int kMaxRowVecs = 1;
constexpr int kValueVecs = 1;    // 4 rows x 16 columns
#endif

// s[j][v] (rows ld apart) for keys j < kTileKeys of kt (rows kKeyBlock apart) and RV row vectors of q_t.
template <int RV>
inline void ScoreTile(const float* q_t, int64_t ld, const float* kt, int64_t head_dim, float* s) {
  Vec acc[kTileKeys][RV];
  for (int j = 0; j < kTileKeys; ++j)
    for (int v = 0; v < RV; ++v) acc[j][v] = Zero();
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec q[RV];
    for (int v = 0; v < RV; ++v) q[v] = Load(q_t + d * ld + 16 * v);
#pragma GCC unroll 8
    for (int j = 0; j < kTileKeys; ++j) {
      const Vec k = Set1(kt[d * kKeyBlock + j]);
      for (int v = 0; v < RV; ++v) acc[j][v] = Fmadd(k, q[v], acc[j][v]);
    }
  }
  for (int j = 0; j < kTileKeys; ++j)
    for (int v = 0; v < RV; ++v) Store(s + j * ld + 16 * v, acc[j][v]);
}

// o[r, :16 V] += sum_j p[j][r] v[slot j, :16 V] for the rows (a multiple of 4) and n <= kKeyBlock keys
// (p rows ld apart).
template <int V>
inline void AccumulateValues(float* o, const float* p, int64_t ld, const float* v_head, const int32_t* slots,
                             int64_t n, int64_t rows, int64_t head_dim) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    Vec acc[4][V];
    for (int i = 0; i < 4; ++i)
      for (int v = 0; v < V; ++v) acc[i][v] = Load(o + (r0 + i) * head_dim + 16 * v);
    for (int64_t jj = 0; jj < n; ++jj) {
      const float* value = v_head + static_cast<int64_t>(slots[jj]) * head_dim;
      Vec vv[V];
      for (int v = 0; v < V; ++v) vv[v] = Load(value + 16 * v);
      for (int i = 0; i < 4; ++i) {
        const Vec w = Set1(p[jj * ld + r0 + i]);
        for (int v = 0; v < V; ++v) acc[i][v] = Fmadd(w, vv[v], acc[i][v]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int v = 0; v < V; ++v) Store(o + (r0 + i) * head_dim + 16 * v, acc[i][v]);
  }
}

// New tokens [t0, t1) of request b against kv head h. Rows r = (t - t0) * group + g, padded to whole vectors.
void AttendBlock(const Shapes& shape, const float* qs, const float* k_head, const float* v_head, const int32_t* pos,
                 const int32_t* slots, int64_t len_b, int64_t row0, int64_t t0, int64_t t1, int64_t h, float scale,
                 float* os) {
  const int64_t q_heads = shape.q_heads, head_dim = shape.head_dim, group = q_heads / shape.kv_heads;
  const int64_t rows = (t1 - t0) * group, row_vecs = (rows + 15) / 16, ld = row_vecs * 16;
  thread_local std::vector<float> q_t, o, s, kt, top, total;
  thread_local std::vector<int32_t> limit;  // keys visible to a row: j < limit (0 for padding rows)
  q_t.assign(head_dim * ld, 0.f), o.assign(ld * head_dim, 0.f), s.resize(kKeyBlock * ld);
  kt.resize(head_dim * kKeyBlock), top.assign(ld, -INFINITY), total.assign(ld, 0.f), limit.assign(ld, 0);
  int64_t keys = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t token = row0 + t;
    const int64_t visible = std::min<int64_t>({pos[token] + 1, len_b, shape.max_len});
    keys = std::max(keys, visible);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - t0) * group + g;
      limit[r] = static_cast<int32_t>(std::max<int64_t>(visible, 0));
      const float* src = qs + (token * q_heads + h * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) q_t[d * ld + r] = src[d] * scale;
    }
  }
  const Vec none = Set1(-INFINITY);
  for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
    const int64_t n = std::min<int64_t>(kKeyBlock, keys - j0);
    const float* key_rows[kKeyBlock];
    for (int64_t jj = 0; jj < kKeyBlock; ++jj)
      key_rows[jj] = k_head + static_cast<int64_t>(slots[j0 + std::min(jj, n - 1)]) * head_dim;
    TransposeKeys(key_rows, head_dim, kt.data(), kKeyBlock);
    if (n > 16) TransposeKeys(key_rows + 16, head_dim, kt.data() + 16, kKeyBlock);
    // Scores of the block's keys (past n: copies of the last key, masked below), three row vectors at a time.
    for (int64_t j = 0; j < n; j += kTileKeys) {
      for (int64_t v = 0; v < row_vecs;) {
        const int64_t left = row_vecs - v, rv = kMaxRowVecs == 3 && left == 4 ? 2 : std::min<int64_t>(kMaxRowVecs, left);
        float* tile = s.data() + j * ld + 16 * v;
        const float* q = q_t.data() + 16 * v;
#if JSGL_AVX512
        if (rv == 3) {
          ScoreTile<3>(q, ld, kt.data() + j, head_dim, tile);
        } else if (rv == 2) {
          ScoreTile<2>(q, ld, kt.data() + j, head_dim, tile);
        } else {
          ScoreTile<1>(q, ld, kt.data() + j, head_dim, tile);
        }
#else
        ScoreTile<1>(q, ld, kt.data() + j, head_dim, tile);
#endif
        v += rv;
      }
    }
    // The online softmax, sixteen rows a vector: mask keys a row cannot see (causal, or past the block), take
    // the new maxima, turn scores into weights in place, and rescale what was summed under the old maxima.
    for (int64_t v = 0; v < row_vecs; ++v) {
      const IVec visible = LoadInts(limit.data() + 16 * v);
      const Vec old_top = Load(top.data() + 16 * v);
      Vec new_top = old_top;
      for (int64_t jj = 0; jj < n; ++jj) {
        float* x = s.data() + jj * ld + 16 * v;
        const Mask sees = IntGreater(visible, static_cast<int32_t>(j0 + jj));
        const Vec score = Select(sees, none, Load(x));
        Store(x, score);
        new_top = Max(new_top, score);
      }
      // Rows that have seen no key yet keep -inf: shift them by 0 so that exp(-inf - shift) is exp(-inf).
      const Mask seen = NotEqual(new_top, none);
      const Vec shift = KeepWhere(seen, new_top);
      Vec sum = Zero();
      for (int64_t jj = 0; jj < n; ++jj) {
        float* x = s.data() + jj * ld + 16 * v;
        const Vec score = Load(x);
        const Vec weight = KeepWhere(NotEqual(score, none), Exp(Sub(score, shift)));
        Store(x, weight);
        sum = Add(sum, weight);
      }
      const Mask grew = Greater(new_top, old_top);
      // exp(old - new) where the maximum grew (0 where nothing was seen before); 1 elsewhere.
      const Vec shrink = Select(grew, Set1(1.f), KeepWhere(NotEqual(old_top, none), Exp(Sub(old_top, shift))));
      Store(total.data() + 16 * v, Fmadd(Load(total.data() + 16 * v), shrink, sum));
      Store(top.data() + 16 * v, new_top);
      if (Any(grew)) {
        alignas(64) float factor[16];
        Store(factor, shrink);
        const unsigned grew_bits = Bits(grew);
        for (int64_t i = 0; i < 16; ++i) {
          if (!(grew_bits >> i & 1)) continue;
          float* orow = o.data() + (16 * v + i) * head_dim;
          for (int64_t c = 0; c < head_dim; c += 16) Store(orow + c, Mul(Load(orow + c), Set1(factor[i])));
        }
      }
    }
    // o += p v: four rows by 64 columns at a time, 16 accumulators in registers (AVX2: by 16 columns).
    for (int64_t c = 0; c < head_dim; c += 16 * kValueVecs) {
      const int64_t width = std::min<int64_t>(16 * kValueVecs, head_dim - c);
      if (width == 64) {
        AccumulateValues<4>(o.data() + c, s.data(), ld, v_head + c, slots + j0, n, ld, head_dim);
      } else if (width == 48) {
        AccumulateValues<3>(o.data() + c, s.data(), ld, v_head + c, slots + j0, n, ld, head_dim);
      } else if (width == 32) {
        AccumulateValues<2>(o.data() + c, s.data(), ld, v_head + c, slots + j0, n, ld, head_dim);
      } else {
        AccumulateValues<1>(o.data() + c, s.data(), ld, v_head + c, slots + j0, n, ld, head_dim);
      }
    }
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - t0) * group + g;
      float* dst = os + ((row0 + t) * q_heads + h * group + g) * head_dim;
      const float inv = total[r] > 0.f ? 1.f / total[r] : 0.f;
      for (int64_t i = 0; i < head_dim; ++i) dst[i] = o[r * head_dim + i] * inv;
    }
}

// out = attention of the (roped) queries qs over the pools, for every new token of every request.
void Attend(const Shapes& shape, const float* qs, const float* ks, const float* vs, const int32_t* pos,
            const int32_t* table, const int32_t* lens, const int32_t* starts, const int32_t* counts, float scale,
            float* os) {
  const int64_t num_tokens = shape.num_tokens, q_heads = shape.q_heads, head_dim = shape.head_dim;
  const int64_t kv_heads = shape.kv_heads, num_slots = shape.num_slots, max_len = shape.max_len;
  const int64_t group = q_heads / kv_heads;
  std::memset(os, 0, sizeof(float) * num_tokens * q_heads * head_dim);  // padding rows stay zero

  // Work items: (request, kv head, run of kTokensPerItem new tokens), so that one long prefill spreads over
  // every core (per (request, head) alone, a lone 512-token prompt gave 3 items to 2 cores).
  struct Item {
    int64_t b, h, t0;
  };
  std::vector<Item> items;  // not thread_local: the helper threads read this one
  for (int64_t b = 0; b < shape.batch; ++b)
    for (int64_t t0 = 0; t0 < counts[b]; t0 += kTokensPerItem)
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({b, h, t0});
  ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t index) {
    const int64_t b = items[index].b, h = items[index].h, t0 = items[index].t0;
    const int32_t* slots = table + b * max_len;
    const float* k_head = ks + h * num_slots * head_dim;
    const float* v_head = vs + h * num_slots * head_dim;
    const int64_t t1 = std::min<int64_t>(counts[b], t0 + kTokensPerItem);
    if (counts[b] >= kBlockedMinTokens && starts[b] >= 0 && starts[b] + counts[b] <= num_tokens) {
      AttendBlock(shape, qs, k_head, v_head, pos, slots, lens[b], starts[b], t0, t1, h, scale, os);
      return;
    }
    for (int64_t t = t0; t < t1; ++t) {  // these new tokens of the request: keys up to each one's position
      const int64_t row = starts[b] + t;
      if (row < 0 || row >= num_tokens) continue;
      const int64_t len = std::min<int64_t>({pos[row] + 1, lens[b], max_len});
      if (len <= 0) continue;
      const float* q_rows = qs + (row * q_heads + h * group) * head_dim;  // this kv head's query group
      const int64_t vecs = head_dim / 16, padded = (len + 15) / 16 * 16;
      Vec query[kMaxGroup][kMaxHeadDim / 16];  // pre-scaled
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < vecs; ++i) query[g][i] = Mul(Load(q_rows + g * head_dim + 16 * i), Set1(scale));
      // Scores, 16 keys at a time: each key leaves one vector of partial products per query head, and
      // SumLanes16 finishes the 16 dot products together. Keys past len score -inf (weight 0).
      thread_local std::vector<float> scores;
      scores.resize(group * padded);
      for (int64_t j = 0; j < std::min(len, kPrefetchKeys); ++j) PrefetchRow(k_head + slots[j] * head_dim, head_dim);
      for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t n = std::min<int64_t>(16, len - j0);
        Vec partial[kMaxGroup][16];
        for (int64_t jj = 0; jj < 16; ++jj) {
          const int64_t j = j0 + jj;
          if (j + kPrefetchKeys < len) PrefetchRow(k_head + slots[j + kPrefetchKeys] * head_dim, head_dim);
          if (j < len) PrefetchRow(v_head + slots[j] * head_dim, head_dim);  // for the weighted sum below
          for (int64_t g = 0; g < group; ++g) partial[g][jj] = Zero();
          if (jj >= n) continue;
          const float* key = k_head + static_cast<int64_t>(slots[j]) * head_dim;
          for (int64_t i = 0; i < vecs; ++i) {
            const Vec k = Load(key + 16 * i);
            for (int64_t g = 0; g < group; ++g) partial[g][jj] = Fmadd(query[g][i], k, partial[g][jj]);
          }
        }
        const Mask valid = FirstLanes(n);
        for (int64_t g = 0; g < group; ++g)
          Store(scores.data() + g * padded + j0, Select(valid, Set1(-INFINITY), SumLanes16(partial[g])));
      }
      float inv_sum[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * padded;
        Vec top = Set1(-INFINITY);
        for (int64_t j = 0; j < padded; j += 16) top = Max(top, Load(s + j));
        const Vec shift = Set1(ReduceMax(top));
        Vec sum = Zero();
        for (int64_t j = 0; j < padded; j += 16) {
          const Vec x = Load(s + j);
          const Vec e = Select(NotEqual(x, Set1(-INFINITY)), Zero(), Exp(Sub(x, shift)));
          Store(s + j, e);
          sum = Add(sum, e);
        }
        inv_sum[g] = 1.f / ReduceAdd(sum);
      }
      Vec acc[kMaxGroup][kMaxHeadDim / 16];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < vecs; ++i) acc[g][i] = Zero();
      for (int64_t j = 0; j < len; ++j) {
        const float* value = v_head + static_cast<int64_t>(slots[j]) * head_dim;
        for (int64_t i = 0; i < vecs; ++i) {
          const Vec v = Load(value + 16 * i);
          for (int64_t g = 0; g < group; ++g) acc[g][i] = Fmadd(Set1(scores[g * padded + j]), v, acc[g][i]);
        }
      }
      float* o_rows = os + (row * q_heads + h * group) * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < vecs; ++i) Store(o_rows + g * head_dim + 16 * i, Mul(acc[g][i], Set1(inv_sum[g])));
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

constexpr int64_t kRopeTokens = 32;  // tokens per task of RopeWriteAttention's RoPE and K/V writes

// Rotate-half RoPE of one head: out = x * cos + roll(x, D/2) * signed_sin ([-sin, sin] per half).
inline void Rope(const float* x, const float* cos, const float* signed_sin, int64_t head_dim, float* out) {
  const int64_t half = head_dim / 2;
  if (half % 16 == 0) {
    for (int64_t i = 0; i < half; i += 16) {
      const Vec lo = Load(x + i), hi = Load(x + half + i);
      Store(out + i, Fmadd(hi, Load(signed_sin + i), Mul(lo, Load(cos + i))));
      Store(out + half + i, Fmadd(lo, Load(signed_sin + half + i), Mul(hi, Load(cos + half + i))));
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
  float* q_out = roped_q.data();  // the helpers write through this pointer, not their own thread_local
  auto rope_tokens = [&](int64_t block) {
    for (int64_t t = block * kRopeTokens; t < std::min(num_tokens, (block + 1) * kRopeTokens); ++t) {
      const float *row = xs + t * width, *c = cs + t * head_dim, *s = sn + t * head_dim;
      for (int64_t h = 0; h < q_heads; ++h) Rope(row + h * head_dim, c, s, head_dim, q_out + (t * q_heads + h) * head_dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        if (slots[t] == 0) continue;  // a padding token: the reserved slot 0 is never read, and they all map there
        const int64_t dst = (h * num_slots + slots[t]) * head_dim;
        Rope(row + (q_heads + h) * head_dim, c, s, head_dim, ks + dst);
        std::memcpy(vs + dst, row + (q_heads + kv_heads + h) * head_dim, sizeof(float) * head_dim);
      }
    }
  };
  // A prefill chunk's RoPE and K/V writes on both threads (one thread: ~1 ms of a 512-token layer's ~3.6).
  // Two real tokens never share a slot, so the blocks write disjoint rows.
  const int64_t rope_blocks = (num_tokens + kRopeTokens - 1) / kRopeTokens;
  if (rope_blocks > 1) {
    ParallelFor(rope_blocks, rope_tokens);
  } else {
    rope_tokens(0);
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
