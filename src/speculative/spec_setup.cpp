#include "speculative/spec_setup.h"

#include <algorithm>
#include <filesystem>

#include "util/error.h"
#include "vocab/freq_file.h"

namespace microspec {

void SpecConfig::validate() const {
  if (mode != "none" && mode != "self" && mode != "draft")
    throw Error("speculative mode must be none, self or draft, got '" + mode + "'");
  if (mode == "none" && (!draft_model.empty() || draft_layers != 0))
    throw Error("--draft-model/--draft-layers need --spec");
  if (mode == "self" && !draft_model.empty()) throw Error("--draft-model applies to --spec draft");
  if (mode == "draft" && draft_model.empty()) throw Error("--spec draft needs --draft-model FILE");
  if (mode == "draft" && draft_layers != 0) throw Error("--draft-layers applies to --spec self");
  if (draft_layers < 0) throw Error("--draft-layers must be >= 0");
  if (draft_vocab != "full" && draft_vocab != "freq" && draft_vocab != "dynamic" && draft_vocab != "hybrid")
    throw Error("--draft-vocab must be full, freq, dynamic or hybrid, got '" + draft_vocab + "'");
  if (vocab_source != "ctx" && vocab_source != "ext" && vocab_source != "both")
    throw Error("--vocab-source must be ctx, ext or both, got '" + vocab_source + "'");
  if (freq_top < 1) throw Error("--freq-top must be >= 1");
  if (hybrid_top < 0) throw Error("--hybrid-top must be >= 0");
  if (vocab_window < 1) throw Error("--vocab-window must be >= 1");
  if (vocab_kpre < 0 || vocab_kver < 0) throw Error("--vocab-kpre/--vocab-kver must be >= 0");
  tree.validate();
}

namespace {
int32_t parse_int(const std::string& key, const std::string& v) {
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty() || x < INT32_MIN || x > INT32_MAX)
    throw Error(key + ": expected an integer, got '" + v + "'");
  return static_cast<int32_t>(x);
}
bool parse_bool(const std::string& key, const std::string& v) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  throw Error(key + ": expected true or false, got '" + v + "'");
}
}  // namespace

void apply_spec_setting(SpecConfig& c, const std::string& key, const std::string& v) {
  if (key == "spec") c.mode = v;
  else if (key == "draft-layers") c.draft_layers = parse_int(key, v);
  else if (key == "draft-model") c.draft_model = v;
  else if (key == "tree-depth") c.tree.depth = parse_int(key, v);
  else if (key == "tree-topk") c.tree.top_k = parse_int(key, v);
  else if (key == "tree-tokens") c.tree.total_tokens = parse_int(key, v);
  else if (key == "draft-vocab") c.draft_vocab = v;
  else if (key == "freq-file") c.freq_file = v;
  else if (key == "freq-top") c.freq_top = parse_int(key, v);
  else if (key == "hybrid-top") c.hybrid_top = parse_int(key, v);
  else if (key == "vocab-window") c.vocab_window = parse_int(key, v);
  else if (key == "vocab-kpre") c.vocab_kpre = parse_int(key, v);
  else if (key == "vocab-kver") c.vocab_kver = parse_int(key, v);
  else if (key == "vocab-source") c.vocab_source = v;
  else if (key == "async-gather") c.async_gather = parse_bool(key, v);
  else throw Error("unknown speculative setting '" + key + "'");
}

int32_t default_draft_layers(int32_t n_layer) {
  // Measured: half the layers almost never agrees with the target (acceptance ~1.0 on Gemma 3 270M
  // and SmolLM2 135M); dropping only the last eighth accepts 1.8 (SmolLM2) to 4.3 (Gemma) tokens
  // per step with a chain of 4.
  return std::max(1, n_layer - std::max(1, n_layer / 8));
}

