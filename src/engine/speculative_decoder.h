#pragma once
// The one generation entry point: the CLI, the server, the benchmark and the coverage measurement
// all generate through a Decoder built from the speculative settings. Plain decoding is a Decoder
// without a drafter (--spec none).
//
// One step of speculative decoding after the newest token (the root, not yet in the cache):
//   draft           the drafter proposes a token tree after the root (no drafter: no tree);
//   verify          the target runs root + tree in one forward pass, resuming the rows a drafter
//                   already ran through its first layers (Drafter::resume_for);
//   accept, commit  the longest path the target agrees with, plus the target's own next token (the
//                   bonus), is accepted and its cache slots committed;
//   update drafter  the drafter learns which path was kept (its cache, its draft vocabulary);
//   emit            the accepted tokens go through the same TokenSink as plain decoding.
// Every emitted token is the target's greedy choice, so greedy output (tokens, text, finish
// reason) equals Generator::generate's exactly. With temperature > 0 the draft tree is sampled and
// verified by recursive rejection sampling (speculative/tree.h, TreeSamplingVerifier): the output
// has exactly plain sampling's distribution, though not the same tokens for a seed.
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "gguf/gguf.h"
#include "speculative/drafter.h"
#include "speculative/drafter_setup.h"
#include "speculative/settings.h"
#include "speculative/tree.h"

namespace microspec {

struct SpecStats {
  int32_t steps = 0;           // verification passes (plain decoding: forward passes)
  int64_t accepted_draft = 0;  // draft tokens accepted over all steps
  int64_t drafted = 0;         // draft tree nodes proposed over all steps
  int64_t decode_tokens = 0;   // tokens after the prefill's that the sink took (bonus tokens included)
  double draft_seconds = 0.0;  // in Drafter::propose/accepted (backbone + draft LM head)
  double draft_lm_head_seconds = 0.0;   // the draft LM head (part of draft_seconds)
  double verify_seconds = 0.0;          // the target's verification forward (its LM head included)
  double verify_lm_head_seconds = 0.0;  // the target's LM head (part of verify_seconds)
  double bookkeeping_seconds = 0.0;     // acceptance, KV commit, draft-vocabulary updates, emitting
  int64_t active_vocab_sum = 0;         // draft vocabulary size summed over steps that drafted
  int32_t drafting_steps = 0;           // steps with a draft tree
  // Drafting steps whose tree was verified in one forward pass together with other sequences (the
  // batching server); counted by the caller that ran that pass.
  int32_t shared_drafting_steps = 0;
  // Draft forwards (tree levels) that ran in one forward call with other sequences' draft rows
  // (Decoder::draft_steps over several sequences: the batching server).
  int64_t shared_draft_forwards = 0;
  // Per DraftSource (none: a plain step, n-gram, model): the steps it drafted and the draft tokens
  // accepted from them (a speculative decoder's steps only).
  struct SourceCounts {
    int32_t steps = 0;
    int64_t accepted = 0;
  };
  std::array<SourceCounts, kDraftSources> by_source{};
  double draft_backbone_seconds() const { return draft_seconds - draft_lm_head_seconds; }
  double lm_head_seconds() const { return draft_lm_head_seconds + verify_lm_head_seconds; }
  double mean_active_vocab() const {
    return drafting_steps ? double(active_vocab_sum) / drafting_steps : 0.0;
  }
  // Accepted draft tokens + 1 per step: tokens per target pass.
  double mean_acceptance_length() const { return steps ? double(accepted_draft + steps) / steps : 0.0; }
};

// The result of a generation and the speeds every front end reports from it.
struct SpecResult {
  GenerateResult gen;
  SpecStats stats;
  // Tokens produced after the prefill that the sink took: a step's tokens after an
  // end-of-generation token, a stop string or the token limit are not counted.
  int64_t decode_tokens() const { return stats.steps > 0 ? stats.decode_tokens : gen.decode_forwards; }
  double decode_tokens_per_second() const {
    return gen.decode_seconds > 0 ? double(decode_tokens()) / gen.decode_seconds : 0.0;
  }
  double prefill_tokens_per_second() const {
    return gen.prefill_seconds > 0 ? gen.prompt_tokens / gen.prefill_seconds : 0.0;
  }
};

// Sees what the target computes during a generation, for measurements (`microspec coverage`):
// the target's top prompt_top_k ids at every prompt position once the prompt is in ([prompt][k],
// best first), then every generated token with the target's logits row it was chosen from, just
// before the sink takes it (the token that ends the generation included).
struct DecodeObserver {
  int32_t prompt_top_k = 0;  // plain decoding only (a drafter asks for its own)
  std::function<void(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top)> on_prompt;
  std::function<void(int32_t token, const float* logits)> on_token;
};

class Decoder {
 public:
  // The drafter config asks for (none for --spec none) over gen's model; gen's cache is shared
  // with a self-drafter. target_file, gen and tokenizer must outlive the decoder. Throws Error for
  // invalid settings.
  // share_draft_model_of: a decoder whose --spec draft model this one runs on as well (must
  // outlive it; see build_drafter), null to load its own.
  // batch_sequences: most sequences whose steps share one verification pass (the batching server's
  // slots), for --spec auto's costs (build_drafter).
  Decoder(const SpecConfig& config, const GgufFile& target_file, Generator& gen, const Tokenizer& tokenizer,
          const Decoder* share_draft_model_of = nullptr, int32_t batch_sequences = 1);
  // With a drafter made elsewhere (tests), or none (nullptr: plain decoding); not owned.
  Decoder(Generator& gen, const Tokenizer& tokenizer, Drafter* drafter, const TreeParams& tree);

