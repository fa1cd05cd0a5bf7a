// pytorch_model.bin without running pickled code: a torch.save'd state dict reads back exactly;
// hostile pickles (made with Python's own pickle module, see scripts/make_checkpoint_fixtures.py)
// are refused with the global named and their payload never runs; corrupt archives and pickles are
// refused with clear errors, at every truncation length.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/pickle.h"
#include "checkpoint/pytorch_checkpoint.h"
#include "checkpoint/zip_reader.h"
#include "support/test_helpers.h"

namespace microspec {
namespace {

using test::error_of;

std::string fixture(const std::string& name) { return test::source_dir() + "/tests/data/checkpoint/" + name; }

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::vector<float> values(const CheckpointTensor& t) {
  std::vector<float> v(size_t(t.n_elements()));
  tensor_to_f32(t, v);
  return v;
}

TEST(PytorchCheckpoint, ReadsTorchSaveExactly) {
  const auto c = PytorchCheckpoint::open(fixture("state_dict.bin"));
  std::vector<std::string> names;
  for (const CheckpointTensor& t : c->tensors()) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "c", "d2t", "t2d", "rows", "row"}));

  const CheckpointTensor& a = *c->find("a");
  EXPECT_EQ(a.dtype, TensorDtype::F32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(values(a), (std::vector<float>{0, 0.25f, 0.5f, 0.75f, 1, 1.25f}));
  const CheckpointTensor& b = *c->find("b");
  EXPECT_EQ(b.dtype, TensorDtype::F16);
  EXPECT_EQ(values(b), (std::vector<float>{1.5f, -2, 0.25f, 65504}));
  const CheckpointTensor& bf = *c->find("c");
  EXPECT_EQ(bf.dtype, TensorDtype::BF16);
  EXPECT_EQ(bf.shape, (std::vector<int64_t>{2, 2}));
  const std::vector<float> cv = values(bf);
  EXPECT_EQ(cv[0], 3.0f);
  EXPECT_EQ(cv[1], -0.25f);
  EXPECT_NEAR(cv[2], 1e30f, 1e30f / 128);  // bf16 keeps 8 significant bits
  EXPECT_EQ(cv[3], -7.0f);

  const CheckpointTensor& d2t = *c->find("d2t");
  ASSERT_EQ(d2t.dtype, TensorDtype::I64);
  ASSERT_EQ(d2t.data.size(), 3 * 8u);
  int64_t ids[3];
  std::memcpy(ids, d2t.data.data(), sizeof ids);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 1);
  EXPECT_EQ(ids[2], 5);
  const CheckpointTensor& t2d = *c->find("t2d");
  ASSERT_EQ(t2d.dtype, TensorDtype::Bool);
  EXPECT_EQ(std::vector<uint8_t>(t2d.data.begin(), t2d.data.end()), (std::vector<uint8_t>{1, 0, 0, 1}));

  // A view into another tensor's storage: offset 4 elements, sharing the bytes.
  const CheckpointTensor& rows = *c->find("rows");
  const CheckpointTensor& row = *c->find("row");
  EXPECT_EQ(row.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(values(row), (std::vector<float>{4, 5, 6, 7}));
  EXPECT_EQ(row.data.data(), rows.data.data() + 4 * 2);
}

