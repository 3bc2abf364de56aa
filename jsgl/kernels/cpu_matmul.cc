// Matmuls for the jitted step, called through XLA's FFI (built and loaded by jsgl/kernels/cpu.py).
//
// jsgl_packed_matmul: y[M, N] = x[M, K] @ W with W packed once, at load, into panels [P, K, 48] of 48
//   output columns (3 AVX-512 vectors, 6 AVX2 ones). XLA's CPU dot repacks its weight operand on every call; for the
//   1-16 rows of a decode step that costs about as much as the arithmetic.
// jsgl_q4_1_matmul, jsgl_q8_0_matmul: the same over weights kept in the GGUF file's own quantized blocks,
//   dequantized exactly, in registers (see QuantMicroKernel).
// Both take more than 16 rows (prefill) to AMX tiles where the CPU and OS allow it (AmxMatmul, cpu_amx.h).

#include <array>
#include <cmath>
#include <optional>
#include <utility>

#include "cpu_amx.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace jsgl;  // Vec and its operations (cpu_simd.h), Exp, ParallelFor, amx

namespace {

constexpr int64_t kPanel = 48;  // output columns of one packed panel
#if JSGL_AVX512
constexpr int64_t kRows = 8;  // rows of one micro-kernel call: 8 x 3 accumulators of 16 floats
constexpr int kGroups = 3;    // 16-column groups a micro-kernel holds at once: the whole panel
#else
// AVX2 has 16 registers of 8 floats: 6 rows x one 16-column group (12 accumulators, BLIS's Haswell shape), the
// panel's three groups in turn.
constexpr int64_t kRows = 6;
constexpr int kGroups = 1;
#endif
// Software prefetch this many panel rows ahead (6 KB): the hardware prefetcher alone left a decode
// matmul at ~40 GB/s of weights; with it ~54, and 16-row matmuls ran ~15% faster too.
constexpr int64_t kPrefetchRows = 32;

// Stores the first `cols` (<= 16 G) of G vectors.
template <int G>
inline void StoreColumns(float* y, const Vec v[G], int64_t cols) {
  for (int j = 0; j < G; ++j) {
    const int64_t c = cols - 16 * j;
    if (c >= 16) {
      Store(y + 16 * j, v[j]);
    } else if (c > 0) {
      StoreFirst(y + 16 * j, FirstLanes(c), v[j]);
    }
  }
}

// y[r, 0:cols] = sum_k x[r, k] * panel[k, 0:cols] for R rows.
// (panel: its first column of this call, the rows still kPanel apart; cols <= 16 kGroups.)
template <int R>
void MicroKernel(const float* x, int64_t ldx, const float* panel, int64_t k_dim, float* y, int64_t ldy,
                 int64_t cols) {
  Vec acc[R][kGroups];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kGroups; ++j) acc[r][j] = Zero();
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* b = panel + k * kPanel;
    for (int j = 0; j < kGroups; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchRows * kPanel + 16 * j), _MM_HINT_T0);
    Vec w[kGroups];
    for (int j = 0; j < kGroups; ++j) w[j] = Load(b + 16 * j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec a = Set1(x[r * ldx + k]);
      for (int j = 0; j < kGroups; ++j) acc[r][j] = Fmadd(a, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) StoreColumns<kGroups>(y + r * ldy, acc[r], cols);
}

using MicroKernelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
template <int... R>
constexpr std::array<MicroKernelFn, sizeof...(R) + 1> MicroKernels(std::integer_sequence<int, R...>) {
  return {nullptr, MicroKernel<R + 1>...};
}
constexpr auto kMicroKernels = MicroKernels(std::make_integer_sequence<int, kRows>());

// y[0:rows, 0:cols] = x[0:rows] @ a float32 panel: the micro-kernel over the panel's column groups in turn (one
// call with AVX-512, three with AVX2).
inline void PanelProduct(const float* x, int64_t rows, const float* panel, int64_t k_dim, float* y, int64_t ldy,
                         int64_t cols) {
  for (int64_t c = 0; c < cols; c += 16 * kGroups)
    kMicroKernels[rows](x, k_dim, panel + c, k_dim, y + c, ldy, std::min<int64_t>(16 * kGroups, cols - c));
}

