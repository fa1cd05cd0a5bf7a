#include "checkpoint/hf_folder.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numbers>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "kernels/kernels.h"
#include "util/error.h"
#include "util/file.h"

namespace microspec {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// The architecture tables.

// The sizes a tensor's shape is made of, read from config.json.
enum class Dim { Vocab, Embd, QDim, KvDim, HeadDim, Ff, Ff2, QkvDim };

// One tensor inside a layer: HF name after "model.layers.N.", GGUF name after "blk.N.", and the
// shape config.json implies, in PyTorch order ([out][in]; one entry for vectors).
struct LayerTensor {
  const char* hf;
  const char* gguf;
  std::vector<Dim> shape;
};

// One config.json key copied to a GGUF key ("{arch}." + gguf).
enum class KeyKind { U32, F32 };
enum class IfAbsent { Error, Skip, WriteZero };
struct ConfigKey {
  const char* hf;
  const char* gguf;
  KeyKind kind;
  IfAbsent if_absent;
};

struct HfArch {
  std::vector<const char*> model_types;  // config.json model_type values
  const char* gguf_arch;                 // general.architecture
  bool permute_qk;                       // Llama: Q/K rows reordered for llama.cpp's interleaved RoPE
  float norm_shift;                      // Gemma: stored norm weight = HF weight + 1
  bool write_vocab_size;                 // llama writes {arch}.vocab_size
  bool write_rope_dims;                  // {arch}.rope.dimension_count (partial_rotary_factor * head dim)
  bool trim_embeddings_to_tokenizer;     // Gemma 3: token_embd keeps only the tokenizer's rows
  bool default_head_dim_256;             // Gemma: key/value length written even when config.json omits it
  bool write_rope_base;                  // {arch}.rope.freq_base (llama.cpp leaves it out for Gemma 2)
  std::vector<ConfigKey> extra_keys;
  std::vector<LayerTensor> layer_tensors;
};

const std::vector<ConfigKey> kCommonKeys = {
    {"max_position_embeddings", "context_length", KeyKind::U32, IfAbsent::Error},
    {"hidden_size", "embedding_length", KeyKind::U32, IfAbsent::Error},
    {"num_hidden_layers", "block_count", KeyKind::U32, IfAbsent::Error},
    {"intermediate_size", "feed_forward_length", KeyKind::U32, IfAbsent::Error},
    {"num_attention_heads", "attention.head_count", KeyKind::U32, IfAbsent::Error},
    {"num_key_value_heads", "attention.head_count_kv", KeyKind::U32, IfAbsent::Skip},
    {"rms_norm_eps", "attention.layer_norm_rms_epsilon", KeyKind::F32, IfAbsent::Error},
};

std::vector<LayerTensor> attention_tensors(bool with_bias, bool with_qk_norm) {
  std::vector<LayerTensor> t = {
      {"self_attn.q_proj.weight", "attn_q.weight", {Dim::QDim, Dim::Embd}},
      {"self_attn.k_proj.weight", "attn_k.weight", {Dim::KvDim, Dim::Embd}},
      {"self_attn.v_proj.weight", "attn_v.weight", {Dim::KvDim, Dim::Embd}},
      {"self_attn.o_proj.weight", "attn_output.weight", {Dim::Embd, Dim::QDim}},
  };
  if (with_bias) {
    t.push_back({"self_attn.q_proj.bias", "attn_q.bias", {Dim::QDim}});
    t.push_back({"self_attn.k_proj.bias", "attn_k.bias", {Dim::KvDim}});
    t.push_back({"self_attn.v_proj.bias", "attn_v.bias", {Dim::KvDim}});
  }
  if (with_qk_norm) {
    t.push_back({"self_attn.q_norm.weight", "attn_q_norm.weight", {Dim::HeadDim}});
    t.push_back({"self_attn.k_norm.weight", "attn_k_norm.weight", {Dim::HeadDim}});
  }
  return t;
}

const std::vector<LayerTensor> kGatedMlp = {
    {"mlp.gate_proj.weight", "ffn_gate.weight", {Dim::Ff, Dim::Embd}},
    {"mlp.up_proj.weight", "ffn_up.weight", {Dim::Ff, Dim::Embd}},
    {"mlp.down_proj.weight", "ffn_down.weight", {Dim::Embd, Dim::Ff}},
};

// Pre-norm blocks (Llama, Qwen, Mistral, Phi-3): post_attention_layernorm is the FFN's input norm.
const std::vector<LayerTensor> kPreNorms = {
    {"input_layernorm.weight", "attn_norm.weight", {Dim::Embd}},
    {"post_attention_layernorm.weight", "ffn_norm.weight", {Dim::Embd}},
};

// Gemma 2/3 sandwich norms: each sub-block has a norm before and after.
const std::vector<LayerTensor> kSandwichNorms = {
    {"input_layernorm.weight", "attn_norm.weight", {Dim::Embd}},
    {"post_attention_layernorm.weight", "post_attention_norm.weight", {Dim::Embd}},
    {"pre_feedforward_layernorm.weight", "ffn_norm.weight", {Dim::Embd}},
    {"post_feedforward_layernorm.weight", "post_ffw_norm.weight", {Dim::Embd}},
};

std::vector<LayerTensor> concat(std::initializer_list<std::vector<LayerTensor>> parts) {
  std::vector<LayerTensor> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

// Llama and Mistral: the same GGUF architecture. Mistral's sliding window (null in Mistral 7B
// v0.2+'s configs: none) is kept as llama.attention.sliding_window, which llama.cpp's converter
// drops; transformers' Llama has no window, so a `llama` config's sliding_window is not read.
HfArch llama_family(std::vector<const char*> model_types, std::vector<ConfigKey> extra_keys) {
  return {.model_types = std::move(model_types),
          .gguf_arch = "llama",
          .permute_qk = true,
          .norm_shift = 0.0f,
          .write_vocab_size = true,
          .write_rope_dims = true,
          .trim_embeddings_to_tokenizer = false,
          .default_head_dim_256 = false,
          .write_rope_base = true,
          .extra_keys = std::move(extra_keys),
          .layer_tensors = concat({attention_tensors(false, false), kGatedMlp, kPreNorms})};
}

const std::vector<HfArch>& architectures() {
  static const std::vector<HfArch> table = {
      llama_family({"llama"}, {}),
      llama_family({"mistral"}, {{"sliding_window", "attention.sliding_window", KeyKind::U32, IfAbsent::Skip}}),
      {.model_types = {"qwen2"},
       .gguf_arch = "qwen2",
       .permute_qk = false,
       .norm_shift = 0.0f,
       .write_vocab_size = false,
       .write_rope_dims = false,
       .trim_embeddings_to_tokenizer = false,
       .default_head_dim_256 = false,
       .write_rope_base = true,
       .extra_keys = {},
       .layer_tensors = concat({attention_tensors(true, false), kGatedMlp, kPreNorms})},
      {.model_types = {"qwen3"},
       .gguf_arch = "qwen3",
       .permute_qk = false,
       .norm_shift = 0.0f,
       .write_vocab_size = false,
       .write_rope_dims = false,
       .trim_embeddings_to_tokenizer = false,
       .default_head_dim_256 = false,
       .write_rope_base = true,
       .extra_keys = {},
       .layer_tensors = concat({attention_tensors(false, true), kGatedMlp, kPreNorms})},
      {.model_types = {"gemma3_text", "gemma3"},
       .gguf_arch = "gemma3",
       .permute_qk = false,
       .norm_shift = 1.0f,
       .write_vocab_size = false,
       .write_rope_dims = false,
       .trim_embeddings_to_tokenizer = true,
       .default_head_dim_256 = true,
       .write_rope_base = true,
       .extra_keys = {{"sliding_window", "attention.sliding_window", KeyKind::U32, IfAbsent::Skip},
                      {"final_logit_softcapping", "final_logit_softcapping", KeyKind::F32, IfAbsent::Skip}},
       .layer_tensors = concat({attention_tensors(false, true), kGatedMlp, kSandwichNorms})},
      {.model_types = {"gemma2"},
       .gguf_arch = "gemma2",
       .permute_qk = false,
       .norm_shift = 1.0f,
       .write_vocab_size = false,
       .write_rope_dims = false,
       .trim_embeddings_to_tokenizer = false,
       .default_head_dim_256 = true,
       .write_rope_base = false,
       .extra_keys = {{"sliding_window", "attention.sliding_window", KeyKind::U32, IfAbsent::Skip},
                      {"attn_logit_softcapping", "attn_logit_softcapping", KeyKind::F32, IfAbsent::Skip},
                      {"final_logit_softcapping", "final_logit_softcapping", KeyKind::F32, IfAbsent::Skip}},
       .layer_tensors = concat({attention_tensors(false, false), kGatedMlp, kSandwichNorms})},
      {.model_types = {"phi3"},
       .gguf_arch = "phi3",
       .permute_qk = false,
       .norm_shift = 0.0f,
       .write_vocab_size = false,
       .write_rope_dims = true,
       .trim_embeddings_to_tokenizer = false,
       .default_head_dim_256 = false,
       .write_rope_base = true,
       .extra_keys = {{"sliding_window", "attention.sliding_window", KeyKind::U32, IfAbsent::WriteZero},
                      {"original_max_position_embeddings", "rope.scaling.original_context_length", KeyKind::U32,
                       IfAbsent::Skip}},
       .layer_tensors = concat({{{"self_attn.qkv_proj.weight", "attn_qkv.weight", {Dim::QkvDim, Dim::Embd}},
                                 {"self_attn.o_proj.weight", "attn_output.weight", {Dim::Embd, Dim::QDim}},
                                 {"mlp.gate_up_proj.weight", "ffn_up.weight", {Dim::Ff2, Dim::Embd}},
                                 {"mlp.down_proj.weight", "ffn_down.weight", {Dim::Embd, Dim::Ff}}},
                                kPreNorms})},
  };
  return table;
}

// Tensors outside the layers, the same for every architecture.
struct GlobalTensor {
  const char* hf;
  const char* gguf;
  std::vector<Dim> shape;
};
const std::vector<GlobalTensor> kGlobalTensors = {
    {"model.embed_tokens.weight", "token_embd.weight", {Dim::Vocab, Dim::Embd}},
    {"model.norm.weight", "output_norm.weight", {Dim::Embd}},
    {"lm_head.weight", "output.weight", {Dim::Vocab, Dim::Embd}},
};

// Name prefixes of multimodal checkpoints: the language model's are rewritten to the text-only
// names, the vision tower's are skipped.
const std::pair<const char*, const char*> kTextPrefixes[] = {
    {"model.language_model.", "model."},
    {"language_model.model.", "model."},
    {"language_model.lm_head.", "lm_head."},
};
const char* const kVisionPrefixes[] = {"model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                                       "multi_modal_projector.", "vision_model.", "model.vision_model."};

// ---------------------------------------------------------------------------------------------
// JSON files.

json read_json(const fs::path& path) {
  if (!fs::is_regular_file(path)) throw Error(path.string() + ": missing");
  const std::string text = read_file_bytes(path.string());
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(path.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// config.json with the text model's settings at the top (multimodal checkpoints nest them in
// text_config) and the file's name for errors.
struct HfConfig {
  json values;
  std::string file;

  const json* find(const char* key) const {
    auto it = values.find(key);
    return it == values.end() || it->is_null() ? nullptr : &*it;
  }
  int64_t get_int(const char* key) const {
    const json* v = find(key);
    if (!v) throw Error(file + ": missing key '" + key + "'");
    if (!v->is_number_integer()) throw Error(file + ": '" + key + "' is not an integer: " + v->dump());
    return v->get<int64_t>();
  }
  int64_t get_positive(const char* key) const {
    const int64_t v = get_int(key);
    if (v <= 0 || v > (int64_t(1) << 31) - 1)
      throw Error(file + ": '" + key + "' = " + std::to_string(v) + " is out of range");
    return v;
  }
  double get_float(const char* key) const {
    const json* v = find(key);
    if (!v) throw Error(file + ": missing key '" + key + "'");
    if (!v->is_number()) throw Error(file + ": '" + key + "' is not a number: " + v->dump());
    return v->get<double>();
  }
};

HfConfig read_config(const fs::path& dir) {
  HfConfig c{read_json(dir / "config.json"), (dir / "config.json").string()};
  if (!c.values.is_object()) throw Error(c.file + ": not a JSON object");
  if (auto it = c.values.find("text_config"); it != c.values.end() && it->is_object()) {
    // Multimodal: the text model's settings, with the outer file's values where it has none.
    json text = *it;
    for (auto& [k, v] : c.values.items())
      if (!text.contains(k) && k != "text_config" && k != "vision_config") text[k] = v;
    if (!it->contains("model_type")) text["model_type"] = c.values["model_type"];
    c.values = std::move(text);
  }
  return c;
}

const HfArch& find_arch(const HfConfig& c) {
  const json* mt = c.find("model_type");
  if (!mt || !mt->is_string()) throw Error(c.file + ": missing key 'model_type' (the architecture)");
  const std::string type = mt->get<std::string>();
  std::string known;
  for (const HfArch& a : architectures())
    for (const char* t : a.model_types) {
      if (type == t) return a;
      known += (known.empty() ? "" : ", ") + std::string(t);
    }
  throw Error(c.file + ": unknown architecture model_type '" + type + "' (supported: " + known + ")");
}

// ---------------------------------------------------------------------------------------------
// Model settings.

struct Dims {
  int64_t vocab, embd, n_head, n_head_kv, head_dim, ff, n_layer;

  int64_t of(Dim d) const {
    switch (d) {
      case Dim::Vocab:
        return vocab;
      case Dim::Embd:
        return embd;
      case Dim::QDim:
        return n_head * head_dim;
      case Dim::KvDim:
        return n_head_kv * head_dim;
      case Dim::HeadDim:
        return head_dim;
      case Dim::Ff:
        return ff;
      case Dim::Ff2:
        return 2 * ff;
      case Dim::QkvDim:
        return (n_head + 2 * n_head_kv) * head_dim;
    }
    return 0;
  }
};

Dims read_dims(const HfConfig& c, const HfArch& arch) {
  Dims d{};
  d.vocab = c.get_positive("vocab_size");
  d.embd = c.get_positive("hidden_size");
  d.n_head = c.get_positive("num_attention_heads");
  d.n_head_kv = c.find("num_key_value_heads") ? c.get_positive("num_key_value_heads") : d.n_head;
  d.ff = c.get_positive("intermediate_size");
  d.n_layer = c.get_positive("num_hidden_layers");
  if (c.find("head_dim"))
    d.head_dim = c.get_positive("head_dim");
  else if (arch.default_head_dim_256)
    d.head_dim = 256;
  else if (d.embd % d.n_head == 0)
    d.head_dim = d.embd / d.n_head;
  else
    throw Error(c.file + ": hidden_size " + std::to_string(d.embd) + " is not a multiple of num_attention_heads " +
                std::to_string(d.n_head) + " and head_dim is absent");
  if (d.head_dim > 65536 || d.head_dim % 2 != 0)
    throw Error(c.file + ": head dimension " + std::to_string(d.head_dim) + " is odd or above 65536");
  if (d.n_head % d.n_head_kv != 0)
    throw Error(c.file + ": num_attention_heads " + std::to_string(d.n_head) +
                " is not a multiple of num_key_value_heads " + std::to_string(d.n_head_kv));
  return d;
}

// RoPE settings: transformers 5 keeps them in rope_parameters (per attention kind for Gemma 3),
// older files in rope_theta / rope_scaling.
struct Rope {
  std::optional<double> theta, theta_swa;
  std::string type = "default";
  json params;  // the full-attention parameters (factor, low_freq_factor, ...)
};

Rope read_rope(const HfConfig& c) {
  Rope r;
  json params = json::object();
  if (const json* p = c.find("rope_parameters"); p && p->is_object()) {
    params = p->contains("full_attention") ? (*p)["full_attention"] : *p;
    if (p->contains("sliding_attention") && (*p)["sliding_attention"].contains("rope_theta"))
      r.theta_swa = (*p)["sliding_attention"]["rope_theta"].get<double>();
  }
  if (const json* s = c.find("rope_scaling"); s && s->is_object())
    for (auto& [k, v] : s->items()) params[k] = v;
  if (params.contains("rope_theta") && params["rope_theta"].is_number()) r.theta = params["rope_theta"].get<double>();
  if (c.find("rope_theta")) r.theta = c.get_float("rope_theta");
  if (!r.theta_swa && c.find("rope_local_base_freq")) r.theta_swa = c.get_float("rope_local_base_freq");
  for (const char* key : {"rope_type", "type"})
    if (params.contains(key) && params[key].is_string()) r.type = params[key].get<std::string>();
  r.params = params;
  return r;
}

double rope_param(const Rope& r, const HfConfig& c, const char* key) {
  if (!r.params.contains(key) || !r.params[key].is_number())
    throw Error(c.file + ": rope scaling '" + r.type + "' without '" + key + "'");
  return r.params[key].get<double>();
}

// Llama 3's frequency scaling as llama.cpp stores it: one factor per rotated pair (rope_freqs.weight).
std::vector<float> llama3_rope_factors(const Rope& r, const HfConfig& c, int64_t head_dim, double theta) {
  const double factor = rope_param(r, c, "factor");
  const double low = rope_param(r, c, "low_freq_factor");
  const double high = rope_param(r, c, "high_freq_factor");
  const double old_ctx = rope_param(r, c, "original_max_position_embeddings");
  const double low_wavelen = old_ctx / low, high_wavelen = old_ctx / high;
  std::vector<float> factors(static_cast<size_t>(head_dim / 2));  // [head_dim / 2]
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double freq = 1.0 / std::pow(theta, double(2 * i) / double(head_dim));
    const double wavelen = 2 * std::numbers::pi / freq;
    if (wavelen < high_wavelen) {
      factors[i] = 1.0f;
    } else if (wavelen > low_wavelen) {
      factors[i] = float(factor);
    } else {
      const double smooth = (old_ctx / wavelen - low) / (high - low);
      factors[i] = float(1.0 / ((1 - smooth) / factor + smooth));
    }
  }
  return factors;
}

// The share of each head's dimensions that is rotated: top-level in older configs, among the RoPE
// parameters in transformers 5's.
double partial_rotary_factor(const HfConfig& c, const Rope& r) {
  if (c.find("partial_rotary_factor")) return c.get_float("partial_rotary_factor");
  if (r.params.contains("partial_rotary_factor") && r.params["partial_rotary_factor"].is_number())
    return r.params["partial_rotary_factor"].get<double>();
  return 1.0;
}

int64_t rotary_dims(const HfConfig& c, const Rope& r, const Dims& d) {
  return std::lround(partial_rotary_factor(c, r) * double(d.head_dim));
}

bool is_longrope(const Rope& r) {
  return r.type == "longrope" || r.type == "su";
}

// LongRoPE's pretraining context: a RoPE parameter in transformers 5's configs, top-level before.
double longrope_original_context(const Rope& r, const HfConfig& c) {
  if (r.params.contains("original_max_position_embeddings")) return rope_param(r, c, "original_max_position_embeddings");
  return c.get_float("original_max_position_embeddings");
}

// LongRoPE's scale on cos and sin (transformers' rule): attention_factor when given, else from the
// context extension factor (`factor`, or max_position_embeddings / the original context):
// sqrt(1 + ln(factor) / ln(original context)), 1 when the factor is at most 1.
double longrope_attn_factor(const Rope& r, const HfConfig& c) {
  if (r.params.contains("attention_factor") && r.params["attention_factor"].is_number())
    return r.params["attention_factor"].get<double>();
  const double original = longrope_original_context(r, c);
  const double factor = r.params.contains("factor") && r.params["factor"].is_number()
                            ? r.params["factor"].get<double>()
                            : c.get_float("max_position_embeddings") / original;
  return factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(factor) / std::log(original));
}

// LongRoPE's per-frequency divisors (long_factor or short_factor): one per rotated pair.
std::vector<float> longrope_factors(const Rope& r, const HfConfig& c, const char* key, int64_t n_rot) {
  if (!r.params.contains(key) || !r.params[key].is_array())
    throw Error(c.file + ": rope scaling '" + r.type + "' without the list '" + key + "'");
  const json& list = r.params[key];
  if (int64_t(list.size()) != n_rot / 2)
    throw Error(c.file + ": rope scaling " + key + " has " + std::to_string(list.size()) +
                " entries, expected " + std::to_string(n_rot / 2) + " (rotated dimensions / 2)");
  std::vector<float> factors;  // [n_rot / 2]
  for (const json& v : list) {
    if (!v.is_number() || !(v.get<double>() > 0))
      throw Error(c.file + ": rope scaling " + key + " holds " + v.dump() + ", not a positive number");
    factors.push_back(v.get<float>());
  }
  return factors;
}

// Settings llama.cpp's loaders do not read but that change the model: refused rather than ignored.
void check_supported_settings(const HfConfig& c, const HfArch& arch, const Dims& d) {
  // Qwen's window (layers from max_window_layers on, when use_sliding_window is true) has no GGUF
  // form and no loader here: refused rather than run without it.
  if (const json* qwen_swa = c.find("use_sliding_window");
      qwen_swa && *qwen_swa == true && std::string(arch.gguf_arch).starts_with("qwen"))
    throw Error(c.file + ": use_sliding_window is true: Qwen's sliding window is not supported");
  if (std::string(arch.gguf_arch) == "gemma3") {
    if (c.find("query_pre_attn_scalar") && c.get_float("query_pre_attn_scalar") != double(d.head_dim))
      throw Error(c.file + ": query_pre_attn_scalar " + c.find("query_pre_attn_scalar")->dump() +
                  " != head_dim " + std::to_string(d.head_dim) + " (not supported)");
    // llama.cpp's Gemma 3: five sliding-window layers, then one global layer.
    if (const json* types = c.find("layer_types"); types && types->is_array() && c.find("sliding_window")) {
      for (size_t il = 0; il < types->size(); ++il) {
        const bool sliding = (*types)[il] == "sliding_attention";
        if (sliding != (il % 6 < 5))
          throw Error(c.file + ": layer_types[" + std::to_string(il) + "] = " + (*types)[il].dump() +
                      " differs from Gemma 3's pattern of five sliding-window layers then one global layer");
      }
    }
  }
}

void add_config_key(GgufWriter& w, const HfConfig& c, const std::string& prefix, const ConfigKey& k) {
  if (!c.find(k.hf)) {
    if (k.if_absent == IfAbsent::Error) throw Error(c.file + ": missing key '" + k.hf + "'");
    if (k.if_absent == IfAbsent::WriteZero) w.add_u32(prefix + k.gguf, 0);
    return;
  }
  if (k.kind == KeyKind::U32)
    w.add_u32(prefix + k.gguf, static_cast<uint32_t>(c.get_positive(k.hf)));
  else
    w.add_f32(prefix + k.gguf, static_cast<float>(c.get_float(k.hf)));
}

void add_model_metadata(GgufWriter& w, const HfConfig& c, const HfArch& arch, const Dims& d, const Rope& rope,
                        const std::string& name) {
  const std::string p = std::string(arch.gguf_arch) + ".";
  w.add_string("general.architecture", arch.gguf_arch);
  w.add_string("general.name", name);
  for (const ConfigKey& k : kCommonKeys) add_config_key(w, c, p, k);
  if (!c.find("num_key_value_heads")) w.add_u32(p + "attention.head_count_kv", uint32_t(d.n_head_kv));
  if (c.find("head_dim") || arch.default_head_dim_256) {
    w.add_u32(p + "attention.key_length", uint32_t(d.head_dim));
    w.add_u32(p + "attention.value_length", uint32_t(d.head_dim));
  }
  if (arch.write_vocab_size) w.add_u32(p + "vocab_size", uint32_t(d.vocab));
  if (arch.write_rope_dims) w.add_u32(p + "rope.dimension_count", uint32_t(rotary_dims(c, rope, d)));
  if (rope.theta && arch.write_rope_base) w.add_f32(p + "rope.freq_base", float(*rope.theta));
  if (rope.theta_swa) w.add_f32(p + "rope.freq_base_swa", float(*rope.theta_swa));
  if (rope.type == "linear") {
    w.add_string(p + "rope.scaling.type", "linear");
    w.add_f32(p + "rope.scaling.factor", float(rope_param(rope, c, "factor")));
  } else if (rope.type == "yarn") {
    w.add_string(p + "rope.scaling.type", "yarn");
    w.add_f32(p + "rope.scaling.factor", float(rope_param(rope, c, "factor")));
    w.add_u32(p + "rope.scaling.original_context_length",
              uint32_t(rope_param(rope, c, "original_max_position_embeddings")));
  } else if (is_longrope(rope)) {
    // The divisors themselves are tensors (rope_factors_long/short.weight), written with the others.
    if (std::string(arch.gguf_arch) != "phi3")
      throw Error(c.file + ": rope type '" + rope.type + "' on architecture " + arch.gguf_arch + " is not supported");
    w.add_f32(p + "rope.scaling.attn_factor", float(longrope_attn_factor(rope, c)));
    if (!c.find("original_max_position_embeddings"))
      w.add_u32(p + "rope.scaling.original_context_length", uint32_t(longrope_original_context(rope, c)));
  } else if (rope.type != "default" && rope.type != "llama3") {
    throw Error(c.file + ": rope type '" + rope.type + "' is not supported");
  }
  for (const ConfigKey& k : arch.extra_keys) add_config_key(w, c, p, k);
}

// ---------------------------------------------------------------------------------------------
// Checkpoint tensors.

// The safetensors files of the folder, and which file holds each tensor.
struct Checkpoint {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<const CheckpointTensor*> tensors;  // every tensor, in file order
};

Checkpoint open_checkpoint(const fs::path& dir) {
  Checkpoint ck;
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const json j = read_json(index);
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(index.string() + ": missing 'weight_map'");
    std::map<std::string, std::vector<std::string>> by_shard;  // shard -> tensor names it should hold
    for (auto& [tensor, shard] : j["weight_map"].items()) {
      if (!shard.is_string()) throw Error(index.string() + ": weight_map[" + tensor + "] is not a file name");
      by_shard[shard.get<std::string>()].push_back(tensor);
    }
    for (const auto& [shard, names] : by_shard) {
      const fs::path path = dir / shard;
      if (shard.find('/') != std::string::npos || !fs::is_regular_file(path))
        throw Error(index.string() + ": shard " + shard + " (holding " + names.front() + ") is missing");
      ck.files.push_back(SafetensorsFile::open(path.string()));
      for (const std::string& n : names)
        if (!ck.files.back()->find(n))
          throw Error(path.string() + ": tensor " + n + " listed in " + index.filename().string() + " is absent");
    }
  } else if (fs::exists(single)) {
    ck.files.push_back(SafetensorsFile::open(single.string()));
  } else {
    throw Error(dir.string() + ": no model.safetensors or model.safetensors.index.json");
  }
  for (const auto& f : ck.files)
    for (const CheckpointTensor& t : f->tensors()) ck.tensors.push_back(&t);
  return ck;
}

// One checkpoint tensor with its GGUF name and the shape config.json implies.
struct MappedTensor {
  const CheckpointTensor* source;
  std::string file;  // the shard, for errors
  std::string gguf_name;
  std::vector<int64_t> expected;  // PyTorch order
  int layer = -1;                 // -1: outside the layers
};

std::vector<int64_t> shape_of(const std::vector<Dim>& dims, const Dims& d) {
  std::vector<int64_t> s;
  for (Dim x : dims) s.push_back(d.of(x));
  return s;
}

// The GGUF name of an HF tensor name, or nullopt when it is not a model weight at all.
std::optional<MappedTensor> map_tensor(const std::string& raw_name, const HfArch& arch, const Dims& d,
                                       const std::string& file) {
  std::string name = raw_name;
  for (const auto& [from, to] : kTextPrefixes)
    if (name.starts_with(from)) {
      name = to + name.substr(std::string_view(from).size());
      break;
    }
  if (name.ends_with("rotary_emb.inv_freq")) return std::nullopt;  // a buffer, recomputed from the config
  for (const GlobalTensor& g : kGlobalTensors)
    if (name == g.hf) return MappedTensor{nullptr, file, g.gguf, shape_of(g.shape, d), -1};
  const std::string layers = "model.layers.";
  if (name.starts_with(layers)) {
    const size_t dot = name.find('.', layers.size());
    const std::string num = name.substr(layers.size(), dot == std::string::npos ? 0 : dot - layers.size());
    if (!num.empty() && num.size() < 6 && std::all_of(num.begin(), num.end(), ::isdigit)) {
      const int layer = std::stoi(num);
      if (layer >= d.n_layer)
        throw Error(file + ": tensor " + raw_name + " belongs to layer " + num + " but num_hidden_layers is " +
                    std::to_string(d.n_layer));
      const std::string rest = name.substr(dot + 1);
      for (const LayerTensor& t : arch.layer_tensors)
        if (rest == t.hf)
          return MappedTensor{nullptr, file, "blk." + num + "." + t.gguf, shape_of(t.shape, d), layer};
    }
  }
  throw Error(file + ": tensor " + raw_name + " has no GGUF name for architecture " + arch.gguf_arch);
}

bool is_vision_tensor(const std::string& name) {
  return std::any_of(std::begin(kVisionPrefixes), std::end(kVisionPrefixes),
                     [&](const char* p) { return name.starts_with(p); });
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// Llama's Q/K rows: HF pairs dimension i with i + head_dim/2 (rotate-half); llama.cpp's NORM rope
// pairs 2i with 2i+1, so row i of each head's first half goes to 2i and of the second half to 2i+1.
void permute_rows_for_norm_rope(std::vector<float>& w, int64_t rows, int64_t cols, int64_t n_heads) {
  const int64_t hd = rows / n_heads, half = hd / 2;
  std::vector<float> out(w.size());  // [rows][cols]
  for (int64_t h = 0; h < n_heads; ++h)
    for (int64_t j = 0; j < half; ++j)
      for (int64_t part = 0; part < 2; ++part) {
        const float* src = w.data() + (h * hd + part * half + j) * cols;
        std::copy(src, src + cols, out.data() + (h * hd + 2 * j + part) * cols);
      }
  w.swap(out);
}

GgmlType float_type_of(TensorDtype d) {
  switch (d) {
    case TensorDtype::F16:
      return GgmlType::F16;
    case TensorDtype::BF16:
      return GgmlType::BF16;
    default:
      return GgmlType::F32;
  }
}

// The stored bytes of one tensor: transforms applied, in the type chosen for it.
std::vector<uint8_t> convert_tensor(const MappedTensor& m, const HfArch& arch, const Dims& d, GgmlType type,
                                    int64_t keep_rows) {
  const CheckpointTensor& t = *m.source;
  const int64_t cols = t.shape.size() == 2 ? t.shape[1] : t.shape[0];
  const int64_t rows = t.shape.size() == 2 ? keep_rows : 1;
  const bool is_norm = m.gguf_name.ends_with("norm.weight");
  const bool permute = arch.permute_qk && (m.gguf_name.ends_with("attn_q.weight") || m.gguf_name.ends_with("attn_k.weight"));
  const bool transformed = (is_norm && arch.norm_shift != 0.0f) || permute || rows * cols != t.n_elements();
  if (!transformed && float_type_of(t.dtype) == type && t.dtype != TensorDtype::F64)
    return std::vector<uint8_t>(t.data.begin(), t.data.end());

  std::vector<float> values(static_cast<size_t>(t.n_elements()));  // [shape] as float32
  tensor_to_f32(t, values);
  values.resize(size_t(rows * cols));
  if (is_norm && arch.norm_shift != 0.0f)
    for (float& v : values) v += arch.norm_shift;
  if (permute)
    permute_rows_for_norm_rope(values, rows, cols, m.gguf_name.ends_with("attn_q.weight") ? d.n_head : d.n_head_kv);
  std::vector<uint8_t> out(row_bytes(type, cols) * size_t(rows));
  for (int64_t r = 0; r < rows; ++r)
    quantize_row_reference(type, values.data() + r * cols, out.data() + size_t(r) * row_bytes(type, cols), cols);
  return out;
}

// ---------------------------------------------------------------------------------------------
// The tokenizer.

// llama.cpp's token types.
enum TokenType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// Pre-tokenizer regexes as tokenizer.json spells them, and the names llama.cpp gives them.
struct KnownSplit {
  const char* pattern;
  const char* pre;
};
const KnownSplit kKnownSplits[] = {
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     "llama-bpe"},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     "qwen2"},
};

// The pre-tokenizer's name (tokenizer.ggml.pre), recognised from its structure in tokenizer.json.
std::string pre_tokenizer_name(const json& tok, const std::string& file) {
  const json pre = tok.value("pre_tokenizer", json());
  std::vector<json> steps;
  if (pre.is_object() && pre.value("type", "") == "Sequence")
    steps = pre.value("pretokenizers", std::vector<json>{});
  else if (pre.is_object())
    steps = {pre};
  auto is = [](const json& s, const char* type) { return s.is_object() && s.value("type", "") == type; };
  if (steps.size() == 2 && is(steps[0], "Split") && is(steps[1], "ByteLevel") &&
      !steps[1].value("use_regex", true)) {
    const json& pattern = steps[0]["pattern"];
    const std::string regex = pattern.is_object() ? pattern.value("Regex", pattern.value("String", "")) : "";
    for (const KnownSplit& k : kKnownSplits)
      if (regex == k.pattern) return k.pre;
    throw Error(file + ": pre-tokenizer regex " + json(regex).dump() + " is not one microspec knows");
  }
  if (steps.size() == 1 && is(steps[0], "ByteLevel") && steps[0].value("use_regex", true)) return "gpt-2";
  if (steps.size() == 2 && is(steps[0], "Digits") && steps[0].value("individual_digits", false) &&
      is(steps[1], "ByteLevel") && steps[1].value("use_regex", true))
    return "smollm";
  throw Error(file + ": pre-tokenizer " + pre.dump().substr(0, 200) + " is not one microspec knows");
}

// SentencePiece-style tokenizer.json: spaces become U+2581 (a Replace normalizer, or a Metaspace
// pre-tokenizer), optionally with one prepended at the start (Prepend normalizer, or Metaspace's
// prepend_scheme). Returns whether it is prepended (tokenizer.ggml.add_space_prefix).
bool sentencepiece_space_prefix(const json& normalizer, const json& pre, const std::string& file) {
  static const std::string kMarker = "\xE2\x96\x81";
  bool replaces = false, prepends = false;
  std::vector<json> steps;
  if (normalizer.is_object() && normalizer.value("type", "") == "Sequence")
    steps = normalizer.value("normalizers", std::vector<json>{});
  else if (normalizer.is_object())
    steps = {normalizer};
  for (const json& n : steps) {
    const std::string type = n.value("type", "");
    if (type == "Prepend" && n.value("prepend", "") == kMarker) {
      prepends = true;
    } else if (type == "Replace" && n.value("content", "") == kMarker && n.contains("pattern") &&
               n["pattern"].value("String", "") == " ") {
      replaces = true;
    } else {
      throw Error(file + ": normalizer step " + n.dump().substr(0, 120) + " is not supported");
    }
  }
  if (pre.is_object() && pre.value("type", "") == "Metaspace" && pre.value("replacement", "") == kMarker) {
    replaces = true;
    prepends = prepends || pre.value("prepend_scheme", "always") != "never";
  } else if (!pre.is_null()) {
    throw Error(file + ": pre-tokenizer " + pre.dump().substr(0, 120) + " of a SentencePiece-style tokenizer is not supported");
  }
  if (!replaces) throw Error(file + ": SentencePiece-style tokenizer without the space-to-U+2581 rule");
  return prepends;
}

bool has_byte_level(const json& j) {
  if (j.is_object()) {
    if (j.value("type", "") == "ByteLevel") return true;
    for (auto& [k, v] : j.items())
      if (has_byte_level(v)) return true;
  } else if (j.is_array()) {
    for (const json& v : j)
      if (has_byte_level(v)) return true;
  }
  return false;
}

// A special token's text from tokenizer_config.json: a string or {"content": ...}.
std::optional<std::string> token_text(const json& cfg, const char* key) {
  if (!cfg.contains(key)) return std::nullopt;
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

// Whether the post-processor's single-sequence template starts (add_bos) or ends (add_eos) with
// the given special token.
std::optional<bool> template_adds(const json& post, const std::string& token, bool at_start) {
  if (!post.is_object()) return std::nullopt;
  if (post.value("type", "") == "Sequence") {
    for (const json& p : post.value("processors", std::vector<json>{}))
      if (auto r = template_adds(p, token, at_start)) return r;
    return std::nullopt;
  }
  if (post.value("type", "") != "TemplateProcessing") return std::nullopt;
  const json single = post.value("single", json::array());
  if (!single.is_array() || single.empty()) return false;
  const json& item = at_start ? single.front() : single.back();
  return item.contains("SpecialToken") && item["SpecialToken"].value("id", "") == token;
}

// Writes the tokenizer keys; returns the number of tokens written.
int64_t add_tokenizer(GgufWriter& w, const fs::path& dir, const HfConfig& config, const HfArch& arch,
                      int64_t n_vocab, const std::function<void(const std::string&)>& notice) {
  const fs::path tok_path = dir / "tokenizer.json";
  const std::string tok_file = tok_path.string();
  const json tok = read_json(tok_path);
  const json model = tok.value("model", json());
  if (!model.is_object() || model.value("type", "") != "BPE")
    throw Error(tok_file + ": tokenizer model type " + model.value("type", std::string("(none)")) +
                " is not supported (byte-level BPE only)");
  const bool byte_level = has_byte_level(tok);
  if (!byte_level && !model.value("byte_fallback", false))
    throw Error(tok_file + ": a BPE tokenizer that is neither byte-level nor byte-fallback (SentencePiece "
                           "style) is not supported");
  const json normalizer = tok.value("normalizer", json());
  bool add_space_prefix = false;
  if (byte_level) {
    // Qwen's NFC normalizer: llama.cpp does not apply it either; text already in NFC (most text)
    // is unaffected, decomposed accents may split differently.
    if (normalizer.is_object() && normalizer.value("type", "") == "NFC")
      notice(tok_file + ": its NFC normalizer is not applied (as in llama.cpp): text not in NFC may tokenize "
                        "differently");
    else if (!normalizer.is_null())
      throw Error(tok_file + ": normalizer " + normalizer.dump().substr(0, 120) + " is not supported");
  } else {
    add_space_prefix = sentencepiece_space_prefix(normalizer, tok.value("pre_tokenizer", json()), tok_file);
  }

  std::map<int64_t, std::pair<std::string, int32_t>> by_id;  // id -> (text, type)
  if (!model.contains("vocab") || !model["vocab"].is_object()) throw Error(tok_file + ": model.vocab is missing");
  for (auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0) throw Error(tok_file + ": vocab entry " + text + " has a bad id");
    by_id[id.get<int64_t>()] = {text, kNormal};
  }
  for (const json& a : tok.value("added_tokens", std::vector<json>{})) {
    const int64_t id = a.value("id", int64_t(-1));
    const std::string text = a.value("content", "");
    if (id < 0) throw Error(tok_file + ": added token " + text + " has a bad id");
    const bool special = a.value("special", false) || (text.starts_with("<|") && text.ends_with("|>"));
    by_id[id] = {text, special ? kControl : kUserDefined};
  }
  const int64_t max_id = by_id.empty() ? -1 : by_id.rbegin()->first;
  if (max_id >= n_vocab)
    throw Error(tok_file + ": token id " + std::to_string(max_id) + " (" + std::to_string(by_id.size()) +
                " tokens) does not fit vocab_size " + std::to_string(n_vocab) + " of " + config.file);
  const int64_t n_tokens = arch.trim_embeddings_to_tokenizer ? max_id + 1 : n_vocab;

  std::vector<std::string> tokens(static_cast<size_t>(n_tokens));  // [n_tokens]
  std::vector<int32_t> types(size_t(n_tokens), kUnused);
  for (int64_t i = 0; i < n_tokens; ++i) {
    auto it = by_id.find(i);
    if (it == by_id.end()) {
      tokens[i] = "[PAD" + std::to_string(i) + "]";
    } else {
      tokens[i] = it->second.first;
      types[i] = it->second.second;
    }
  }

  std::vector<std::string> merges;
  for (const json& m : model.value("merges", std::vector<json>{})) {
    if (m.is_string())
      merges.push_back(m.get<std::string>());
    else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
      merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    else
      throw Error(tok_file + ": a merge is neither \"a b\" nor [\"a\", \"b\"]: " + m.dump());
  }

  if (byte_level) {
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", pre_tokenizer_name(tok, tok_file));
    w.add_string_array("tokenizer.ggml.tokens", tokens);
    w.add_i32_array("tokenizer.ggml.token_type", types);
    w.add_string_array("tokenizer.ggml.merges", merges);
  } else {
    // SentencePiece style: llama.cpp merges the adjacent pair whose concatenation scores highest,
    // HF the pair of the lowest-ranked merge; a token's score is minus the rank of the first merge
    // that makes it, so both pick the same pair. Byte tokens <0xXX> are typed as such.
    std::map<std::string, int64_t, std::less<>> id_of_text;
    for (int64_t i = 0; i < n_tokens; ++i) id_of_text.emplace(tokens[i], i);
    std::vector<float> scores(static_cast<size_t>(n_tokens), -float(merges.size()));  // [n_tokens]
    for (size_t rank = merges.size(); rank-- > 0;) {
      const std::string& m = merges[rank];
      const size_t space = m.find(' ');
      if (auto it = id_of_text.find(m.substr(0, space) + m.substr(space + 1)); it != id_of_text.end())
        scores[it->second] = -float(rank);
    }
    const std::string unk = model.value("unk_token", json()).is_string() ? model["unk_token"].get<std::string>() : "";
    for (int64_t i = 0; i < n_tokens; ++i) {
      const std::string& t = tokens[i];
      if (types[i] != kNormal) continue;
      if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>' && std::isxdigit(t[3]) && std::isxdigit(t[4]))
        types[i] = kByte;
      else if (t == unk)
        types[i] = kUnknown;
    }
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string("tokenizer.ggml.pre", "default");
    w.add_string_array("tokenizer.ggml.tokens", tokens);
    w.add_f32_array("tokenizer.ggml.scores", scores);
    w.add_i32_array("tokenizer.ggml.token_type", types);
    w.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix);
  }

