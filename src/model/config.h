#pragma once
// Hyperparameters of a model, read from GGUF metadata and checked for consistency.
#include <cstdint>
#include <string>
#include <vector>

namespace microspec {

class GgufFile;

// The architectures, named as llama.cpp's `general.architecture` names them. Mistral files are
// `llama` (llama.cpp's converter writes MistralForCausalLM as llama and drops its sliding window;
// microspec's keeps it as llama.attention.sliding_window, which slides every layer).
enum class Arch { Gemma2, Gemma3, Llama, Phi3, Qwen2, Qwen3 };
enum class RopeStyle { Norm, Neox };  // Norm pairs (2i, 2i+1); Neox pairs (i, i + n_rot/2)

struct ModelConfig {
  Arch arch = Arch::Llama;
  std::string arch_name;
  int32_t n_vocab = 0;
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t n_ff = 0;
  int32_t n_rot = 0;           // rotated dimensions per head (rope.dimension_count; < head_dim: partial rotary)
  int32_t context_length = 0;  // training context
  int32_t rope_orig_context = 0;  // rope.scaling.original_context_length, else context_length
  float rms_eps = 1e-5f;
  float rope_base = 10000.0f;        // global layers
  float rope_base_local = 10000.0f;  // sliding-window layers (Gemma 3: rope.freq_base_swa, else 10000)
  float rope_freq_scale = 1.0f;      // global layers: 1 / rope.scaling.factor of linear scaling
  float rope_freq_scale_local = 1.0f;  // sliding-window layers (Gemma 3's are never scaled)
  float rope_attn_factor = 1.0f;       // rope.scaling.attn_factor: multiplies cos and sin (Phi-3 LongRoPE)
  RopeStyle rope_style = RopeStyle::Norm;
  float embed_scale = 1.0f;               // Gemma multiplies embeddings by sqrt(n_embd)
  float attn_scale = 1.0f;                // applied to q·k
  float attn_softcap = 0.0f;              // > 0: scores become cap * tanh(score / cap) (Gemma 2)
  float final_softcap = 0.0f;             // > 0: logits become cap * tanh(logit / cap) (Gemma 2)
  int32_t sliding_window = 0;             // 0: no sliding-window layers; else a query at position i
                                          // sees keys at j with i - j < sliding_window
  std::vector<uint8_t> layer_is_sliding;  // [n_layer] (Gemma 2/3: their patterns; llama: all or none)

  int32_t q_dim() const { return n_head * head_dim; }
  int32_t kv_dim() const { return n_head_kv * head_dim; }
};

// Throws Error naming the file and key for missing or inconsistent values.
ModelConfig read_model_config(const GgufFile& file);
const char* arch_name(Arch a);

}  // namespace microspec
