#include "speculative/drafter_setup.h"

#include <algorithm>
#include <filesystem>

#include "model/model_file.h"
#include "speculative/auto_drafter.h"
#include "speculative/head_drafter.h"
#include "speculative/ngram.h"
#include "util/error.h"
#include "vocab/freq_file.h"

namespace microspec {

namespace {

// The draft vocabulary c asks for, over model's LM head; *describe says which.
DraftVocabulary make_vocabulary(const SpecConfig& c, const std::string& target_file_name, const Model& model,
                                const Tokenizer& tokenizer, std::string* describe) {
  const int32_t n_vocab = model.config().n_vocab;
  if (c.draft_vocab == DraftVocabKind::Full) {
    *describe = "full vocabulary";
    return DraftVocabulary::full(n_vocab);
  }
  PrunedVocabSpec spec = pruned_vocab_spec(c, target_file_name, n_vocab, tokenizer, describe);
  if (spec.kind == PrunedVocabSpec::Kind::Fixed) return DraftVocabulary::packed(model, std::move(spec.pinned));
  return DraftVocabulary::dynamic(model, spec.window, std::move(spec.pinned));
}

}  // namespace

namespace {

// The model-based drafter of `mode` (self, draft or head) into b.
void build_model_drafter(SpecMode mode, const SpecConfig& config, const GgufFile& target_file, Model& target,
                         KVCache& target_kv, const Tokenizer& tokenizer, Model* shared_draft_model, BuiltDrafter& b) {
  const int32_t n_layer = target.config().n_layer;
  std::string vocab;
  if (mode == SpecMode::Self) {
    const int32_t layers = config.draft_layers > 0 ? config.draft_layers : default_draft_layers(n_layer);
    if (layers > n_layer)
      throw Error("--draft-layers " + std::to_string(layers) + ": the model has " + std::to_string(n_layer) +
                  " layers");
    b.drafter = std::make_unique<SelfDrafter>(
        target, target_kv, layers, make_vocabulary(config, target_file.name(), target, tokenizer, &vocab));
    b.describe = "self, " + std::to_string(layers) + "/" + std::to_string(n_layer) + " layers";
  } else if (mode == SpecMode::Head) {
    const std::string path = draft_head_path(config, target_file.name());
    // The head runs on the target's thread pool and kernel table, rows up to the target's batch size.
    auto head = std::make_unique<Eagle3Head>(GgufFile::open(path), target, target.n_batch());
    const Eagle3Config& hc = head->config();
    b.describe = std::string(hc.arch == HeadArch::Eagle3 ? "EAGLE-3" : "EAGLE-2") + " head " + path +
                 (hc.n_draft_vocab ? " (own LM head, " + std::to_string(hc.n_draft_vocab) + " rows)" : "");
    b.drafter = std::make_unique<HeadDrafter>(std::move(head), target, target_kv.n_ctx(),
                                              make_vocabulary(config, target_file.name(), target, tokenizer, &vocab));
  } else if (mode == SpecMode::Draft) {
    if (shared_draft_model) {
      b.draft_model = shared_draft_model;  // loaded, checked and configured by the build that shared it
    } else {
      b.file = open_model_file(config.draft_model);  // a GGUF file or a Hugging Face folder
      check_same_vocabulary(target_file, *b.file);
      // The draft runs on the target's threads, batch size and kernel table (--kernels).
      ModelOptions opt;
      opt.n_threads = target.pool().size();
      opt.n_batch = target.n_batch();
      opt.kernels = target.kernels().name;
      opt.repack = target.repacks();
      b.model = Model::load(*b.file, opt);
      b.draft_model = b.model.get();
    }
    b.drafter = std::make_unique<ModelDrafter>(
        *b.draft_model, target_kv.n_ctx(),
        make_vocabulary(config, target_file.name(), *b.draft_model, tokenizer, &vocab));
    b.describe = "draft model " + config.draft_model;
  } else {
    throw Error(std::string("no model drafter for --spec ") + name_of(mode));
  }
  b.describe += ", " + vocab;
}

// Bytes of the tensors of f whose names start with `prefix` (empty: all).
size_t tensor_bytes(const GgufFile& f, const std::string& prefix) {
  size_t bytes = 0;
  for (const GgufTensor& t : f.tensors())
    if (t.name.rfind(prefix, 0) == 0) bytes += t.n_bytes;
  return bytes;
}

// What a level of auto's model drafter costs, from the target's measured costs and the shapes: a
// one-row forward streams its weights, so a drafter's layers cost their share of the target's
// layers' bytes; its draft LM head scores at most the vocabulary's rows (the dynamic window's W_max).
ModelDraftCost model_draft_cost(SpecMode model_mode, const SpecConfig& config, const GgufFile& target_file,
                                const Model& target, const BuiltDrafter& b, const StepCosts& costs) {
  const int32_t n_vocab = target.config().n_vocab;
  const double body = costs.body_at(1), head = costs.lm_head_at(1);
  const double vocab_rows = config.draft_vocab == DraftVocabKind::Full   ? n_vocab
                            : config.draft_vocab == DraftVocabKind::Freq ? config.freq_top
                                                                         : config.vocab_window + config.hybrid_top;
  const double draft_head = head * std::min(1.0, vocab_rows / n_vocab);
  const double target_layers = std::max<size_t>(1, tensor_bytes(target_file, "blk."));
  // A pending row runs in a batch of them: the target's body per row at its largest measured count.
  const double batched_row = costs.body_at(costs.max_rows()) / costs.max_rows();
  ModelDraftCost c;
  if (model_mode == SpecMode::Self) {
    const int32_t layers = config.draft_layers > 0 ? config.draft_layers : default_draft_layers(target.config().n_layer);
    c.resumed_share = double(layers) / target.config().n_layer;
    c.level_seconds = c.resumed_share * body + draft_head;  // it runs the target's layers: nothing pending
  } else {
    // A head or a draft model: its share of the target's layer bytes.
    const double share =
        model_mode == SpecMode::Head
            ? double(tensor_bytes(*GgufFile::open(draft_head_path(config, target_file.name())), "")) / target_layers
            : double(tensor_bytes(*b.file, "blk.")) / target_layers;
    c.level_seconds = body * share + draft_head;
    c.catch_up_row_seconds = batched_row * share;
  }
  return c;
}

}  // namespace

PrunedVocabSpec pruned_vocab_spec(const SpecConfig& c, const std::string& target_file_name, int32_t n_vocab,
                                  const Tokenizer& tokenizer, std::string* describe) {
  if (c.draft_vocab == DraftVocabKind::Full) throw Error("pruned_vocab_spec: the full vocabulary is not pruned");
  // The frequent tokens of `freq` and `hybrid`, with every end-of-generation token added: a draft
  // that cannot propose the end of a reply would lose the step that ends it.
  auto frequent = [&](int32_t k) {
    // Without --freq-file: the ranking scripts/make_freq.sh writes next to the target's file.
    std::string path = c.freq_file;
    if (path.empty()) {
      const std::string& target = target_file_name;
      const bool gguf = target.size() > 5 && target.compare(target.size() - 5, 5, ".gguf") == 0;
      const std::string beside = (gguf ? target.substr(0, target.size() - 5) : target) + ".freq.bin";
      if (!std::filesystem::exists(beside))
        throw Error(std::string("--draft-vocab ") + name_of(c.draft_vocab) +
                    " needs --freq-file FILE (written by `microspec vocab-freq`; " +
                    "scripts/make_freq.sh makes " + beside + ")");
      path = beside;
    }
    const TokenFrequencies freq = read_freq_file(path, n_vocab);
    std::vector<int32_t> ids = freq.top(k);
    std::vector<uint8_t> in(size_t(n_vocab), 0);
    for (int32_t id : ids) in[id] = 1;
    for (int32_t id : tokenizer.end_of_generation_ids())  // EOS is among them
      if (id >= 0 && id < n_vocab && !in[id]) {
        in[id] = 1;
        ids.push_back(id);
      }
    return ids;
  };
  PrunedVocabSpec spec;
  spec.window = dynamic_vocab_params(c);
  if (c.draft_vocab == DraftVocabKind::Freq) {
    spec.kind = PrunedVocabSpec::Kind::Fixed;
    spec.pinned = frequent(c.freq_top);
    *describe = "freq vocabulary " + std::to_string(spec.pinned.size());
    return spec;
  }
  if (c.draft_vocab == DraftVocabKind::Hybrid && c.hybrid_top > 0) spec.pinned = frequent(c.hybrid_top);
  *describe = std::string(name_of(c.draft_vocab)) + " vocabulary W " + std::to_string(c.vocab_window) + " kpre " +
              std::to_string(c.vocab_kpre) + " kver " + std::to_string(c.vocab_kver) +
              (c.vocab_source != VocabSource::Both ? std::string(" source ") + name_of(c.vocab_source)
                                                   : std::string()) +
              (spec.pinned.empty() ? std::string() : " + " + std::to_string(spec.pinned.size()) + " frequent") +
              (c.async_gather ? "" : ", sync gather");
  return spec;
}

DynamicVocabParams dynamic_vocab_params(const SpecConfig& c) {
  DynamicVocabParams p;
  p.stream.w_max = c.vocab_window;
  p.stream.k_pre = c.vocab_kpre;
  p.stream.k_ver = c.vocab_kver;
  p.stream.source = c.vocab_source;
  p.async_gather = c.async_gather;
  return p;
}

std::string draft_head_path(const SpecConfig& config, const std::string& target_file_name) {
  const std::string path = config.draft_head.empty() ? default_draft_head_path(target_file_name) : config.draft_head;
  if (config.draft_head.empty() && !std::filesystem::exists(path))
    throw Error("--spec " + std::string(name_of(config.mode)) + " needs --draft-head FILE (no head at " + path + ")");
  return path;
}

BuiltDrafter build_drafter(const SpecConfig& config, const GgufFile& target_file, Model& target, KVCache& target_kv,
                           const Tokenizer& tokenizer, Model* shared_draft_model, int32_t batch_sequences) {
  BuiltDrafter b;
  if (!config.enabled()) return b;
  const NgramParams ngram{config.ngram_min, config.ngram_max, config.ngram_min_accept};
  const int32_t n_ctx = target_kv.n_ctx();
  const std::string ngram_describe =
      "n-gram lookup " + std::to_string(ngram.min_n) + ".." + std::to_string(ngram.max_n) + " tokens";
  if (config.mode == SpecMode::Ngram) {
    b.drafter = std::make_unique<NgramDrafter>(ngram, n_ctx);
    b.describe = ngram_describe;
    return b;
  }
  if (config.mode == SpecMode::Auto) {
    const bool head_found = std::filesystem::exists(default_draft_head_path(target_file.name()));
    const SpecMode model_mode = auto_model_mode(config, head_found);
    build_model_drafter(model_mode, config, target_file, target, target_kv, tokenizer, shared_draft_model, b);
    // The costs of every verification this drafter's steps can take part in: its own tree and, in
    // the batching server, the other sequences' rows.
    const int32_t rows = std::min(target.n_batch(), std::max(1, batch_sequences) * (config.tree.total_tokens + 1));
    std::string note;
    StepCosts costs = cached_step_costs(target, target_file, rows, config.step_costs, &note);
    const ModelDraftCost model_cost = model_draft_cost(model_mode, config, target_file, target, b, costs);
    b.drafter = std::make_unique<AutoDrafter>(ngram, n_ctx, std::move(b.drafter), model_cost, std::move(costs));
    b.describe = "auto: " + ngram_describe + ", " + b.describe + " or plain; " + note;
    return b;
  }
  const SpecMode model_mode = fallback_mode(config.mode);
  build_model_drafter(model_mode, config, target_file, target, target_kv, tokenizer, shared_draft_model, b);
  if (uses_ngram(config.mode)) {
    // n-gram first: a match of at least ngram_first tokens drafts, else the model drafter.
    b.drafter = std::make_unique<NgramFirstDrafter>(ngram, config.ngram_first, n_ctx, std::move(b.drafter));
    b.describe = ngram_describe + " (>= " + std::to_string(config.ngram_first) + " drafts), else " + b.describe;
  }
  return b;
}

}  // namespace microspec
