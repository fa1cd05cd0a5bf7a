#pragma once
// A loaded model: weights (views into the mapped GGUF file), scratch buffers sized at load, and
// one forward pass per architecture (gemma2.cpp, gemma3.cpp, llama.cpp, phi3.cpp, qwen3.cpp) built
// from the shared blocks.
//
// One forward call may carry several sequences (continuous batching in the server): each brings
// its own Batch (positions, tree parents, output rows) and its own KVCache. The matmuls run once
// over the rows of all sequences (the weights are read once per call), attention runs per
// sequence against that sequence's cache. Per-sequence caches rather than one shared cache with
// block tables: a KVCache is already the unit the speculative decoder commits, compacts and
// truncates (tree paths are copied down behind the prefix), a sequence's rows stay contiguous so
// attention reads them as today, and `--parallel N` allocates N caches at start, which bounds KV
// memory exactly as the per-slot caches did; block tables would only pay off with prefix sharing
// or caches of different lengths, neither of which the server has. Every kernel is per row and the
// matmuls are batch invariant (Matmul.BatchInvariantBitForBit), so a sequence's logits are bitwise
// the same whatever else shares its forward call (ModelBatch.* tests).
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
#include "kernels/repacked_weights.h"
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
  std::vector<float> logits;  // [n_rows - logits_from][n_vocab] when requested (SequenceForward::logits_from)
  // [n_rows][capture_layers.size()][n_embd] when ForwardOptions::capture_layers names layers: the
  // residual stream entering each named layer (n_layer: leaving the last one), for a draft head.
  std::vector<float> layer_inputs;
};

// One sequence's part of a multi-sequence forward call: its tokens, its own cache (distinct from
// every other sequence's in the call) and where its results go.
//
// A call may also take, per sequence, leading rows that already ran the first layers elsewhere
// (the one way to resume a forward): a self-drafter runs the root and tree nodes through the
// target's first `resumed_layer` layers at the very pending slots verification uses. The call runs
// every other row of every sequence through layers [0, resumed_layer) first, puts the resumed
// rows' streams beside them, and then runs all rows on: bitwise what running every row from the
// embeddings gives (layers are per token), without recomputing the drafter's rows.
struct SequenceForward {
  const Batch* batch = nullptr;
  KVCache* kv = nullptr;
  ForwardOutput* out = nullptr;
  int32_t resumed_rows = 0;        // leading rows that ran layers [0, resumed_layer) already
  int32_t resumed_layer = 0;       // the same for every sequence of a call that has resumed rows
  const float* resumed = nullptr;  // [resumed_rows][n_embd] their residual streams after them
  // With ForwardOptions::logits: the first output row whose logits are computed; the rows before
  // it get hidden states (and captured features) only. ForwardOutput::logits then holds output
  // rows [logits_from, n_rows). A prompt piece that needs every row's features but at most its
  // last row's logits sets it to n_rows - 1 (or n_rows: no logits).
  int32_t logits_from = 0;
};

// Wall time spent in the LM head since the last reset, for the statistics lines and benchmarks.
struct ModelTimings {
  double lm_head_seconds = 0.0;  // lm_head(), lm_head_rows() and lm_head_packed() calls
  void reset() { *this = ModelTimings{}; }
};

// Which part of the model one forward() call runs: layers [0, end_layer) from the token
// embeddings (a sequence's resumed rows, SequenceForward::resumed_rows, join at their layer).
struct ForwardOptions {
  static constexpr int32_t kAllLayers = -1;
  bool logits = false;             // also fill ForwardOutput::logits (the full LM head)
  int32_t end_layer = kAllLayers;  // one past the last layer to run; kAllLayers: to the last
  // Layers whose input residual stream to copy into ForwardOutput::layer_inputs for the output
  // rows (an EAGLE-3 head's target features), non-decreasing, each in [resumed layer, end_layer];
  // end_layer means the stream after the last layer run. Free: the layers run in segments.
  std::span<const int32_t> capture_layers = {};
};

struct ModelOptions {
  int n_threads = 2;
  int32_t n_batch = 512;         // most tokens one forward call takes; scratch is sized for it at load
  std::string kernels = "auto";  // kernel table, see kernels_by_name()
  // Repack weights at load into the interleaved layout the kernel table reads (repack.h: the Q8_0,
  // Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K matrices, on every SIMD table): an extra copy of their
  // size. false: multiply the mapped file's bytes only (zero-copy). Results are bitwise the same
  // either way.
  bool repack = true;
};

