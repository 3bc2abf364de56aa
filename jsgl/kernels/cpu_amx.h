// Prefill-sized matmuls on AMX tiles (cpu_matmul.cc), at near float32 accuracy.
//
// AMX multiplies bfloat16 (8-bit mantissa) into float32 sums, ~16x the FLOPs per cycle of AVX-512's FMAs. A float32
// value is split into two bfloat16, hi = bf16(v) and lo = bf16(v - hi), which together carry 16 bits of mantissa;
// x @ w = xh wh + xh wl + xl wh (+ xl wl, ~2^-16 of the rest: dropped), three tile products for one (oneDNN's
// "bf16x3"). Measured against float64, the error relative to sum |x||w| is ~1.3e-6, ~4x the AVX-512 kernels'
// (~3e-7) and far from one bfloat16 product's (~4e-3); greedy outputs still equal transformers'.
//
// Tiles: C[32 rows, 32 columns] (2 x 2 float32 tiles of 16 x 16) += A[32, 32] @ B[32, 32] per 32 of K. A (x's hi or
// lo) comes from x split once per call into tile-major blocks (SplitBlock), B (W's hi or lo) in the VNNI layout AMX
// reads: row t of a B tile holds rows 2t and 2t + 1 of W interleaved, column by column (SplitGroup).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JSGL_HAVE_AMX 1
#else
#define JSGL_HAVE_AMX 0
#endif

namespace jsgl::amx {

constexpr int64_t kBlockRows = 32;  // rows of x per product: two tiles
constexpr int64_t kTileK = 32;          // bfloat16 along K per tile product
constexpr int64_t kTileElems = 16 * 32;  // bfloat16 per A or B tile (1 KB)

#if JSGL_HAVE_AMX

// Whether this process may use the tiles: the OS must have enabled their state (XCR0 bits 17-18; a CPU can list
// AMX under a hypervisor that does not), and Linux hands a process AMX's 8 KB of tile state only when asked
// (once per process). JSGL_NO_AMX=1 keeps the AVX-512 kernels, for A/B runs.
inline bool Enabled() {
  static const bool enabled = [] {
    const char* off = std::getenv("JSGL_NO_AMX");
    if (off && *off && *off != '0') return false;
    constexpr unsigned long long kTileState = 3ull << 17;
    if ((_xgetbv(0) & kTileState) != kTileState) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return enabled;
}

// Every tile 16 rows x 64 bytes. The configuration is per thread: each task loads it (the helpers too).
inline void Configure() {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// bf16 (in the low 16 bits of each 32-bit lane) back to float32.
inline __m512 Widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }

// The hi and lo bfloat16 of a and b (16 floats each), as [a's 16 | b's 16].
inline void Split(__m512 a, __m512 b, __m512i& hi, __m512i& lo) {
  hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  const __m512 a_hi = Widen(_mm512_castsi512_si256(hi)), b_hi = Widen(_mm512_extracti64x4_epi64(hi, 1));
  lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, b_hi), _mm512_sub_ps(a, a_hi));
}

// A block of 32 rows of x [rows <= 32, K] float32 -> its A tiles, for each 32 of K [hi rows 0-15, hi rows 16-31, lo
// rows 0-15, lo rows 16-31] (each 16 x 32 bfloat16, 1 KB), so a block's tiles are one stream along K (read from the
// row-major split at 3 KB strides, K = 1536 ran ~25% slower than K = 576); rows past `rows` are zero.
constexpr int64_t kBlockTiles = 4;  // per 32 of K
inline void SplitBlock(const float* x, int64_t rows, int64_t k_dim, uint16_t* tiles) {
  for (int64_t r = 0; r < kBlockRows; ++r) {
    for (int64_t kb = 0; kb < k_dim / kTileK; ++kb) {
      uint16_t* hi = tiles + (kb * kBlockTiles + r / 16) * kTileElems + r % 16 * kTileK;
      if (r >= rows) {
        _mm512_storeu_si512(hi, _mm512_setzero_si512());
        _mm512_storeu_si512(hi + 2 * kTileElems, _mm512_setzero_si512());
        continue;
      }
      __m512i h, l;
      Split(_mm512_loadu_ps(x + r * k_dim + kb * kTileK), _mm512_loadu_ps(x + r * k_dim + kb * kTileK + 16), h, l);
      _mm512_storeu_si512(hi, h);
      _mm512_storeu_si512(hi + 2 * kTileElems, l);
    }
  }
}