TEST(PytorchCheckpoint, HostilePicklesAreRefusedNamingTheGlobalAndNothingRuns) {
  struct Case {
    const char* file;
    const char* global;
    const char* pwned;  // the file the payload would create
  };
  const Case cases[] = {
      {"hostile_system.bin", "'posix.system'", "/tmp/microspec_pwned_system"},
      {"hostile_eval.bin", "'builtins.eval'", "/tmp/microspec_pwned_eval"},
      {"hostile_subprocess.bin", "'subprocess.call'", "/tmp/microspec_pwned_subprocess"},
      {"hostile_inst.bin", "'os.system'", "/tmp/microspec_pwned_inst"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file);
    std::filesystem::remove(c.pwned);
    const std::string err = error_of([&] { PytorchCheckpoint::open(fixture(c.file)); });
    EXPECT_NE(err.find(c.file), std::string::npos) << err;
    EXPECT_NE(err.find(std::string("the global ") + c.global), std::string::npos) << err;
    EXPECT_NE(err.find("refused, nothing was run"), std::string::npos) << err;
    EXPECT_FALSE(std::filesystem::exists(c.pwned));
  }
  const std::string err = error_of([&] { PytorchCheckpoint::open(fixture("hostile_storage_call.bin")); });
  EXPECT_NE(err.find("REDUCE calls torch.FloatStorage, which is not a function"), std::string::npos) << err;
}

TEST(PytorchCheckpoint, RefusesWhatItCannotRepresent) {
  EXPECT_NE(error_of([] { PytorchCheckpoint::open(fixture("transposed.bin")); }).find("non-contiguous view"),
            std::string::npos);
  EXPECT_NE(error_of([] { PytorchCheckpoint::open(fixture("legacy.bin")); }).find("legacy (pre-1.6, non-zip)"),
            std::string::npos);
  const std::string compressed = error_of([] { PytorchCheckpoint::open(fixture("compressed.bin")); });
  EXPECT_NE(compressed.find("compressed (method 8)"), std::string::npos) << compressed;
  EXPECT_NE(compressed.find("data.pkl"), std::string::npos) << compressed;
  const std::vector<uint8_t> text = {'h', 'e', 'l', 'l', 'o'};
  EXPECT_NE(error_of([&] { PytorchCheckpoint::from_memory(text.data(), text.size(), "x.bin"); })
                .find("x.bin: not a PyTorch checkpoint"),
            std::string::npos);
}

TEST(PytorchCheckpoint, EveryTruncationAndCorruptionIsAnError) {
  const std::vector<uint8_t> good = read_bytes(fixture("state_dict.bin"));
  ASSERT_GT(good.size(), 1000u);
  for (size_t n = 0; n < good.size(); ++n) {
    const std::string err = error_of([&] { PytorchCheckpoint::from_memory(good.data(), n, "cut.bin"); });
    ASSERT_EQ(err.rfind("cut.bin: ", 0), 0u) << "length " << n << ": " << err;
  }
  // A flipped byte inside the pickle fails its CRC; one in a storage's declared size (the last
  // BININT1 of the first persistent id) makes the storage the wrong size.
  const ZipArchive zip(good.data(), good.size(), "good.bin");
  const ZipEntry* pkl = zip.find("state_dict/data.pkl");
  ASSERT_NE(pkl, nullptr);
  std::vector<uint8_t> bad = good;
  bad[size_t(pkl->data.data() - good.data()) + 40] ^= 0x55;
  EXPECT_NE(error_of([&] { PytorchCheckpoint::from_memory(bad.data(), bad.size(), "bad.bin"); }).find("CRC-32"),
            std::string::npos);
}

