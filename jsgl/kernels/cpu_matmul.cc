// Matmuls for the jitted step, called through XLA's FFI (built and loaded by jsgl/kernels/cpu.py).
//
// jsgl_packed_matmul: y[M, N] = x[M, K] @ W with W packed once, at load, into panels [P, K, 48] of 48
//   output columns (3 AVX-512 vectors). XLA's CPU dot repacks its weight operand on every call; for the
//   1-16 rows of a decode step that costs about as much as the arithmetic.
// jsgl_q4_1_matmul, jsgl_q8_0_matmul: the same over weights kept in the GGUF file's own quantized blocks,
//   dequantized exactly, in registers (see QuantMicroKernel).

#include <array>
#include <cmath>
#include <optional>
#include <utility>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jsgl::Exp;
using jsgl::ParallelFor;

namespace {

constexpr int64_t kPanel = 48;  // output columns of one packed panel
constexpr int64_t kRows = 8;    // rows of one micro-kernel call: 8 x 3 accumulators of 16 floats
// Software prefetch this many panel rows ahead (6 KB): the hardware prefetcher alone left a decode
// matmul at ~40 GB/s of weights; with it ~54, and 16-row matmuls ran ~15% faster too.
constexpr int64_t kPrefetchRows = 32;

// Stores the first `cols` (<= 48) of three vectors.
inline void StoreColumns(float* y, const __m512 v[3], int64_t cols) {
  for (int j = 0; j < 3; ++j) {
    const int64_t c = cols - 16 * j;
    if (c >= 16) {
      _mm512_storeu_ps(y + 16 * j, v[j]);
    } else if (c > 0) {
      _mm512_mask_storeu_ps(y + 16 * j, static_cast<__mmask16>((1u << c) - 1), v[j]);
    }
  }
}

// y[r, 0:cols] = sum_k x[r, k] * panel[k, 0:cols] for R rows.
template <int R>
void MicroKernel(const float* x, int64_t ldx, const float* panel, int64_t k_dim, float* y, int64_t ldy,
                 int64_t cols) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* b = panel + k * kPanel;
    for (int j = 0; j < 3; ++j) _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchRows * kPanel + 16 * j), _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
    }
  }
  for (int r = 0; r < R; ++r) StoreColumns(y + r * ldy, acc[r], cols);
}

using MicroKernelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
constexpr MicroKernelFn kMicroKernels[kRows + 1] = {nullptr,         MicroKernel<1>, MicroKernel<2>,
                                                    MicroKernel<3>, MicroKernel<4>, MicroKernel<5>,
                                                    MicroKernel<6>, MicroKernel<7>, MicroKernel<8>};

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

  // The product's input: x itself, or x transformed into `buffer`.
  const float* Input(const float* x, int64_t m_dim, int64_t k_dim, std::vector<float>& buffer) const {
    if (!norm && !swiglu) return x;
    buffer.resize(m_dim * k_dim);
    for (int64_t m = 0; m < m_dim; ++m) {
      float* out = buffer.data() + m * k_dim;
      if (swiglu) {
        const float *gate = x + m * 2 * k_dim, *up = gate + k_dim;
        int64_t k = 0;
        for (; k + 16 <= k_dim; k += 16) {
          const __m512 g = _mm512_loadu_ps(gate + k);
          const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), Exp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
          _mm512_storeu_ps(out + k, _mm512_mul_ps(silu, _mm512_loadu_ps(up + k)));
        }
        for (; k < k_dim; ++k) out[k] = gate[k] / (1.f + std::exp(-gate[k])) * up[k];
      } else {
        const float* row = x + m * k_dim;
        float sum = 0.f;
        for (int64_t k = 0; k < k_dim; ++k) sum += row[k] * row[k];
        const float scale = 1.f / std::sqrt(sum / static_cast<float>(k_dim) + eps);
        for (int64_t k = 0; k < k_dim; ++k) out[k] = row[k] * scale * norm[k];
      }
    }
    return buffer.data();
  }

  // y[:, columns [c0, c0 + cols)] += residual, for the columns a task wrote.
  void Finish(float* y, int64_t m_dim, int64_t n_dim, int64_t c0, int64_t cols) const {
    if (!residual) return;
    for (int64_t m = 0; m < m_dim; ++m)
      for (int64_t c = c0; c < c0 + cols; ++c) y[m * n_dim + c] += residual[m * n_dim + c];
  }
};

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
  // One task per panel: the panel stays in cache while every row block passes over it.
  ParallelFor((n_dim + kPanel - 1) / kPanel, [&](int64_t p) {
    const float* panel = ws + p * k_dim * kPanel;
    const int64_t cols = std::min(kPanel, n_dim - p * kPanel);
    for (int64_t m = 0; m < m_dim; m += kRows) {
      const int64_t rows = std::min(kRows, m_dim - m);
      kMicroKernels[rows](xs + m * k_dim, k_dim, panel, k_dim, ys + m * n_dim + p * kPanel, n_dim, cols);
    }
    fusion->Finish(ys, m_dim, n_dim, p * kPanel, cols);
  });
  return ffi::Error::Success();
}

