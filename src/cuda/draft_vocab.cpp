#include "cuda/draft_vocab.h"

#include <algorithm>
#include <cstddef>
#include <string>

#include "cuda/cuda_check.h"
#include "util/error.h"

namespace microspec::cuda {

namespace {
// Where the packed slots' counters are inside the device state.
constexpr size_t kCopiesOffset = offsetof(DraftVocabState, slots) + offsetof(PackedSlots, n_copies);
constexpr size_t kRowsOffset = offsetof(DraftVocabState, slots) + offsetof(PackedSlots, n_rows);
}  // namespace

DeviceDraftVocab::DeviceDraftVocab(const DeviceMatrix& head, const PrunedVocabSpec& spec,
                                   const DeviceVocabSizes& sizes, cudaStream_t compute)
    : head_data_(head.data), spec_(spec), compute_(compute), n_vocab_(int32_t(head.rows)), sizes_(sizes) {
  if (sizes.max_prompt < 1 || sizes.max_rows < 1) throw Error("device draft vocabulary: empty sizes");
  const bool fixed = spec.kind == PrunedVocabSpec::Kind::Fixed;
  // Fixed: a window of one entry that nothing is ever pushed into, beside the pinned ids.
  CandidateStreamParams sp = spec.window.stream;
  if (fixed) sp.w_max = 1, sp.k_pre = 0, sp.k_ver = 0;
  if (sp.w_max < 1 || sp.w_max > kMaxWindow)
    throw Error("--device cuda: vocabulary window " + std::to_string(sp.w_max) + " outside 1.." +
                std::to_string(kMaxWindow));
  if (sp.k_pre < 0 || sp.k_ver < 0 || sp.k_pre > 64 || sp.k_ver > 64)
    throw Error("--device cuda: K_pre and K_ver must be in 0..64, got " + std::to_string(sp.k_pre) + " and " +
                std::to_string(sp.k_ver));
  std::vector<uint8_t> seen(size_t(n_vocab_), 0);
  for (int32_t id : spec.pinned) {
    if (id < 0 || id >= n_vocab_ || seen[size_t(id)])
      throw Error("device draft vocabulary: pinned id " + std::to_string(id) + " is repeated or outside 0.." +
                  std::to_string(n_vocab_ - 1));
    seen[size_t(id)] = 1;
  }
  if (fixed && spec.pinned.empty()) throw Error("device draft vocabulary: a fixed vocabulary without ids");
  const int32_t n_pinned = int32_t(spec.pinned.size());
  capacity_ = fixed ? n_pinned : int32_t(std::min<int64_t>(int64_t(sp.w_max) + n_pinned, n_vocab_));
  packed_ = std::make_unique<DevicePackedHead>(head, capacity_, compute,
                                               spec.window.async_gather ? GatherStream::Copy : GatherStream::Compute);
  auto alloc = [this](size_t bytes) { return memory_.alloc(bytes); };
  const size_t V = size_t(n_vocab_), C = size_t(capacity_);
  DraftVocabState& s = layout_;
  s.window.count = static_cast<int32_t*>(alloc(V * 4));
  s.window.touched_flag = static_cast<uint8_t*>(alloc(V));
  s.window.touched = static_cast<int32_t*>(alloc(V * 4));
  s.window.ring = static_cast<int32_t*>(alloc(size_t(sp.w_max) * 4));
  s.window.n_vocab = n_vocab_;
  s.window.w_max = sp.w_max;
  s.stamps.stamp = static_cast<uint32_t*>(alloc(V * 4));
  s.stamps.n_vocab = n_vocab_;
  s.slots.slot_of = static_cast<int32_t*>(alloc(V * 4));
  s.slots.token_of_slot = static_cast<int32_t*>(alloc(C * 4));
  s.slots.holes = static_cast<int32_t*>(alloc(C * 4));
  s.slots.source_of_slot = static_cast<int32_t*>(alloc(C * 4));
  s.slots.copies = static_cast<RowCopy*>(alloc(2 * C * sizeof(RowCopy)));
  s.slots.capacity = capacity_;
  s.entered = static_cast<int32_t*>(alloc(C * 4));
  s.left = static_cast<int32_t*>(alloc(C * 4));
  MS_CUDA(cudaMemsetAsync(s.window.count, 0, V * 4, compute));
  MS_CUDA(cudaMemsetAsync(s.window.touched_flag, 0, V, compute));
  MS_CUDA(cudaMemsetAsync(s.stamps.stamp, 0, V * 4, compute));
  MS_CUDA(cudaMemsetAsync(s.slots.slot_of, 0xFF, V * 4, compute));  // -1
  MS_CUDA(cudaMemsetAsync(s.slots.token_of_slot, 0xFF, C * 4, compute));
  const std::vector<int32_t> no_source(C, PackedSlots::kNoSource);
  MS_CUDA(cudaMemcpyAsync(s.slots.source_of_slot, no_source.data(), C * 4, cudaMemcpyHostToDevice, compute));
  state_ = static_cast<DraftVocabState*>(alloc(sizeof(DraftVocabState)));
  MS_CUDA(cudaMemcpyAsync(state_, &s, sizeof(s), cudaMemcpyHostToDevice, compute));
  // The pinned ids count once in the window for good; the first begin() enters them (in this
  // order: the fixed vocabulary's rows are the ids as given).
  if (n_pinned > 0) {
    int32_t* pinned = static_cast<int32_t*>(alloc(size_t(n_pinned) * 4));
    MS_CUDA(cudaMemcpyAsync(pinned, spec.pinned.data(), size_t(n_pinned) * 4, cudaMemcpyHostToDevice, compute));
    vocab_pin(state_, pinned, n_pinned, compute);
  }
  prompt_ids_ = static_cast<int32_t*>(alloc(size_t(sizes.max_prompt) * 4));
  prompt_top_ = static_cast<int32_t*>(alloc(size_t(sizes.max_prompt) * size_t(std::max(prompt_top_k(), 1)) * 4));
  logits_ = static_cast<float*>(alloc(size_t(sizes.max_rows) * C * sizeof(float)));
  tops_ = static_cast<int32_t*>(alloc(size_t(kMaxStepRows) * std::max(sp.k_ver, 1) * 4));
  top_values_ = static_cast<float*>(alloc(size_t(kMaxStepRows) * std::max(sp.k_ver, 1) * 4));
  host_update_ = static_cast<VocabUpdate*>(alloc(sizeof(VocabUpdate)));
  MS_CUDA(cudaStreamSynchronize(compute));  // the host vectors above are gone after this scope
}

const int32_t* DeviceDraftVocab::device_counter(size_t offset) const {
  return reinterpret_cast<const int32_t*>(reinterpret_cast<const uint8_t*>(state_) + offset);
}

DeviceDraftVocab::~DeviceDraftVocab() {
  if (compute_) cudaStreamSynchronize(compute_);
  packed_.reset();  // waits for its copy stream; memory_ goes after this body
}

void DeviceDraftVocab::wait_for_gather() { packed_->wait_for_gather(); }

const int32_t* DeviceDraftVocab::device_rows() const { return device_counter(kRowsOffset); }

void DeviceDraftVocab::begin(int32_t n_prompt) {
  if (n_prompt < 0 || n_prompt > sizes_.max_prompt)
    throw Error("device draft vocabulary: prompt of " + std::to_string(n_prompt) + " tokens, at most " +
                std::to_string(sizes_.max_prompt));
  const int32_t k = prompt_top_k();
  packed_->wait_for_gather();
  const bool prompt_in_stream = spec_.kind == PrunedVocabSpec::Kind::Window &&
                                spec_.window.stream.source != CandidateStreamParams::Source::Ext;
  vocab_begin(state_, prompt_ids_, prompt_in_stream ? n_prompt : 0, prompt_top_, k, prompt_in_stream ? k : 0,
              compute_);
  packed_->gather(layout_.slots.copies, device_counter(kCopiesOffset), 2 * capacity_);
}

void DeviceDraftVocab::step(const int32_t* tree, const float* verify_logits, const VocabUpdate* update,
                            int32_t max_tree, int32_t max_rows, const int32_t* accepted_rows) {
  if (!takes_steps()) return;
  if (max_tree < 0 || max_rows < 0 || max_rows > kMaxStepRows)
    throw Error("device draft vocabulary: a step of up to " + std::to_string(max_tree) + " tree tokens and " +
                std::to_string(max_rows) + " verification rows (at most " + std::to_string(kMaxStepRows) + ")");
  const int32_t k = spec_.window.stream.k_ver;
  if (k > 0)
    top_k_rows(verify_logits, n_vocab_, n_vocab_, RowRange{&update->first_row, &update->n_rows, max_rows, accepted_rows}, k, tops_,
               top_values_, compute_);
  packed_->wait_for_gather();
  vocab_step(state_, tree, tops_, update, k, compute_);
  // Each append enters at most one token and evicts at most one; a move follows each eviction.
  packed_->gather(layout_.slots.copies, device_counter(kCopiesOffset),
                  std::min(2 * capacity_, 2 * (max_tree + max_rows * k)));
}

void DeviceDraftVocab::step(const int32_t* tree, const float* verify_logits, const VocabUpdate& update) {
  if (update.n_tree < 0 || update.first_row < 0 || update.n_rows < 0)
    throw Error("device draft vocabulary: negative step sizes");
  // Pageable source: the runtime stages it before returning.
  MS_CUDA(cudaMemcpyAsync(host_update_, &update, sizeof(update), cudaMemcpyHostToDevice, compute_));
  step(tree, verify_logits, host_update_, update.n_tree, update.n_rows);
}

const float* DeviceDraftVocab::logits(const float* hidden, int32_t n, uint8_t* scratch) {
  if (n < 1 || n > sizes_.max_rows)
    throw Error("device draft vocabulary: " + std::to_string(n) + " rows, at most " + std::to_string(sizes_.max_rows));
  packed_->logits(hidden, n, capacity_, logits_, capacity_, scratch);
  return logits_;
}

void DeviceDraftVocab::argmax(int32_t n, int32_t if_empty, int32_t* out) {
  if (n < 1 || n > sizes_.max_rows)
    throw Error("device draft vocabulary: " + std::to_string(n) + " rows, at most " + std::to_string(sizes_.max_rows));
  packed_argmax(logits_, capacity_, n, device_counter(kRowsOffset), layout_.slots.token_of_slot, if_empty, out,
                compute_);
}

void DeviceDraftVocab::proposals(int32_t n, int32_t k, int32_t* tokens, float* logprobs) {
  if (n < 1 || n > sizes_.max_rows)
    throw Error("device draft vocabulary: " + std::to_string(n) + " rows, at most " + std::to_string(sizes_.max_rows));
  tree_proposals(logits_, capacity_, capacity_, device_counter(kRowsOffset), layout_.slots.token_of_slot, n, k, tokens,
                 logprobs, compute_);
}

void DeviceDraftVocab::ranked(int32_t n, int32_t k, int32_t* ids, float* values) {
  if (n < 1 || n > sizes_.max_rows)
    throw Error("device draft vocabulary: " + std::to_string(n) + " rows, at most " + std::to_string(sizes_.max_rows));
  packed_top_k(logits_, capacity_, n, device_counter(kRowsOffset), layout_.slots.token_of_slot, k, ids, values,
               compute_);
}

DeviceDraftVocab::Snapshot DeviceDraftVocab::snapshot() const {
  MS_CUDA(cudaStreamSynchronize(compute_));
  DraftVocabState s;
  MS_CUDA(cudaMemcpy(&s, state_, sizeof(s), cudaMemcpyDeviceToHost));
  Snapshot out;
  out.active = s.window.active;
  out.token_of_slot.resize(size_t(s.slots.n_rows));
  MS_CUDA(cudaMemcpy(out.token_of_slot.data(), s.slots.token_of_slot, out.token_of_slot.size() * 4,
                     cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace microspec::cuda
