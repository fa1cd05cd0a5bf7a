#include "draft_head/eagle_checkpoint.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numbers>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/pytorch_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "kernels/kernels.h"
#include "model/model_file.h"
#include "util/error.h"

namespace microspec {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The checkpoint's tensors, from whichever file the folder has.
struct Checkpoint {
  std::string file;
  std::unique_ptr<SafetensorsFile> safetensors;
  std::unique_ptr<PytorchCheckpoint> pytorch;
  const std::vector<CheckpointTensor>& tensors() const {
    return safetensors ? safetensors->tensors() : pytorch->tensors();
  }
  const CheckpointTensor* find(const std::string& name) const {
    return safetensors ? safetensors->find(name) : pytorch->find(name);
  }
};

Checkpoint open_checkpoint(const fs::path& dir) {
  Checkpoint c;
  if (fs::exists(dir / "model.safetensors")) {
    c.file = (dir / "model.safetensors").string();
    c.safetensors = SafetensorsFile::open(c.file);
  } else if (fs::exists(dir / "pytorch_model.bin")) {
    c.file = (dir / "pytorch_model.bin").string();
    c.pytorch = PytorchCheckpoint::open(c.file);
  } else {
    throw Error(dir.string() + ": no model.safetensors or pytorch_model.bin (an EAGLE head folder holds one)");
  }
  return c;
}

json read_config(const fs::path& dir) {
  const fs::path p = dir / "config.json";
  std::ifstream in(p);
  if (!in) throw Error(p.string() + ": cannot open (an EAGLE head folder has a config.json)");
  try {
    json j = json::parse(in);
    if (!j.is_object()) throw Error(p.string() + ": not a JSON object");
    return j;
  } catch (const json::exception& e) {
    throw Error(p.string() + ": invalid JSON: " + e.what());
  }
}

// What the head must match, from the target GGUF.
struct TargetInfo {
  std::string arch;
  int64_t n_embd = 0, n_layer = 0, n_vocab = 0;
};

TargetInfo target_info(const GgufFile& t) {
  TargetInfo info;
  info.arch = std::string(t.get_string("general.architecture"));
  info.n_embd = t.get_int(info.arch + ".embedding_length");
  info.n_layer = t.get_int(info.arch + ".block_count");
  // The vocabulary: the tokenizer's token list, else the embedding rows (a test target has no tokenizer).
  if (t.has("tokenizer.ggml.tokens")) {
    info.n_vocab = static_cast<int64_t>(t.get_string_array("tokenizer.ggml.tokens").size());
  } else if (const GgufTensor* e = t.find_tensor("token_embd.weight"); e && e->ne.size() == 2) {
    info.n_vocab = e->ne[1];
  } else {
    throw Error(t.name() + ": neither tokenizer.ggml.tokens nor token_embd.weight: cannot tell the vocabulary");
  }
  return info;
}

// The head's hyperparameters from config.json (Llama names).
struct HeadConfig {
  int64_t hidden = 0, n_ff = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ctx = 2048, vocab = 0;
  double rms_eps = 1e-6, rope_base = 10000.0;
  std::vector<float> rope_factors;  // llama3 rope scaling: [head_dim / 2] frequency divisors
};

int64_t config_int(const json& c, const std::string& key, const std::string& where) {
  const auto it = c.find(key);
  if (it == c.end() || !it->is_number_integer()) throw Error(where + ": config.json has no integer '" + key + "'");
  return it->get<int64_t>();
}

HeadConfig head_config(const json& c, const std::string& where) {
  HeadConfig h;
  h.hidden = config_int(c, "hidden_size", where);
  h.n_ff = config_int(c, "intermediate_size", where);
  h.n_head = config_int(c, "num_attention_heads", where);
  h.n_head_kv = c.contains("num_key_value_heads") ? config_int(c, "num_key_value_heads", where) : h.n_head;
  h.head_dim = c.contains("head_dim") && c["head_dim"].is_number_integer() ? c["head_dim"].get<int64_t>()
                                                                          : (h.n_head > 0 ? h.hidden / h.n_head : 0);
  h.vocab = config_int(c, "vocab_size", where);
  if (c.contains("max_position_embeddings")) h.n_ctx = config_int(c, "max_position_embeddings", where);
  if (c.contains("rms_norm_eps") && c["rms_norm_eps"].is_number()) h.rms_eps = c["rms_norm_eps"].get<double>();
  if (c.contains("rope_theta") && c["rope_theta"].is_number()) h.rope_base = c["rope_theta"].get<double>();
  if (h.hidden < 1 || h.n_ff < 1 || h.n_head < 1 || h.n_head_kv < 1 || h.n_head % h.n_head_kv || h.head_dim < 2 ||
      h.head_dim % 2)
    throw Error(where + ": config.json sizes are invalid (hidden_size " + std::to_string(h.hidden) + ", heads " +
                std::to_string(h.n_head) + "/" + std::to_string(h.n_head_kv) + ", head_dim " +
                std::to_string(h.head_dim) + ")");
  // Llama 3 rope scaling becomes per-frequency divisors, as llama.cpp's converter writes them.
  const auto rs = c.find("rope_scaling");
  if (rs != c.end() && rs->is_object()) {
    const std::string type = rs->value("rope_type", rs->value("type", std::string()));
    if (type != "llama3" && type != "default")
      throw Error(where + ": rope_scaling type '" + type + "' is not supported (only llama3)");
    if (type == "llama3") {
      const double factor = rs->value("factor", 8.0), low = rs->value("low_freq_factor", 1.0),
                   high = rs->value("high_freq_factor", 4.0),
                   old_ctx = rs->value("original_max_position_embeddings", 8192.0);
      const double low_wavelen = old_ctx / low, high_wavelen = old_ctx / high;
      for (int64_t i = 0; i < h.head_dim; i += 2) {
        const double freq = 1.0 / std::pow(h.rope_base, double(float(i) / float(h.head_dim)));
        const double wavelen = 2 * std::numbers::pi / freq;
        if (wavelen < high_wavelen) {
          h.rope_factors.push_back(1.0f);
        } else if (wavelen > low_wavelen) {
          h.rope_factors.push_back(float(factor));
        } else {
          const double smooth = (old_ctx / wavelen - low) / (high - low);
          h.rope_factors.push_back(float(1.0 / ((1 - smooth) / factor + smooth)));
        }
      }
    }
  }
  return h;
}

// Writes the head: each tensor checked against its expected shape, converted, named.
class HeadWriter {
 public:
  HeadWriter(const Checkpoint& ckpt, GgmlType matrix_type) : ckpt_(ckpt), matrix_type_(matrix_type) {}

