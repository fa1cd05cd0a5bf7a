#pragma once
// The dynamic draft vocabulary's bookkeeping as plain arrays and functions without allocation,
// exceptions or the standard library, so that one piece of code runs on the host (VocabWindow,
// CandidateStream, PackedHead own the arrays there) and inside one device thread (src/cuda's
// DeviceDraftVocab owns them in device memory): the device's window and packed slots are the CPU's,
// entry for entry. Callers validate their inputs first; these functions trust them.
//
// Three parts, each a struct of array pointers and counters:
//   WindowState   the FIFO window over the candidate stream S with per-token occupancy counts and
//                 the net membership changes since they were last taken (see vocab_window.h);
//   StreamStamps  "append each token at most once per group" (a prompt union or one step);
//   PackedSlots   which packed LM-head row holds which token, and the row copies an update needs
//                 (see packed_head.h);
// the candidate stream's begin and step over the first two (candidate_stream.h has the rules), and
// DraftVocabState, the three together, advanced as the device runs it.
#include <cstdint>

#include "util/host_device.h"

namespace microspec {

struct WindowState {
  int32_t* count = nullptr;         // [n_vocab] window entries holding the token (+1 if pinned)
  uint8_t* touched_flag = nullptr;  // [n_vocab] 0 untouched; 1 + (was active) otherwise
  int32_t* touched = nullptr;       // [n_vocab] tokens whose count crossed zero since the last take
  int32_t* ring = nullptr;          // [min(w_max, entries ever pushed)] window entries, a ring once full
  int32_t n_vocab = 0;
  int32_t w_max = 0;
  int32_t entries = 0;    // entries in the ring (<= w_max)
  int32_t head = 0;       // oldest entry once the ring is full
  int32_t active = 0;     // tokens with count > 0
  int32_t n_touched = 0;  // entries of touched
};

// Records the token's membership before its first change since the last take.
MS_HOST_DEVICE inline void window_touch(WindowState& w, int32_t token) {
  if (w.touched_flag[token]) return;
  w.touched_flag[token] = uint8_t(1 + (w.count[token] > 0));
  w.touched[w.n_touched++] = token;
}

// A token that is always active (one count no eviction removes). Before any push.
MS_HOST_DEVICE inline void window_pin(WindowState& w, int32_t token) {
  window_touch(w, token);
  w.count[token] = 1;
  ++w.active;
}

// Appends one token to S, evicting the oldest entry when the window is full. The ring must have
// room for entry min(entries, w_max - 1).
MS_HOST_DEVICE inline void window_push(WindowState& w, int32_t token) {
  if (w.entries == w.w_max) {
    int32_t& slot = w.ring[w.head];
    const int32_t old = slot;
    if (w.count[old] == 1) {
      window_touch(w, old);  // before the change: records "was active"
      --w.active;
    }
    --w.count[old];
    slot = token;
    w.head = w.head + 1 == w.w_max ? 0 : w.head + 1;
  } else {
    w.ring[w.entries++] = token;
  }
  if (w.count[token] == 0) {
    window_touch(w, token);  // before the change: records "was inactive"
    ++w.active;
  }
  ++w.count[token];
}

// Empties the window (pinned tokens stay).
MS_HOST_DEVICE inline void window_clear(WindowState& w) {
  for (int32_t i = 0; i < w.entries; ++i) {
    const int32_t t = w.ring[i];
    if (w.count[t] == 1) {
      window_touch(w, t);
      --w.active;
    }
    --w.count[t];
  }
  w.entries = 0;
  w.head = 0;
}

// Net membership changes since the last take, in the order the tokens were first touched:
// entered[0, *n_entered) and left[0, *n_left) (each at most n_vocab long; at most active entered).
MS_HOST_DEVICE inline void window_take_changes(WindowState& w, int32_t* entered, int32_t* n_entered, int32_t* left,
                                               int32_t* n_left) {
  int32_t ne = 0, nl = 0;
  for (int32_t i = 0; i < w.n_touched; ++i) {
    const int32_t t = w.touched[i];
    const bool was = w.touched_flag[t] == 2, now = w.count[t] > 0;
    if (now && !was) entered[ne++] = t;
    if (was && !now) left[nl++] = t;
    w.touched_flag[t] = 0;
  }
  w.n_touched = 0;
  *n_entered = ne;
  *n_left = nl;
}

struct StreamStamps {
  uint32_t* stamp = nullptr;  // [n_vocab] last group a token was appended in
  int32_t n_vocab = 0;
  uint32_t group = 0;         // current group
};

// Starts a new append group (a prompt union or one step).
MS_HOST_DEVICE inline void stamps_next_group(StreamStamps& s) {
  if (++s.group == 0) {  // wrapped: forget every stamp (once every 4 billion groups)
    for (int32_t t = 0; t < s.n_vocab; ++t) s.stamp[t] = 0;
    s.group = 1;
  }
}

// Appends the token to the window unless this group has appended it already.
MS_HOST_DEVICE inline void stream_push_once(StreamStamps& s, WindowState& w, int32_t token) {
  if (s.stamp[token] == s.group) return;
  s.stamp[token] = s.group;
  window_push(w, token);
}

// A row copy into the packed buffer. src >= 0: row src of the full head; src < 0: packed slot
// -src - 1 as it was before the update. Sources are resolved through the update's earlier copies,
// so no copy reads a slot another copy of the same update writes: the copies of one update may
// run in any order, or all at once.
struct RowCopy {
  int32_t src;
  int32_t dst;
};

struct PackedSlots {
  int32_t* slot_of = nullptr;         // [n_vocab] packed slot, -1 = inactive
  int32_t* token_of_slot = nullptr;   // [capacity] token id, -1 = hole
  int32_t* holes = nullptr;           // [capacity] freed slots during an update
  int32_t* source_of_slot = nullptr;  // [capacity] source written into a slot by this update; kNoSource between updates
  RowCopy* copies = nullptr;          // [2 * capacity] the last update's copies
  int32_t capacity = 0;
  int32_t n_rows = 0;    // slots [0, n_rows) hold rows (no holes between updates)
  int32_t n_copies = 0;  // entries of copies
  static constexpr int32_t kNoSource = INT32_MIN;
};

// Net changes of the active set: `left` tokens active, `entered` inactive, no duplicates, and the
// result within the capacity (the caller checks). Entered tokens take freed slots first (last freed
// first), then the end; holes left over are filled from the last rows so [0, n_rows) stays dense.
MS_HOST_DEVICE inline void packed_update(PackedSlots& p, const int32_t* left, int32_t n_left, const int32_t* entered,
                                         int32_t n_entered) {
  int32_t n_holes = 0;
  p.n_copies = 0;
  auto write = [&p](int32_t src, int32_t dst) {
    p.copies[p.n_copies++] = RowCopy{src, dst};
    p.source_of_slot[dst] = src;
  };
  for (int32_t i = 0; i < n_left; ++i) {
    const int32_t s = p.slot_of[left[i]];
    p.slot_of[left[i]] = -1;
    p.token_of_slot[s] = -1;
    p.holes[n_holes++] = s;
  }
  for (int32_t i = 0; i < n_entered; ++i) {
    const int32_t t = entered[i];
    const int32_t s = n_holes > 0 ? p.holes[--n_holes] : p.n_rows++;
    p.slot_of[t] = s;
    p.token_of_slot[s] = t;
    write(t, s);
  }
  // Holes left over (more left than entered): fill each from the last row.
  for (int32_t i = 0; i < n_holes; ++i) {
    const int32_t h = p.holes[i];
    while (p.n_rows > 0 && p.token_of_slot[p.n_rows - 1] < 0) --p.n_rows;
    if (h >= p.n_rows) continue;  // the hole is past the new end already
    const int32_t last = p.n_rows - 1, t = p.token_of_slot[last];
    const int32_t written = p.source_of_slot[last];
    write(written != PackedSlots::kNoSource ? written : -last - 1, h);
    p.token_of_slot[h] = t;
    p.slot_of[t] = h;
    p.token_of_slot[last] = -1;
    --p.n_rows;
  }
  while (p.n_rows > 0 && p.token_of_slot[p.n_rows - 1] < 0) --p.n_rows;
  for (int32_t i = 0; i < p.n_copies; ++i) p.source_of_slot[p.copies[i].dst] = PackedSlots::kNoSource;
}

// The dynamic vocabulary's whole state: what one device thread advances per step.
struct DraftVocabState {
  WindowState window;
  StreamStamps stamps;
  PackedSlots slots;
  int32_t* entered = nullptr;  // [capacity] scratch: tokens that entered at the last take
  int32_t* left = nullptr;     // [capacity] scratch: tokens that left
};

// Takes the window's net changes into the packed slots (their copies in slots.copies).
MS_HOST_DEVICE inline void vocab_state_apply_changes(DraftVocabState& s) {
  int32_t n_entered = 0, n_left = 0;
  window_take_changes(s.window, s.entered, &n_entered, s.left, &n_left);
  packed_update(s.slots, s.left, n_left, s.entered, n_entered);
}

// CandidateStream::begin on the window: emptied, prompt[0, n_prompt) appended as written, then,
// as one group, prompt_top[p * k + j] for j < use_k (ids outside the vocabulary skipped). Source
// ext passes n_prompt = use_k = 0. The ring must have room for every append.
MS_HOST_DEVICE inline void stream_begin(WindowState& w, StreamStamps& s, const int32_t* prompt, int32_t n_prompt,
                                        const int32_t* prompt_top, int32_t k, int32_t use_k) {
  window_clear(w);
  for (int32_t i = 0; i < n_prompt; ++i) window_push(w, prompt[i]);
  if (use_k <= 0) return;
  stamps_next_group(s);
  for (int32_t p = 0; p < n_prompt; ++p)
    for (int32_t j = 0; j < use_k; ++j) {
      const int32_t t = prompt_top[int64_t(p) * k + j];
      if (t >= 0 && t < w.n_vocab) stream_push_once(s, w, t);
    }
}

// CandidateStream::step on the window: one group of tree[0, n_tree), then tops[0, n_top) (the
// target's top K_ver of each verification row, row after row; ids outside the vocabulary skipped).
MS_HOST_DEVICE inline void stream_step(WindowState& w, StreamStamps& s, const int32_t* tree, int32_t n_tree,
                                       const int32_t* tops, int32_t n_top) {
  stamps_next_group(s);
  for (int32_t i = 0; i < n_tree; ++i)
    if (tree[i] >= 0 && tree[i] < w.n_vocab) stream_push_once(s, w, tree[i]);
  for (int32_t i = 0; i < n_top; ++i)
    if (tops[i] >= 0 && tops[i] < w.n_vocab) stream_push_once(s, w, tops[i]);
}

// stream_begin, then the window's changes into the packed slots.
MS_HOST_DEVICE inline void vocab_state_begin(DraftVocabState& s, const int32_t* prompt, int32_t n_prompt,
                                             const int32_t* prompt_top, int32_t k, int32_t use_k) {
  stream_begin(s.window, s.stamps, prompt, n_prompt, prompt_top, k, use_k);
  vocab_state_apply_changes(s);
}

// stream_step, then the window's changes into the packed slots.
MS_HOST_DEVICE inline void vocab_state_step(DraftVocabState& s, const int32_t* tree, int32_t n_tree,
                                            const int32_t* tops, int32_t n_top) {
  stream_step(s.window, s.stamps, tree, n_tree, tops, n_top);
  vocab_state_apply_changes(s);
}

}  // namespace microspec