  // Special tokens: tokenizer_config.json names them by text; config.json's ids fill the gaps.
  const fs::path cfg_path = dir / "tokenizer_config.json";
  const json tcfg = fs::exists(cfg_path) ? read_json(cfg_path) : json::object();
  auto id_of = [&](const std::string& text) -> std::optional<int64_t> {
    for (int64_t i = 0; i < n_tokens; ++i)
      if (tokens[i] == text) return i;
    return std::nullopt;
  };
  struct Special {
    const char* config_key;
    const char* config_id_key;
    const char* gguf_key;
  };
  const Special specials[] = {{"bos_token", "bos_token_id", "tokenizer.ggml.bos_token_id"},
                              {"eos_token", "eos_token_id", "tokenizer.ggml.eos_token_id"},
                              {"unk_token", nullptr, "tokenizer.ggml.unknown_token_id"},
                              {"pad_token", "pad_token_id", "tokenizer.ggml.padding_token_id"}};
  std::map<std::string, std::string> special_text;  // config key -> token text
  for (const Special& s : specials) {
    std::optional<int64_t> id;
    if (auto text = token_text(tcfg, s.config_key)) {
      id = id_of(*text);
      if (!id) throw Error(cfg_path.string() + ": " + s.config_key + " " + *text + " is not in " + tok_file);
      special_text[s.config_key] = *text;
    } else if (s.config_id_key && config.find(s.config_id_key)) {
      const json& v = *config.find(s.config_id_key);
      const json& first = v.is_array() && !v.empty() ? v[0] : v;
      if (first.is_number_integer()) id = first.get<int64_t>();
    }
    if (id && *id >= 0 && *id < n_tokens) w.add_u32(s.gguf_key, uint32_t(*id));
  }
  const json post = tok.value("post_processor", json());
  auto add_flag = [&](const char* key, const char* special, bool at_start) {
    std::optional<bool> v;
    if (tcfg.contains(key) && tcfg[key].is_boolean())
      v = tcfg[key].get<bool>();
    else if (special_text.count(special))
      v = template_adds(post, special_text[special], at_start);
    w.add_bool(std::string("tokenizer.ggml.") + key, v.value_or(false));
  };
  add_flag("add_bos_token", "bos_token", true);
  add_flag("add_eos_token", "eos_token", false);

