// Writes the seed corpus for fuzz_gguf: small valid GGUF files covering every metadata value type,
// every supported tensor type, both versions and a non-default alignment. Usage: make_gguf_seeds DIR
#include <cstdio>
#include <string>
#include <vector>

#include "gguf/gguf_writer.h"
#include "kernels/types.h"
#include "util/error.h"

using namespace microspec;

namespace {

std::vector<uint8_t> bytes_for(GgmlType type, std::vector<int64_t> ne, uint8_t seed) {
  const TypeTraits& tt = type_traits(type);
  size_t n = static_cast<size_t>(ne[0] / tt.block_elems) * tt.block_bytes;
  for (size_t i = 1; i < ne.size(); ++i) n *= static_cast<size_t>(ne[i]);
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed * 31 + i * 13);
  return out;
}

void add(GgufWriter& w, const std::string& name, GgmlType type, std::vector<int64_t> ne, uint8_t seed = 1) {
  std::vector<uint8_t> data = bytes_for(type, ne, seed);
  w.add_tensor(name, type, std::move(ne), data);
}

void save(const std::string& dir, const std::string& name, std::vector<uint8_t> bytes) {
  const std::string path = dir + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size())
    throw Error(path + ": cannot write");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  try {
    save(dir, "empty.gguf", GgufWriter().to_bytes());

    {  // every value type
      GgufWriter w;
      w.add_string("general.architecture", "llama");
      w.add_u8("a.u8", 7);
      w.add_i8("a.i8", -7);
      w.add_u16("a.u16", 700);
      w.add_i16("a.i16", -700);
      w.add_u32("a.u32", 70000);
      w.add_i32("a.i32", -70000);
      w.add_u64("a.u64", 1ull << 50);
      w.add_i64("a.i64", -(1ll << 50));
      w.add_f32("a.f32", 0.5f);
      w.add_f64("a.f64", 0.25);
      w.add_bool("a.bool", true);
      const std::vector<std::string> toks = {"<s>", "</s>", "a", "b", "ab"};
      w.add_string_array("tokenizer.ggml.tokens", toks);
      const std::vector<std::string> merges = {"a b"};
      w.add_string_array("tokenizer.ggml.merges", merges);
      const std::vector<float> scores = {0, 0, -1, -2, -3};
      w.add_f32_array("tokenizer.ggml.scores", scores);
      const std::vector<int32_t> types = {3, 3, 1, 1, 1};
      w.add_i32_array("tokenizer.ggml.token_type", types);
      const uint64_t u64s[] = {1, 2};
      w.add_array("a.u64s", GgufType::U64, u64s, 2);
      const uint8_t bools[] = {0, 1};
      w.add_array("a.bools", GgufType::BOOL, bools, 2);
      save(dir, "values.gguf", w.to_bytes());
    }

    {  // every supported tensor type, tiny shapes
      GgufWriter w;
      w.add_string("general.architecture", "llama");
      uint8_t seed = 0;
      for (GgmlType t :
           {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0,
            GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
        const int64_t row = type_traits(t).block_elems == 1 ? 8 : type_traits(t).block_elems;
        add(w, std::string("t.") + type_traits(t).name, t, {row, 2}, ++seed);
      }
      add(w, "t.4d", GgmlType::F32, {2, 2, 2, 2});
      add(w, "t.empty", GgmlType::F32, {0});
      std::vector<uint8_t> v3 = w.to_bytes();
      save(dir, "tensors.gguf", v3);
      v3[4] = 2;
      save(dir, "tensors_v2.gguf", v3);
    }

    {  // non-default alignment
      GgufWriter w(64);
      w.add_string("general.name", "aligned");
      add(w, "a", GgmlType::Q8_0, {32});
      add(w, "b", GgmlType::F32, {3});
      save(dir, "align64.gguf", w.to_bytes());
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