DraftVocabulary SpecSetup::make_vocabulary(const Model& model, const Tokenizer& tokenizer) {
  const SpecConfig& c = config_;
  const int32_t n_vocab = model.config().n_vocab;
  if (c.draft_vocab == "full") {
    vocab_describe_ = "full vocabulary";
    return DraftVocabulary::full(n_vocab);
  }
  // The frequent tokens of `freq` and `hybrid`, with every end-of-generation token added: a draft
  // that cannot propose the end of a reply would lose the step that ends it.
  auto frequent = [&](int32_t k) {
    // Without --freq-file: the ranking scripts/make_freq.sh writes next to the target's file.
    std::string path = c.freq_file;
    if (path.empty()) {
      const std::string& target = target_file_name_;
      const bool gguf = target.size() > 5 && target.compare(target.size() - 5, 5, ".gguf") == 0;
      const std::string beside = (gguf ? target.substr(0, target.size() - 5) : target) + ".freq.bin";
      if (!std::filesystem::exists(beside))
        throw Error("--draft-vocab " + c.draft_vocab + " needs --freq-file FILE (written by `microspec vocab-freq`; " +
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
  if (c.draft_vocab == "freq") {
    std::vector<int32_t> ids = frequent(c.freq_top);
    vocab_describe_ = "freq vocabulary " + std::to_string(ids.size());
    return DraftVocabulary::packed(model, std::move(ids));
  }
  DynamicVocabParams p;
  p.stream.w_max = c.vocab_window;
  p.stream.k_pre = c.vocab_kpre;
  p.stream.k_ver = c.vocab_kver;
  p.stream.source = CandidateStreamParams::parse_source(c.vocab_source);
  p.async_gather = c.async_gather;
  std::vector<int32_t> pinned;
  if (c.draft_vocab == "hybrid" && c.hybrid_top > 0) pinned = frequent(c.hybrid_top);
  vocab_describe_ = c.draft_vocab + " vocabulary W " + std::to_string(c.vocab_window) + " kpre " +
                    std::to_string(c.vocab_kpre) + " kver " + std::to_string(c.vocab_kver) +
                    (c.vocab_source != "both" ? " source " + c.vocab_source : std::string()) +
                    (pinned.empty() ? std::string() : " + " + std::to_string(pinned.size()) + " frequent") +
                    (c.async_gather ? "" : ", sync gather");
  return DraftVocabulary::dynamic(model, p, std::move(pinned));
}

SpecSetup::SpecSetup(const SpecConfig& config, const GgufFile& target_file, Model& target, Generator& gen,
                     const Tokenizer& tokenizer)
    : config_(config), target_file_name_(target_file.name()) {
  config_.validate();
  if (!config_.enabled()) throw Error("speculative setup: mode is none");
  const int32_t n_layer = target.config().n_layer;
  if (config_.mode == "self") {
    const int32_t layers = config_.draft_layers > 0 ? config_.draft_layers : default_draft_layers(n_layer);
    if (layers > n_layer)
      throw Error("--draft-layers " + std::to_string(layers) + ": the model has " + std::to_string(n_layer) +
                  " layers");
    drafter_ = std::make_unique<SelfDrafter>(target, gen.cache(), layers, make_vocabulary(target, tokenizer));
    describe_ = "self, " + std::to_string(layers) + "/" + std::to_string(n_layer) + " layers";
  } else {
    draft_file_ = GgufFile::open(config_.draft_model);
    check_same_vocabulary(target_file, *draft_file_);
    ModelOptions opt;
    opt.n_threads = target.pool().size();
    opt.n_batch = target.n_batch();
    draft_model_ = Model::load(*draft_file_, opt);
    drafter_ = std::make_unique<ModelDrafter>(*draft_model_, gen.cache().n_ctx(),
                                              make_vocabulary(*draft_model_, tokenizer));
    describe_ = "draft model " + config_.draft_model;
  }
  describe_ += ", " + vocab_describe_;
  gen_ = std::make_unique<SpeculativeGenerator>(gen, tokenizer, *drafter_, config_.tree);
  describe_ += ", tree depth " + std::to_string(config_.tree.depth) + " top-k " +
               std::to_string(config_.tree.top_k) + " tokens " + std::to_string(config_.tree.total_tokens);
}

}  // namespace microspec