// The elementwise work around a layer's matmuls, done here instead of in XLA ops of ~10 us each:
// before, x <- rms_norm(x) * norm (norm: [K]) or x [M, 2K] <- silu(x[:, :K]) * x[:, K:] (swiglu);
// after, y <- y + residual ([M, N]).
struct Fusion {
  const float* norm = nullptr;
  float eps = 0.f;
  bool swiglu = false;
  const float* residual = nullptr;

  // None if the shapes do not fit: norm [K] or empty, residual [M, N] or empty, not norm and swiglu both.
  static std::optional<Fusion> Decode(ffi::Buffer<ffi::F32> norm, float eps, bool swiglu,
                                      ffi::Buffer<ffi::F32> residual, int64_t m_dim, int64_t k_dim, int64_t n_dim) {
    const int64_t norm_size = norm.element_count(), residual_size = residual.element_count();
    if ((norm_size && norm_size != k_dim) || (residual_size && residual_size != m_dim * n_dim) ||
        (swiglu && norm_size)) {
      return std::nullopt;
    }
    return Fusion{norm.element_count() ? norm.typed_data() : nullptr, eps, swiglu,
                  residual.element_count() ? residual.typed_data() : nullptr};
  }

  // The product's input: x itself, or x transformed into `buffer`. Prefill-sized inputs are transformed by
  // both threads, in blocks of rows: done by the caller alone, the SwiGLU of 512 x 1536 took ~0.8 ms of the
  // down projection's ~4 ms while the other core waited (a 512-token extend step spent ~25 ms per step so).
  const float* Input(const float* x, int64_t m_dim, int64_t k_dim, std::vector<float>& buffer) const {
    if (!norm && !swiglu) return x;
    buffer.resize(m_dim * k_dim);
    float* out = buffer.data();
    const int64_t blocks = m_dim >= kParallelInputRows ? (m_dim + kInputBlockRows - 1) / kInputBlockRows : 1;
    const int64_t block_rows = blocks > 1 ? kInputBlockRows : m_dim;
    auto rows = [&](int64_t b) {
      for (int64_t m = b * block_rows; m < std::min(m_dim, (b + 1) * block_rows); ++m) Row(x, m, k_dim, out + m * k_dim);
    };
    if (blocks > 1) {
      ParallelFor(blocks, rows);
    } else {
      rows(0);
    }
    return out;
  }

  // y[rows [m0, m0 + rows), columns [c0, c0 + cols)] += residual: a micro-kernel's block while it is in cache.
  void Finish(float* y, int64_t m0, int64_t rows, int64_t n_dim, int64_t c0, int64_t cols) const {
    if (!residual) return;
    for (int64_t m = m0; m < m0 + rows; ++m) {
      float* out = y + m * n_dim;
      const float* add = residual + m * n_dim;
      for (int64_t c = c0; c < c0 + cols; c += 16) {  // masked: cols need not be a multiple of 16
        const Mask mask = FirstLanes(c0 + cols - c);
        StoreFirst(out + c, mask, Add(LoadFirst(mask, out + c), LoadFirst(mask, add + c)));
      }
    }
  }

 private:
  static constexpr int64_t kParallelInputRows = 64;  // fewer: one thread (a ParallelFor costs a few us)
  static constexpr int64_t kInputBlockRows = 16;

  void Row(const float* x, int64_t m, int64_t k_dim, float* out) const {
    if (swiglu) {
      const float *gate = x + m * 2 * k_dim, *up = gate + k_dim;
      int64_t k = 0;
      for (; k + 16 <= k_dim; k += 16) {
        const Vec g = Load(gate + k);
        const Vec silu = Div(g, Add(Set1(1.f), Exp(Sub(Zero(), g))));
        Store(out + k, Mul(silu, Load(up + k)));
      }
      for (; k < k_dim; ++k) out[k] = gate[k] / (1.f + std::exp(-gate[k])) * up[k];
    } else {
      const float* row = x + m * k_dim;
      // Sum of squares in vectors: the scalar loop's dependency chain took ~14 us per 16-row call.
      Vec squares = Zero();
      int64_t k = 0;
      for (; k + 16 <= k_dim; k += 16) squares = Fmadd(Load(row + k), Load(row + k), squares);
      float sum = ReduceAdd(squares);
      for (; k < k_dim; ++k) sum += row[k] * row[k];
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(k_dim) + eps);
      for (k = 0; k < k_dim; ++k) out[k] = row[k] * scale * norm[k];
    }
  }
};

