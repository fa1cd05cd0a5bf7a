#pragma once
// GGUF v2/v3 reader: memory-mapped, zero-copy. Every count, offset, size, dimension and alignment
// is validated before use; a bad file throws microspec::Error("<file>: <what is wrong>").
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/types.h"

namespace microspec {

class MappedFile;

enum class GgufType : int32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};
const char* gguf_type_name(GgufType t);
// Bytes of one element of a fixed-size value type; 0 for STRING, ARRAY and unknown types.
size_t gguf_value_size(GgufType t);

// One metadata value. Scalars are widened on parse; arrays keep a view into the mapped file.
struct GgufValue {
  GgufType type = GgufType::U8;
  GgufType elem_type = GgufType::U8;      // for arrays
  uint64_t count = 0;                     // for arrays
  const uint8_t* array_data = nullptr;    // for arrays of fixed-size elements: raw little-endian elements
  std::vector<std::string_view> strings;  // for STRING (one entry) and arrays of STRING
  int64_t i = 0;                          // integer and bool scalars
  uint64_t u = 0;                         // U64 scalars (also mirrored into i when it fits)
  double f = 0.0;                         // F32/F64 scalars
};

struct GgufTensor {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;  // ggml order: ne[0] is the fastest-varying (row length)
  uint64_t offset = 0;      // relative to the data section
  const uint8_t* data = nullptr;
  size_t n_bytes = 0;
  int64_t n_elements() const;
  int64_t rows() const;  // product of ne[1..]
};

class GgufFile {
 public:
  // Maps and parses `path`. Throws Error naming the file and the problem.
  static std::unique_ptr<GgufFile> open(const std::string& path);
  // Parses a buffer that the caller keeps alive (used by tests and the fuzzer).
  static std::unique_ptr<GgufFile> from_memory(const uint8_t* data, size_t size, std::string name);
  // Parses a buffer that the file then owns (a GGUF built in memory, e.g. from a Hugging Face folder).
  static std::unique_ptr<GgufFile> from_bytes(std::vector<uint8_t> bytes, std::string name);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& name() const { return name_; }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  size_t file_size() const { return file_size_; }
  size_t data_offset() const { return data_offset_; }  // file offset of the (aligned) tensor data section

  bool has(std::string_view key) const;
  const GgufValue* find(std::string_view key) const;
  // Typed getters: throw Error("<file>: key K: expected <type>, found <type>") on a type mismatch,
  // and (the non-optional forms) Error("<file>: missing key K") when absent.
  int64_t get_int(std::string_view key) const;  // any integer type or bool
  std::optional<int64_t> get_int_opt(std::string_view key) const;
  double get_float(std::string_view key) const;  // F32/F64 (integers accepted too)
  std::optional<double> get_float_opt(std::string_view key) const;
  bool get_bool_or(std::string_view key, bool fallback) const;
  std::string_view get_string(std::string_view key) const;
  std::optional<std::string_view> get_string_opt(std::string_view key) const;
  const std::vector<std::string_view>& get_string_array(std::string_view key) const;
  std::vector<float> get_f32_array(std::string_view key) const;    // F32 array
  std::vector<int32_t> get_i32_array(std::string_view key) const;  // any integer array, range-checked
  std::vector<std::string> keys() const;

  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find_tensor(std::string_view name) const;

 private:
  GgufFile() = default;
  void parse(const uint8_t* data, size_t size);

  std::string name_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  size_t file_size_ = 0;
  size_t data_offset_ = 0;
  std::unique_ptr<MappedFile> mapping_;  // null for from_memory() and from_bytes()
  std::vector<uint8_t> owned_bytes_;     // [file size] the whole file, for from_bytes() only
  std::unordered_map<std::string, GgufValue> kv_;
  std::vector<std::string> key_order_;
  std::vector<GgufTensor> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace microspec
