#pragma once
// The drafter a SpecConfig asks for: a self-drafter over the target's first layers, or a separate
// draft model (loaded here with the target's threads, batch size and kernel table), each with the
// draft vocabulary of --draft-vocab. The Decoder builds its drafter here, so a setting means the
// same in the CLI, the server and the benchmark.
#include <memory>
#include <string>

#include "gguf/gguf.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "speculative/drafter.h"
#include "speculative/settings.h"
#include "tokenizer/tokenizer.h"

namespace microspec {

// A drafter with what it owns. Members are destroyed drafter first, then its model and file.
struct BuiltDrafter {
  std::unique_ptr<GgufFile> file;    // --spec draft: the draft model's file (null when shared)
  std::unique_ptr<Model> model;      // --spec draft: the draft model (null when shared)
  Model* draft_model = nullptr;      // --spec draft: the model the drafter runs on (its own, or shared)
  std::unique_ptr<Drafter> drafter;  // null for --spec none
  std::string describe;              // drafter and draft vocabulary, for statistics lines
};

// The dynamic / hybrid vocabulary's parameters of a config (--vocab-window, --vocab-kpre,
// --vocab-kver, --vocab-source, --no-async-gather).
DynamicVocabParams dynamic_vocab_params(const SpecConfig& config);

// The pruned vocabulary config asks for (--draft-vocab freq / dynamic / hybrid; not full) over a
// target of n_vocab tokens: the window's parameters and the frequent tokens (--freq-file, or the
// ranking scripts/make_freq.sh writes beside target_file_name; every end-of-generation token of
// tokenizer added). *describe names it for statistics lines. The CPU's drafters and the CUDA
// backend both build their vocabulary from it. Throws Error (a missing frequency file).
PrunedVocabSpec pruned_vocab_spec(const SpecConfig& config, const std::string& target_file_name, int32_t n_vocab,
                                  const Tokenizer& tokenizer, std::string* describe);

// config must be valid (SpecConfig::validate). target_kv: the target's cache (its n_ctx sizes the
// drafter; a self-drafter shares it); target_file (the target's GGUF) locates the default frequency file and is
// compared with a draft model's vocabulary. shared_draft_model: for --spec draft, a draft model
// loaded by an earlier build_drafter (BuiltDrafter::draft_model, which must outlive this drafter)
// to run on instead of loading another copy: the batching server's slots share one, so their tree
// levels are drafted in one forward call (draft_together). Throws Error.
// The EAGLE head file `--spec head` uses: --draft-head, else heads/<stem>.eagle3.gguf beside the
// target file, which must then exist (Error asking for --draft-head otherwise).
std::string draft_head_path(const SpecConfig& config, const std::string& target_file_name);

// batch_sequences: most sequences whose rows share one verification pass (the batching server's
// slots; 1 alone): --spec auto measures the target's costs up to that many sequences' trees.
BuiltDrafter build_drafter(const SpecConfig& config, const GgufFile& target_file, Model& target, KVCache& target_kv,
                           const Tokenizer& tokenizer, Model* shared_draft_model = nullptr,
                           int32_t batch_sequences = 1);

}  // namespace microspec
