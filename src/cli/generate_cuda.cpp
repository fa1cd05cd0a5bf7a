#include "cli/generate_cuda.h"

#include <algorithm>
#include <chrono>

#include "checkpoint/hf_folder.h"
#include "gguf/gguf.h"
#include "speculative/drafter.h"
#include "speculative/settings.h"
#include "util/error.h"

#if MICROSPEC_HAS_CUDA
#include "cuda/cuda_check.h"
#include "cuda/cuda_model.h"
#endif

namespace microspec::cli {

#if MICROSPEC_HAS_CUDA
struct CudaGenerator::Impl {
  const Tokenizer& tok;
  CudaGenerateArgs args;
  std::unique_ptr<cuda::CudaModel> model;
  std::unique_ptr<GgufFile> draft_file;
  std::unique_ptr<cuda::CudaModel> draft_model;
  std::unique_ptr<cuda::DeviceEagleHead> draft_head;
  int32_t draft_layers = 0;  // the self-draft's
};

CudaGenerator::CudaGenerator(const LoadedModel& m, const CudaGenerateArgs& args)
    : impl_(new Impl{*m.tokenizer, args, nullptr, nullptr, nullptr, nullptr, 0}) {
  Impl& d = *impl_;
  cuda::CudaModelOptions opt;
  opt.n_ctx = args.n_ctx;
  opt.n_batch = args.n_batch;
  // Room for the last speculative step's whole chain or tree path past n_predict (its extra
  // tokens are dropped).
  opt.max_generate = args.n_predict + 1 + (args.spec_tree ? args.spec_tree->max_emitted() : std::max(args.spec_chain, 0));
  // The head is read and checked before any device is touched.
  std::unique_ptr<GgufFile> head_file;
  if (!args.draft_head.empty()) {
    head_file = GgufFile::open(args.draft_head);
    if (const std::string why = cuda::device_head_unsupported(*head_file); !why.empty())
      throw Error(args.draft_head + ": --device cuda cannot run this draft head: " + why + "; run it on the CPU");
  }
  d.model = cuda::CudaModel::load(*m.file, opt);
  if (!args.draft_model.empty()) {
    d.draft_file = open_model_file(args.draft_model);
    check_same_vocabulary(*m.file, *d.draft_file);
    d.draft_model = cuda::CudaModel::load(*d.draft_file, opt);
  }
  // The head's rows: the chain's and a prompt chunk's (the target's batch); its prompt room and
  // cache: the target's context.
  if (head_file)
    d.draft_head = std::make_unique<cuda::DeviceEagleHead>(*head_file, d.model->config(), d.model->embedding_matrix(),
                                                           opt.n_batch, opt.n_ctx, opt.n_ctx, d.model->stream());
  d.draft_layers = args.spec_draft_layers > 0 ? args.spec_draft_layers : default_draft_layers(d.model->config().n_layer);
}

CudaGenerator::~CudaGenerator() = default;

bool CudaGenerator::speculative() const { return impl_->args.spec_chain > 0 || impl_->args.spec_tree.has_value(); }

std::string CudaGenerator::describe() const {
  const Impl& d = *impl_;
  std::string s = "device: " + cuda::device_description();
  if (!speculative()) return s;
  return s + " | speculative (" +
         (d.draft_model ? std::string("draft-model")
          : d.draft_head ? std::string("EAGLE-3 head")
                         : "self-draft " + std::to_string(d.draft_layers) + " layers") +
         (d.args.spec_tree ? ", tree of top-k " + std::to_string(d.args.spec_tree->top_k) + ", depth " +
                                 std::to_string(d.args.spec_tree->depth) + ", " + std::to_string(d.args.spec_tree->total) +
                                 " nodes, "
                           : ", chain of " + std::to_string(d.args.spec_chain) + ", ") +
         (d.args.vocab ? d.args.vocab_describe : std::string("full vocabulary")) + ")";
}

CudaGeneration CudaGenerator::generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                                       const TextCallback& on_text) const {
  const Impl& d = *impl_;  // the prompt's ids are checked by CudaModel's forward
  if (params.max_new_tokens > d.args.n_predict)
    throw Error("--device cuda: " + std::to_string(params.max_new_tokens) + " tokens asked for, the device has room for " +
                std::to_string(d.args.n_predict));
  CudaGeneration out;
  GenerateResult& r = out.gen;
  r.prompt_tokens = int32_t(prompt.size());
  TokenSink sink(d.tok, params, on_text, r);
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
  if (speculative()) {
    cuda::SpecChainOptions so;
    so.n_predict = params.max_new_tokens;
    so.depth = d.args.spec_chain;
    so.tree = d.args.spec_tree;
    so.draft_layers = d.draft_layers;
    so.vocab = d.args.vocab;
    so.draft_model = d.draft_model.get();
    so.draft_head = d.draft_head.get();
    cuda::SpecChainStats st;
    d.model->generate_speculative(prompt, so, &st, take);
    out.steps = st.steps;
    out.accepted_drafts = st.accepted_drafts;
  } else {
    cuda::GreedyOptions g;
    g.n_predict = params.max_new_tokens;
    d.model->generate_greedy(prompt, g, take);
  }
  out.decode_tokens = std::max(n_seen - 1, 0);
  r.decode_forwards = speculative() ? out.steps : out.decode_tokens;
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

CudaGenerator::CudaGenerator(const LoadedModel&, const CudaGenerateArgs&) {
  throw Error("--device cuda: this build has no CUDA backend (configure with a CUDA compiler, MICROSPEC_CUDA=ON)");
}
CudaGenerator::~CudaGenerator() = default;
bool CudaGenerator::speculative() const { return false; }
std::string CudaGenerator::describe() const { return {}; }
CudaGeneration CudaGenerator::generate(const std::vector<int32_t>&, const GenerateParams&, const TextCallback&) const {
  throw Error("--device cuda: this build has no CUDA backend");
}
#endif

}  // namespace microspec::cli
