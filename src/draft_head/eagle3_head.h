#pragma once
// An EAGLE-3 draft head (Li et al., "EAGLE-3", 2025) in llama.cpp's `eagle3` GGUF layout.
//
// Layout followed: llama.cpp as vendored by llama-cpp-python 0.3.36 (src/models/eagle3.cpp,
// src/llama-arch.cpp, conversion/llama.py). Metadata (arch "eagle3"): eagle3.embedding_length,
// .block_count (1), .feed_forward_length, .attention.head_count, .attention.head_count_kv,
// .attention.layer_norm_rms_epsilon, .rope.freq_base, .target_layers (3 ids: the target layers
// whose INPUT residual stream is read; n_layer means the stream after the last layer),
// .target_hidden_size, optional .norm_before_residual and .norm_before_fc. Tensors:
//   fc.weight               [3*H_t cols][H rows]  fuses the three target features
//   enc.output_norm.weight  [3*H_t]               only with norm_before_fc
//   blk.0.attn_norm.weight  [H]                   norm of the token embedding
//   blk.0.attn_norm_2.weight [H]                  norm of the fused (or fed back) hidden state
//   blk.0.attn_{q,k,v}.weight [2H cols][q_dim | kv_dim rows], attn_output [q_dim cols][H rows]
//   blk.0.ffn_norm, ffn_gate/ffn_up [H cols][n_ff rows], ffn_down [n_ff cols][H rows]
//   output_norm.weight      [H]
//   token_embd.weight       optional own embeddings [H cols][n_vocab rows]; else the target's
//   output.weight           optional own LM head [H cols][n_draft rows] (every published EAGLE-3
//                           head has one, over a reduced draft vocabulary)
//   d2t                     I64 [n_draft]: the target id of each own LM-head row, absolute (llama.cpp's
//                           converter adds the Hugging Face offsets to the row index); absent: the
//                           own head covers the target's whole vocabulary in id order
//   rope_freqs.weight       optional [head_dim / 2] frequency divisors (Llama 3 rope scaling)
//
// Scoring (HeadDrafter): without an own LM head, the target's LM head rows through the
// DraftVocabulary, so full/freq/dynamic/hybrid apply unchanged. With one, the head scores its own
// rows: those whose target id (d2t) the draft vocabulary holds (full: every own row; freq /
// dynamic / hybrid: the active set intersected with the head's vocabulary, gathered from the own
// rows in the vocabulary's order) and proposes their target ids. Verification is the target's,
// so greedy output stays exactly plain decoding's whatever the head scores.
//
// One row's forward (llama.cpp's graph, NORM RoPE, attention scale 1/sqrt(head_dim)):
//   g  = fc(features) (level 1) or the previous level's prenorm output (deeper levels)
//   x  = [attn_norm(embed(token)) ; attn_norm_2(g)]                          (2H)
//   r  = Wo attention(rope(Wq x), rope(Wk x), Wv x) + (norm_before_residual ? attn_norm_2(g) : g)
//   h  = r + Wdown(silu(Wgate ffn_norm(r)) * Wup ffn_norm(r))               (prenorm output)
//   logits = target LM head (output_norm(h))
// The row at position i pairs the target's features at position i with the token at i + 1.
//
// EAGLE-2 heads (arch "eagle2", ours; converted from SafeAILab/EAGLE's cnets1.py checkpoints by
// draft_head/eagle_checkpoint.h): the same keys under "eagle2." (no target_layers: the one
// feature is the target's last hidden state after its final norm, captured as the stream after
// its last layer and normed here with the target's output_norm), tensors
//   fc.weight [2H cols][H rows], fc.bias [H] (optional), blk.0.attn_{q,k,v} [H cols], attn_output,
//   blk.0.ffn_norm, ffn_gate/up/down, optional token_embd, optional rope_freqs.
// One row's forward:
//   g  = output_norm_target(target's last stream) (level 1) or the previous level's output
//   x  = fc([embed(token) ; g]) + fc.bias                                      (no input norm)
//   r  = Wo attention(rope(Wq x), rope(Wk x), Wv x) + x
//   h  = r + Wdown(silu(Wgate ffn_norm(r)) * Wup ffn_norm(r))      (fed back as is: no final norm)
//   logits = LM head (h)
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/matmul.h"
#include "kernels/repacked_weights.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace microspec {

class GgufFile;

enum class HeadArch { Eagle3, Eagle2 };

struct Eagle3Config {
  HeadArch arch = HeadArch::Eagle3;
  int32_t n_embd = 0;  // H, equal to the target's
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t n_ff = 0;
  float rms_eps = 1e-6f;
  float rope_base = 10000.0f;
  std::vector<int32_t> target_layers;  // [3] non-decreasing, in [0, target n_layer]
  int32_t target_hidden = 0;           // H_t
  bool norm_before_residual = false;
  bool norm_before_fc = false;
  int32_t n_draft_vocab = 0;           // rows of the own LM head; 0: the target's LM head is used
  int32_t attn_input() const { return arch == HeadArch::Eagle3 ? 2 * n_embd : n_embd; }
  int32_t q_dim() const { return n_head * head_dim; }
  int32_t kv_dim() const { return n_head_kv * head_dim; }
  int32_t n_features() const { return static_cast<int32_t>(target_layers.size()) * target_hidden; }
};

