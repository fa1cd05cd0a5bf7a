#pragma once
// Published EAGLE draft heads (Hugging Face folders: config.json + pytorch_model.bin or
// model.safetensors) converted into the head GGUF the runtime loads (src/draft_head/).
//
// EAGLE-3 (config with draft_vocab_size; fc 3*H_t -> H; tensors fc.weight, midlayer.* (or
// layers.0.*), norm.weight, lm_head.weight, d2t, t2d, optional embed_tokens.weight and
// input_norm.weight) -> llama.cpp's `eagle3` GGUF exactly as its converter writes it
// (llama-cpp-python 0.3.36's convert_hf_to_gguf.py / conversion/llama.py): the same tensor names,
// q/k rows permuted from Hugging Face's rotate-half order to GGUF's interleaved pairs, d2t's
// offsets turned into absolute target ids (d2t[i] + i, each < the target vocabulary, all
// distinct), t2d dropped, norms in F32, the target's tokenizer.* metadata copied in.
//
// EAGLE-2 (fc 2H -> H with bias over [embedding ; target hidden], one Llama decoder layer whose
// input norm is absent, no final norm; SafeAILab/EAGLE's cnets1.py; tensors fc.weight, fc.bias,
// layers.0.*, optional embed_tokens.weight) -> our `eagle2` GGUF (layout in
// draft_head/eagle3_head.h).
//
// The target GGUF fixes what the head must match: its hidden size, vocabulary and layer count are
// read from it and every mismatch is refused naming both values.
#include <string>

#include "kernels/types.h"

namespace microspec {

struct EagleConvertOptions {
  std::string checkpoint_dir;               // config.json + pytorch_model.bin | model.safetensors
  std::string target_path;                  // the target model's GGUF
  std::string output_path;                  // the head GGUF to write
  GgmlType matrix_type = GgmlType::F16;     // F16, F32 or Q8_0 for the matrices (norms stay F32)
};

struct EagleConvertResult {
  int version = 0;        // 2 or 3
  int n_tensors = 0;      // written
  int n_draft_vocab = 0;  // EAGLE-3: rows of its own LM head
};

// Throws Error naming the file and the mismatch.
EagleConvertResult convert_eagle_checkpoint(const EagleConvertOptions& options);

}  // namespace microspec