// y = x @ W for more than 16 rows on AMX (cpu_amx.h), where it applies: x is split once into bfloat16 hi and lo A
// tiles, 32 rows a block (the last padded with zeros; by both threads from 64 rows, like Fusion::Input), then each
// task splits two panels of W into B tiles (`pair(panel, k2, c, w0, w1)` gives W's rows 2 k2 and 2 k2 + 1 of a
// panel's columns [c, c + 16), called for k2 = 0, 1, ... in turn) and runs every row block against them, each
// block finished while in cache. False: the AVX-512 kernels instead (no AMX, K not a multiple of 32, or too few
// rows: up to 16 rows a step is a decode and the register kernels win; 32-64 rows are about even).
constexpr int64_t kAmxAbove = 16;
constexpr int64_t kAmxPanels = 2;  // panels per task: three column pairs (the tile product is 32 columns wide)

template <typename PairFn>
bool AmxMatmul(const float* x, int64_t m_dim, int64_t k_dim, PairFn pair, const Fusion& fusion, float* ys,
               int64_t n_dim) {
#if JSGL_HAVE_AMX
  if (m_dim <= kAmxAbove || k_dim % amx::kTileK != 0 || !amx::Enabled()) return false;
  thread_local std::vector<uint16_t> a_buffer;  // block b's A tiles at b * kBlockRows * K * 2 (hi and lo)
  const int64_t blocks = (m_dim + amx::kBlockRows - 1) / amx::kBlockRows;
  a_buffer.resize(blocks * amx::kBlockRows * k_dim * 2);
  uint16_t* a_tiles = a_buffer.data();
  auto split = [&](int64_t b) {
    const int64_t m0 = b * amx::kBlockRows;
    amx::SplitBlock(x + m0 * k_dim, std::min(amx::kBlockRows, m_dim - m0), k_dim, a_tiles + m0 * k_dim * 2);
  };
  if (m_dim >= 64) {
    ParallelFor(blocks, split);
  } else {
    for (int64_t b = 0; b < blocks; ++b) split(b);
  }
  const int64_t num_panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t pair_elems = k_dim / amx::kTileK * amx::kPairTiles * amx::kTileElems;
  ParallelFor((num_panels + kAmxPanels - 1) / kAmxPanels, [&](int64_t task) {
    const int64_t p = task * kAmxPanels, groups = 3 * std::min(kAmxPanels, num_panels - p), pairs = (groups + 1) / 2;
    thread_local std::vector<uint16_t> b_buffer;
    b_buffer.resize(pairs * pair_elems);
    uint16_t* b_tiles = b_buffer.data();
    PairFn panel_pair = pair;  // its own copy per task: a quantized pair keeps its block's scales
    for (int64_t g = 0; g < groups; ++g)
      amx::SplitGroup(k_dim, g, [&](int64_t k2, Vec& w0, Vec& w1) { panel_pair(p + g / 3, k2, g % 3 * 16, w0, w1); },
                      b_tiles);
    if (groups % 2) {  // the last pair's second half: zero weights
      for (int64_t kb = 0; kb < k_dim / amx::kTileK; ++kb)
        for (int64_t half : {1, 3})
          std::fill_n(b_tiles + (pairs - 1) * pair_elems + (kb * amx::kPairTiles + half) * amx::kTileElems,
                      amx::kTileElems, 0);
    }
    amx::Configure();
    constexpr int64_t ldo = 3 * 32;
    alignas(64) float out[amx::kBlockRows * ldo];
    const int64_t cols = std::min(groups / 3 * kPanel, n_dim - p * kPanel);
    for (int64_t m0 = 0; m0 < m_dim; m0 += amx::kBlockRows) {
      const int64_t rows = std::min(amx::kBlockRows, m_dim - m0);
      for (int64_t q = 0; q < pairs; ++q)
        amx::PairProduct(a_tiles + m0 * k_dim * 2, k_dim, b_tiles + q * pair_elems, out + 32 * q, ldo);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; c += kPanel) {
          const Vec row[3] = {_mm512_load_ps(out + r * ldo + c), _mm512_load_ps(out + r * ldo + c + 16),
                              _mm512_load_ps(out + r * ldo + c + 32)};
          StoreColumns<3>(ys + (m0 + r) * n_dim + p * kPanel + c, row, cols - c);
        }
      fusion.Finish(ys, m0, rows, n_dim, p * kPanel, cols);
    }
    _tile_release();
  });
  return true;
