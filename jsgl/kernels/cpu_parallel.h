// ParallelFor for the CPU kernels (cpu_matmul.cc, cpu_attention.cc): work split between the calling
// thread and helper threads of our own.
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#ifndef __AVX512F__
#error "the jsgl CPU kernels need AVX-512F"
#endif

namespace jsgl {

// Helper threads for ParallelFor: one fewer than the cores this process may use (JSGL_CPU_THREADS sets
// the total). XLA's own intra-op pool parks its threads between ops, and waking one took about as long
// as a decode-sized matmul (the caller did 94% of the work), so these spin for a while after each job.
class Helpers {
 public:
  struct Job {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0, grain = 1;
    const std::function<void(int64_t)>* body = nullptr;
    void Work() {
      for (int64_t i; (i = next.fetch_add(grain, std::memory_order_relaxed)) < n;) {
        const int64_t end = std::min(n, i + grain);
        for (int64_t j = i; j < end; ++j) (*body)(j);
        done.fetch_add(end - i, std::memory_order_release);
      }
    }
  };

  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: threads outlive static teardown
    return *helpers;
  }

  int threads() const { return static_cast<int>(threads_.size()) + 1; }  // with the caller

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

// body(i) for every i in [0, n), on the calling thread and the helpers. Runs of `grain` consecutive indices
// are claimed from a shared counter, so the caller never waits for a helper that has not started: it works
// until none is left, then waits only for indices already claimed.
inline void ParallelFor(int64_t n, const std::function<void(int64_t)>& body, int64_t grain = 1) {
  auto job = std::make_shared<Helpers::Job>();
  job->n = n;
  job->grain = std::max<int64_t>(1, grain);
  job->body = &body;  // read only for a claimed index, while the caller still waits
  Helpers& helpers = Helpers::Get();
  const bool shared = n > job->grain && helpers.Publish(job);
  job->Work();
  if (shared) helpers.Retract();
  while (job->done.load(std::memory_order_acquire) < n) _mm_pause();
}

}  // namespace jsgl