// GGUF blocks of 32 weights along K, as packed by jsgl/kernels/cpu.py: Q4_1 is w = d * q + m with q in
// 0..15 (one byte holds rows k and k+1: low nibble, high nibble), Q8_0 is w = d * q with q int8. d is a
// float16, so d * q is exact in float32 and every weight equals gguf's float32 dequantization.
//
// y[0:R, 0:cols] = x[0:R, :] @ W[:, 16 columns]: each row of 16 weights is dequantized in registers and
// used for all R (<= 16) rows at once, so a decode step reads 4-8 bits per weight and dequantizes each
// weight once per 16 rows.
constexpr int64_t kQuantRows = 16;

// x_t is x transposed, [K][16]: one base address serves every row (GCC spilled 16 row pointers of x
// [R, K] into vector registers inside the loop).
template <int R, bool kQ4>
void QuantMicroKernel(const float* x_t, const uint8_t* codes, const float* scales, int64_t k_dim, float* y,
                      int64_t ldy, int64_t cols) {
  constexpr int64_t kScales = kQ4 ? 2 : 1, kRowsPerByte = kQ4 ? 2 : 1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < k_dim / 32; ++b) {
    const __m512 d = _mm512_loadu_ps(scales + b * kScales * kPanel);
    const __m512 m = kQ4 ? _mm512_loadu_ps(scales + b * kScales * kPanel + kPanel) : _mm512_setzero_ps();
    for (int64_t k = 32 * b; k < 32 * (b + 1); k += kRowsPerByte) {
      const uint8_t* c = codes + k / kRowsPerByte * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(c + 32 * kPanel), _MM_HINT_T0);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
      if constexpr (kQ4) {
        const __m512i q = _mm512_cvtepu8_epi32(bytes);
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low_nibble)), d, m);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x_t[k * kQuantRows + r]), w0, acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x_t[(k + 1) * kQuantRows + r]), w1, acc[r]);
        }
      } else {
        const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), d);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x_t[k * kQuantRows + r]), w, acc[r]);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}

// The same weights written out as a float32 panel [K, 48]: for many rows, dequantizing each weight once
// into cache and running the float32 micro-kernel beats dequantizing it again for every 16 rows.
template <bool kQ4>
void DequantizePanel(const uint8_t* codes, const float* scales, int64_t k_dim, float* out) {
  constexpr int64_t kScales = kQ4 ? 2 : 1, kRowsPerByte = kQ4 ? 2 : 1;
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < k_dim / 32; ++b) {
    for (int j = 0; j < 3; ++j) {
      const float* s = scales + b * kScales * kPanel + 16 * j;
      const __m512 d = _mm512_loadu_ps(s), m = kQ4 ? _mm512_loadu_ps(s + kPanel) : _mm512_setzero_ps();
      for (int64_t k = 32 * b; k < 32 * (b + 1); k += kRowsPerByte) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / kRowsPerByte * kPanel + 16 * j));
        float* row = out + k * kPanel + 16 * j;
        if constexpr (kQ4) {
          const __m512i q = _mm512_cvtepu8_epi32(bytes);
          _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low_nibble)), d, m));
          _mm512_storeu_ps(row + kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m));
        } else {
          _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), d));
        }
      }
    }
  }
}