#else
  return false;
#endif
}

ffi::Error PackedMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels, ffi::Buffer<ffi::F32> norm,
                        ffi::Buffer<ffi::F32> residual, float eps, bool swiglu, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  const int64_t k_dim = xd.size() == 2 ? xd[1] / (swiglu ? 2 : 1) : -1;
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kPanel || pd[1] != k_dim ||
      yd[0] != xd[0] || yd[1] > pd[0] * kPanel) {
    return ffi::Error::InvalidArgument("jsgl_packed_matmul: expected x [M, K], panels [P, K, 48], y [M, N<=48P]");
  }
  const int64_t m_dim = xd[0], n_dim = yd[1];
  const auto fusion = Fusion::Decode(norm, eps, swiglu, residual, m_dim, k_dim, n_dim);
  if (!fusion) return ffi::Error::InvalidArgument("jsgl matmul: bad norm / residual shapes");
  thread_local std::vector<float> input;
  const float* xs = fusion->Input(x.typed_data(), m_dim, k_dim, input);
  const float* ws = panels.typed_data();
  float* ys = y->typed_data();
  auto pair = [&](int64_t p, int64_t k2, int64_t c, Vec& w0, Vec& w1) {
    const float* panel = ws + p * k_dim * kPanel;
    w0 = Load(panel + 2 * k2 * kPanel + c);
    w1 = Load(panel + (2 * k2 + 1) * kPanel + c);
  };
  if (AmxMatmul(xs, m_dim, k_dim, pair, *fusion, ys, n_dim)) return ffi::Error::Success();
  // One task per panel: the panel stays in cache while every row block passes over it.
  ParallelFor((n_dim + kPanel - 1) / kPanel, [&](int64_t p) {
    const float* panel = ws + p * k_dim * kPanel;
    const int64_t cols = std::min(kPanel, n_dim - p * kPanel);
    for (int64_t m = 0; m < m_dim; m += kRows) {
      const int64_t rows = std::min(kRows, m_dim - m);
      PanelProduct(xs + m * k_dim, rows, panel, k_dim, ys + m * n_dim + p * kPanel, n_dim, cols);
      fusion->Finish(ys, m, rows, n_dim, p * kPanel, cols);
    }
  });
  return ffi::Error::Success();
}

// GGUF blocks of 32 weights along K, as packed by jsgl/kernels/cpu.py: Q4_1 is w = d * q + m with q in
// 0..15, Q8_0 is w = d * q with q int8. d and m are float16, so d * q (+ m) is exact in float32 and every
// weight equals gguf's float32 dequantization.
//
// A panel of 48 columns is K/32 such blocks in a row, each one contiguous run of bytes, so a panel is one
// read stream: the scales as float16 [S][48] (d, then m for Q4_1), then the codes [32 / kRowsPerByte][48]
// (Q4_1: one byte holds rows 2t and 2t + 1 in its low and high nibble). That is the file's own size:
// 960 bytes per 32 x 48 weights for Q4_1, 1632 for Q8_0.
template <bool kQ4>
struct QuantBlock {
  static constexpr int64_t kScales = kQ4 ? 2 : 1;
  static constexpr int64_t kRowsPerByte = kQ4 ? 2 : 1;
  static constexpr int64_t kCodeOffset = kScales * kPanel * 2;
  static constexpr int64_t kBytes = kCodeOffset + 32 / kRowsPerByte * kPanel;

  // d and m of columns [c, c + 16) of a block.
  static Vec D(const uint8_t* block, int64_t c) { return Halves(block + 2 * c); }
  static Vec M(const uint8_t* block, int64_t c) { return kQ4 ? Halves(block + 2 * (kPanel + c)) : Zero(); }