  SpecResult generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                      const TextCallback& on_text = nullptr, const DecodeObserver* observer = nullptr);

  bool speculative() const { return drafter_ != nullptr; }
  // One line describing drafter and tree ("plain decoding" without a drafter).
  const std::string& describe() const { return describe_; }
  // The separate draft model of --spec draft (null otherwise).
  const Model* draft_model() const { return built_.draft_model; }

 private:
  // The generation's sampling state, an argument of every part that samples: the target's
  // sampler, and for temperature > 0 the draft's (same filters, a derived seed) with the state
  // Drafter::propose draws into. Greedy decoding draws nothing.
  struct Sampling {
    Sampler target;
    std::optional<Sampler> draft;
    DraftSampling draft_state;
    Sampling(const SamplingParams& params, int32_t n_vocab);
    DraftSampling* for_drafter() { return draft ? &draft_state : nullptr; }
  };

 public:
  // One generation in progress, for callers that interleave generations step by step (the
  // batching server): start() prefills and takes the first token, advance() runs one step,
  // finish() releases held-back text and fills the timings; the result is then in `res`.
  // generate() is exactly start, advance until false, finish. params and on_text must outlive it.
  struct Run {
    Run(const Tokenizer& tokenizer, const GenerateParams& params, const TextCallback& on_text, int32_t n_vocab);
    SpecResult res;
    TokenSink sink;  // writes into res.gen
    Sampling sampling;
    Penalizer penalties;          // the target rows' penalties and logit bias (params.penalties)
    std::vector<float> first_row;  // [n_vocab] with penalties: the first token's transformed row
    std::chrono::steady_clock::time_point decode_start;
    double draft_head0 = 0.0;   // the drafter's LM-head seconds before the run
    int32_t root = -1;          // newest token, not yet in the cache
    int32_t step_position = 0;  // cache position of the current step's root
    bool drafted = false;       // the current step has a draft tree
    DraftSource source = DraftSource::None;  // who drafted the current step's tree (None: empty)
    int32_t prefilled = 0;      // prompt positions in the cache (start_piece)
    // Prompt rows the cache already holds when the run starts (a prefix cache): set before
    // start(); the caller vouches that rows [0, reused_rows) hold prompt[0, reused_rows) and were
    // last prefilled by this decoder (so its K_pre ids and head features of those rows are kept
    // too). The drafter still begins from the whole prompt, exactly as after a fresh prefill.
    int32_t reused_rows = 0;
    bool prefill_begun = false;                           // start_piece began the prefill
    std::chrono::steady_clock::time_point prefill_start;  // when the first prompt piece ran
    std::chrono::steady_clock::time_point verify_start;  // when the current step's rows were handed out
  };
  // Prefills the prompt and takes the first token. False when the generation already ended.
  bool start(Run& run, const std::vector<int32_t>& prompt, const DecodeObserver* observer = nullptr);
  // start() in pieces of at most max_tokens prompt positions, for a caller that bounds the prompt
  // tokens of one pass (the batching server): each call runs the next piece with the same prompt;
  // the one that completes it takes the first token as start() does. start() is start_piece with
  // n_batch pieces until it returns more than Prefilling.
  enum class Progress { Prefilling, Running, Ended };
  Progress start_piece(Run& run, const std::vector<int32_t>& prompt, int32_t max_tokens,
                       const DecodeObserver* observer = nullptr);
  // start_piece's two halves, for a caller that runs the piece in its own forward call together
  // with other sequences' rows (the batching server: one pass for every sequence's rows); the
  // results are bitwise start_piece's. start_piece is start_rows, a call of its own, start_taken.
  //   start_rows     the next piece of at most max_tokens prompt positions, as this sequence's
  //                  part of the call, which must run with verify_options() (a piece needs the same:
  //                  logits, and the features a draft head reads), so one call can hold prompt
  //                  pieces and verified rows;
  //   start_taken    after the call: commits the piece (with the drafter's prompt statistics) and,
  //                  once the prompt is in, takes the first token.
  SequenceForward start_rows(Run& run, const std::vector<int32_t>& prompt, int32_t max_tokens,
                             const DecodeObserver* observer = nullptr);
  Progress start_taken(Run& run, const std::vector<int32_t>& prompt, const DecodeObserver* observer = nullptr);
  // One step: draft_step with the configured tree, the verification pass of its own (resuming
  // what a self-drafter already ran), accept_step. False once the generation ended.
  bool advance(Run& run, const DecodeObserver* observer = nullptr);
  void finish(Run& run);