// The 2-D weight `name` of f as a [rows][cols] matrix the kernels of `kernels` can multiply; Error
// naming the file, the tensor and expected vs actual when it is missing, of another shape or of a
// type without a kernel. Models and draft heads load their weights through it.
QMatrix load_matrix(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows,
                    const KernelTable& kernels);
// The 1-D F32 weight `name` of f with n elements; Error naming the file, the tensor and expected vs
// actual when it is missing, of another type or of another shape.
const float* load_vector(const GgufFile& f, const std::string& name, int64_t n);
// Rows [first, first + count) of m as a matrix of their own (a view: rows are stored independently
// in every format), for fused weights such as phi3's attn_qkv and gate/up.
QMatrix matrix_rows(const QMatrix& m, int64_t first, int64_t count);

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
  // Whether weights are repacked at load (ModelOptions::repack), and the bytes the repacked
  // copies take: a draft model loads with the same setting.
  bool repacks() const { return repack_; }
  size_t repacked_bytes() const { return repacked_.bytes(); }
  KVCache make_cache(int32_t n_ctx) const;

  // Runs the batch through the layers options names (see ForwardOptions), writing its keys and
  // values of those layers into the pending slots of kv. Fills out.residual and out.hidden for
  // batch.output_rows, and out.logits too when options.logits. A token's result is bitwise the same
  // whether its layers run in one call or are split across calls. Throws Error when the batch does
  // not fit the cache or n_batch, or the layer range is invalid.
  void forward(const Batch& batch, KVCache& kv, ForwardOutput& out, const ForwardOptions& options = {});
  // The same for several sequences in one call: every row of every sequence goes through each
  // weight matrix together (one read of the weights), the LM head included; attention is per
  // sequence. Each sequence's results are bitwise those of forward() on it alone. The total token
  // count must fit n_batch.
  void forward(std::span<const SequenceForward> seqs, const ForwardOptions& options);

  // logits[i][v] for all vocabulary rows: hidden is [n][n_embd], logits [n][n_vocab].
  void lm_head(const float* hidden, int32_t n, float* logits);
  // logits[i][j] for vocabulary rows rows[j] only: logits is [n][n_rows].
  void lm_head_rows(const float* hidden, int32_t n, const int32_t* rows, int32_t n_rows, float* logits);
  // logits[i][j] for the rows of `packed`: head rows in the head's own format and width (a draft
  // vocabulary's packed copy of some vocabulary rows); logits is [n][packed.rows].
  void lm_head_packed(const float* hidden, int32_t n, const QMatrix& packed, float* logits);
  const QMatrix& output_matrix() const { return output_; }
  // The token embedding rows as stored ([n_vocab rows][n_embd], before any embed_scale).
  const QMatrix& embedding_matrix() const { return token_embd_; }
  // The final norm's weights ([n_embd]), applied as rms_norm before the LM head (an EAGLE-2 head
  // reads the target's last hidden state after it).
  const float* output_norm_weights() const { return output_norm_; }
  ModelTimings& timings() { return timings_; }

 protected:
  Model(const GgufFile& file, const ModelOptions& options);
  // The architecture's layers: transforms x ([n][n_embd] embeddings in, residual stream out).
  // Layers [first, end) of the architecture on x in place. The rows are those of one forward call:
  // all its sequences' tokens, one after the other.
  struct ForwardRows {
    int32_t n = 0;                            // rows in all
    const int32_t* positions = nullptr;       // [n] each row's position in its sequence
    std::span<const SequenceForward> seqs;    // the sequences, rows in this order
    const int32_t* row_seq = nullptr;         // [n] index into seqs of each row
    const int32_t* seq_first_row = nullptr;   // [seqs.size()] first row of each sequence
    // [seqs.size()] pending index of each sequence's first row relative to its batch's start (the
    // rows a call skips: resumed rows); null: 0 for all.
    const int32_t* seq_skip = nullptr;
    // Row i's pending index in its sequence's batch (from batch->start).
    int32_t local(int32_t i) const {
      const int32_t s = row_seq[i];
      return i - seq_first_row[s] + (seq_skip ? seq_skip[s] : 0);
    }
  };
  virtual void run_layers(const ForwardRows& rows, int32_t first, int32_t end, float* x) = 0;
  // Runs the rows that are not resumed (SequenceForward::resumed_rows) of every sequence through
  // layers [0, layer), the layers the resumed ones already ran, and lays out every row's stream
  // after them in x ([n][n_embd], the call's row order).
  void run_fresh_rows(std::span<const SequenceForward> seqs, int32_t layer, float* x);
  // run_layers over [first, end), copying the stream entering each layer of `capture` (see
  // ForwardOptions::capture_layers) for every sequence's output rows into its out->layer_inputs.
  void run_layers_capturing(const ForwardRows& rows, int32_t first, int32_t end, std::span<const int32_t> capture,
                            float* x);

  // --- shared blocks: each reads its inputs and writes its outputs through its arguments --------
  // Rows of activations are [n][dim] row-major; every pointer is a view into Activations below.
  // The weight `name` as load_matrix() gives it, plus its interleaved copy (repack.h) when the
  // model repacks and the kernel table reads that layout for its type.
  QMatrix matrix(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows);
  // m with its interleaved copy added as matrix() adds it.
  QMatrix repacked(QMatrix m);
  const float* vector(const GgufFile& f, const std::string& name, int64_t n, bool required = true) const;
  // y ([n][w.rows]) = W x for x [n][w.cols].
  void matmul(const QMatrix& w, const float* x, int32_t n, float* y);
  // y = x / rms(x) * weight for each of n_rows rows of dim elements (y may be x).
  void rms_norm(const float* x, const float* weight, int32_t n_rows, int32_t dim, float* y);
  // f(begin, end) over row ranges covering [0, n_rows): on the pool when the rows hold enough
  // elements, else at once on the caller. For per-row work, whose results do not depend on the split.
  template <class F>
  void for_rows(int64_t n_rows, int64_t row_elems, F&& f);
  // The rotation of one layer: base and linear scale (the local ones on sliding-window layers) and
  // optional per-frequency divisors ([n_rot/2]: Llama 3's rope_freqs.weight), as ggml's rope_ext.
  struct RopeSpec {
    float base = 10000.0f;
    float freq_scale = 1.0f;
    const float* freq_factors = nullptr;  // [n_rot/2] or null
    float attn_factor = 1.0f;             // multiplies cos and sin
  };
  RopeSpec rope_spec(int32_t il, const float* freq_factors) const;
  // Rotates the first n_rot dimensions of each head of x ([n][n_heads][head_dim]) in place by each
  // token's position; the rest of a head (partial rotary) is left as is.
  void rope(float* x, int32_t n, int32_t n_heads, const int32_t* positions, const RopeSpec& spec);
  enum class Activation { GeluTanh, Silu };
  // q ([n][q_dim]), k, v ([n][kv_dim]) = Wq, Wk, Wv times xn ([n][n_embd]).
  void project_qkv(const QMatrix& wq, const QMatrix& wk, const QMatrix& wv, const float* xn, int32_t n, float* q,
                   float* k, float* v);
  // out ([n][n_embd]) = Wdown (act(Wgate xn) * Wup xn) for xn [n][n_embd]; gate and up ([n][n_ff])
  // are its working rows.
  void gated_ffn(const QMatrix& w_gate, const QMatrix& w_up, const QMatrix& w_down, Activation act,
                 const float* xn, int32_t n, float* gate, float* up, float* out);
  // x ([count]) = cap * tanh(x / cap) in place (logit soft-capping); no-op when cap is 0.
  static void soft_cap(float* x, size_t count, float cap);
  // x += block_out, both [n][n_embd].
  void add_block_output(const float* block_out, int32_t n, float* x) const;
  // Checks one sequence of a forward call (tokens, parents, positions, output rows, room in its cache).
  void check_sequence(const SequenceForward& seq) const;
  // Writes k, v ([n][kv_dim]) of every row into layer il of its sequence's cache and computes
  // attention of q ([n][q_dim]) against that sequence's committed prefix plus the token's ancestors
  // into out ([n][q_dim]).
  // Blocked: a task is a block of consecutive query rows of one sequence times the heads (all, or a
  // part) of one KV group, at most kAttentionRows (query, head) rows, so each key and value row is
  // read once for all of them (F16ScoresFn, F16WeightedSumFn); every row's bits are those of the
  // row alone, so they do not depend on the block (batch invariance).
  void attention(int32_t il, const ForwardRows& rows, const float* q, const float* k, const float* v, float* out);
  static constexpr int32_t kAttentionRows = 16;  // (query, head) rows per attention task, at most

  // The activations of one forward call, sized at load for n_batch tokens; the architectures pass
  // views of them to the blocks, nothing is allocated per token.
  struct Activations {
    std::vector<float> x;         // [n_batch][n_embd] residual stream
    std::vector<float> xn;        // [n_batch][n_embd] normed input of a block
    std::vector<float> q;         // [n_batch][n_head*head_dim]
    std::vector<float> k, v;      // [n_batch][n_head_kv*head_dim]
    std::vector<float> attn;      // [n_batch][n_head*head_dim] attention output, heads side by side
    std::vector<float> o;         // [n_batch][n_embd] block output
    std::vector<float> gate, up;  // [n_batch][n_ff]
    std::vector<int32_t> positions;      // [n_batch] positions of all rows of a call
    std::vector<int32_t> row_seq;        // [n_batch] sequence of each row
    std::vector<int32_t> seq_first_row;  // [n_batch] first row of each sequence (a sequence has >= 1 row)
    // The rows of a call that are not resumed (SequenceForward::resumed_rows), run through the
    // first layers on their own: their streams and the same row tables for them.
    std::vector<float> x_fresh;             // [n_batch][n_embd]
    std::vector<int32_t> fresh_positions;   // [n_batch]
    std::vector<int32_t> fresh_row_seq;     // [n_batch]
    std::vector<int32_t> fresh_first_row;   // [n_batch] first fresh row of each sequence
    std::vector<int32_t> seq_skip;          // [n_batch] resumed rows of each sequence
  };

  ModelConfig config_;
  ModelTimings timings_;
  int32_t n_batch_;
  ThreadPool pool_;
  MatmulContext mm_;
  QMatrix token_embd_;                  // [n_vocab rows][n_embd] rows looked up, never multiplied
  QMatrix output_;                      // [n_vocab rows][n_embd]: token_embd_'s rows when tied
  const float* output_norm_ = nullptr;  // [n_embd]
  Activations act_;

 private:
  bool repack_ = true;
  RepackedWeights repacked_;  // the interleaved copies that QMatrix::interleaved points into
  // attention()'s own working memory, one region per pool thread.
  std::vector<float> scores_;       // [n_threads][kAttentionRows][n_ctx + n_batch] scores, then weights
  std::vector<uint8_t> seen_;       // [n_threads][kAttentionRows][n_ctx] whether a query sees a key
  std::vector<uint16_t> q16_;       // [n_threads][head_dim] one query head in half floats
  std::vector<uint16_t> weights16_; // [n_threads][n_ctx + n_batch] one row's weights in half floats
  std::vector<float> q_rows_;       // [n_threads][kAttentionRows][head_dim] the task's query heads, f16-rounded
  std::vector<float> head_out_;     // [n_threads][kAttentionRows][head_dim] the task's outputs
  std::vector<int32_t> attn_blocks_;  // [n_batch + 1] first row of each query block, then n
  // The LM head of a multi-sequence call runs once over every sequence's output rows: their final
  // hidden states side by side, and the logits before they are handed to each sequence. Grown to
  // the largest number of output rows seen (decode steps: one or a few rows per sequence).
  std::vector<float> head_hidden_;  // [output rows][n_embd]
  std::vector<float> head_logits_;  // [output rows][n_vocab]

  // The parts of forward(), in the order it runs them.
  struct ForwardCall {
    int32_t n_rows = 0;         // the rows of all sequences
    int32_t end_layer = 0;      // one past the last layer run
    int32_t resumed_layer = 0;  // where the sequences' resumed rows join (0: none has any)
  };
  // Checks every sequence and the call as a whole; throws Error before anything is written.
  ForwardCall check_call(std::span<const SequenceForward> seqs, const ForwardOptions& options) const;
  // The call's rows, sequence after sequence: each row's position and sequence, each sequence's
  // first row, and each token's slot metadata in its cache.
  struct RowTables {
    int32_t* positions = nullptr;      // [rows]
    int32_t* row_seq = nullptr;        // [rows]
    int32_t* seq_first_row = nullptr;  // [seqs]
  };
  void lay_out_rows(std::span<const SequenceForward> seqs, const RowTables& tables);
  // Grows attention()'s working memory to the largest cache of the call.
  void reserve_attention_scratch(std::span<const SequenceForward> seqs);
  // x ([rows][n_embd]) = every row's token embedding (times embed_scale).
  void embed_tokens(std::span<const SequenceForward> seqs, const int32_t* seq_first_row, float* x) const;
  // Each sequence's output rows of x into its out->residual and, after the final norm, out->hidden.
  void write_outputs(const ForwardRows& rows, const float* x);
  // Each sequence's out->logits: one LM head over the output rows of all sequences from each one's
  // logits_from on (n in all), gathered in head_hidden ([n][n_embd]) with logits in head_logits
  // ([n][n_vocab]).
  void logits_of_outputs(std::span<const SequenceForward> seqs, std::vector<float>& head_hidden,
                         std::vector<float>& head_logits);
};

}  // namespace microspec
