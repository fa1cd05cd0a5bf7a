#include "model/config.h"

#include <cmath>

#include "gguf/gguf.h"
#include "util/error.h"

namespace microspec {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Gemma3:
      return "gemma3";
    case Arch::Llama:
      return "llama";
    case Arch::Qwen2:
      return "qwen2";
  }
  return "?";
}

namespace {

int32_t positive_int(const GgufFile& f, const std::string& key, int64_t limit) {
  int64_t v = f.get_int(key);
  if (v <= 0 || v > limit)
    throw Error(f.name() + ": " + key + " = " + std::to_string(v) + " is out of range (1.." +
                std::to_string(limit) + ")");
  return static_cast<int32_t>(v);
}

}  // namespace

ModelConfig read_model_config(const GgufFile& f) {
  ModelConfig c;
  c.arch_name = std::string(f.get_string("general.architecture"));
  if (c.arch_name == "gemma3")
    c.arch = Arch::Gemma3;
  else if (c.arch_name == "llama")
    c.arch = Arch::Llama;
  else if (c.arch_name == "qwen2")
    c.arch = Arch::Qwen2;
  else
    throw Error(f.name() + ": unsupported architecture '" + c.arch_name +
                "' (supported: gemma3, llama, qwen2)");
  const std::string p = c.arch_name + ".";

  constexpr int64_t kMaxDim = 1 << 20;
  c.n_embd = positive_int(f, p + "embedding_length", kMaxDim);
  c.n_layer = positive_int(f, p + "block_count", 4096);
  c.n_head = positive_int(f, p + "attention.head_count", 4096);
  c.n_head_kv =
      f.has(p + "attention.head_count_kv") ? positive_int(f, p + "attention.head_count_kv", 4096) : c.n_head;
  c.n_ff = positive_int(f, p + "feed_forward_length", kMaxDim);
  c.context_length = positive_int(f, p + "context_length", int64_t(1) << 30);
  if (c.n_head % c.n_head_kv != 0)
    throw Error(f.name() + ": head_count " + std::to_string(c.n_head) +
                " is not a multiple of head_count_kv " + std::to_string(c.n_head_kv));
  if (f.has(p + "attention.key_length")) {
    c.head_dim = positive_int(f, p + "attention.key_length", 65536);
    int64_t vlen = f.get_int_opt(p + "attention.value_length").value_or(c.head_dim);
    if (vlen != c.head_dim)
      throw Error(f.name() + ": key_length " + std::to_string(c.head_dim) + " != value_length " +
                  std::to_string(vlen) + " (not supported)");
  } else {
    if (c.n_embd % c.n_head != 0)
      throw Error(f.name() + ": embedding_length is not a multiple of head_count and key_length is absent");
    c.head_dim = c.n_embd / c.n_head;
  }
  c.n_rot = static_cast<int32_t>(f.get_int_opt(p + "rope.dimension_count").value_or(c.head_dim));
  if (c.n_rot != c.head_dim)
    throw Error(f.name() + ": partial rotary embeddings (rope.dimension_count " + std::to_string(c.n_rot) +
                " != head dim " + std::to_string(c.head_dim) + ") are not supported");
  if (c.head_dim % 2 != 0) throw Error(f.name() + ": head dimension must be even for RoPE");
  c.rms_eps = static_cast<float>(f.get_float(p + "attention.layer_norm_rms_epsilon"));
  if (!(c.rms_eps > 0 && c.rms_eps < 1)) throw Error(f.name() + ": layer_norm_rms_epsilon out of range");
  c.rope_base = static_cast<float>(f.get_float_opt(p + "rope.freq_base").value_or(10000.0));
  if (!(c.rope_base > 1)) throw Error(f.name() + ": rope.freq_base must be > 1");
  if (f.has(p + "rope.scaling.type")) {
    std::string_view type = f.get_string(p + "rope.scaling.type");
    if (type != "none") throw Error(f.name() + ": rope scaling '" + std::string(type) + "' is not supported");
  }
  c.layer_is_sliding.assign(c.n_layer, 0);

  switch (c.arch) {
    case Arch::Gemma3:
      c.rope_style = RopeStyle::Neox;
      c.rope_base_local = 10000.0f;  // Gemma 3's local base is fixed by the architecture
      c.embed_scale = std::sqrt(static_cast<float>(c.n_embd));
      c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      c.sliding_window = static_cast<int32_t>(f.get_int_opt(p + "attention.sliding_window").value_or(0));
      if (c.sliding_window < 0) throw Error(f.name() + ": negative sliding window");
      if (f.has(p + "final_logit_softcapping") || f.has(p + "attn_logit_softcapping"))
        throw Error(f.name() + ": logit soft-capping is not supported");
      // Five sliding-window layers, then one global layer.
      for (int il = 0; il < c.n_layer; ++il) c.layer_is_sliding[il] = c.sliding_window > 0 && (il % 6 < 5);
      break;
    case Arch::Llama:
    case Arch::Qwen2:
      c.rope_style = c.arch == Arch::Qwen2 ? RopeStyle::Neox : RopeStyle::Norm;
      c.rope_base_local = c.rope_base;
      c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      break;
  }
  return c;
}

}  // namespace microspec
