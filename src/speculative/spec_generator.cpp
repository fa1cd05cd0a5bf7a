#include "speculative/spec_generator.h"

#include <algorithm>
#include <chrono>
#include <optional>
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

SpeculativeGenerator::SpeculativeGenerator(Generator& gen, const Tokenizer& tokenizer, Drafter& drafter,
                                           const TreeParams& tree)
    : gen_(gen),
      tokenizer_(tokenizer),
      drafter_(drafter),
      params_(tree),
      verifier_(gen.model().config().n_vocab) {
  params_.validate();
  const int32_t n_batch = gen.model().n_batch();
  if (params_.total_tokens + 1 > n_batch || params_.top_k > n_batch)
    throw Error("speculative tree: " + std::to_string(params_.total_tokens + 1) +
                " verified tokens and top-k " + std::to_string(params_.top_k) + " must fit the batch size " +
                std::to_string(n_batch) + " (raise -b)");
  const int32_t V = gen.model().config().n_vocab;
  out_.logits.reserve(size_t(params_.total_tokens + 1) * V);
  resume_x_.resize(size_t(params_.total_tokens + 1) * gen.model().config().n_embd);
  argmax_.reserve(params_.total_tokens + 1);
}

SpecResult SpeculativeGenerator::generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                                          const TextCallback& on_text) {
  Model& model = gen_.model();
  KVCache& kv = gen_.cache();
  const int32_t V = model.config().n_vocab;
  SpecResult res;
  GenerateResult& r = res.gen;
  SpecStats& st = res.stats;
  r.prompt_tokens = static_cast<int32_t>(prompt.size());
  TokenSink sink(tokenizer_, params, on_text, r);

  const auto t0 = Clock::now();
  // Sampling (temperature > 0): the target's tokens come from its sampler (request's filters and
  // seed), the draft's from a second sampler with the same filters and a derived seed, and each
  // step is verified by recursive rejection sampling (TreeSamplingVerifier). Greedy keeps the
  // argmax path, which needs no sampler at all.
  const bool sampling = params.sampling.temperature > 0.0f;
  std::optional<Sampler> target_sampler, draft_sampler;
  if (sampling) {
    target_sampler.emplace(params.sampling, V);
    SamplingParams dp = params.sampling;
    dp.seed = params.sampling.seed ^ 0x9e3779b97f4a7c15ull;
    draft_sampler.emplace(dp, V);
    draft_sampling_.sampler = &*draft_sampler;
  }
  // The drafter holds a pointer to draft_sampling_ only for this call, exceptions included.
  struct SamplingScope {
    Drafter& d;
    ~SamplingScope() { d.set_sampling(nullptr); }
  } scope{drafter_};
  drafter_.set_sampling(sampling ? &draft_sampling_ : nullptr);

  const int32_t k_pre = drafter_.prompt_top_k();
  const float* logits = gen_.prefill(prompt, k_pre, &prompt_top_);
  int32_t root = sampling ? target_sampler->sample(logits) : argmax(logits, V);
  drafter_.begin(prompt, std::span<const int32_t>(prompt_top_.data(), k_pre ? prompt_top_.size() : 0));
  const auto t1 = Clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  const double draft_head0 = drafter_.lm_head_seconds();

  // The first token comes from the prefill, exactly as in plain decoding.
  bool running = !sink.done() && sink.push(root);
  if (running && kv.n_past() + 1 >= kv.n_ctx()) {
    r.finish = FinishReason::ContextFull;
    running = false;
  }
  while (running) {
    const int32_t m = kv.n_past(), room = kv.n_ctx() - m;
    // Near the end of the context the step degrades to a plain one (root only), so it never needs
    // more room than plain decoding.
    tree_.clear();
    bool drafted = false;
    if (drafter_.fits(params_, room) && params_.total_tokens + 1 <= room) {
      drafted = true;
      const auto td = Clock::now();
      drafter_.propose(root, m, params_, tree_);
      st.draft_seconds += since(td);
      st.active_vocab_sum += drafter_.active_vocab_size();
      ++st.drafting_steps;
    }

    // Verification: root at pending slot 0, node i at slot i + 1.
    const auto tv = Clock::now();
    const int32_t n = tree_.size() + 1;
    batch_.clear();
    batch_.tokens.push_back(root);
    batch_.positions.push_back(m);
    batch_.parents.push_back(-1);
    for (const TreeNode& node : tree_.nodes) {
      batch_.tokens.push_back(node.token);
      batch_.positions.push_back(m + node.depth);
      batch_.parents.push_back(node.parent + 1);
    }
    for (int32_t i = 0; i < n; ++i) batch_.output_rows.push_back(i);
    const double head0 = model.timings().lm_head_seconds;
    // A self-drafter already ran the leading rows through the target's first layers at these very
    // slots: resume them there (bitwise the same result, layers are per token) and run only the
    // rest from the embeddings.
    const int32_t d = model.config().n_embd;
    const int32_t reuse = drafted ? drafter_.reusable_rows(tree_, resume_x_.data()) : 0;
    const int32_t reuse_layers = drafter_.reuse_layers();
    if (reuse > 0 && reuse_layers > 0) {
      if (reuse < n) {
        tail_.clear();
        tail_.start = reuse;
        for (int32_t i = reuse; i < n; ++i) {
          tail_.tokens.push_back(batch_.tokens[i]);
          tail_.positions.push_back(batch_.positions[i]);
          tail_.parents.push_back(batch_.parents[i]);
          tail_.output_rows.push_back(i - reuse);
        }
        model.forward(tail_, kv, tail_out_, false, reuse_layers);
        std::copy(tail_out_.residual.begin(), tail_out_.residual.end(), resume_x_.begin() + size_t(reuse) * d);
      }
      model.forward(batch_, kv, out_, true, -1, reuse_layers, resume_x_.data());
    } else {
      model.forward(batch_, kv, out_, true);
    }
    st.verify_lm_head_seconds += model.timings().lm_head_seconds - head0;
    st.verify_seconds += since(tv);
    const auto tb = Clock::now();
    if (sampling) {
      verifier_.accept(tree_, out_.logits.data(), V, *target_sampler, path_, emitted_);
    } else {
      argmax_.resize(n);
      for (int32_t i = 0; i < n; ++i) argmax_[i] = argmax(out_.logits.data() + size_t(i) * V, V);
      accept_greedy(tree_, argmax_, path_, emitted_);
    }
    commit_.assign(1, 0);
    for (int32_t p : path_) commit_.push_back(p + 1);
    kv.commit(commit_);
    st.bookkeeping_seconds += since(tb);

    const auto ta = Clock::now();
    drafter_.accepted(root, tree_, path_, out_.logits.data());
    st.draft_seconds += since(ta);
    ++st.steps;
    st.drafted += tree_.size();
    st.accepted_draft += static_cast<int64_t>(path_.size());
    st.decode_tokens += static_cast<int64_t>(emitted_.size());

    const auto te = Clock::now();
    // Emit in order through the plain decoder's logic. Plain decoding would have m + 1 + j tokens
    // in its cache when it produces emitted_[j], and stops there if one more does not fit.
    for (size_t j = 0; j < emitted_.size() && running; ++j) {
      if (!sink.push(emitted_[j])) {
        running = false;
      } else if (m + 1 + int32_t(j) + 1 >= kv.n_ctx()) {
        r.finish = FinishReason::ContextFull;
        running = false;
      }
    }
    root = emitted_.back();
    st.bookkeeping_seconds += since(te);
  }
  sink.finish();
  r.decode_seconds = since(t1);
  r.decode_forwards = st.steps;
  st.draft_lm_head_seconds = drafter_.lm_head_seconds() - draft_head0;
  r.decode_lm_head_seconds = st.lm_head_seconds();
  return res;
}

}  // namespace microspec
