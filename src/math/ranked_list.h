#pragma once
// A short list of the best (value, index) pairs seen so far, in the order every selection here
// uses: larger value first, then lower index; NaN never enters. The CUDA backend's top-k keeps one
// such list per thread over the elements it reads, then merges the threads' lists by their heads
// (src/cuda/ops.cu, block_top_k); tests/test_sampler.cpp runs the same lists and merge on the CPU.
#include <cstdint>

#include "util/host_device.h"

namespace microspec {

// Whether (v, i) ranks before (bv, bi); bi < 0 is an empty place, which anything but NaN beats.
MS_HOST_DEVICE inline bool ranks_before(float v, int64_t i, float bv, int64_t bi) {
  if (v != v) return false;  // NaN
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}

// Offers (v, i) to the list values/ids[0, count) (best first, capacity k): it enters in its place
// if the list is not full or it ranks before the last one, which then drops out.
MS_HOST_DEVICE inline void ranked_insert(float* values, int64_t* ids, int32_t& count, int32_t k, float v, int64_t i) {
  if (v != v || k < 1) return;
  if (count == k && !ranks_before(v, i, values[k - 1], ids[k - 1])) return;
  int32_t at = count < k ? count++ : k - 1;
  for (; at > 0 && ranks_before(v, i, values[at - 1], ids[at - 1]); --at) {
    values[at] = values[at - 1];
    ids[at] = ids[at - 1];
  }
  values[at] = v;
  ids[at] = i;
}

}  // namespace microspec
