#include "gguf/gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "util/error.h"
#include "util/mapped_file.h"

namespace microspec {

namespace {

// llama.cpp refuses tensor names of GGML_MAX_NAME (64) bytes or more; we follow it so that any file we
// accept also loads there.
constexpr size_t kMaxTensorNameBytes = 63;
// Real keys are dotted identifiers of a few dozen bytes; anything longer is corruption.
constexpr size_t kMaxKeyBytes = 256;
constexpr uint32_t kMaxDims = 4;
constexpr size_t kDefaultAlignment = 32;
constexpr uint64_t kMaxReserve = 4096;

// Smallest possible encodings, used to bound counts by the bytes left before anything is allocated.
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;  // key length, 1-byte key, type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes =
    8 + 1 + 4 + 8 + 4 + 8;  // name length, name, n_dims, ne[0], type, offset

bool is_known_type(int32_t raw) {
  return raw >= 0 && raw <= static_cast<int32_t>(GgufType::F64);
}

bool is_integer(GgufType t) {
  switch (t) {
    case GgufType::U8:
    case GgufType::I8:
    case GgufType::U16:
    case GgufType::I16:
    case GgufType::U32:
    case GgufType::I32:
    case GgufType::U64:
    case GgufType::I64:
      return true;
    default:
      return false;
  }
}

std::string describe(const GgufValue& v) {
  if (v.type == GgufType::ARRAY) return std::string("array of ") + gguf_type_name(v.elem_type);
  return gguf_type_name(v.type);
}

std::string shape_string(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ne[i]);
  }
  return s + "]";
}

// Printable rendering of a short byte string for error messages (the magic, a key prefix).
std::string printable(const uint8_t* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7f) {
      s += static_cast<char>(p[i]);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", p[i]);
      s += buf;
    }
  }
  return s;
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Bounds-checked little-endian cursor over the file. Every read checks the bytes left first, so a
// corrupt length or count is reported instead of being followed.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& file) : data_(data), size_(size), file_(file) {}

  [[noreturn]] void fail(const std::string& what) const { throw Error(file_ + ": " + what); }

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  const uint8_t* here() const { return data_ + pos_; }
  const uint8_t* at(size_t offset) const { return data_ + offset; }  // caller checks the bytes there

  void need(uint64_t n, const std::string& what) const {
    if (n > remaining())
      fail("file is truncated: " + what + " at offset " + std::to_string(pos_) + " needs " +
           std::to_string(n) + " bytes, only " + std::to_string(remaining()) + " left");
  }
  void skip(size_t n) { pos_ += n; }  // caller has called need()

  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v = load<T>(data_ + pos_);
    pos_ += sizeof(T);
    return v;
  }

  std::string_view read_string(const std::string& what) {
    const size_t at = pos_;
    const uint64_t len = read<uint64_t>(what + " length");
    if (len > remaining())
      fail(what + ": string length " + std::to_string(len) + " at offset " + std::to_string(at) +
           " exceeds the " + std::to_string(remaining()) + " bytes left in the file");
    std::string_view s(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& file_;
};

std::string quoted(std::string_view s) {
  // Built by appends: GCC 12 warns falsely (-Wrestrict) on "'" + std::string(s).
  std::string out;
  out.reserve(s.size() + 2);
  out += '\'';
  out += s;
  out += '\'';
  return out;
}

}  // namespace

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::U8:
      return "u8";
    case GgufType::I8:
      return "i8";
    case GgufType::U16:
      return "u16";
    case GgufType::I16:
      return "i16";
    case GgufType::U32:
      return "u32";
    case GgufType::I32:
      return "i32";
    case GgufType::F32:
      return "f32";
    case GgufType::BOOL:
      return "bool";
    case GgufType::STRING:
      return "string";
    case GgufType::ARRAY:
      return "array";
    case GgufType::U64:
      return "u64";
    case GgufType::I64:
      return "i64";
    case GgufType::F64:
      return "f64";
  }
  return "unknown";
}

int64_t GgufTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // overflow excluded at parse time
  return n;
}

int64_t GgufTensor::rows() const {
  int64_t n = 1;
  for (size_t i = 1; i < ne.size(); ++i) n *= ne[i];
  return n;
}

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->name_ = path;
  f->mapping_ = std::make_unique<MappedFile>(path, "GGUF file");
  f->parse(f->mapping_->data(), f->mapping_->size());
  return f;
}

