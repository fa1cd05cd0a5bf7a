// Phi-3 / Phi-3.5 / Phi-4-mini: Llama's pre-norm blocks with Q, K and V fused into one matrix
// (attn_qkv.weight, rows q then k then v; separate attn_q/k/v are accepted too) and the FFN's gate
// and up fused into ffn_up.weight (rows gate then up), both taken apart at load as row views of the
// file's matrix; NEOX RoPE over the first rope.dimension_count dimensions of each head (partial
// rotary), with LongRoPE's per-frequency divisors when the file has them: rope_factors_long.weight
// for a sequence whose cache is longer than the original context, else rope_factors_short.weight
// (llama.cpp's rule), and rope.scaling.attn_factor on cos and sin. As llama.cpp, Phi-3's sliding
// window is not applied (see config.cpp).
#include <string>

#include "gguf/gguf.h"
#include "model/architectures.h"
#include "model/model.h"

namespace microspec {

namespace {

class Phi3Model final : public Model {
 public:
  Phi3Model(const GgufFile& f, const ModelOptions& options) : Model(f, options) {
    const ModelConfig& c = config_;
    const int32_t d = c.n_embd;
    rope_long_ = vector(f, "rope_factors_long.weight", c.n_rot / 2, /*required=*/false);
    rope_short_ = vector(f, "rope_factors_short.weight", c.n_rot / 2, /*required=*/rope_long_ != nullptr);
    layers_.resize(c.n_layer);
    for (int32_t il = 0; il < c.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      Layer& L = layers_[il];
      L.attn_norm = vector(f, p + "attn_norm.weight", d);
      if (f.find_tensor(p + "attn_qkv.weight")) {
        const QMatrix qkv = matrix(f, p + "attn_qkv.weight", d, c.q_dim() + 2 * c.kv_dim());
        L.wq = matrix_rows(qkv, 0, c.q_dim());
        L.wk = matrix_rows(qkv, c.q_dim(), c.kv_dim());
        L.wv = matrix_rows(qkv, c.q_dim() + c.kv_dim(), c.kv_dim());
      } else {
        L.wq = matrix(f, p + "attn_q.weight", d, c.q_dim());
        L.wk = matrix(f, p + "attn_k.weight", d, c.kv_dim());
        L.wv = matrix(f, p + "attn_v.weight", d, c.kv_dim());
      }
      L.wo = matrix(f, p + "attn_output.weight", c.q_dim(), d);
      L.ffn_norm = vector(f, p + "ffn_norm.weight", d);
      const QMatrix gate_up = matrix(f, p + "ffn_up.weight", d, 2 * c.n_ff);
      L.w_gate = matrix_rows(gate_up, 0, c.n_ff);
      L.w_up = matrix_rows(gate_up, c.n_ff, c.n_ff);
      L.w_down = matrix(f, p + "ffn_down.weight", c.n_ff, d);
    }
  }

 private:
  struct Layer {
    const float* attn_norm;  // [n_embd]
    QMatrix wq;              // [n_head*head_dim rows][n_embd]: rows of attn_qkv
    QMatrix wk, wv;          // [n_head_kv*head_dim rows][n_embd]: rows of attn_qkv
    QMatrix wo;              // [n_embd rows][n_head*head_dim]
    const float* ffn_norm;   // [n_embd]
    QMatrix w_gate, w_up;    // [n_ff rows][n_embd]: the two halves of ffn_up
    QMatrix w_down;          // [n_embd rows][n_ff]
  };

  // Rotates q and k of each sequence of the call with that sequence's LongRoPE factors. A
  // sequence's rows are those from its first row to the next sequence's first row (or the end).
  void rope_per_sequence(int32_t il, const ForwardRows& rows, float* q, float* k) {
    const ModelConfig& c = config_;
    const size_t n_seqs = rows.seqs.size();
    for (size_t s = 0; s < n_seqs; ++s) {
      const bool long_context = rows.seqs[s].kv->n_ctx() > c.rope_orig_context;
      const RopeSpec rot = rope_spec(il, long_context && rope_long_ ? rope_long_ : rope_short_);
      const int32_t first = rows.seq_first_row[s];
      const int32_t count = (s + 1 < n_seqs ? rows.seq_first_row[s + 1] : rows.n) - first;
      rope(q + size_t(first) * c.q_dim(), count, c.n_head, rows.positions + first, rot);
      rope(k + size_t(first) * c.kv_dim(), count, c.n_head_kv, rows.positions + first, rot);
    }
  }

  // One layer: x += attention(norm(x)), then x += ffn(norm(x)).
  void run_layers(const ForwardRows& rows, int32_t first, int32_t end, float* x) override {
    const ModelConfig& c = config_;
    const int32_t n = rows.n, d = c.n_embd;
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
      rope_per_sequence(il, rows, q, k);
      attention(il, rows, q, k, v, attn);
      matmul(L.wo, attn, n, o);
      add_block_output(o, n, x);

      // Feed-forward block.
      rms_norm(x, L.ffn_norm, n, d, xn);
      gated_ffn(L.w_gate, L.w_up, L.w_down, Activation::Silu, xn, n, gate, up, o);
      add_block_output(o, n, x);
    }
  }

  const float* rope_long_ = nullptr;   // [n_rot/2] LongRoPE divisors past the original context, else null
  const float* rope_short_ = nullptr;  // [n_rot/2] LongRoPE divisors within it, else null
  std::vector<Layer> layers_;          // [n_layer]
};

}  // namespace

std::unique_ptr<Model> make_phi3(const GgufFile& file, const ModelOptions& options) {
  return std::make_unique<Phi3Model>(file, options);
}

}  // namespace microspec
