#include "engine/speculative_decoder.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "math/select.h"
#include "util/error.h"

namespace microspec {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
}  // namespace

Decoder::Sampling::Sampling(const SamplingParams& params, int32_t n_vocab) : target(params, n_vocab) {
  if (!(params.temperature > 0.0f)) return;
  SamplingParams dp = params;
  dp.seed = draft_sampler_seed(params.seed);
  draft.emplace(dp, n_vocab);
  draft_state.sampler = &*draft;
}

Decoder::Decoder(const SpecConfig& config, const GgufFile& target_file, Generator& gen,
                 const Tokenizer& tokenizer, const Decoder* share_draft_model_of, int32_t batch_sequences)
    : gen_(gen), tokenizer_(tokenizer), params_(config.tree), verifier_(gen.model().config().n_vocab) {
  config.validate();
  built_ = build_drafter(config, target_file, gen.model(), gen.cache(), tokenizer,
                         share_draft_model_of ? share_draft_model_of->built_.draft_model : nullptr, batch_sequences);
  drafter_ = built_.drafter.get();
  describe_ = "plain decoding";
  if (drafter_)
    describe_ = built_.describe + ", tree depth " + std::to_string(params_.depth) + " top-k " +
                std::to_string(params_.top_k) + " tokens " + std::to_string(params_.total_tokens);
  size_step_buffers();
}

Decoder::Decoder(Generator& gen, const Tokenizer& tokenizer, Drafter* drafter, const TreeParams& tree)
    : gen_(gen),
      tokenizer_(tokenizer),
      drafter_(drafter),
      params_(tree),
      describe_(drafter ? "drafter given by the caller" : "plain decoding"),
      verifier_(gen.model().config().n_vocab) {
  params_.validate();
  size_step_buffers();
}

void Decoder::size_step_buffers() {
  const Model& model = gen_.model();
  const int32_t rows = drafter_ ? params_.total_tokens + 1 : 1, n_batch = model.n_batch();
  if (rows > n_batch || (drafter_ && params_.top_k > n_batch))
    throw Error("speculative tree: " + std::to_string(rows) + " verified tokens and top-k " +
                std::to_string(params_.top_k) + " must fit the batch size " + std::to_string(n_batch) +
                " (raise -b)");
  out_.logits.reserve(size_t(rows) * model.config().n_vocab);
  argmax_.reserve(size_t(rows));
  node_path_.reserve(size_t(rows));
  node_index_.reserve(size_t(rows));
}

Decoder::Run::Run(const Tokenizer& tokenizer, const GenerateParams& params, const TextCallback& on_text,
                  int32_t n_vocab)
    : sink(tokenizer, params, on_text, res.gen), sampling(params.sampling, n_vocab), penalties(params.penalties, n_vocab, grammar_matcher(params, n_vocab)) {
  if (penalties.active()) first_row.resize(size_t(n_vocab));
}

SpecResult Decoder::generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                             const TextCallback& on_text, const DecodeObserver* observer) {
  Run run(tokenizer_, params, on_text, gen_.model().config().n_vocab);
  if (start(run, prompt, observer))
    while (advance(run, observer)) {
    }
  finish(run);
  return std::move(run.res);
}

bool Decoder::start(Run& run, const std::vector<int32_t>& prompt, const DecodeObserver* observer) {
  for (;;) {
    const Progress p = start_piece(run, prompt, gen_.model().n_batch(), observer);
    if (p != Progress::Prefilling) return p == Progress::Running;
  }
}

Decoder::Progress Decoder::start_piece(Run& run, const std::vector<int32_t>& prompt, int32_t max_tokens,
                                       const DecodeObserver* observer) {
  const SequenceForward rows = start_rows(run, prompt, max_tokens, observer);
  gen_.model().forward(std::span<const SequenceForward>(&rows, 1), verify_options());
  return start_taken(run, prompt, observer);
}

SequenceForward Decoder::start_rows(Run& run, const std::vector<int32_t>& prompt, int32_t max_tokens,
                                    const DecodeObserver* observer) {
  // A context-aware draft vocabulary seeds itself from the target's top tokens at every prompt
  // position (K_pre), and a draft head reads the target's features there: the prefill computes both.
  if (drafter_ && observer && observer->prompt_top_k > 0)
    throw Error("decoder: an observer's prompt top-k applies to plain decoding only");
  const int32_t k_pre = prompt_top_k(observer);
  const PrefillCapture capture = prompt_capture();
  if (!run.prefill_begun) {
    run.res.gen.prompt_tokens = static_cast<int32_t>(prompt.size());
    run.prefill_start = Clock::now();
    gen_.begin_prefill(prompt, run.reused_rows, k_pre, &prompt_top_, &capture);
    run.prefill_begun = true;
  }
  return gen_.prefill_rows(prompt, max_tokens, k_pre, &capture);
}

