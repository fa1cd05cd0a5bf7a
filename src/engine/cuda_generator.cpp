#include "engine/cuda_generator.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "draft_head/eagle3_head.h"
#include "model/config.h"
#include "model/model_file.h"
#include "speculative/drafter.h"
#include "speculative/drafter_setup.h"
#include "speculative/tree_sampling.h"
#include "util/error.h"

#if MICROSPEC_HAS_CUDA
#include "cuda/cuda_check.h"
#include "cuda/cuda_model.h"
#endif

namespace microspec {

// --spec auto (the default) decodes plainly on the device: the device has no auto step yet.
bool device_speculates(const SpecConfig& spec) {
  return spec.enabled() && spec.mode != SpecMode::Auto;
}

std::string cuda_spec_unsupported(const SpecConfig& spec) {
  if (!device_speculates(spec)) return {};
  // A chain or a tree from the target's own first layers, a draft model or an EAGLE-3 head.
  const bool drafter = spec.mode == SpecMode::Self || spec.mode == SpecMode::Draft || spec.mode == SpecMode::Head;
  if (drafter && spec.tree.p_min == 0) return {};
  return "--device cuda speculates with --spec self|draft|head (a chain with --tree-topk 1, a tree with "
         "--tree-topk K), --draft-p-min 0 only";
}

std::string cuda_spec_sampling_unsupported(const SpecConfig& spec) {
  // A chain, or a tree whose draft rows' draws fit a step's (what cuda_spec_unsupported refuses,
  // such as --draft-p-min, it names).
  if (!device_speculates(spec) || spec.tree.top_k == 1 || spec.tree.p_min != 0 || spec.tree.total_tokens <= 0) return {};
  const TreeShape shape = spec.tree.fixed_shape();
  const int32_t draws = tree_draft_draws(shape);
  if (draws <= kMaxDraftDrawsPerStep) return {};
  return "--device cuda samples speculatively from a draft tree of at most " + std::to_string(kMaxDraftDrawsPerStep) +
         " draft draws a step ((1 + depth x top-k) x top-k); --tree-topk " + std::to_string(shape.top_k) +
         " --tree-depth " + std::to_string(shape.depth) + " takes " + std::to_string(draws);
}

void set_cuda_speculation(const SpecConfig& spec, const GgufFile& target, const Tokenizer& tokenizer,
                          CudaGeneratorOptions& o) {
  if (!device_speculates(spec)) return;
  if (const std::string why = cuda_spec_unsupported(spec); !why.empty()) throw Error(why);
  spec.validate();
  if (spec.mode == SpecMode::Draft) o.draft_model = spec.draft_model;
  o.spec_draft_layers = spec.draft_layers;
  if (spec.tree.top_k > 1)
    o.spec_tree = spec.tree.fixed_shape();
  else
    o.spec_chain = std::max(1, std::min(spec.tree.depth + 1, spec.tree.total_tokens));
  o.spec_draft_draws = o.spec_chain > 0 ? spec.tree.depth + 1 : 0;
  const ModelConfig config = read_model_config(target);
  if (spec.mode == SpecMode::Head) {
    // The head is read and checked against the target here, before any device is asked for.
    o.draft_head = draft_head_path(spec, target.name());
    read_eagle3_config(*GgufFile::open(o.draft_head), config);
  }
  if (spec.draft_vocab != DraftVocabKind::Full)
    o.vocab = pruned_vocab_spec(spec, target.name(), config.n_vocab, tokenizer, &o.vocab_describe);
}

std::string cuda_params_unsupported(const SamplingParams& sampling) {
  const int32_t k = sampling.top_k;
  if (!sampling.greedy() && (k < 1 || k > 64))
    return "the device samples from the top-k tokens: top_k must be in 1..64, got " + std::to_string(k);
  return {};
}

#if MICROSPEC_HAS_CUDA
struct CudaGenerator::Impl {
  const Tokenizer& tokenizer;
  CudaGeneratorOptions options;
  std::unique_ptr<cuda::CudaModel> model;
  std::unique_ptr<GgufFile> draft_file;
  std::unique_ptr<cuda::CudaModel> draft_model;
  std::unique_ptr<cuda::DeviceEagleHead> draft_head;
  int32_t draft_layers = 0;  // the self-draft's
};

CudaGenerator::CudaGenerator(const GgufFile& target, const Tokenizer& tokenizer, const CudaGeneratorOptions& options)
    : impl_(new Impl{tokenizer, options, nullptr, nullptr, nullptr, nullptr, 0}) {
  Impl& d = *impl_;
  cuda::CudaModelOptions opt;
  opt.n_ctx = options.n_ctx;
  opt.n_batch = options.n_batch;
  // No generation outlives the context; room for the last speculative step's whole chain or tree
  // path past it (its extra tokens are dropped).
  opt.max_generate = std::min(options.n_predict, options.n_ctx) + 1 +
                     (options.spec_tree ? options.spec_tree->max_emitted() : std::max(options.spec_chain, 0));
  // The head is read and checked before any device is touched.
  std::unique_ptr<GgufFile> head_file;
  if (!options.draft_head.empty()) {
    head_file = GgufFile::open(options.draft_head);
    if (const std::string why = cuda::device_head_unsupported(*head_file); !why.empty())
      throw Error(options.draft_head + ": --device cuda cannot run this draft head: " + why + "; run it on the CPU");
  }
  d.model = cuda::CudaModel::load(target, opt);
  if (!options.draft_model.empty()) {
    d.draft_file = open_model_file(options.draft_model);
    check_same_vocabulary(target, *d.draft_file);
    d.draft_model = cuda::CudaModel::load(*d.draft_file, opt);
  }
  // The head's rows: the chain's and a prompt chunk's (the target's batch); its prompt room and
  // cache: the target's context.
  if (head_file)
    d.draft_head = std::make_unique<cuda::DeviceEagleHead>(*head_file, d.model->config(), d.model->embedding_matrix(),
                                                           opt.n_batch, opt.n_ctx, opt.n_ctx, d.model->stream());
  d.draft_layers =
      options.spec_draft_layers > 0 ? options.spec_draft_layers : default_draft_layers(d.model->config().n_layer);
}

CudaGenerator::~CudaGenerator() = default;

bool CudaGenerator::speculative() const {
  return impl_->options.spec_chain > 0 || impl_->options.spec_tree.has_value();
}

std::string CudaGenerator::describe() const {
  const Impl& d = *impl_;
  const CudaGeneratorOptions& o = d.options;
  std::string s = "device: " + cuda::device_description();
  if (!speculative()) return s;
  const std::string drafter = d.draft_model  ? std::string("draft-model")
                              : d.draft_head ? std::string("EAGLE-3 head")
                                             : "self-draft " + std::to_string(d.draft_layers) + " layers";
  const std::string shape = o.spec_tree ? "tree of top-k " + std::to_string(o.spec_tree->top_k) + ", depth " +
                                              std::to_string(o.spec_tree->depth) + ", " +
                                              std::to_string(o.spec_tree->total) + " nodes"
                                        : "chain of " + std::to_string(o.spec_chain);
  return s + " | speculative (" + drafter + ", " + shape + ", " + (o.vocab ? o.vocab_describe : "full vocabulary") +
         ")";
}

SpecResult CudaGenerator::generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                                   const TextCallback& on_text, Drafting drafting) const {
  const Impl& d = *impl_;  // the prompt's ids are checked by CudaModel's forward
  if (const std::string why = cuda_params_unsupported(params.sampling); !why.empty())
    throw Error("--device cuda: " + why);
  if (const char* field = first_active_penalty(params.penalties, params.sampling.min_p))
    throw Error(std::string("--device cuda: ") + field +
                " is not supported on the device (penalties, logit bias and min_p run on the CPU only)");
  if (params.max_new_tokens > d.options.n_predict)
    throw Error("--device cuda: " + std::to_string(params.max_new_tokens) + " tokens asked for, the device has room for " +
                std::to_string(d.options.n_predict));
  SpecResult out;
  GenerateResult& r = out.gen;
  r.prompt_tokens = int32_t(prompt.size());
  TokenSink sink(d.tokenizer, params, on_text, r);
  if (sink.done()) return out;

  // The sink decides where the text ends (end-of-generation tokens, stop strings, the limit): it
  // ends the device's generation by refusing a token.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point t_first = t0;
  int32_t n_seen = 0;
  const cuda::TokenHandler take = [&](int32_t id) {
    if (n_seen++ == 0) t_first = Clock::now();
    return sink.push(id);
  };
  const bool drafts = speculative() && drafting == Drafting::Speculative;
  if (drafts) {
    cuda::SpecChainOptions so;
    so.n_predict = params.max_new_tokens;
    so.depth = d.options.spec_chain;
    so.tree = d.options.spec_tree;
    so.draft_layers = d.draft_layers;
    so.vocab = d.options.vocab;
    so.draft_model = d.draft_model.get();
    so.draft_head = d.draft_head.get();
    so.sampling = params.sampling;
    so.draft_draws = d.options.spec_draft_draws;
    cuda::SpecChainStats st;
    d.model->generate_speculative(prompt, so, &st, take);
    // The counts of the steps that emitted the text, as the CPU decoder counts them; every device
    // step drafts its whole chain or tree.
    out.stats.steps = st.steps;
    out.stats.accepted_draft = st.accepted_drafts;
    out.stats.drafting_steps = st.steps;
    out.stats.drafted = int64_t(st.steps) * (d.options.spec_tree ? d.options.spec_tree->total : d.options.spec_chain);
  } else {
    cuda::PlainOptions g;
    g.n_predict = params.max_new_tokens;
    g.sampling = params.sampling;
    d.model->generate_plain(prompt, g, take);
  }
  const int32_t decode_tokens = std::max(n_seen - 1, 0);
  out.stats.decode_tokens = decode_tokens;
  r.decode_forwards = drafts ? out.stats.steps : decode_tokens;
  // The device stopped without the sink ending the text: the context is full.
  if (!sink.done()) r.finish = FinishReason::ContextFull;
  sink.finish();
  const Clock::time_point t_end = Clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t_first - t0).count();
  r.decode_seconds = std::chrono::duration<double>(t_end - t_first).count();
  return out;
}
#else
struct CudaGenerator::Impl {};

CudaGenerator::CudaGenerator(const GgufFile&, const Tokenizer&, const CudaGeneratorOptions&) {
  throw Error("--device cuda: this build has no CUDA backend (configure with a CUDA compiler, MICROSPEC_CUDA=ON)");
}
CudaGenerator::~CudaGenerator() = default;
bool CudaGenerator::speculative() const { return false; }
std::string CudaGenerator::describe() const { return {}; }
SpecResult CudaGenerator::generate(const std::vector<int32_t>&, const GenerateParams&, const TextCallback&,
                                   Drafting) const {
  throw Error("--device cuda: this build has no CUDA backend");
}
#endif

}  // namespace microspec
