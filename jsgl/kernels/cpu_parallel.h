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

namespace jsgl {

// Helper threads for ParallelFor: one fewer than the cores this process may use (JSGL_CPU_THREADS sets
// the total). XLA's own intra-op pool parks its threads between ops, and waking one took about as long
// as a decode-sized matmul (the caller did 94% of the work), so these spin for a while after each job.
class Helpers {
 public:
  static constexpr int kMaxThreads = 64;

  // Indices [0, n) split into one contiguous segment per thread. A thread takes its own segment front to
  // back, then steals from the back of the others' (a helper that starts late loses its segment's tail,
  // and the caller never waits for it). Each thread thus reads one long run of neighbouring panels:
  // one panel per claim left a decode matmul's weight stream at ~30 GB/s, segments ~45.
  struct Job {
    // Segment s: (next, end) packed into one word, so the owner's front claim and a thief's back claim
    // race on one compare-and-swap.
    std::atomic<uint64_t> segments[kMaxThreads];
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    int threads = 1;
    const std::function<void(int64_t)>* body = nullptr;

    Job(int64_t count, int num_threads, const std::function<void(int64_t)>* fn)
        : n(count), threads(num_threads), body(fn) {
      for (int s = 0; s < threads; ++s)
        segments[s].store(Pack(n * s / threads, n * (s + 1) / threads), std::memory_order_relaxed);
    }

    void Work(int self) {
      int64_t i;
      while (Claim(self, /*front=*/true, &i)) Run(i);
      for (int k = 1; k < threads; ++k)
        while (Claim((self + k) % threads, /*front=*/false, &i)) Run(i);
    }

   private:
    static uint64_t Pack(int64_t next, int64_t end) { return static_cast<uint64_t>(next) << 32 | static_cast<uint32_t>(end); }
    void Run(int64_t i) {
      (*body)(i);
      done.fetch_add(1, std::memory_order_release);
    }
    bool Claim(int s, bool front, int64_t* i) {
      uint64_t word = segments[s].load(std::memory_order_relaxed);
      for (;;) {
        const int64_t next = static_cast<int64_t>(word >> 32), end = static_cast<uint32_t>(word);
        if (next >= end) return false;
        const uint64_t claimed = front ? Pack(next + 1, end) : Pack(next, end - 1);
        if (segments[s].compare_exchange_weak(word, claimed, std::memory_order_relaxed)) {
          *i = front ? next : end - 1;
          return true;
        }
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
    if (const char* env = std::getenv("JSGL_CPU_THREADS")) cores = std::atoi(env);
    cores = std::clamp(cores, 1, kMaxThreads);
    for (int t = 1; t < cores; ++t) threads_.emplace_back([this, t] { Loop(t); });
    for (auto& th : threads_) th.detach();
  }

  void Loop(int self) {
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
      if (job && self < job->threads) job->Work(self);
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleeping_{0};
  std::shared_ptr<Job> current_;
  std::vector<std::thread> threads_;
};

// body(i) for every i in [0, n), on the calling thread and the helpers (see Helpers::Job). The caller
// waits only for indices a helper has already claimed.
inline void ParallelFor(int64_t n, const std::function<void(int64_t)>& body) {
  Helpers& helpers = Helpers::Get();
  const bool share = n > 1 && helpers.threads() > 1;
  auto job = std::make_shared<Helpers::Job>(n, share ? helpers.threads() : 1, &body);
  const bool shared = share && helpers.Publish(job);
  job->Work(0);  // with no helpers: the whole range (the caller steals the other segments)
  if (shared) helpers.Retract();
  while (job->done.load(std::memory_order_acquire) < n) _mm_pause();
}

}  // namespace jsgl
