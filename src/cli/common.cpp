#include "cli/common.h"

#include <fstream>
#include <sstream>
#include <thread>

#include "util/error.h"

namespace microspec::cli {

void ModelArgs::add_to(CLI::App& cmd, int32_t default_batch) {
  n_batch = default_batch;
  cmd.add_option("-m,--model", model_path, "GGUF model file")->required();
  cmd.add_option("-t,--threads", threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  cmd.add_option("-c,--ctx-size", n_ctx, "context size in tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  cmd.add_option("-b,--batch-size", n_batch, "most tokens per forward pass (prefill chunk)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--kernels", kernels, "kernel table: auto, reference, avx2, avx512")->capture_default_str();
}

void add_spec_options(CLI::App& cmd, SpecConfig& c) {
  cmd.add_option("--spec", c.mode, "speculative decoding: none, self or draft")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "self", "draft"}));
  cmd.add_option("--draft-layers", c.draft_layers,
                 "--spec self: target layers the draft runs (0 = all but the last eighth)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  cmd.add_option("--draft-model", c.draft_model, "--spec draft: GGUF draft model with the same vocabulary");
  cmd.add_option("--tree-depth", c.tree.depth, "draft tree expansion rounds after the root level")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  cmd.add_option("--tree-topk", c.tree.top_k, "draft tree branching (1 = chain)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd.add_option("--tree-tokens", c.tree.total_tokens, "draft tree nodes verified per step")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd.add_option("--draft-vocab", c.draft_vocab, "draft vocabulary: full, freq, dynamic or hybrid")
      ->capture_default_str()
      ->check(CLI::IsMember({"full", "freq", "dynamic", "hybrid"}));
  cmd.add_option("--freq-file", c.freq_file, "freq/hybrid: token ranking written by `microspec vocab-freq` (default: MODEL with .freq.bin for .gguf)");
  cmd.add_option("--freq-top", c.freq_top, "freq: the K most frequent tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  cmd.add_option("--hybrid-top", c.hybrid_top, "hybrid: most frequent tokens always kept")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  cmd.add_option("--vocab-window", c.vocab_window, "dynamic/hybrid: W_max, candidate-stream entries kept")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  cmd.add_option("--vocab-kpre", c.vocab_kpre, "dynamic/hybrid: target top-k per prompt position")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd.add_option("--vocab-kver", c.vocab_kver, "dynamic/hybrid: target top-k per verification")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd.add_option("--vocab-source", c.vocab_source, "dynamic/hybrid ablation: ctx, ext or both")
      ->capture_default_str()
      ->check(CLI::IsMember({"ctx", "ext", "both"}));
  cmd.add_flag("!--no-async-gather", c.async_gather, "gather new draft LM-head rows on the calling thread");
}

LoadedModel load_model(const ModelArgs& args) {
  LoadedModel m;
  m.file = GgufFile::open(args.model_path);
  ModelOptions opt;
  opt.n_threads =
      args.threads > 0 ? args.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  opt.n_batch = args.n_batch;
  opt.kernels = args.kernels;
  m.model = Model::load(*m.file, opt);
  m.tokenizer = Tokenizer::from_gguf(*m.file);
  return m;
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int32_t> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ' ' || text[i] == ',' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r') {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
    if (j == i || j - i > 9) throw Error("token ids: expected a number at '" + text.substr(i, 16) + "'");
    ids.push_back(std::stoi(text.substr(i, j - i)));
    i = j;
  }
  return ids;
}

}  // namespace microspec::cli
