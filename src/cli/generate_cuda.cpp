#include "cli/generate_cuda.h"

#include <chrono>
#include <algorithm>
#include <cstdio>

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
void generate_greedy_cuda(const LoadedModel& m, const CudaGenerateArgs& args, const std::vector<int32_t>& prompt) {
  const Tokenizer& tok = *m.tokenizer;
  for (int32_t id : prompt)
    if (id < 0 || id >= tok.n_vocab()) throw Error("prompt token id " + std::to_string(id) + " is outside the vocabulary");
  cuda::CudaModelOptions opt;
  opt.n_ctx = args.n_ctx;
  opt.n_batch = args.n_batch;
  // Room for the last speculative step's whole chain past n_predict (its extra tokens are dropped).
  opt.max_generate = args.n_predict + 1 + std::max(args.spec_chain, 0);
  std::unique_ptr<GgufFile> head_file;
  if (!args.draft_head.empty()) {
    head_file = GgufFile::open(args.draft_head);
    if (const std::string why = cuda::device_head_unsupported(*head_file); !why.empty())
      throw Error(args.draft_head + ": --device cuda cannot run this draft head: " + why + "; run it on the CPU");
  }
  auto model = cuda::CudaModel::load(*m.file, opt);
  std::unique_ptr<GgufFile> draft_file;
  std::unique_ptr<cuda::CudaModel> draft_model;
  if (!args.draft_model.empty()) {
    draft_file = open_model_file(args.draft_model);
    check_same_vocabulary(*m.file, *draft_file);
    draft_model = cuda::CudaModel::load(*draft_file, opt);
  }
  // The head's rows: the chain's and a prompt chunk's (the target's batch); its prompt room and
  // cache: the target's context.
  std::unique_ptr<cuda::DeviceEagleHead> draft_head;
  if (head_file)
    draft_head = std::make_unique<cuda::DeviceEagleHead>(*head_file, model->config(), model->embedding_matrix(),
                                                         opt.n_batch, opt.n_ctx, opt.n_ctx, model->stream());
  cuda::GreedyOptions g;
  g.n_predict = args.n_predict;
  if (!args.ignore_eos) g.stop_ids = tok.end_of_generation_ids();
  Utf8StreamDecoder utf8;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  Clock::time_point t_first;
  size_t n_tokens = 0;
  auto print = [&](int32_t id) {
    if (n_tokens++ == 0) t_first = Clock::now();
    const bool eog = !args.ignore_eos && std::find(g.stop_ids.begin(), g.stop_ids.end(), id) != g.stop_ids.end();
    if (!args.quiet && !eog) {
      const std::string text = utf8.push(tok.token_to_piece(id));
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    }
  };
  std::vector<int32_t> ids;
  cuda::SpecChainStats spec_stats;
  if (args.spec_chain > 0) {
    cuda::SpecChainOptions so;
    so.n_predict = args.n_predict;
    so.stop_ids = g.stop_ids;
    so.depth = args.spec_chain;
    so.draft_layers = args.spec_draft_layers > 0 ? args.spec_draft_layers : default_draft_layers(model->config().n_layer);
    so.vocab = args.vocab;
    so.draft_model = draft_model.get();
    so.draft_head = draft_head.get();
    ids = model->generate_speculative(prompt, so, &spec_stats);  // tokens arrive at the end of the run
    for (int32_t id : ids) print(id);
  } else {
    ids = model->generate_greedy(prompt, g, print);
  }
  const auto t_end = Clock::now();
  if (!args.quiet) {
    const std::string tail = utf8.flush();
    std::fwrite(tail.data(), 1, tail.size(), stdout);
    std::fputc('\n', stdout);
  }
  const double prefill_s = std::chrono::duration<double>(t_first - t0).count();
  const double decode_s = std::chrono::duration<double>(t_end - t_first).count();
  if (args.spec_chain > 0) {
    // Prefill and decoding run in one call here: one rate over both.
    std::fprintf(stderr,
                 "device: %s | prompt tokens: %zu | prefill + decode: %.1f tok/s (%zu tokens) | speculative "
                 "(%s chain of %d, %s): %d steps, mean acceptance length %.2f\n",
                 cuda::device_description().c_str(), prompt.size(),
                 ids.size() / std::max(std::chrono::duration<double>(t_end - t0).count(), 1e-9), ids.size(),
                 draft_model ? "draft-model" : draft_head ? "EAGLE-3 head" : "self-draft", args.spec_chain, args.vocab ? args.vocab_describe.c_str() : "full vocabulary",
                 spec_stats.steps,
                 spec_stats.mean_acceptance_length());
    return;
  }
  std::fprintf(stderr, "device: %s | prompt tokens: %zu | prefill: %.1f tok/s | decode: %.1f tok/s (%zu tokens)\n",
               cuda::device_description().c_str(), prompt.size(), prompt.size() / std::max(prefill_s, 1e-9),
               ids.size() > 1 ? (ids.size() - 1) / std::max(decode_s, 1e-9) : 0.0, ids.size());
}
#else
void generate_greedy_cuda(const LoadedModel&, const CudaGenerateArgs&, const std::vector<int32_t>&) {
  throw Error("--device cuda: this build has no CUDA backend (configure with a CUDA compiler, MICROSPEC_CUDA=ON)");
}
#endif

}  // namespace microspec::cli
