#pragma once
// Generation slots of `microspec serve` and the bounded FIFO queue in front of them.
//
// A slot is one sequence of the running batch (its KV cache and decoder live in the
// BatchScheduler, batch_scheduler.h); `--parallel N` slots are N sequences in flight at most. The
// pool hands out slot indices first come, first served and bounds the number of waiters.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace microspec::server {

class SlotPool;

// Holds one slot until destroyed (then the next queued request gets it).
class SlotLease {
 public:
  SlotLease(SlotPool& pool, int index) : pool_(pool), index_(index) {}
  ~SlotLease();
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  int index() const { return index_; }

 private:
  SlotPool& pool_;
  int index_;
};

class SlotPool {
 public:
  // queue_limit: most requests waiting for a slot at once (beyond that, acquire() says QueueFull).
  SlotPool(int n_slots, int queue_limit);

  enum class Status { Ok, QueueFull, ShuttingDown };
  // Waits (first come, first served) for a free slot. On Ok, *lease holds it.
  Status acquire(std::unique_ptr<SlotLease>* lease, double* waited_seconds);
  // No new leases; waiters return ShuttingDown.
  void shutdown();
  // Blocks until no slot is leased and nobody waits.
  void wait_idle();

  int size() const { return n_slots_; }
  int queue_limit() const { return queue_limit_; }
  int busy() const;
  int waiting() const;

 private:
  friend class SlotLease;
  void release(int index);

  int n_slots_;
  int queue_limit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_;  // [slots] indices of free slots (capacity reserved at start)
  int busy_ = 0;
  int waiting_ = 0;
  uint64_t next_ticket_ = 0;  // FIFO order: tickets are served in the order they were taken
  uint64_t serving_ = 0;
  bool shutting_down_ = false;
};

}  // namespace microspec::server
