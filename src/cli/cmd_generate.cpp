// `microspec generate`: text generation from a prompt, printed as it is produced, then one line of
// statistics on stderr.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/commands.h"
#include "cli/common.h"
#include "engine/generator.h"
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
  int32_t n_predict = 128;
  float temperature = 0.0f;
  int top_k = 40;
  float top_p = 0.95f;
  int64_t seed = -1;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool json = false;
  bool quiet = false;
};

void run_generate(const GenerateArgs& a) {
  int sources = !a.prompt.empty() + !a.prompt_file.empty() + !a.prompt_ids.empty();
  if (sources != 1) throw Error("give exactly one of -p/--prompt, -f/--file, --prompt-ids");
  if (!a.prompt_ids.empty() && a.chat) throw Error("--chat applies to text prompts, not --prompt-ids");
  if (a.n_predict < 0) throw Error("-n must be >= 0");

  LoadedModel m = load_model(a.model);
  const Tokenizer& tok = *m.tokenizer;
  std::vector<int32_t> prompt_ids;
  if (!a.prompt_ids.empty()) {
    prompt_ids = parse_token_ids(a.prompt_ids);
  } else {
    std::string text = a.prompt_file.empty() ? a.prompt : read_file_bytes(a.prompt_file);
    if (a.chat) {
      std::vector<ChatMessage> messages;
      if (!a.system.empty()) messages.push_back({"system", a.system});
      messages.push_back({"user", text});
      const ChatFormat fmt = detect_chat_format(*m.file, tok);
      prompt_ids = tok.encode(apply_chat_template(fmt, messages, true, default_system_prompt(*m.file)),
                              tok.add_bos_default(), true);
    } else {
      prompt_ids = tok.encode(text, tok.add_bos_default(), false);
    }
  }
  for (int32_t id : prompt_ids)
    if (id < 0 || id >= tok.n_vocab()) throw Error("prompt token id " + std::to_string(id) + " is outside the vocabulary");

  GenerateParams params;
  params.max_new_tokens = a.n_predict;
  params.sampling.temperature = a.temperature;
  params.sampling.top_k = a.top_k;
  params.sampling.top_p = a.top_p;
  params.sampling.seed = a.seed >= 0 ? static_cast<uint64_t>(a.seed) : std::random_device{}();
  params.stop_strings = a.stop;
  params.ignore_eos = a.ignore_eos;

  Generator gen(*m.model, tok, a.model.n_ctx);
  const bool stream = !a.json && !a.quiet;
  GenerateResult r = gen.generate(prompt_ids, params, [&](std::string_view text) {
    if (stream) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  });
  if (stream) std::fputc('\n', stdout);

  const double prefill_tps = r.prefill_seconds > 0 ? r.prompt_tokens / r.prefill_seconds : 0.0;
  const double decode_tps = r.decode_seconds > 0 ? r.decode_forwards / r.decode_seconds : 0.0;
  const double peak_mib = peak_memory_bytes() / (1024.0 * 1024.0);
  std::fprintf(stderr,
               "prompt tokens: %d | prefill: %.1f tok/s | decode: %.1f tok/s (%zu tokens) | peak memory: %.0f MiB\n",
               r.prompt_tokens, prefill_tps, decode_tps, r.tokens.size(), peak_mib);
  if (a.json) {
    nlohmann::json j;
    j["prompt_tokens"] = r.prompt_tokens;
    j["prompt_ids"] = prompt_ids;
    j["tokens"] = r.tokens;
    j["text"] = r.text;
    j["finish_reason"] = finish_reason_name(r.finish);
    j["prefill_tokens_per_second"] = prefill_tps;
    j["decode_tokens_per_second"] = decode_tps;
    j["prefill_seconds"] = r.prefill_seconds;
    j["decode_seconds"] = r.decode_seconds;
    j["decode_lm_head_seconds"] = r.decode_lm_head_seconds;
    j["peak_memory_bytes"] = peak_memory_bytes();
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a prompt");
  args->model.add_to(*cmd);
  cmd->add_option("-p,--prompt", args->prompt, "prompt text");
  cmd->add_option("-f,--file", args->prompt_file, "read the prompt from a file (bytes kept as they are)");
  cmd->add_option("--prompt-ids", args->prompt_ids, "prompt as token ids (\"1 2 3\"), no tokenization");
  cmd->add_flag("--chat", args->chat, "wrap the prompt in the model's chat format as a user turn");
  cmd->add_option("-s,--system", args->system, "system message for --chat");
  cmd->add_option("-n,--n-predict", args->n_predict, "most tokens to generate")->capture_default_str();
  cmd->add_option("--temp", args->temperature, "temperature; 0 = greedy")->capture_default_str()->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", args->top_k, "top-k filter; 0 = off")->capture_default_str()->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--top-p", args->top_p, "top-p (nucleus) filter; 1 = off")->capture_default_str()->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", args->seed, "RNG seed; -1 = random")->capture_default_str();
  cmd->add_option("--stop", args->stop, "stop before this string (repeatable)");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "keep generating past end-of-generation tokens");
  cmd->add_flag("--json", args->json, "print one JSON object (ids, text, stats) instead of streaming text");
  cmd->add_flag("-q,--quiet", args->quiet, "print only the statistics line");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace microspec::cli