std::unique_ptr<GgufFile> GgufFile::from_memory(const uint8_t* data, size_t size, std::string name) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->name_ = std::move(name);
  f->parse(data, size);
  return f;
}

std::unique_ptr<GgufFile> GgufFile::from_bytes(std::vector<uint8_t> bytes, std::string name) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->name_ = std::move(name);
  f->owned_bytes_ = std::move(bytes);
  f->parse(f->owned_bytes_.data(), f->owned_bytes_.size());
  return f;
}

GgufFile::~GgufFile() = default;

namespace {

// --- GgufFile::parse's parts, in file order: each reads through the cursor and checks as it goes ---

struct HeaderCounts {
  uint32_t version = 0;
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
};

// The magic, the version and the two counts, each count bounded by the bytes left.
HeaderCounts read_header(Cursor& c, const uint8_t* data, size_t size) {
  if (size < 4) c.fail("file is too small to be GGUF (" + std::to_string(size) + " bytes)");
  if (std::memcmp(data, "GGUF", 4) != 0)
    c.fail("bad magic '" + printable(data, 4) + "' (expected 'GGUF'): not a GGUF file");
  c.skip(4);
  HeaderCounts h;
  h.version = c.read<uint32_t>("version");
  if (h.version != 2 && h.version != 3) {
    if (h.version == 1) c.fail("GGUF version 1 is not supported (only versions 2 and 3)");
    const uint32_t swapped = __builtin_bswap32(h.version);
    if (swapped == 2 || swapped == 3)
      c.fail("version field " + std::to_string(h.version) +
             " looks byte-swapped: big-endian GGUF is not supported");
    c.fail("unsupported GGUF version " + std::to_string(h.version) + " (only versions 2 and 3)");
  }
  h.n_tensors = c.read<uint64_t>("tensor count");
  h.n_kv = c.read<uint64_t>("metadata key count");
  // Bound both counts by the bytes left before anything is sized from them.
  if (h.n_tensors > c.remaining() / kMinTensorInfoBytes)
    c.fail("tensor count " + std::to_string(h.n_tensors) + " cannot fit in the " +
           std::to_string(c.remaining()) + " bytes left in the file");
  if (h.n_kv > c.remaining() / kMinKvBytes)
    c.fail("metadata key count " + std::to_string(h.n_kv) + " cannot fit in the " +
           std::to_string(c.remaining()) + " bytes left in the file");
  if (h.n_tensors * kMinTensorInfoBytes + h.n_kv * kMinKvBytes > c.remaining())
    c.fail("tensor count " + std::to_string(h.n_tensors) + " and metadata key count " +
           std::to_string(h.n_kv) + " cannot fit in the " + std::to_string(c.remaining()) +
           " bytes left in the file");
  return h;
}

// One scalar of type t (not ARRAY) into out: integers widened into i (unsigned ones mirrored into
// u), floats into f, a string appended to strings. ctx names the key in errors.
void read_scalar(Cursor& c, GgufType t, const std::string& ctx, GgufValue& out) {
  const std::string what = ctx + " value";
  switch (t) {
    case GgufType::U8:
      out.i = c.read<uint8_t>(what);
      out.u = static_cast<uint64_t>(out.i);
      break;
    case GgufType::I8:
      out.i = c.read<int8_t>(what);
      break;
    case GgufType::U16:
      out.i = c.read<uint16_t>(what);
      out.u = static_cast<uint64_t>(out.i);
      break;
    case GgufType::I16:
      out.i = c.read<int16_t>(what);
      break;
    case GgufType::U32:
      out.i = c.read<uint32_t>(what);
      out.u = static_cast<uint64_t>(out.i);
      break;
    case GgufType::I32:
      out.i = c.read<int32_t>(what);
      break;
    case GgufType::U64:
      out.u = c.read<uint64_t>(what);
      if (out.u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        out.i = static_cast<int64_t>(out.u);
      break;
    case GgufType::I64:
      out.i = c.read<int64_t>(what);
      break;
    case GgufType::F32:
      out.f = c.read<float>(what);
      break;
    case GgufType::F64:
      out.f = c.read<double>(what);
      break;
    case GgufType::BOOL: {
      const uint8_t b = c.read<uint8_t>(what);
      if (b > 1) c.fail(ctx + ": bool value " + std::to_string(b) + " is neither 0 nor 1");
      out.i = b;
      out.u = b;
      break;
    }
    case GgufType::STRING:
      out.strings.push_back(c.read_string(ctx));
      break;
    case GgufType::ARRAY:
      break;  // read_array's
  }
}

// v.count strings into v.strings: every length is checked first, so the views are sized once.
void read_string_array(Cursor& c, const std::string& ctx, GgufValue& v) {
  size_t p = c.pos();
  const size_t end = p + c.remaining();
  for (uint64_t j = 0; j < v.count; ++j) {
    if (end - p < 8)
      c.fail("file is truncated: " + ctx + " string #" + std::to_string(j) + " length at offset " +
             std::to_string(p) + " needs 8 bytes, only " + std::to_string(end - p) + " left");
    const uint64_t len = load<uint64_t>(c.at(p));
    p += 8;
    if (len > end - p)
      c.fail(ctx + ": string #" + std::to_string(j) + " length " + std::to_string(len) + " at offset " +
             std::to_string(p - 8) + " exceeds the " + std::to_string(end - p) + " bytes left in the file");
    p += len;
  }
  v.strings.reserve(v.count);
  for (uint64_t j = 0; j < v.count; ++j) {
    const uint64_t len = c.read<uint64_t>(ctx);
    v.strings.emplace_back(reinterpret_cast<const char*>(c.here()), len);
    c.skip(len);
  }
}

// An array's element type, count and elements into v: fixed-size elements as a view of the file
// (bools checked), strings as views.
void read_array(Cursor& c, const std::string& ctx, GgufValue& v) {
  const int32_t raw_elem = c.read<int32_t>(ctx + " array element type");
  if (raw_elem == static_cast<int32_t>(GgufType::ARRAY)) c.fail(ctx + ": arrays of arrays are not supported");
  if (!is_known_type(raw_elem)) c.fail(ctx + ": unknown array element type " + std::to_string(raw_elem));
  v.elem_type = static_cast<GgufType>(raw_elem);
  const size_t count_at = c.pos();
  v.count = c.read<uint64_t>(ctx + " array count");
  const size_t elem = gguf_value_size(v.elem_type);
  // A string takes at least its 8-byte length; bound the count before walking.
  const size_t min_elem = elem ? elem : 8;
  if (v.count > c.remaining() / min_elem)
    c.fail(ctx + ": array count " + std::to_string(v.count) + " at offset " + std::to_string(count_at) +
           " of " + gguf_type_name(v.elem_type) + " cannot fit in the " + std::to_string(c.remaining()) +
           " bytes left in the file");
  if (!elem) return read_string_array(c, ctx, v);
  v.array_data = c.here();
  if (v.elem_type == GgufType::BOOL)
    for (uint64_t j = 0; j < v.count; ++j)
      if (v.array_data[j] > 1)
        c.fail(ctx + ": bool element " + std::to_string(j) + " has value " + std::to_string(v.array_data[j]) +
               ", neither 0 nor 1");
  c.skip(v.count * elem);
}

// n_kv key-value pairs into kv, their keys in file order into key_order.
void read_metadata(Cursor& c, uint64_t n_kv, std::unordered_map<std::string, GgufValue>& kv,
                   std::vector<std::string>& key_order) {
  // Counts are only bounded by the file size here; cap what is reserved up front so a corrupt count
  // in a large file cannot reserve much more than a real model needs.
  kv.reserve(std::min<uint64_t>(n_kv, kMaxReserve));
  key_order.reserve(std::min<uint64_t>(n_kv, kMaxReserve));
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string idx = "metadata key #" + std::to_string(i);
    const std::string_view key = c.read_string(idx);
    if (key.empty()) c.fail(idx + " is empty");
    if (key.size() > kMaxKeyBytes)
      c.fail(idx + " is " + std::to_string(key.size()) + " bytes long (limit " +
             std::to_string(kMaxKeyBytes) + "): '" +
             printable(reinterpret_cast<const uint8_t*>(key.data()), 40) + "...'");
    const std::string ctx = "key " + quoted(key);
    const int32_t raw_type = c.read<int32_t>(ctx + " value type");
    if (!is_known_type(raw_type)) c.fail(ctx + ": unknown value type " + std::to_string(raw_type));
    GgufValue v;
    v.type = static_cast<GgufType>(raw_type);
    if (v.type != GgufType::ARRAY)
      read_scalar(c, v.type, ctx, v);
    else
      read_array(c, ctx, v);
    auto [it, inserted] = kv.try_emplace(std::string(key), std::move(v));
    if (!inserted) c.fail("duplicate key " + quoted(key));
    key_order.emplace_back(key);
  }
}

// general.alignment (a u32 power of two) when the file sets it, else the default.
size_t read_alignment(const Cursor& c, const std::unordered_map<std::string, GgufValue>& kv) {
  const auto found = kv.find("general.alignment");
  if (found == kv.end()) return kDefaultAlignment;
  const GgufValue& a = found->second;
  if (a.type != GgufType::U32) c.fail("general.alignment must be u32, found " + describe(a));
  const uint64_t av = a.u;
  if (av == 0 || (av & (av - 1)) != 0)
    c.fail("general.alignment " + std::to_string(av) + " is not a nonzero power of two");
  return av;
}

// t's shape: n_dims non-negative dimensions whose element count fits int64.
void read_shape(Cursor& c, const std::string& ctx, GgufTensor& t) {
  const uint32_t n_dims = c.read<uint32_t>(ctx + " n_dims");
  if (n_dims < 1 || n_dims > kMaxDims)
    c.fail(ctx + ": n_dims " + std::to_string(n_dims) + " is out of range (1.." + std::to_string(kMaxDims) +
           ")");
  t.ne.resize(n_dims);
  for (uint32_t d = 0; d < n_dims; ++d) {
    t.ne[d] = c.read<int64_t>(ctx + " ne[" + std::to_string(d) + "]");
    if (t.ne[d] < 0)
      c.fail(ctx + ": dimension ne[" + std::to_string(d) + "] is negative (" + std::to_string(t.ne[d]) + ")");
  }
  // Zero dimensions are skipped so that rows() and n_elements() cannot overflow either
  // (ne = [0, 2^40, 2^40] has no elements but 2^80 rows).
  int64_t n_elem = 1;
  for (int64_t d : t.ne)
    if (__builtin_mul_overflow(n_elem, std::max<int64_t>(d, 1), &n_elem))
      c.fail(ctx + ": element count of shape " + shape_string(t.ne) + " overflows int64");
}

// t's type (known and supported, whole blocks per row) and its data size.
void read_type(Cursor& c, const std::string& ctx, GgufTensor& t) {
  const uint32_t raw_type = c.read<uint32_t>(ctx + " type");
  const TypeTraits* tt = type_traits(raw_type);
  if (!tt) c.fail(ctx + ": unknown tensor type id " + std::to_string(raw_type));
  if (!tt->supported)
    c.fail(ctx + ": tensor type " + std::string(tt->name) + " is not supported by microspec");
  t.type = static_cast<GgmlType>(raw_type);
  if (t.ne[0] % tt->block_elems != 0)
    c.fail(ctx + ": row length ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " + tt->name +
           " block size " + std::to_string(tt->block_elems));
  uint64_t n_bytes = 0;
  bool overflow = __builtin_mul_overflow(static_cast<uint64_t>(t.ne[0] / tt->block_elems),
                                         static_cast<uint64_t>(tt->block_bytes), &n_bytes);
  for (size_t d = 1; d < t.ne.size(); ++d)
    overflow |= __builtin_mul_overflow(n_bytes, static_cast<uint64_t>(t.ne[d]), &n_bytes);
  if (overflow) c.fail(ctx + ": data size of shape " + shape_string(t.ne) + " overflows");
  t.n_bytes = static_cast<size_t>(n_bytes);
}

// n_tensors tensor infos (name, shape, type, aligned offset) into tensors and tensor_index.
void read_tensor_infos(Cursor& c, uint64_t n_tensors, size_t alignment, std::vector<GgufTensor>& tensors,
                       std::unordered_map<std::string, size_t>& tensor_index) {
  tensors.reserve(std::min<uint64_t>(n_tensors, kMaxReserve));
  tensor_index.reserve(std::min<uint64_t>(n_tensors, kMaxReserve));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const std::string idx = "tensor #" + std::to_string(i);
    const std::string_view name = c.read_string(idx + " name");
    if (name.empty()) c.fail(idx + " has an empty name");
    if (name.size() > kMaxTensorNameBytes)
      c.fail(idx + " name is " + std::to_string(name.size()) + " bytes long (limit " +
             std::to_string(kMaxTensorNameBytes) + "): '" +
             printable(reinterpret_cast<const uint8_t*>(name.data()), 40) + "...'");
    const std::string ctx = "tensor " + quoted(name);
    GgufTensor t;
    t.name = std::string(name);
    read_shape(c, ctx, t);
    read_type(c, ctx, t);
    t.offset = c.read<uint64_t>(ctx + " offset");
    if (t.offset % alignment != 0)
      c.fail(ctx + ": data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(alignment));
    auto [it, inserted] = tensor_index.try_emplace(t.name, tensors.size());
    if (!inserted) c.fail("duplicate tensor name " + quoted(name));
    tensors.push_back(std::move(t));
  }
}

// The data section starts at the next multiple of the alignment after the tensor infos: checks
// every tensor's bytes lie inside the file, points its data there, and returns the section's offset.
size_t place_tensor_data(const Cursor& c, const uint8_t* data, size_t size, size_t alignment,
                         std::vector<GgufTensor>& tensors) {
  const size_t header_end = c.pos();
  const size_t data_start = (header_end + alignment - 1) / alignment * alignment;  // alignment <= 2^32
  if (!tensors.empty() && data_start > size)
    c.fail("data section would start at offset " + std::to_string(data_start) +
           ", past the end of the file (size " + std::to_string(size) + ")");
  const uint64_t data_size = tensors.empty() ? 0 : size - data_start;
  for (GgufTensor& t : tensors) {
    if (t.offset > data_size || t.n_bytes > data_size - t.offset) {
      const bool abs_fits = t.offset <= std::numeric_limits<uint64_t>::max() - data_start;
      const std::string where = abs_fits ? "offset " + std::to_string(data_start + t.offset)
                                         : "data-section offset " + std::to_string(t.offset);
      c.fail("tensor " + quoted(t.name) + " data [" + where + ", " + std::to_string(t.n_bytes) +
             " bytes] extends past end of file (size " + std::to_string(size) + ")");
    }
    t.data = data + data_start + t.offset;
  }
  return data_start;
}

// With tensors sorted by offset, each must end before the next starts. Empty tensors occupy
// nothing and cannot overlap.
void check_no_overlap(const Cursor& c, const std::vector<GgufTensor>& tensors) {
  std::vector<const GgufTensor*> by_offset;
  by_offset.reserve(tensors.size());
  for (const GgufTensor& t : tensors)
    if (t.n_bytes) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensor& a = *by_offset[i - 1];
    const GgufTensor& b = *by_offset[i];
    if (a.offset + a.n_bytes > b.offset)
      c.fail("tensors " + quoted(a.name) + " [data offset " + std::to_string(a.offset) + ", " +
             std::to_string(a.n_bytes) + " bytes] and " + quoted(b.name) + " [data offset " +
             std::to_string(b.offset) + ", " + std::to_string(b.n_bytes) + " bytes] overlap");
  }
}

}  // namespace

