#pragma once
// The vocabulary a drafter scores: a list of LM-head rows (token ids). Drafting only needs the
// likely next tokens, so a drafter may score a pruned subset of the vocabulary; the target always
// verifies against its full head, so pruning never changes the output, only the acceptance rate.
// Drafters never index the full head themselves: they ask this object for the logits of its rows
// and map row positions back to token ids.
//
// Kinds (`--draft-vocab`):
//   full     all n_vocab rows, in id order: the model's own LM head.
//   subset   a fixed list of ids scored through the full head by row index (tests, small sets).
//   packed   a fixed list of ids whose rows are copied once into one contiguous buffer (FR-Spec's
//            frequency set, `freq`): the LM head is one dense matmul over that buffer.
//   dynamic  MicroSpec's context-aware window (vocab/candidate_stream.h) over packed rows
//            (vocab/packed_head.h): begin() seeds it from the prompt, accepted() updates it after
//            every verification, and the rows that newly entered are copied into the slots of
//            rows that left, on a helper thread, while the drafter runs its backbone. Pinned ids
//            (the `hybrid` kind's frequent tokens) are always active.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "vocab/candidate_stream.h"

namespace microspec {

class Model;
class PackedHead;

struct DynamicVocabParams {
  CandidateStreamParams stream;
  bool async_gather = true;  // copy new rows on a helper thread (false: inside accepted())
  bool operator==(const DynamicVocabParams&) const = default;
};

// A pruned draft vocabulary as a value, from which the CPU's drafters (speculative/drafter_setup.h)
// and the CUDA backend each build theirs:
//   Window  MicroSpec's window over the candidate stream (`dynamic`), plus `pinned` ids that are
//           always active (`hybrid`'s frequent tokens; none for `dynamic`);
//   Fixed   the `pinned` ids alone, in that order (`freq`, FR-Spec's frequent set): no stream.
struct PrunedVocabSpec {
  enum class Kind { Window, Fixed };
  Kind kind = Kind::Window;
  DynamicVocabParams window;    // Window: its parameters; Fixed: only async_gather is read
  std::vector<int32_t> pinned;  // distinct ids
  bool operator==(const PrunedVocabSpec&) const = default;
};

class DraftVocabulary {
 public:
  static DraftVocabulary full(int32_t n_vocab);
  // token_ids: distinct ids in [0, n_vocab). Throws Error otherwise.
  static DraftVocabulary subset(std::vector<int32_t> token_ids, int32_t n_vocab);
  // The rows of token_ids (distinct, in range) copied from model's LM head into one buffer; rows
  // are scored in the given order. model must outlive the vocabulary.
  static DraftVocabulary packed(const Model& model, std::vector<int32_t> token_ids);
  // The context-aware window over model's LM head; pinned: ids always active. model must outlive
  // the vocabulary.
  static DraftVocabulary dynamic(const Model& model, const DynamicVocabParams& params,
                                 std::vector<int32_t> pinned = {});

  DraftVocabulary(DraftVocabulary&&) noexcept;
  DraftVocabulary& operator=(DraftVocabulary&&) noexcept;
  ~DraftVocabulary();

  // Rows the next logits() call scores (dynamic: the current active set, which may be 0 before
  // the first update of an `ext`-only window: there is nothing to draft then).
  int32_t size() const;
  // Token id of position j of the active rows.
  int32_t token(int32_t j) const { return ids_ ? ids_[j] : j; }
  // Token ids of the active rows in row order, nullptr when they are all ids in order.
  const int32_t* ids() const { return ids_; }

  // logits[i][j] = head row token(j) applied to hidden[i]: hidden is [n][n_embd], logits [n][size()].
  // Dynamic: waits for the row copies of the last update first.
  void logits(Model& model, const float* hidden, int32_t n, float* logits);

  // Context hooks, no-ops except for dynamic vocabularies (see Drafter): target top tokens wanted
  // per prompt position, the prompt with them, and each verification's outcome.
  int32_t prompt_top_k() const;
  void begin(std::span<const int32_t> prompt, std::span<const int32_t> prompt_top);
  // tree_tokens: [nodes] the draft tree's tokens in node order; path: the accepted node indices
  // and verify_logits ([1 + nodes][n_vocab], row 0 at the root) as Drafter::accepted receives them.
  void accepted(std::span<const int32_t> tree_tokens, std::span<const int32_t> path, const float* verify_logits);

  // Dynamic only (nullptr otherwise): the window and the packed rows, for statistics and tests.
  const CandidateStream* stream() const { return stream_.get(); }
  const PackedHead* packed_head() const { return head_.get(); }

 private:
  enum class Kind { Full, Subset, Packed, Dynamic };
  DraftVocabulary() = default;
  void apply_window_changes();  // window's net changes -> packed head slots and row copies

  Kind kind_ = Kind::Full;
  int32_t n_vocab_ = 0;
  const int32_t* ids_ = nullptr;             // row j's token id: rows_ (subset) or the packed head's slots
  std::vector<int32_t> rows_;                // subset: [size] token ids
  std::unique_ptr<PackedHead> head_;         // packed / dynamic
  std::unique_ptr<CandidateStream> stream_;  // dynamic
  std::vector<int32_t> entered_, left_;      // dynamic scratch: net window changes of one update
  std::vector<int32_t> ver_rows_;            // dynamic scratch: verification rows for K_ver
};

}  // namespace microspec
