#pragma once
// A whole file mapped read-only into memory (GGUF files, safetensors shards): the bytes stay
// valid for the object's lifetime, and the OS pages them in on demand.
#include <cstddef>
#include <cstdint>
#include <string>

namespace microspec {

class MappedFile {
 public:
  // Throws Error("PATH: cannot open ..." / "not a regular file" / "file is empty (0 bytes), not
  // a WHAT") for a path that cannot be mapped; `what` names the expected format.
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(map_); }
  size_t size() const { return size_; }

 private:
  void* map_ = nullptr;
  size_t size_ = 0;
};

}  // namespace microspec
