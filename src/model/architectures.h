#pragma once
// Factories of the architecture-specific models (one file each).
#include <memory>

namespace microspec {

class GgufFile;
class Model;
struct ModelOptions;

std::unique_ptr<Model> make_gemma2(const GgufFile& file, const ModelOptions& options);  // gemma2.cpp
std::unique_ptr<Model> make_gemma3(const GgufFile& file, const ModelOptions& options);  // gemma3.cpp
std::unique_ptr<Model> make_llama(const GgufFile& file,
                                  const ModelOptions& options);  // llama.cpp: llama (and Mistral), qwen2
std::unique_ptr<Model> make_phi3(const GgufFile& file, const ModelOptions& options);   // phi3.cpp
std::unique_ptr<Model> make_qwen3(const GgufFile& file, const ModelOptions& options);  // qwen3.cpp

}  // namespace microspec
