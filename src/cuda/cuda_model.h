#pragma once
// A model on the GPU: weights uploaded once in their file formats, the KV cache, activations and
// logits in device memory, and a forward pass (llama family, Qwen2, Gemma 3) made of the kernels
// in ops.h. The CPU model (src/model) is its oracle: tests/cuda/ checks logits and greedy tokens.
//
// The state a step needs lives on the device (n_past, the one-token batch of greedy decoding), so
// a decode step is a fixed sequence of launches that can be captured once as a CUDA graph and
// replayed with no host round trip.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/draft_vocab.h"
#include "cuda/eagle_head.h"
#include "cuda/ops.h"
#include "model/config.h"
#include "sampling/sampler.h"
#include "vocab/draft_vocab.h"

namespace microspec {
class GgufFile;
}

namespace microspec::cuda {

class DeviceDraftVocab;

struct CudaModelOptions {
  int32_t n_batch = 64;   // most tokens one forward takes; buffers are sized for it at load
  int32_t n_ctx = 2048;   // KV cache slots
  int32_t max_generate = 4096;  // capacity of the device's generated-token buffer
};


// A batch in host memory (the Batch of src/model, without depending on it).
struct HostBatch {
  std::span<const int32_t> tokens;       // [n]
  std::span<const int32_t> positions;    // [n]
  std::span<const int32_t> parents;      // [n] pending index of the parent, -1 = prefix only
  std::span<const int32_t> output_rows;  // rows whose hidden state / logits are produced
  int32_t start = 0;                     // pending index of tokens[0]
};

// Takes each generated token in order, as the host reads them back; returning false ends the
// generation with that token (a stop string the caller watches for, say).
using TokenHandler = std::function<bool(int32_t)>;

enum class Graphs { Off, On };  // replay the decode step as a captured CUDA graph, or launch each kernel

struct PlainOptions {
  int32_t n_predict = 128;
  std::vector<int32_t> stop_ids;  // generation ends after one of these (it is kept)
  Graphs graphs = Graphs::On;
  int32_t sync_every = 8;  // steps between host checks for a stop token (more steps may run past it)
  // Temperature 0: greedy (the argmax). Else the CPU's Sampler with top-k on (top_k 1..64, below
  // the vocabulary size): each token is its draw from the row's top_k best (top-p, temperature,
  // then the draw: sampling/ranked_draw.h) with the seed's random bits, one per token, as the CPU
  // draws them.
  SamplingParams sampling;
};

// How a plain decode step picks its token: the argmax (sample_k 0), or the sampler's draw from the
// sample_k best with the settings and random bits the generation uploaded (begin_sampling).
struct TokenPick {
  int32_t sample_k = 0;
  bool operator==(const TokenPick& o) const { return sample_k == o.sample_k; }
};

class CudaModel;

// Speculative decoding on the device with a self-drafter: the target's first draft_layers layers
// (with the final norm and LM head) propose a chain of `depth` tokens one at a time, written into
// the pending KV slots; one batched forward over the chain verifies them; the longest prefix that
// matches the target's argmax is kept plus the target's own next token, and the cache keeps that
// prefix. Every kernel's result for a token is the same whatever the batch (batch invariance), so
// the output equals plain greedy decoding token for token.
//
// The step is device-resident: each draft is fed to the next draft forward on the device,
// acceptance and the next batch are made by one device thread (speculative/chain_state.h)
// and the vocabulary's update reads its counts on the device, so the host only launches steps and
// looks at the emitted tokens every sync_every steps (steps after the text's end may run: their
// tokens are dropped, and the counts are those of the steps that emitted the text).
// With graphs on, the whole step (vocabulary update, drafts, verification, acceptance) is captured
// once as a CUDA graph and replayed. Near the end of the context, where a
// whole chain no longer fits, plain decode steps finish the generation.
//
// With vocab the draft LM head is a pruned one (DeviceDraftVocab): MicroSpec's window (`dynamic`,
// with always-active frequent tokens: `hybrid`), where the prompt's tokens and the target's top
// K_pre at every prompt position start the candidate stream and each step appends the chain's
// tokens and the target's top K_ver at the accepted positions, all on the device; or FR-Spec's
// fixed frequent set (`freq`). The drafts are scored over the packed rows only. Without it, the
// full vocabulary's head.
//
// With draft_model the drafter is a separate model with the target's vocabulary (its own cache, on
// its own stream, forked from and joined to the target's by events inside the step), kept one token
// behind the target so that every step has the same shape (speculative/chain_state.h, a tree's:
// tree_state.h); draft_layers is then unused.
//
// With tree the self-drafter (or draft_model, or draft_head) drafts an EAGLE-2 tree of that fixed
// shape instead of a chain (speculative/tree_state.h): the root's forward (a draft model's: the
// newest committed token with the root; a head's: its catch-up), then one forward of the k
// frontier rows per level, each row's k best over the draft head (full or pruned) with
// their log-probabilities, the frontier and the kept nodes chosen on the device; the verification
// runs every node with the tree's parent mask, and the cache keeps the accepted path (kv_compact,
// its count on the device). The whole step is one fixed launch sequence, captured as a graph like
// the chain's.
//
// With draft_head the drafter is an EAGLE-3 head (cuda/eagle_head.h) reading the target's features,
// which the prefill and every verification capture on the device; each step starts with the head's
// catch-up over the last verification (speculative/chain_state.h), then one head row per draft,
// each scored by the target's LM head through the draft vocabulary. draft_layers is then unused.
//
// With sampling (temperature > 0, top_k 1..64) the step is speculative sampling
// (speculative/chain_sampling.h; a tree's: tree_sampling.h): each draft is the draft sampler's
// draw from its row's k best (a tree row's children: k draws without replacement), and the
// verification's k best per row feed (recursive) rejection sampling in one device thread, so the
// output has plain sampling's distribution. The random bits are the CPU decoder's two samplers'
// (the seed's, and draft_sampler_seed's), consumed as the CPU consumes them, so equal
// logits give the CPU decoder's tokens; draft_draws is the CPU's draft draws per step (its tree's
// depth + 1; 0: depth).
struct SpecChainOptions {
  int32_t n_predict = 128;
  std::vector<int32_t> stop_ids;  // generation ends after one of these (it is kept)
  int32_t draft_layers = 1;
  int32_t depth = 4;
  std::optional<TreeShape> tree;  // a tree of this shape instead of a chain; depth, draft_draws unused
  std::optional<PrunedVocabSpec> vocab;
  CudaModel* draft_model = nullptr;
  DeviceEagleHead* draft_head = nullptr;  // made for this model (its embeddings, its features)
  Graphs graphs = Graphs::On;  // replay the step as a captured CUDA graph
  int32_t sync_every = 4;      // steps between host checks for a stop token
  SamplingParams sampling;     // greedy (the default) or speculative sampling
  int32_t draft_draws = 0;     // with sampling on a chain: the draft sampler's draws per step (>= depth; 0: depth)
};
// The device's counts: the steps up to and including the one that emitted the last token the
// generation kept (the stop token, the last one wanted, the one a TokenHandler ended with), as the
// CPU decoder counts them; not the plain decode steps at the context's end.
struct SpecChainStats {
  int32_t steps = 0;           // verification forwards
  int32_t accepted_drafts = 0;  // draft tokens kept
  double mean_acceptance_length() const { return steps ? 1.0 + double(accepted_drafts) / steps : 0.0; }
};

class CudaModel {
 public:
  static std::unique_ptr<CudaModel> load(const GgufFile& file, const CudaModelOptions& options);
  // Llama-architecture weights of config's shapes drawn at random on the device in `type` (BF16 or
  // F16), norms near 1: for benchmarks of real shapes without a file.
  static std::unique_ptr<CudaModel> random(const ModelConfig& config, GgmlType type, uint64_t seed,
                                           const CudaModelOptions& options);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  int32_t n_past() const { return n_past_; }
  int32_t n_ctx() const { return options_.n_ctx; }
  cudaStream_t stream() const { return stream_; }
  size_t weight_bytes() const { return weight_bytes_; }
  const DeviceMatrix& output_matrix() const { return output_; }
  const DeviceMatrix& embedding_matrix() const { return token_embd_; }

