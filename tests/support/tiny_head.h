#pragma once
// Writes small random EAGLE-3 draft heads in llama.cpp's eagle3 GGUF layout (see
// draft_head/eagle3_head.h) for tests: every value a test may want to get wrong is a field.
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gguf/gguf_writer.h"
#include "kernels/kernels.h"
#include "kernels/types.h"

namespace microspec::test {

struct TinyHeadSpec {
  int32_t n_embd = 64;         // the head's hidden size (must be the target's)
  int32_t target_hidden = 64;  // eagle3.target_hidden_size
  std::vector<int32_t> target_layers = {0, 1, 2};
  int32_t n_head = 4;
  int32_t n_head_kv = 2;
  int32_t head_dim = 16;
  int32_t n_ff = 96;
  int32_t n_vocab_tokens = 0;     // > 0: write a tokenizer.ggml.tokens list of this many tokens
  int64_t fc_cols = 0;            // 0: 3 * target_hidden (the truth); else the shape fc claims
  std::string nan_tensor;         // a tensor whose first element is NaN
  GgmlType weight_type = GgmlType::F16;
  float scale = 1.0f;             // multiplies every random matrix
  int64_t own_lm_rows = 0;        // > 0: an own LM head (output.weight) of this many rows
  std::vector<int64_t> d2t;       // written as the I64 tensor d2t when not empty (absolute target ids)
  uint32_t seed = 5;
};

inline void write_tiny_head(const TinyHeadSpec& s, const std::string& path) {
  std::mt19937 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  GgufWriter w;
  const std::string a = "eagle3.";
  w.add_string("general.architecture", "eagle3");
  w.add_u32(a + "context_length", 2048);
  w.add_u32(a + "embedding_length", s.n_embd);
  w.add_u32(a + "block_count", 1);
  w.add_u32(a + "feed_forward_length", s.n_ff);
  w.add_u32(a + "attention.head_count", s.n_head);
  w.add_u32(a + "attention.head_count_kv", s.n_head_kv);
  w.add_u32(a + "attention.key_length", s.head_dim);
  w.add_u32(a + "attention.value_length", s.head_dim);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  w.add_f32(a + "rope.freq_base", 10000.0f);
  w.add_i32_array(a + "target_layers", s.target_layers);
  w.add_u32(a + "target_hidden_size", s.target_hidden);
  w.add_bool(a + "norm_before_residual", false);
  if (s.n_vocab_tokens > 0) {
    std::vector<std::string> tokens;
    for (int32_t i = 0; i < s.n_vocab_tokens; ++i) tokens.push_back("t" + std::to_string(i));
    w.add_string_array("tokenizer.ggml.tokens", tokens);
  }
  auto poison = [&](const std::string& name, std::vector<float>& f) {
    if (name == s.nan_tensor) f[0] = std::numeric_limits<float>::quiet_NaN();
  };
  auto add_matrix = [&](const std::string& name, int64_t cols, int64_t rows) {
    std::vector<float> f(size_t(cols) * rows);
    const float scale = s.scale / std::sqrt(float(cols));
    for (float& x : f) x = normal(rng) * scale;
    poison(name, f);
    const size_t rb = row_bytes(s.weight_type, cols);
    std::vector<uint8_t> q(rb * rows);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row_reference(s.weight_type, f.data() + r * cols, q.data() + r * rb, cols);
    w.add_tensor(name, s.weight_type, {cols, rows}, q);
  };
  auto add_vector = [&](const std::string& name, int64_t n) {
    std::vector<float> f(static_cast<size_t>(n));
    for (float& x : f) x = 1.0f + 0.1f * normal(rng);
    poison(name, f);
    w.add_tensor(name, GgmlType::F32, {n},
                 std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(f.data()), f.size() * sizeof(float)));
  };
  const int64_t H = s.n_embd, qd = int64_t(s.n_head) * s.head_dim, kvd = int64_t(s.n_head_kv) * s.head_dim;
  add_matrix("fc.weight", s.fc_cols ? s.fc_cols : 3 * int64_t(s.target_hidden), H);
  add_vector("blk.0.attn_norm.weight", H);
  add_vector("blk.0.attn_norm_2.weight", H);
  add_matrix("blk.0.attn_q.weight", 2 * H, qd);
  add_matrix("blk.0.attn_k.weight", 2 * H, kvd);
  add_matrix("blk.0.attn_v.weight", 2 * H, kvd);
  add_matrix("blk.0.attn_output.weight", qd, H);
  add_vector("blk.0.ffn_norm.weight", H);
  add_matrix("blk.0.ffn_gate.weight", H, s.n_ff);
  add_matrix("blk.0.ffn_up.weight", H, s.n_ff);
  add_matrix("blk.0.ffn_down.weight", s.n_ff, H);
  add_vector("output_norm.weight", H);
  if (s.own_lm_rows > 0) add_matrix("output.weight", H, s.own_lm_rows);
  if (!s.d2t.empty())
    w.add_tensor("d2t", static_cast<GgmlType>(27) /* I64 */, {int64_t(s.d2t.size())},
                 std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.d2t.data()), s.d2t.size() * 8));
  w.write_file(path);
}

}  // namespace microspec::test