// The same for R <= 4 rows over all 48 columns of a panel: three independent accumulator chains per row
// instead of one, since a single row is bound by the FMA latency, not by its throughput.
template <int R, bool kQ4>
void QuantMicroKernelWide(const float* x, int64_t ldx, const uint8_t* codes, const float* scales, int64_t k_dim,
                          float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t kScales = kQ4 ? 2 : 1, kRowsPerByte = kQ4 ? 2 : 1;
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < k_dim / 32; ++b) {
    __m512 d[3], m[3];
    for (int j = 0; j < 3; ++j) {
      d[j] = _mm512_loadu_ps(scales + b * kScales * kPanel + 16 * j);
      m[j] = kQ4 ? _mm512_loadu_ps(scales + b * kScales * kPanel + kPanel + 16 * j) : _mm512_setzero_ps();
    }
    for (int64_t k = 32 * b; k < 32 * (b + 1); k += kRowsPerByte) {
      const uint8_t* c = codes + k / kRowsPerByte * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(c + 32 * kPanel), _MM_HINT_T0);
      for (int j = 0; j < 3; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j));
        if constexpr (kQ4) {
          const __m512i q = _mm512_cvtepu8_epi32(bytes);
          const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low_nibble)), d[j], m[j]);
          const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d[j], m[j]);
          for (int r = 0; r < R; ++r) {
            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, acc[r][j]);
            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + 1]), w1, acc[r][j]);
          }
        } else {
          const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), d[j]);
          for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) StoreColumns(y + r * ldy, acc[r], cols);
}

constexpr int64_t kWideRows = 4;
constexpr int64_t kDequantizeAbove = 16;  // rows; more go through DequantizePanel
static_assert(kDequantizeAbove <= kQuantRows, "the 16-column kernel takes all rows at once");
using QuantMicroKernelFn = void (*)(const float*, const uint8_t*, const float*, int64_t, float*, int64_t, int64_t);
using WideQuantMicroKernelFn = void (*)(const float*, int64_t, const uint8_t*, const float*, int64_t, float*, int64_t,
                                        int64_t);
template <bool kQ4, int... R>
constexpr std::array<QuantMicroKernelFn, sizeof...(R) + 1> QuantKernels(std::integer_sequence<int, R...>) {
  return {nullptr, QuantMicroKernel<R + 1, kQ4>...};
}
template <bool kQ4, int... R>
constexpr std::array<WideQuantMicroKernelFn, sizeof...(R) + 1> WideQuantKernels(std::integer_sequence<int, R...>) {
  return {nullptr, QuantMicroKernelWide<R + 1, kQ4>...};
}