  // What a forward computes, as the CPU Model's ForwardOptions names it.
  struct ForwardOptions {
    bool logits = false;     // the output rows' logits into device_logits()
    int32_t end_layer = -1;  // run layers [0, end_layer); -1: all
    // The residual stream entering the named layers, for every batch row (an EAGLE-3 head's
    // features; with all layers run).
    const FeatureCapture* capture = nullptr;
  };
  // Runs the batch through layers [0, options.end_layer), writing its keys and values into the
  // pending slots n_past + start + i. With options.logits the logits of the output rows are left
  // in device_logits() ([n_out][n_vocab]); hidden states after the final norm in device_hidden()
  // ([n_out][n_embd]). Asynchronous on stream(); throws Error on bad input.
  void forward(const HostBatch& batch, const ForwardOptions& options);
  const float* device_logits() const { return logits_; }
  const float* device_hidden() const { return hidden_; }
  // Copies the logits of the last forward to the host (synchronizes).
  void logits_to_host(int32_t n_rows, std::vector<float>& out) const;

  // Cache bookkeeping, all on the device: keep the first n pending slots, keep the pending slots
  // `indices` (strictly increasing; the accepted path of a tree) or forget everything past n.
  void commit_prefix(int32_t n);
  void commit(std::span<const int32_t> indices);
  void truncate(int32_t n);

