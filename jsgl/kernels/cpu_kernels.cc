// CPU kernels for the jitted step, called through XLA's FFI (built and loaded by jsgl/kernels/cpu.py).
//
// jsgl_packed_matmul: y[M, N] = x[M, K] @ W with W packed once, at load, into panels [P, K, 48] of 48
//   output columns (3 AVX-512 vectors). XLA's CPU dot repacks its weight operand on every call; for the
//   1-16 rows of a decode step that costs about as much as the arithmetic.
// jsgl_q4_1_matmul, jsgl_q8_0_matmul: the same over weights kept in the GGUF file's own quantized blocks,
//   dequantized exactly, in registers (see QuantMicroKernel).
// jsgl_paged_decode_attention: one query token per request attends over its slots, read in place from
//   the token-granular pool [Hkv, N, D] (XLA gathers a [B, Hkv, L, D] copy of K and V first).
//
// All split their work between the calling thread and helper threads (see Helpers).

#include <immintrin.h>

#include <sched.h>

#include <algorithm>
#include <array>
#include <utility>
#include <chrono>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#include <cstdlib>

#include "xla/ffi/api/ffi.h"

#ifndef __AVX512F__
#error "the jsgl CPU kernels need AVX-512F"
#endif



namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 48;  // output columns of one packed panel
constexpr int64_t kRows = 8;    // rows of one micro-kernel call: 8 x 3 accumulators of 16 floats
// Software prefetch this many panel rows ahead (6 KB): the hardware prefetcher alone left a decode
// matmul at ~40 GB/s of weights; with it ~54, and 16-row matmuls ran ~15% faster too.
constexpr int64_t kPrefetchRows = 32;

// Helper threads for ParallelFor: one fewer than the cores this process may use (JSGL_CPU_THREADS sets
// the total). XLA's own intra-op pool parks its threads between ops, and waking one took about as long
// as a decode-sized matmul (the caller did 94% of the work), so these spin for a while after each job.
class Helpers {
 public:
  struct Job {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    const std::function<void(int64_t)>* body = nullptr;
    void Work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        (*body)(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };

  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: threads outlive static teardown
    return *helpers;
  }

  // Offers the job to the helpers; false if another caller's job holds them (then the caller works alone).
  bool Publish(const std::shared_ptr<Job>& job) {
    if (threads_.empty()) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (current_) return false;
      current_ = job;
      epoch_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    return true;
  }

  void Retract() {
    std::lock_guard<std::mutex> lock(mu_);
    current_.reset();
  }

 private:
  Helpers() {
    cpu_set_t set;
    int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    if (const char* env = std::getenv("JSGL_CPU_THREADS")) cores = std::max(1, std::atoi(env));
    for (int t = 1; t < cores; ++t) threads_.emplace_back([this] { Loop(); });
    for (auto& th : threads_) th.detach();
  }

  void Loop() {
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      // Spin up to 1 ms for the next job (a step's next matmul comes within microseconds), yielding the
      // core to any runnable thread (XLA's own) as we go, then sleep until woken.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
      for (int spin = 1; epoch_.load(std::memory_order_acquire) == seen; ++spin) {
        _mm_pause();
        if (spin % 64 == 0) {
          if (std::chrono::steady_clock::now() > deadline) break;
          sched_yield();
        }
      }
      if (epoch_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        wake_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = epoch_.load(std::memory_order_acquire);
        job = current_;
      }
      if (job) job->Work();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleeping_{0};
  std::shared_ptr<Job> current_;
  std::vector<std::thread> threads_;
};

// body(i) for every i in [0, n), on the calling thread and the helpers. Indices are claimed from a shared
// counter, so the caller never waits for a helper that has not started: it works until none is left,
// then waits only for indices already claimed.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& body) {
  auto job = std::make_shared<Helpers::Job>();
  job->n = n;
  job->body = &body;  // read only for a claimed index, while the caller still waits
  Helpers& helpers = Helpers::Get();
  const bool shared = n > 1 && helpers.Publish(job);
  job->Work();
  if (shared) helpers.Retract();
  while (job->done.load(std::memory_order_acquire) < n) _mm_pause();
}

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

