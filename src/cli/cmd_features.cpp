// `microspec features`: the training data of an EAGLE-3 draft head (scripts/train_draft_head.py),
// computed by the target itself: for every position of every conversation, the residual streams
// entering the chosen layers (the head's input features) and the target's top-k next-token
// log-probabilities (the head's soft labels), from one teacher-forced pass.
//
// Input: JSONL, one {"messages": [{"role", "content"}, ...]} (rendered with the model's chat
// template, or --chat-template's; whole conversation, no generation prompt) or {"ids": [...]} per
// line. Output (-o): per sequence, in input order, raw little-endian arrays
//   ids        int32 [n]
//   features   bf16  [n][layers][n_embd]   (bfloat16: the residual streams exceed half-float range,
//                                           Gemma 3's reach 1e5; round to nearest even)
//   top_ids    int32 [n][k]
//   top_logp   f32   [n][k]   log-softmax over the whole vocabulary, best first
// and on stdout one JSON line per sequence: {"n_tokens", "offset"} (byte offset in the file).
// The trainer memory-maps the file and reads a sequence's arrays in place (nothing is held in RAM).
//
// The labels are the LM head over kLabelRows positions per call (the many-token kernels), then
// each position's log-softmax and top-k with the positions split across the model's threads. The
// values are the ones `generate --logprobs` reports for the same position: one log-sum-exp
// (sampling/logprobs.h) and batch-invariant kernels.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "math/select.h"
#include "model/kv_cache.h"
#include "sampling/logprobs.h"
#include "tokenizer/chat.h"
#include "util/error.h"
#include "util/file.h"

namespace microspec::cli {

namespace {

struct FeaturesArgs {
  ModelArgs model;
  std::string input;
  std::string output;
  std::string layers;
  std::string chat_template;  // --chat-template: chat_style_for's choice
  int32_t top_k = 16;
  int32_t max_tokens = 1024;
};

// f32 -> bfloat16, round to nearest even (inputs are finite activations).
uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<int32_t> parse_layers(const std::string& text, int32_t n_layer) {
  std::vector<int32_t> layers = parse_token_ids(text);
  if (layers.empty()) throw Error("--layers: give the layer indices (\"2,9,15\")");
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 0 || layers[i] > n_layer)
      throw Error("--layers: " + std::to_string(layers[i]) + " is outside [0, " + std::to_string(n_layer) + "]");
    if (i > 0 && layers[i] < layers[i - 1]) throw Error("--layers must be non-decreasing");
  }
  return layers;
}

// The token ids of one input line, each checked against the vocabulary. The chat template is
// chosen at the first line with messages.
std::vector<int32_t> sequence_ids(const nlohmann::json& j, const LoadedModel& m, const FeaturesArgs& a,
                                  std::optional<ChatStyle>& style, const std::string& where) {
  std::vector<int32_t> ids;
  if (j.is_object() && j.contains("ids")) {
    const nlohmann::json& list = j["ids"];
    if (!list.is_array()) throw Error(where + "\"ids\" must be an array of token ids");
    const int32_t V = m.model->config().n_vocab;
    for (const auto& id : list) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= V)
        throw Error(where + "token id " + id.dump() + " is not in [0, " + std::to_string(V) + ")");
      ids.push_back(id.get<int32_t>());
    }
    return ids;
  }
  if (!j.is_object() || !j.contains("messages") || !j["messages"].is_array())
    throw Error(where + "expected {\"messages\": [...]} or {\"ids\": [...]}");
  std::vector<ChatMessage> messages;
  for (const auto& msg : j["messages"]) {
    if (!msg.is_object() || !msg.contains("role") || !msg.contains("content") || !msg["role"].is_string() ||
        !msg["content"].is_string())
      throw Error(where + "each message needs string \"role\" and \"content\"");
    messages.push_back({msg["role"].get<std::string>(), msg["content"].get<std::string>()});
  }
  if (!style) style = chat_style_for(*m.file, *m.tokenizer, a.chat_template);
  return encode_chat(*m.tokenizer, *style, messages, GenerationPrompt::Omit);
}

// Positions' labels per LM-head call: enough tokens for the many-token kernels' full tiles.
constexpr int32_t kLabelRows = 64;

// The labels of `rows` positions whose final hidden states are hidden[rows][E]: the LM head in
// one call into logits[rows][V], then per position its k best ids and their log-softmax values
// (top_ids[rows][k], top_logp[rows][k]), the positions split across the model's threads.
void label_rows(Model& model, const float* hidden, int32_t rows, int32_t k, float* logits, int32_t* top_ids,
                float* top_logp) {
  const int32_t V = model.config().n_vocab;
  model.lm_head(hidden, rows, logits);
  std::atomic<int32_t> non_finite{-1};  // a row whose maximum is not finite (workers must not throw)
  model.pool().parallel_for(rows, 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = logits + size_t(i) * V;
      const float mx = max_ignoring_nan(row, V);
      if (!std::isfinite(mx)) {
        non_finite.store(int32_t(i));
        continue;
      }
      const double offset = double(mx) + log_sum_exp_below(row, V, mx);  // log p = x - offset
      int32_t* ids = top_ids + size_t(i) * k;
      top_k_indices(row, V, k, ids);
      for (int32_t t = 0; t < k; ++t) top_logp[size_t(i) * k + t] = float(double(row[ids[t]]) - offset);
    }
  });
  if (non_finite.load() >= 0) throw Error("the target's logits are not finite at a position (NaN or infinite)");
}

