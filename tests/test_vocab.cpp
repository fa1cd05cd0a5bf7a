// Draft-vocabulary building blocks: the FIFO window with occupancy counts, MicroSpec's candidate
// stream rules (expected sets computed by hand), the packed LM head against the full head (bit
// for bit, after many randomised updates with slot reuse, several quant types, with and without
// the async gather) and the frequency file format.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/matmul.h"
#include "kernels/threadpool.h"
#include "kernels/types.h"
#include "math/select.h"
#include "sampling/sampler.h"
#include "support/host_vocab_state.h"
#include "util/error.h"
#include "vocab/candidate_stream.h"
#include "vocab/freq_file.h"
#include "vocab/packed_head.h"
#include "vocab/vocab_window.h"
#include "vocab/window_state.h"

namespace microspec {
namespace {

using Ids = std::vector<int32_t>;

Ids sorted(Ids v) {
  std::sort(v.begin(), v.end());
  return v;
}

Ids changes_entered(VocabWindow& w, Ids* left = nullptr) {
  Ids e, l;
  w.take_changes(e, l);
  if (left) *left = sorted(l);
  return sorted(e);
}

TEST(VocabWindow, FifoEvictionAndCounts) {
  VocabWindow w(16, 3);
  EXPECT_EQ(w.capacity(), 3);
  for (int32_t t : {1, 2, 3}) w.push(t);
  EXPECT_EQ(w.active_tokens(), (Ids{1, 2, 3}));
  Ids left;
  EXPECT_EQ(changes_entered(w, &left), (Ids{1, 2, 3}));
  EXPECT_TRUE(left.empty());
  w.push(4);  // evicts 1
  EXPECT_EQ(w.active_tokens(), (Ids{2, 3, 4}));
  EXPECT_EQ(changes_entered(w, &left), (Ids{4}));
  EXPECT_EQ(left, (Ids{1}));
  EXPECT_EQ(w.entries(), 3);
  EXPECT_EQ(w.active_size(), 3);
}

TEST(VocabWindow, DuplicatesHoldOneMemberUntilTheirLastEntryLeaves) {
  VocabWindow w(16, 3);
  for (int32_t t : {1, 1, 2}) w.push(t);  // window [1 1 2]
  EXPECT_EQ(w.active_tokens(), (Ids{1, 2}));
  EXPECT_EQ(w.active_size(), 2);
  changes_entered(w);
  w.push(3);  // [1 2 3]: one entry of 1 left, 1 stays
  EXPECT_EQ(w.active_tokens(), (Ids{1, 2, 3}));
  Ids left;
  EXPECT_EQ(changes_entered(w, &left), (Ids{3}));
  EXPECT_TRUE(left.empty());
  w.push(2);  // [2 3 2]: 1 leaves
  EXPECT_EQ(w.active_tokens(), (Ids{2, 3}));
  EXPECT_EQ(changes_entered(w, &left), Ids{});
  EXPECT_EQ(left, (Ids{1}));
  w.push(2);  // [3 2 2]
  w.push(2);  // [2 2 2]: 3 leaves
  EXPECT_EQ(w.active_tokens(), (Ids{2}));
  EXPECT_EQ(w.active_size(), 1);
}

TEST(VocabWindow, ChangesAreNet) {
  VocabWindow w(16, 2);
  w.push(5);
  w.push(6);
  changes_entered(w);
  w.push(7);  // 5 leaves
  w.push(5);  // 6 leaves, 5 back: net +7 -6 ... and 5 unchanged
  Ids left;
  EXPECT_EQ(changes_entered(w, &left), (Ids{7}));  // window [7 5]
  EXPECT_EQ(left, (Ids{6}));
  w.push(9);
  w.push(10);  // 9 enters and leaves again inside one update: no change for 9
  EXPECT_EQ(w.active_tokens(), (Ids{9, 10}));
  w.push(11);  // [10 11]
  EXPECT_EQ(changes_entered(w, &left), (Ids{10, 11}));
  EXPECT_EQ(left, (Ids{5, 7}));
}

TEST(VocabWindow, PinnedTokensStayAndClearKeepsThem) {
  const Ids pinned = {0, 15};
  VocabWindow w(16, 2, pinned);
  EXPECT_EQ(w.capacity(), 4);
  EXPECT_EQ(changes_entered(w), (Ids{0, 15}));
  w.push(15);
  w.push(3);
  w.push(4);  // evicts the window's 15: still pinned
  EXPECT_EQ(w.active_tokens(), (Ids{0, 3, 4, 15}));
  Ids left;
  EXPECT_EQ(changes_entered(w, &left), (Ids{3, 4}));
  EXPECT_TRUE(left.empty());
  w.clear();
  EXPECT_EQ(w.active_tokens(), (Ids{0, 15}));
  EXPECT_EQ(changes_entered(w, &left), Ids{});
  EXPECT_EQ(left, (Ids{3, 4}));
  EXPECT_EQ(w.entries(), 0);
}

TEST(VocabWindow, VocabularySmallerThanWindow) {
  VocabWindow w(4, 100);
  EXPECT_EQ(w.capacity(), 4);
  for (int i = 0; i < 250; ++i) w.push(i % 4);
  EXPECT_EQ(w.active_tokens(), (Ids{0, 1, 2, 3}));
  EXPECT_EQ(w.entries(), 100);
}

TEST(VocabWindow, RejectsBadInput) {
  EXPECT_THROW(VocabWindow(0, 4), Error);
  EXPECT_THROW(VocabWindow(8, 0), Error);
  EXPECT_THROW(VocabWindow(8, 4, Ids{8}), Error);
  EXPECT_THROW(VocabWindow(8, 4, Ids{1, 1}), Error);
  VocabWindow w(8, 4);
  EXPECT_THROW(w.push(8), Error);
  EXPECT_THROW(w.push(-1), Error);
}

// A randomised run against a direct model of the definition: Unique(last W entries) | pinned.
TEST(VocabWindow, MatchesTheDefinitionOnRandomStreams) {
  std::mt19937 rng(3);
  for (int32_t w_max : {1, 2, 7, 50}) {
    const Ids pinned = {4, 9};
    VocabWindow w(40, w_max, pinned);
    Ids stream;
    std::set<int32_t> prev(pinned.begin(), pinned.end());
    changes_entered(w);
    for (int step = 0; step < 300; ++step) {
      const int n = int(rng() % 6);
      for (int i = 0; i < n; ++i) {
        const int32_t t = int32_t(rng() % 40);
        w.push(t);
        stream.push_back(t);
      }
      if (step % 37 == 36) {
        w.clear();
        stream.clear();
      }
      std::set<int32_t> want(pinned.begin(), pinned.end());
      for (size_t i = stream.size() > size_t(w_max) ? stream.size() - w_max : 0; i < stream.size(); ++i)
        want.insert(stream[i]);
      ASSERT_EQ(w.active_tokens(), Ids(want.begin(), want.end())) << "W " << w_max << " step " << step;
      ASSERT_EQ(w.active_size(), int32_t(want.size()));
      Ids left;
      const Ids entered = changes_entered(w, &left);
      Ids want_entered, want_left;
      for (int32_t t : want)
        if (!prev.count(t)) want_entered.push_back(t);
      for (int32_t t : prev)
        if (!want.count(t)) want_left.push_back(t);
      ASSERT_EQ(entered, want_entered);
      ASSERT_EQ(left, want_left);
      prev = want;
    }
  }
}

// Logits rows over a vocabulary of 16 whose top-3 are the given ids (best first).
std::vector<float> rows_with_top(const std::vector<Ids>& tops) {
  std::vector<float> logits(tops.size() * 16, 0.0f);
  for (size_t r = 0; r < tops.size(); ++r)
    for (size_t j = 0; j < tops[r].size(); ++j) logits[r * 16 + size_t(tops[r][j])] = 10.0f - float(j);
  return logits;
}

CandidateStreamParams stream_params(int32_t w, int32_t kpre, int32_t kver) {
  CandidateStreamParams p;
  p.w_max = w;
  p.k_pre = kpre;
  p.k_ver = kver;
  return p;
}

// Prompt [5 6 5 7]; target top-2 per position: [6 8] [9 8] [5 10] [11 6]. S_init = the prompt,
// then the union by first occurrence: 6 8 9 5 10 11 -> S = 5 6 5 7 6 8 9 5 10 11.
const Ids kPromptIds = {5, 6, 5, 7};
const Ids kPromptTop = {6, 8, 9, 8, 5, 10, 11, 6};

TEST(CandidateStream, PromptPartIsPromptThenUnionOfTopKpre) {
  CandidateStream s(16, stream_params(100, 2, 3));
  s.begin(kPromptIds, kPromptTop, 2);
  EXPECT_EQ(s.window().active_tokens(), (Ids{5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(s.window().entries(), 10);
}

TEST(CandidateStream, WindowSmallerThanThePromptKeepsTheLatestEntries) {
  struct Case {
    int32_t w;
    Ids want;
  };
  // Last W entries of S = 5 6 5 7 6 8 9 5 10 11.
  for (const Case& c :
       {Case{3, {5, 10, 11}}, Case{5, {5, 8, 9, 10, 11}}, Case{8, {5, 6, 7, 8, 9, 10, 11}}, Case{1, {11}}}) {
    CandidateStream s(16, stream_params(c.w, 2, 3));
    s.begin(kPromptIds, kPromptTop, 2);
    EXPECT_EQ(s.window().active_tokens(), c.want) << "W " << c.w;
  }
}

TEST(CandidateStream, KpreUsesTheBestEntriesOnlyAndZeroSkipsTheUnion) {
  CandidateStream s1(16, stream_params(100, 1, 3));
  s1.begin(kPromptIds, kPromptTop, 2);  // best of each position: 6 9 5 11
  EXPECT_EQ(s1.window().active_tokens(), (Ids{5, 6, 7, 9, 11}));
  EXPECT_EQ(s1.window().entries(), 4 + 4);
  CandidateStream s0(16, stream_params(100, 0, 3));
  s0.begin(kPromptIds, kPromptTop, 2);
  EXPECT_EQ(s0.window().active_tokens(), (Ids{5, 6, 7}));
  EXPECT_EQ(s0.params().prompt_top_k(), 0);
}

TEST(CandidateStream, StepAppendsDistinctTreeTokensThenKverOfEachRow) {
  CandidateStream s(16, stream_params(6, 2, 2));
  s.begin(kPromptIds, kPromptTop, 2);  // window: 7 6 8 9 5 10 11 -> last 6 = 6 8 9 5 10 11
  EXPECT_EQ(s.window().active_tokens(), (Ids{5, 6, 8, 9, 10, 11}));
  // Tree [3 3 4 3]; rows 0 and 2 with top-2 [4 12] and [13 3]: appended 3 4 12 13 (4 and 3 once).
  const std::vector<float> logits = rows_with_top({{4, 12, 1}, {0, 1, 2}, {13, 3, 1}});
  const Ids rows = {0, 2};
  s.step(Ids{3, 3, 4, 3}, logits.data(), rows);
  // S tail: ... 5 10 11 3 4 12 13 -> last 6 = 10 11 3 4 12 13
  EXPECT_EQ(s.window().active_tokens(), (Ids{3, 4, 10, 11, 12, 13}));
  // The next step may append the same tokens again (a new entry each: they become most recent).
  const std::vector<float> logits2 = rows_with_top({{13, 14, 1}});
  s.step(Ids{3}, logits2.data(), Ids{0});  // appends 3 13 14 -> last 6 = 4 12 13 3 13 14
  EXPECT_EQ(s.window().active_tokens(), (Ids{3, 4, 12, 13, 14}));
  EXPECT_EQ(s.window().entries(), 6);
}

TEST(CandidateStream, EmptyTreeAppendsOnlyVerificationCandidates) {
  CandidateStream s(16, stream_params(100, 2, 3));
  s.begin(kPromptIds, kPromptTop, 2);
  const std::vector<float> logits = rows_with_top({{14, 15, 0}});
  s.step(Ids{}, logits.data(), Ids{0});
  EXPECT_EQ(s.window().active_tokens(), (Ids{0, 5, 6, 7, 8, 9, 10, 11, 14, 15}));
  // K_ver = 0 and an empty tree: nothing changes.
  CandidateStream z(16, stream_params(100, 2, 0));
  z.begin(kPromptIds, kPromptTop, 2);
  z.step(Ids{}, logits.data(), Ids{0});
  EXPECT_EQ(z.window().entries(), 10);
}

TEST(CandidateStream, SourceAblations) {
  const std::vector<float> logits = rows_with_top({{14, 15, 0}});
  CandidateStreamParams ctx = stream_params(100, 2, 3);
  ctx.source = CandidateStreamParams::Source::Ctx;
  CandidateStream c(16, ctx);
  c.begin(kPromptIds, kPromptTop, 2);
  c.step(Ids{1, 2}, logits.data(), Ids{0});  // ignored
  EXPECT_EQ(c.window().active_tokens(), (Ids{5, 6, 7, 8, 9, 10, 11}));

  CandidateStreamParams ext = stream_params(100, 2, 3);
  ext.source = CandidateStreamParams::Source::Ext;
  EXPECT_EQ(ext.prompt_top_k(), 0);
  CandidateStream e(16, ext);
  e.begin(kPromptIds, kPromptTop, 2);  // no prompt part
  EXPECT_EQ(e.window().active_size(), 0);
  e.step(Ids{1, 2}, logits.data(), Ids{0});
  EXPECT_EQ(e.window().active_tokens(), (Ids{0, 1, 2, 14, 15}));

  EXPECT_EQ(CandidateStreamParams::parse_source("ctx"), CandidateStreamParams::Source::Ctx);
  EXPECT_THROW(CandidateStreamParams::parse_source("all"), Error);
}

TEST(CandidateStream, BeginRestartsAndChecksItsInput) {
  CandidateStream s(16, stream_params(100, 2, 3));
  s.begin(kPromptIds, kPromptTop, 2);
  s.begin(Ids{1, 2}, Ids{}, 0);
  EXPECT_EQ(s.window().active_tokens(), (Ids{1, 2}));
  EXPECT_THROW(s.begin(Ids{1, 2}, Ids{3}, 2), Error);  // table of the wrong size
  EXPECT_THROW(s.begin(Ids{16}, Ids{}, 0), Error);
}

// --- packed LM head ----------------------------------------------------------------------------

struct HeadWeights {
  std::vector<uint8_t> data;
  QMatrix m;
};

HeadWeights random_head(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HeadWeights h;
  const size_t rb = row_bytes(type, cols);
  h.data.resize(rb * size_t(rows));
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (float& x : row) x = normal(rng);
    quantize_row_reference(type, row.data(), h.data.data() + size_t(r) * rb, cols);
  }
  h.m.type = type;
  h.m.data = h.data.data();
  h.m.rows = rows;
  h.m.cols = cols;
  h.m.row_stride = rb;
  return h;
}

TEST(PackedHead, LogitsEqualTheFullHeadsRowsAfterRandomUpdates) {
  constexpr int64_t kRows = 700, kCols = 256;
  constexpr int32_t kTokens = 3;
  ThreadPool pool(2);
  MatmulContext ctx(pool, best_kernels());
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hidden(size_t(kTokens) * kCols);
  for (float& x : hidden) x = normal(rng);
  for (GgmlType type :
       {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q4_1, GgmlType::F16}) {
    const HeadWeights head = random_head(type, kRows, kCols, 5 + uint32_t(type));
    std::vector<float> full(size_t(kTokens) * kRows);
    matmul(ctx, head.m, hidden.data(), kTokens, full.data(), kRows);
    for (bool async : {false, true}) {
      const std::string what = std::string(type_name(uint32_t(type))) + (async ? " async" : " sync");
      // Windows of 64 entries over a stream drawn from a skewed distribution: tokens keep leaving
      // and coming back, the active set grows and shrinks, so slots are reused and rows moved.
      CandidateStream stream(int32_t(kRows), stream_params(64, 3, 3), Ids{0, 699});
      PackedHead packed(head.m, stream.window().capacity(), async);
      Ids entered, left;
      std::vector<float> logits(size_t(kTokens) * kRows);
      for (int step = 0; step < 400; ++step) {
        const int n = int(rng() % 40);
        const int32_t spread = step % 50 < 25 ? 60 : int32_t(kRows);  // phases of few / many distinct
        for (int i = 0; i < n; ++i) stream.window().push(int32_t(rng() % spread));
        stream.window().take_changes(entered, left);
        packed.update(left, entered);
        ASSERT_EQ(packed.size(), stream.window().active_size()) << what;
        const QMatrix& m = packed.matrix();
        ASSERT_EQ(m.rows, packed.size());
        matmul(ctx, m, hidden.data(), kTokens, logits.data(), m.rows);
        std::set<int32_t> seen;
        for (int32_t j = 0; j < packed.size(); ++j) {
          const int32_t t = packed.token(j);
          ASSERT_TRUE(stream.window().contains(t)) << what;
          ASSERT_EQ(packed.slot_of(t), j);
          seen.insert(t);
          for (int32_t r = 0; r < kTokens; ++r)
            ASSERT_EQ(
                std::memcmp(&logits[size_t(r) * m.rows + j], &full[size_t(r) * kRows + t], sizeof(float)), 0)
                << what << " step " << step << " token " << t;
        }
        ASSERT_EQ(int32_t(seen.size()), packed.size());
      }
      EXPECT_GT(packed.rows_moved(), 0) << what;  // the shrinking phases compacted the buffer
      EXPECT_GT(packed.rows_gathered(), packed.capacity()) << what;  // slots were reused
    }
  }
}

// The slot algorithm shared with the CUDA backend (window_state.h): the copies of one update read
// only the full head or packed rows no copy of that update writes, so the device may run them all
// at once. Here they run in reverse order, one row of bytes per token id, over updates that free
// the last rows and refill them in the same update (the case where a move reads a row just gathered).
TEST(PackedSlots, CopiesOfAnUpdateRunInAnyOrder) {
  constexpr int32_t kVocab = 300, kCapacity = 48;
  std::vector<int32_t> slot_of(kVocab, -1), token_of_slot(kCapacity, -1), holes(kCapacity);
  std::vector<int32_t> source_of_slot(kCapacity, PackedSlots::kNoSource);
  std::vector<RowCopy> copies(2 * kCapacity);
  PackedSlots p{slot_of.data(), token_of_slot.data(), holes.data(), source_of_slot.data(), copies.data(), kCapacity, 0, 0};
  std::vector<int32_t> rows(kCapacity, -1);  // packed buffer: "row" j holds the id whose row it copied
  std::mt19937 rng(3);
  std::set<int32_t> active;
  int64_t moves_from_fresh_rows = 0;
  for (int step = 0; step < 3000; ++step) {
    // Leave: a random subset, biased to the last slots; enter: fresh ids, fewer than left half the time.
    Ids left, entered;
    for (int32_t j = p.n_rows - 1; j >= 0; --j)
      if (rng() % 4 == 0 || (j >= p.n_rows - 3 && rng() % 2 == 0)) left.push_back(token_of_slot[j]);
    std::shuffle(left.begin(), left.end(), rng);
    const int32_t room = kCapacity - (int32_t(active.size()) - int32_t(left.size()));
    const int32_t want = int32_t(rng() % (step % 2 ? 4 : 16));
    for (int32_t tries = 0; int32_t(entered.size()) < std::min(want, room) && tries < 100; ++tries) {
      const int32_t t = int32_t(rng() % kVocab);
      if (!active.count(t) && std::find(entered.begin(), entered.end(), t) == entered.end()) entered.push_back(t);
    }
    for (int32_t t : left) active.erase(t);
    for (int32_t t : entered) active.insert(t);
    packed_update(p, left.data(), int32_t(left.size()), entered.data(), int32_t(entered.size()));
    const std::vector<int32_t> before = rows;
    for (int32_t i = p.n_copies - 1; i >= 0; --i) {
      const RowCopy c = p.copies[i];
      if (c.src < 0 && std::any_of(p.copies, p.copies + p.n_copies, [&](const RowCopy& o) { return o.dst == -c.src - 1; }))
        FAIL() << "step " << step << ": a copy reads slot " << -c.src - 1 << ", which this update writes";
      if (i >= int32_t(entered.size()) && c.src >= 0) ++moves_from_fresh_rows;  // gathers come first, then moves
      rows[c.dst] = c.src >= 0 ? c.src : before[-c.src - 1];
    }
    ASSERT_EQ(p.n_rows, int32_t(active.size()));
    for (int32_t j = 0; j < p.n_rows; ++j) {
      ASSERT_GE(token_of_slot[j], 0) << "step " << step << ": hole at " << j;
      ASSERT_EQ(slot_of[token_of_slot[j]], j);
      ASSERT_EQ(rows[j], token_of_slot[j]) << "step " << step << " slot " << j;
    }
    for (int32_t s : source_of_slot) ASSERT_EQ(s, PackedSlots::kNoSource);
  }
  EXPECT_GT(moves_from_fresh_rows, 0);  // moves did read rows gathered earlier in their own update
}

// DraftVocabState's begin and step, what one CUDA thread runs per step (window_state.h), on host
// arrays: the same window, active set and slot of every token as the CPU's CandidateStream +
// PackedHead fed the same prompt, candidates, tree tokens and verification rows, over a window of
// 40 entries that churns (slots freed, reused, compacted), for the prompt + steps and steps-only
// streams.
TEST(DraftVocabState, BeginAndStepEqualTheCpuStreamAndPackedHead) {
  constexpr int32_t kVocab = 500, kPrompt = 60, kPre = 3, kVer = 3;
  const HeadWeights head = random_head(GgmlType::Q8_0, kVocab, 32, 2);
  std::mt19937 rng(9);
  auto ids = [&](int32_t n) {
    Ids v(static_cast<size_t>(n));
    for (int32_t& t : v) t = int32_t(rng() % kVocab);
    return v;
  };
  using Source = CandidateStreamParams::Source;
  for (Source source : {Source::Both, Source::Ext}) {
    SCOPED_TRACE(source == Source::Both ? "both" : "ext");
    const CandidateStreamParams params = [&] {
      CandidateStreamParams p = stream_params(40, kPre, kVer);
      p.source = source;
      return p;
    }();
    CandidateStream cpu(kVocab, params);
    PackedHead cpu_head(head.m, cpu.window().capacity(), false);
    test::HostDraftVocabState host(kVocab, params.w_max, cpu.window().capacity());
    DraftVocabState& st = host.st;
    const std::vector<int32_t>& count = host.count;
    const std::vector<int32_t>& token_of_slot = host.token_of_slot;
    Ids entered, left;
    auto expect_same = [&](const std::string& when) {
      cpu.window().take_changes(entered, left);
      cpu_head.update(left, entered);
      ASSERT_EQ(st.window.active, cpu.window().active_size()) << when;
      ASSERT_EQ(st.slots.n_rows, cpu_head.size()) << when;
      for (int32_t j = 0; j < cpu_head.size(); ++j) ASSERT_EQ(token_of_slot[j], cpu_head.token(j)) << when << " slot " << j;
      for (int32_t t = 0; t < kVocab; ++t) ASSERT_EQ(count[t] > 0, cpu.window().contains(t)) << when << " token " << t;
    };
    const Ids prompt = ids(kPrompt);
    Ids prompt_top = ids(kPrompt * kPre);
    prompt_top[4] = -1;  // a position with fewer candidates
    if (source == Source::Ext) {
      cpu.begin(prompt, {}, 0);
      vocab_state_begin(st, prompt.data(), 0, prompt_top.data(), kPre, 0);
    } else {
      cpu.begin(prompt, prompt_top, kPre);
      vocab_state_begin(st, prompt.data(), kPrompt, prompt_top.data(), kPre, kPre);
    }
    expect_same("begin");
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int32_t step = 0; step < 200; ++step) {
      const Ids tree = ids(int32_t(rng() % 12));
      const int32_t n_rows = 1 + int32_t(rng() % 5);
      std::vector<float> verify(size_t(n_rows) * kVocab);
      for (float& x : verify) x = normal(rng);
      Ids rows, tops;
      for (int32_t r = 0; r < n_rows; r += 1 + step % 2) rows.push_back(r);
      for (int32_t r : rows) {
        tops.resize(tops.size() + kVer);
        top_k_indices(verify.data() + size_t(r) * kVocab, kVocab, kVer, tops.data() + tops.size() - kVer);
      }
      cpu.step(tree, verify.data(), rows);
      vocab_state_step(st, tree.data(), int32_t(tree.size()), tops.data(), int32_t(tops.size()));
      expect_same("step " + std::to_string(step));
    }
  }
}

TEST(PackedHead, RejectsInconsistentUpdatesWithoutChangingState) {
  const HeadWeights head = random_head(GgmlType::Q8_0, 10, 32, 1);
  PackedHead p(head.m, 3, false);
  p.update(Ids{}, Ids{1, 2});
  EXPECT_THROW(p.update(Ids{}, Ids{2}), Error);     // already active
  EXPECT_THROW(p.update(Ids{5}, Ids{}), Error);     // not active
  EXPECT_THROW(p.update(Ids{}, Ids{3, 4}), Error);  // past the capacity
  EXPECT_THROW(p.update(Ids{}, Ids{10}), Error);    // outside the head
  EXPECT_EQ(p.size(), 2);
  p.update(Ids{1}, Ids{3, 4});
  EXPECT_EQ(p.size(), 3);
  p.update(Ids{2, 3, 4}, Ids{});  // every row leaves
  EXPECT_EQ(p.size(), 0);
  EXPECT_EQ(p.slot_of(3), -1);
  EXPECT_THROW(PackedHead(head.m, 11, false), Error);
  EXPECT_THROW(PackedHead(head.m, 0, true), Error);
}

// --- frequency files ---------------------------------------------------------------------------

class FreqFile : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ =
        (std::filesystem::temp_directory_path() / ("microspec_freq_" + std::to_string(::getpid()) + ".bin"))
            .string();
  }
  void TearDown() override { std::filesystem::remove(path_); }
  std::string read() {
    std::ifstream in(path_, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  void write(const std::string& bytes) {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), std::streamsize(bytes.size()));
  }
  std::string path_;
};

TEST_F(FreqFile, RoundTripRanksByCountThenId) {
  const std::vector<uint64_t> counts = {0, 5, 2, 5, 0, 9};
  const TokenFrequencies f = TokenFrequencies::from_counts(counts);
  EXPECT_EQ(f.ids, (Ids{5, 1, 3, 2, 0, 4}));
  EXPECT_EQ(f.counts, (std::vector<uint64_t>{9, 5, 5, 2, 0, 0}));
  EXPECT_EQ(f.total, 21u);
  EXPECT_EQ(f.top(3), (Ids{5, 1, 3}));
  EXPECT_EQ(f.top(100).size(), 6u);
  write_freq_file(path_, f);
  EXPECT_EQ(read().size(), 32u + 12u * 6u);
  const TokenFrequencies g = read_freq_file(path_, 6);
  EXPECT_EQ(g.ids, f.ids);
  EXPECT_EQ(g.counts, f.counts);
  EXPECT_EQ(g.total, f.total);
  EXPECT_EQ(g.n_vocab, 6);
  EXPECT_NO_THROW(read_freq_file(path_, 0));  // 0: any vocabulary
}

TEST_F(FreqFile, BadFilesGiveClearErrors) {
  write_freq_file(path_, TokenFrequencies::from_counts({3, 1, 2, 0}));
  const std::string good = read();
  auto expect_error = [&](const std::string& bytes, const std::string& needle, int32_t vocab = 4) {
    write(bytes);
    try {
      read_freq_file(path_, vocab);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  for (size_t len = 0; len < good.size(); ++len)
    expect_error(good.substr(0, len), len < 8 ? "truncated header" : len < 32 ? "truncated" : "truncated");
  expect_error(good + "x", "trailing bytes");
  std::string bad = good;
  bad[0] = 'X';
  expect_error(bad, "bad magic");
  bad = good;
  bad[8] = 2;
  expect_error(bad, "version 2");
  expect_error(good, "made for another model", 5);
  bad = good;
  bad[32 + 4] = bad[32];  // rank 1 repeats rank 0's id
  bad[33 + 4] = bad[33];
  bad[34 + 4] = bad[34];
  bad[35 + 4] = bad[35];
  expect_error(bad, "appears twice");
  bad = good;
  bad[32] = 9;  // id 9 in a vocabulary of 4
  expect_error(bad, "outside the vocabulary");
  bad = good;
  std::swap(bad[32 + 16], bad[32 + 16 + 8]);  // counts 3 and 2 swapped: not ranked
  expect_error(bad, "not ranked");
  bad = good;
  bad[24] = 7;  // total
  expect_error(bad, "sum");
  bad = good;
  bad[16] = 5;  // n > n_vocab
  expect_error(bad, "holds 5 ids");
  EXPECT_THROW(read_freq_file(path_ + ".missing", 4), Error);
}

}  // namespace
}  // namespace microspec