  // The parts of one step, for a caller that verifies several sequences' trees in ONE forward pass
  // (the batching server: Model::forward over every sequence's verify_rows, with
  // verify_options()). advance() is draft_step, its own pass over the same rows, accept_step.
  //   draft_step   the drafter proposes a tree no larger than `shape` (total_tokens 0, or no
  //                drafter: no tree, the step is a plain decoding step). True when it drafted.
  //   verify_rows  this sequence's part of the caller's forward call: the root at the cache's
  //                first pending slot, tree node i at slot i + 1, every row's logits asked for;
  //                the leading rows a self-drafter already ran through the target's first layers
  //                resume there (SequenceForward::resumed_rows) instead of being recomputed.
  //   accept_step  accepts the longest agreed path plus the bonus token, commits it, updates the
  //                drafter (its MicroSpec window too) and emits. False once the generation ended.
  bool draft_step(Run& run, const TreeParams& shape);
  SequenceForward verify_rows(Run& run);
  // draft_step of several sequences together (the batching server): each its own decoder, run and
  // shape; the drafters' forwards of each tree level run in one forward call over all the
  // sequences' rows (draft_together: the weights read once per level), and each sequence keeps its
  // own cache, draft vocabulary and tree. Each tree is the one draft_step gives alone. Sets every
  // run's `drafted`. jobs: [steps.size()] the caller's scratch (nothing allocated per step).
  struct DraftStep {
    Decoder* decoder = nullptr;
    Run* run = nullptr;
    TreeParams shape;
    int32_t shared_rows = 0;  // rows of other sequences in the same verification pass (Drafter::set_shared_rows)
  };
  static void draft_steps(std::span<const DraftStep> steps, std::span<DraftJob> jobs);
  bool accept_step(Run& run, const DecodeObserver* observer = nullptr);
  // What the caller's forward call must ask for: every row's logits, and the target features a
  // draft head reads (empty for other drafters).
  ForwardOptions verify_options() const;
  // The tree --tree-depth / --tree-topk / --tree-tokens configured.
  const TreeParams& tree_params() const { return params_; }

