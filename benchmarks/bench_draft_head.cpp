// Draft LM-head micro-benchmark: time per draft step of a self-drafter on a real model with the
// full LM head, FR-Spec's frequency set (packed) and MicroSpec's dynamic window (packed, rows
// gathered on a helper thread or inline).
//
//   bench_draft_head [-m models/gemma-3-270m-q4_k_m.gguf] [--freq-file F] [--freq-top 32768]
//                    [--window 3072] [--layers 16] [--steps 300] [--threads 2]
//
// One draft step = the window update of the previous verification (dynamic: a draft chain of 4
// tokens and the top-3 of 4 verification rows, i.e. 3 accepted tokens; rows that newly entered
// are gathered), then the draft backbone on one token (the first `layers` layers) and the draft LM
// head on its hidden state. Reported: medians over the steps of the step, the LM head alone
// (including any wait for the gather) and the update. The tree tokens and the verification rows'
// top tokens are drawn from a Zipf-like distribution over the vocabulary, so the window churns
// (~15 rows enter and leave per step once it is full) more than in decoding of one reply: an
// upper bound on the gather work. --warmup steps (default: enough to fill the window) run first.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "vocab/draft_vocab.h"
#include "speculative/tree.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "vocab/freq_file.h"
#include "vocab/packed_head.h"

using namespace microspec;

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Args {
  std::string model = "models/gemma-3-270m-q4_k_m.gguf";
  std::string freq_file;
  int32_t freq_top = 32768, window = 3072, layers = 16, steps = 300, threads = 2, warmup = -1;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(k + " needs a value");
      return argv[++i];
    };
    if (k == "-m")
      a.model = val();
    else if (k == "--freq-file")
      a.freq_file = val();
    else if (k == "--freq-top")
      a.freq_top = std::stoi(val());
    else if (k == "--window")
      a.window = std::stoi(val());
    else if (k == "--layers")
      a.layers = std::stoi(val());
    else if (k == "--steps")
      a.steps = std::stoi(val());
    else if (k == "--threads")
      a.threads = std::stoi(val());
    else if (k == "--warmup")
      a.warmup = std::stoi(val());
    else
      throw Error("unknown option " + k);
  }
  return a;
}