  // Plain generation after `prompt`, greedy or sampled (options.sampling): the prompt in n_batch
  // chunks, then one token per step with the step's state on the device. Returns the generated ids
  // (stopping after a stop id).
  std::vector<int32_t> generate_plain(std::span<const int32_t> prompt, const PlainOptions& options,
                                      const TokenHandler& on_token = {});

  // The same with speculative decoding (see SpecChainOptions); on_token takes the tokens every
  // sync_every steps.
  std::vector<int32_t> generate_speculative(std::span<const int32_t> prompt, const SpecChainOptions& options,
                                            SpecChainStats* stats = nullptr, const TokenHandler& on_token = {});

  // Runs `steps` decode steps after the current state (the prompt's last token already sampled
  // into the device batch by generate_plain or prefill_for_decode); returns the seconds they
  // took, timed with device events. For benchmarks.
  void prefill_for_decode(std::span<const int32_t> prompt);
  // The same, also leaving the prompt in prompt_ids (device, [prompt.size()]; unless null) and, for k > 0, the
  // target's top k ids at every prompt position in prompt_top (device, [prompt.size()][k], k <= 64).
  struct PromptCandidates {
    int32_t k = 0;
    int32_t* prompt_top = nullptr;
    int32_t* prompt_ids = nullptr;
    const FeatureCapture* capture = nullptr;  // the prompt's features, row i at position i (a draft head's)
  };
  // pick: how the first generated token is picked from the prompt's last logits.
  void prefill_for_decode(std::span<const int32_t> prompt, const PromptCandidates& candidates,
                          const TokenPick& pick = {});
  // Greedy steps, or sampled with `sampling` (PlainOptions::sampling's rules).
  double time_decode_steps(int32_t steps, Graphs graphs, const SamplingParams& sampling = {});