// Element 2c of a B tile's row is w0[c] (element c of [w0 | w1]), element 2c + 1 is w1[c] (element 16 + c).
alignas(64) constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Rows 2t and 2t + 1 of W over 16 columns (w0, w1) -> row t of a B tile: (w0[c], w1[c]) for each c, hi and lo.
inline void SplitPair(__m512 w0, __m512 w1, __m512i interleave, uint16_t* hi_row, uint16_t* lo_row) {
  __m512i h, l;
  Split(w0, w1, h, l);
  _mm512_storeu_si512(hi_row, _mm512_permutexvar_epi16(interleave, h));
  _mm512_storeu_si512(lo_row, _mm512_permutexvar_epi16(interleave, l));
}

// B tiles of W's columns taken 32 at a time (a pair of 16-column groups): for each 32 of K, the pair's hi
// tiles then its lo tiles, [hi c0, hi c1, lo c0, lo c1], so one pair's tiles are one stream along K.
constexpr int64_t kPairTiles = 4;  // per 32 of K

// Splits group `g` (16 columns) of a W whose rows 2 k2 and 2 k2 + 1 over those columns `pair(k2, w0, w1)` gives
// (called for k2 = 0, 1, 2, ... in turn) into the pair tiles at `tiles` (pair g / 2, column half g % 2).
template <typename PairFn>
void SplitGroup(int64_t k_dim, int64_t g, PairFn pair, uint16_t* tiles) {
  uint16_t* stream = tiles + g / 2 * (k_dim / kTileK) * kPairTiles * kTileElems + g % 2 * kTileElems;
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t kb = 0; kb < k_dim / kTileK; ++kb) {
    uint16_t* block = stream + kb * kPairTiles * kTileElems;
    for (int64_t t = 0; t < 16; ++t) {
      __m512 w0, w1;
      pair(kb * 16 + t, w0, w1);
      SplitPair(w0, w1, interleave, block + t * 32, block + 2 * kTileElems + t * 32);
    }
  }
}

// Tile registers: accumulators tmm0-3 (rows 0-15 / 16-31 x columns 0-15 / 16-31), A rows 0-15 and 16-31 in
// tmm4-5, B columns 0-15 and 16-31 in tmm6-7 (the intrinsics take tile numbers as immediates).
inline void LoadA(const uint16_t* tiles) {
  _tile_loadd(4, tiles, 64);
  _tile_loadd(5, tiles + kTileElems, 64);
}
inline void LoadB(const uint16_t* tiles) {
  _tile_loadd(6, tiles, 64);
  _tile_loadd(7, tiles + kTileElems, 64);
}
inline void Accumulate() {  // C += A @ B, the four 16 x 16 quarters
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// out[32, 32] (row stride ldo floats) = a block of x (its A tiles, SplitBlock) @ one pair's tiles. Four
// accumulators (2 x 2 tiles, tmm0-3), two A and two B tiles: the three products in turn per 32 of K. (One
// 16-row block against a 48-column panel, 3 accumulators, ran at ~760 bfloat16 GFLOP/s a core; 2 x 2 tiles at
// ~1,100 for K = 576; torch's bfloat16 matmul reaches ~1,400.)
inline void PairProduct(const uint16_t* a, int64_t k_dim, const uint16_t* tiles, float* out, int64_t ldo) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < k_dim / kTileK; ++kb) {
    const uint16_t* b = tiles + kb * kPairTiles * kTileElems;  // [hi c0, hi c1, lo c0, lo c1]
    const uint16_t* x = a + kb * kBlockTiles * kTileElems;     // [hi r0, hi r1, lo r0, lo r1]
    LoadA(x);  // xh wh
    LoadB(b);
    Accumulate();
    LoadB(b + 2 * kTileElems);  // xh wl
    Accumulate();
    LoadA(x + 2 * kTileElems);  // xl wh
    LoadB(b);
    Accumulate();
  }
  _tile_stored(0, out, ldo * 4);
  _tile_stored(1, out + 16, ldo * 4);
  _tile_stored(2, out + 16 * ldo, ldo * 4);
  _tile_stored(3, out + 16 * ldo + 16, ldo * 4);
}

#else

inline bool Enabled() { return false; }

#endif

}  // namespace jsgl::amx