  // The codes (as floats) of rows 2t and 2t + 1 (t < 16) of a block, columns [c, c + 16).
  static void Codes(const uint8_t* block, int64_t t, int64_t c, Vec& q0, Vec& q1) {
    const uint8_t* codes = block + kCodeOffset + c;
    if constexpr (kQ4) {
      Nibbles(codes + t * kPanel, q0, q1);
    } else {
      q0 = Int8s(codes + 2 * t * kPanel);
      q1 = Int8s(codes + (2 * t + 1) * kPanel);
    }
  }

  // Their weights, d * q (+ m).
  static void Pair(const uint8_t* block, int64_t t, int64_t c, Vec d, Vec m, Vec& w0, Vec& w1) {
    Codes(block, t, c, w0, w1);
    w0 = kQ4 ? Fmadd(w0, d, m) : Mul(w0, d);
    w1 = kQ4 ? Fmadd(w1, d, m) : Mul(w1, d);
  }

  // Prefetches the stream kPrefetchBytes past the code rows of pair t.
  static void Prefetch(const uint8_t* block, int64_t t) {
    const char* p = reinterpret_cast<const char*>(block + kCodeOffset + 2 * t / kRowsPerByte * kPanel);
    _mm_prefetch(p + kPrefetchBytes, _MM_HINT_T0);
    if constexpr (!kQ4) _mm_prefetch(p + kPrefetchBytes + kPanel, _MM_HINT_T0);
  }

 private:
  // 8 KB ahead: a thread streams one contiguous run of panels, so this runs on into its next panel
  // (1.5 KB was ~5% slower at 16 rows).
  static constexpr int64_t kPrefetchBytes = 8192;
};

constexpr int64_t kWideRows = 4;  // rows the wide kernel (below) takes, scales folded out of its sums
#if JSGL_AVX512
constexpr int64_t kDequantizeAbove = 16;  // rows; more go through DequantizePanel
#else
// AVX2: the 16-column kernel's 16 accumulators would take all 32 half registers, so from 5 rows the panel is
// dequantized once into cache for the float32 kernel.
constexpr int64_t kDequantizeAbove = kWideRows;
#endif
// 16-column groups the wide kernel sums at once for R rows: the whole panel with AVX-512; AVX2's 16 registers of 8
// floats hold that only for one row (one set of sums), else one group at a time.
constexpr int WideGroups(int rows) { return JSGL_AVX512 || rows == 1 ? 3 : 1; }

#if JSGL_AVX512
// y[0:R, 0:cols] = x[0:R, :] @ W[:, columns c .. c + 16 of a panel]: each row of 16 weights is dequantized
// in registers and used for all R (<= 16) rows at once, so a decode step reads 4-8 bits per weight and
// dequantizes each weight once per 16 rows.
constexpr int64_t kQuantRows = 16;
static_assert(kDequantizeAbove <= kQuantRows, "the 16-column kernel takes all rows at once");

// In-register transpose of a 16 x 16 block: r[i] holds row i before, column i after.
inline void Transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

// x [M <= 16, K] (K a multiple of 16) into x_t [K][16]; rows past M are zero.
inline void TransposeRows(const float* x, int64_t m_dim, int64_t k_dim, float* x_t) {
  for (int64_t k0 = 0; k0 < k_dim; k0 += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < m_dim ? _mm512_loadu_ps(x + i * k_dim + k0) : _mm512_setzero_ps();
    Transpose16x16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(x_t + (k0 + i) * kQuantRows, r[i]);
  }
}

// x_t is x transposed, [K][16]: one base address serves every row (GCC spilled 16 row pointers of x
// [R, K] into vector registers inside the loop).
template <int R, bool kQ4>
void QuantMicroKernel(const float* x_t, const uint8_t* panel, int64_t c, int64_t k_dim, float* y, int64_t ldy,
                      int64_t cols) {
  using Block = QuantBlock<kQ4>;
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Zero();
  for (int64_t b = 0; b < k_dim / 32; ++b) {
    const uint8_t* block = panel + b * Block::kBytes;
    const Vec d = Block::D(block, c), m = Block::M(block, c);
    for (int64_t t = 0; t < 16; ++t) {
      Block::Prefetch(block, t);
      Vec w0, w1;
      Block::Pair(block, t, c, d, m, w0, w1);
      const float* x0 = x_t + (32 * b + 2 * t) * kQuantRows;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[r] = Fmadd(Set1(x0[r]), w0, acc[r]);
        acc[r] = Fmadd(Set1(x0[kQuantRows + r]), w1, acc[r]);
      }
    }
  }
  const Mask mask = FirstLanes(cols);
  for (int r = 0; r < R; ++r) StoreFirst(y + r * ldy, mask, acc[r]);
}

