#include "server/slots.h"

#include "util/error.h"

namespace microspec::server {

SlotLease::~SlotLease() {
  pool_.release(index_);
}

SlotPool::SlotPool(int n_slots, int queue_limit) : n_slots_(n_slots), queue_limit_(queue_limit) {
  if (n_slots_ < 1) throw Error("the server needs at least one slot");
  if (queue_limit_ < 0) throw Error("queue limit must be >= 0");
  free_.reserve(size_t(n_slots_));
  for (int i = n_slots_ - 1; i >= 0; --i) free_.push_back(i);
}

SlotPool::Status SlotPool::acquire(std::unique_ptr<SlotLease>* lease, double* waited_seconds) {
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
  const int index = free_.back();
  free_.pop_back();
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
