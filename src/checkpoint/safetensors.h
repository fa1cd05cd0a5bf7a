#pragma once
// Reading checkpoints as the PyTorch ecosystem writes them (Hugging Face model folders, published
// EAGLE heads). This file: the safetensors format, one file (one shard):
//
//   u64 (little endian) N | N bytes of JSON header | tensor data
//   header: {"NAME": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {"key": "value", ...}}   (offsets relative to the data section)
//
// Every entry is checked against the file: a known dtype, a shape whose byte size equals its
// offsets' span, offsets inside the data, no two tensors overlapping. Tensor bytes are views into
// the mapped file, never copied.
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace microspec {

class MappedFile;

enum class TensorDtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, Bool };

const char* dtype_name(TensorDtype d);  // as safetensors spells it: "BF16", "F32", ...
size_t dtype_bytes(TensorDtype d);

// One tensor of a checkpoint: PyTorch's order (shape[0] varies slowest; a Linear weight is
// [out_features][in_features]), packed row-major little-endian data.
struct CheckpointTensor {
  std::string name;
  TensorDtype dtype = TensorDtype::F32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;  // [n_elements() * dtype_bytes(dtype)]

  int64_t n_elements() const;
  std::string shape_text() const;  // "[4096, 1024]"
};

// The tensor's values as float32 into out ([n_elements()]); F32, F16 and BF16 only, else throws
// Error naming the tensor and its dtype.
void tensor_to_f32(const CheckpointTensor& t, std::span<float> out);

class SafetensorsFile {
 public:
  // Throws Error("PATH: ...") naming what is wrong with the file.
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  // The same checks over bytes in memory (tests, fuzzing); `data` must outlive the object.
  static std::unique_ptr<SafetensorsFile> from_memory(const uint8_t* data, size_t size, std::string name);
  ~SafetensorsFile();

  const std::string& name() const { return name_; }
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }  // header order
  const CheckpointTensor* find(std::string_view tensor_name) const;            // null if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void parse(const uint8_t* data, size_t size);

  std::string name_;
  std::unique_ptr<MappedFile> mapping_;  // null for from_memory()
  std::vector<CheckpointTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

}  // namespace microspec