void run_features(const FeaturesArgs& a) {
  // top_k_indices keeps its k best in order by insertion: a label set, not a sort of the vocabulary.
  constexpr int32_t kMaxTopK = 1024;
  if (a.top_k < 1 || a.top_k > kMaxTopK) throw Error("--top-k must be in [1, " + std::to_string(kMaxTopK) + "]");
  if (a.max_tokens < 2) throw Error("--max-tokens must be >= 2");
  LoadedModel m = load_model(a.model);
  Model& model = *m.model;
  const int32_t V = model.config().n_vocab, E = model.config().n_embd;
  const std::vector<int32_t> layers = parse_layers(a.layers, model.config().n_layer);
  const int32_t L = static_cast<int32_t>(layers.size()), k = std::min(a.top_k, V);
  FILE* out = std::fopen(a.output.c_str(), "wb");
  if (!out) throw Error(a.output + ": cannot open for writing");
  std::unique_ptr<FILE, int (*)(FILE*)> close_out(out, std::fclose);
  KVCache kv = model.make_cache(std::min(a.model.n_ctx, a.max_tokens));

  Batch batch;
  ForwardOutput fo;
  std::vector<float> logits(size_t(kLabelRows) * V);  // [kLabelRows][V]
  std::vector<float> hidden;                           // [n][E] final hidden states of a sequence
  std::vector<uint16_t> features;                      // [n_batch][L][E] bfloat16
  std::vector<int32_t> top_ids;                        // [n][k]
  std::vector<float> top_logp;                         // [n][k]
  std::optional<ChatStyle> style;
  std::istringstream lines(read_file_bytes(a.input));
  std::string line;
  int line_no = 0;
  long offset = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = a.input + ":" + std::to_string(line_no) + ": ";
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    std::vector<int32_t> ids = sequence_ids(j, m, a, style, where);
    if (ids.size() > size_t(a.max_tokens)) ids.resize(size_t(a.max_tokens));
    const int32_t n = static_cast<int32_t>(ids.size());
    if (n == 0) throw Error(where + "empty sequence");
    std::fwrite(ids.data(), sizeof(int32_t), ids.size(), out);
    // The features go out per forward call (the file's layout holds them before the labels); the
    // final hidden states are kept for the labels, computed kLabelRows at a time.
    kv.clear();
    hidden.resize(size_t(n) * E);
    for (int32_t at = 0; at < n; at += model.n_batch()) {
      const int32_t len = std::min(model.n_batch(), n - at);
      batch.set_sequence(std::span<const int32_t>(ids.data() + at, len), at, true);
      model.forward(batch, kv, fo, {.capture_layers = layers});
      kv.commit_prefix(len);
      features.resize(fo.layer_inputs.size());
      for (size_t i = 0; i < features.size(); ++i) features[i] = to_bf16(fo.layer_inputs[i]);
      std::fwrite(features.data(), sizeof(uint16_t), features.size(), out);
      std::copy(fo.hidden.begin(), fo.hidden.begin() + ptrdiff_t(len) * E, hidden.begin() + ptrdiff_t(at) * E);
    }
    top_ids.resize(size_t(n) * k);
    top_logp.resize(size_t(n) * k);
    for (int32_t r = 0; r < n; r += kLabelRows)
      label_rows(model, hidden.data() + size_t(r) * E, std::min(kLabelRows, n - r), k, logits.data(),
                 top_ids.data() + size_t(r) * k, top_logp.data() + size_t(r) * k);
    std::fwrite(top_ids.data(), sizeof(int32_t), top_ids.size(), out);
    std::fwrite(top_logp.data(), sizeof(float), top_logp.size(), out);
    if (std::ferror(out)) throw Error(a.output + ": write failed");
    std::printf("%s\n", nlohmann::json{{"n_tokens", n}, {"offset", offset}}.dump().c_str());
    std::fflush(stdout);
    offset += long(n) * (sizeof(int32_t) + sizeof(uint16_t) * L * E + sizeof(int32_t) * k + sizeof(float) * k);
  }
}

}  // namespace

void add_features_command(CLI::App& app) {
  auto args = std::make_shared<FeaturesArgs>();
  CLI::App* cmd = app.add_subcommand(
      "features", "an EAGLE-3 head's training data: chosen layers' hidden states and the target's top-k labels");
  args->model.add_to(*cmd);
  cmd->option_defaults()->group(group::kInput);
  cmd->add_option(
         "--input", args->input,
         "JSONL of {\"messages\": [...]} (rendered with the model's chat template) or {\"ids\": [...]}")
      ->required();
  add_chat_template_option(*cmd, args->chat_template);
  cmd->add_option("-o,--output", args->output, "binary output (see the command's header comment)")
      ->required()
      ->group(group::kOutput);
  cmd->add_option("--layers", args->layers, "layers whose input residual stream is written (\"2,9,15\")")
      ->required();
  cmd->add_option("--top-k", args->top_k, "target log-probabilities kept per position")->capture_default_str();
  cmd->add_option("--max-tokens", args->max_tokens, "sequences are cut to this many tokens")->capture_default_str();
  cmd->callback([args] { run_features(*args); });
}

}  // namespace microspec::cli