 private:
  CudaModel(const ModelConfig& config, const CudaModelOptions& options);
  struct Layer;
  struct Projection;
  // What one device-resident speculative step runs.
  struct ChainStep {
    int32_t depth = 0;
    int32_t draft_layers = 0;           // self-draft
    DeviceDraftVocab* vocab = nullptr;  // null: the full vocabulary's draft head
    CudaModel* draft_model = nullptr;   // null: the self-draft (or the head)
    DeviceEagleHead* head = nullptr;    // an EAGLE-3 head drafts
    std::optional<TreeShape> tree;      // the drafter drafts a tree of this shape (depth unused)
    int32_t sample_k = 0;               // > 0: speculative sampling from each row's sample_k best
    int32_t draft_draws = 0;            // with sample_k: the draft sampler's draws per step
    // What a captured graph of the step was made for: objects by serial, not address.
    struct Key {
      int32_t depth = 0, draft_layers = 0;
      uint64_t vocab = 0, draft_model = 0, head = 0;
      std::optional<TreeShape> tree;
      int32_t sample_k = 0, draft_draws = 0;
      bool operator==(const Key&) const = default;
    };
    Key key() const {
      return Key{tree ? 0 : depth, draft_model || head ? 0 : draft_layers, vocab ? vocab->serial() : 0,
                 draft_model ? draft_model->serial_ : 0, head ? head->serial() : 0, tree, sample_k, draft_draws};
    }
  };
  void allocate_buffers();
  // Runs `batch` (its arrays in device memory) through the layers; output rows out_rows[0, n_out)
  // (device memory).
  void enqueue_forward(const DeviceBatch& batch, const int32_t* out_rows, int32_t n_out, const ForwardOptions& options);
  void enqueue_layer(const Layer& L, int32_t il, const DeviceBatch& batch);
  void project(const Projection& p, const float* x, int32_t n, float* y, int64_t ldy);
  void enqueue_decode_step(const TokenPick& pick);
  // tokens[0] = the pick from one logits row ([n_vocab], device); draw: the index of the random
  // bits a sampled pick uses (device; null: 0).
  void enqueue_pick(const float* row, const TokenPick& pick, const int32_t* draw);
  // A decode graph captured for another pick is destroyed (the next capture is this pick's).
  void drop_decode_graph_unless(const TokenPick& pick);
  // Checks a sampled generation's settings and uploads them with the seed's first n_bits random
  // bits (one per plain decoding token; speculative sampling's target draws); the pick its steps
  // use ({} for greedy).
  TokenPick begin_sampling(const SamplingParams& sampling, int32_t n_bits);
  // Speculative sampling's start (after begin_sampling): the draft sampler's bits for `steps`
  // steps of draws_per_step, and both counters (the target's at 1: the first token's draw).
  void begin_spec_sampling(const SamplingParams& sampling, int32_t steps, int32_t draws_per_step);
  // The target's bits from its `drawn`-th on, uploaded as plain decoding's from token index `at`:
  // where speculative sampling ends in plain sampled steps (the context's end).
  void continue_sampling_plainly(const SamplingParams& sampling, int32_t drawn, int32_t at, int32_t n_tokens);
  void enqueue_chain_step(const ChainStep& step);
  // The tree step (SpecChainOptions::tree) over tree_'s arrays.
  void enqueue_tree_step(const ChainStep& step);
  // A draft head's part of the step: its catch-up, then the drafts into tokens[1..depth].
  void enqueue_head_drafts(const ChainStep& step);
  // A draft head's rows of tree draft forward `forward` (0: its catch-up, whose root row proposes
  // the first level), scored by the LM head: the draft vocabulary's logits, or logits_.
  void enqueue_head_tree_rows(const ChainStep& step, const TreeState& st, int32_t forward);
  // A draft model's stream inside a step: it waits for what stream_ launched so far (fork_to), and
  // stream_ waits for what it launched (join_from); events, so a captured graph holds both.
  void fork_to(const CudaModel& drafter);
  void join_from(const CudaModel& drafter);
  // Captures what `enqueue` launches on stream_ as an instantiated graph.
  cudaGraphExec_t capture(const std::function<void()>& enqueue);
  // Runs `steps` of what `enqueue` launches: replays `graph` (captured on first use) with graphs
  // on, launches kernel by kernel with them off.
  void run_steps(cudaGraphExec_t& graph, int32_t steps, Graphs graphs, const std::function<void()>& enqueue);
  // n tokens of the device batch arrays from index `offset`, written to pending slots start + i.
  DeviceBatch device_batch(int32_t offset, int32_t n, int32_t start) const;
  DecodeState decode_state() const;
  ChainState chain_state(const ChainStep& step) const;
  ChainSampling chain_sampling(const ChainStep& step) const;
  TreeSampling tree_sampling(const ChainStep& step) const;
  // A sampled chain's pick of draft d from the drafter's row: its sample_k best (the packed head's
  // or the full logits'), then chain_draw, on `stream`.
  void enqueue_draft_draw(const ChainStep& step, int32_t d, const float* full_logits, cudaStream_t stream);
  TreeState tree_state(const ChainStep& step) const;
  void* alloc(size_t bytes);
  void destroy_stream_and_events();  // what the destructor and a failed constructor release
  // Copies out_ids[ids.size(), produced) to ids, calling on_token for each; stops after a stop id,
  // a token on_token refuses or at `limit` tokens (truncating ids there). Returns whether the
  // generation is over.
  bool fetch_emitted(int32_t produced, int32_t limit, const std::vector<int32_t>& stop_ids,
                     const TokenHandler& on_token, std::vector<int32_t>& ids);
  // Plain decode steps after the device state (tokens[0] emitted, at position n_past) until
  // `limit` tokens, a stop id or the end of the context; ids holds every token emitted so far.
  void decode_until(int32_t limit, const std::vector<int32_t>& stop_ids, Graphs graphs, int32_t sync_every,
                    const TokenPick& pick, const TokenHandler& on_token, std::vector<int32_t>& ids);
  // The resident steps of generate_speculative (step: what each one runs, made from o).
  std::vector<int32_t> speculate_resident(const SpecChainOptions& o, const ChainStep& step, const TokenHandler& on_token,
                                          SpecChainStats& st);

  ModelConfig config_;
  CudaModelOptions options_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
  size_t weight_bytes_ = 0;
  bool has_bias_ = false;

  DeviceMatrix token_embd_;     // [n_vocab rows][n_embd]
  DeviceMatrix output_;         // [n_vocab rows][n_embd]
  const float* output_norm_ = nullptr;  // [n_embd]
  std::vector<Layer> layers_;   // [n_layer]

  DeviceKV kv_;
  int32_t n_past_ = 0;  // host mirror of *kv_.n_past

