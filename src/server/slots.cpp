#include "server/slots.h"

#include <algorithm>

#include "util/error.h"

namespace microspec::server {

SlotLease::~SlotLease() {
  pool_.release(index_);
}

void SlotLease::remember(std::span<const int32_t> tokens) {
  std::lock_guard<std::mutex> lock(pool_.mu_);
  pool_.remembered_[size_t(index_)].assign(tokens.begin(), tokens.end());
}

SlotPool::SlotPool(int n_slots, int queue_limit) : n_slots_(n_slots), queue_limit_(queue_limit) {
  if (n_slots_ < 1) throw Error("the server needs at least one slot");
  if (queue_limit_ < 0) throw Error("queue limit must be >= 0");
  free_.reserve(size_t(n_slots_));
  for (int i = 0; i < n_slots_; ++i) free_.push_back(i);
  remembered_.resize(size_t(n_slots_));
  last_used_.assign(size_t(n_slots_), 0);
}

size_t SlotPool::best_free_slot(std::span<const int32_t> prompt) const {
  size_t best = 0;
  size_t best_common = 0;
  for (size_t i = 0; i < free_.size(); ++i) {
    const std::vector<int32_t>& cached = remembered_[size_t(free_[i])];
    const size_t common = size_t(
        std::mismatch(cached.begin(), cached.end(), prompt.begin(), prompt.end()).first - cached.begin());
    const bool longer = common > best_common;
    const bool older =
        common == best_common && last_used_[size_t(free_[i])] < last_used_[size_t(free_[best])];
    if (i == 0 || longer || older) {
      best = i;
      best_common = common;
    }
  }
  return best;
}

SlotPool::Status SlotPool::acquire(std::span<const int32_t> prompt, std::unique_ptr<SlotLease>* lease,
                                   double* waited_seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  if (shutting_down_) return Status::ShuttingDown;
  // A request may wait only when every slot is busy and the queue has room; a free slot with an
  // empty queue is taken at once.
  const bool must_wait = free_.empty() || waiting_ > 0;
  if (must_wait && waiting_ >= queue_limit_) return Status::QueueFull;
  const uint64_t ticket = next_ticket_++;
  ++waiting_;
  cv_.wait(lock, [&] { return shutting_down_ || (ticket == serving_ && !free_.empty()); });
  --waiting_;
  if (shutting_down_) {
    cv_.notify_all();
    return Status::ShuttingDown;
  }
  ++serving_;
  const size_t pick = best_free_slot(prompt);
  const int index = free_[pick];
  free_.erase(free_.begin() + ptrdiff_t(pick));
  last_used_[size_t(index)] = ++leases_;
  remembered_[size_t(index)].clear();  // until the lease remembers what its generation left
  ++busy_;
  lock.unlock();
  cv_.notify_all();  // the next ticket may find another free slot
  *waited_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  *lease = std::make_unique<SlotLease>(*this, index);
  return Status::Ok;
}

void SlotPool::release(int index) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(index);
    --busy_;
  }
  cv_.notify_all();
}

void SlotPool::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutting_down_ = true;
  }
  cv_.notify_all();
}

void SlotPool::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return busy_ == 0 && waiting_ == 0; });
}

int SlotPool::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_;
}

int SlotPool::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

}  // namespace microspec::server