// One stored entry in a zip64 archive: sizes and the local header's offset in the zip64 extra
// field, the entry count and directory place in the zip64 end record (what a > 4 GB torch.save
// archive holds). flags: the entry's general-purpose flags (bit 0: encrypted).
std::vector<uint8_t> zip64_archive(const std::string& name, const std::string& data, uint16_t flags = 0) {
  std::vector<uint8_t> z;
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) z.push_back(uint8_t(v >> (8 * i)));
  };
  const uint32_t crc = ZipArchive::crc32(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  put(0x04034b50, 4), put(45, 2), put(flags, 2), put(0, 2), put(0, 4), put(crc, 4);
  put(0xFFFFFFFF, 4), put(0xFFFFFFFF, 4), put(name.size(), 2), put(20, 2);
  z.insert(z.end(), name.begin(), name.end());
  put(1, 2), put(16, 2), put(data.size(), 8), put(data.size(), 8);
  z.insert(z.end(), data.begin(), data.end());
  const uint64_t cd = z.size();
  put(0x02014b50, 4), put(45, 2), put(45, 2), put(flags, 2), put(0, 2), put(0, 4), put(crc, 4);
  put(0xFFFFFFFF, 4), put(0xFFFFFFFF, 4), put(name.size(), 2), put(28, 2), put(0, 2), put(0, 2), put(0, 2), put(0, 4);
  put(0xFFFFFFFF, 4);
  z.insert(z.end(), name.begin(), name.end());
  put(1, 2), put(24, 2), put(data.size(), 8), put(data.size(), 8), put(0, 8);
  const uint64_t cd_size = z.size() - cd, end64 = z.size();
  put(0x06064b50, 4), put(44, 8), put(45, 2), put(45, 2), put(0, 4), put(0, 4), put(1, 8), put(1, 8), put(cd_size, 8),
      put(cd, 8);
  put(0x07064b50, 4), put(0, 4), put(end64, 8), put(1, 4);
  put(0x06054b50, 4), put(0, 2), put(0, 2), put(0xFFFF, 2), put(0xFFFF, 2), put(0xFFFFFFFF, 4), put(0xFFFFFFFF, 4), put(0, 2);
  return z;
}

TEST(ZipReader, ReadsZip64AndRefusesEncryptedEntries) {
  const std::vector<uint8_t> z = zip64_archive("archive/data/0", "hello zip64");
  const ZipArchive zip(z.data(), z.size(), "big.bin");
  ASSERT_EQ(zip.entries().size(), 1u);
  EXPECT_EQ(zip.entries()[0].name, "archive/data/0");
  EXPECT_EQ(std::string(zip.entries()[0].data.begin(), zip.entries()[0].data.end()), "hello zip64");
  EXPECT_TRUE(ZipArchive::crc_ok(zip.entries()[0]));
  const std::vector<uint8_t> enc = zip64_archive("archive/data.pkl", "x", 1);
  EXPECT_NE(error_of([&] { ZipArchive(enc.data(), enc.size(), "enc.bin"); })
                .find("enc.bin: entry 'archive/data.pkl': encrypted entries are not supported"),
            std::string::npos);
  for (size_t n = 0; n < z.size(); ++n)
    EXPECT_EQ(error_of([&] { ZipArchive(z.data(), n, "cut.bin"); }).rfind("cut.bin: ", 0), 0u) << n;
}

TEST(Unpickler, MalformedPicklesGiveClearErrors) {
  auto err = [](std::vector<uint8_t> p) {
    return error_of([&] { unpickle_state_dict(p, "p"); });
  };
  EXPECT_NE(err({0x80, 0x02, '}', 'X', 10, 0, 0, 0, 'a'}).find("pickle truncated at byte 8 (10 bytes needed, 1 left)"), std::string::npos);
  EXPECT_NE(err({0x80, 0x02, 0xff}).find("unknown pickle opcode 0xff at byte 2"), std::string::npos);
  EXPECT_NE(err({0x80, 0x02, 'h', 7}).find("memo entry 7, which was never stored"), std::string::npos);
  EXPECT_NE(err({'a', '.'}).find("empty stack"), std::string::npos);
  EXPECT_NE(err({0x81}).find("NEWOBJ at byte 0 is never emitted by torch.save"), std::string::npos);
  EXPECT_NE(err({'K', 3, '.'}).find("holds a int, not a state dict"), std::string::npos);
  // A dict whose value is not a tensor.
  EXPECT_NE(err({'}', 'X', 1, 0, 0, 0, 'w', 'K', 1, 's', '.'}).find("entry 'w' is a int, not a tensor"),
            std::string::npos);
  // A list appended to itself (a cycle through the memo) costs nothing and frees nothing twice.
  EXPECT_NE(err({']', 'q', 0, 'h', 0, 'a', '.'}).find("holds a list"), std::string::npos);
}

}  // namespace
}  // namespace microspec
