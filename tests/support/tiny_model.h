#pragma once
// Writes small random models (gemma2, gemma3, llama, phi3, qwen2, qwen3) as GGUF files, with
// llama.cpp's keys and tensor names, for tests that need shapes or features the real models lack:
// a short sliding window, biases, an untied output matrix, q/k norms, soft-capping, Llama 3's
// rope_freqs, phi3's fused QKV and gate/up with partial rotary and LongRoPE factors.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "kernels/kernels.h"
#include "kernels/types.h"
#include "model/model.h"

namespace microspec::test {

struct TinyModelSpec {
  std::string arch = "gemma3";  // gemma2, gemma3, llama, phi3, qwen2, qwen3
  int32_t n_vocab = 320;
  int32_t n_embd = 64;
  int32_t n_layer = 3;
  int32_t n_head = 4;
  int32_t n_head_kv = 2;
  int32_t head_dim = 32;
  int32_t n_ff = 96;
  int32_t sliding_window = 8;  // gemma2 and gemma3 (their layer patterns); llama only with llama_window
  bool llama_window = false;   // llama: write llama.attention.sliding_window (Mistral's: every layer)
  bool untied_output = false;
  bool llama3_rope = false;  // llama: write rope_freqs.weight (frequency divisors 1..8)
  GgmlType weight_type = GgmlType::Q8_0;  // for the 2-D weights (rows must fit its block size)
  uint32_t seed = 1;
  int32_t declared_n_head = 0;  // head_count written to the metadata; 0: n_head (tests of load errors)
};

inline void write_tiny_model(const TinyModelSpec& s, const std::string& path) {
  std::mt19937 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  GgufWriter w;
  const std::string a = s.arch;
  w.add_string("general.architecture", a);
  w.add_u32(a + ".context_length", 4096);
  w.add_u32(a + ".embedding_length", s.n_embd);
  w.add_u32(a + ".block_count", s.n_layer);
  w.add_u32(a + ".feed_forward_length", s.n_ff);
  w.add_u32(a + ".attention.head_count", s.declared_n_head ? s.declared_n_head : s.n_head);
  w.add_u32(a + ".attention.head_count_kv", s.n_head_kv);
  w.add_u32(a + ".attention.key_length", s.head_dim);
  w.add_u32(a + ".attention.value_length", s.head_dim);
  w.add_f32(a + ".attention.layer_norm_rms_epsilon", 1e-6f);
  w.add_f32(a + ".rope.freq_base", a == "gemma3" ? 1e6f : 1e4f);
  if (a == "gemma3" || a == "gemma2" || (a == "llama" && s.llama_window))
    w.add_u32(a + ".attention.sliding_window", s.sliding_window);
  if (a == "gemma2") {
    w.add_f32(a + ".attn_logit_softcapping", 5.0f);
    w.add_f32(a + ".final_logit_softcapping", 20.0f);
  }
  const int32_t n_rot = a == "phi3" ? s.head_dim * 3 / 4 : s.head_dim;  // phi3: partial rotary
  if (a == "phi3") {
    w.add_u32(a + ".rope.dimension_count", n_rot);
    w.add_u32(a + ".rope.scaling.original_context_length", 64);
    w.add_f32(a + ".rope.scaling.attn_factor", 1.1f);
  }

  auto add_matrix = [&](const std::string& name, int64_t cols, int64_t rows, float scale) {
    std::vector<float> f(size_t(cols) * rows);
    for (float& x : f) x = normal(rng) * scale;
    const size_t rb = row_bytes(s.weight_type, cols);
    std::vector<uint8_t> q(rb * rows);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row_reference(s.weight_type, f.data() + r * cols, q.data() + r * rb, cols);
    w.add_tensor(name, s.weight_type, {cols, rows}, q);
  };
  auto add_vector = [&](const std::string& name, int64_t n, float base, float scale) {
    std::vector<float> f(n);
    for (float& x : f) x = base + normal(rng) * scale;
    w.add_tensor(
        name, GgmlType::F32, {n},
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(f.data()), f.size() * sizeof(float)));
  };
  const int32_t d = s.n_embd, qd = s.n_head * s.head_dim, kvd = s.n_head_kv * s.head_dim;
  const float ws = 1.0f / std::sqrt(float(d));
  add_matrix("token_embd.weight", d, s.n_vocab, a == "gemma3" || a == "gemma2" ? 0.1f : 1.0f);
  if (s.untied_output) add_matrix("output.weight", d, s.n_vocab, ws);
  add_vector("output_norm.weight", d, 1.0f, 0.1f);
  if (a == "llama" && s.llama3_rope) add_vector("rope_freqs.weight", s.head_dim / 2, 4.5f, 2.0f);
  if (a == "phi3") {
    add_vector("rope_factors_long.weight", n_rot / 2, 3.0f, 1.0f);
    add_vector("rope_factors_short.weight", n_rot / 2, 1.1f, 0.05f);
  }
  for (int32_t il = 0; il < s.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    add_vector(p + "attn_norm.weight", d, 1.0f, 0.1f);
    if (a == "phi3") {
      add_matrix(p + "attn_qkv.weight", d, qd + 2 * kvd, ws);
    } else {
      add_matrix(p + "attn_q.weight", d, qd, ws);
      add_matrix(p + "attn_k.weight", d, kvd, ws);
      add_matrix(p + "attn_v.weight", d, kvd, ws);
    }
    add_matrix(p + "attn_output.weight", qd, d, 1.0f / std::sqrt(float(qd)));
    add_vector(p + "ffn_norm.weight", d, 1.0f, 0.1f);
    if (a == "phi3") {
      add_matrix(p + "ffn_up.weight", d, 2 * s.n_ff, ws);  // gate rows, then up rows
    } else {
      add_matrix(p + "ffn_gate.weight", d, s.n_ff, ws);
      add_matrix(p + "ffn_up.weight", d, s.n_ff, ws);
    }
    add_matrix(p + "ffn_down.weight", s.n_ff, d, 1.0f / std::sqrt(float(s.n_ff)));
    if (a == "gemma3" || a == "qwen3") {
      add_vector(p + "attn_q_norm.weight", s.head_dim, 1.0f, 0.1f);
      add_vector(p + "attn_k_norm.weight", s.head_dim, 1.0f, 0.1f);
    }
    if (a == "gemma3" || a == "gemma2") {
      add_vector(p + "post_attention_norm.weight", d, 1.0f, 0.1f);
      add_vector(p + "post_ffw_norm.weight", d, 1.0f, 0.1f);
    }
    if (a == "qwen2") {
      add_vector(p + "attn_q.bias", qd, 0.0f, 0.5f);
      add_vector(p + "attn_k.bias", kvd, 0.0f, 0.5f);
      add_vector(p + "attn_v.bias", kvd, 0.0f, 0.5f);
    }
  }
  w.write_file(path);
}

// An SPM vocabulary for the tiny models: <unk>, <s>, </s>, then words "▁w3".."▁w{n-1}", so every
// token prints as text and </s> (2) ends generation. Returns path.
// A tiny model written to `path` and loaded on the CPU (2 threads, batches of 64).
struct TinyLoaded {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
};
inline TinyLoaded load_tiny_model(const TinyModelSpec& spec, const std::string& path) {
  write_tiny_model(spec, path);
  TinyLoaded t;
  t.file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 2;
  opt.n_batch = 64;
  t.model = Model::load(*t.file, opt);
  return t;
}

inline std::string write_tiny_tokenizer(const std::string& path, int32_t n_vocab = 320) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("tokenizer.ggml.model", "llama");
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  for (int32_t i = 3; i < n_vocab; ++i) {
    tokens.push_back("\xe2\x96\x81w" + std::to_string(i));
    types.push_back(1);
  }
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_f32_array("tokenizer.ggml.scores", std::vector<float>(size_t(n_vocab), 0.0f));
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.write_file(path);
  return path;
}

}  // namespace microspec::test
