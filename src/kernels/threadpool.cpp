// Persistent thread pool. A decode step issues hundreds of parallel_for calls, each a few
// microseconds of work, so a call must not cost a futex round trip when the workers are busy:
// workers spin on the generation counter for a while after each call and only then block on the
// condition variable. Only the pool that started a call most recently (g_spinning_pool) keeps its
// idle workers spinning; another pool's idle workers go to sleep as soon as they see it change, so
// two pools taking turns on two cores (draft model and target) or running side by side (server
// slots) never have an idle worker competing for the core a running one needs.
//
// Work is split into up to kChunksPerThread chunks per thread; each thread claims its own chunks
// in order, then the chunks other threads have not claimed yet. The caller returns once every
// chunk has run, without waiting for workers that never got to claim one (late wakeup, or
// descheduled on a busy machine). Claims carry the call's generation, so a worker that arrives
// late cannot take a chunk of a later call.
#include "kernels/threadpool.h"

#include <immintrin.h>

#include <chrono>
#include <exception>

namespace microspec {

namespace {

// The default idle spin (ThreadPool::kDefaultIdleSpin) is long enough to bridge the serial work
// between two matmuls of a decode step (norms, attention, sampling: up to a few hundred
// microseconds), short enough that an idle pool stops burning its cores quickly.

// The pool whose idle workers may spin: the one that started a call most recently. Only compared,
// never dereferenced.
std::atomic<const ThreadPool*> g_spinning_pool{nullptr};
// Polls with pause alone before also yielding the core on each poll. Pure spinning answers within
// nanoseconds; yielding keeps a pool with more threads than free cores (other processes, tests
// running in parallel) from starving the very thread it waits for.
constexpr int kPureSpins = 2000;
// Chunks per thread: enough that a late or preempted thread's share can be taken over in parts,
// few enough that per-chunk costs (a kernel call, its activation setup) stay negligible.
constexpr int64_t kChunksPerThread = 4;

inline void cpu_relax() {
  _mm_pause();
}

// One poll of a wait loop: pause, and after kPureSpins polls also give the core away.
inline void backoff(int& spins) {
  if (spins < kPureSpins) {
    ++spins;
    cpu_relax();
  } else {
    std::this_thread::yield();
  }
}

inline uint64_t pack(uint32_t generation, int64_t next, int64_t end) {
  return (uint64_t(generation) << 32) | (uint64_t(next) << 16) | uint64_t(end);
}

// The exception thrown by the caller's own chunk, kept until the other chunks have settled.
thread_local std::exception_ptr t_error;

}  // namespace

ThreadPool::ThreadPool(int n_threads, std::chrono::microseconds idle_spin)
    : n_threads_(n_threads < 1 ? 1 : n_threads),
      idle_spin_(idle_spin),
      slots_(new Slot[size_t(n_threads < 1 ? 1 : n_threads)]) {
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
  const ThreadPool* self = this;
  g_spinning_pool.compare_exchange_strong(self, nullptr);
}

bool ThreadPool::claim(int owner, uint32_t generation, int64_t* chunk) {
  std::atomic<uint64_t>& word = slots_[size_t(owner)].word;
  uint64_t w = word.load(std::memory_order_acquire);
  for (;;) {
    if (uint32_t(w >> 32) != generation) return false;
    const int64_t next = int64_t((w >> 16) & 0xFFFF), end = int64_t(w & 0xFFFF);
    if (next >= end) return false;
    if (word.compare_exchange_weak(w, w + (uint64_t(1) << 16), std::memory_order_acq_rel,
                                   std::memory_order_acquire)) {
      *chunk = next;
      return true;
    }
  }
}

void ThreadPool::run_chunk(int64_t chunk, int thread) {
  // Chunk c covers grains [c * G / C, (c + 1) * G / C): contiguous and balanced.
  const int64_t g0 = chunk * n_grains_ / n_chunks_, g1 = (chunk + 1) * n_grains_ / n_chunks_;
  const int64_t b = g0 * grain_, e = g1 * grain_ < n_ ? g1 * grain_ : n_;
  thunk_(ctx_, b, e, thread);
}

void ThreadPool::participate(int index, uint32_t generation) {
  for (int k = 0; k < n_threads_; ++k) {
    const int owner = (index + k) % n_threads_;
    int64_t chunk;
    while (claim(owner, generation, &chunk)) {
      if (index == 0) {
        try {
          run_chunk(chunk, index);
        } catch (...) {
          t_error = std::current_exception();
          done_.fetch_add(1, std::memory_order_release);
          return;
        }
      } else {
        run_chunk(chunk, index);
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }
}

void ThreadPool::run(int64_t n, int64_t grain, Thunk thunk, void* ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t n_grains = (n + grain - 1) / grain;
  if (n_threads_ == 1 || n_grains == 1) {
    thunk(ctx, 0, n, 0);
    return;
  }
  int64_t chunks = n_grains < n_threads_ * kChunksPerThread ? n_grains : n_threads_ * kChunksPerThread;
  if (chunks > 0xFFFF) chunks = 0xFFFF;  // chunk indices are packed in 16 bits
  thunk_ = thunk;
  ctx_ = ctx;
  n_ = n;
  grain_ = grain;
  n_grains_ = n_grains;
  n_chunks_ = chunks;
  done_.store(0, std::memory_order_relaxed);
  // This pool's idle workers may spin from now on, every other pool's go to sleep. Checked first
  // so that a pool running alone does not write the shared word on every call.
  if (g_spinning_pool.load(std::memory_order_relaxed) != this)
    g_spinning_pool.store(this, std::memory_order_relaxed);
  const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
  const uint32_t tag = uint32_t(generation);
  for (int t = 0; t < n_threads_; ++t)
    slots_[size_t(t)].word.store(pack(tag, t * chunks / n_threads_, (t + 1) * chunks / n_threads_),
                                 std::memory_order_release);
  // seq_cst: pairs with the sleeping_ increment in worker(), see there.
  generation_.store(generation, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) > 0) {
    // Taking the mutex orders this notify after any worker that saw the old generation has
    // actually started waiting, so no wakeup is lost.
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
  participate(0, tag);
  if (t_error) {
    // Skip the chunks nobody has started, then let the started ones finish: they use ctx, which
    // lives in our caller's frame.
    for (int t = 0; t < n_threads_; ++t) {
      int64_t chunk;
      while (claim(t, tag, &chunk)) done_.fetch_add(1, std::memory_order_release);
    }
  }
  for (int spins = 0; done_.load(std::memory_order_acquire) != chunks;) backoff(spins);
  if (t_error) {
    std::exception_ptr e = t_error;
    t_error = nullptr;
    std::rethrow_exception(e);
  }
}

void ThreadPool::worker(int index) {
  // The generation before any call: run() may publish the first call before this thread starts.
  uint64_t seen = 0;
  for (;;) {
    // Spin, then sleep, until the generation moves on. Stop spinning early once another pool
    // has started a call: its threads need the cores.
    uint64_t g = generation_.load(std::memory_order_acquire);
    if (g == seen) {
      const auto deadline = std::chrono::steady_clock::now() + idle_spin_;
      for (int i = 0, spins = 0;; ++i) {
        backoff(spins);
        g = generation_.load(std::memory_order_acquire);
        if (g != seen) break;
        if (g_spinning_pool.load(std::memory_order_relaxed) != this) break;
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
    participate(index, uint32_t(g));
  }
}

}  // namespace microspec
