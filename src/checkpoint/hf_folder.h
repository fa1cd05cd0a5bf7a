#pragma once
// Hugging Face model folders (config.json, model.safetensors or model.safetensors.index.json with
// its shards, tokenizer.json, tokenizer_config.json) translated into a GGUF with exactly the
// metadata keys, tensor names and tensor layouts that llama.cpp's convert_hf_to_gguf.py writes, so
// every architecture's GGUF loader reads a folder unchanged. One table per architecture says which
// HF `model_type` it is, which config.json keys become which GGUF keys, which tensor names become
// which, and which transforms llama.cpp applies (Llama's Q/K row order for its interleaved RoPE,
// Gemma's stored norm weight + 1).
//
// Bad input is one Error naming the file and the mismatch: a missing shard, a tensor whose shape
// does not match config.json, an unknown model_type, a tokenizer of another vocabulary size, a
// missing config key.
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "kernels/types.h"

namespace microspec {

class GgufWriter;

struct HfFolderOptions {
  // Type of the weight matrices; nullopt keeps the checkpoint's float type (F32, F16 or BF16).
  // Vectors (norms, biases) are always F32. A matrix whose rows do not split into the type's blocks
  // is stored as F16, as llama.cpp's converter does.
  std::optional<GgmlType> weight_type;
  // One-line notices (vision tensors skipped, fallbacks); null prints "note: ..." on stderr.
  std::function<void(const std::string&)> notice;
};

// Whether `path` is a directory holding a config.json.
bool is_hf_folder(const std::string& path);

// The GGUF of the folder `dir` (metadata, tokenizer and tensors), ready to write or parse.
GgufWriter hf_folder_to_gguf(const std::string& dir, const HfFolderOptions& options);

// "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k" (any case);
// throws Error listing these for anything else.
GgmlType parse_weight_type(std::string_view name);

}  // namespace microspec