Decoder::Progress Decoder::start_taken(Run& run, const std::vector<int32_t>& prompt, const DecodeObserver* observer) {
  const float* root_logits = nullptr;
  run.root = prefill_taken(run, prompt, observer, &root_logits);
  run.prefilled = gen_.cache().n_past();
  if (run.root < 0) return Progress::Prefilling;
  run.decode_start = Clock::now();
  run.res.gen.prefill_seconds = std::chrono::duration<double>(run.decode_start - run.prefill_start).count();
  run.draft_head0 = drafter_ ? drafter_->lm_head_seconds() : 0.0;

  // The first token comes from the prefill, exactly as in plain decoding.
  KVCache& kv = gen_.cache();
  const std::span<const float> row(root_logits, size_t(gen_.model().config().n_vocab));
  if (run.sink.done()) return Progress::Ended;
  const bool more = run.sink.push(run.root, row);
  run.penalties.accept(run.root);
  if (!more) return Progress::Ended;
  if (kv.n_past() + 1 >= kv.n_ctx()) {
    run.res.gen.finish = FinishReason::ContextFull;
    return Progress::Ended;
  }
  return Progress::Running;
}

int32_t Decoder::prompt_top_k(const DecodeObserver* observer) const {
  return drafter_ ? drafter_->prompt_top_k() : observer ? observer->prompt_top_k : 0;
}

PrefillCapture Decoder::prompt_capture() {
  return {drafter_ ? drafter_->feature_layers() : std::span<const int32_t>{}, &prompt_features_};
}

bool Decoder::advance(Run& run, const DecodeObserver* observer) {
  draft_step(run, params_);
  verify(verify_rows(run), run.res.stats);
  return accept_step(run, observer);
}

void Decoder::finish(Run& run) {
  run.sink.finish();
  SpecStats& st = run.res.stats;
  run.res.gen.decode_seconds = since(run.decode_start);
  run.res.gen.decode_forwards = st.steps;
  st.draft_lm_head_seconds = drafter_ ? drafter_->lm_head_seconds() - run.draft_head0 : 0.0;
  run.res.gen.decode_lm_head_seconds = st.lm_head_seconds();
}

int32_t Decoder::prefill_taken(Run& run, const std::vector<int32_t>& prompt, const DecodeObserver* observer,
                               const float** first_logits) {
  const int32_t k_pre = prompt_top_k(observer);
  const PrefillCapture capture = prompt_capture();
  const float* logits = gen_.prefill_taken(prompt, k_pre, &prompt_top_, &capture);
  if (!logits) return -1;
  if (run.penalties.active()) {  // the first token's row, transformed as every later one is
    run.penalties.begin(prompt, gen_.cache().n_ctx() + 1);
    std::copy(logits, logits + run.first_row.size(), run.first_row.begin());
    run.penalties.apply(run.first_row.data());
    logits = run.first_row.data();
  }
  const int32_t first = run.sampling.target.sample(logits);
  *first_logits = logits;
  const std::span<const int32_t> prompt_top(prompt_top_.data(), k_pre ? prompt_top_.size() : 0);
  if (drafter_ && !capture.layers.empty())
    drafter_->target_features(prompt_features_.data(), static_cast<int32_t>(prompt.size()));
  if (drafter_) drafter_->begin(prompt, prompt_top);
  if (observer && observer->on_prompt) observer->on_prompt(prompt, prompt_top);
  if (observer && observer->on_token) observer->on_token(first, logits);
  return first;
}

bool Decoder::draft_step(Run& run, const TreeParams& shape) {
  const DraftStep step{.decoder = this, .run = &run, .shape = shape};
  DraftJob job;
  draft_steps(std::span<const DraftStep>(&step, 1), std::span<DraftJob>(&job, 1));
  return run.drafted;
}