  const CheckpointTensor& need(const std::string& name, std::vector<int64_t> shape) {
    const CheckpointTensor* t = ckpt_.find(name);
    if (!t) throw Error(ckpt_.file + ": missing tensor '" + name + "'");
    check_shape(*t, shape);
    used_.insert(name);
    return *t;
  }
  const CheckpointTensor* optional(const std::string& name) {
    const CheckpointTensor* t = ckpt_.find(name);
    if (t) used_.insert(name);
    return t;
  }
  void check_shape(const CheckpointTensor& t, const std::vector<int64_t>& shape) const {
    CheckpointTensor expect;
    expect.shape = shape;
    if (t.shape != shape)
      throw Error(ckpt_.file + ": tensor '" + t.name + "' has shape " + t.shape_text() + ", expected " +
                  expect.shape_text());
  }
  void skip(const std::string& name) { used_.insert(name); }
  // Every checkpoint tensor must have been converted or deliberately skipped.
  void check_all_used() const {
    for (const CheckpointTensor& t : ckpt_.tensors())
      if (!used_.count(t.name))
        throw Error(ckpt_.file + ": unexpected tensor '" + t.name + "' " + t.shape_text() +
                    " (not part of an EAGLE head of this kind)");
  }

  static std::vector<float> values(const CheckpointTensor& t) {
    std::vector<float> v(size_t(t.n_elements()));
    tensor_to_f32(t, v);
    for (float x : v)
      if (!std::isfinite(x)) throw Error("tensor '" + t.name + "' holds a non-finite value");
    return v;
  }

