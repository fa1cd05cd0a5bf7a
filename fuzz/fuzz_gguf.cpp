// libFuzzer target for the GGUF reader: parses arbitrary bytes, then reads every value and tensor
// through the public API and checks the invariants the rest of microspec relies on (tensor data
// inside the buffer, sizes consistent with type and shape, views inside the buffer). Only
// microspec::Error is an acceptable failure; anything else (crash, sanitizer report, other
// exception, broken invariant) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "gguf/gguf.h"
#include "kernels/types.h"
#include "util/error.h"

namespace {

using microspec::Error;
using microspec::GgufFile;
using microspec::GgufTensor;
using microspec::GgufType;
using microspec::GgufValue;

volatile uint64_t g_sink;  // keeps the reads below from being optimised away

void require(bool ok) {
  if (!ok) __builtin_trap();
}

bool inside(const void* p, size_t n, const uint8_t* data, size_t size) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return b >= data && n <= size && b - data <= static_cast<ptrdiff_t>(size - n);
}

template <typename F>
void tolerate_error(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

void touch_value(const GgufFile& f, const std::string& key, const GgufValue& v, const uint8_t* data,
                 size_t size) {
  uint64_t acc = 0;
  // Every getter either succeeds or throws Error, whatever the stored type.
  tolerate_error([&] { acc += static_cast<uint64_t>(f.get_int(key)); });
  tolerate_error([&] { acc += static_cast<uint64_t>(f.get_float(key) != 0.0); });
  tolerate_error([&] { acc += f.get_bool_or(key, false); });
  tolerate_error([&] { acc += f.get_string(key).size(); });
  tolerate_error([&] {
    for (std::string_view s : f.get_string_array(key)) {
      require(inside(s.data(), s.size(), data, size));
      if (!s.empty()) acc += static_cast<uint8_t>(s.front()) + static_cast<uint8_t>(s.back());
    }
  });
  tolerate_error([&] {
    for (float x : f.get_f32_array(key)) acc += x > 0.f;
  });
  tolerate_error([&] {
    for (int32_t x : f.get_i32_array(key)) acc += static_cast<uint32_t>(x);
  });
  if (v.type == GgufType::STRING) {
    require(v.strings.size() == 1);
    require(inside(v.strings[0].data(), v.strings[0].size(), data, size));
  }
  if (v.type == GgufType::ARRAY) {
    require(v.elem_type != GgufType::ARRAY);
    if (v.elem_type == GgufType::STRING)
      require(v.strings.size() == v.count);
    else if (v.count)
      require(v.array_data && inside(v.array_data, 1, data, size));
  }
  g_sink = g_sink + acc;
}

void touch_tensor(const GgufFile& f, const GgufTensor& t, const uint8_t* data, size_t size) {
  require(f.find_tensor(t.name) == &t);
  require(!t.name.empty() && t.name.size() < 64);
  require(t.ne.size() >= 1 && t.ne.size() <= 4);
  for (int64_t d : t.ne) require(d >= 0);
  const microspec::TypeTraits& tt = microspec::type_traits(t.type);
  require(tt.supported);
  require(t.offset % f.alignment() == 0);
  // The byte size must be exactly what the kernels will compute from type and shape.
  const size_t row = microspec::row_bytes(t.type, t.ne[0]);
  unsigned __int128 expect = static_cast<unsigned __int128>(row) * static_cast<uint64_t>(t.rows());
  require(expect == t.n_bytes);
  require(t.n_elements() == t.ne[0] * t.rows());
  if (t.n_bytes) {
    require(inside(t.data, t.n_bytes, data, size));
    g_sink = g_sink + t.data[0] + t.data[t.n_bytes - 1];
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<GgufFile> f;
  try {
    f = GgufFile::from_memory(data, size, "fuzz.gguf");
  } catch (const Error&) {
    return 0;
  }
  require(f->version() == 2 || f->version() == 3);
  const size_t a = f->alignment();
  require(a != 0 && (a & (a - 1)) == 0);
  for (const std::string& key : f->keys()) {
    const GgufValue* v = f->find(key);
    require(v != nullptr && !key.empty());
    touch_value(*f, key, *v, data, size);
  }
  for (const GgufTensor& t : f->tensors()) touch_tensor(*f, t, data, size);
  // Tensor data ranges must not overlap.
  const auto& ts = f->tensors();
  for (size_t i = 0; i < ts.size(); ++i)
    for (size_t j = i + 1; j < ts.size() && j < i + 64; ++j)
      if (ts[i].n_bytes && ts[j].n_bytes)
        require(ts[i].data + ts[i].n_bytes <= ts[j].data || ts[j].data + ts[j].n_bytes <= ts[i].data);
  return 0;
}