void Decoder::draft_steps(std::span<const DraftStep> steps, std::span<DraftJob> jobs) {
  if (jobs.size() < steps.size()) throw Error("decoder: fewer draft jobs than draft steps");
  jobs = jobs.first(steps.size());
  // Each sequence starts its tree (a drafter without a level-wise backbone proposes it whole
  // here), then the trees grow together, level by level.
  const auto t0 = Clock::now();
  for (size_t i = 0; i < steps.size(); ++i) {
    Decoder& d = *steps[i].decoder;
    Run& run = *steps[i].run;
    run.step_position = d.gen_.cache().n_past();
    run.drafted = d.will_draft(run.step_position, steps[i].shape);
    jobs[i] = DraftJob{};
    jobs[i].tree = &d.tree_;
    if (run.drafted) {
      d.drafter_->set_shared_rows(steps[i].shared_rows);
      jobs[i].growth =
          d.drafter_->begin_propose(run.root, run.step_position, steps[i].shape, run.sampling.for_drafter(), d.tree_);
    }
  }
  draft_together(jobs);
  for (const DraftStep& s : steps)
    if (s.run->drafted && !s.run->sampling.draft && s.run->penalties.constrained())
      s.decoder->drop_disallowed(s.run->penalties);
  // The shared drafting counts whole for each sequence (as a shared verification pass does).
  const double seconds = since(t0);
  for (size_t i = 0; i < steps.size(); ++i) {
    Run& run = *steps[i].run;
    run.source = run.drafted && !steps[i].decoder->tree_.nodes.empty() ? steps[i].decoder->drafter_->last_source()
                                                                       : DraftSource::None;
    if (!run.drafted) continue;
    SpecStats& st = steps[i].run->res.stats;
    st.draft_seconds += seconds;
    st.active_vocab_sum += steps[i].decoder->drafter_->active_vocab_size();
    ++st.drafting_steps;
    st.shared_draft_forwards += jobs[i].shared_forwards;
  }
}

SequenceForward Decoder::verify_rows(Run& run) {
  set_verify_rows(run.root, run.step_position);
  SequenceForward rows{.batch = &batch_, .kv = &gen_.cache(), .out = &out_};
  // A self-drafter ran the leading rows through the target's first layers at these very slots:
  // the pass resumes them there instead of recomputing them.
  const VerifyResume resume = run.drafted ? drafter_->resume_for(tree_) : VerifyResume{};
  if (resume.rows > 0 && resume.layer > 0) {
    rows.resumed_rows = std::min(resume.rows, batch_.size());
    rows.resumed_layer = resume.layer;
    rows.resumed = resume.activations;
  }
  run.verify_start = Clock::now();
  return rows;
}

ForwardOptions Decoder::verify_options() const {
  return {.logits = true,
          .capture_layers = drafter_ ? drafter_->feature_layers() : std::span<const int32_t>{}};
}

bool Decoder::accept_step(Run& run, const DecodeObserver* observer) {
  if (run.verify_start != Clock::time_point{}) {  // the verification pass (a shared one counts whole)
    run.res.stats.verify_seconds += since(run.verify_start);
    run.verify_start = {};
  }
  penalise_rows(run.penalties);
  accept_and_commit(run.sampling, run.res.stats);
  if (drafter_) {
    SpecStats::SourceCounts& by = run.res.stats.by_source[size_t(run.source)];
    ++by.steps;
    by.accepted += static_cast<int64_t>(path_.size());
  }
  update_drafter(run.root, run.res.stats);
  const bool running = emit(run.step_position, run, observer);
  run.root = emitted_.back();
  return running;
}

bool Decoder::will_draft(int32_t position, const TreeParams& shape) {
  tree_.clear();
  // Near the end of the context the step degrades to a plain one (root only), so it never needs
  // more room than plain decoding. A shape larger than the configured tree would not fit the
  // buffers sized for it.
  const int32_t room = gen_.cache().n_ctx() - position;
  if (!drafter_ || shape.total_tokens == 0 || !drafter_->fits(shape, room) || shape.total_tokens + 1 > room)
    return false;
  if (shape.total_tokens > params_.total_tokens || shape.top_k > params_.top_k)
    throw Error("decoder: a step's draft shape exceeds the configured tree");
  return true;
}

void Decoder::set_verify_rows(int32_t root, int32_t position) {
  batch_.clear();
  batch_.tokens.push_back(root);
  batch_.positions.push_back(position);
  batch_.parents.push_back(-1);
  for (const TreeNode& node : tree_.nodes) {
    batch_.tokens.push_back(node.token);
    batch_.positions.push_back(position + node.depth);
    batch_.parents.push_back(node.parent + 1);
  }
  for (int32_t i = 0; i < batch_.size(); ++i) batch_.output_rows.push_back(i);
}

void Decoder::verify(const SequenceForward& rows, SpecStats& st) {
  Model& model = gen_.model();
  const double head0 = model.timings().lm_head_seconds;
  model.forward(std::span<const SequenceForward>(&rows, 1), verify_options());
  st.verify_lm_head_seconds += model.timings().lm_head_seconds - head0;
}

