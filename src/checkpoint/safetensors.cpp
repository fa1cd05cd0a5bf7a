#include "checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "kernels/types.h"
#include "util/error.h"
#include "util/mapped_file.h"

namespace microspec {

namespace {

// Real headers are a few hundred bytes per tensor; the reference implementation caps them at
// 100 MB, and so do we (a corrupt length must not make us parse gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr size_t kMaxDims = 8;

struct DtypeInfo {
  TensorDtype dtype;
  const char* name;
  size_t bytes;
};
constexpr DtypeInfo kDtypes[] = {
    {TensorDtype::F64, "F64", 8}, {TensorDtype::F32, "F32", 4}, {TensorDtype::F16, "F16", 2},
    {TensorDtype::BF16, "BF16", 2}, {TensorDtype::I64, "I64", 8}, {TensorDtype::I32, "I32", 4},
    {TensorDtype::I16, "I16", 2}, {TensorDtype::I8, "I8", 1}, {TensorDtype::U8, "U8", 1},
    {TensorDtype::Bool, "BOOL", 1},
};

const DtypeInfo& info(TensorDtype d) {
  for (const DtypeInfo& i : kDtypes)
    if (i.dtype == d) return i;
  throw Error("unknown tensor dtype");
}

}  // namespace

const char* dtype_name(TensorDtype d) { return info(d).name; }
size_t dtype_bytes(TensorDtype d) { return info(d).bytes; }

int64_t CheckpointTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string CheckpointTensor::shape_text() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void tensor_to_f32(const CheckpointTensor& t, std::span<float> out) {
  const int64_t n = t.n_elements();
  if (static_cast<int64_t>(out.size()) != n)
    throw Error("tensor " + t.name + ": " + std::to_string(n) + " values into a buffer of " +
                std::to_string(out.size()));
  const uint8_t* p = t.data.data();
  switch (t.dtype) {
    case TensorDtype::F32:
      std::memcpy(out.data(), p, size_t(n) * 4);
      return;
    case TensorDtype::F16:
      for (int64_t i = 0; i < n; ++i) {
        fp16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = fp16_to_fp32(h);
      }
      return;
    case TensorDtype::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        out[i] = bf16_to_fp32(b);
      }
      return;
    default:
      throw Error("tensor " + t.name + ": dtype " + dtype_name(t.dtype) +
                  " is not a weight type (expected F32, F16 or BF16)");
  }
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->name_ = path;
  f->mapping_ = std::make_unique<MappedFile>(path, "safetensors file");
  f->parse(f->mapping_->data(), f->mapping_->size());
  return f;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::from_memory(const uint8_t* data, size_t size,
                                                              std::string name) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->name_ = std::move(name);
  f->parse(data, size);
  return f;
}

SafetensorsFile::~SafetensorsFile() = default;

const CheckpointTensor* SafetensorsFile::find(std::string_view tensor_name) const {
  auto it = index_.find(tensor_name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::parse(const uint8_t* data, size_t size) {
  auto fail = [&](const std::string& what) -> void { throw Error(name_ + ": " + what); };

  // Header length and header.
  if (size < 8) fail("file is too small to be safetensors (" + std::to_string(size) + " bytes)");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | data[i];
  if (header_bytes > kMaxHeaderBytes || header_bytes > size - 8)
    fail("header length " + std::to_string(header_bytes) + " exceeds the file (" + std::to_string(size) +
         " bytes) or the 100 MB limit: not a safetensors file, or truncated");
  const char* header_begin = reinterpret_cast<const char*>(data + 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_begin, header_begin + header_bytes);
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail("header is not a JSON object");
  const uint8_t* tensor_data = data + 8 + header_bytes;
  const uint64_t data_bytes = size - 8 - header_bytes;

  // Entries.
  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  for (const auto& [key, entry] : header.items()) {
    if (key == "__metadata__") {
      if (!entry.is_object()) fail("__metadata__ is not an object");
      for (const auto& [mk, mv] : entry.items()) {
        if (!mv.is_string()) fail("__metadata__ value of '" + mk + "' is not a string");
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + key + "': ";
    if (!entry.is_object()) fail(where + "entry is not an object");
    CheckpointTensor t;
    t.name = key;

    const auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) fail(where + "missing string 'dtype'");
    const std::string dtype = dt->get<std::string>();
    const DtypeInfo* found = nullptr;
    for (const DtypeInfo& i : kDtypes)
      if (dtype == i.name) found = &i;
    if (!found) fail(where + "unsupported dtype '" + dtype + "'");
    t.dtype = found->dtype;

    const auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array() || sh->size() > kMaxDims)
      fail(where + "'shape' must be an array of at most " + std::to_string(kMaxDims) + " sizes");
    uint64_t n = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) fail(where + "shape entries must be non-negative integers");
      const uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t(1) << 40) || (v != 0 && n > (uint64_t(1) << 48) / v))
        fail(where + "shape " + sh->dump() + " is too large");
      n *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }

    const auto off = entry.find("data_offsets");
    if (off == entry.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      fail(where + "'data_offsets' must be [begin, end]");
    const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end || end > data_bytes)
      fail(where + "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
           "] outside the data section of " + std::to_string(data_bytes) + " bytes (truncated file?)");
    if (end - begin != n * found->bytes)
      fail(where + "shape " + t.shape_text() + " of " + dtype + " needs " + std::to_string(n * found->bytes) +
           " bytes, data_offsets span " + std::to_string(end - begin));
    t.data = std::span<const uint8_t>(tensor_data + begin, end - begin);
    spans.push_back({begin, end, tensors_.size()});
    index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }

  // No two tensors share bytes.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].begin < spans[i - 1].end && spans[i].begin != spans[i].end)
      fail("tensors '" + tensors_[spans[i - 1].index].name + "' and '" + tensors_[spans[i].index].name +
           "' overlap");
}

}  // namespace microspec
