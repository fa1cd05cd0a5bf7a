#pragma once
// MicroSpec's dynamic draft vocabulary on the GPU: the CPU's DraftVocabulary::dynamic (with the
// pinned tokens of `hybrid`) with its state in device memory, so a speculative step needs no host
// round trip for it; and `freq`, the pinned tokens alone (PrunedVocabSpec::Kind::Fixed: the same
// packed rows and argmax, no stream):
// - the candidate stream's window (occupancy counts), its append stamps and the packed slots are
//   advanced on the device by ops.h's vocab_begin / vocab_step, which run the CPU's own algorithm
//   (vocab/window_state.h): the device's active set and slot map are the CPU's, entry for entry;
// - the rows of newly entered tokens are gathered into the packed head on its copy stream, which
//   waits for the update through an event and overlaps the next draft backbone; the draft LM head
//   joins the gather through a second event (GatherStream::Compute runs the gather in line);
// - the draft LM head scores every packed slot (a fixed shape, ready for graph capture) and the
//   argmax looks only at the active rows, whose count lives on the device.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/ops.h"
#include "cuda/packed_head.h"
#include "vocab/draft_vocab.h"

namespace microspec::cuda {

struct DeviceVocabSizes {
  int32_t max_prompt = 1;  // longest prompt begin() takes
  int32_t max_rows = 1;    // most draft rows one logits() call scores
};

class DeviceDraftVocab {
 public:
  // head: the target's LM head on the device ([n_vocab rows][n_embd]). spec: as the CPU's
  // (window.async_gather picks the copy stream; W_max at most kMaxWindow; pinned ids distinct and
  // in range, at least one for Fixed). compute: the model's stream.
  DeviceDraftVocab(const DeviceMatrix& head, const PrunedVocabSpec& spec, const DeviceVocabSizes& sizes,
                   cudaStream_t compute);
  ~DeviceDraftVocab();
  DeviceDraftVocab(const DeviceDraftVocab&) = delete;
  DeviceDraftVocab& operator=(const DeviceDraftVocab&) = delete;

  static constexpr int32_t kMaxWindow = 1 << 20;  // the device ring is allocated whole
  static constexpr int32_t kMaxStepRows = 256;    // most verification rows one step takes K_ver from

  int32_t capacity() const { return capacity_; }  // packed slots = logits columns
  // Whether this vocabulary is the one these arguments would make (so a caller can keep it).
  bool made_for(const DeviceMatrix& head, const PrunedVocabSpec& spec, const DeviceVocabSizes& sizes,
                cudaStream_t compute) const {
    return head.data == head_data_ && spec == spec_ && sizes.max_prompt <= sizes_.max_prompt &&
           sizes.max_rows <= sizes_.max_rows && compute == compute_;
  }
  uint64_t serial() const { return serial_; }  // next_object_serial() at construction
  // Whether step() changes anything: a window fed by verification (not Fixed, not source ctx).
  bool takes_steps() const {
    return spec_.kind == PrunedVocabSpec::Kind::Window &&
           spec_.window.stream.source != CandidateStreamParams::Source::Ctx;
  }
  // K_ver of the last accepted verification row only (KverRows::Last), not of every accepted one.
  bool kver_last_only() const { return spec_.window.stream.kver_rows == CandidateStreamParams::KverRows::Last; }
  // Target top-k per prompt position begin() takes (0 for source ext and Fixed).
  int32_t prompt_top_k() const {
    return spec_.kind == PrunedVocabSpec::Kind::Window ? spec_.window.stream.prompt_top_k() : 0;
  }
  // Where the caller leaves the prompt ([max_prompt]) and the target's top prompt_top_k() ids at
  // each prompt position ([max_prompt][prompt_top_k()]) before begin(): device memory.
  int32_t* prompt_ids() const { return prompt_ids_; }
  int32_t* prompt_top() const { return prompt_top_; }