  void vector(const std::string& gguf_name, const CheckpointTensor& t) {
    const std::vector<float> v = values(t);
    add(gguf_name, GgmlType::F32, {int64_t(v.size())}, v.data(), v.size() * 4);
  }
  void vector(const std::string& gguf_name, const std::vector<float>& v) {
    add(gguf_name, GgmlType::F32, {int64_t(v.size())}, v.data(), v.size() * 4);
  }

  // A [rows][cols] weight; permute_heads > 0 reorders each head's rows from rotate-half to
  // interleaved pairs (llama.cpp's LlamaModel.permute).
  void matrix(const std::string& gguf_name, const CheckpointTensor& t, int64_t permute_heads = 0) {
    const int64_t rows = t.shape[0], cols = t.shape[1];
    std::vector<float> w = values(t);
    if (permute_heads > 0) {
      const int64_t hd = rows / permute_heads, half = hd / 2;
      std::vector<float> p(w.size());
      for (int64_t h = 0; h < permute_heads; ++h)
        for (int64_t j = 0; j < half; ++j)
          for (int64_t s = 0; s < 2; ++s)
            std::copy_n(&w[size_t((h * hd + s * half + j) * cols)], cols, &p[size_t((h * hd + 2 * j + s) * cols)]);
      w.swap(p);
    }
    // Q8_0 needs rows in blocks of 32; llama.cpp falls back to F16 otherwise, and so do we.
    const GgmlType type = matrix_type_ == GgmlType::Q8_0 && cols % kQK != 0 ? GgmlType::F16 : matrix_type_;
    const size_t stride = row_bytes(type, cols);
    std::vector<uint8_t> bytes(stride * size_t(rows));
    for (int64_t r = 0; r < rows; ++r) quantize_row_reference(type, &w[size_t(r * cols)], &bytes[size_t(r) * stride], cols);
    writer_.add_tensor(gguf_name, type, {cols, rows}, bytes);
    ++n_tensors_;
  }

  void add(const std::string& gguf_name, GgmlType type, std::vector<int64_t> ne, const void* data, size_t n) {
    writer_.add_tensor(gguf_name, type, std::move(ne), std::span<const uint8_t>(static_cast<const uint8_t*>(data), n));
    ++n_tensors_;
  }

  GgufWriter& gguf() { return writer_; }
  int n_tensors() const { return n_tensors_; }

