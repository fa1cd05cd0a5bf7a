// `microspec generate`: text generation from a prompt, printed as it is produced, then one line of
// statistics on stderr.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <sstream>

#include "bench/dataset.h"
#include "cli/commands.h"
#include "draft_head/eagle3_head.h"
#include "cli/common.h"
#include "engine/cuda_generator.h"
#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "sampling/logprobs.h"
#include "grammar/json_schema.h"
#include "speculative/drafter_setup.h"
#include "tokenizer/chat.h"
#include "util/error.h"

namespace microspec::cli {

namespace {

struct GenerateArgs {
  ModelArgs model;
  std::string prompt;
  std::string prompt_file;
  std::string prompt_ids;
  std::string system;
  bool chat = false;
  std::string chat_template;  // --chat-template: chat_style_for's choice
  int32_t n_predict = 128;
  float temperature = 0.0f;
  int top_k = 40;
  float top_p = 0.95f;
  int64_t seed = -1;
  PenaltyParams penalties;              // --repeat-penalty, --presence-penalty, ...
  float min_p = 0.0f;                   // --min-p
  std::vector<std::string> logit_bias;  // --logit-bias TOKEN_ID(+/-)BIAS
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool json = false;
  int32_t logprobs = -1;  // --logprobs K: each token's log-probability and its K best alternatives (-1: off)
  bool quiet = false;
  SpecConfig spec;
  std::string prompts_jsonl;  // batch mode: one prompt per line ({"turns": [...]} or {"prompt": ...})
  std::string device = "cpu";  // cpu, or cuda (greedy decoding on the GPU)
  std::string json_schema;       // --json-schema: structured output, the schema as JSON text
  std::string json_schema_file;  // --json-schema-file: the same from a file
};

// --json-schema / --json-schema-file: the grammar every generated token must keep to (null: none).
std::shared_ptr<const TokenConstraint> structured_output(const GenerateArgs& a, const Tokenizer& tok) {
  if (a.json_schema.empty() && a.json_schema_file.empty()) return nullptr;
  if (!a.json_schema.empty() && !a.json_schema_file.empty()) throw Error("give one of --json-schema, --json-schema-file");
  const std::string flag = a.json_schema.empty() ? "--json-schema-file" : "--json-schema";
  const std::string text = a.json_schema.empty() ? read_file_bytes(a.json_schema_file) : a.json_schema;
  const nlohmann::ordered_json schema = nlohmann::ordered_json::parse(text, nullptr, false);
  if (schema.is_discarded()) throw Error(flag + ": not valid JSON");
  try {
    return std::make_shared<TokenConstraint>(json_schema_grammar(schema), std::make_shared<GrammarVocabulary>(tok));
  } catch (const Error& e) {
    throw Error(flag + ": " + e.what());
  }
}

// How text prompts become ids: plain, or (--chat) as one user turn in the file's chat format,
// which is detected once per run.
struct PromptEncoder {
  const GenerateArgs& a;
  const Tokenizer& tok;
  ChatStyle style;
  PromptEncoder(const GenerateArgs& args, const LoadedModel& m) : a(args), tok(*m.tokenizer) {
    if (!a.chat) return;
    style = chat_style_for(*m.file, tok, a.chat_template);
  }
  std::vector<int32_t> operator()(const std::string& text) const {
    if (!a.chat) return tok.encode(text, tok.add_bos_default(), false);
    std::vector<ChatMessage> messages;
    if (!a.system.empty()) messages.push_back({"system", a.system});
    messages.push_back({"user", text});
    return encode_chat(tok, style, messages);
  }
};

// One generation as the output needs it: the result, its speeds, the statistics lines for stderr
// and the members of the JSON line that only the path that ran it has.
struct Outcome {
  GenerateResult gen;
  double prefill_tokens_per_second = 0.0;
  double decode_tokens_per_second = 0.0;
  std::vector<std::string> stats_lines;
  nlohmann::json extra = nlohmann::json::object();
};
// Generates from prompt ids on the CPU or the device; on_text takes the text as it becomes final.
using RunOne = std::function<Outcome(const std::vector<int32_t>& prompt_ids, const GenerateParams& params,
                                     const TextCallback& on_text)>;

// printf into a string of the length it needs.
std::string format(const char* fmt, auto... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string s(size_t(std::max(n, 0)), '\0');
  std::snprintf(s.data(), s.size() + 1, fmt, args...);
  return s;
}

Outcome run_on_cpu(const GenerateArgs& a, Decoder& decoder, const std::vector<int32_t>& prompt_ids,
                   const GenerateParams& params, const TextCallback& on_text) {
  const SpecResult sr = decoder.generate(prompt_ids, params, on_text);
  const GenerateResult& r = sr.gen;
  const SpecStats& st = sr.stats;
  Outcome o;
  o.gen = r;
  o.prefill_tokens_per_second = sr.prefill_tokens_per_second();
  o.decode_tokens_per_second = sr.decode_tokens_per_second();
  const double peak_mib = peak_memory_bytes() / (1024.0 * 1024.0);
  o.stats_lines.push_back(format("prompt tokens: %d | prefill: %.1f tok/s | decode: %.1f tok/s (%zu tokens) | peak memory: %.0f MiB",
                                 r.prompt_tokens, o.prefill_tokens_per_second, o.decode_tokens_per_second,
                                 r.tokens.size(), peak_mib));
  auto share = [&](double s) { return r.decode_seconds > 0 ? s / r.decode_seconds : 0.0; };
  if (decoder.speculative())
    o.stats_lines.push_back(format(
        "speculative (%s): decode %.1f tok/s | %d steps | mean acceptance length %.2f | draft vocabulary "
        "%.0f | time shares: draft backbone %.0f%%, draft LM head %.0f%%, verify %.0f%% (LM head %.0f%%), "
        "bookkeeping %.0f%%",
        decoder.describe().c_str(), o.decode_tokens_per_second, st.steps, st.mean_acceptance_length(),
        st.mean_active_vocab(), 100 * share(st.draft_backbone_seconds()), 100 * share(st.draft_lm_head_seconds),
        100 * share(st.verify_seconds), 100 * share(st.verify_lm_head_seconds), 100 * share(st.bookkeeping_seconds)));
  if (decoder.speculative()) {
    // Which drafter ran each step: auto's choices, or an X+ngram mode's split.
    std::string line = "steps by drafter:";
    for (int i = 0; i < kDraftSources; ++i) {
      const SpecStats::SourceCounts& c = st.by_source[size_t(i)];
      line += format(" %s %d (acceptance %.2f)%s", name_of(DraftSource(i)), c.steps,
                     c.steps ? 1.0 + double(c.accepted) / c.steps : 0.0, i + 1 < kDraftSources ? "," : "");
    }
    o.stats_lines.push_back(line);
  }
  o.extra["decode_lm_head_seconds"] = r.decode_lm_head_seconds;
  if (decoder.speculative()) {
    nlohmann::json by_source = nlohmann::json::object();
    for (int i = 0; i < kDraftSources; ++i)
      by_source[name_of(DraftSource(i))] = {{"steps", st.by_source[size_t(i)].steps},
                                            {"accepted_draft_tokens", st.by_source[size_t(i)].accepted}};
    o.extra["spec"] = {{"mode", name_of(a.spec.mode)},
                       {"steps", st.steps},
                       {"drafted_tokens", st.drafted},
                       {"accepted_draft_tokens", st.accepted_draft},
                       {"mean_acceptance_length", st.mean_acceptance_length()},
                       {"draft_seconds", st.draft_seconds},
                       {"verify_seconds", st.verify_seconds},
                       {"draft_lm_head_seconds", st.draft_lm_head_seconds},
                       {"draft_backbone_seconds", st.draft_backbone_seconds()},
                       {"verify_lm_head_seconds", st.verify_lm_head_seconds},
                       {"bookkeeping_seconds", st.bookkeeping_seconds},
                       {"mean_active_vocab", st.mean_active_vocab()},
                       {"lm_head_seconds", st.lm_head_seconds()},
                       {"draft_share", share(st.draft_seconds)},
                       {"verify_share", share(st.verify_seconds)},
                       {"lm_head_share", share(st.lm_head_seconds())},
                       {"steps_by_drafter", by_source}};
  }
  return o;
}

// The device's generation: its own speeds (prefill up to the first token, decoding after it) and
// counts (steps and accepted drafts, as the CPU counts them; the device times no parts of a step).
Outcome run_on_device(const GenerateArgs& a, const CudaGenerator& device, const std::vector<int32_t>& prompt_ids,
                      const GenerateParams& params, const TextCallback& on_text) {
  const SpecResult sr = device.generate(prompt_ids, params, on_text);
  const GenerateResult& r = sr.gen;
  const SpecStats& st = sr.stats;
  Outcome o;
  o.gen = r;
  o.prefill_tokens_per_second = sr.prefill_tokens_per_second();
  o.decode_tokens_per_second = sr.decode_tokens_per_second();
  std::string line = format("%s | prompt tokens: %d | prefill: %.1f tok/s | decode: %.1f tok/s (%zu tokens)",
                            device.describe().c_str(), r.prompt_tokens, o.prefill_tokens_per_second,
                            o.decode_tokens_per_second, r.tokens.size());
  if (device.speculative())
    line += format(" | %d steps, mean acceptance length %.2f", st.steps, st.mean_acceptance_length());
  o.stats_lines.push_back(line);
  o.extra["device"] = "cuda";
  if (device.speculative())
    o.extra["spec"] = {{"mode", name_of(a.spec.mode)},
                       {"steps", st.steps},
                       {"drafted_tokens", st.drafted},
                       {"accepted_draft_tokens", st.accepted_draft},
                       {"mean_acceptance_length", st.mean_acceptance_length()}};
  return o;
}

// --logprobs in the JSON line: per generated token {"token", "logprob", "top": [[id, logprob], ...]}
// (sampling/logprobs.h says which values); -inf is written as null.
nlohmann::json logprobs_json(const LogprobRows& rows) {
  auto value = [](float x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < rows.rows(); ++i) {
    const std::span<const TokenLogprob> row = rows.row(i);
    nlohmann::json top = nlohmann::json::array();
    for (const TokenLogprob& alt : row.subspan(1))
      if (alt.token >= 0) top.push_back({alt.token, value(alt.logprob)});
    out.push_back({{"token", row[0].token}, {"logprob", value(row[0].logprob)}, {"top", top}});
  }
  return out;
}

// Generates from one prompt and prints the statistics lines (stderr) and, with json, one JSON line.
// seed: the sampler's seed (-1 = random).
// grammar: structured output's constraint (null: none).
void generate_one(const GenerateArgs& a, const Tokenizer& tok, const RunOne& run, const std::vector<int32_t>& prompt_ids,
                  int64_t seed, bool json, const std::shared_ptr<const TokenConstraint>& grammar) {
  for (int32_t id : prompt_ids)
    if (id < 0 || id >= tok.n_vocab())
      throw Error("prompt token id " + std::to_string(id) + " is outside the vocabulary");

  GenerateParams params;
  params.max_new_tokens = a.n_predict;
  params.sampling.temperature = a.temperature;
  params.sampling.top_k = a.top_k;
  params.sampling.top_p = a.top_p;
  params.sampling.min_p = a.min_p;
  params.penalties = a.penalties;
  params.penalties.logit_bias = parse_logit_bias_flags(a.logit_bias);
  params.sampling.seed = seed >= 0 ? static_cast<uint64_t>(seed) : std::random_device{}();
  params.stop_strings = a.stop;
  params.ignore_eos = a.ignore_eos;
  params.logprobs = {.enabled = a.logprobs >= 0, .top = std::max(a.logprobs, 0)};
  params.grammar = grammar;

  const bool stream = !json && !a.quiet;
  auto on_text = [&](std::string_view text) {
    if (stream) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  const Outcome o = run(prompt_ids, params, on_text);
  const GenerateResult& r = o.gen;
  if (stream) {
    std::fputc('\n', stdout);
    std::fflush(stdout);  // before the statistics: the two may share a terminal or a pipe
  }
  for (const std::string& line : o.stats_lines) std::fprintf(stderr, "%s\n", line.c_str());
  if (json) {
    nlohmann::json j;
    j["prompt_tokens"] = r.prompt_tokens;
    j["prompt_ids"] = prompt_ids;
    if (seed >= 0) j["seed"] = seed;
    j["tokens"] = r.tokens;
    j["text"] = r.text;
    j["finish_reason"] = finish_reason_name(r.finish);
    if (params.logprobs.enabled) j["logprobs"] = logprobs_json(r.logprobs);
    j["prefill_tokens_per_second"] = o.prefill_tokens_per_second;
    j["decode_tokens_per_second"] = o.decode_tokens_per_second;
    j["prefill_seconds"] = r.prefill_seconds;
    j["decode_seconds"] = r.decode_seconds;
    j["peak_memory_bytes"] = peak_memory_bytes();
    j.update(o.extra);
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    std::fflush(stdout);
  }
}

// A batch row's sampling seed: its "seed" member (a non-negative integer) when it has one, else
// --seed. Many seeds of one prompt in one process give a sample of its output distribution.
int64_t row_seed(const nlohmann::json& row, int64_t default_seed, const std::string& where) {
  if (!row.is_object() || !row.contains("seed")) return default_seed;
  const nlohmann::json& s = row["seed"];
  if (!s.is_number_integer() || s.get<int64_t>() < 0)
    throw Error(where + ": \"seed\" must be a non-negative integer, got " + s.dump());
  return s.get<int64_t>();
}

void run_generate(const GenerateArgs& a) {
  int sources = !a.prompt.empty() + !a.prompt_file.empty() + !a.prompt_ids.empty() + !a.prompts_jsonl.empty();
  if (sources != 1) throw Error("give exactly one of -p/--prompt, -f/--file, --prompt-ids, --prompts-jsonl");
  if (!a.prompt_ids.empty() && a.chat) throw Error("--chat applies to text prompts, not --prompt-ids");
  if (a.n_predict < 0) throw Error("-n must be >= 0");

  // The device path: what it cannot run is refused before the model is loaded.
  if (a.device != "cpu" && a.device != "cuda") throw Error("--device must be cpu or cuda, got '" + a.device + "'");
  const bool on_device = a.device == "cuda";
  if (a.logprobs >= 0 && !a.json) throw Error("--logprobs needs --json (the values are printed in the JSON line)");
  if (a.logprobs >= 0 && on_device) throw Error("--logprobs: the device hands back tokens, not logits rows; use --device cpu");
  if ((!a.json_schema.empty() || !a.json_schema_file.empty()) && on_device)
    throw Error("--json-schema: the device applies no grammar; use --device cpu");
  if (on_device) {
    const SamplingParams sampling{.temperature = a.temperature, .top_k = a.top_k, .top_p = a.top_p};
    if (const std::string why = cuda_params_unsupported(sampling); !why.empty()) throw Error("--device cuda: " + why);
    PenaltyParams penalties = a.penalties;
    penalties.logit_bias = parse_logit_bias_flags(a.logit_bias);
    if (const char* field = first_active_penalty(penalties, a.min_p))
      throw Error(std::string("--device cuda: ") + field +
                  " is not supported on the device (penalties, logit bias and min-p run on the CPU only)");
    if (const std::string why = cuda_spec_sampling_unsupported(a.spec); !why.empty() && !sampling.greedy())
      throw Error(why);
    if (const std::string why = cuda_spec_unsupported(a.spec); !why.empty()) throw Error(why);
  }
  // The device loads its own weights: the CPU reads only the file's metadata and tokenizer.
  LoadedModel m = on_device ? open_model(a.model) : load_model(a.model);
  const PromptEncoder encode(a, m);
  const std::shared_ptr<const TokenConstraint> grammar = structured_output(a, *m.tokenizer);
  RunOne run;
  std::unique_ptr<Generator> gen;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<CudaGenerator> device;
  if (on_device) {
    CudaGeneratorOptions cuda_options;
    cuda_options.n_predict = a.n_predict;
    cuda_options.n_ctx = a.model.n_ctx;
    cuda_options.n_batch = a.model.n_batch;
    set_cuda_speculation(a.spec, *m.file, *m.tokenizer, cuda_options);
    device = std::make_unique<CudaGenerator>(*m.file, *m.tokenizer, cuda_options);
    run = [&](const std::vector<int32_t>& ids, const GenerateParams& params, const TextCallback& on_text) {
      return run_on_device(a, *device, ids, params, on_text);
    };
  } else {
    gen = std::make_unique<Generator>(*m.model, *m.tokenizer, a.model.n_ctx);
    decoder = std::make_unique<Decoder>(a.spec, *m.file, *gen, *m.tokenizer);
    run = [&](const std::vector<int32_t>& ids, const GenerateParams& params, const TextCallback& on_text) {
      return run_on_cpu(a, *decoder, ids, params, on_text);
    };
  }
  const Tokenizer& tok = *m.tokenizer;

  if (!a.prompts_jsonl.empty()) {
    // Batch mode: one model load, one JSON line per prompt.
    std::istringstream lines(read_file_bytes(a.prompts_jsonl));
    std::string line;
    int line_no = 0;
    while (std::getline(lines, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      const int64_t seed = row_seed(j, a.seed, a.prompts_jsonl + ":" + std::to_string(line_no));
      if (j.is_object() && j.contains("prompt_ids") && j["prompt_ids"].is_array()) {
        std::vector<int32_t> ids;
        try {
          ids = j["prompt_ids"].get<std::vector<int32_t>>();
        } catch (const nlohmann::json::exception&) {
          throw Error(a.prompts_jsonl + ":" + std::to_string(line_no) + ": \"prompt_ids\" must be token ids");
        }
        if (a.chat) throw Error("--chat applies to text prompts, not \"prompt_ids\"");
        generate_one(a, tok, run, ids, seed, true, grammar);
        continue;
      }
      std::vector<std::string> turns;
      try {
        turns = bench::row_turns(j);
      } catch (const Error& e) {
        throw Error(a.prompts_jsonl + ":" + std::to_string(line_no) + ": " + e.what());
      }
      if (turns.empty())
        throw Error(a.prompts_jsonl + ":" + std::to_string(line_no) +
                    ": expected a JSON object with \"prompt\" (string), \"turns\" (strings) or \"prompt_ids\" (token ids)");
      generate_one(a, tok, run, encode(turns[0]), seed, true, grammar);
    }
    return;
  }
  std::vector<int32_t> prompt_ids;
  if (!a.prompt_ids.empty())
    prompt_ids = parse_token_ids(a.prompt_ids);
  else
    prompt_ids = encode(a.prompt_file.empty() ? a.prompt : read_file_bytes(a.prompt_file));
  generate_one(a, tok, run, prompt_ids, a.seed, a.json, grammar);
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a prompt");
  args->model.add_to(*cmd);
  cmd->add_option("--device", args->device,
                  "cpu, or cuda: decoding on the GPU, greedy or sampled (top-k 1..64), plain or speculative (a chain, or a "
                  "tree from the self-draft, a draft model or the head; builds with MICROSPEC_CUDA)")
      ->capture_default_str()
      ->group(group::kModel);

  cmd->option_defaults()->group(group::kInput);
  cmd->add_option("-p,--prompt", args->prompt, "prompt text");
  cmd->add_option("-f,--file", args->prompt_file, "read the prompt from a file (bytes kept as they are)");
  cmd->add_option("--prompt-ids", args->prompt_ids, "prompt as token ids (\"1 2 3\"), no tokenization");
  CLI::Option* chat = cmd->add_flag("--chat", args->chat, "wrap the prompt in the model's chat format as a user turn");
  cmd->add_option("--chat-template", args->chat_template,
                  "with --chat: a Jinja chat template file, a built-in format (gemma, chatml, llama3) or 'model' "
                  "(the model's own template); default: the built-in format that fits the model, else its own")
      ->needs(chat);
  cmd->add_option("--system-prompt,--system", args->system, "system message for --chat");
  cmd->add_option(
      "--prompts-jsonl", args->prompts_jsonl,
      "batch mode: a JSONL file of {\"turns\": [...]} (first turn), {\"prompt\": ...} or {\"prompt_ids\": [...]} "
      "objects, \"turns\" winning over \"prompt\" when a row has both; an optional \"seed\" (integer >= 0) "
      "replaces --seed for that row; prints one JSON line per prompt");

  add_sampling_options(*cmd, {.n_predict = args->n_predict,
                              .temperature = args->temperature,
                              .top_k = args->top_k,
                              .top_p = args->top_p,
                              .seed = args->seed,
                              .ignore_eos = args->ignore_eos,
                              .min_n_predict = 0,
                              .min_seed = -1,
                              .seed_help = "RNG seed; -1 = random"});
  add_penalty_options(*cmd, {.penalties = args->penalties, .min_p = args->min_p, .logit_bias = args->logit_bias});
  cmd->add_option("--stop", args->stop, "stop before this string (repeatable)")->group(group::kSampling);
  cmd->add_option("--json-schema", args->json_schema,
                  "structured output: generate only JSON that validates against this JSON Schema (text); '{}' is any "
                  "JSON value, '{\"type\": \"object\"}' any object")
      ->group(group::kSampling);
  cmd->add_option("--json-schema-file", args->json_schema_file, "--json-schema, read from a file")
      ->group(group::kSampling);

  add_spec_options(*cmd, args->spec);

  cmd->option_defaults()->group(group::kOutput);
  cmd->add_flag("--json", args->json, "print one JSON object (ids, text, stats) instead of streaming text");
  cmd->add_option("--logprobs", args->logprobs,
                  "with --json: each token's log-probability and its K most likely alternatives (0..20; "
                  "greedy: the raw row's log-softmax, sampled: the distribution drawn from)")
      ->check(CLI::Range(0, int(kMaxTopLogprobs)));
  cmd->add_flag("-q,--quiet", args->quiet, "print only the statistics line");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace microspec::cli
