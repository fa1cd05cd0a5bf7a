// Qwen3 (dense): Llama's pre-norm blocks with per-head RMS norms on q and k before RoPE, no Q/K/V
// biases, NEOX RoPE, SiLU-gated FFN, tied or separate LM head.
#include <string>

#include "gguf/gguf.h"
#include "model/architectures.h"
#include "model/model.h"

namespace microspec {

namespace {

class Qwen3Model final : public Model {
 public:
  Qwen3Model(const GgufFile& f, const ModelOptions& options) : Model(f, options) {
    const ModelConfig& c = config_;
    const int32_t d = c.n_embd, hd = c.head_dim;
    layers_.resize(c.n_layer);
    for (int32_t il = 0; il < c.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      Layer& L = layers_[il];
      L.attn_norm = vector(f, p + "attn_norm.weight", d);
      L.wq = matrix(f, p + "attn_q.weight", d, c.q_dim());
      L.wk = matrix(f, p + "attn_k.weight", d, c.kv_dim());
      L.wv = matrix(f, p + "attn_v.weight", d, c.kv_dim());
      L.q_norm = vector(f, p + "attn_q_norm.weight", hd);
      L.k_norm = vector(f, p + "attn_k_norm.weight", hd);
      L.wo = matrix(f, p + "attn_output.weight", c.q_dim(), d);
      L.ffn_norm = vector(f, p + "ffn_norm.weight", d);
      L.w_gate = matrix(f, p + "ffn_gate.weight", d, c.n_ff);
      L.w_up = matrix(f, p + "ffn_up.weight", d, c.n_ff);
      L.w_down = matrix(f, p + "ffn_down.weight", c.n_ff, d);
    }
  }

 private:
  struct Layer {
    const float* attn_norm;  // [n_embd]
    QMatrix wq;              // [n_head*head_dim rows][n_embd]
    QMatrix wk, wv;          // [n_head_kv*head_dim rows][n_embd]
    const float* q_norm;     // [head_dim]
    const float* k_norm;     // [head_dim]
    QMatrix wo;              // [n_embd rows][n_head*head_dim]
    const float* ffn_norm;   // [n_embd]
    QMatrix w_gate, w_up;    // [n_ff rows][n_embd]
    QMatrix w_down;          // [n_embd rows][n_ff]
  };

  // One layer: x += attention(norm(x)) with normed q and k heads, then x += ffn(norm(x)).
  void run_layers(const ForwardRows& rows, int32_t first, int32_t end, float* x) override {
    const ModelConfig& c = config_;
    const int32_t n = rows.n, d = c.n_embd;
    const int32_t* positions = rows.positions;
    float* xn = act_.xn.data();      // [n][n_embd]
    float* q = act_.q.data();        // [n][n_head][head_dim]
    float* k = act_.k.data();        // [n][n_head_kv][head_dim]
    float* v = act_.v.data();        // [n][n_head_kv][head_dim]
    float* attn = act_.attn.data();  // [n][n_head*head_dim]
    float* o = act_.o.data();        // [n][n_embd]
    float* gate = act_.gate.data();  // [n][n_ff]
    float* up = act_.up.data();      // [n][n_ff]
    for (int32_t il = first; il < end; ++il) {
      const Layer& L = layers_[il];
      const RopeSpec rot = rope_spec(il, /*freq_factors=*/nullptr);

      // Attention block.
      rms_norm(x, L.attn_norm, n, d, xn);
      project_qkv(L.wq, L.wk, L.wv, xn, n, q, k, v);
      rms_norm(q, L.q_norm, n * c.n_head, c.head_dim, q);
      rms_norm(k, L.k_norm, n * c.n_head_kv, c.head_dim, k);
      rope(q, n, c.n_head, positions, rot);
      rope(k, n, c.n_head_kv, positions, rot);
      attention(il, rows, q, k, v, attn);
      matmul(L.wo, attn, n, o);
      add_block_output(o, n, x);

      // Feed-forward block.
      rms_norm(x, L.ffn_norm, n, d, xn);
      gated_ffn(L.w_gate, L.w_up, L.w_down, Activation::Silu, xn, n, gate, up, o);
      add_block_output(o, n, x);
    }
  }

  std::vector<Layer> layers_;  // [n_layer]
};

}  // namespace

std::unique_ptr<Model> make_qwen3(const GgufFile& file, const ModelOptions& options) {
  return std::make_unique<Qwen3Model>(file, options);
}

}  // namespace microspec
