// libFuzzer target for the checkpoint readers: the first byte picks one, the rest is its input.
//   0: the safetensors reader (SafetensorsFile::from_memory)
//   1: the restricted unpickler on a bare pickle (unpickle_state_dict)
//   2: a torch.save zip archive (PytorchCheckpoint::from_memory: zip reader + unpickler + views)
// Only microspec::Error is an acceptable failure. On success every tensor must be a view inside the
// input whose size is exactly its shape times its dtype's size, and every unpickled tensor must
// name a storage the result holds.
#include <cstddef>
#include <cstdint>

#include "checkpoint/pickle.h"
#include "checkpoint/pytorch_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "util/error.h"

namespace {

using namespace microspec;

volatile uint64_t g_sink;

void require(bool ok) {
  if (!ok) __builtin_trap();
}

void check_views(const std::vector<CheckpointTensor>& tensors, const uint8_t* data, size_t size) {
  for (const CheckpointTensor& t : tensors) {
    require(t.n_elements() >= 0);
    require(t.data.size() == size_t(t.n_elements()) * dtype_bytes(t.dtype));
    if (t.data.empty()) continue;
    require(t.data.data() >= data && t.data.size() <= size && size_t(t.data.data() - data) <= size - t.data.size());
    g_sink = g_sink + t.data.front() + t.data.back();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t which = data[0] % 3;
  const uint8_t* in = data + 1;
  const size_t n = size - 1;
  try {
    if (which == 0) {
      const auto f = SafetensorsFile::from_memory(in, n, "fuzz.safetensors");
      check_views(f->tensors(), in, n);
      for (const CheckpointTensor& t : f->tensors()) require(f->find(t.name) != nullptr);
    } else if (which == 1) {
      const PickledStateDict sd = unpickle_state_dict(std::span<const uint8_t>(in, n), "fuzz.pkl");
      for (const PickledTensor& t : sd.tensors) {
        require(t.storage < sd.storages.size());
        require(t.shape.size() == t.strides.size());
      }
    } else {
      const auto c = PytorchCheckpoint::from_memory(in, n, "fuzz.bin");
      check_views(c->tensors(), in, n);
    }
  } catch (const Error&) {
  }
  return 0;
}
