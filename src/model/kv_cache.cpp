#include "model/kv_cache.h"

#include <cstring>
#include <string>

#include "util/error.h"

namespace microspec {

KVCache::KVCache(int32_t n_layer, int32_t n_ctx, int32_t kv_dim)
    : n_layer_(n_layer), n_ctx_(n_ctx), kv_dim_(kv_dim) {
  if (n_layer <= 0 || n_ctx <= 0 || kv_dim <= 0) throw Error("KV cache: invalid dimensions");
  const size_t n = size_t(n_layer) * n_ctx * kv_dim;
  k_.assign(n, 0);
  v_.assign(n, 0);
  positions_.assign(n_ctx, 0);
  parents_.assign(n_ctx, -1);
}

void KVCache::visible_keys(int32_t pending, int32_t qpos, int32_t window, int32_t n_keys, uint8_t* seen) const {
  if (window == 0)
    std::memset(seen, 1, size_t(n_past_));
  else
    for (int32_t slot = 0; slot < n_past_; ++slot) seen[slot] = qpos - positions_[slot] < window;
  std::memset(seen + n_past_, 0, size_t(n_keys - n_past_));
  for (int32_t p = pending; p >= 0; p = pending_parent(p))
    seen[n_past_ + p] = window == 0 || qpos - positions_[n_past_ + p] < window;
}

void KVCache::set_slot_meta(int32_t slot, int32_t position, int32_t parent_pending_index) {
  // A parent is an earlier pending slot, so every walk up the chain of ancestors ends.
  if (slot < n_past_ || slot >= n_ctx_ || parent_pending_index < -1 || parent_pending_index >= slot - n_past_)
    throw Error("KV slot meta: slot " + std::to_string(slot) + " with parent " + std::to_string(parent_pending_index) +
                " (pending slots start at " + std::to_string(n_past_) + ", the cache holds " +
                std::to_string(n_ctx_) + "; a parent is an earlier pending slot or -1)");
  positions_[slot] = position;
  parents_[slot] = parent_pending_index;
}

void KVCache::commit(std::span<const int32_t> pending_indices) {
  int32_t prev = -1;
  for (int32_t idx : pending_indices) {
    if (idx <= prev || n_past_ + idx >= n_ctx_)
      throw Error("KV commit: pending indices must increase and fit the cache");
    prev = idx;
  }
  // Destinations never pass their sources (dst = n_past + j <= n_past + idx_j), so in-order copies are safe.
  int32_t dst = n_past_;
  for (int32_t idx : pending_indices) {
    const int32_t src = n_past_ + idx;
    if (src != dst) {
      for (int32_t il = 0; il < n_layer_; ++il) {
        std::memcpy(k(il, dst), k(il, src), row_bytes());
        std::memcpy(v(il, dst), v(il, src), row_bytes());
      }
      positions_[dst] = positions_[src];
    }
    parents_[dst] = -1;
    ++dst;
  }
  n_past_ = dst;
}

void KVCache::commit_prefix(int32_t n) {
  if (n < 0 || n_past_ + n > n_ctx_) throw Error("KV commit: out of range");
  for (int32_t i = 0; i < n; ++i) parents_[n_past_ + i] = -1;
  n_past_ += n;
}

void KVCache::truncate(int32_t n) {
  if (n < 0 || n > n_past_)
    throw Error("KV truncate: " + std::to_string(n) + " is beyond " + std::to_string(n_past_));
  n_past_ = n;
}

}  // namespace microspec
