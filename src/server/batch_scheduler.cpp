#include "server/batch_scheduler.h"

#include <algorithm>
#include <utility>

#include "util/error.h"

namespace microspec::server {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

TreeParams draft_shape(const TreeParams& configured, int in_flight, int spec_max_batch) {
  // The table: sequences in flight -> what each speculative sequence drafts per step.
  //   1 .. max(1, spec_max_batch / 2)   the configured tree
  //   .. spec_max_batch                 a chain of at most kShortChain tokens
  //   more                              nothing (a plain decoding row)
  constexpr int32_t kShortChain = 2;
  if (in_flight <= std::max(1, spec_max_batch / 2)) return configured;
  if (in_flight <= spec_max_batch) {
    const int32_t n = std::min(kShortChain, configured.total_tokens);
    return {.depth = std::max(0, n - 1), .top_k = 1, .total_tokens = n};
  }
  return {.depth = 0, .top_k = 1, .total_tokens = 0};
}

BatchScheduler::BatchScheduler(Model& model, const Tokenizer& tokenizer, std::vector<SequenceSlot> slots,
                               int32_t prefill_chunk, int spec_max_batch)
    : model_(model),
      tokenizer_(tokenizer),
      slots_(std::move(slots)),
      prefill_chunk_(prefill_chunk),
      spec_max_batch_(spec_max_batch) {
  if (slots_.empty()) throw Error("the scheduler needs at least one slot");
  if (prefill_chunk_ < 1) throw Error("--prefill-chunk must be >= 1");
  if (spec_max_batch_ < 0) throw Error("--spec-max-batch must be >= 0");
  for (SequenceSlot& slot : slots_) slot.cached.reserve(size_t(slot.gen->cache().n_ctx()));
  if (int32_t(slots_.size()) > model_.n_batch())
    throw Error("--parallel " + std::to_string(slots_.size()) + " exceeds the batch size " +
                std::to_string(model_.n_batch()) + ": every running sequence needs a row per step (raise -b)");
  incoming_.reserve(slots_.size());
  running_.reserve(slots_.size());
  call_.reserve(slots_.size());
  in_call_.reserve(slots_.size());
  draft_steps_.reserve(slots_.size());
  draft_jobs_.resize(slots_.size());
  drafting_.reserve(slots_.size());
  thread_ = std::thread([this] { loop(); });
}

BatchScheduler::~BatchScheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

SpecResult BatchScheduler::generate(int slot, const std::vector<int32_t>& prompt, const GenerateParams& params,
                                    bool speculative, const PieceCallback& on_piece, int32_t reuse_prompt_rows) {
  if (slot < 0 || slot >= size()) throw Error("scheduler: no slot " + std::to_string(slot));
  if (speculative && !slots_[slot].decoder->speculative())
    throw Error("speculative generation asked of a server built without speculation");
  if (reuse_prompt_rows < 0 || reuse_prompt_rows > reusable_rows(slot, prompt, speculative))
    throw Error("scheduler: " + std::to_string(reuse_prompt_rows) + " reused rows of a " +
                std::to_string(prompt.size()) + "-token prompt; slot " + std::to_string(slot) + " can give " +
                std::to_string(reusable_rows(slot, prompt, speculative)));
  Request req;
  req.prompt = &prompt;
  req.params = &params;
  req.speculative = speculative;
  req.reuse_prompt_rows = reuse_prompt_rows;
  // Log-probability entries travel with the text; both buffers hold the whole generation's, so
  // handing them over allocates nothing per token.
  const size_t logprob_entries = params.logprobs.enabled ? size_t(std::max(params.max_new_tokens, 0)) *
                                                               (size_t(params.logprobs.top) + 1)
                                                         : 0;
  req.logprobs.reserve(logprob_entries);
  std::vector<TokenLogprob> handed;  // the entries of the piece being handed to on_piece
  handed.reserve(logprob_entries);
  req.to_caller = [this, &req](std::string_view text) {  // on the scheduler thread, under no lock
    std::lock_guard<std::mutex> lock(mu_);
    req.text.append(text);
    const std::vector<TokenLogprob>& recorded = req.source->logprobs.entries;
    req.logprobs.insert(req.logprobs.end(), recorded.begin() + ptrdiff_t(req.logprobs_copied), recorded.end());
    req.logprobs_copied = recorded.size();
    req.cv.notify_all();
    return !req.stop;
  };
  std::unique_lock<std::mutex> lock(mu_);
  if (quit_) throw Error("the scheduler has stopped");
  incoming_.emplace_back(slot, &req);
  wake_.notify_all();
  // Hand the text to on_piece as it comes, on this thread: a caller that blocks (a stream writer
  // waiting for its socket) delays only itself.
  for (;;) {
    req.cv.wait(lock, [&] { return req.finished || !req.text.empty(); });
    if (!req.text.empty()) {
      std::string text;
      text.swap(req.text);
      handed.clear();
      handed.swap(req.logprobs);
      lock.unlock();
      const bool more = !on_piece || on_piece(text, handed);
      lock.lock();
      if (!more) req.stop = true;
      continue;
    }
    break;  // finished and every piece handed over
  }
  if (req.error) std::rethrow_exception(req.error);
  return std::move(req.result);
}

int32_t BatchScheduler::reusable_rows(int slot, const std::vector<int32_t>& prompt, bool speculative) const {
  if (slot < 0 || slot >= size()) throw Error("scheduler: no slot " + std::to_string(slot));
  const SequenceSlot& s = slots_[slot];
  const auto [mismatch, unused] =
      std::mismatch(s.cached.begin(), s.cached.end(), prompt.begin(), prompt.end());
  int32_t rows = static_cast<int32_t>(mismatch - s.cached.begin());
  rows = std::min(rows, static_cast<int32_t>(prompt.size()) - 1);  // the last prompt row is run again
  if (speculative) rows = std::min(rows, s.decoder_rows);
  return std::max(rows, 0);
}

void BatchScheduler::loop() {
  std::vector<Running*> ended;
  ended.reserve(slots_.size());
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return quit_ || !incoming_.empty() || !running_.empty(); });
      if (quit_ && running_.empty() && incoming_.empty()) return;
      for (auto& [slot, req] : incoming_) running_.push_back(admit(slot, req));
      incoming_.clear();
    }
    // A round: one batched step (plain sequences, and speculative ones while others run), then a
    // speculative step of each speculative sequence that was not in it.
    ended.clear();
    try {
      batched_step(ended);
    } catch (...) {
      // A fault inside the shared forward pass ends every sequence that took part in it.
      const std::exception_ptr error = std::current_exception();
      for (auto& seq : running_)
        if (seq->req && (!seq->req->speculative || seq->stepped)) retire(*seq, error);
      std::erase_if(running_, [](const auto& seq) { return seq->req == nullptr; });
      continue;
    }
    for (auto& seq : running_) {
      if (!seq->req || !seq->req->speculative) continue;
      if (seq->stepped) {  // its step ran in the batched pass
        seq->stepped = false;
        continue;
      }
      try {
        if (!speculative_step(*seq)) ended.push_back(seq.get());
      } catch (...) {
        retire(*seq, std::current_exception());
      }
    }
    for (Running* seq : ended) retire(*seq, nullptr);
    std::erase_if(running_, [](const auto& seq) { return seq->req == nullptr; });
  }
}