  std::optional<std::string> chat_template;
  if (tcfg.contains("chat_template")) {
    const json& t = tcfg["chat_template"];
    if (t.is_string()) chat_template = t.get<std::string>();
    if (t.is_array())
      for (const json& named : t)
        if (named.value("name", "") == "default" && named.contains("template"))
          chat_template = named["template"].get<std::string>();
  }
  if (!chat_template && fs::exists(dir / "chat_template.jinja"))
    chat_template = read_file_bytes((dir / "chat_template.jinja").string());
  if (chat_template) w.add_string("tokenizer.chat_template", *chat_template);
  return n_tokens;
}

std::string folder_name(const fs::path& dir) {
  const fs::path p = dir.has_filename() ? dir : dir.parent_path();
  return p.filename().string();
}

// llama.cpp's file type (general.file_type) of a file whose matrices are mostly `t`.
uint32_t llama_file_type(GgmlType t) {
  switch (t) {
    case GgmlType::F16:
      return 1;
    case GgmlType::Q4_0:
      return 2;
    case GgmlType::Q4_1:
      return 3;
    case GgmlType::Q8_0:
      return 7;
    case GgmlType::Q5_0:
      return 8;
    case GgmlType::Q5_1:
      return 9;
    case GgmlType::Q4_K:
      return 14;
    case GgmlType::Q5_K:
      return 16;
    case GgmlType::Q6_K:
      return 18;
    case GgmlType::BF16:
      return 32;
    default:
      return 0;
  }
}