using QuantMicroKernelFn = void (*)(const float*, const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t);
template <bool kQ4, int... R>
constexpr std::array<QuantMicroKernelFn, sizeof...(R) + 1> QuantKernels(std::integer_sequence<int, R...>) {
  return {nullptr, QuantMicroKernel<R + 1, kQ4>...};
}
#endif  // JSGL_AVX512

// The same weights written out as a float32 panel [K, 48]: for many rows, dequantizing each weight once
// into cache and running the float32 micro-kernel beats dequantizing it again for every 16 rows.
template <bool kQ4>
void DequantizePanel(const uint8_t* panel, int64_t k_dim, float* out) {
  using Block = QuantBlock<kQ4>;
  for (int64_t b = 0; b < k_dim / 32; ++b) {
    const uint8_t* block = panel + b * Block::kBytes;
    for (int64_t c = 0; c < kPanel; c += 16) {
      const Vec d = Block::D(block, c), m = Block::M(block, c);
      for (int64_t t = 0; t < 16; ++t) {
        Vec w0, w1;
        Block::Pair(block, t, c, d, m, w0, w1);
        float* row = out + (32 * b + 2 * t) * kPanel + c;
        Store(row, w0);
        Store(row + kPanel, w1);
      }
    }
  }
}

constexpr int kSplitRows = 2;  // up to this many rows the wide kernel keeps even and odd k apart

