#pragma once
// Key/value cache with a committed prefix and a pending region.
//
// Slots [0, n_past) hold the committed sequence, in order. A forward pass writes its tokens into
// pending slots n_past + start + i; each pending slot records its parent pending slot (or -1), so a
// token tree attends to the committed prefix plus its own ancestors. commit() copies the chosen
// pending slots down behind the prefix (the accepted path) and drops the rest; rollback is simply
// not committing.
#include <cstdint>
#include <span>
#include <vector>

namespace microspec {

class KVCache {
 public:
  KVCache(int32_t n_layer, int32_t n_ctx, int32_t kv_dim);

  int32_t n_layer() const { return n_layer_; }
  int32_t n_ctx() const { return n_ctx_; }
  int32_t kv_dim() const { return kv_dim_; }
  int32_t n_past() const { return n_past_; }

  // Row of slot `slot` in layer `il`: kv_dim half floats.
  uint16_t* k(int32_t il, int32_t slot) { return k_.data() + (size_t(il) * n_ctx_ + slot) * kv_dim_; }
  uint16_t* v(int32_t il, int32_t slot) { return v_.data() + (size_t(il) * n_ctx_ + slot) * kv_dim_; }
  const uint16_t* k(int32_t il, int32_t slot) const {
    return k_.data() + (size_t(il) * n_ctx_ + slot) * kv_dim_;
  }
  const uint16_t* v(int32_t il, int32_t slot) const {
    return v_.data() + (size_t(il) * n_ctx_ + slot) * kv_dim_;
  }
  size_t row_bytes() const { return sizeof(uint16_t) * kv_dim_; }
  int32_t position(int32_t slot) const { return positions_[slot]; }
  int32_t pending_parent(int32_t pending_index) const { return parents_[n_past_ + pending_index]; }

  // Which keys a query sees: seen[0, n_keys) for the query at pending index `pending` (position
  // qpos; n_keys > n_past + pending): the committed slots, then of the pending ones itself and its
  // chain of ancestors (the tree's parent mask); with window > 0 only keys with
  // qpos - position < window.
  void visible_keys(int32_t pending, int32_t qpos, int32_t window, int32_t n_keys, uint8_t* seen) const;

  // Called by the forward pass for each token it writes; a parent must be an earlier pending slot
  // (or -1), else it throws, so the walk up a chain of ancestors always ends.
  void set_slot_meta(int32_t slot, int32_t position, int32_t parent_pending_index);

  // Keeps pending slots `pending_indices` (strictly increasing) as the next committed tokens.
  void commit(std::span<const int32_t> pending_indices);
  // Keeps the first n pending slots (a plain sequential batch).
  void commit_prefix(int32_t n);
  // Forgets everything after the first n committed tokens.
  void truncate(int32_t n);
  void clear() { truncate(0); }

  size_t bytes() const { return (k_.size() + v_.size()) * sizeof(uint16_t); }

 private:
  int32_t n_layer_, n_ctx_, kv_dim_;
  int32_t n_past_ = 0;
  std::vector<uint16_t> k_, v_;     // [n_layer][n_ctx][kv_dim] IEEE half
  std::vector<int32_t> positions_;  // [n_ctx] position of the token in each slot
  std::vector<int32_t> parents_;    // [n_ctx] parent pending index of each pending slot, -1 = none
};

}  // namespace microspec
