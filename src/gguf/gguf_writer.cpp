#include "gguf/gguf_writer.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "util/error.h"

namespace microspec {

namespace {

constexpr size_t kMaxTensorNameBytes = 63;  // same limit as the reader (and llama.cpp)

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86-64 is little-endian, as GGUF is
  out.insert(out.end(), b, b + sizeof(T));
}

void put_string(std::vector<uint8_t>& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

}  // namespace

GgufWriter::GgufWriter(uint32_t alignment) : alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw Error("GgufWriter: alignment " + std::to_string(alignment) + " is not a nonzero power of two");
  if (alignment != 32) add_u32("general.alignment", alignment);
}

void GgufWriter::begin_kv(std::string_view key, GgufType type) {
  if (key.empty()) throw Error("GgufWriter: empty key");
  if (std::find(keys_.begin(), keys_.end(), key) != keys_.end())
    throw Error("GgufWriter: duplicate key '" + std::string(key) + "'");
  keys_.emplace_back(key);
  put_string(kv_bytes_, key);
  put<int32_t>(kv_bytes_, static_cast<int32_t>(type));
  ++n_kv_;
}

void GgufWriter::add_u8(std::string_view key, uint8_t v) {
  begin_kv(key, GgufType::U8);
  put(kv_bytes_, v);
}
void GgufWriter::add_i8(std::string_view key, int8_t v) {
  begin_kv(key, GgufType::I8);
  put(kv_bytes_, v);
}
void GgufWriter::add_u16(std::string_view key, uint16_t v) {
  begin_kv(key, GgufType::U16);
  put(kv_bytes_, v);
}
void GgufWriter::add_i16(std::string_view key, int16_t v) {
  begin_kv(key, GgufType::I16);
  put(kv_bytes_, v);
}
void GgufWriter::add_u32(std::string_view key, uint32_t v) {
  begin_kv(key, GgufType::U32);
  put(kv_bytes_, v);
}
void GgufWriter::add_i32(std::string_view key, int32_t v) {
  begin_kv(key, GgufType::I32);
  put(kv_bytes_, v);
}
void GgufWriter::add_u64(std::string_view key, uint64_t v) {
  begin_kv(key, GgufType::U64);
  put(kv_bytes_, v);
}
void GgufWriter::add_i64(std::string_view key, int64_t v) {
  begin_kv(key, GgufType::I64);
  put(kv_bytes_, v);
}
void GgufWriter::add_f32(std::string_view key, float v) {
  begin_kv(key, GgufType::F32);
  put(kv_bytes_, v);
}
void GgufWriter::add_f64(std::string_view key, double v) {
  begin_kv(key, GgufType::F64);
  put(kv_bytes_, v);
}
void GgufWriter::add_bool(std::string_view key, bool v) {
  begin_kv(key, GgufType::BOOL);
  put<uint8_t>(kv_bytes_, v ? 1 : 0);
}
void GgufWriter::add_string(std::string_view key, std::string_view v) {
  begin_kv(key, GgufType::STRING);
  put_string(kv_bytes_, v);
}

void GgufWriter::add_string_array(std::string_view key, std::span<const std::string> v) {
  begin_kv(key, GgufType::ARRAY);
  put<int32_t>(kv_bytes_, static_cast<int32_t>(GgufType::STRING));
  put<uint64_t>(kv_bytes_, v.size());
  for (const std::string& s : v) put_string(kv_bytes_, s);
}

void GgufWriter::add_string_array(std::string_view key, std::span<const std::string_view> v) {
  begin_kv(key, GgufType::ARRAY);
  put<int32_t>(kv_bytes_, static_cast<int32_t>(GgufType::STRING));
  put<uint64_t>(kv_bytes_, v.size());
  for (std::string_view s : v) put_string(kv_bytes_, s);
}

void GgufWriter::add_f32_array(std::string_view key, std::span<const float> v) {
  add_array(key, GgufType::F32, v.data(), v.size());
}

void GgufWriter::add_i32_array(std::string_view key, std::span<const int32_t> v) {
  add_array(key, GgufType::I32, v.data(), v.size());
}

void GgufWriter::add_array(std::string_view key, GgufType elem_type, const void* data, uint64_t count) {
  const size_t es = gguf_value_size(elem_type);
  if (es == 0)
    throw Error(std::string("GgufWriter: add_array needs a fixed-size element type, not ") +
                gguf_type_name(elem_type));
  begin_kv(key, GgufType::ARRAY);
  put<int32_t>(kv_bytes_, static_cast<int32_t>(elem_type));
  put<uint64_t>(kv_bytes_, count);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  kv_bytes_.insert(kv_bytes_.end(), p, p + count * es);
}

