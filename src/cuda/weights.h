#pragma once
// A GGUF file's weights uploaded to the device, each checked on the way (Error naming the file, the
// tensor, expected vs actual shape or type): what the device model and the device draft head load.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cuda/ops.h"

namespace microspec {
class GgufFile;
}

namespace microspec::cuda {

class WeightUploader {
 public:
  // alloc: device memory of n bytes, owned by the caller (freed with it).
  WeightUploader(const GgufFile& f, std::function<void*(size_t)> alloc) : f_(f), alloc_(std::move(alloc)) {}

  // The matrix `name` of `rows` rows of `cols` elements ([cols, rows] in GGUF order), of a type
  // matmul() runs.
  DeviceMatrix matrix(const std::string& name, int64_t cols, int64_t rows);
  // Matrices of `cols` columns stacked by rows (names[i] has rows[i]): consecutive ones of one type
  // share one allocation and run as one matrix, so there are as many parts as type changes.
  std::vector<DeviceMatrix> stacked(const std::vector<std::string>& names, const std::vector<int64_t>& rows,
                                    int64_t cols);
  // The F32 vector `name` of n elements.
  const float* vector(const std::string& name, int64_t n);
  // Bytes uploaded so far.
  size_t bytes() const { return bytes_; }

 private:
  const GgufFile& f_;
  std::function<void*(size_t)> alloc_;
  size_t bytes_ = 0;
};

}  // namespace microspec::cuda
