#include "model/config.h"

#include <cmath>

#include "gguf/gguf.h"
#include "util/error.h"

namespace microspec {

// One table of the supported architectures: the GGUF name and the enum.
struct ArchName {
  Arch arch;
  const char* name;
};
constexpr ArchName kArchNames[] = {{Arch::Gemma2, "gemma2"}, {Arch::Gemma3, "gemma3"}, {Arch::Llama, "llama"},
                                   {Arch::Phi3, "phi3"},     {Arch::Qwen2, "qwen2"},   {Arch::Qwen3, "qwen3"}};

const char* arch_name(Arch a) {
  for (const ArchName& n : kArchNames)
    if (n.arch == a) return n.name;
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

// {arch}.attention.sliding_window (llama.cpp's key for Gemma 2/3; microspec's converter writes it
// for Mistral too): keys with qpos - kpos < window are seen. Absent: `absent` (0: no window).
int32_t sliding_window(const GgufFile& f, const std::string& p, int64_t absent) {
  const int64_t w = f.get_int_opt(p + "attention.sliding_window").value_or(absent);
  if (w < 0 || w > (int64_t(1) << 30))
    throw Error(f.name() + ": " + p + "attention.sliding_window = " + std::to_string(w) + " is out of range");
  return static_cast<int32_t>(w);
}

}  // namespace

ModelConfig read_model_config(const GgufFile& f) {
  ModelConfig c;
  c.arch_name = std::string(f.get_string("general.architecture"));
  bool known = false;
  std::string supported;
  for (const ArchName& n : kArchNames) {
    supported += std::string(supported.empty() ? "" : ", ") + n.name;
    if (c.arch_name == n.name) c.arch = n.arch, known = true;
  }
  if (!known)
    throw Error(f.name() + ": unsupported architecture '" + c.arch_name + "' (supported: " + supported +
                "; Mistral files are 'llama')");
  const std::string p = c.arch_name + ".";

  constexpr int64_t kMaxDim = 1 << 20;
  c.n_embd = positive_int(f, p + "embedding_length", kMaxDim);
  c.n_layer = positive_int(f, p + "block_count", 4096);
  c.n_head = positive_int(f, p + "attention.head_count", 4096);
  c.n_head_kv =
      f.has(p + "attention.head_count_kv") ? positive_int(f, p + "attention.head_count_kv", 4096) : c.n_head;
  c.n_ff = positive_int(f, p + "feed_forward_length", kMaxDim);
  c.context_length = positive_int(f, p + "context_length", int64_t(1) << 30);
  c.rope_orig_context = f.has(p + "rope.scaling.original_context_length")
                            ? positive_int(f, p + "rope.scaling.original_context_length", int64_t(1) << 30)
                            : c.context_length;
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
  if (c.n_rot <= 0 || c.n_rot > c.head_dim || c.n_rot % 2 != 0)
    throw Error(f.name() + ": rope.dimension_count " + std::to_string(c.n_rot) +
                " must be even and in 2..head dim " + std::to_string(c.head_dim));
  if (c.head_dim % 2 != 0) throw Error(f.name() + ": head dimension must be even for RoPE");
  c.rms_eps = static_cast<float>(f.get_float(p + "attention.layer_norm_rms_epsilon"));
  if (!(c.rms_eps > 0 && c.rms_eps < 1)) throw Error(f.name() + ": layer_norm_rms_epsilon out of range");
  c.rope_base = static_cast<float>(f.get_float_opt(p + "rope.freq_base").value_or(10000.0));
  if (!(c.rope_base > 1)) throw Error(f.name() + ": rope.freq_base must be > 1");
  // llama.cpp's rope scaling: "linear" (its default) divides positions by rope.scaling.factor on
  // global layers; Llama 3's scaling comes as per-frequency factors (the tensor rope_freqs.weight).
  const std::string scaling(f.get_string_opt(p + "rope.scaling.type").value_or("linear"));
  if (scaling != "none" && scaling != "linear")
    throw Error(f.name() + ": rope scaling '" + scaling + "' is not supported (supported: none, linear)");
  const double factor = f.get_float_opt(p + "rope.scaling.factor").value_or(0.0);
  if (factor < 0 || (factor > 0 && factor < 1e-3))
    throw Error(f.name() + ": rope.scaling.factor " + std::to_string(factor) + " is out of range");
  if (scaling == "linear" && factor > 0) c.rope_freq_scale = static_cast<float>(1.0 / factor);
  c.rope_attn_factor = static_cast<float>(f.get_float_opt(p + "rope.scaling.attn_factor").value_or(1.0));
  if (!(c.rope_attn_factor > 0 && c.rope_attn_factor < 100))
    throw Error(f.name() + ": rope.scaling.attn_factor " + std::to_string(c.rope_attn_factor) + " is out of range");
  c.attn_softcap = static_cast<float>(f.get_float_opt(p + "attn_logit_softcapping").value_or(0.0));
  c.final_softcap = static_cast<float>(f.get_float_opt(p + "final_logit_softcapping").value_or(0.0));
  if (c.attn_softcap < 0 || c.final_softcap < 0) throw Error(f.name() + ": negative logit soft-capping");
  c.layer_is_sliding.assign(c.n_layer, 0);

  c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  c.rope_base_local = c.rope_base;
  switch (c.arch) {
    case Arch::Gemma2:
    case Arch::Gemma3: {
      const bool gemma2 = c.arch == Arch::Gemma2;
      c.rope_style = RopeStyle::Neox;
      c.embed_scale = std::sqrt(static_cast<float>(c.n_embd));
      // As llama.cpp: the 27B models scale q·k by n_embd / n_head (query_pre_attn_scalar) rather
      // than head_dim; llama.cpp recognises them by their layer count.
      if (c.n_layer == (gemma2 ? 46 : 62))
        c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.n_embd / c.n_head));
      // Gemma 2 always soft-caps attention and logits (llama.cpp's defaults 50 and 30 unless the
      // file says); Gemma 3 has no attention cap and caps logits only if the file says.
      if (gemma2 && !f.has(p + "attn_logit_softcapping")) c.attn_softcap = 50.0f;
      if (gemma2 && !f.has(p + "final_logit_softcapping")) c.final_softcap = 30.0f;
      if (!gemma2 && c.attn_softcap != 0.0f) throw Error(f.name() + ": gemma3 has no attention soft-capping");
      // Gemma 2: every other layer slides (window 4096 by default); Gemma 3: five of every six.
      c.sliding_window = sliding_window(f, p, gemma2 ? 4096 : 0);
      c.rope_base_local = static_cast<float>(
          f.get_float_opt(p + "rope.freq_base_swa").value_or(gemma2 ? c.rope_base : 10000.0));
      const int64_t pattern = f.get_int_opt(p + "attention.sliding_window_pattern").value_or(gemma2 ? 2 : 6);
      if (pattern < 0 || pattern > 4096)
        throw Error(f.name() + ": attention.sliding_window_pattern " + std::to_string(pattern) + " is out of range");
      for (int il = 0; il < c.n_layer; ++il)
        c.layer_is_sliding[il] = c.sliding_window > 0 && (pattern == 0 || il % pattern < pattern - 1);
      break;
    }
    case Arch::Llama:
      c.rope_style = RopeStyle::Norm;
      // Mistral's sliding window, on every layer, when the file has the key (microspec's converter
      // writes config.json's sliding_window there). llama.cpp's converter drops it and llama.cpp
      // ignores it: a file without the key attends to the whole context, as in llama.cpp.
      c.sliding_window = sliding_window(f, p, 0);
      c.layer_is_sliding.assign(c.n_layer, c.sliding_window > 0);
      break;
    case Arch::Phi3:
      // llama.cpp disables Phi-3's sliding window (its converters do not describe the layer
      // pattern), so every layer attends to the whole context here too.
      c.rope_style = RopeStyle::Neox;
      break;
    case Arch::Qwen2:
    case Arch::Qwen3:
      c.rope_style = RopeStyle::Neox;
      break;
  }
  c.rope_freq_scale_local = c.arch == Arch::Gemma3 ? 1.0f : c.rope_freq_scale;
  if (c.arch != Arch::Gemma2 && c.attn_softcap != 0.0f)
    throw Error(f.name() + ": attention soft-capping is not supported for " + c.arch_name);

  // The vocabulary: the embedding's rows, as many as the tokenizer's tokens when the file has them.
  const GgufTensor* embd = f.find_tensor("token_embd.weight");
  if (!embd) throw Error(f.name() + ": missing tensor 'token_embd.weight'");
  if (embd->ne.size() != 2) throw Error(f.name() + ": tensor 'token_embd.weight' must be 2-D");
  c.n_vocab = static_cast<int32_t>(embd->ne[1]);
  if (f.has("tokenizer.ggml.tokens")) {
    const size_t n_tok = f.get_string_array("tokenizer.ggml.tokens").size();
    if (n_tok != size_t(c.n_vocab))
      throw Error(f.name() + ": tokenizer has " + std::to_string(n_tok) + " tokens but token_embd has " +
                  std::to_string(c.n_vocab) + " rows");
  }
  return c;
}

}  // namespace microspec