void GgufWriter::add_tensor(std::string_view name, GgmlType type, std::vector<int64_t> ne,
                            std::span<const uint8_t> data) {
  const std::string n(name);
  if (n.empty() || n.size() > kMaxTensorNameBytes)
    throw Error("GgufWriter: tensor name '" + n + "' must be 1.." + std::to_string(kMaxTensorNameBytes) +
                " bytes");
  for (const Tensor& t : tensors_)
    if (t.name == n) throw Error("GgufWriter: duplicate tensor name '" + n + "'");
  if (ne.empty() || ne.size() > 4) throw Error("GgufWriter: tensor '" + n + "' must have 1..4 dimensions");
  const uint32_t raw = static_cast<uint32_t>(type);
  const TypeTraits* tt = type_traits(raw);
  if (!tt) throw Error("GgufWriter: tensor '" + n + "': unknown type id " + std::to_string(raw));
  for (int64_t d : ne)
    if (d < 0) throw Error("GgufWriter: tensor '" + n + "': negative dimension");
  if (ne[0] % tt->block_elems != 0)
    throw Error("GgufWriter: tensor '" + n + "': ne[0] " + std::to_string(ne[0]) +
                " is not a multiple of the " + tt->name + " block size");
  uint64_t bytes = 0;
  bool overflow = __builtin_mul_overflow(static_cast<uint64_t>(ne[0] / tt->block_elems),
                                         static_cast<uint64_t>(tt->block_bytes), &bytes);
  for (size_t i = 1; i < ne.size(); ++i)
    overflow |= __builtin_mul_overflow(bytes, static_cast<uint64_t>(ne[i]), &bytes);
  if (overflow) throw Error("GgufWriter: tensor '" + n + "': size overflows");
  if (data.size() != bytes)
    throw Error("GgufWriter: tensor '" + n + "' needs " + std::to_string(bytes) + " bytes of " + tt->name +
                " data, got " + std::to_string(data.size()));
  Tensor t{n, raw, std::move(ne), std::vector<uint8_t>(data.begin(), data.end()), data_size_};
  data_size_ = align_up(data_size_ + bytes, alignment_);
  tensors_.push_back(std::move(t));
}

std::vector<uint8_t> GgufWriter::header() const {
  std::vector<uint8_t> out;
  out.reserve(24 + kv_bytes_.size() + tensors_.size() * 96);  // also keeps GCC 12 from a false warning
  for (char ch : {'G', 'G', 'U', 'F'}) out.push_back(static_cast<uint8_t>(ch));
  put<uint32_t>(out, 3);
  put<uint64_t>(out, tensors_.size());
  put<uint64_t>(out, n_kv_);
  out.insert(out.end(), kv_bytes_.begin(), kv_bytes_.end());
  for (const Tensor& t : tensors_) {
    put_string(out, t.name);
    put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put<int64_t>(out, d);
    put<uint32_t>(out, t.type);
    put<uint64_t>(out, t.offset);
  }
  out.resize(align_up(out.size(), alignment_), 0);
  return out;
}

std::vector<uint8_t> GgufWriter::to_bytes() const {
  GgufWriter copy = *this;
  return std::move(copy).take_bytes();
}

std::vector<uint8_t> GgufWriter::take_bytes() && {
  std::vector<uint8_t> out = header();
  const size_t data_start = out.size();
  // Reserved, not resized: pages are touched only as tensors are appended (in offset order), each
  // tensor's own copy freed right after.
  out.reserve(data_start + data_size_);
  for (Tensor& t : tensors_) {
    out.resize(data_start + t.offset, 0);
    out.insert(out.end(), t.data.begin(), t.data.end());
    std::vector<uint8_t>().swap(t.data);
  }
  out.resize(data_start + data_size_, 0);
  tensors_.clear();
  return out;
}

void GgufWriter::write_file(const std::string& path) const {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw Error(path + ": cannot create: " + std::strerror(errno));
  const std::vector<uint8_t> head = header();
  bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size();
  static const uint8_t kZeros[64] = {};
  auto write_zeros = [&](uint64_t n) {
    while (ok && n > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, sizeof kZeros));
      ok = std::fwrite(kZeros, 1, chunk, f) == chunk;
      n -= chunk;
    }
  };
  uint64_t pos = 0;  // within the data section
  for (const Tensor& t : tensors_) {
    write_zeros(t.offset - pos);
    if (ok && !t.data.empty()) ok = std::fwrite(t.data.data(), 1, t.data.size(), f) == t.data.size();
    pos = t.offset + t.data.size();
  }
  write_zeros(data_size_ - pos);
  const int err = errno;
  if (std::fclose(f) != 0 || !ok) throw Error(path + ": write failed: " + std::strerror(ok ? errno : err));
}

}  // namespace microspec