void GgufFile::parse(const uint8_t* data, size_t size) {
  Cursor c(data, size, name_);
  file_size_ = size;
  const HeaderCounts header = read_header(c, data, size);
  version_ = header.version;
  read_metadata(c, header.n_kv, kv_, key_order_);
  alignment_ = read_alignment(c, kv_);
  read_tensor_infos(c, header.n_tensors, alignment_, tensors_, tensor_index_);
  data_offset_ = place_tensor_data(c, data, size, alignment_, tensors_);
  check_no_overlap(c, tensors_);
}

bool GgufFile::has(std::string_view key) const {
  return find(key) != nullptr;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(std::string(key));
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {

[[noreturn]] void mismatch(const std::string& file, std::string_view key, const char* expected,
                           const GgufValue& v) {
  throw Error(file + ": key " + quoted(key) + ": expected " + expected + ", found " + describe(v));
}

}  // namespace

std::optional<int64_t> GgufFile::get_int_opt(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (!is_integer(v->type) && v->type != GgufType::BOOL) mismatch(name_, key, "an integer", *v);
  if (v->type == GgufType::U64 && v->u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    throw Error(name_ + ": key " + quoted(key) + ": value " + std::to_string(v->u) +
                " does not fit in int64");
  return v->i;
}

int64_t GgufFile::get_int(std::string_view key) const {
  auto v = get_int_opt(key);
  if (!v) throw Error(name_ + ": missing key " + quoted(key));
  return *v;
}

std::optional<double> GgufFile::get_float_opt(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type == GgufType::F32 || v->type == GgufType::F64) return v->f;
  if (v->type == GgufType::U64) return static_cast<double>(v->u);
  if (is_integer(v->type)) return static_cast<double>(v->i);
  mismatch(name_, key, "a number", *v);
}

double GgufFile::get_float(std::string_view key) const {
  auto v = get_float_opt(key);
  if (!v) throw Error(name_ + ": missing key " + quoted(key));
  return *v;
}

bool GgufFile::get_bool_or(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  if (!v) return fallback;
  if (v->type != GgufType::BOOL) mismatch(name_, key, "bool", *v);
  return v->i != 0;
}

std::optional<std::string_view> GgufFile::get_string_opt(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufType::STRING) mismatch(name_, key, "string", *v);
  return v->strings[0];
}