// codes [P, K/2, 48] (Q4_1) or [P, K, 48] (Q8_0), scales [P, K/32, 2 or 1, 48]; one task per panel: its
// three 16-column groups in turn (they share the panel's code bytes in cache), or, for many rows, the
// dequantized panel, or for at most 4 rows all 48 columns at once. All give the float32 kernel's sums, bit
// for bit.
template <bool kQ4>
ffi::Error QuantMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scales,
                       ffi::Buffer<ffi::F32> norm, ffi::Buffer<ffi::F32> residual, float eps, bool swiglu,
                       ffi::ResultBuffer<ffi::F32> y) {
  static constexpr auto kernels = QuantKernels<kQ4>(std::make_integer_sequence<int, kQuantRows>());
  static constexpr auto wide_kernels = WideQuantKernels<kQ4>(std::make_integer_sequence<int, kWideRows>());
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  const int64_t rows_per_byte = kQ4 ? 2 : 1, num_scales = kQ4 ? 2 : 1;
  const int64_t k_dim = xd.size() == 2 ? xd[1] / (swiglu ? 2 : 1) : -1;
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 4 || yd.size() != 2 || k_dim % 32 != 0 ||
      cd[1] * rows_per_byte != k_dim || cd[2] != kPanel || sd[0] != cd[0] || sd[1] * 32 != k_dim ||
      sd[2] != num_scales || sd[3] != kPanel || yd[0] != xd[0] || yd[1] > cd[0] * kPanel) {
    return ffi::Error::InvalidArgument("jsgl_quant_matmul: codes/scales do not match x [M, K] and y [M, N]");
  }
  const int64_t m_dim = xd[0], n_dim = yd[1];
  const auto fusion = Fusion::Decode(norm, eps, swiglu, residual, m_dim, k_dim, n_dim);
  if (!fusion) return ffi::Error::InvalidArgument("jsgl matmul: bad norm / residual shapes");
  thread_local std::vector<float> input;
  const float* xs = fusion->Input(x.typed_data(), m_dim, k_dim, input);
  const uint8_t* cs = codes.typed_data();
  const float* ss = scales.typed_data();
  float* ys = y->typed_data();
  // x transposed for the 16-column kernel (rows past m_dim are never read). The tasks get its address:
  // the helpers would see their own thread_local buffer.
  thread_local std::vector<float> x_t_buffer;
  if (m_dim > kWideRows && m_dim <= kDequantizeAbove) {
    x_t_buffer.resize(k_dim * kQuantRows);
    for (int64_t k = 0; k < k_dim; ++k)
      for (int64_t r = 0; r < m_dim; ++r) x_t_buffer[k * kQuantRows + r] = xs[r * k_dim + k];
  }
  const float* x_t = x_t_buffer.data();
  ParallelFor((n_dim + kPanel - 1) / kPanel, [&](int64_t p) {
    const uint8_t* panel_codes = cs + p * cd[1] * kPanel;
    const float* panel_scales = ss + p * sd[1] * num_scales * kPanel;
    if (m_dim > kDequantizeAbove) {
      thread_local std::vector<float> scratch;
      scratch.resize(k_dim * kPanel);
      DequantizePanel<kQ4>(panel_codes, panel_scales, k_dim, scratch.data());
      const int64_t cols = std::min(kPanel, n_dim - p * kPanel);
      for (int64_t m = 0; m < m_dim; m += kRows) {
        const int64_t rows = std::min(kRows, m_dim - m);
        kMicroKernels[rows](xs + m * k_dim, k_dim, scratch.data(), k_dim, ys + m * n_dim + p * kPanel, n_dim, cols);
      }
      fusion->Finish(ys, m_dim, n_dim, p * kPanel, cols);
      return;
    }
    if (m_dim <= kWideRows) {
      wide_kernels[m_dim](xs, k_dim, panel_codes, panel_scales, k_dim, ys + p * kPanel, n_dim,
                          std::min(kPanel, n_dim - p * kPanel));
      fusion->Finish(ys, m_dim, n_dim, p * kPanel, std::min(kPanel, n_dim - p * kPanel));
      return;
    }
    for (int64_t g = 0; g < kPanel && p * kPanel + g < n_dim; g += 16) {
      const int64_t cols = std::min<int64_t>(16, n_dim - p * kPanel - g);
      kernels[m_dim](x_t, panel_codes + g, panel_scales + g, k_dim, ys + p * kPanel + g, n_dim, cols);
    }
    fusion->Finish(ys, m_dim, n_dim, p * kPanel, std::min(kPanel, n_dim - p * kPanel));
  });
  return ffi::Error::Success();
}

}  // namespace

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
                                    .Arg<ffi::Buffer<ffi::F32>>()                               \
                                    .Attr<float>("eps")                                         \
                                    .Attr<bool>("swiglu")                                       \
                                    .Ret<ffi::Buffer<ffi::F32>>());
JSGL_QUANT_MATMUL(jsgl_q4_1_matmul, true)
JSGL_QUANT_MATMUL(jsgl_q8_0_matmul, false)
