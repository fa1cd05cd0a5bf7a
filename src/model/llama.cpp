// Llama family (SmolLM2, Llama 3.x, Mistral) and Qwen2 (Llama plus biases on Q, K and V, NEOX RoPE):
// pre-norm residual blocks, grouped-query attention, SiLU-gated FFN, tied or separate LM head.
// Llama 3.x's RoPE scaling comes as per-frequency divisors, the tensor rope_freqs.weight, which
// llama.cpp's converter computes from rope_scaling (rope_type llama3). Mistral files are `llama`:
// with llama.attention.sliding_window (written by microspec's converter, not llama.cpp's) every
// layer is a sliding-window layer, masked in the shared attention block as Gemma's are; without
// it every layer attends to the whole context, as in llama.cpp.
#include <cmath>
#include <string>

#include "gguf/gguf.h"
#include "model/architectures.h"
#include "model/model.h"

namespace microspec {

namespace {

class LlamaModel final : public Model {
 public:
  LlamaModel(const GgufFile& f, const ModelOptions& options) : Model(f, options) {
    const ModelConfig& c = config_;
    const int32_t d = c.n_embd;
    const bool biases = c.arch == Arch::Qwen2;
    rope_freqs_ = vector(f, "rope_freqs.weight", c.n_rot / 2, /*required=*/false);
    layers_.resize(c.n_layer);
    for (int32_t il = 0; il < c.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      Layer& L = layers_[il];
      L.attn_norm = vector(f, p + "attn_norm.weight", d);
      L.wq = matrix(f, p + "attn_q.weight", d, c.q_dim());
      L.wk = matrix(f, p + "attn_k.weight", d, c.kv_dim());
      L.wv = matrix(f, p + "attn_v.weight", d, c.kv_dim());
      L.bq = vector(f, p + "attn_q.bias", c.q_dim(), biases);
      L.bk = vector(f, p + "attn_k.bias", c.kv_dim(), biases);
      L.bv = vector(f, p + "attn_v.bias", c.kv_dim(), biases);
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
    const float* bq;         // [n_head*head_dim] (Qwen2), else null
    const float* bk;         // [n_head_kv*head_dim] (Qwen2), else null
    const float* bv;         // [n_head_kv*head_dim] (Qwen2), else null
    QMatrix wo;              // [n_embd rows][n_head*head_dim]
    const float* ffn_norm;   // [n_embd]
    QMatrix w_gate, w_up;    // [n_ff rows][n_embd]
    QMatrix w_down;          // [n_embd rows][n_ff]
  };

  // y ([n][dim]) += bias ([dim]) on every row; no-op without a bias.
  static void add_bias(float* y, const float* bias, int32_t n, int32_t dim) {
    if (!bias) return;
    for (int32_t t = 0; t < n; ++t)
      for (int32_t i = 0; i < dim; ++i) y[size_t(t) * dim + i] += bias[i];
  }

  // One layer: x += attention(norm(x)), then x += ffn(norm(x)).
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

      // Attention block.
      rms_norm(x, L.attn_norm, n, d, xn);
      project_qkv(L.wq, L.wk, L.wv, xn, n, q, k, v);
      add_bias(q, L.bq, n, c.q_dim());
      add_bias(k, L.bk, n, c.kv_dim());
      add_bias(v, L.bv, n, c.kv_dim());
      const RopeSpec rot = rope_spec(il, rope_freqs_);
      rope(q, n, c.n_head, positions, rot);
      rope(k, n, c.n_head_kv, positions, rot);
      attention(il, rows, q, k, v, attn);  // Mistral's window, if the file has one
      matmul(L.wo, attn, n, o);
      add_block_output(o, n, x);

      // Feed-forward block.
      rms_norm(x, L.ffn_norm, n, d, xn);
      gated_ffn(L.w_gate, L.w_up, L.w_down, Activation::Silu, xn, n, gate, up, o);
      add_block_output(o, n, x);
    }
  }

  const float* rope_freqs_ = nullptr;  // [n_rot/2] frequency divisors (Llama 3.x), else null
  std::vector<Layer> layers_;          // [n_layer]
};

}  // namespace

std::unique_ptr<Model> make_llama(const GgufFile& file, const ModelOptions& options) {
  return std::make_unique<LlamaModel>(file, options);
}

}  // namespace microspec