ffi::Error PackedMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kPanel || pd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] > pd[0] * kPanel) {
    return ffi::Error::InvalidArgument("jsgl_packed_matmul: expected x [M, K], panels [P, K, 48], y [M, N<=48P]");
  }
  const int64_t m_dim = xd[0], k_dim = xd[1], n_dim = yd[1];
  const float* xs = x.typed_data();
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
                       ffi::ResultBuffer<ffi::F32> y) {
  static constexpr auto kernels = QuantKernels<kQ4>(std::make_integer_sequence<int, kQuantRows>());
  static constexpr auto wide_kernels = WideQuantKernels<kQ4>(std::make_integer_sequence<int, kWideRows>());
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  const int64_t rows_per_byte = kQ4 ? 2 : 1, num_scales = kQ4 ? 2 : 1;
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 4 || yd.size() != 2 || xd[1] % 32 != 0 ||
      cd[1] * rows_per_byte != xd[1] || cd[2] != kPanel || sd[0] != cd[0] || sd[1] * 32 != xd[1] ||
      sd[2] != num_scales || sd[3] != kPanel || yd[0] != xd[0] || yd[1] > cd[0] * kPanel) {
    return ffi::Error::InvalidArgument("jsgl_quant_matmul: codes/scales do not match x [M, K] and y [M, N]");
  }
  const int64_t m_dim = xd[0], k_dim = xd[1], n_dim = yd[1];
  const float* xs = x.typed_data();
  const uint8_t* cs = codes.typed_data();
  const float* ss = scales.typed_data();
  float* ys = y->typed_data();
  std::vector<float> x_t;  // for the 16-column kernel
  if (m_dim > kWideRows && m_dim <= kDequantizeAbove) {
    x_t.assign(k_dim * kQuantRows, 0.f);
    for (int64_t r = 0; r < m_dim; ++r)
      for (int64_t k = 0; k < k_dim; ++k) x_t[k * kQuantRows + r] = xs[r * k_dim + k];
  }
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
      return;
    }
    if (m_dim <= kWideRows) {
      wide_kernels[m_dim](xs, k_dim, panel_codes, panel_scales, k_dim, ys + p * kPanel, n_dim,
                          std::min(kPanel, n_dim - p * kPanel));
      return;
    }
    for (int64_t g = 0; g < kPanel && p * kPanel + g < n_dim; g += 16) {
      const int64_t cols = std::min<int64_t>(16, n_dim - p * kPanel - g);
      kernels[m_dim](x_t.data(), panel_codes + g, panel_scales + g, k_dim, ys + p * kPanel + g, n_dim, cols);
    }
  });
  return ffi::Error::Success();
}

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

// e^x for x <= 0 (scores minus their max), within ~2 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by its
// degree-6 Taylor polynomial, times 2^n.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
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

ffi::Error PagedDecodeAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                                ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> block_table,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_start,
                                ffi::Buffer<ffi::S32> q_len, float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), bd = block_table.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || bd.size() != 2 || kd[2] != qd[2] || qd[1] % kd[0] != 0 ||
      qd[2] % 16 != 0 || qd[2] > kMaxHeadDim || qd[1] / kd[0] > kMaxGroup) {
    return ffi::Error::InvalidArgument(
        "jsgl_paged_decode_attention: expected q [T, Hq, D], pools [Hkv, N, D], D % 16 == 0, D <= 256");
  }
  const int64_t num_tokens = qd[0], q_heads = qd[1], head_dim = qd[2];
  const int64_t kv_heads = kd[0], num_slots = kd[1], batch = bd[0], max_len = bd[1];
  const int64_t group = q_heads / kv_heads;
  const float *qs = q.typed_data(), *ks = k_pool.typed_data(), *vs = v_pool.typed_data();
  const int32_t *table = block_table.typed_data(), *lens = kv_lens.typed_data();
  const int32_t *starts = q_start.typed_data(), *counts = q_len.typed_data();
  float* os = out->typed_data();
  std::memset(os, 0, sizeof(float) * num_tokens * q_heads * head_dim);  // padding rows stay zero

  ParallelFor(batch * kv_heads, [&](int64_t item) {
    const int64_t b = item / kv_heads, h = item % kv_heads;
    const int64_t len = std::min<int64_t>(lens[b], max_len);
    const int64_t row = starts[b];
    if (counts[b] <= 0 || len <= 0 || row < 0 || row >= num_tokens) return;
    const int32_t* slots = table + b * max_len;
    const float* k_head = ks + h * num_slots * head_dim;
    const float* v_head = vs + h * num_slots * head_dim;
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
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jsgl_packed_matmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define JSGL_QUANT_MATMUL(name, q4)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, QuantMatmul<q4>,                                          \
                                ffi::Ffi::Bind()                                                \
                                    .Arg<ffi::Buffer<ffi::F32>>()                               \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                \
                                    .Arg<ffi::Buffer<ffi::F32>>()                               \
                                    .Ret<ffi::Buffer<ffi::F32>>());
JSGL_QUANT_MATMUL(jsgl_q4_1_matmul, true)
JSGL_QUANT_MATMUL(jsgl_q8_0_matmul, false)

XLA_FFI_DEFINE_HANDLER_SYMBOL(jsgl_paged_decode_attention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
