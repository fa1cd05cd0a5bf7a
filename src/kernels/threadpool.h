#pragma once
// A persistent pool of worker threads. parallel_for splits [0, n) into contiguous chunks and
// returns when all are done; the caller works too, as thread 0. No allocation per call.
//
// Each thread owns a few consecutive chunks and, when done with them, takes over chunks another
// thread has not started yet. So a worker that the OS has not scheduled (a busy machine) does not
// stall the call: the others do its share.
//
// Idle workers poll for the next call for a while (idle_spin) before sleeping, but only while
// their pool is the one that started a call most recently in this process: when several pools
// share the cores (a target and a separate draft model, several server slots), the idle workers of
// the others sleep at once instead of burning a core the running pool needs.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace microspec {

class ThreadPool {
 public:
  static constexpr std::chrono::microseconds kDefaultIdleSpin{2000};
  // n_threads >= 1; 1 means run on the caller only. idle_spin: how long an idle worker polls for
  // the next call (while this pool is the most recent caller) before it sleeps.
  explicit ThreadPool(int n_threads, std::chrono::microseconds idle_spin = kDefaultIdleSpin);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // Workers blocked (or about to block) waiting for the next call: for tests and diagnostics.
  int sleeping_workers() const { return sleeping_.load(std::memory_order_relaxed); }

  // fn(begin, end, thread_index) for disjoint chunks covering [0, n); a thread may get several
  // chunks, one call each, so per-thread scratch must be indexed by thread_index (< size()).
  // `grain` is the chunk granularity: chunk boundaries are multiples of it (except the end).
  // One caller at a time (no nesting). fn must not throw on the workers (thread_index > 0): that
  // terminates the program; an exception on the caller's thread propagates once the chunks already
  // started elsewhere have finished (chunks not yet started are skipped).
  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    using Fn = std::remove_reference_t<F>;  // F is an lvalue reference when fn is an lvalue
    auto thunk = [](void* ctx, int64_t b, int64_t e, int t) { (*static_cast<Fn*>(ctx))(b, e, t); };
    run(n, grain, thunk, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Thunk = void (*)(void*, int64_t, int64_t, int);
  // Per thread: the chunks it owns in the current call, packed as generation (32 bits) | next
  // unclaimed chunk (16) | end (16), claimed by compare-and-swap so a chunk runs exactly once and
  // a late worker can never claim a chunk of a later call.
  struct alignas(64) Slot {
    std::atomic<uint64_t> word{0};
  };

  void run(int64_t n, int64_t grain, Thunk thunk, void* ctx);
  void worker(int index);
  bool claim(int owner, uint32_t generation, int64_t* chunk);
  void run_chunk(int64_t chunk, int thread);
  // Claims and runs chunks, own ones first, then the others'. Returns on the first exception
  // (caller only) after storing it in *error.
  void participate(int index, uint32_t generation);

  int n_threads_;
  std::chrono::microseconds idle_spin_;
  std::vector<std::thread> workers_;
  std::unique_ptr<Slot[]> slots_;  // [n_threads_]
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> done_{0};  // chunks finished (or skipped after an exception) in this call
  std::atomic<int> sleeping_{0};  // workers blocked (or about to block) on wake_
  bool stop_ = false;
  // The current call; written before its generation is published, read only after a claim.
  Thunk thunk_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0, grain_ = 1, n_grains_ = 0, n_chunks_ = 0;
};

}  // namespace microspec
