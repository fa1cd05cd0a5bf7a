// Persistent thread pool. A decode step issues hundreds of parallel_for calls, each a few
// microseconds of work, so a call must not cost a futex round trip when the workers are busy:
// workers spin on the generation counter for a while after each job and only then block on the
// condition variable. The caller runs chunk 0 itself and spins until the others report done.
#include "kernels/threadpool.h"

#include <immintrin.h>

#include <chrono>

namespace microspec {

namespace {

// How long an idle worker polls before blocking. Long enough to bridge the serial work between
// two matmuls of a decode step (norms, attention: tens of microseconds), short enough that an idle
// pool stops burning its cores quickly.
constexpr auto kSpinTime = std::chrono::microseconds(2000);

inline void cpu_relax() { _mm_pause(); }

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  workers_.reserve(size_t(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::chunk(int index, int64_t* begin, int64_t* end) const {
  // Split whole grains evenly; the first (n_grains % n_threads) threads take one grain more.
  const int64_t n_grains = (n_ + grain_ - 1) / grain_;
  const int64_t base = n_grains / n_threads_, extra = n_grains % n_threads_;
  const int64_t g0 = index * base + (index < extra ? index : extra);
  const int64_t g1 = g0 + base + (index < extra ? 1 : 0);
  *begin = g0 * grain_ < n_ ? g0 * grain_ : n_;
  *end = g1 * grain_ < n_ ? g1 * grain_ : n_;
}

void ThreadPool::run(int64_t n, int64_t grain, Thunk thunk, void* ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (n_threads_ == 1 || n <= grain) {
    thunk(ctx, 0, n, 0);
    return;
  }
  thunk_ = thunk;
  ctx_ = ctx;
  n_ = n;
  grain_ = grain;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  // seq_cst: pairs with the sleeping_ increment in worker(), see there.
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) > 0) {
    // Taking the mutex orders this notify after any worker that saw the old generation has
    // actually started waiting, so no wakeup is lost.
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
  int64_t b, e;
  chunk(0, &b, &e);
  try {
    if (b < e) thunk(ctx, b, e, 0);
  } catch (...) {
    // The workers still use ctx, which lives in the caller's frame: let them finish first.
    while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
    throw;
  }
  while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
}

void ThreadPool::worker(int index) {
  // The generation before any job: run() may publish the first job before this thread starts.
  uint64_t seen = 0;
  for (;;) {
    // Spin, then sleep, until the generation moves on.
    uint64_t g = generation_.load(std::memory_order_acquire);
    if (g == seen) {
      const auto deadline = std::chrono::steady_clock::now() + kSpinTime;
      for (int i = 0;; ++i) {
        cpu_relax();
        g = generation_.load(std::memory_order_acquire);
        if (g != seen) break;
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > deadline) break;
      }
    }
    if (g == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      // seq_cst with run(): either run() sees sleeping_ > 0 and notifies under the mutex, or this
      // load sees the new generation and does not wait.
      sleeping_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
      sleeping_.fetch_sub(1, std::memory_order_relaxed);
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_) return;
    int64_t b, e;
    chunk(index, &b, &e);
    if (b < e) thunk_(ctx_, b, e, index);
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace microspec
