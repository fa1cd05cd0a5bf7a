#include "vocab/packed_head.h"

#include <chrono>
#include <cstring>
#include <string>

#include "util/error.h"

namespace microspec {

PackedHead::PackedHead(const QMatrix& head, int32_t capacity, bool async)
    : head_(head), capacity_(capacity), async_(async) {
  if (head.rows <= 0 || head.data == nullptr) throw Error("packed LM head: empty head matrix");
  if (capacity < 1 || capacity > head.rows)
    throw Error("packed LM head: capacity " + std::to_string(capacity) + " must be in [1, " +
                std::to_string(head.rows) + "]");
  storage_.resize(size_t(capacity) * head.row_stride + 64);
  rows_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage_.data()) + 63) & ~uintptr_t(63));
  packed_ = head;
  packed_.data = rows_;
  packed_.rows = 0;
  slot_of_.assign(size_t(head.rows), -1);
  token_of_slot_.assign(size_t(capacity), -1);
  holes_.assign(size_t(capacity), 0);
  source_of_slot_.assign(size_t(capacity), PackedSlots::kNoSource);
  copies_.assign(2 * size_t(capacity), RowCopy{0, 0});
  slots_ = PackedSlots{slot_of_.data(), token_of_slot_.data(), holes_.data(), source_of_slot_.data(), copies_.data(),
                       capacity, 0, 0};
  if (async_) thread_ = std::thread([this] { worker(); });
}

PackedHead::~PackedHead() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
}

void PackedHead::worker() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return pending_ || stop_; });
    if (stop_) return;
    lock.unlock();
    run_copies();  // copies_ is not touched by the caller while pending_
    lock.lock();
    pending_ = false;
    cv_.notify_all();
  }
}

void PackedHead::run_copies() {
  const size_t stride = head_.row_stride;
  for (int32_t i = 0; i < slots_.n_copies; ++i) {
    const RowCopy c = slots_.copies[i];
    const uint8_t* src = c.src >= 0 ? head_.data + size_t(c.src) * stride : rows_ + size_t(-c.src - 1) * stride;
    std::memcpy(rows_ + size_t(c.dst) * stride, src, stride);
  }
}

void PackedHead::wait_copies() {
  if (!async_) return;
  std::unique_lock<std::mutex> lock(mutex_);
  if (!pending_) return;
  const auto t0 = std::chrono::steady_clock::now();
  cv_.wait(lock, [this] { return !pending_; });
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void PackedHead::update(std::span<const int32_t> left, std::span<const int32_t> entered) {
  // Validate first so that a bad call changes nothing.
  const int64_t vocab = head_.rows;
  for (int32_t t : left)
    if (t < 0 || t >= vocab || slot_of_[t] < 0)
      throw Error("packed LM head: token " + std::to_string(t) + " left but is not active");
  for (int32_t t : entered)
    if (t < 0 || t >= vocab || slot_of_[t] >= 0)
      throw Error("packed LM head: token " + std::to_string(t) + " entered but is already active");
  if (int64_t(slots_.n_rows) - int64_t(left.size()) + int64_t(entered.size()) > capacity_)
    throw Error("packed LM head: more than " + std::to_string(capacity_) + " active rows");
  wait_copies();  // the previous copies read or write slots this update may reassign

  packed_update(slots_, left.data(), static_cast<int32_t>(left.size()), entered.data(),
                static_cast<int32_t>(entered.size()));
  rows_gathered_ += int64_t(entered.size());
  rows_moved_ += slots_.n_copies - int64_t(entered.size());
  packed_.rows = slots_.n_rows;
  if (slots_.n_copies == 0) return;
  if (!async_) {
    run_copies();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = true;
  }
  cv_.notify_all();
}

const QMatrix& PackedHead::matrix() {
  wait_copies();
  return packed_;
}

}  // namespace microspec
