#pragma once
// A persistent pool of worker threads. parallel_for splits [0, n) into contiguous chunks, one per
// thread (the caller is thread 0), and returns when all are done. No allocation per call.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace microspec {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // n_threads >= 1; 1 means run on the caller only
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // fn(begin, end, thread_index) for disjoint chunks covering [0, n). `grain` is the chunk
  // granularity: chunk boundaries are multiples of it (except the end). One caller at a time (no
  // nesting). fn must not throw on the workers (thread_index > 0): that terminates the program;
  // an exception on the caller's own chunk propagates after the workers have finished.
  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    using Fn = std::remove_reference_t<F>;  // F is an lvalue reference when fn is an lvalue
    auto thunk = [](void* ctx, int64_t b, int64_t e, int t) { (*static_cast<Fn*>(ctx))(b, e, t); };
    run(n, grain, thunk, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Thunk = void (*)(void*, int64_t, int64_t, int);
  void run(int64_t n, int64_t grain, Thunk thunk, void* ctx);
  void worker(int index);
  void chunk(int index, int64_t* begin, int64_t* end) const;

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};  // workers blocked (or about to block) on wake_
  bool stop_ = false;
  Thunk thunk_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
};

}  // namespace microspec
