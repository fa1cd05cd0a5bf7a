#pragma once
// A model path as the CLI, the server and the drafters take it: a GGUF file (memory-mapped) or a
// Hugging Face folder (translated in memory by checkpoint/hf_folder.h; its GgufFile owns the bytes
// and is named after the folder).
#include <memory>
#include <string>

#include "checkpoint/hf_folder.h"
#include "gguf/gguf.h"

namespace microspec {

// Throws Error for a directory without config.json, and whatever GgufFile::open or the folder's
// translation throws.
std::unique_ptr<GgufFile> open_model_file(const std::string& path, const HfFolderOptions& options = {});

}  // namespace microspec
