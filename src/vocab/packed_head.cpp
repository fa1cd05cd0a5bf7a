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
  holes_.reserve(size_t(capacity));
  copies_.reserve(2 * size_t(capacity));
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
  for (const Copy& c : copies_) std::memcpy(rows_ + size_t(c.dst) * stride, c.src, stride);
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
  if (int64_t(n_rows_) - int64_t(left.size()) + int64_t(entered.size()) > capacity_)
    throw Error("packed LM head: more than " + std::to_string(capacity_) + " active rows");
  wait_copies();  // the previous copies read or write slots this update may reassign

  copies_.clear();
  holes_.clear();
  for (int32_t t : left) {
    const int32_t s = slot_of_[t];
    slot_of_[t] = -1;
    token_of_slot_[s] = -1;
    holes_.push_back(s);
  }
  // Entered rows go into freed slots first, then at the end.
  for (int32_t t : entered) {
    int32_t s;
    if (!holes_.empty()) {
      s = holes_.back();
      holes_.pop_back();
    } else {
      s = n_rows_++;
    }
    slot_of_[t] = s;
    token_of_slot_[s] = t;
    copies_.push_back({head_.data + size_t(t) * head_.row_stride, s});
  }
  rows_gathered_ += int64_t(entered.size());
  // Holes left over (more left than entered): fill each from the last row, keeping [0, n_rows_)
  // dense. Copies run in order, so a move may read a row that an earlier copy of this update wrote.
  const size_t stride = head_.row_stride;
  for (int32_t h : holes_) {
    while (n_rows_ > 0 && token_of_slot_[n_rows_ - 1] < 0) --n_rows_;
    if (h >= n_rows_) continue;  // the hole is past the new end already
    const int32_t last = n_rows_ - 1, t = token_of_slot_[last];
    copies_.push_back({rows_ + size_t(last) * stride, h});
    token_of_slot_[h] = t;
    slot_of_[t] = h;
    token_of_slot_[last] = -1;
    --n_rows_;
    ++rows_moved_;
  }
  while (n_rows_ > 0 && token_of_slot_[n_rows_ - 1] < 0) --n_rows_;
  holes_.clear();
  packed_.rows = n_rows_;
  if (copies_.empty()) return;
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