// The head's metadata, checked against the target's shapes (Error naming the file, the value,
// expected and found); the own LM head (n_draft_vocab) is read with the weights, not here. The
// CPU head and the CUDA backend's (cuda/eagle_head.h) read it alike.
Eagle3Config read_eagle3_config(const GgufFile& f, const ModelConfig& target);
// Error naming the tensor, row and column of the first non-finite weight of the file.
void check_head_tensors_finite(const GgufFile& f);

class Eagle3Head {
 public:
  // Checks every metadata value, shape and weight (no NaN or infinity) against the target and
  // throws Error naming the file, the value, what was expected and what was found. n_batch: most
  // rows one forward() takes. The head shares the target's thread pool and kernel table; file and
  // target must outlive it.
  Eagle3Head(std::unique_ptr<GgufFile> file, Model& target, int32_t n_batch);
  ~Eagle3Head();

  const Eagle3Config& config() const { return config_; }
  int32_t n_batch() const { return n_batch_; }
  KVCache make_cache(int32_t n_ctx) const { return KVCache(1, n_ctx, config_.kv_dim()); }

  // fused ([n][H]) = the level-1 hidden input from the target's features ([n][n_features()] as
  // ForwardOutput::layer_inputs holds them): EAGLE-3 fc(features), EAGLE-2 the target's final norm.
  void fuse(const float* features, int32_t n, float* fused);
  // The own LM head (config().n_draft_vocab > 0): logits ([n][n_rows]) of own rows `rows` for
  // normed ([n][H]), and each own row's target id ([n_draft_vocab]).
  void own_logits(const float* normed, int32_t n, const int32_t* rows, int32_t n_rows, float* logits);
  const std::vector<int32_t>& draft_to_target() const { return d2t_; }
  // The decoder layer on batch's tokens at its positions and parents (as Model::forward takes
  // them; output_rows is ignored: every row is computed), with g ([n][H]) each row's hidden input.
  // Writes the rows' keys and values into kv's pending slots from batch.start. prenorm ([n][H]):
  // the layer's output, what a deeper level feeds back; normed ([n][H]): after output_norm, for
  // the LM head.
  void forward(const Batch& batch, const float* g, KVCache& kv, float* prenorm, float* normed);

 private:
  void load_weights();
  void load_own_lm_head();
  void rms_norm(const float* x, const float* w, int32_t n, int32_t dim, float eps, float* y) const;
  void rope(float* x, int32_t n, int32_t n_heads, const int32_t* positions) const;
  void attention(const Batch& batch, KVCache& kv, const float* q, const float* k, const float* v, float* out);

  std::unique_ptr<GgufFile> file_;
  Model& target_;
  Eagle3Config config_;
  int32_t n_batch_;
  MatmulContext mm_;
  // Interleaved copies of the matrices multiplied whole (fc_, the attention and FFN weights) when
  // the target repacks its own (Model::repacks).
  RepackedWeights repacked_;

  // Weights: views into the mapped file (token_embd_ and the LM head may be the target's).
  QMatrix fc_;                           // [H rows][3*H_t] (EAGLE-2: [H rows][2H])
  const float* fc_bias_ = nullptr;       // [H] EAGLE-2 only, optional
  const float* rope_freqs_ = nullptr;    // [head_dim / 2] optional frequency divisors
  const float* target_norm_ = nullptr;   // [H] EAGLE-2: the target's output_norm
  QMatrix output_;                       // [n_draft rows][H] own LM head (n_draft_vocab > 0)
  std::vector<int32_t> d2t_;             // [n_draft] target id of each own row
  const float* fc_norm_ = nullptr;       // [3*H_t] (norm_before_fc only)
  QMatrix token_embd_;                   // [n_vocab rows][H]
  const float* embd_norm_ = nullptr;     // [H] attn_norm
  const float* hidden_norm_ = nullptr;   // [H] attn_norm_2
  QMatrix wq_;                           // [q_dim rows][2H]
  QMatrix wk_, wv_;                      // [kv_dim rows][2H]
  QMatrix wo_;                           // [H rows][q_dim]
  const float* ffn_norm_ = nullptr;      // [H]
  QMatrix w_gate_, w_up_;                // [n_ff rows][H]
  QMatrix w_down_;                       // [H rows][n_ff]
  const float* output_norm_ = nullptr;   // [H]

  // Activations of one forward call, sized at load for n_batch rows.
  struct Activations {
    std::vector<float> features;  // [n_batch][3*H_t] normed features (norm_before_fc)
    std::vector<float> embd;      // [n_batch][H] token embeddings
    std::vector<float> x;         // [n_batch][2H] attention input
    std::vector<float> gn;        // [n_batch][H] normed hidden input
    std::vector<float> q;         // [n_batch][q_dim]
    std::vector<float> k, v;      // [n_batch][kv_dim]
    std::vector<float> attn;      // [n_batch][q_dim]
    std::vector<float> rn;        // [n_batch][H] normed FFN input
    std::vector<float> gate, up;  // [n_batch][n_ff]
    std::vector<float> scores;    // [threads][n_head / n_head_kv][n_ctx] attention scores (grown once)
    std::vector<uint8_t> seen;    // [threads][n_ctx] the keys one row sees (grown once)
  };
  Activations act_;
};

}  // namespace microspec