 private:
  const Checkpoint& ckpt_;
  GgmlType matrix_type_;
  GgufWriter writer_;
  std::set<std::string> used_;
  int n_tensors_ = 0;
};

// The target's tokenizer.* metadata, every value type copied as stored.
void copy_tokenizer(const GgufFile& target, GgufWriter& w) {
  for (const std::string& key : target.keys()) {
    if (key.rfind("tokenizer.", 0) != 0) continue;
    const GgufValue& v = *target.find(key);
    switch (v.type) {
      case GgufType::U8: w.add_u8(key, uint8_t(v.i)); break;
      case GgufType::I8: w.add_i8(key, int8_t(v.i)); break;
      case GgufType::U16: w.add_u16(key, uint16_t(v.i)); break;
      case GgufType::I16: w.add_i16(key, int16_t(v.i)); break;
      case GgufType::U32: w.add_u32(key, uint32_t(v.i)); break;
      case GgufType::I32: w.add_i32(key, int32_t(v.i)); break;
      case GgufType::U64: w.add_u64(key, v.u); break;
      case GgufType::I64: w.add_i64(key, v.i); break;
      case GgufType::F32: w.add_f32(key, float(v.f)); break;
      case GgufType::F64: w.add_f64(key, v.f); break;
      case GgufType::BOOL: w.add_bool(key, v.i != 0); break;
      case GgufType::STRING: w.add_string(key, v.strings.at(0)); break;
      case GgufType::ARRAY:
        if (v.elem_type == GgufType::STRING)
          w.add_string_array(key, std::span<const std::string_view>(v.strings));
        else
          w.add_array(key, v.elem_type, v.array_data, v.count);
        break;
    }
  }
}

void expect_value(const std::string& where, const std::string& what, int64_t head, int64_t target) {
  if (head != target)
    throw Error(where + ": " + what + " is " + std::to_string(head) + ", the target's is " + std::to_string(target));
}

// Metadata both layouts share (llama.cpp's keys under the head's architecture name).
void common_metadata(GgufWriter& w, const std::string& a, const HeadConfig& h, const std::string& name) {
  w.add_string("general.architecture", a);
  w.add_string("general.name", name);
  w.add_u32(a + ".context_length", uint32_t(h.n_ctx));
  w.add_u32(a + ".embedding_length", uint32_t(h.hidden));
  w.add_u32(a + ".feed_forward_length", uint32_t(h.n_ff));
  w.add_u32(a + ".attention.head_count", uint32_t(h.n_head));
  w.add_u32(a + ".attention.head_count_kv", uint32_t(h.n_head_kv));
  w.add_f32(a + ".rope.freq_base", float(h.rope_base));
  w.add_f32(a + ".attention.layer_norm_rms_epsilon", float(h.rms_eps));
  w.add_u32(a + ".attention.key_length", uint32_t(h.head_dim));
  w.add_u32(a + ".attention.value_length", uint32_t(h.head_dim));
  w.add_u32(a + ".block_count", 1);
  w.add_u32(a + ".vocab_size", uint32_t(h.vocab));
  w.add_u32(a + ".rope.dimension_count", uint32_t(h.head_dim));
}

// The decoder layer's tensors under `prefix` (midlayer. or layers.0.), attention input width `in`.
void layer_tensors(HeadWriter& hw, const std::string& prefix, const HeadConfig& h, int64_t in) {
  const int64_t q = h.n_head * h.head_dim, kv = h.n_head_kv * h.head_dim, H = h.hidden;
  hw.matrix("blk.0.attn_q.weight", hw.need(prefix + "self_attn.q_proj.weight", {q, in}), h.n_head);
  hw.matrix("blk.0.attn_k.weight", hw.need(prefix + "self_attn.k_proj.weight", {kv, in}), h.n_head_kv);
  hw.matrix("blk.0.attn_v.weight", hw.need(prefix + "self_attn.v_proj.weight", {kv, in}));
  hw.matrix("blk.0.attn_output.weight", hw.need(prefix + "self_attn.o_proj.weight", {H, q}));
  hw.vector("blk.0.ffn_norm.weight", hw.need(prefix + "post_attention_layernorm.weight", {H}));
  hw.matrix("blk.0.ffn_gate.weight", hw.need(prefix + "mlp.gate_proj.weight", {h.n_ff, H}));
  hw.matrix("blk.0.ffn_up.weight", hw.need(prefix + "mlp.up_proj.weight", {h.n_ff, H}));
  hw.matrix("blk.0.ffn_down.weight", hw.need(prefix + "mlp.down_proj.weight", {H, h.n_ff}));
}

EagleConvertResult convert_eagle3(const json& cfg, const fs::path& dir, const Checkpoint& ckpt, const GgufFile& target,
                                  HeadWriter& hw) {
  const std::string where = (dir / "config.json").string();
  const TargetInfo t = target_info(target);
  const HeadConfig h = head_config(cfg, where);
  // The target's sizes, named: the head reads its features, embeddings and vocabulary.
  const int64_t target_hidden = cfg.contains("target_hidden_size") && cfg["target_hidden_size"].is_number_integer()
                                    ? cfg["target_hidden_size"].get<int64_t>()
                                    : t.n_embd;
  expect_value(where, "target_hidden_size", target_hidden, t.n_embd);
  expect_value(where, "hidden_size (the head reads the target's embeddings)", h.hidden, t.n_embd);
  expect_value(where, "vocab_size", h.vocab, t.n_vocab);
  std::vector<int32_t> layers;
  const json* ids = cfg.contains("eagle_aux_hidden_state_layer_ids") ? &cfg["eagle_aux_hidden_state_layer_ids"]
                    : cfg.contains("eagle_config") && cfg["eagle_config"].is_object() &&
                            cfg["eagle_config"].contains("eagle_aux_hidden_state_layer_ids")
                        ? &cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
                        : nullptr;
  if (ids && ids->is_array()) {
    for (const auto& x : *ids) {
      if (!x.is_number_integer()) throw Error(where + ": eagle_aux_hidden_state_layer_ids must be integers");
      layers.push_back(x.get<int32_t>());
    }
  } else {
    layers = {2, int32_t(t.n_layer / 2), int32_t(t.n_layer - 3)};
  }
  if (layers.size() != 3) throw Error(where + ": EAGLE-3 reads 3 target layers, config.json names " + std::to_string(layers.size()));
  for (int32_t l : layers)
    if (l < 0 || l > t.n_layer)
      throw Error(where + ": target layer " + std::to_string(l) + " is outside the target's " + std::to_string(t.n_layer) +
                  " layers");
  const bool norm_before_residual = cfg.value("norm_before_residual", false);
  const bool norm_before_fc = cfg.value("norm_before_fc", false);
  const int64_t H = h.hidden, F = 3 * target_hidden;

  GgufWriter& w = hw.gguf();
  const std::string a = "eagle3";
  common_metadata(w, a, h, dir.filename().string());
  w.add_i32_array(a + ".target_layers", layers);
  w.add_u32(a + ".target_hidden_size", uint32_t(target_hidden));
  w.add_bool(a + ".norm_before_residual", norm_before_residual);
  w.add_bool(a + ".norm_before_fc", norm_before_fc);
  copy_tokenizer(target, w);

  const std::string prefix = ckpt.find("midlayer.input_layernorm.weight") ? "midlayer." : "layers.0.";
  hw.matrix("fc.weight", hw.need("fc.weight", {H, F}));
  if (const CheckpointTensor* n = hw.optional("input_norm.weight")) {
    hw.check_shape(*n, {F});
    hw.vector("enc.output_norm.weight", *n);
  } else if (norm_before_fc) {
    throw Error(ckpt.file + ": norm_before_fc is set but input_norm.weight is missing");
  }
  hw.vector("blk.0.attn_norm.weight", hw.need(prefix + "input_layernorm.weight", {H}));
  hw.vector("blk.0.attn_norm_2.weight", hw.need(prefix + "hidden_norm.weight", {H}));
  layer_tensors(hw, prefix, h, 2 * H);
  hw.vector("output_norm.weight", hw.need("norm.weight", {H}));
  if (const CheckpointTensor* e = hw.optional("embed_tokens.weight")) {
    hw.check_shape(*e, {t.n_vocab, H});
    hw.matrix("token_embd.weight", *e);
  }
  if (!h.rope_factors.empty()) hw.vector("rope_freqs.weight", h.rope_factors);

  // Own LM head over the draft vocabulary; d2t offsets -> absolute target ids.
  EagleConvertResult r;
  r.version = 3;
  const int64_t n_draft = cfg.contains("draft_vocab_size") ? config_int(cfg, "draft_vocab_size", where) : t.n_vocab;
  if (const CheckpointTensor* lm = hw.optional("lm_head.weight")) {
    hw.check_shape(*lm, {n_draft, H});
    hw.matrix("output.weight", *lm);
    r.n_draft_vocab = int(n_draft);
  }
  if (const CheckpointTensor* d2t = hw.optional("d2t")) {
    hw.check_shape(*d2t, {n_draft});
    if (d2t->dtype != TensorDtype::I64 && d2t->dtype != TensorDtype::I32)
      throw Error(ckpt.file + ": d2t has dtype " + dtype_name(d2t->dtype) + ", expected an integer type");
    std::vector<int64_t> target_ids(static_cast<size_t>(n_draft));
    std::set<int64_t> seen;
    for (int64_t i = 0; i < n_draft; ++i) {
      int64_t off = 0;
      if (d2t->dtype == TensorDtype::I64) {
        std::memcpy(&off, d2t->data.data() + 8 * i, 8);
      } else {
        int32_t o32;
        std::memcpy(&o32, d2t->data.data() + 4 * i, 4);
        off = o32;
      }
      target_ids[size_t(i)] = off + i;
      if (target_ids[size_t(i)] < 0 || target_ids[size_t(i)] >= t.n_vocab)
        throw Error(ckpt.file + ": d2t[" + std::to_string(i) + "] maps to target id " + std::to_string(target_ids[size_t(i)]) +
                    ", outside the target's vocabulary of " + std::to_string(t.n_vocab));
      if (!seen.insert(target_ids[size_t(i)]).second)
        throw Error(ckpt.file + ": d2t maps two draft rows to target id " + std::to_string(target_ids[size_t(i)]));
    }
    hw.add("d2t", static_cast<GgmlType>(27) /* I64 */, {n_draft}, target_ids.data(), target_ids.size() * 8);
  } else if (n_draft != t.n_vocab) {
    throw Error(ckpt.file + ": draft_vocab_size " + std::to_string(n_draft) + " differs from the target's vocabulary " +
                std::to_string(t.n_vocab) + " but there is no d2t mapping");
  }
  hw.skip("t2d");
  hw.check_all_used();
  return r;
}

EagleConvertResult convert_eagle2(const json& cfg, const fs::path& dir, const Checkpoint& ckpt, const GgufFile& target,
                                  HeadWriter& hw) {
  const std::string where = (dir / "config.json").string();
  const TargetInfo t = target_info(target);
  const HeadConfig h = head_config(cfg, where);
  expect_value(where, "hidden_size (EAGLE-2 reads the target's last hidden state)", h.hidden, t.n_embd);
  expect_value(where, "vocab_size", h.vocab, t.n_vocab);
  const int64_t H = h.hidden;
  GgufWriter& w = hw.gguf();
  const std::string a = "eagle2";
  common_metadata(w, a, h, dir.filename().string());
  w.add_u32(a + ".target_hidden_size", uint32_t(t.n_embd));
  copy_tokenizer(target, w);

  hw.matrix("fc.weight", hw.need("fc.weight", {H, 2 * H}));
  if (const CheckpointTensor* b = hw.optional("fc.bias")) {
    hw.check_shape(*b, {H});
    hw.vector("fc.bias", *b);
  }
  for (const char* bias : {"q_proj.bias", "k_proj.bias", "v_proj.bias"})
    if (ckpt.find(std::string("layers.0.self_attn.") + bias))
      throw Error(ckpt.file + ": attention biases (layers.0.self_attn." + bias + ", qkv_bias) are not supported");
  if (ckpt.find("layers.0.input_layernorm.weight"))
    throw Error(ckpt.file + ": layers.0.input_layernorm.weight: an EAGLE-2 head's first layer has no input norm");
  layer_tensors(hw, "layers.0.", h, H);
  if (const CheckpointTensor* e = hw.optional("embed_tokens.weight")) {
    hw.check_shape(*e, {t.n_vocab, H});
    hw.matrix("token_embd.weight", *e);
  }
  if (!h.rope_factors.empty()) hw.vector("rope_freqs.weight", h.rope_factors);
  hw.check_all_used();
  EagleConvertResult r;
  r.version = 2;
  return r;
}

}  // namespace

