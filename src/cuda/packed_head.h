#pragma once
// MicroSpec's packed LM head on the device: a buffer of `capacity` vocabulary rows in the full
// head's own format. Rows that enter the draft vocabulary are gathered from the full head on a
// second stream (overlapping whatever runs on the compute stream, e.g. the draft backbone), and
// the packed logits wait for the gather through an event recorded after it.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "cuda/cuda_check.h"
#include "cuda/ops.h"

namespace microspec::cuda {

// Where gathers run: on the head's own copy stream, overlapping the compute stream's work until
// the logits join them (the paper's design), or on the compute stream itself (--no-async-gather).
enum class GatherStream { Copy, Compute };

class DevicePackedHead {
 public:
  // full: the model's LM head ([n_vocab rows][n_embd]); compute: the stream the logits run on.
  // The packed rows start as zeros.
  DevicePackedHead(const DeviceMatrix& full, int32_t capacity, cudaStream_t compute,
                   GatherStream gather = GatherStream::Copy);
  ~DevicePackedHead();
  DevicePackedHead(const DevicePackedHead&) = delete;
  DevicePackedHead& operator=(const DevicePackedHead&) = delete;

  int32_t capacity() const { return capacity_; }
  cudaStream_t copy_stream() const { return copy_; }

  // Makes the compute stream wait for the last gather, unless it already has: before an update
  // rewrites the copy list and the slots that gather reads. (Only gathers that the compute stream
  // has not joined are waited for, so a step captured as a graph after a joined gather waits on
  // nothing recorded outside its capture.)
  void wait_for_gather();
  // Enqueues on the gather stream, after what the compute stream has enqueued so far (e.g. the
  // vocabulary update that wrote the list): copies[0, *n_copies) (device; at most max_copies) into
  // the packed rows (ops.h gather_packed_rows).
  void gather(const RowCopy* copies, const int32_t* n_copies, int32_t max_copies);
  // The same for a list made on the host: full-head rows ids[j] into packed slots slots[j].
  void enter(std::span<const int32_t> ids, std::span<const int32_t> slots);
  // logits[t * ldl + j] = dot(packed row j, hidden[t]) for j < n_rows, t < n, on the compute stream
  // after the last gather (event join). scratch: matmul_scratch_bytes(n, n_embd) bytes.
  void logits(const float* hidden, int32_t n, int32_t n_rows, float* logits, int64_t ldl, uint8_t* scratch);

 private:
  void release();  // synchronizes the copy stream, destroys the events and the own stream

  DeviceMatrix full_;
  int32_t capacity_;
  cudaStream_t compute_;
  cudaStream_t copy_ = nullptr;     // the gather stream: its own, or compute_ (GatherStream::Compute)
  cudaStream_t own_copy_ = nullptr;
  cudaEvent_t updated_ = nullptr;   // compute stream: the slot update a gather waits for
  cudaEvent_t gathered_ = nullptr;
  bool joined_ = false;           // the compute stream has waited for the last gather
  DeviceAllocations memory_;
  uint8_t* rows_ = nullptr;       // [capacity][full.row_stride] packed rows
  RowCopy* d_copies_ = nullptr;   // [capacity] enter()'s copies
  int32_t* d_n_copies_ = nullptr; // [1] their count
};

}  // namespace microspec::cuda