std::unique_ptr<BatchScheduler::Running> BatchScheduler::admit(int slot, Request* req) {
  auto seq = std::make_unique<Running>();
  seq->slot = slot;
  seq->req = req;
  seq->admitted = Clock::now();
  if (req->speculative) {
    seq->run = std::make_unique<Decoder::Run>(tokenizer_, *req->params, req->to_caller, model_.config().n_vocab);
    seq->run->reused_rows = req->reuse_prompt_rows;
    req->source = &seq->run->res.gen;
    return seq;
  }
  req->source = &req->result.gen;
  req->result.gen.prompt_tokens = static_cast<int32_t>(req->prompt->size());
  seq->sampler = std::make_unique<Sampler>(req->params->sampling, model_.config().n_vocab);
  seq->penalties = std::make_unique<Penalizer>(req->params->penalties, model_.config().n_vocab,
                                               grammar_matcher(*req->params, model_.config().n_vocab));
  seq->penalties->begin(*req->prompt, slots_[slot].gen->cache().n_ctx() + 1);
  seq->sink = std::make_unique<TokenSink>(tokenizer_, *req->params, req->to_caller, req->result.gen);
  return seq;
}

bool BatchScheduler::stop_requested(const Running& seq) {
  const std::atomic<bool>* cancel = seq.req->params->cancel;
  if (cancel && cancel->load(std::memory_order_relaxed)) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return seq.req->stop;
}

