#include "cuda/weights.h"

#include <cuda_runtime_api.h>

#include "cuda/cuda_check.h"
#include "gguf/gguf.h"
#include "kernels/types.h"
#include "util/error.h"

namespace microspec::cuda {

namespace {

const GgufTensor& find_matrix(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows) {
  const GgufTensor* t = f.find_tensor(name);
  if (!t) throw Error(f.name() + ": missing tensor '" + name + "'");
  if (t->ne.size() != 2 || t->ne[0] != cols || t->ne[1] != rows) {
    std::string actual;
    for (size_t i = 0; i < t->ne.size(); ++i) actual += (i ? ", " : "") + std::to_string(t->ne[i]);
    throw Error(f.name() + ": tensor '" + name + "' has shape [" + actual + "], expected [" + std::to_string(cols) +
                ", " + std::to_string(rows) + "]");
  }
  if (!matmul_supported(t->type))
    throw Error(f.name() + ": tensor '" + name + "' has type " + type_name(uint32_t(t->type)) +
                ", which has no CUDA kernel");
  return *t;
}

}  // namespace

DeviceMatrix WeightUploader::matrix(const std::string& name, int64_t cols, int64_t rows) {
  return stacked({name}, {rows}, cols).front();
}

std::vector<DeviceMatrix> WeightUploader::stacked(const std::vector<std::string>& names,
                                                  const std::vector<int64_t>& rows, int64_t cols) {
  std::vector<const GgufTensor*> ts;
  for (size_t i = 0; i < names.size(); ++i) ts.push_back(&find_matrix(f_, names[i], cols, rows[i]));
  std::vector<DeviceMatrix> parts;
  for (size_t i = 0; i < ts.size();) {
    size_t j = i, bytes = 0;
    int64_t total_rows = 0;
    while (j < ts.size() && ts[j]->type == ts[i]->type) bytes += ts[j]->n_bytes, total_rows += rows[j], ++j;
    uint8_t* dst = static_cast<uint8_t*>(alloc_(bytes));
    for (size_t k = i, off = 0; k < j; off += ts[k]->n_bytes, ++k)
      upload(dst + off, ts[k]->data, ts[k]->n_bytes);
    bytes_ += bytes;
    parts.push_back(DeviceMatrix{ts[i]->type, dst, total_rows, cols, row_bytes(ts[i]->type, cols)});
    i = j;
  }
  return parts;
}

const float* WeightUploader::vector(const std::string& name, int64_t n) {
  const GgufTensor* t = f_.find_tensor(name);
  if (!t) throw Error(f_.name() + ": missing tensor '" + name + "'");
  if (t->type != GgmlType::F32 || t->ne.size() != 1 || t->ne[0] != n)
    throw Error(f_.name() + ": tensor '" + name + "' must be F32 [" + std::to_string(n) + "]");
  void* p = alloc_(t->n_bytes);
  upload(p, t->data, t->n_bytes);
  bytes_ += t->n_bytes;
  return static_cast<const float*>(p);
}

}  // namespace microspec::cuda
