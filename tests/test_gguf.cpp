// GGUF reader and writer: round trips, the two real models' metadata, and the reader's refusal of
// corrupt files (each case checks that the message names the problem, not just that it throws).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "util/error.h"

namespace microspec {
namespace {

constexpr const char* kName = "test.gguf";

std::string source_dir() {
  if (const char* env = std::getenv("MICROSPEC_SOURCE_DIR")) return env;
  return MICROSPEC_SOURCE_DIR;
}

std::unique_ptr<GgufFile> parse(const std::vector<uint8_t>& b) {
  return GgufFile::from_memory(b.data(), b.size(), kName);
}

// Parses `b`, expects an Error prefixed with the file name and containing every one of `parts`.
void expect_error(const std::vector<uint8_t>& b, std::initializer_list<std::string> parts) {
  try {
    parse(b);
    ADD_FAILURE() << "parsed without error; expected: " << *parts.begin();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(std::string(kName) + ": ", 0), 0u) << msg;
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

template <typename F>
void expect_getter_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected: " << *parts.begin();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// Unchecked little-endian byte builder for hand-made (often deliberately invalid) files.
struct Raw {
  std::vector<uint8_t> b;
  template <typename T>
  Raw& put(T v) {
    uint8_t tmp[sizeof(T)];
    std::memcpy(tmp, &v, sizeof(T));
    b.insert(b.end(), tmp, tmp + sizeof(T));
    return *this;
  }
  Raw& u8(uint8_t v) { return put(v); }
  Raw& u32(uint32_t v) { return put(v); }
  Raw& i32(int32_t v) { return put(v); }
  Raw& u64(uint64_t v) { return put(v); }
  Raw& i64(int64_t v) { return put(v); }
  Raw& f32(float v) { return put(v); }
  Raw& str(std::string_view s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Raw& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    b.insert(b.end(), {'G', 'G', 'U', 'F'});
    return u32(version).u64(n_tensors).u64(n_kv);
  }
  Raw& kv_u32(std::string_view key, uint32_t v) { return str(key).i32(4).u32(v); }
  Raw& kv_str(std::string_view key, std::string_view v) { return str(key).i32(8).str(v); }
  Raw& tensor(std::string_view name, std::vector<int64_t> ne, uint32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(ne.size()));
    for (int64_t d : ne) i64(d);
    return u32(type).u64(offset);
  }
  Raw& pad(size_t align = 32) {
    b.resize((b.size() + align - 1) / align * align, 0);
    return *this;
  }
  Raw& zeros(size_t n) {
    b.resize(b.size() + n, 0);
    return *this;
  }
};

constexpr uint32_t kF32 = 0, kQ8_0 = 8, kQ4_K = 12, kIQ2_XXS = 16;

// One valid file with one tensor; the error cases below each differ from it in one place.
Raw one_tensor(std::string_view name, std::vector<int64_t> ne, uint32_t type, uint64_t offset, size_t data) {
  Raw r;
  r.header(1, 1)
      .kv_str("general.architecture", "llama")
      .tensor(name, std::move(ne), type, offset)
      .pad()
      .zeros(data);
  return r;
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + i * 7);
  return out;
}

// A writer exercising every value type and three tensor types.
GgufWriter sample_writer(uint32_t alignment = 32) {
  GgufWriter w(alignment);
  w.add_string("general.architecture", "llama");
  w.add_u8("t.u8", 200);
  w.add_i8("t.i8", -100);
  w.add_u16("t.u16", 60000);
  w.add_i16("t.i16", -30000);
  w.add_u32("t.u32", 4000000000u);
  w.add_i32("t.i32", -2000000000);
  w.add_u64("t.u64", 1ull << 40);
  w.add_i64("t.i64", -(1ll << 40));
  w.add_f32("t.f32", 1.5f);
  w.add_f64("t.f64", -2.25);
  w.add_bool("t.bool", true);
  w.add_string("t.empty_string", "");
  const std::vector<std::string> toks = {"<s>", "", "hello", "\xe2\x96\x81world"};
  w.add_string_array("tokenizer.ggml.tokens", toks);
  const std::vector<float> scores = {0.f, -1.f, 2.5f, -1e30f};
  w.add_f32_array("tokenizer.ggml.scores", scores);
  const std::vector<int32_t> types = {3, 1, 1, -7};
  w.add_i32_array("tokenizer.ggml.token_type", types);
  const uint16_t u16s[] = {1, 65535};
  w.add_array("t.u16_array", GgufType::U16, u16s, 2);
  w.add_array("t.empty_array", GgufType::F32, nullptr, 0);
  w.add_tensor("a", GgmlType::F32, {4, 3}, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  w.add_tensor("blk.0.b", GgmlType::Q8_0, {64, 2}, pattern(4 * 34, 1));
  w.add_tensor("c", GgmlType::Q4_K, {256}, pattern(144, 9));
  w.add_tensor("empty", GgmlType::F32, {0, 5}, {});
  return w;
}

void check_sample(const GgufFile& f, const std::vector<uint8_t>* buf, size_t alignment,
                  uint32_t version = 3) {
  EXPECT_EQ(f.version(), version);
  EXPECT_EQ(f.alignment(), alignment);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("t.u8"), 200);
  EXPECT_EQ(f.get_int("t.i8"), -100);
  EXPECT_EQ(f.get_int("t.u16"), 60000);
  EXPECT_EQ(f.get_int("t.i16"), -30000);
  EXPECT_EQ(f.get_int("t.u32"), 4000000000ll);
  EXPECT_EQ(f.get_int("t.i32"), -2000000000);
  EXPECT_EQ(f.get_int("t.u64"), 1ll << 40);
  EXPECT_EQ(f.find("t.u64")->u, 1ull << 40);
  EXPECT_EQ(f.get_int("t.i64"), -(1ll << 40));
  EXPECT_EQ(f.get_float("t.f32"), 1.5);
  EXPECT_EQ(f.get_float("t.f64"), -2.25);
  EXPECT_EQ(f.get_float("t.u32"), 4e9);  // integers widen to float
  EXPECT_TRUE(f.get_bool_or("t.bool", false));
  EXPECT_EQ(f.get_int("t.bool"), 1);
  EXPECT_EQ(f.get_string("t.empty_string"), "");
  const auto& toks = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(toks.size(), 4u);
  EXPECT_EQ(toks[0], "<s>");
  EXPECT_EQ(toks[1], "");
  EXPECT_EQ(toks[2], "hello");
  EXPECT_EQ(toks[3], "\xe2\x96\x81world");
  if (buf) {  // zero-copy: the views point into the buffer
    const char* lo = reinterpret_cast<const char*>(buf->data());
    EXPECT_GE(toks[2].data(), lo);
    EXPECT_LT(toks[2].data(), lo + buf->size());
  }
  EXPECT_EQ(f.get_f32_array("tokenizer.ggml.scores"), (std::vector<float>{0.f, -1.f, 2.5f, -1e30f}));
  EXPECT_EQ(f.get_i32_array("tokenizer.ggml.token_type"), (std::vector<int32_t>{3, 1, 1, -7}));
  EXPECT_EQ(f.get_i32_array("t.u16_array"), (std::vector<int32_t>{1, 65535}));
  EXPECT_TRUE(f.get_f32_array("t.empty_array").empty());
  const GgufValue* arr = f.find("tokenizer.ggml.scores");
  ASSERT_NE(arr, nullptr);
  EXPECT_EQ(arr->type, GgufType::ARRAY);
  EXPECT_EQ(arr->elem_type, GgufType::F32);
  EXPECT_EQ(arr->count, 4u);

  const std::vector<std::string> keys = f.keys();
  const size_t extra = alignment != 32 ? 1 : 0;  // general.alignment comes first
  ASSERT_EQ(keys.size(), 18u + extra);
  EXPECT_EQ(keys[extra], "general.architecture");
  EXPECT_EQ(keys.back(), "t.empty_array");

  ASSERT_EQ(f.tensors().size(), 4u);
  const GgufTensor* a = f.find_tensor("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->type, GgmlType::F32);
  EXPECT_EQ(a->ne, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(a->n_elements(), 12);
  EXPECT_EQ(a->rows(), 3);
  EXPECT_EQ(a->n_bytes, 48u);
  EXPECT_EQ(std::memcmp(a->data, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}).data(), 48), 0);
  const GgufTensor* b = f.find_tensor("blk.0.b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->type, GgmlType::Q8_0);
  EXPECT_EQ(b->n_bytes, 4u * 34);
  EXPECT_EQ(b->rows(), 2);
  EXPECT_EQ(std::memcmp(b->data, pattern(4 * 34, 1).data(), b->n_bytes), 0);
  const GgufTensor* c = f.find_tensor("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->type, GgmlType::Q4_K);
  EXPECT_EQ(c->n_bytes, 144u);
  EXPECT_EQ(std::memcmp(c->data, pattern(144, 9).data(), 144), 0);
  const GgufTensor* e = f.find_tensor("empty");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->n_elements(), 0);
  EXPECT_EQ(e->n_bytes, 0u);
  for (const GgufTensor& t : f.tensors()) {
    EXPECT_EQ(t.offset % alignment, 0u) << t.name;
    if (buf) {
      EXPECT_EQ(static_cast<uintptr_t>(t.data - buf->data()) % alignment, 0u) << t.name;
    }
  }
  EXPECT_EQ(f.find_tensor("nope"), nullptr);
  EXPECT_FALSE(f.has("nope"));
  EXPECT_EQ(f.get_int_opt("nope"), std::nullopt);
  EXPECT_EQ(f.get_float_opt("nope"), std::nullopt);
  EXPECT_EQ(f.get_string_opt("nope"), std::nullopt);
  EXPECT_FALSE(f.get_bool_or("nope", false));
  EXPECT_TRUE(f.get_bool_or("nope", true));
}

TEST(Gguf, RoundTripInMemory) {
  const std::vector<uint8_t> buf = sample_writer().to_bytes();
  check_sample(*parse(buf), &buf, 32);
}

TEST(Gguf, RoundTripCustomAlignment) {
  const std::vector<uint8_t> buf = sample_writer(128).to_bytes();
  auto f = parse(buf);
  check_sample(*f, &buf, 128);
  EXPECT_EQ(f->get_int("general.alignment"), 128);
}

TEST(Gguf, RoundTripThroughFile) {
  const std::string path =
      testing::TempDir() + "microspec_gguf_roundtrip_" + std::to_string(getpid()) + ".gguf";
  const GgufWriter w = sample_writer(64);
  w.write_file(path);
  std::vector<uint8_t> expected = w.to_bytes();
  EXPECT_EQ(std::filesystem::file_size(path), expected.size());  // write_file and to_bytes agree
  {
    auto f = GgufFile::open(path);
    EXPECT_EQ(f->name(), path);
    check_sample(*f, nullptr, 64);
    // mmap is page-aligned, so tensor data is aligned in memory too.
    for (const GgufTensor& t : f->tensors())
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 64, 0u) << t.name;
  }
  std::remove(path.c_str());
}

TEST(Gguf, Version2IsAccepted) {
  std::vector<uint8_t> buf = sample_writer().to_bytes();
  buf[4] = 2;  // v2 and v3 share the layout
  auto f = parse(buf);
  EXPECT_EQ(f->version(), 2u);
  check_sample(*f, &buf, 32, 2);
}

TEST(Gguf, EmptyFileWithoutTensorsOrKeys) {
  Raw r;
  r.header(0, 0);
  auto f = parse(r.b);
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_TRUE(f->keys().empty());
}

TEST(Gguf, TypeMismatchMessages) {
  const std::vector<uint8_t> buf = sample_writer().to_bytes();
  auto f = parse(buf);
  expect_getter_error([&] { f->get_string("t.u32"); },
                      {"test.gguf", "'t.u32'", "expected string, found u32"});
  expect_getter_error([&] { f->get_int("general.architecture"); },
                      {"'general.architecture'", "found string"});
  expect_getter_error([&] { f->get_float("t.bool"); }, {"'t.bool'", "found bool"});
  expect_getter_error([&] { f->get_bool_or("t.u8", false); }, {"'t.u8'", "expected bool, found u8"});
  expect_getter_error([&] { f->get_f32_array("tokenizer.ggml.token_type"); },
                      {"expected array of f32, found array of i32"});
  expect_getter_error([&] { f->get_i32_array("tokenizer.ggml.scores"); }, {"found array of f32"});
  expect_getter_error([&] { f->get_string_array("tokenizer.ggml.scores"); },
                      {"expected array of string, found array of f32"});
  expect_getter_error([&] { f->get_string_array("t.f32"); }, {"expected array of string, found f32"});
  expect_getter_error([&] { f->get_int("missing.key"); }, {"test.gguf: missing key 'missing.key'"});
  expect_getter_error([&] { f->get_string("missing.key"); }, {"missing key 'missing.key'"});
  expect_getter_error([&] { f->get_f32_array("missing.key"); }, {"missing key 'missing.key'"});
}

TEST(Gguf, IntegerRangeChecks) {
  GgufWriter w;
  w.add_u64("big", std::numeric_limits<uint64_t>::max());
  const uint32_t u32s[] = {5, 3000000000u};
  w.add_array("u32s", GgufType::U32, u32s, 2);
  const int64_t i64s[] = {-5, std::numeric_limits<int32_t>::min()};
  w.add_array("i64s", GgufType::I64, i64s, 2);
  const std::vector<uint8_t> buf = w.to_bytes();
  auto f = parse(buf);
  expect_getter_error([&] { f->get_int("big"); }, {"'big'", "does not fit in int64"});
  EXPECT_EQ(f->get_float("big"), 18446744073709551615.0);
  expect_getter_error([&] { f->get_i32_array("u32s"); }, {"'u32s'", "element 1", "3000000000", "i32"});
  EXPECT_EQ(f->get_i32_array("i64s"), (std::vector<int32_t>{-5, std::numeric_limits<int32_t>::min()}));
}

// Every proper prefix of a valid file that cuts into the header or tensor data must be refused;
// prefixes that only drop trailing padding are still complete.
TEST(Gguf, TruncatedAtEveryLength) {
  const std::vector<uint8_t> buf = sample_writer().to_bytes();
  auto full = parse(buf);
  size_t needed = 0;
  for (const GgufTensor& t : full->tensors())
    needed = std::max(needed, static_cast<size_t>(t.data - buf.data()) + t.n_bytes);
  ASSERT_GT(needed, 200u);
  for (size_t len = 0; len < buf.size(); ++len) {
    std::vector<uint8_t> cut(buf.begin(), buf.begin() + len);  // exact-size copy so ASan sees overreads
    if (len < needed) {
      EXPECT_THROW(parse(cut), Error) << "prefix of " << len << " bytes";
    } else {
      EXPECT_NO_THROW(parse(cut)) << "prefix of " << len << " bytes";
    }
  }
  expect_error(std::vector<uint8_t>(buf.begin(), buf.begin() + 10), {"truncated", "tensor count"});
  expect_error(std::vector<uint8_t>(buf.begin(), buf.begin() + needed - 1), {"extends past end of file"});
}

TEST(GgufErrors, TooSmall) {
  expect_error({'G', 'G', 'U'}, {"too small", "3 bytes"});
}

TEST(GgufErrors, BadMagic) {
  std::vector<uint8_t> buf = sample_writer().to_bytes();
  buf[0] = 'X';
  expect_error(buf, {"bad magic", "XGUF"});
  buf[0] = 0;
  expect_error(buf, {"bad magic", "\\x00GUF"});
}

TEST(GgufErrors, Version1) {
  std::vector<uint8_t> buf = sample_writer().to_bytes();
  buf[4] = 1;
  expect_error(buf, {"version 1 is not supported"});
}

TEST(GgufErrors, Version4) {
  std::vector<uint8_t> buf = sample_writer().to_bytes();
  buf[4] = 4;
  expect_error(buf, {"unsupported GGUF version 4"});
}

TEST(GgufErrors, BigEndianVersion) {
  std::vector<uint8_t> buf = sample_writer().to_bytes();
  buf[4] = 0;
  buf[7] = 3;
  expect_error(buf, {"big-endian"});
}

TEST(GgufErrors, HugeTensorCount) {
  Raw r;
  r.header(uint64_t(1) << 60, 0).zeros(100);
  expect_error(r.b, {"tensor count 1152921504606846976 cannot fit"});
}

TEST(GgufErrors, HugeKeyCount) {
  Raw r;
  r.header(0, ~uint64_t(0)).zeros(100);
  expect_error(r.b, {"metadata key count 18446744073709551615 cannot fit"});
}

TEST(GgufErrors, TensorAndKeyCountsTogetherTooLarge) {
  Raw r;
  r.header(3, 3).zeros(3 * 33 + 2 * 14);  // each count fits alone, both together do not
  expect_error(r.b, {"tensor count 3 and metadata key count 3 cannot fit"});
}

TEST(GgufErrors, HugeStringLength) {
  Raw r;
  r.header(0, 1).str("general.name").i32(8).u64(uint64_t(1) << 62).zeros(16);
  expect_error(r.b, {"key 'general.name'", "string length 4611686018427387904", "exceeds"});
}

TEST(GgufErrors, HugeKeyLength) {
  Raw r;
  r.header(0, 1).u64(~uint64_t(0)).zeros(32);
  expect_error(r.b, {"metadata key #0", "string length 18446744073709551615"});
}

TEST(GgufErrors, HugeArrayCount) {
  Raw r;
  r.header(0, 1).str("tokenizer.ggml.scores").i32(9).i32(6).u64(uint64_t(1) << 61).zeros(64);
  expect_error(r.b, {"'tokenizer.ggml.scores'", "array count 2305843009213693952", "f32", "cannot fit"});
}

TEST(GgufErrors, HugeStringArrayCount) {
  Raw r;
  r.header(0, 1).str("tokenizer.ggml.tokens").i32(9).i32(8).u64(1000).str("a").str("b");
  expect_error(r.b, {"'tokenizer.ggml.tokens'", "array count 1000", "string", "cannot fit"});
}

TEST(GgufErrors, StringArrayElementTooLong) {
  Raw r;
  r.header(0, 1).str("tokenizer.ggml.tokens").i32(9).i32(8).u64(3).str("a").u64(1u << 20).zeros(64);
  expect_error(r.b, {"'tokenizer.ggml.tokens'", "string #1 length 1048576"});
}

TEST(GgufErrors, ArrayOfArrays) {
  Raw r;
  r.header(0, 1).str("nested").i32(9).i32(9).u64(1).i32(4).u64(1).u32(7);
  expect_error(r.b, {"'nested'", "arrays of arrays"});
}

TEST(GgufErrors, UnknownValueType) {
  Raw r;
  r.header(0, 1).str("weird").i32(13).u64(0);
  expect_error(r.b, {"'weird'", "unknown value type 13"});
  Raw n;
  n.header(0, 1).str("weird").i32(-1).u64(0);
  expect_error(n.b, {"'weird'", "unknown value type -1"});
}

TEST(GgufErrors, UnknownArrayElementType) {
  Raw r;
  r.header(0, 1).str("weird").i32(9).i32(42).u64(0);
  expect_error(r.b, {"'weird'", "unknown array element type 42"});
}

TEST(GgufErrors, DuplicateKey) {
  Raw r;
  r.header(0, 2).kv_u32("llama.block_count", 1).kv_u32("llama.block_count", 2);
  expect_error(r.b, {"duplicate key 'llama.block_count'"});
}

TEST(GgufErrors, EmptyKey) {
  Raw r;
  r.header(0, 1).kv_u32("", 1);
  expect_error(r.b, {"metadata key #0 is empty"});
}

TEST(GgufErrors, OverlongKey) {
  Raw r;
  r.header(0, 1).kv_u32(std::string(300, 'k'), 1);
  expect_error(r.b, {"metadata key #0 is 300 bytes long"});
}

TEST(GgufErrors, BoolNotZeroOrOne) {
  Raw r;
  r.header(0, 1).str("flag").i32(7).u8(2);
  expect_error(r.b, {"'flag'", "bool value 2"});
}

TEST(GgufErrors, NDimsZero) {
  Raw r;
  r.header(1, 0).str("t").u32(0).u32(kF32).u64(0).pad().zeros(32);
  expect_error(r.b, {"tensor 't'", "n_dims 0 is out of range"});
}

TEST(GgufErrors, NDimsFive) {
  expect_error(one_tensor("t", {1, 1, 1, 1, 1}, kF32, 0, 32).b, {"tensor 't'", "n_dims 5 is out of range"});
}

TEST(GgufErrors, NegativeDimension) {
  expect_error(one_tensor("t", {32, -2}, kF32, 0, 256).b, {"tensor 't'", "ne[1] is negative (-2)"});
}

TEST(GgufErrors, ElementCountOverflow) {
  const int64_t big = int64_t(1) << 40;
  expect_error(one_tensor("t", {big, big}, kF32, 0, 32).b, {"tensor 't'", "element count", "overflows"});
}

TEST(GgufErrors, RowCountOverflowBehindZeroDimension) {
  // No elements at all, but rows() = 2^80 would overflow: found by the fuzzer.
  const int64_t big = int64_t(1) << 40;
  expect_error(one_tensor("t", {0, big, big}, kF32, 0, 32).b, {"tensor 't'", "element count", "overflows"});
}

TEST(GgufErrors, ByteSizeOverflow) {
  // 2^62 elements fit in int64, but 2^62 * 4 bytes do not fit in 64 bits.
  const int64_t big = int64_t(1) << 31;
  expect_error(one_tensor("t", {big, big}, kF32, 0, 32).b, {"tensor 't'", "data size", "overflows"});
}

TEST(GgufErrors, RowNotMultipleOfBlockSize) {
  expect_error(one_tensor("blk.0.attn_q.weight", {33, 2}, kQ8_0, 0, 128).b,
               {"tensor 'blk.0.attn_q.weight'", "ne[0] = 33", "Q8_0 block size 32"});
  expect_error(one_tensor("k", {128}, kQ4_K, 0, 144).b, {"'k'", "Q4_K block size 256"});
}

TEST(GgufErrors, UnknownTensorType) {
  expect_error(one_tensor("w", {32}, 99, 0, 128).b, {"tensor 'w'", "unknown tensor type id 99"});
}

TEST(GgufErrors, UnsupportedTensorType) {
  // The writer accepts any defined type, so this file is well-formed apart from the type.
  GgufWriter w;
  w.add_tensor("blk.3.ffn_up.weight", static_cast<GgmlType>(kIQ2_XXS), {256}, std::vector<uint8_t>(66));
  expect_error(w.to_bytes(), {"tensor 'blk.3.ffn_up.weight'", "IQ2_XXS is not supported"});
}

TEST(GgufErrors, MisalignedOffset) {
  Raw r;
  r.header(2, 0).tensor("a", {8}, kF32, 0).tensor("b", {8}, kF32, 40).pad().zeros(128);
  expect_error(r.b, {"tensor 'b'", "offset 40 is not a multiple of the alignment 32"});
}

TEST(GgufErrors, OffsetPastEnd) {
  Raw r = one_tensor("far", {8}, kF32, 1 << 20, 64);
  expect_error(r.b, {"tensor 'far' data [offset",
                     "32 bytes] extends past end of file (size " + std::to_string(r.b.size()) + ")"});
  Raw h = one_tensor("huge", {8}, kF32, ~uint64_t(0) & ~uint64_t(31), 64);  // offset + data start overflows
  expect_error(h.b, {"tensor 'huge' data [data-section offset", "extends past end of file"});
}

TEST(GgufErrors, DataExtendsPastEnd) {
  Raw r = one_tensor("blk.0.attn_q.weight", {64, 4}, kF32, 0, 1000);  // needs 1024 bytes
  const std::string data_start = std::to_string(r.b.size() - 1000);
  expect_error(r.b,
               {"tensor 'blk.0.attn_q.weight' data [offset " + data_start + ", 1024 bytes] extends past end",
                "size " + std::to_string(r.b.size())});
}

TEST(GgufErrors, OverlappingTensors) {
  Raw r;
  r.header(2, 0).tensor("a", {16}, kF32, 32).tensor("b", {32}, kF32, 0).pad().zeros(256);
  expect_error(r.b, {"tensors 'b'", "and 'a'", "overlap"});
}

TEST(GgufErrors, DuplicateTensorName) {
  Raw r;
  r.header(2, 0).tensor("w", {8}, kF32, 0).tensor("w", {8}, kF32, 32).pad().zeros(64);
  expect_error(r.b, {"duplicate tensor name 'w'"});
}

TEST(GgufErrors, EmptyTensorName) {
  expect_error(one_tensor("", {8}, kF32, 0, 32).b, {"tensor #0 has an empty name"});
}

TEST(GgufErrors, OverlongTensorName) {
  expect_error(one_tensor(std::string(64, 'n'), {8}, kF32, 0, 32).b, {"tensor #0 name is 64 bytes long"});
  auto f = parse(one_tensor(std::string(63, 'n'), {8}, kF32, 0, 32).b);  // the limit itself is fine
  EXPECT_EQ(f->tensors()[0].name.size(), 63u);
}

TEST(GgufErrors, AlignmentZero) {
  Raw r;
  r.header(0, 1).kv_u32("general.alignment", 0);
  expect_error(r.b, {"general.alignment 0 is not a nonzero power of two"});
}

TEST(GgufErrors, AlignmentThree) {
  Raw r;
  r.header(0, 1).kv_u32("general.alignment", 3);
  expect_error(r.b, {"general.alignment 3 is not a nonzero power of two"});
}

TEST(GgufErrors, AlignmentWrongType) {
  Raw r;
  r.header(0, 1).str("general.alignment").i32(10).u64(32);
  expect_error(r.b, {"general.alignment must be u32, found u64"});
}

TEST(GgufErrors, DataSectionPastEnd) {
  Raw r;
  r.header(1, 0).tensor("t", {0}, kF32, 0);  // no padding, no data
  expect_error(r.b, {"data section would start at offset 64", "past the end"});
}

TEST(GgufErrors, OpenMissingFileAndDirectory) {
  expect_getter_error([] { GgufFile::open("/nonexistent/dir/model.gguf"); },
                      {"/nonexistent/dir/model.gguf: cannot open", "No such file"});
  expect_getter_error([] { GgufFile::open("/tmp"); }, {"/tmp: not a regular file"});
  const std::string path = testing::TempDir() + "microspec_gguf_empty_" + std::to_string(getpid()) + ".gguf";
  std::fclose(std::fopen(path.c_str(), "wb"));
  expect_getter_error([&] { GgufFile::open(path); }, {path + ": file is empty"});
  std::remove(path.c_str());
}

TEST(GgufWriterTest, RefusesWhatTheReaderWould) {
  GgufWriter w;
  w.add_u32("k", 1);
  EXPECT_THROW(w.add_u32("k", 2), Error);
  EXPECT_THROW(w.add_string("", "x"), Error);
  EXPECT_THROW(w.add_tensor("t", GgmlType::Q8_0, {33}, std::vector<uint8_t>(34)), Error);
  EXPECT_THROW(w.add_tensor("t", GgmlType::F32, {4}, std::vector<uint8_t>(15)), Error);
  EXPECT_THROW(w.add_tensor("t", GgmlType::F32, {1, 1, 1, 1, 1}, std::vector<uint8_t>(4)), Error);
  EXPECT_THROW(w.add_tensor(std::string(64, 'x'), GgmlType::F32, {1}, std::vector<uint8_t>(4)), Error);
  w.add_tensor("t", GgmlType::F32, {1}, std::vector<uint8_t>(4));
  EXPECT_THROW(w.add_tensor("t", GgmlType::F32, {1}, std::vector<uint8_t>(4)), Error);
  EXPECT_THROW(GgufWriter(24), Error);
}

// ---- The two real models. ----

std::unique_ptr<GgufFile> open_model(const std::string& file, double* ms) {
  const std::string path = source_dir() + "/models/" + file;
  if (!std::filesystem::exists(path))
    throw std::runtime_error(path + " is missing: run scripts/fetch_models.sh");
  const auto t0 = std::chrono::steady_clock::now();
  auto f = GgufFile::open(path);
  *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return f;
}

std::map<std::string, int> type_counts(const GgufFile& f) {
  std::map<std::string, int> counts;
  for (const GgufTensor& t : f.tensors()) ++counts[type_traits(t.type).name];
  return counts;
}

TEST(GgufRealModels, Gemma3) {
  double ms = 0;
  auto f = open_model("gemma-3-270m-q4_k_m.gguf", &ms);
  std::printf("gemma-3-270m parse: %.2f ms\n", ms);
  EXPECT_LT(ms, 1000.0);  // loose bound that still catches quadratic parsing (target < 100 ms)
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->file_size(), 253113024u);
  EXPECT_EQ(f->data_offset(), 6525120u);  // as gguf-py reports
  EXPECT_EQ(f->get_string("general.architecture"), "gemma3");
  EXPECT_EQ(f->keys().size(), 33u);
  EXPECT_EQ(f->tensors().size(), 236u);
  EXPECT_EQ(f->get_int("gemma3.block_count"), 18);
  EXPECT_EQ(f->get_int("gemma3.embedding_length"), 640);
  EXPECT_EQ(f->get_int("gemma3.attention.key_length"), 256);
  EXPECT_EQ(f->get_int("gemma3.attention.head_count_kv"), 1);
  EXPECT_EQ(f->get_int("gemma3.attention.sliding_window"), 512);
  EXPECT_NEAR(f->get_float("gemma3.attention.layer_norm_rms_epsilon"), 1e-6, 1e-12);
  EXPECT_EQ(f->get_float("gemma3.rope.freq_base"), 1e6);
  EXPECT_EQ(f->get_string("tokenizer.ggml.model"), "llama");
  EXPECT_TRUE(f->get_bool_or("tokenizer.ggml.add_bos_token", false));
  EXPECT_FALSE(f->get_bool_or("tokenizer.ggml.add_space_prefix", true));
  EXPECT_EQ(f->get_int("tokenizer.ggml.bos_token_id"), 2);
  const auto& toks = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(toks.size(), 262144u);
  EXPECT_EQ(toks[0], "<pad>");
  EXPECT_EQ(toks[2], "<bos>");
  EXPECT_EQ(toks[106], "<end_of_turn>");
  EXPECT_EQ(toks[1000], "put");
  const std::vector<float> scores = f->get_f32_array("tokenizer.ggml.scores");
  ASSERT_EQ(scores.size(), 262144u);
  EXPECT_EQ(scores[1000], -506.f);
  const std::vector<int32_t> tt = f->get_i32_array("tokenizer.ggml.token_type");
  ASSERT_EQ(tt.size(), 262144u);
  EXPECT_EQ(tt[106], 3);
  EXPECT_EQ(tt[1000], 1);