std::span<const int32_t> Decoder::path_to(int32_t k) {
  node_path_.resize(size_t(tree_.nodes[size_t(k)].depth));  // within the capacity reserved for a whole tree
  int32_t depth = tree_.nodes[size_t(k)].depth;
  for (int32_t i = k; i >= 0; i = tree_.nodes[size_t(i)].parent) node_path_[size_t(--depth)] = tree_.nodes[size_t(i)].token;
  if (depth != 0) throw Error("decoder: a draft tree node's depth does not match its ancestors");
  return node_path_;
}

void Decoder::penalise_rows(Penalizer& penalties) {
  if (!penalties.active()) return;
  const size_t V = size_t(gen_.model().config().n_vocab);
  float* logits = out_.logits.data();
  penalties.apply(logits);  // the root's row: the committed history alone
  for (int32_t k = 0; k < tree_.size(); ++k) penalties.apply(logits + V * size_t(k + 1), path_to(k));
}

void Decoder::drop_disallowed(Penalizer& constraint) {
  // Decided on the whole tree first (paths read the nodes as they are), then compacted. Nodes stay
  // in candidate order (parents first), so a node is decided after its parent.
  node_index_.assign(size_t(tree_.size()), -1);
  int32_t kept = 0;
  for (int32_t k = 0; k < tree_.size(); ++k) {
    const int32_t parent = tree_.nodes[size_t(k)].parent;
    if (parent >= 0 && node_index_[size_t(parent)] < 0) continue;  // its parent was dropped
    if (constraint.allows_path(path_to(k))) node_index_[size_t(k)] = kept++;
  }
  for (int32_t k = 0; k < tree_.size(); ++k) {
    const int32_t to = node_index_[size_t(k)];
    if (to < 0) continue;
    TreeNode node = tree_.nodes[size_t(k)];
    node.parent = node.parent >= 0 ? node_index_[size_t(node.parent)] : -1;
    tree_.nodes[size_t(to)] = node;  // to <= k: an earlier slot, already read
  }
  tree_.nodes.resize(size_t(kept));
}

void Decoder::accept_and_commit(Sampling& sampling, SpecStats& st) {
  const auto t0 = Clock::now();
  const int32_t V = gen_.model().config().n_vocab, n = tree_.size() + 1;
  const float* logits = out_.logits.data();
  path_.clear();
  if (tree_.nodes.empty()) {
    // The root alone: a plain decoding step, the token drawn exactly as Generator draws it.
    emitted_.assign(1, sampling.target.sample(logits));
  } else if (sampling.draft) {
    verifier_.accept(tree_, logits, V, sampling.target, path_, emitted_);
  } else {
    argmax_.resize(size_t(n));
    for (int32_t i = 0; i < n; ++i) argmax_[size_t(i)] = argmax(logits + size_t(i) * V, V);
    accept_greedy(tree_, argmax_, path_, emitted_);
  }
  commit_.assign(1, 0);
  for (int32_t p : path_) commit_.push_back(p + 1);
  gen_.cache().commit(commit_);
  ++st.steps;
  st.drafted += tree_.size();
  st.accepted_draft += static_cast<int64_t>(path_.size());
  st.bookkeeping_seconds += since(t0);
}

void Decoder::update_drafter(int32_t root, SpecStats& st) {
  if (!drafter_) return;
  const auto t0 = Clock::now();
  if (!drafter_->feature_layers().empty()) drafter_->target_features(out_.layer_inputs.data(), out_.n_rows);
  drafter_->accepted(root, tree_, path_, out_.logits.data());
  st.draft_seconds += since(t0);
}

bool Decoder::emit(int32_t position, Run& run, const DecodeObserver* observer) {
  TokenSink& sink = run.sink;
  SpecResult& res = run.res;
  const auto t0 = Clock::now();
  // In order, through the plain decoder's logic: plain decoding would have position + 1 + j tokens
  // in its cache when it produces emitted_[j], and stops there if one more does not fit. Only the
  // tokens the sink takes count as decoded.
  bool running = true;
  const size_t V = size_t(gen_.model().config().n_vocab);
  for (size_t j = 0; j < emitted_.size() && running; ++j) {
    // emitted_[j] was chosen from the root's row (j = 0), else from the row of the j-th accepted node.
    const float* row = out_.logits.data() + V * size_t(j == 0 ? 0 : path_[j - 1] + 1);
    if (observer && observer->on_token) observer->on_token(emitted_[j], row);
    ++res.stats.decode_tokens;
    const bool more = sink.push(emitted_[j], {row, V});
    run.penalties.accept(emitted_[j]);
    if (!more) {
      running = false;
    } else if (position + 1 + int32_t(j) + 1 >= gen_.cache().n_ctx()) {
      res.gen.finish = FinishReason::ContextFull;
      running = false;
    }
  }
  res.stats.bookkeeping_seconds += since(t0);
  return running;
}

}  // namespace microspec