  // Restarts the stream for a prompt of n_prompt tokens (in prompt_ids() / prompt_top()).
  void begin(int32_t n_prompt);
  // One verification step, its sizes read on the device when it runs (so a captured step takes
  // each step's own): the first update->n_tree tokens of `tree` (device, tree order) and the
  // target's top K_ver of verification logits rows [update->first_row, + update->n_rows) (device
  // logits [.][n_vocab]; the caller picks the rows by kver_last_only()); with accepted_rows
  // (device; a tree's accepted path) those rows are accepted_rows[first_row, + n_rows). max_tree and
  // max_rows bound the update's counts and size the launches (max_rows <= 256). No-op unless
  // takes_steps().
  void step(const int32_t* tree, const float* verify_logits, const VocabUpdate* update, int32_t max_tree,
            int32_t max_rows, const int32_t* accepted_rows = nullptr);
  // The same with the update's counts given by the host (copied to the device first).
  void step(const int32_t* tree, const float* verify_logits, const VocabUpdate& update);
  // The draft LM head: logits [n][capacity()] for every packed slot (slots past the active ones are
  // stale), after the last gather. scratch: matmul_scratch_bytes(n, n_embd).
  const float* logits(const float* hidden, int32_t n, uint8_t* scratch);
  // out[t] = the token of the best active slot of the last logits()' row t, or if_empty when the
  // vocabulary has no rows.
  void argmax(int32_t n, int32_t if_empty, int32_t* out);
  // A draft tree's proposals from the last logits()' n rows: each row's k best active slots as
  // token ids with their log-probabilities over the active slots (ops.h's tree_proposals; token -1
  // past the active rows there are). tokens, logprobs: device, [n][k].
  void proposals(int32_t n, int32_t k, int32_t* tokens, float* logprobs);
  // Each of the last logits()' n rows' k best active slots (k <= 64), best first (ties: lower slot),
  // as token ids with their logits (ops.h's packed_top_k: -1 and -inf past the active rows there
  // are). ids, values: device, [n][k]. A sampled chain's draft rows (speculative/chain_sampling.h).
  void ranked(int32_t n, int32_t k, int32_t* ids, float* values);
  // Makes the compute stream wait for the last gather (if it has not yet): before a step is
  // captured as a graph, which must wait on nothing recorded outside its capture.
  void wait_for_gather();
  // The device counter of packed rows in use (what argmax looks at).
  const int32_t* device_rows() const;

  // The state as the host sees it after synchronizing (tests).
  struct Snapshot {
    int32_t active = 0;                  // window's distinct tokens
    std::vector<int32_t> token_of_slot;  // [n_rows] packed rows in slot order
  };
  Snapshot snapshot() const;

 private:
  // The device address of one of the state's counters (offset inside DraftVocabState).
  const int32_t* device_counter(size_t offset) const;

  const uint8_t* head_data_;
  PrunedVocabSpec spec_;
  uint64_t serial_ = next_object_serial();
  cudaStream_t compute_;
  int32_t n_vocab_ = 0;
  int32_t capacity_ = 0;
  std::unique_ptr<DevicePackedHead> packed_;
  DeviceAllocations memory_;
  DraftVocabState* state_ = nullptr;  // device: the state
  DraftVocabState layout_;            // host copy as made: the device addresses of its arrays
  DeviceVocabSizes sizes_;
  int32_t* prompt_ids_ = nullptr;      // [max_prompt]
  int32_t* prompt_top_ = nullptr;      // [max_prompt][K_pre]
  float* logits_ = nullptr;            // [max_rows][capacity]
  int32_t* tops_ = nullptr;            // [kMaxStepRows][K_ver] top K_ver ids of a step's rows
  float* top_values_ = nullptr;        // [kMaxStepRows][K_ver] their values (scratch)
  VocabUpdate* host_update_ = nullptr;  // [1] device copy of the host-given update
};

}  // namespace microspec::cuda
