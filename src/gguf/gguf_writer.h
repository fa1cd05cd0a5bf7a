#pragma once
// Minimal GGUF v3 writer: metadata of every value type and tensors given as raw bytes in their
// stored type. Used by tests (tiny random models, corrupt-file cases) and the fuzzer's seed corpus.
// It refuses what the reader would refuse (empty or duplicate keys and names, bad shapes, data of
// the wrong size), so anything it writes parses back; tests that need a corrupt file patch the bytes.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/gguf.h"
#include "kernels/types.h"

namespace microspec {

class GgufWriter {
 public:
  // `alignment` (a power of two) is written as general.alignment when it differs from the default 32.
  explicit GgufWriter(uint32_t alignment = 32);

  void add_u8(std::string_view key, uint8_t v);
  void add_i8(std::string_view key, int8_t v);
  void add_u16(std::string_view key, uint16_t v);
  void add_i16(std::string_view key, int16_t v);
  void add_u32(std::string_view key, uint32_t v);
  void add_i32(std::string_view key, int32_t v);
  void add_u64(std::string_view key, uint64_t v);
  void add_i64(std::string_view key, int64_t v);
  void add_f32(std::string_view key, float v);
  void add_f64(std::string_view key, double v);
  void add_bool(std::string_view key, bool v);
  void add_string(std::string_view key, std::string_view v);

  void add_string_array(std::string_view key, std::span<const std::string> v);
  void add_string_array(std::string_view key, std::span<const std::string_view> v);
  void add_f32_array(std::string_view key, std::span<const float> v);
  void add_i32_array(std::string_view key, std::span<const int32_t> v);
  // Any fixed-size element type: `data` holds `count` little-endian elements of `elem_type`.
  void add_array(std::string_view key, GgufType elem_type, const void* data, uint64_t count);

  // `ne` in ggml order (ne[0] = row length); `data` must hold exactly the bytes the type and shape
  // need. Any type ggml defines is accepted (also ones microspec cannot run), so tests can write them.
  void add_tensor(std::string_view name, GgmlType type, std::vector<int64_t> ne,
                  std::span<const uint8_t> data);

  std::vector<uint8_t> to_bytes() const;
  // The same bytes, freeing each tensor's copy as it is placed: peak memory is the file plus one
  // tensor instead of twice the file (a whole model built in memory). Leaves the writer unusable.
  std::vector<uint8_t> take_bytes() &&;
  void write_file(const std::string& path) const;  // throws Error on I/O failure

  size_t n_tensors() const { return tensors_.size(); }
  size_t n_kv() const { return n_kv_; }

 private:
  struct Tensor {
    std::string name;
    uint32_t type;
    std::vector<int64_t> ne;    // ggml order
    std::vector<uint8_t> data;  // [n_bytes] stored bytes
    uint64_t offset;            // within the data section, aligned
  };

  void begin_kv(std::string_view key, GgufType type);
  std::vector<uint8_t> header() const;

  uint32_t alignment_;
  std::vector<uint8_t> kv_bytes_;  // [encoded key-value pairs] in insertion order
  size_t n_kv_ = 0;
  std::vector<std::string> keys_;
  std::vector<Tensor> tensors_;
  uint64_t data_size_ = 0;  // end of the last tensor's padded data
};

}  // namespace microspec