// The same for R <= 4 rows over all 48 columns of a panel, with the scales taken out of the inner loop:
// sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k per block, which halves the FMAs per weight (the
// kernel is bound by them at one row). The weights are the same; the sums differ from the float32 kernel's
// by rounding only. Three independent accumulator chains per row, since a single row is bound by the FMA
// latency, and for R <= 2 two sets of them (even and odd k). One pass: columns [c0, c0 + 16 G) of the panel.
// x_sums [R][K/32]: each row's sum over each block.
template <int R, bool kQ4, int64_t c0, int G>
void QuantWidePass(const float* x, int64_t ldx, const float* x_sums, const uint8_t* panel, int64_t k_dim, float* y,
                   int64_t ldy, int64_t cols) {
  using Block = QuantBlock<kQ4>;
  // AVX2 summing all three groups (one row) has registers for one set: 6 sums + 4 codes + 2 broadcasts.
  constexpr int kSets = R <= kSplitRows && (JSGL_AVX512 || G == 1) ? 2 : 1;
  const int64_t num_blocks = k_dim / 32;
  Vec acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) acc[r][j] = Zero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = panel + b * Block::kBytes;
    Vec dot[kSets][R][G];  // sum_k x_k q_k over this block
    for (int s = 0; s < kSets; ++s)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < G; ++j) dot[s][r][j] = Zero();
    auto& odd = dot[kSets - 1];
    for (int64_t t = 0; t < 16; ++t) {
      Block::Prefetch(block, t);
      const int64_t k = 32 * b + 2 * t;
      for (int j = 0; j < G; ++j) {
        Vec q0, q1;
        Block::Codes(block, t, c0 + 16 * j, q0, q1);
        for (int r = 0; r < R; ++r) {
          dot[0][r][j] = Fmadd(Set1(x[r * ldx + k]), q0, dot[0][r][j]);
          odd[r][j] = Fmadd(Set1(x[r * ldx + k + 1]), q1, odd[r][j]);
        }
      }
    }
    for (int j = 0; j < G; ++j) {
      const Vec d = Block::D(block, c0 + 16 * j), m = Block::M(block, c0 + 16 * j);
      for (int r = 0; r < R; ++r) {
        const Vec sum = kSets == 2 ? Add(dot[0][r][j], odd[r][j]) : dot[0][r][j];
        acc[r][j] = Fmadd(d, sum, acc[r][j]);
        if constexpr (kQ4) acc[r][j] = Fmadd(m, Set1(x_sums[r * num_blocks + b]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) StoreColumns<G>(y + r * ldy, acc[r], cols);
}

// All of a panel's columns: one pass with AVX-512, a pass per group where AVX2 takes one at a time. Each pass's start
// is a constant (a runtime column offset cost the one-row AVX-512 kernel ~30% more instructions).
template <int R, bool kQ4, int64_t... Pass>
void QuantPasses(const float* x, int64_t ldx, const float* x_sums, const uint8_t* panel, int64_t k_dim, float* y,
                 int64_t ldy, int64_t cols, std::integer_sequence<int64_t, Pass...>) {
  constexpr int G = WideGroups(R);
  ((16 * G * Pass < cols ? QuantWidePass<R, kQ4, 16 * G * Pass, G>(x, ldx, x_sums, panel, k_dim, y + 16 * G * Pass,
                                                                    ldy, std::min<int64_t>(16 * G, cols - 16 * G * Pass))
                         : void()),
   ...);
}
template <int R, bool kQ4>
void QuantMicroKernelWide(const float* x, int64_t ldx, const float* x_sums, const uint8_t* panel, int64_t k_dim,
                          float* y, int64_t ldy, int64_t cols) {
  QuantPasses<R, kQ4>(x, ldx, x_sums, panel, k_dim, y, ldy, cols, std::make_integer_sequence<int64_t, 3 / WideGroups(R)>());
}

using WideQuantMicroKernelFn = void (*)(const float*, int64_t, const float*, const uint8_t*, int64_t, float*, int64_t,
                                        int64_t);
template <bool kQ4, int... R>
constexpr std::array<WideQuantMicroKernelFn, sizeof...(R) + 1> WideQuantKernels(std::integer_sequence<int, R...>) {
  return {nullptr, QuantMicroKernelWide<R + 1, kQ4>...};
}

// blocks [P, K/32, QuantBlock::kBytes]; one task per panel: for at most 4 rows all 48 columns at once, for
// up to 16 (AVX-512) its three 16-column groups in turn (they share the panel's bytes in cache), for more the
// dequantized panel. From 5 rows on they give the float32 kernel's sums bit for bit (the wide kernel
// folds the scales out of its sums).
template <bool kQ4>
ffi::Error QuantMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> blocks, ffi::Buffer<ffi::F32> norm,
                       ffi::Buffer<ffi::F32> residual, float eps, bool swiglu, ffi::ResultBuffer<ffi::F32> y) {
  using Block = QuantBlock<kQ4>;
  static constexpr auto wide_kernels = WideQuantKernels<kQ4>(std::make_integer_sequence<int, kWideRows>());
  const auto xd = x.dimensions(), bd = blocks.dimensions(), yd = y->dimensions();
  const int64_t k_dim = xd.size() == 2 ? xd[1] / (swiglu ? 2 : 1) : -1;
  if (xd.size() != 2 || bd.size() != 3 || yd.size() != 2 || k_dim % 32 != 0 || bd[1] * 32 != k_dim ||
      bd[2] != Block::kBytes || yd[0] != xd[0] || yd[1] > bd[0] * kPanel) {
    return ffi::Error::InvalidArgument("jsgl_quant_matmul: blocks do not match x [M, K] and y [M, N]");
  }
  const int64_t m_dim = xd[0], n_dim = yd[1];
  const auto fusion = Fusion::Decode(norm, eps, swiglu, residual, m_dim, k_dim, n_dim);
  if (!fusion) return ffi::Error::InvalidArgument("jsgl matmul: bad norm / residual shapes");
  thread_local std::vector<float> input;
  const float* xs = fusion->Input(x.typed_data(), m_dim, k_dim, input);
  const uint8_t* bs = blocks.typed_data();
  float* ys = y->typed_data();
#if JSGL_AVX512
  static constexpr auto kernels = QuantKernels<kQ4>(std::make_integer_sequence<int, kQuantRows>());
  // x transposed for the 16-column kernel (rows past m_dim are never read). The tasks get its address:
  // the helpers would see their own thread_local buffer.
  thread_local std::vector<float> x_t_buffer;
  if (m_dim > kWideRows && m_dim <= kDequantizeAbove) {
    x_t_buffer.resize(k_dim * kQuantRows);
    TransposeRows(xs, m_dim, k_dim, x_t_buffer.data());
  }
  const float* x_t = x_t_buffer.data();
#endif
  // Each row's sums over the blocks, for the wide kernel.
  thread_local std::vector<float> x_sums_buffer;
  if (m_dim <= kWideRows) {
    x_sums_buffer.resize(m_dim * bd[1]);
    for (int64_t r = 0; r < m_dim; ++r)
      for (int64_t b = 0; b < bd[1]; ++b) {
        const float* xb = xs + r * k_dim + 32 * b;
        x_sums_buffer[r * bd[1] + b] = ReduceAdd(Add(Load(xb), Load(xb + 16)));
      }
  }
  const float* x_sums = x_sums_buffer.data();
  // Called for k2 = 0, 1, ... of one panel's columns in turn: a block's scales are read at its first pair.
  auto pair = [&, d = Zero(), m = Zero()](int64_t p, int64_t k2, int64_t c, Vec& w0, Vec& w1) mutable {
    const uint8_t* block = bs + (p * bd[1] + k2 / 16) * Block::kBytes;
    if (k2 % 16 == 0) d = Block::D(block, c), m = Block::M(block, c);
    Block::Pair(block, k2 % 16, c, d, m, w0, w1);
  };
  if (AmxMatmul(xs, m_dim, k_dim, pair, *fusion, ys, n_dim)) return ffi::Error::Success();
  ParallelFor((n_dim + kPanel - 1) / kPanel, [&](int64_t p) {
    const uint8_t* panel = bs + p * bd[1] * Block::kBytes;
    const int64_t cols = std::min(kPanel, n_dim - p * kPanel);
    if (m_dim <= kWideRows) {
      wide_kernels[m_dim](xs, k_dim, x_sums, panel, k_dim, ys + p * kPanel, n_dim, cols);
#if JSGL_AVX512
    } else if (m_dim <= kDequantizeAbove) {
      for (int64_t g = 0; g < cols; g += 16)
        kernels[m_dim](x_t, panel, g, k_dim, ys + p * kPanel + g, n_dim, std::min<int64_t>(16, cols - g));
#endif
    } else {
      thread_local std::vector<float> scratch;
      scratch.resize(k_dim * kPanel);
      DequantizePanel<kQ4>(panel, k_dim, scratch.data());
      for (int64_t m = 0; m < m_dim; m += kRows) {
        const int64_t rows = std::min(kRows, m_dim - m);
        PanelProduct(xs + m * k_dim, rows, scratch.data(), k_dim, ys + m * n_dim + p * kPanel, n_dim, cols);
        fusion->Finish(ys, m, rows, n_dim, p * kPanel, cols);
      }
      return;
    }
    fusion->Finish(ys, 0, m_dim, n_dim, p * kPanel, cols);
  });
  return ffi::Error::Success();
}

}  // namespace

// For jsgl/kernels/cpu.py's amx_enabled(): whether prefill-sized matmuls take the AMX path in this process.
extern "C" int jsgl_amx_enabled() { return amx::Enabled() ? 1 : 0; }
// For cpu.py's vector_isa(): 1 for the AVX-512 build, 0 for AVX2.
extern "C" int jsgl_avx512() { return JSGL_AVX512; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(jsgl_packed_matmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm [K] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [M, N] or [0, 0]
                                  .Attr<float>("eps")
                                  .Attr<bool>("swiglu")
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define JSGL_QUANT_MATMUL(name, q4)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, QuantMatmul<q4>,                                          \
                                ffi::Ffi::Bind()                                                \
                                    .Arg<ffi::Buffer<ffi::F32>>()                               \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                \
                                    .Arg<ffi::Buffer<ffi::F32>>()                               \
                                    .Arg<ffi::Buffer<ffi::F32>>()                               \
                                    .Attr<float>("eps")                                         \
                                    .Attr<bool>("swiglu")                                       \
                                    .Ret<ffi::Buffer<ffi::F32>>());
JSGL_QUANT_MATMUL(jsgl_q4_1_matmul, true)
JSGL_QUANT_MATMUL(jsgl_q8_0_matmul, false)
