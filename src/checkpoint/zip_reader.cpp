#include "checkpoint/zip_reader.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "util/error.h"

namespace microspec {

namespace {

constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr size_t kEndBytes = 22, kCentralBytes = 46, kLocalBytes = 30;
constexpr size_t kZip64LocatorBytes = 20, kZip64EndBytes = 56;
constexpr uint64_t kMaxEntries = uint64_t(1) << 20;  // a checkpoint has one entry per storage

// Little-endian reads within [data, data + size); `at` is checked by the caller's bounds test.
uint64_t le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

bool ZipArchive::looks_like_zip(const uint8_t* data, size_t size) {
  return size >= 4 && le(data, 4) == kLocalSig;
}

uint32_t ZipArchive::crc32(std::span<const uint8_t> bytes) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (uint8_t b : bytes) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

const ZipEntry* ZipArchive::find(std::string_view entry_name) const {
  for (const ZipEntry& e : entries_)
    if (e.name == entry_name) return &e;
  return nullptr;
}

ZipArchive::ZipArchive(const uint8_t* data, size_t size, std::string name) : name_(std::move(name)) {
  auto fail = [&](const std::string& what) { throw Error(name_ + ": " + what); };
  auto inside = [&](uint64_t at, uint64_t n) { return at <= size && n <= size - at; };

  // End of central directory: the last signature whose comment reaches exactly the file's end.
  if (size < kEndBytes) fail("too small to be a zip archive (" + std::to_string(size) + " bytes)");
  size_t end = size_t(-1);
  const size_t lowest = size > kEndBytes + 0xFFFF ? size - kEndBytes - 0xFFFF : 0;
  for (size_t at = size - kEndBytes + 1; at-- > lowest;)
    if (le(data + at, 4) == kEndSig && at + kEndBytes + le(data + at + 20, 2) == size) {
      end = at;
      break;
    }
  if (end == size_t(-1)) fail("no zip end-of-central-directory record (truncated or not a zip archive)");
  const uint8_t* e = data + end;
  if (le(e + 4, 2) != 0 || le(e + 6, 2) != 0) fail("split (multi-disk) zip archives are not supported");
  uint64_t n_entries = le(e + 10, 2), cd_size = le(e + 12, 4), cd_offset = le(e + 16, 4);
  if (n_entries == 0xFFFF || cd_size == 0xFFFFFFFF || cd_offset == 0xFFFFFFFF) {
    // Zip64: a locator just before the record points at the zip64 end record.
    if (end < kZip64LocatorBytes || le(data + end - kZip64LocatorBytes, 4) != kZip64LocatorSig)
      fail("zip64 archive without its zip64 end-of-central-directory locator");
    const uint64_t at = le(data + end - kZip64LocatorBytes + 8, 8);
    if (!inside(at, kZip64EndBytes) || le(data + at, 4) != kZip64EndSig)
      fail("zip64 end-of-central-directory record missing or outside the file");
    n_entries = le(data + at + 32, 8);
    cd_size = le(data + at + 40, 8);
    cd_offset = le(data + at + 48, 8);
  }
  if (n_entries > kMaxEntries) fail(std::to_string(n_entries) + " entries is more than a checkpoint holds");
  if (!inside(cd_offset, cd_size)) fail("central directory outside the file (truncated?)");

  // Central directory: name, method, flags, sizes and the local header's offset per entry.
  uint64_t at = cd_offset;
  const uint64_t cd_end = cd_offset + cd_size;
  for (uint64_t i = 0; i < n_entries; ++i) {
    if (at + kCentralBytes > cd_end || le(data + at, 4) != kCentralSig)
      fail("central directory entry " + std::to_string(i) + " is corrupt or truncated");
    const uint8_t* c = data + at;
    const uint64_t flags = le(c + 8, 2), method = le(c + 10, 2);
    uint64_t csize = le(c + 20, 4), usize = le(c + 24, 4), local = le(c + 42, 4);
    const uint64_t n_name = le(c + 28, 2), n_extra = le(c + 30, 2), n_comment = le(c + 32, 2);
    if (at + kCentralBytes + n_name + n_extra + n_comment > cd_end)
      fail("central directory entry " + std::to_string(i) + " runs past the directory");
    ZipEntry entry;
    entry.name.assign(reinterpret_cast<const char*>(c + kCentralBytes), n_name);
    entry.crc32 = static_cast<uint32_t>(le(c + 16, 4));
    const std::string where = "entry '" + entry.name + "': ";
    if (flags & 1) fail(where + "encrypted entries are not supported");
    if (method != 0)
      fail(where + "compressed (method " + std::to_string(method) +
           "); torch.save stores entries uncompressed: re-save the checkpoint with torch.save");
    // Zip64 extra field: the 64-bit values of the fields that hold 0xFFFFFFFF, in this order.
    const uint8_t* x = c + kCentralBytes + n_name;
    for (uint64_t p = 0; p + 4 <= n_extra;) {
      const uint64_t id = le(x + p, 2), len = le(x + p + 2, 2);
      if (p + 4 + len > n_extra) fail(where + "extra field runs past its entry");
      if (id == 1) {
        uint64_t q = p + 4;
        for (uint64_t* field : {&usize, &csize, &local})
          if (*field == 0xFFFFFFFF) {
            if (q + 8 > p + 4 + len) fail(where + "zip64 extra field too short");
            *field = le(x + q, 8);
            q += 8;
          }
      }
      p += 4 + len;
    }
    if (csize != usize)
      fail(where + "stored size " + std::to_string(csize) + " differs from its size " + std::to_string(usize));
    // Local header: its own name and extra lengths place the data.
    if (!inside(local, kLocalBytes) || le(data + local, 4) != kLocalSig)
      fail(where + "local header missing or outside the file (truncated?)");
    const uint64_t l_name = le(data + local + 26, 2), l_extra = le(data + local + 28, 2);
    const uint64_t begin = local + kLocalBytes + l_name + l_extra;
    if (l_name != n_name || std::memcmp(data + local + kLocalBytes, entry.name.data(), n_name) != 0)
      fail(where + "local header names another entry");
    if (!inside(begin, usize))
      fail(where + std::to_string(usize) + " bytes at offset " + std::to_string(begin) + " run past the end of the " +
           std::to_string(size) + "-byte file (truncated?)");
    entry.data = std::span<const uint8_t>(data + begin, usize);
    entries_.push_back(std::move(entry));
    at += kCentralBytes + n_name + n_extra + n_comment;
  }
}

}  // namespace microspec
