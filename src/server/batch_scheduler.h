#pragma once
// Continuous batching for `microspec serve`: one Model (one set of scratch buffers, one compute
// thread pool) serves every slot. A scheduler thread runs steps; at each step boundary it admits
// the generations that arrived, runs one multi-sequence forward pass (Model::forward over a span
// of sequences) for all plain-decoding sequences, samples each sequence's next token, and retires
// the sequences that finished, were cancelled or asked to stop. A newcomer's prompt is prefilled
// in pieces: at most `prefill_chunk` prompt tokens per step over all newcomers (first come, first
// served), so decoding sequences keep producing a token every step.
//
// Each slot (sequence) has its own KV cache (its Generator's) and, with --spec, its own Decoder
// and drafter over the shared model (its own MicroSpec window and draft vocabulary). A speculative
// sequence alone in the server runs whole speculative steps (Decoder::advance: draft, its own
// verification pass, accept). While other sequences run, each speculative sequence drafts its tree
// (Decoder::draft_steps, with the shape draft_shape() gives for the sequences in flight), and the
// roots and trees of all of them are verified in the same batched forward pass as the plain rows
// and the prompt pieces (Decoder::verify_rows); then each accepts its path and compacts its own
// cache (Decoder::accept_step). A speculative sequence's prompt pieces join the batched pass as
// well (Decoder::start_rows / start_taken: its drafter gathers the prompt statistics, K_pre and a
// head's features, on the way), within the same prefill budget as plain ones. The speculative
// sequences of a step draft together (Decoder::draft_steps): at each tree level ONE draft forward
// runs all their frontier rows (self-drafters: the target's first layers, read once per level for
// all sequences), while each keeps its own cache, MicroSpec window, draft LM head rows and tree.
//
// Exactness: every kernel is per row and batch invariant, so a sequence's logits do not depend on
// what shares its forward pass or how its prompt was cut into pieces; each sequence samples with
// its own Sampler in the order plain decoding does. Outputs therefore equal the single-stream CLI
// token for token (greedy, and sampling with a seed).
//
// Threads: generate() is called on the HTTP worker thread that holds the slot; it hands the
// request to the scheduler thread and waits, calling on_text on its own thread with the text the
// scheduler produced, so a slow client (a stream writer waiting for its socket) never stalls the
// batch. on_text returning false stops the generation at the scheduler's next step.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <string>
#include <thread>
#include <vector>

#include "engine/generator.h"
#include "model/model.h"
#include "engine/speculative_decoder.h"
#include "tokenizer/tokenizer.h"

namespace microspec::server {

// Receives text as it becomes final, with the log-probability entries (rows of 1 + top, see
// sampling/logprobs.h) of the tokens generated since the previous call: empty unless the request
// asked for logprobs. Entries of tokens whose text never came (the last ones, held back or empty)
// are in the result's gen.logprobs only. Return false to stop.
using PieceCallback = std::function<bool(std::string_view text, std::span<const TokenLogprob> logprobs)>;

// What one slot keeps across generations: its KV cache (in the Generator) and its Decoder, and
// what a later generation may take from them (the prefix cache).
struct SequenceSlot {
  std::unique_ptr<Generator> gen;    // the shared model, this slot's KV cache of n_ctx tokens
  std::unique_ptr<Decoder> decoder;  // the server's speculative settings (--spec none: plain decoding)
  std::vector<int32_t> cached;       // [<= n_ctx] the tokens the cache's committed rows hold, in order
  // Leading rows of `cached` whose prompt statistics (K_pre ids, a draft head's features) the
  // decoder still holds: a speculative generation may reuse only these rows, so that its drafter
  // begins exactly as after a fresh prefill.
  int32_t decoder_rows = 0;
};

// The draft policy: the tree a speculative sequence drafts in one step when `in_flight` sequences
// (speculative or not) share the server. Speculation pays most at low load; at high load the batch
// itself fills the machine and a tree's extra rows cost more than they save. Up to half of
// spec_max_batch (--spec-max-batch) sequences the configured tree, up to spec_max_batch a chain
// of at most 2 tokens, above it none (total_tokens 0: the sequence decodes one token per step).
TreeParams draft_shape(const TreeParams& configured, int in_flight, int spec_max_batch);

class BatchScheduler {
 public:
  // slots: one per --parallel sequence, all over `model`. prefill_chunk: most prompt tokens one
  // step takes over all sequences (at least 1; capped by the model's n_batch minus the decoding
  // sequences' rows). spec_max_batch: the draft policy's threshold (draft_shape).
  BatchScheduler(Model& model, const Tokenizer& tokenizer, std::vector<SequenceSlot> slots, int32_t prefill_chunk,
                 int spec_max_batch);
  ~BatchScheduler();
  BatchScheduler(const BatchScheduler&) = delete;
  BatchScheduler& operator=(const BatchScheduler&) = delete;