void default_notice(const std::string& text) { std::fprintf(stderr, "note: %s\n", text.c_str()); }

}  // namespace

bool is_hf_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / "config.json", ec);
}

GgufWriter hf_folder_to_gguf(const std::string& dir_text, const HfFolderOptions& options) {
  const fs::path dir(dir_text);
  const auto notice = options.notice ? options.notice : default_notice;
  const HfConfig config = read_config(dir);
  const HfArch& arch = find_arch(config);
  const Dims dims = read_dims(config, arch);
  check_supported_settings(config, arch, dims);
  const Rope rope = read_rope(config);

  // Tensors: named, shape-checked against config.json, in GGUF order (globals, then layer by layer).
  // First, so that the sizes config.json gives are backed by the checkpoint before anything is
  // sized by them.
  const Checkpoint ck = open_checkpoint(dir);
  std::vector<MappedTensor> mapped;
  int64_t n_vision = 0;
  for (size_t f = 0; f < ck.files.size(); ++f)
    for (const CheckpointTensor& t : ck.files[f]->tensors()) {
      if (is_vision_tensor(t.name)) {
        ++n_vision;
        continue;
      }
      std::optional<MappedTensor> m = map_tensor(t.name, arch, dims, ck.files[f]->name());
      if (!m) continue;
      m->source = &t;
      if (t.shape != m->expected)
        throw Error(m->file + ": tensor " + t.name + " has shape " + t.shape_text() + " but " + config.file +
                    " implies " + shape_text(m->expected));
      mapped.push_back(std::move(*m));
    }
  if (n_vision > 0)
    notice(dir_text + ": skipped " + std::to_string(n_vision) + " vision tensors (text model only)");
  auto order = [](const MappedTensor& m) {
    if (m.gguf_name == "token_embd.weight") return std::pair<int, std::string>{-2, m.gguf_name};
    if (m.layer < 0) return std::pair<int, std::string>{1 << 30, m.gguf_name};
    return std::pair<int, std::string>{m.layer, m.gguf_name};
  };
  std::sort(mapped.begin(), mapped.end(), [&](const MappedTensor& a, const MappedTensor& b) { return order(a) < order(b); });
  if (mapped.empty() || mapped.front().gguf_name != "token_embd.weight")
    throw Error(dir_text + ": the checkpoint has no token embedding (model.embed_tokens.weight)");

  GgufWriter w;
  add_model_metadata(w, config, arch, dims, rope, folder_name(dir));
  const int64_t n_tokens = add_tokenizer(w, dir, config, arch, dims.vocab, notice);

  if (rope.type == "llama3") {
    if (std::string(arch.gguf_arch) != "llama")
      throw Error(config.file + ": rope type 'llama3' on architecture " + arch.gguf_arch + " is not supported");
    const std::vector<float> factors = llama3_rope_factors(rope, config, dims.head_dim, rope.theta.value_or(10000.0));
    w.add_tensor("rope_freqs.weight", GgmlType::F32, {int64_t(factors.size())},
                 std::span(reinterpret_cast<const uint8_t*>(factors.data()), factors.size() * 4));
  }
  if (is_longrope(rope)) {
    const int64_t n_rot = rotary_dims(config, rope, dims);
    for (const auto& [key, name] : {std::pair{"long_factor", "rope_factors_long.weight"},
                                    std::pair{"short_factor", "rope_factors_short.weight"}}) {
      const std::vector<float> factors = longrope_factors(rope, config, key, n_rot);  // [n_rot / 2]
      w.add_tensor(name, GgmlType::F32, {int64_t(factors.size())},
                   std::span(reinterpret_cast<const uint8_t*>(factors.data()), factors.size() * 4));
    }
  }
  int64_t n_fallback = 0;
  std::optional<uint32_t> file_type;  // general.file_type: from the first matrix's type
  for (const MappedTensor& m : mapped) {
    const CheckpointTensor& t = *m.source;
    const bool matrix = t.shape.size() == 2;
    const bool vocab_rows = m.gguf_name == "token_embd.weight" || m.gguf_name == "output.weight";
    const int64_t rows = matrix ? (vocab_rows ? n_tokens : t.shape[0]) : 1;
    GgmlType type = matrix ? options.weight_type.value_or(float_type_of(t.dtype)) : GgmlType::F32;
    if (matrix && t.shape[1] % type_traits(type).block_elems != 0) {
      type = GgmlType::F16;
      ++n_fallback;
    }
    const std::vector<uint8_t> bytes = convert_tensor(m, arch, dims, type, rows);
    std::vector<int64_t> ne(t.shape.rbegin(), t.shape.rend());
    if (matrix) ne[1] = rows;
    w.add_tensor(m.gguf_name, type, ne, bytes);
    if (!file_type) file_type = llama_file_type(type);
  }
  if (n_fallback > 0)
    notice(std::to_string(n_fallback) + " matrices have rows that do not split into " +
           type_traits(*options.weight_type).name + " blocks: stored as F16");
  w.add_u32("general.file_type", file_type.value_or(0));
  return w;
}

GgmlType parse_weight_type(std::string_view name) {
  static const std::pair<const char*, GgmlType> kTypes[] = {
      {"f32", GgmlType::F32},   {"f16", GgmlType::F16},   {"bf16", GgmlType::BF16}, {"q8_0", GgmlType::Q8_0},
      {"q4_0", GgmlType::Q4_0}, {"q4_1", GgmlType::Q4_1}, {"q5_0", GgmlType::Q5_0}, {"q5_1", GgmlType::Q5_1},
      {"q4_k", GgmlType::Q4_K}, {"q5_k", GgmlType::Q5_K}, {"q6_k", GgmlType::Q6_K},
  };
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  std::string known;
  for (const auto& [n, t] : kTypes) {
    if (lower == n) return t;
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  throw Error("weight type '" + std::string(name) + "' is not one of " + known);
}

}  // namespace microspec
