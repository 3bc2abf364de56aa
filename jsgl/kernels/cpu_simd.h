// Vectors of 16 floats for the CPU kernels: one AVX-512 register, or a pair of AVX2 registers on the many x86
// CPUs without AVX-512 (AMD before Zen 4, Intel's client cores since Alder Lake). The kernels are written once
// against these functions; with AVX-512 each is its one intrinsic, so that build's code is what it was before
// this layer existed. Where the register count matters (16 AVX2 registers against 32, each holding half a
// vector), the kernels choose their tile shapes by JSGL_AVX512.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__)
#define JSGL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JSGL_AVX512 0
#else
#error "the jsgl CPU kernels need AVX-512F, or AVX2 with FMA and F16C"
#endif

namespace jsgl {

#if JSGL_AVX512

using Vec = __m512;
using IVec = __m512i;   // 16 int32
using Mask = __mmask16;  // one bit a lane

inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline IVec LoadInts(const int32_t* p) { return _mm512_loadu_si512(p); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec Fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
inline Vec Fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline float ReduceAdd(Vec v) { return _mm512_reduce_add_ps(v); }
inline float ReduceMax(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec RoundNearest(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec Scale2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral

// Masks: lanes [0, n) (0 <= n; 16 or more is every lane), comparisons, selection.
inline Mask FirstLanes(int64_t n) { return static_cast<Mask>(n >= 16 ? 0xFFFF : (1u << n) - 1); }
inline Vec LoadFirst(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // zeros elsewhere
inline void StoreFirst(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
inline Mask NotEqual(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
inline Mask Greater(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask IntGreater(IVec a, int32_t b) { return _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(b)); }
inline Vec Select(Mask m, Vec if_clear, Vec if_set) { return _mm512_mask_mov_ps(if_clear, m, if_set); }
inline Vec KeepWhere(Mask m, Vec v) { return _mm512_maskz_mov_ps(m, v); }  // zeros elsewhere
inline unsigned Bits(Mask m) { return m; }

// 16 float16, 16 int8, and the low and high nibbles of 16 bytes, as floats.
inline Vec Halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec Int8s(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void Nibbles(const uint8_t* p, Vec& low, Vec& high) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
  high = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
}

#else  // AVX2: lanes 0-7 in lo, 8-15 in hi

struct Vec {
  __m256 lo, hi;
};
struct IVec {
  __m256i lo, hi;
};
struct Mask {  // all-ones lanes where set
  __m256 lo, hi;
};

inline Vec Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec Set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec Load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline IVec LoadInts(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline Vec Add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec Sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec Mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec Div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec Max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec Min(Vec a, Vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline Vec Fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec Fnmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline float Reduce8(__m256 v, __m128 (*op)(__m128, __m128)) {
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_shuffle_ps(x, x, 1)));
}
inline float ReduceAdd(Vec v) { return Reduce8(_mm256_add_ps(v.lo, v.hi), _mm_add_ps); }
inline float ReduceMax(Vec v) { return Reduce8(_mm256_max_ps(v.lo, v.hi), _mm_max_ps); }
inline Vec RoundNearest(Vec x) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, kMode), _mm256_round_ps(x.hi, kMode)};
}
// p 2^n for integral n in [-126, 127] (Exp's range): 2^n built in the exponent field, so the product is exact as
// AVX-512's scalef.
inline __m256 Pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec Scale2(Vec p, Vec n) { return {_mm256_mul_ps(p.lo, Pow2(n.lo)), _mm256_mul_ps(p.hi, Pow2(n.hi))}; }

inline Mask FirstLanes(int64_t n) {
  const __m256i count = _mm256_set1_epi32(static_cast<int32_t>(n >= 16 ? 16 : n));
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)))};
}
inline Vec LoadFirst(Mask m, const float* p) {
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}
inline void StoreFirst(float* p, Mask m, Vec v) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(m.lo), v.lo), _mm256_maskstore_ps(p + 8, _mm256_castps_si256(m.hi), v.hi);
}
inline Mask NotEqual(Vec a, Vec b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_NEQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_NEQ_OQ)}; }
inline Mask Greater(Vec a, Vec b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
inline Mask IntGreater(IVec a, int32_t b) {
  const __m256i bs = _mm256_set1_epi32(b);
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(a.lo, bs)), _mm256_castsi256_ps(_mm256_cmpgt_epi32(a.hi, bs))};
}
inline Vec Select(Mask m, Vec if_clear, Vec if_set) {
  return {_mm256_blendv_ps(if_clear.lo, if_set.lo, m.lo), _mm256_blendv_ps(if_clear.hi, if_set.hi, m.hi)};
}
inline Vec KeepWhere(Mask m, Vec v) { return {_mm256_and_ps(m.lo, v.lo), _mm256_and_ps(m.hi, v.hi)}; }
inline unsigned Bits(Mask m) {
  return static_cast<unsigned>(_mm256_movemask_ps(m.lo)) | static_cast<unsigned>(_mm256_movemask_ps(m.hi)) << 8;
}

inline Vec Halves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline Vec Int8s(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline void Nibbles(const uint8_t* p, Vec& low, Vec& high) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i q0 = _mm256_cvtepu8_epi32(b), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), mask = _mm256_set1_epi32(15);
  low = {_mm256_cvtepi32_ps(_mm256_and_si256(q0, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(q1, mask))};
  high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4))};
}

#endif

inline bool Any(Mask m) { return Bits(m) != 0; }

}  // namespace jsgl