  EXPECT_EQ(type_counts(*f), (std::map<std::string, int>{
                                 {"F32", 109}, {"Q5_0", 81}, {"Q4_K", 27}, {"Q8_0", 10}, {"Q6_K", 9}}));
  const GgufTensor* embd = f->find_tensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->type, GgmlType::Q8_0);
  EXPECT_EQ(embd->ne, (std::vector<int64_t>{640, 262144}));
  EXPECT_EQ(embd->n_bytes, 178257920u);
  EXPECT_EQ(embd->offset, 2560u);  // right after output_norm (640 f32)
  const uint8_t embd_head[] = {0xf2, 0x10, 0xf4, 0x47, 0xc7, 0xdd, 0xec, 0x30};
  EXPECT_EQ(std::memcmp(embd->data, embd_head, 8), 0);
  const GgufTensor* norm = f->find_tensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->offset, 0u);
  float w[2];
  std::memcpy(w, norm->data, sizeof w);
  EXPECT_EQ(w[0], 7.125f);
  EXPECT_EQ(w[1], 9.5625f);
  const GgufTensor* o = f->find_tensor("blk.0.attn_output.weight");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->type, GgmlType::Q4_K);
  EXPECT_EQ(o->ne, (std::vector<int64_t>{1024, 640}));
  const GgufTensor* down = f->find_tensor("blk.0.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->type, GgmlType::Q6_K);
  EXPECT_EQ(down->n_bytes, 1075200u);
  const GgufTensor* q = f->find_tensor("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->type, GgmlType::Q5_0);
  EXPECT_EQ(q->ne, (std::vector<int64_t>{640, 1024}));
  const GgufTensor* last = f->find_tensor("blk.17.post_ffw_norm.weight");
  ASSERT_NE(last, nullptr);
  EXPECT_EQ(last->data + last->n_bytes,
            embd->data - embd->offset + (f->file_size() - f->data_offset()));  // at EOF
}

TEST(GgufRealModels, SmolLM2) {
  double ms = 0;
  auto f = open_model("smollm2-135m-instruct-q4_1.gguf", &ms);
  std::printf("smollm2-135m parse: %.2f ms\n", ms);
  EXPECT_LT(ms, 1000.0);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->data_offset(), 1785664u);
  EXPECT_EQ(f->keys().size(), 33u);
  EXPECT_EQ(f->tensors().size(), 272u);
  EXPECT_EQ(f->get_int("llama.block_count"), 30);
  EXPECT_EQ(f->get_int("llama.embedding_length"), 576);
  EXPECT_EQ(f->get_int("llama.attention.head_count"), 9);
  EXPECT_EQ(f->get_int("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(f->get_int("llama.vocab_size"), 49152);
  EXPECT_EQ(f->get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(f->get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f->get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_FALSE(f->get_bool_or("tokenizer.ggml.add_bos_token", true));
  EXPECT_NE(f->get_string("tokenizer.chat_template").find("<|im_start|>"), std::string_view::npos);
  const auto& toks = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(toks.size(), 49152u);
  EXPECT_EQ(toks[0], "<|endoftext|>");
  EXPECT_EQ(toks[2], "<|im_end|>");
  const auto& merges = f->get_string_array("tokenizer.ggml.merges");
  ASSERT_EQ(merges.size(), 48900u);
  EXPECT_EQ(merges[0], "\xc4\xa0 t");
  EXPECT_EQ(merges.back(), "ect able");
  EXPECT_FALSE(f->has("tokenizer.ggml.scores"));

  EXPECT_EQ(type_counts(*f), (std::map<std::string, int>{{"F32", 61}, {"Q4_1", 210}, {"Q8_0", 1}}));
  const GgufTensor* embd = f->find_tensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->type, GgmlType::Q8_0);
  EXPECT_EQ(embd->ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(embd->offset, 0u);
  const uint8_t embd_head[] = {0x32, 0x19, 0xd6, 0x0d, 0x13, 0xf7, 0xe5, 0xee};
  EXPECT_EQ(std::memcmp(embd->data, embd_head, 8), 0);
  const GgufTensor* k = f->find_tensor("blk.0.attn_k.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->type, GgmlType::Q4_1);
  EXPECT_EQ(k->ne, (std::vector<int64_t>{576, 192}));
  EXPECT_EQ(k->n_bytes, 69120u);
  EXPECT_EQ(k->rows(), 192);
  const GgufTensor* norm = f->find_tensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  float w[2];
  std::memcpy(w, norm->data, sizeof w);
  EXPECT_EQ(w[0], 1.7578125f);
  EXPECT_EQ(w[1], 1.8203125f);
}

}  // namespace
}  // namespace microspec
