// The safetensors reader: values read back exactly, and every malformed header refused with the
// file's name and what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "kernels/types.h"
#include "support/test_helpers.h"

namespace microspec {
namespace {

using test::error_of;

template <typename T>
void append(std::vector<uint8_t>& v, T x);
void append(std::vector<uint8_t>& v, const std::string& s) { v.insert(v.end(), s.begin(), s.end()); }

// A safetensors file: 8-byte little-endian header length, the header, then `data`.
std::vector<uint8_t> safetensors_bytes(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  out.reserve(sizeof(uint64_t) + header.size() + data.size());  // also spares GCC 12 a false -Wstringop-overread
  append(out, uint64_t(header.size()));
  append(out, header);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

template <typename T>
void append(std::vector<uint8_t>& v, T x) {
  const size_t at = v.size();
  v.resize(at + sizeof(T));
  std::memcpy(v.data() + at, &x, sizeof(T));
}

std::string parse_error(const std::string& header, const std::vector<uint8_t>& data) {
  const std::vector<uint8_t> bytes = safetensors_bytes(header, data);
  return error_of([&] { SafetensorsFile::from_memory(bytes.data(), bytes.size(), "x.safetensors"); });
}

TEST(Safetensors, ReadsF32F16Bf16AndMetadata) {
  // a: F32 [2,3] = 0..5; b: F16 [2] = {1.5, -2}; c: BF16 [1,2] = {3, -0.25}
  std::vector<uint8_t> data;
  for (int i = 0; i < 6; ++i) append(data, float(i));
  append(data, fp32_to_fp16(1.5f));
  append(data, fp32_to_fp16(-2.0f));
  for (float f : {3.0f, -0.25f}) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    append(data, uint16_t(bits >> 16));
  }
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"F16","shape":[2],"data_offsets":[24,28]},)"
      R"("c":{"dtype":"BF16","shape":[1,2],"data_offsets":[28,32]}})";
  const std::vector<uint8_t> bytes = safetensors_bytes(header, data);
  const auto f = SafetensorsFile::from_memory(bytes.data(), bytes.size(), "x.safetensors");
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->find("nope"), nullptr);

  const CheckpointTensor* a = f->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape_text(), "[2, 3]");
  std::vector<float> va(6);
  tensor_to_f32(*a, va);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(va[i], float(i));
  std::vector<float> vb(2), vc(2);
  tensor_to_f32(*f->find("b"), vb);
  tensor_to_f32(*f->find("c"), vc);
  EXPECT_EQ(vb, (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(vc, (std::vector<float>{3.0f, -0.25f}));
  std::vector<float> wrong(5);
  EXPECT_NE(error_of([&] { tensor_to_f32(*a, wrong); }).find("6 values into a buffer of 5"), std::string::npos);
}

TEST(Safetensors, OpensAFileAndNamesItInErrors) {
  const std::string path = testing::TempDir() + "/checkpoint_test.safetensors";
  std::vector<uint8_t> data;
  append(data, 7.0f);
  const auto bytes = safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data);
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  const auto f = SafetensorsFile::open(path);
  std::vector<float> v(1);
  tensor_to_f32(*f->find("w"), v);
  EXPECT_EQ(v[0], 7.0f);
  std::filesystem::resize_file(path, bytes.size() - 2);  // truncated data
  const std::string e = error_of([&] { SafetensorsFile::open(path); });
  EXPECT_NE(e.find(path + ": tensor 'w': data_offsets [0, 4] outside the data section of 2 bytes"),
            std::string::npos)
      << e;
  EXPECT_NE(error_of([&] { SafetensorsFile::open(path + ".missing"); }).find("cannot open"), std::string::npos);
}

TEST(Safetensors, RefusesMalformedHeaders) {
  const std::vector<uint8_t> four(4, 0);
  struct Case {
    std::string header;
    std::string expected;
  } cases[] = {
      {"[1,2]", "header is not a JSON object"},
      {"{\"a\":", "header is not valid JSON"},
      {R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", "tensor 'a': unsupported dtype 'Q4'"},
      {R"({"a":{"shape":[1],"data_offsets":[0,4]}})", "tensor 'a': missing string 'dtype'"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "shape entries must be non-negative"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})",
       "shape [2] of F32 needs 8 bytes, data_offsets span 4"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "data_offsets [4, 0] outside"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "'data_offsets' must be [begin, end]"},
      {R"({"a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,4]}})", "is too large"},
      {R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"F16","shape":[1],"data_offsets":[2,4]}})",
       "tensors 'a' and 'b' overlap"},
      {R"({"__metadata__":{"k":1}})", "__metadata__ value of 'k' is not a string"},
  };
  for (const Case& c : cases) {
    const std::string e = parse_error(c.header, four);
    EXPECT_NE(e.find("x.safetensors: "), std::string::npos) << e;
    EXPECT_NE(e.find(c.expected), std::string::npos) << c.header << " -> " << e;
  }
  // A header length past the end of the file, and a file too short to hold one.
  std::vector<uint8_t> bytes = safetensors_bytes("{}", {});
  bytes[0] = 0xff;
  EXPECT_NE(error_of([&] { SafetensorsFile::from_memory(bytes.data(), bytes.size(), "y"); })
                .find("header length 255 exceeds the file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsFile::from_memory(bytes.data(), 3, "y"); }).find("too small"),
            std::string::npos);
}

TEST(Safetensors, RefusesNonWeightDtypeConversion) {
  std::vector<uint8_t> data(8, 0);
  const auto bytes = safetensors_bytes(R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", data);
  const auto f = SafetensorsFile::from_memory(bytes.data(), bytes.size(), "z");
  std::vector<float> v(1);
  EXPECT_NE(error_of([&] { tensor_to_f32(*f->find("ids"), v); })
                .find("tensor ids: dtype I64 is not a weight type (expected F32, F16 or BF16)"),
            std::string::npos);
}

}  // namespace
}  // namespace microspec
