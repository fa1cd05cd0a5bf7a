#include "model/model_file.h"

#include <filesystem>
#include <system_error>

#include "gguf/gguf_writer.h"
#include "util/error.h"

namespace microspec {

std::unique_ptr<GgufFile> open_model_file(const std::string& path, const HfFolderOptions& options) {
  if (!is_hf_folder(path)) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
      throw Error(path + ": a directory without config.json (not a Hugging Face folder)");
    return GgufFile::open(path);
  }
  return GgufFile::from_bytes(hf_folder_to_gguf(path, options).take_bytes(), path);
}

}  // namespace microspec