void BatchScheduler::batched_step(std::vector<Running*>& ended) {
  call_.clear();
  in_call_.clear();
  ForwardOptions options{.logits = true};
  // Decoding sequences first (one row each), then prompt pieces within the step's budget, in
  // admission order so an earlier request's prompt finishes first.
  int32_t rows = 0;
  for (auto& seq : running_) {
    if (seq->req->speculative || seq->next_token < 0) continue;
    if (stop_requested(*seq)) {
      ended.push_back(seq.get());
      continue;
    }
    KVCache& kv = slots_[seq->slot].gen->cache();
    seq->batch.set_sequence(std::span<const int32_t>(&seq->next_token, 1), kv.n_past(), false);
    call_.push_back({.batch = &seq->batch, .kv = &kv, .out = &seq->out});
    in_call_.push_back(seq.get());
    ++rows;
  }
  // Speculative sequences join the batched pass while other sequences run (alone, they take whole
  // steps of their own in the loop): each drafts a tree of the shape the policy gives for the
  // sequences in flight, and its root and tree become its rows of the pass.
  // Their trees are drafted together: each tree level's draft forward is one call over all of them
  // (Decoder::draft_steps).
  if (running_.size() > 1) {
    const int in_flight = static_cast<int>(running_.size());
    int32_t waiting = 0;  // started speculative sequences still to add: each needs a row at least
    for (auto& seq : running_) waiting += seq->req->speculative && seq->started;
    draft_steps_.clear();
    drafting_.clear();
    int32_t reserved = rows;  // rows of the pass so far, with each drafting sequence's largest tree
    for (auto& seq : running_) {
      if (!seq->req->speculative || !seq->started) continue;
      --waiting;
      seq->stepped = true;  // this round's step is taken here (or the sequence ends here)
      if (stop_requested(*seq)) {
        ended.push_back(seq.get());
        continue;
      }
      Decoder& decoder = *slots_[seq->slot].decoder;
      TreeParams shape = draft_shape(decoder.tree_params(), in_flight, spec_max_batch_);
      shape.total_tokens = std::min(shape.total_tokens, model_.n_batch() - reserved - waiting - 1);
      draft_steps_.push_back({.decoder = &decoder, .run = seq->run.get(), .shape = shape, .shared_rows = in_flight - 1});
      drafting_.push_back(seq.get());
      reserved += shape.total_tokens + 1;  // the root and at most total_tokens nodes
      options = decoder.verify_options();  // the same for every slot: one server configuration
    }
    Decoder::draft_steps(draft_steps_, draft_jobs_);
    for (Running* seq : drafting_) {
      call_.push_back(slots_[seq->slot].decoder->verify_rows(*seq->run));
      in_call_.push_back(seq);
      rows += call_.back().batch->size();
    }
  }
  int32_t budget = std::min(prefill_chunk_, model_.n_batch() - rows);
  for (auto& seq : running_) {
    if (seq->req->speculative) {
      if (!seq->started && running_.size() > 1 && add_speculative_piece(*seq, budget, ended))
        options = slots_[seq->slot].decoder->verify_options();  // the same for every slot: one server configuration
      continue;
    }
    if (seq->next_token >= 0) continue;
    if (stop_requested(*seq)) {
      ended.push_back(seq.get());
      continue;
    }
    const std::vector<int32_t>& prompt = *seq->req->prompt;
    KVCache& kv = slots_[seq->slot].gen->cache();
    if (seq->prefilled == 0) {
      if (prompt.empty() || int64_t(prompt.size()) >= kv.n_ctx()) {  // this request's fault alone
        retire(*seq, std::make_exception_ptr(Error("the prompt has " + std::to_string(prompt.size()) +
                                                   " tokens; the context holds " + std::to_string(kv.n_ctx()))));
        continue;
      }
      if (seq->sink->done()) {  // max_tokens 0: nothing to generate, nothing to compute
        ended.push_back(seq.get());
        continue;
      }
      // The rows a previous choice of the same request left are kept (see generate()).
      const int32_t reuse = seq->req->reuse_prompt_rows;
      if (kv.n_past() < reuse) {
        retire(*seq, std::make_exception_ptr(Error("the slot's cache holds " + std::to_string(kv.n_past()) +
                                                   " rows, not the " + std::to_string(reuse) + " reused ones")));
        continue;
      }
      kv.truncate(reuse);
      seq->prefilled = reuse;
    }
    if (budget == 0) continue;
    const int32_t len = std::min(budget, int32_t(prompt.size()) - seq->prefilled);
    seq->batch.set_sequence(std::span<const int32_t>(prompt.data() + seq->prefilled, len), seq->prefilled, false);
    // Only the piece that ends the prompt needs its last row's logits.
    if (seq->prefilled + len < int32_t(prompt.size())) seq->batch.output_rows.clear();
    call_.push_back({.batch = &seq->batch, .kv = &kv, .out = &seq->out});
    in_call_.push_back(seq.get());
    budget -= len;
  }
  if (call_.empty()) return;

  model_.forward(call_, options);
  const Clock::time_point now = Clock::now();
  for (Running* seq : in_call_) {
    if (seq->req->speculative) {
      Decoder& decoder = *slots_[seq->slot].decoder;
      if (!seq->started) {  // a prompt piece
        const Decoder::Progress p = decoder.start_taken(*seq->run, *seq->req->prompt);
        seq->started = p != Decoder::Progress::Prefilling;
        if (p == Decoder::Progress::Ended) ended.push_back(seq);
        continue;
      }
      if (seq->run->drafted && call_.size() > 1) ++seq->run->res.stats.shared_drafting_steps;
      if (!decoder.accept_step(*seq->run)) ended.push_back(seq);
      continue;
    }
    KVCache& kv = slots_[seq->slot].gen->cache();
    const int32_t len = seq->batch.size();
    kv.commit_prefix(len);
    if (seq->next_token < 0) {  // a prompt piece
      seq->prefilled += len;
      if (seq->out.n_rows == 0) continue;
      seq->req->result.gen.prefill_seconds = seconds_between(seq->admitted, now);
      seq->decode_start = now;
    } else {
      ++seq->req->result.gen.decode_forwards;
    }
    if (!take_token(*seq)) ended.push_back(seq);
  }
}

