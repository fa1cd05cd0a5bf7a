#pragma once
// The zip container PyTorch's torch.save writes (PyTorchStreamWriter, a miniz writer): every entry
// stored uncompressed and 64-byte aligned, so a tensor's bytes are a view into the mapped file.
// This reader takes only what such archives use: the end-of-central-directory record (zip64 when
// sizes or counts overflow 32 bits), the central directory and each entry's local header. A
// compressed or encrypted entry, a split archive or an entry outside the file is refused with an
// Error naming the archive and the entry. Entry data are bounds-checked views; the CRC-32 is
// checked by crc_ok() on demand (PyTorchCheckpoint checks the pickle, not the large storages).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace microspec {

struct ZipEntry {
  std::string name;
  uint32_t crc32 = 0;
  std::span<const uint8_t> data;  // [size] the stored bytes
};

class ZipArchive {
 public:
  // `data` must outlive the object; `name` prefixes every error.
  ZipArchive(const uint8_t* data, size_t size, std::string name);

  const std::string& name() const { return name_; }
  const std::vector<ZipEntry>& entries() const { return entries_; }  // central-directory order
  const ZipEntry* find(std::string_view entry_name) const;           // null if absent

  static bool looks_like_zip(const uint8_t* data, size_t size);  // a local-header signature first
  static uint32_t crc32(std::span<const uint8_t> bytes);
  static bool crc_ok(const ZipEntry& e) { return crc32(e.data) == e.crc32; }

 private:
  std::string name_;
  std::vector<ZipEntry> entries_;
};

}  // namespace microspec
