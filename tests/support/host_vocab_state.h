#pragma once
// A DraftVocabState (vocab/window_state.h) over host arrays: what src/cuda's DeviceDraftVocab keeps
// in device memory and advances in one device thread, here for tests that run the same functions
// on the host.
#include <cstdint>
#include <vector>

#include "vocab/window_state.h"

namespace microspec::test {

struct HostDraftVocabState {
  std::vector<int32_t> count, touched, ring, slot_of, token_of_slot, holes, source_of_slot, entered, left;
  std::vector<uint8_t> touched_flag;
  std::vector<uint32_t> stamp;
  std::vector<RowCopy> copies;
  DraftVocabState st;

  // capacity: packed rows (min(w_max, n_vocab), as the window's capacity()).
  HostDraftVocabState(int32_t n_vocab, int32_t w_max, int32_t capacity)
      : count(size_t(n_vocab), 0), touched(size_t(n_vocab)), ring(size_t(w_max)), slot_of(size_t(n_vocab), -1),
        token_of_slot(size_t(capacity), -1), holes(size_t(capacity)), source_of_slot(size_t(capacity), PackedSlots::kNoSource),
        entered(size_t(capacity)), left(size_t(capacity)), touched_flag(size_t(n_vocab), 0), stamp(size_t(n_vocab), 0),
        copies(2 * size_t(capacity)) {
    st.window = WindowState{count.data(), touched_flag.data(), touched.data(), ring.data(), n_vocab, w_max};
    st.stamps = StreamStamps{stamp.data(), n_vocab, 0};
    st.slots = PackedSlots{slot_of.data(), token_of_slot.data(), holes.data(), source_of_slot.data(), copies.data(),
                           capacity, 0, 0};
    st.entered = entered.data();
    st.left = left.data();
  }
  HostDraftVocabState(const HostDraftVocabState&) = delete;
  HostDraftVocabState& operator=(const HostDraftVocabState&) = delete;
};

}  // namespace microspec::test