int run(const Args& a) {
  auto file = GgufFile::open(a.model);
  ModelOptions opt;
  opt.n_threads = a.threads;
  auto model = Model::load(*file, opt);
  auto tok = Tokenizer::from_gguf(*file);
  const int32_t V = model->config().n_vocab;
  std::string freq_file = a.freq_file;
  if (freq_file.empty()) freq_file = a.model.substr(0, a.model.size() - 5) + ".freq.bin";

  // A prompt of varied text; its per-position target logits stand in for verification rows.
  const std::string text =
      "Speculative decoding drafts several tokens with a cheap model and verifies them with the "
      "target in one pass. Write a Python function that merges two sorted lists, then explain its "
      "complexity. Translate into German: the weather is lovely today and we are going to the lake. "
      "Summarise the causes of the French Revolution in three bullet points.";
  const std::vector<int32_t> prompt = tok->encode(text, tok->add_bos_default(), false);
  Generator gen(*model, *tok, 1024);
  std::vector<int32_t> prompt_top;
  gen.prefill(prompt, 3, &prompt_top);
  constexpr int32_t kRows = 4;
  std::vector<float> verify(size_t(kRows) * V, 0.0f);  // [kRows][V] synthetic verification logits
  uint64_t rng = 88172645463325252ull;
  auto next = [&rng] {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
  };
  // Zipf-like ids: most draws among the first few thousand ids, a tail over the whole vocabulary.
  auto draw_id = [&]() -> int32_t {
    const double u = double(next() % 1000000) / 1000000.0;
    return int32_t(std::min<double>(V - 1, std::pow(double(V), u * u)));
  };
  std::vector<int32_t> hot;  // [kRows * 3] ids set high in verify this step
  struct Variant {
    std::string name;
    DraftVocabulary vocab;
  };
  std::vector<Variant> variants;
  variants.push_back({"full", DraftVocabulary::full(V)});
  const TokenFrequencies freq = read_freq_file(freq_file, V);
  variants.push_back(
      {"freq-" + std::to_string(a.freq_top), DraftVocabulary::packed(*model, freq.top(a.freq_top))});
  for (bool async : {true, false}) {
    DynamicVocabParams p;
    p.stream.w_max = a.window;
    p.async_gather = async;
    variants.push_back({"dynamic-" + std::to_string(a.window) + (async ? " async" : " sync"),
                        DraftVocabulary::dynamic(*model, p)});
  }

  std::printf("model %s, %d threads, draft layers %d/%d, %d steps, prompt %zu tokens\n", a.model.c_str(),
              a.threads, a.layers, model->config().n_layer, a.steps, prompt.size());
  std::printf("%-22s %10s %10s %10s %10s %12s %10s\n", "vocabulary", "step ms", "head ms", "update ms",
              "rows", "gathered/st", "wait ms");
  KVCache& kv = gen.cache();
  Batch b;
  ForwardOutput out;
  DraftTree tree;
  std::vector<int32_t> tree_tokens;  // [tree nodes]
  std::vector<float> logits;
  const std::vector<int32_t> path = {0, 1, 2};  // 3 of the chain's 4 tokens accepted
  for (Variant& v : variants) {
    v.vocab.begin(prompt, prompt_top);
    std::vector<double> step_ms, head_ms, upd_ms;
    double rows = 0.0;
    int64_t gathered0 = 0;
    const double wait0 = v.vocab.packed_head() ? v.vocab.packed_head()->wait_seconds() : 0.0;
    const int32_t warmup = a.warmup >= 0 ? a.warmup : a.window / 8;
    for (int s = -warmup; s < a.steps; ++s) {
      // The previous verification: a chain of 4 tokens, 3 accepted, and 4 rows of target logits.
      for (int32_t id : hot) verify[size_t(id)] = 0.0f;
      hot.clear();
      for (int32_t r = 0; r < kRows; ++r)
        for (int j = 0; j < 3; ++j) {
          const int32_t id = draw_id();
          verify[size_t(r) * V + size_t(id)] = 10.0f - float(j);
          hot.push_back(r * V + id);
        }
      tree.nodes.clear();
      for (int i = 0; i < 4; ++i) tree.nodes.push_back({draw_id(), i - 1, i + 1});
      const int32_t root = draw_id();
      if (s == 0 && v.vocab.packed_head()) gathered0 = v.vocab.packed_head()->rows_gathered();
      const auto t0 = Clock::now();
      v.vocab.accepted(node_tokens(tree, tree_tokens), path, verify.data());
      const double upd = ms_since(t0);
      const auto t1 = Clock::now();
      b.clear();
      b.tokens = {root};
      b.positions = {kv.n_past()};
      b.parents = {-1};
      b.output_rows = {0};
      model->forward(b, kv, out, {.end_layer = a.layers});
      const auto t2 = Clock::now();
      logits.resize(size_t(v.vocab.size()));
      v.vocab.logits(*model, out.hidden.data(), 1, logits.data());
      const double head = ms_since(t2);
      if (s < 0) continue;
      step_ms.push_back(ms_since(t1) + upd);
      head_ms.push_back(head);
      upd_ms.push_back(upd);
      rows += v.vocab.size();
    }
    const PackedHead* ph = v.vocab.packed_head();
    std::printf("%-22s %10.3f %10.3f %10.3f %10.0f %12.1f %10.4f\n", v.name.c_str(), median(step_ms),
                median(head_ms), median(upd_ms), rows / a.steps,
                ph ? double(ph->rows_gathered() - gathered0) / a.steps : 0.0,
                ph ? (ph->wait_seconds() - wait0) * 1e3 / (a.steps + warmup) : 0.0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
