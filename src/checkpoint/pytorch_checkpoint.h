#pragma once
// pytorch_model.bin as torch.save writes it (PyTorch >= 1.6, the zip format), read without
// executing pickled code:
//
//   <archive>/data.pkl      the state dict, pickled (read by checkpoint/pickle.h's restricted machine)
//   <archive>/data/<key>    one storage per key, raw little-endian elements
//   <archive>/byteorder     "little" (absent in old files, which were little-endian)
//
// Each tensor becomes a CheckpointTensor view into the mapped file: the storage's dtype, the
// tensor's shape, its storage offset honoured. Checked: every storage entry exists and holds
// exactly the elements its persistent id declares, every view lies inside its storage, every
// view is contiguous (a transposed or strided view is refused: re-save with .contiguous()).
// The legacy (pre-1.6) non-zip format and TorchScript archives are refused with a message.
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/safetensors.h"

namespace microspec {

class MappedFile;
class ZipArchive;

class PytorchCheckpoint {
 public:
  static std::unique_ptr<PytorchCheckpoint> open(const std::string& path);
  // The same over bytes in memory (tests, fuzzing); `data` must outlive the object.
  static std::unique_ptr<PytorchCheckpoint> from_memory(const uint8_t* data, size_t size, std::string name);
  ~PytorchCheckpoint();

  const std::string& name() const { return name_; }
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }  // the state dict's order
  const CheckpointTensor* find(std::string_view tensor_name) const;            // null if absent

 private:
  PytorchCheckpoint() = default;
  void parse(const uint8_t* data, size_t size);

  std::string name_;
  std::unique_ptr<MappedFile> mapping_;  // null for from_memory()
  std::vector<CheckpointTensor> tensors_;
};

}  // namespace microspec