 private:
  // Checks that a step fits the batch size and sizes the step buffers.
  void size_step_buffers();
  // After the forward call of start_rows' piece: commits it (K_pre and the draft head's features
  // are collected on the way); once the prompt is in, returns the first generated token (and sets
  // *first_logits to the row it was chosen from), else -1.
  int32_t prefill_taken(Run& run, const std::vector<int32_t>& prompt, const DecodeObserver* observer,
                        const float** first_logits);
  // The prefill's K_pre (a drafter's, or the observer's for plain decoding) and features to capture.
  int32_t prompt_top_k(const DecodeObserver* observer) const;
  PrefillCapture prompt_capture();
  // The step's parts, in order (see the top of this file).
  // Whether a step at `position` drafts a tree of `shape` (clears the tree either way).
  bool will_draft(int32_t position, const TreeParams& shape);
  // Fills batch_ with the verification rows: the root, then the tree's nodes.
  void set_verify_rows(int32_t root, int32_t position);
  // The verification pass of a sequence alone: its verify_rows in a forward call of their own.
  void verify(const SequenceForward& rows, SpecStats& st);
  // Applies the run's penalties to every verified row in place: row 0 with the history, node k's
  // row with the history plus the path root -> k (its ancestors and itself, never its siblings).
  void penalise_rows(Penalizer& penalties);
  // Structured output, greedy trees: drops every node the grammar does not allow after its path,
  // with its subtree (the constrained target could never accept it), so drafters propose only
  // grammar-valid tokens. Sampled trees keep theirs: dropping a drawn node would bias the draws
  // that verification assumes (the masked target rejects such a node instead).
  void drop_disallowed(Penalizer& constraint);
  // The tokens root -> node k of the tree (its ancestors and itself), in node_path_.
  std::span<const int32_t> path_to(int32_t k);
  void accept_and_commit(Sampling& sampling, SpecStats& st);
  void update_drafter(int32_t root, SpecStats& st);
  bool emit(int32_t position, Run& run, const DecodeObserver* observer);

  Generator& gen_;
  const Tokenizer& tokenizer_;
  BuiltDrafter built_;          // what the settings built (empty for a drafter made elsewhere)
  Drafter* drafter_ = nullptr;  // null: plain decoding
  TreeParams params_;
  std::string describe_;

  // One step's buffers, sized at construction (the verify rows) or on first use.
  DraftTree tree_;
  Batch batch_;                   // verification: root at pending slot 0, node i at slot i + 1
  ForwardOutput out_;             // [1 + tree nodes][n_vocab] target logits
  std::vector<int32_t> argmax_;   // [1 + tree nodes] target argmax per verified row
  std::vector<int32_t> path_;     // accepted node indices
  std::vector<int32_t> emitted_;  // tokens of one step
  std::vector<int32_t> commit_;   // pending slots to commit
  std::vector<int32_t> node_path_;  // [tree depth] tokens root -> node (penalise_rows)
  std::vector<int32_t> node_index_;  // [tree nodes] a node's index after drop_disallowed, -1: dropped
  TreeSamplingVerifier verifier_;
  std::vector<int32_t> prompt_top_;  // [prompt][drafter's K_pre] target top ids per prompt position
  std::vector<float> prompt_features_;  // [prompt][drafter's feature layers][n_embd] (a draft head's)
};

}  // namespace microspec
