#pragma once
// A loaded model: weights (views into the mapped GGUF file), scratch buffers sized at load, and
// one forward pass per architecture (gemma3.cpp, llama.cpp) built from the shared blocks.
//
// The forward API is shaped for speculative decoding: a batch of tokens with arbitrary positions
// and per-token parents (a token tree), final hidden states and/or logits only for the rows asked
// for, an optional layer limit (a self-drafter runs only the first N layers), and the LM head
// callable on its own for any subset of vocabulary rows.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/matmul.h"
#include "kernels/threadpool.h"
#include "model/config.h"
#include "model/kv_cache.h"

namespace microspec {

class GgufFile;

struct Batch {
  std::vector<int32_t> tokens;     // [n]
  std::vector<int32_t> positions;  // [n] sequence positions (RoPE and sliding window)
  // [n] parent of each token as a pending index (relative to kv.n_past()), -1 = attends to the
  // committed prefix only. A parent must be written already: earlier in this batch or by an
  // earlier forward into the pending region. Every token also attends to itself.
  std::vector<int32_t> parents;
  std::vector<int32_t> output_rows;  // batch rows whose hidden state (and logits) are returned
  int32_t start = 0;                 // pending index of tokens[0]

  int32_t size() const { return static_cast<int32_t>(tokens.size()); }
  void clear() {
    tokens.clear();
    positions.clear();
    parents.clear();
    output_rows.clear();
    start = 0;
  }
  // A plain sequential run of tokens at positions pos0.., each the parent of the next.
  void set_sequence(std::span<const int32_t> toks, int32_t pos0, bool output_all);
};

struct ForwardOutput {
  int32_t n_rows = 0;
  std::vector<float> residual;  // [n_rows][n_embd] residual stream after the last layer run
  std::vector<float> hidden;    // [n_rows][n_embd] after the final norm
  std::vector<float> logits;  // [n_rows][n_vocab] when requested
};

// Wall time spent in the model since the last reset, for the statistics lines and benchmarks.
struct ModelTimings {
  double forward_seconds = 0.0;  // whole forward() calls, LM head included
  double lm_head_seconds = 0.0;  // lm_head() and lm_head_rows() calls
  void reset() { *this = ModelTimings{}; }
};

struct ModelOptions {
  int n_threads = 2;
  int32_t n_batch = 512;         // most tokens one forward call takes; scratch is sized for it at load
  std::string kernels = "auto";  // kernel table, see kernels_by_name()
};

class Model {
 public:
  // Reads the config, checks every tensor's type and shape, and picks the architecture.
  static std::unique_ptr<Model> load(const GgufFile& file, const ModelOptions& options);
  virtual ~Model() = default;

  const ModelConfig& config() const { return config_; }
  int32_t n_batch() const { return n_batch_; }
  ThreadPool& pool() { return pool_; }
  // The kernel table the model runs on (--kernels, resolved): a draft model loads with the same.
  const KernelTable& kernels() const { return mm_.kernels(); }
  KVCache make_cache(int32_t n_ctx) const;

  // Runs the batch through layers [first_layer, n_layers) (n_layers < 0: to the last layer),
  // writing its keys and values of those layers into the pending slots of kv. The input is the
  // token embeddings, or with first_layer > 0 the residual streams x_in ([n][n_embd]) after layer
  // first_layer - 1 (from an earlier forward's ForwardOutput::residual). Fills out.residual and
  // out.hidden for batch.output_rows, and out.logits too when want_logits. A token's result is
  // bitwise the same whether its layers run in one call or are split across calls. Throws Error
  // when the batch does not fit the cache or n_batch.
  void forward(const Batch& batch, KVCache& kv, ForwardOutput& out, bool want_logits, int32_t n_layers = -1,
               int32_t first_layer = 0, const float* x_in = nullptr);

  // logits[i][v] for all vocabulary rows: hidden is [n][n_embd], logits [n][n_vocab].
  void lm_head(const float* hidden, int32_t n, float* logits);
  // logits[i][j] for vocabulary rows rows[j] only: logits is [n][n_rows].
  void lm_head_rows(const float* hidden, int32_t n, const int32_t* rows, int32_t n_rows, float* logits);
  // logits[i][j] for the rows of `packed`: head rows in the head's own format and width (a draft
  // vocabulary's packed copy of some vocabulary rows); logits is [n][packed.rows].
  void lm_head_packed(const float* hidden, int32_t n, const QMatrix& packed, float* logits);
  const QMatrix& output_matrix() const { return output_; }
  ModelTimings& timings() { return timings_; }

 protected:
  Model(const GgufFile& file, const ModelOptions& options);
  // The architecture's layers: transforms x ([n][n_embd] embeddings in, residual stream out).
  // Layers [first, end) of the architecture on x in place.
  virtual void run_layers(const Batch& batch, KVCache& kv, int32_t first, int32_t end, float* x) = 0;

  // --- shared blocks -------------------------------------------------------------------------
  QMatrix matrix(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows) const;
  const float* vector(const GgufFile& f, const std::string& name, int64_t n, bool required = true) const;
  void matmul(const QMatrix& w, const float* x, int32_t n, float* y);
  void rms_norm(const float* x, const float* weight, int32_t n_rows, int32_t dim, float* y) const;
  void rope(float* x, int32_t n, int32_t n_heads, const int32_t* positions, float base) const;
  enum class Activation { GeluTanh, Silu };
  // q_, k_, v_ = Wq, Wk, Wv times xn_ (n tokens).
  void project_qkv(const QMatrix& wq, const QMatrix& wk, const QMatrix& wv, int32_t n);
  // o_ = Wdown (act(Wgate xn_) * Wup xn_) for n tokens.
  void gated_ffn(const QMatrix& w_gate, const QMatrix& w_up, const QMatrix& w_down, Activation act,
                 int32_t n);
  // x += o_ for n tokens.
  void add_block_output(float* x, int32_t n) const;
  // Writes k, v of the batch into the cache and computes attention of q against the committed
  // prefix plus each token's ancestors. q: [n][n_head*head_dim], out: same shape.
  void attention(int32_t il, const Batch& batch, KVCache& kv, const float* q, const float* k, const float* v,
                 float* out);

  ModelConfig config_;
  ModelTimings timings_;
  int32_t n_batch_;
  ThreadPool pool_;
  MatmulContext mm_;
  QMatrix token_embd_;                  // [n_vocab rows][n_embd]
  QMatrix output_;                      // [n_vocab rows][n_embd]: token_embd_ when tied
  const float* output_norm_ = nullptr;  // [n_embd]

  // Scratch, sized at load for n_batch tokens.
  std::vector<float> x_;          // [n_batch][n_embd] residual stream
  std::vector<float> xn_;         // [n_batch][n_embd] normed input of a block
  std::vector<float> q_;          // [n_batch][n_head*head_dim]
  std::vector<float> k_, v_;      // [n_batch][n_head_kv*head_dim]
  std::vector<float> attn_;       // [n_batch][n_head*head_dim]
  std::vector<float> o_;          // [n_batch][n_embd] block output
  std::vector<float> gate_, up_;  // [n_batch][n_ff]
  std::vector<float> scores_;     // [n_threads][n_ctx_reserved] attention scores per thread
  std::vector<int32_t> visible_;  // [n_threads][n_ctx - n_past] visible pending indices per thread
  std::vector<uint16_t> q16_;     // [n_threads][head_dim] query head in half floats
};

}  // namespace microspec
