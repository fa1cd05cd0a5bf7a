#pragma once
// `microspec coverage` (run_coverage): how often the target's greedy token is inside a draft
// vocabulary, the measurement behind MicroSpec's Figure 1b. For every step of plain greedy decoding over a
// dataset's first turns (chat template applied), each vocabulary is asked whether it holds the
// token the target is about to produce:
//   static  the K most frequent ids of a frequency file plus the end-of-generation tokens
//           (FR-Spec's set, as --draft-vocab freq builds it), K in 512 .. 65536;
//   dynamic MicroSpec's window (W_max in 1k .. 8k, K_pre / K_ver from the flags) fed as in a
//           speculative run that drafts one token per step: S starts as the prompt then the union
//           of the target's top-K_pre at every prompt position; after step t (the target produced
//           x_t from logits_t) it appends x_t, standing for the accepted draft tree, then the
//           top-K_ver of logits_t. Token x_t is checked against the window as it was before step
//           t, so the target's own logits for x_t are never used to predict it. (A real run also
//           appends rejected draft tokens and checks several tokens per verification against the
//           same window; this is the one-token-per-step version.)
// Writes <out>/coverage.csv (one row per vocabulary and category, plus "all") and
// <out>/coverage.png (coverage against vocabulary size: static as a line, dynamic as points),
// drawn by <out>/plot_coverage.py, which the command writes and runs with python3 + matplotlib.
#include <cstdint>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace microspec::bench {

struct CoverageOptions {
  std::string dataset;        // JSONL prompts (first turns; bench/dataset.h's row rule)
  std::string freq_file;      // frequency file for the static top-K sets (vocab-freq)
  std::string chat_template;  // --chat-template: tokenizer/chat.h's chat_style_for's choice
  std::string output = "coverage";
  int32_t n_ctx = 4096;
  int32_t per_category = 2;
  int32_t max_new_tokens = 128;
  int32_t kpre = 3, kver = 3;
  std::vector<int32_t> static_sizes = {512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
  std::vector<int32_t> windows = {1024, 2048, 3072, 4096, 8192};
  bool no_plot = false;
  bool quiet = false;  // no progress bar
};

// Decodes every prompt greedily through the Decoder (plain), tallies coverage, writes
// <output>/coverage.csv, prints the table and (unless no_plot) draws <output>/coverage.png.
// file, model and tokenizer: the loaded target. Throws Error.
void run_coverage(const CoverageOptions& options, const GgufFile& file, Model& model,
                  const Tokenizer& tokenizer);

}  // namespace microspec::bench
