#pragma once
// The active rows of an LM head packed in one contiguous buffer, in the head's own quantized
// format, so that the draft LM head is one dense matmul over size() rows instead of a gather over
// the full head (Gemma 3: 262,144 rows, 178 MB of Q8_0).
//
// Slots: update() frees the slots of tokens that left and gives tokens that entered a freed slot
// (or the next one at the end); when more left than entered, the last rows move into the holes so
// rows [0, size()) stay dense. Only rows of tokens that newly entered are copied from the head;
// the work per update is O(tokens entered + tokens left), never O(capacity). The bookkeeping is
// window_state.h's packed_update, which the CUDA backend runs too.
//
// Copies: with `async`, update() only does the slot bookkeeping (so size() and token() are exact
// at once) and hands the row copies to a helper thread made once in the constructor; matrix()
// waits for them. The drafter updates the vocabulary after a verification and needs the rows only
// at its next LM head, so the copies overlap the draft backbone's forward pass. Without `async`
// the copies run inside update().
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "kernels/matmul.h"
#include "vocab/window_state.h"

namespace microspec {

class PackedHead {
 public:
  // head: the full LM head ([n_vocab rows][cols]), which must outlive this object. capacity: most
  // rows active at once (1..head.rows).
  PackedHead(const QMatrix& head, int32_t capacity, bool async);
  ~PackedHead();
  PackedHead(const PackedHead&) = delete;
  PackedHead& operator=(const PackedHead&) = delete;

  // Net changes of the active set: `left` must be active, `entered` inactive, both without
  // duplicates. Throws Error (before changing anything) otherwise or past the capacity.
  void update(std::span<const int32_t> left, std::span<const int32_t> entered);

  int32_t size() const { return slots_.n_rows; }
  int32_t capacity() const { return capacity_; }
  // Token id of packed row j < size().
  int32_t token(int32_t j) const { return token_of_slot_[j]; }
  // Token ids of all slots ([capacity], valid for [0, size())); the pointer stays valid.
  const int32_t* tokens() const { return token_of_slot_.data(); }
  // Packed row of a token, -1 when inactive.
  int32_t slot_of(int32_t token) const { return slot_of_[token]; }

  // The packed rows [size()][cols] as a matrix: waits for the copies of the last update.
  const QMatrix& matrix();
  // Seconds matrix() spent waiting for copies, rows copied from the head and moved within the
  // buffer, since construction: for statistics and the benchmark.
  double wait_seconds() const { return wait_seconds_; }
  int64_t rows_gathered() const { return rows_gathered_; }
  int64_t rows_moved() const { return rows_moved_; }

 private:
  void run_copies();   // executes slots_.copies (any order would do: window_state.h)
  void wait_copies();  // returns once no copies are pending
  void worker();

  QMatrix head_;
  int32_t capacity_;
  bool async_;
  std::vector<uint8_t> storage_;          // [capacity * row_stride + 64] packed rows, 64-byte aligned
  uint8_t* rows_ = nullptr;               // aligned start in storage_
  QMatrix packed_;                        // view of rows [0, size())
  // The arrays behind slots_ (window_state.h has the slot algorithm, shared with the CUDA backend).
  std::vector<int32_t> slot_of_;          // [n_vocab] packed slot, -1 = inactive
  std::vector<int32_t> token_of_slot_;    // [capacity] token id, -1 = hole
  std::vector<int32_t> holes_;            // [capacity] freed slots during an update
  std::vector<int32_t> source_of_slot_;   // [capacity] update scratch
  std::vector<RowCopy> copies_;           // [2 * capacity] row copies of the last update
  PackedSlots slots_;
  double wait_seconds_ = 0.0;
  int64_t rows_gathered_ = 0, rows_moved_ = 0;

  std::mutex mutex_;
  std::condition_variable cv_;
  bool pending_ = false;  // copies_ handed to the worker, not finished (guarded by mutex_)
  bool stop_ = false;     // guarded by mutex_
  std::thread thread_;
};

}  // namespace microspec