  // Generates in slot `slot` (the caller holds it exclusively) as part of the running batch;
  // blocks until the generation ends. speculative: through the slot's drafter (which must exist).
  // Throws what the generation threw (Error: an engine fault).
  // reuse_prompt_rows: rows of the slot's cache the generation keeps instead of prefilling them
  // again, at most reusable_rows(); the rest of the prompt is prefilled after them, which is
  // bitwise what a fresh prefill gives (the kernels are batch invariant), so the output is the
  // same token for token, and a speculative generation's drafter begins from the whole prompt.
  SpecResult generate(int slot, const std::vector<int32_t>& prompt, const GenerateParams& params, bool speculative,
                      const PieceCallback& on_piece, int32_t reuse_prompt_rows);
  // The rows of slot `slot`'s cache a generation of `prompt` may keep: the common prefix of the
  // slot's cached tokens and the prompt, less the prompt's last token (run again for its logits
  // row); for a speculative generation also at most the decoder's rows (SequenceSlot). The caller
  // must hold the slot.
  int32_t reusable_rows(int slot, const std::vector<int32_t>& prompt, bool speculative) const;

  int size() const { return static_cast<int>(slots_.size()); }
  const SequenceSlot& slot(int i) const { return slots_[i]; }

 private:
  // One generation, shared by its waiting caller and the scheduler thread (under mu_).
  struct Request {
    const std::vector<int32_t>* prompt = nullptr;
    const GenerateParams* params = nullptr;
    bool speculative = false;
    int32_t reuse_prompt_rows = 0;  // see generate()
    TextCallback to_caller;    // the sinks' callback: appends to text (runs on the scheduler thread)
    std::string text;          // produced, not yet handed to the caller's on_piece
    const GenerateResult* source = nullptr;  // where the sink records (set at admission)
    size_t logprobs_copied = 0;              // source's log-probability entries copied to `logprobs`
    std::vector<TokenLogprob> logprobs;      // copied, not yet handed over (reserved up front)
    bool stop = false;         // the caller's on_text returned false
    bool finished = false;     // result (or error) is final
    SpecResult result;
    std::exception_ptr error;
    std::condition_variable cv;  // the caller waits on it
  };

  // The scheduler thread's state of one running sequence (only that thread touches it).
  struct Running {
    int slot = -1;
    Request* req = nullptr;
    // Plain decoding in the batch:
    std::unique_ptr<Sampler> sampler;
    std::unique_ptr<Penalizer> penalties;  // applied to each newest row before sampling
    std::unique_ptr<TokenSink> sink;  // writes into req->result.gen
    int32_t prefilled = 0;            // prompt tokens in the cache
    int32_t next_token = -1;          // sampled, not yet in the cache (-1 while prefilling)
    Batch batch;
    ForwardOutput out;
    std::chrono::steady_clock::time_point admitted, decode_start;
    // Speculative decoding through the slot's Decoder, one step per round:
    std::unique_ptr<Decoder::Run> run;
    bool started = false;  // the prompt is in (Decoder::start_piece, a piece per round) and the first token taken
    bool stepped = false;  // this round's step ran in the batched pass
  };

  void loop();
  std::unique_ptr<Running> admit(int slot, Request* req);
  // The batched forward step: the newest token of each plain decoding sequence, the root and draft
  // tree of each speculative one (while others run), a prompt piece of each prefilling one (within
  // the step's prefill budget and the rows left). Returns the sequences that ended.
  void batched_step(std::vector<Running*>& ended);
  // A prompt piece of a speculative sequence that has not started, in the batched pass: at most
  // `budget` tokens (taken from it). False when it added none: no budget left, its client left
  // (it is then in `ended`), or its prompt was refused (it is retired with the error).
  bool add_speculative_piece(Running& seq, int32_t& budget, std::vector<Running*>& ended);
  // One step of a speculative sequence alone in the server (its prefill first). False when it ended.
  bool speculative_step(Running& seq);
  // Samples the sequence's next token from its newest logits and hands it to its sink. False when
  // the generation ended with it.
  bool take_token(Running& seq);
  // Ends a sequence: final text, timings, result (or error) to its caller.
  void retire(Running& seq, std::exception_ptr error);
  // Records what the sequence's slot cache holds once it ended (nothing after a failure).
  void remember_cache(const Running& seq, bool failed);
  // The client left, or the caller's on_text asked to stop.
  bool stop_requested(const Running& seq);

  Model& model_;
  const Tokenizer& tokenizer_;
  std::vector<SequenceSlot> slots_;
  const int32_t prefill_chunk_;
  const int spec_max_batch_;

  std::mutex mu_;
  std::condition_variable wake_;            // the scheduler waits on it for work
  std::vector<std::pair<int, Request*>> incoming_;  // [slots] admitted at the next step boundary
  bool quit_ = false;

  std::vector<std::unique_ptr<Running>> running_;  // [slots] in admission order (scheduler thread only)
  std::vector<SequenceForward> call_;           // [slots] the batched forward's sequences
  std::vector<Running*> in_call_;               // [slots] the sequence of each call_ entry
  std::vector<Decoder::DraftStep> draft_steps_;  // [slots] the speculative sequences drafting this step
  std::vector<DraftJob> draft_jobs_;             // [slots] Decoder::draft_steps' scratch
  std::vector<Running*> drafting_;               // [slots] the sequence of each draft_steps_ entry
  std::thread thread_;
};

}  // namespace microspec::server