std::string_view GgufFile::get_string(std::string_view key) const {
  auto v = get_string_opt(key);
  if (!v) throw Error(name_ + ": missing key " + quoted(key));
  return *v;
}

const std::vector<std::string_view>& GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) throw Error(name_ + ": missing key " + quoted(key));
  if (v->type != GgufType::ARRAY || v->elem_type != GgufType::STRING)
    mismatch(name_, key, "array of string", *v);
  return v->strings;
}

std::vector<float> GgufFile::get_f32_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) throw Error(name_ + ": missing key " + quoted(key));
  if (v->type != GgufType::ARRAY || v->elem_type != GgufType::F32) mismatch(name_, key, "array of f32", *v);
  std::vector<float> out(v->count);
  if (v->count) std::memcpy(out.data(), v->array_data, v->count * sizeof(float));
  return out;
}

std::vector<int32_t> GgufFile::get_i32_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) throw Error(name_ + ": missing key " + quoted(key));
  if (v->type != GgufType::ARRAY || !is_integer(v->elem_type)) mismatch(name_, key, "array of integers", *v);
  std::vector<int32_t> out(v->count);
  const uint8_t* p = v->array_data;
  auto out_of_range = [&](uint64_t j, const std::string& value) {
    throw Error(name_ + ": key " + quoted(key) + ": element " + std::to_string(j) + " value " + value +
                " does not fit in i32");
  };
  for (uint64_t j = 0; j < v->count; ++j) {
    int64_t x = 0;
    switch (v->elem_type) {
      case GgufType::U8:
        x = load<uint8_t>(p + j);
        break;
      case GgufType::I8:
        x = load<int8_t>(p + j);
        break;
      case GgufType::U16:
        x = load<uint16_t>(p + 2 * j);
        break;
      case GgufType::I16:
        x = load<int16_t>(p + 2 * j);
        break;
      case GgufType::U32:
        x = load<uint32_t>(p + 4 * j);
        break;
      case GgufType::I32:
        x = load<int32_t>(p + 4 * j);
        break;
      case GgufType::U64: {
        const uint64_t u = load<uint64_t>(p + 8 * j);
        if (u > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
          out_of_range(j, std::to_string(u));
        x = static_cast<int64_t>(u);
        break;
      }
      case GgufType::I64:
        x = load<int64_t>(p + 8 * j);
        break;
      default:
        break;
    }
    if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max())
      out_of_range(j, std::to_string(x));
    out[j] = static_cast<int32_t>(x);
  }
  return out;
}

std::vector<std::string> GgufFile::keys() const {
  return key_order_;
}

const GgufTensor* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

size_t gguf_value_size(GgufType t) {
  switch (t) {
    case GgufType::U8:
    case GgufType::I8:
    case GgufType::BOOL:
      return 1;
    case GgufType::U16:
    case GgufType::I16:
      return 2;
    case GgufType::U32:
    case GgufType::I32:
    case GgufType::F32:
      return 4;
    case GgufType::U64:
    case GgufType::I64:
    case GgufType::F64:
      return 8;
    case GgufType::STRING:
    case GgufType::ARRAY:
      return 0;
  }
  return 0;
}

}  // namespace microspec
