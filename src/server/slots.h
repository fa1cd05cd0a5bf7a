#pragma once
// Generation slots of `microspec serve` and the bounded FIFO queue in front of them.
//
// A slot is one sequence of the running batch (its KV cache and decoder live in the
// BatchScheduler, batch_scheduler.h); `--parallel N` slots are N sequences in flight at most. The
// pool hands out slot indices first come, first served and bounds the number of waiters.
//
// The prefix cache picks the slot: a lease may remember the tokens its slot's cache holds when it
// ends (SlotLease::remember), and a request takes, of the free slots, the one whose remembered
// tokens share the longest prefix with its prompt; ties (no common prefix at all, say) go to the
// slot used least recently, so a new conversation evicts the oldest cache.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
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
  // The tokens the slot's cache holds now (empty: nothing worth matching); kept for the next
  // acquire()s until the slot is leased again.
  void remember(std::span<const int32_t> tokens);

 private:
  SlotPool& pool_;
  int index_;
};

class SlotPool {
 public:
  // queue_limit: most requests waiting for a slot at once (beyond that, acquire() says QueueFull).
  SlotPool(int n_slots, int queue_limit);

  enum class Status { Ok, QueueFull, ShuttingDown };
  // Waits (first come, first served) for a free slot. On Ok, *lease holds it: the free slot whose
  // remembered tokens share the longest prefix with `prompt`, the least recently used of equals.
  Status acquire(std::span<const int32_t> prompt, std::unique_ptr<SlotLease>* lease, double* waited_seconds);
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
  // Of free_, the position of the slot acquire() gives `prompt` (under mu_).
  size_t best_free_slot(std::span<const int32_t> prompt) const;

  int n_slots_;
  int queue_limit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_;  // [slots] indices of free slots (capacity reserved at start)
  std::vector<std::vector<int32_t>> remembered_;  // [slots][tokens] what each slot's cache holds
  std::vector<uint64_t> last_used_;               // [slots] the ticket that last leased each slot
  uint64_t leases_ = 0;                           // leases handed out (the clock of last_used_)
  int busy_ = 0;
  int waiting_ = 0;
  uint64_t next_ticket_ = 0;  // FIFO order: tickets are served in the order they were taken
  uint64_t serving_ = 0;
  bool shutting_down_ = false;
};

}  // namespace microspec::server