EagleConvertResult convert_eagle_checkpoint(const EagleConvertOptions& o) {
  if (o.matrix_type != GgmlType::F16 && o.matrix_type != GgmlType::F32 && o.matrix_type != GgmlType::Q8_0)
    throw Error("convert --eagle: matrix type must be f16, f32 or q8_0");
  const fs::path dir(o.checkpoint_dir);
  const json cfg = read_config(dir);
  const Checkpoint ckpt = open_checkpoint(dir);
  // A GGUF file or a Hugging Face folder (translated in memory, weights included: only its sizes and
  // tokenizer are read here).
  const auto target = open_model_file(o.target_path);
  HeadWriter hw(ckpt, o.matrix_type);

  // The kind: fc's input width (3 target features for EAGLE-3, embedding + hidden for EAGLE-2).
  const CheckpointTensor* fc = ckpt.find("fc.weight");
  if (!fc || fc->shape.size() != 2) throw Error(ckpt.file + ": missing tensor 'fc.weight' (not an EAGLE head?)");
  const bool eagle3 = cfg.contains("draft_vocab_size") || ckpt.find("d2t") || fc->shape[1] == 3 * fc->shape[0];
  EagleConvertResult r = eagle3 ? convert_eagle3(cfg, dir, ckpt, *target, hw) : convert_eagle2(cfg, dir, ckpt, *target, hw);
  hw.gguf().write_file(o.output_path);
  r.n_tensors = hw.n_tensors();
  return r;
}

}  // namespace microspec
