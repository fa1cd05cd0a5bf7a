#include "cuda/packed_head.h"

#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "util/error.h"

namespace microspec::cuda {

DevicePackedHead::DevicePackedHead(const DeviceMatrix& full, int32_t capacity, cudaStream_t compute,
                                   GatherStream gather)
    : full_(full), capacity_(capacity), compute_(compute) {
  if (capacity < 1 || capacity > full.rows)
    throw Error("packed head: capacity " + std::to_string(capacity) + " outside 1.." + std::to_string(full.rows));
  try {
    if (gather == GatherStream::Copy) {
      MS_CUDA(cudaStreamCreateWithFlags(&own_copy_, cudaStreamNonBlocking));
      copy_ = own_copy_;
    } else {
      copy_ = compute_;
    }
    MS_CUDA(cudaEventCreateWithFlags(&updated_, cudaEventDisableTiming));
    MS_CUDA(cudaEventCreateWithFlags(&gathered_, cudaEventDisableTiming));
    rows_ = static_cast<uint8_t*>(memory_.alloc(full.row_stride * size_t(capacity)));
    MS_CUDA(cudaMemsetAsync(rows_, 0, full.row_stride * size_t(capacity), copy_));
    d_copies_ = static_cast<RowCopy*>(memory_.alloc(sizeof(RowCopy) * capacity));
    d_n_copies_ = static_cast<int32_t*>(memory_.alloc(sizeof(int32_t)));
    MS_CUDA(cudaEventRecord(gathered_, copy_));  // the zeroing: the first logits wait for it
  } catch (...) {
    release();  // no destructor runs for a constructor that throws (memory_ frees itself)
    throw;
  }
}

DevicePackedHead::~DevicePackedHead() { release(); }

void DevicePackedHead::release() {
  if (copy_) cudaStreamSynchronize(copy_);
  for (cudaEvent_t* e : {&updated_, &gathered_}) {
    if (*e) cudaEventDestroy(*e);
    *e = nullptr;
  }
  if (own_copy_) cudaStreamDestroy(own_copy_);
  own_copy_ = nullptr;
  copy_ = nullptr;
}

void DevicePackedHead::wait_for_gather() {
  if (joined_) return;
  MS_CUDA(cudaStreamWaitEvent(compute_, gathered_, 0));
  stream_barrier(compute_);  // the packed product's early weight loads must not pass the gather
  joined_ = true;
}

void DevicePackedHead::gather(const RowCopy* copies, const int32_t* n_copies, int32_t max_copies) {
  if (max_copies < 0 || max_copies > 2 * capacity_)
    throw Error("packed head: " + std::to_string(max_copies) + " copies for capacity " + std::to_string(capacity_));
  MS_CUDA(cudaEventRecord(updated_, compute_));
  MS_CUDA(cudaStreamWaitEvent(copy_, updated_, 0));
  gather_packed_rows(full_, copies, n_copies, max_copies, rows_, copy_);
  MS_CUDA(cudaEventRecord(gathered_, copy_));
  joined_ = false;
}

void DevicePackedHead::enter(std::span<const int32_t> ids, std::span<const int32_t> slots) {
  if (ids.size() != slots.size() || ids.size() > size_t(capacity_))
    throw Error("packed head: " + std::to_string(ids.size()) + " ids for " + std::to_string(slots.size()) +
                " slots (capacity " + std::to_string(capacity_) + ")");
  std::vector<RowCopy> copies(ids.size());
  for (size_t j = 0; j < ids.size(); ++j) {
    if (ids[j] < 0 || ids[j] >= full_.rows || slots[j] < 0 || slots[j] >= capacity_)
      throw Error("packed head: row " + std::to_string(ids[j]) + " -> slot " + std::to_string(slots[j]) +
                  " out of range");
    copies[j] = RowCopy{ids[j], slots[j]};
  }
  if (copies.empty()) return;
  const int32_t n = static_cast<int32_t>(copies.size());
  // Pageable sources: the runtime stages them before returning.
  MS_CUDA(cudaMemcpyAsync(d_copies_, copies.data(), copies.size() * sizeof(RowCopy), cudaMemcpyHostToDevice, copy_));
  MS_CUDA(cudaMemcpyAsync(d_n_copies_, &n, sizeof(n), cudaMemcpyHostToDevice, copy_));
  gather(d_copies_, d_n_copies_, n);
}

void DevicePackedHead::logits(const float* hidden, int32_t n, int32_t n_rows, float* logits, int64_t ldl,
                              uint8_t* scratch) {
  if (n_rows < 0 || n_rows > capacity_)
    throw Error("packed head: " + std::to_string(n_rows) + " rows of " + std::to_string(capacity_));
  wait_for_gather();
  const DeviceMatrix packed{full_.type, rows_, n_rows, full_.cols, full_.row_stride};
  matmul(packed, RowSelection{nullptr, n_rows}, hidden, full_.cols, n, logits, ldl, Store::Overwrite, scratch,
         compute_);
}

}  // namespace microspec::cuda