bool BatchScheduler::add_speculative_piece(Running& seq, int32_t& budget, std::vector<Running*>& ended) {
  seq.stepped = true;  // this round's step is its piece in the batched pass (or it ends here)
  if (stop_requested(seq)) {
    ended.push_back(&seq);
    return false;
  }
  if (budget == 0) return false;
  try {
    call_.push_back(slots_[seq.slot].decoder->start_rows(*seq.run, *seq.req->prompt, budget));
  } catch (...) {  // this request's fault alone (a prompt the context cannot hold)
    retire(seq, std::current_exception());
    return false;
  }
  in_call_.push_back(&seq);
  budget -= call_.back().batch->size();
  return true;
}

bool BatchScheduler::take_token(Running& seq) {
  seq.penalties->apply(seq.out.logits.data());  // the sequence's own row, transformed in place
  const int32_t token = seq.sampler->sample(seq.out.logits.data());
  const std::span<const float> row(seq.out.logits.data(), size_t(model_.config().n_vocab));
  const bool more = seq.sink->push(token, row);
  seq.penalties->accept(token);
  if (!more) return false;
  KVCache& kv = slots_[seq.slot].gen->cache();
  if (kv.n_past() + 1 >= kv.n_ctx()) {
    seq.req->result.gen.finish = FinishReason::ContextFull;
    return false;
  }
  seq.next_token = token;
  return true;
}

bool BatchScheduler::speculative_step(Running& seq) {
  if (stop_requested(seq)) return false;
  Decoder& decoder = *slots_[seq.slot].decoder;
  if (!seq.started) {
    // Alone, the prompt in whole n_batch pieces, one per round (while other sequences run, its
    // pieces join the batched pass: add_speculative_piece).
    const Decoder::Progress p = decoder.start_piece(*seq.run, *seq.req->prompt, model_.n_batch());
    if (p == Decoder::Progress::Prefilling) return true;
    seq.started = true;
    return p == Decoder::Progress::Running;
  }
  return decoder.advance(*seq.run);
}

void BatchScheduler::retire(Running& seq, std::exception_ptr error) {
  Request& req = *seq.req;
  if (!error) {
    try {
      if (req.speculative) {
        if (seq.started) slots_[seq.slot].decoder->finish(*seq.run);  // else: stopped before its prefill
        req.result = std::move(seq.run->res);
      } else {
        seq.sink->finish();
        if (seq.next_token >= 0 || seq.req->result.gen.decode_forwards > 0)
          req.result.gen.decode_seconds = seconds_between(seq.decode_start, Clock::now());
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  remember_cache(seq, error != nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    req.error = error;
    req.finished = true;
    req.cv.notify_all();
  }
  seq.req = nullptr;  // erased from running_ by the loop
}

void BatchScheduler::remember_cache(const Running& seq, bool failed) {
  SequenceSlot& slot = slots_[seq.slot];
  const std::vector<int32_t>& prompt = *seq.req->prompt;
  const std::vector<int32_t>& generated = seq.req->result.gen.tokens;  // retire moved a run's result here
  // The committed rows hold the prompt, then the generated tokens in the order the sink took them;
  // rows past those (a speculative step's tokens after the end of generation) are not kept.
  const int32_t n_past = failed ? 0 : slot.gen->cache().n_past();
  const int32_t rows = std::min<int32_t>(n_past, int32_t(prompt.size() + generated.size()));
  slot.cached.clear();
  const int32_t from_prompt = std::min<int32_t>(rows, int32_t(prompt.size()));
  slot.cached.insert(slot.cached.end(), prompt.begin(), prompt.begin() + from_prompt);
  slot.cached.insert(slot.cached.end(), generated.begin(), generated.begin() + (rows - from_prompt));
  // A speculative generation's decoder holds the statistics of every prompt row it prefilled (and
  // those it kept); plain decoding overwrote the rows after the ones it kept.
  slot.decoder_rows = std::min(
      rows, seq.req->speculative ? from_prompt : std::min(slot.decoder_rows, seq.req->reuse_prompt_rows));
}

}  // namespace microspec::server