  // Activations, sized for n_batch tokens.
  int32_t qkv_dim_ = 0;       // q_dim + 2 * kv_dim
  float* x_ = nullptr;        // [n_batch][n_embd] residual stream
  float* xn_ = nullptr;       // [n_batch][n_embd] normed block input
  float* qkv_ = nullptr;      // [n_batch][qkv_dim] q | k | v
  float* attn_ = nullptr;     // [n_batch][q_dim]
  float* o_ = nullptr;        // [n_batch][n_embd] block output (Gemma's post-norms)
  float* gate_up_ = nullptr;  // [n_batch][2 * n_ff] gate | up
  float* ffn_h_ = nullptr;    // [n_batch][n_ff]
  float* residual_ = nullptr; // [n_batch][n_embd] output rows' residual stream
  float* hidden_ = nullptr;   // [n_batch][n_embd] output rows after the final norm
  float* logits_ = nullptr;   // [n_batch][n_vocab]
  float* top_values_ = nullptr;  // [n_batch][64] top-k values scratch
  uint8_t* act_scratch_ = nullptr;  // quantized activations
  int32_t* d_tokens_ = nullptr;     // [n_batch]
  int32_t* d_positions_ = nullptr;  // [n_batch]
  int32_t* d_parents_ = nullptr;    // [n_batch]
  int32_t* d_out_rows_ = nullptr;   // [n_batch]
  int32_t* d_keep_ = nullptr;       // [n_ctx] pending indices to commit
  int32_t* d_n_keep_ = nullptr;     // [1] commit()'s count of them
  int32_t* d_out_ids_ = nullptr;    // [max_generate]
  int32_t* d_counter_ = nullptr;    // [1]
  DrawSettings* d_sample_settings_ = nullptr;  // [1] a sampled generation's temperature and top-p
  int32_t max_draw_bits_ = 0;                    // 1 + max_generate * n_batch
  uint64_t* d_draw_bits_ = nullptr;              // [max_draw_bits_] its random bits (the target sampler's)
  int32_t* d_top_ids_ = nullptr;                 // [64] a sampled pick's ranked ids (values: top_values_)
  // Speculative sampling (speculative/chain_sampling.h).
  int32_t max_draft_bits_ = 0;                   // max_generate * kMaxDraftDrawsPerStep
  uint64_t* d_draft_bits_ = nullptr;             // [max_draft_bits_] the draft sampler's random bits
  int32_t* d_target_drawn_ = nullptr;            // [1] target bits consumed
  int32_t* d_draft_drawn_ = nullptr;             // [1] draft bits consumed
  int32_t* d_draft_top_ids_ = nullptr;           // [n_batch][64] each draft row's ranked best ids
  float* d_draft_top_values_ = nullptr;          // [n_batch][64] their logits
  int32_t* d_verify_top_ids_ = nullptr;          // [n_batch][64] each verification row's ranked best ids
  float* d_verify_top_values_ = nullptr;         // [n_batch][64] their logits
  uint64_t* d_argmax_scratch_ = nullptr;  // [n_batch]
  int32_t* d_argmax_out_ = nullptr;       // [n_batch] argmax of each logits row (speculative steps)
  VocabUpdate* d_update_ = nullptr;       // [1] the resident chain's next vocabulary update
  int32_t* d_steps_ = nullptr;            // [1] the resident chain's steps
  int32_t* d_step_counts_ = nullptr;      // [max_generate] the resident chain's count of tokens after each step
  int32_t* h_staging_ = nullptr;    // pinned: [4][n_batch] batch arrays, then [n_ctx] keep list

  // MicroSpec's vocabulary over this model's head when it drafts (generate_speculative), kept
  // between generations.
  std::unique_ptr<DeviceDraftVocab> draft_vocab_;
  // A tree step's arrays (speculative/tree_state.h) in device memory, made for one shape and kept.
  struct DeviceTree;
  std::unique_ptr<DeviceTree> tree_;
  cudaGraphExec_t decode_graph_ = nullptr;
  TokenPick decode_graph_pick_;  // the pick decode_graph_ was captured with
  cudaGraphExec_t chain_graph_ = nullptr;  // the resident speculative step, made for chain_graph_for_
  ChainStep::Key chain_graph_for_;
  cudaEvent_t ev_start_ = nullptr, ev_stop_ = nullptr;
  cudaEvent_t ev_fork_ = nullptr, ev_join_ = nullptr;  // a draft model's stream inside the step
  uint64_t serial_ = next_object_serial();
};

}  // namespace microspec::cuda
