#include "cli/common.h"

#include <cctype>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <thread>

#include "checkpoint/hf_folder.h"
#include "model/model_file.h"
#include "speculative/settings.h"
#include "util/error.h"
#include "util/log.h"

namespace microspec::cli {

CLI::Option* add_model_path_option(CLI::App& cmd, std::string& path, const char* help) {
  return cmd.add_option("-m,--model", path, help)->required()->group(group::kModel);
}

CLI::Option* add_chat_template_option(CLI::App& cmd, std::string& choice) {
  return cmd
      .add_option(
          "--chat-template", choice,
          "how chat messages become a prompt: a Jinja chat template file, a built-in format (gemma, chatml, "
          "llama3) or 'model' (the model's own template); default: the built-in format that fits the model, "
          "else its own template")
      ->group(group::kInput);
}

void ModelArgs::add_to(CLI::App& cmd, int32_t default_batch) {
  n_batch = default_batch;
  CLI::OptionDefaults before = *cmd.option_defaults();
  cmd.option_defaults()->group(group::kModel);
  add_model_path_option(cmd, model_path, "GGUF model file or Hugging Face model folder");
  cmd.add_option("--hf-type", hf_type,
                 "Hugging Face folder: store the weights as this type on load (f32, f16, bf16, q8_0, q4_k, ...; "
                 "default: the checkpoint's own)");
  cmd.add_option("-t,--threads", threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  cmd.add_option("-c,--ctx-size", n_ctx, "context size in tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  cmd.add_option("-b,--batch-size", n_batch, "most tokens per forward pass (prefill chunk)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--kernels", kernels, "kernel table: auto, reference, avx2, avx512, amx")->capture_default_str();
  cmd.add_flag_callback(
      "--no-repack", [this] { repack = false; },
      "multiply the mapped file's weights as stored: no interleaved copy of the Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K "
      "and Q6_K matrices for the AVX2, AVX-512 and AMX kernels (saves their size in memory; the same results, slower)");
  *cmd.option_defaults() = before;
}

namespace {

// llama.cpp's names for the settings it has too: the option's first name, the table's own flag
// (also bench's override key and JSON key) kept as an alias.
const std::vector<std::pair<std::string, std::string>> kLlamaSpecNames = {{"draft-model", "--model-draft"}};

std::string spec_option_names(const std::string& flag) {
  for (const auto& [table_flag, llama_name] : kLlamaSpecNames)
    if (table_flag == flag) return llama_name + ",--" + flag;
  return "--" + flag;
}

}  // namespace

void add_spec_options(CLI::App& cmd, SpecConfig& c) {
  // One option per row of the settings table: the table parses and range-checks the value.
  for (const SpecSetting& s : spec_settings()) {
    const std::string flag = s.flag;
    auto set = [&c, &s, flag](const std::string& value) {
      try {
        s.set(c, value);
      } catch (const Error& e) {
        throw CLI::ValidationError("--" + flag, e.what());
      }
    };
    if (s.kind == SpecSetting::Kind::Switch) {
      // A switch that defaults to on is turned off with --no-FLAG, one that defaults to off on with --FLAG.
      const bool on_by_default = s.get(SpecConfig{}).get<bool>();
      cmd.add_flag_callback((on_by_default ? "--no-" : "--") + flag,
                            [set, on_by_default] { set(on_by_default ? "false" : "true"); }, s.help)
          ->group(group::kSpeculation);
      continue;
    }
    CLI::Option* opt = cmd.add_option_function<std::string>(spec_option_names(flag), set, s.help);
    opt->group(group::kSpeculation);
    if (s.kind != SpecSetting::Kind::Text) opt->default_str(s.default_text());
  }
}

void add_sampling_options(CLI::App& cmd, const SamplingFlags& f) {
  auto in_group = [](CLI::Option* opt) { return opt->group(group::kSampling)->capture_default_str(); };
  in_group(cmd.add_option("-n,--n-predict,--max-new-tokens", f.n_predict, "most tokens to generate"))
      ->check(CLI::Range(f.min_n_predict, int32_t(1) << 24));
  in_group(cmd.add_option("--temp", f.temperature, "temperature; 0 = greedy"))->check(CLI::Range(0.0, 100.0));
  in_group(cmd.add_option("--top-k", f.top_k, "top-k filter; 0 = off"))->check(CLI::Range(0, 1 << 30));
  in_group(cmd.add_option("--top-p", f.top_p, "top-p (nucleus) filter; 1 = off"))->check(CLI::Range(0.0, 1.0));
  in_group(cmd.add_option("-s,--seed", f.seed, f.seed_help))->check(CLI::Range(f.min_seed, INT64_MAX));
  cmd.add_flag("--ignore-eos", f.ignore_eos, "keep generating past end-of-generation tokens")->group(group::kSampling);
}

void add_penalty_options(CLI::App& cmd, const PenaltyFlags& f) {
  auto in_group = [](CLI::Option* opt) { return opt->group(group::kSampling)->capture_default_str(); };
  in_group(cmd.add_option("--repeat-penalty", f.penalties.repeat_penalty,
                          "divide positive (multiply negative) logits of tokens in the last --repeat-last-n "
                          "context tokens; 1 = off"))
      ->check(CLI::PositiveNumber);
  in_group(cmd.add_option("--repeat-last-n", f.penalties.repeat_last_n,
                          "context tokens the repeat penalty looks at; -1 = the whole context, 0 = off"))
      ->check(CLI::Range(-1, INT32_MAX));
  in_group(cmd.add_option("--presence-penalty", f.penalties.presence_penalty,
                          "subtracted from the logit of every token generated before; 0 = off"))
      ->check(CLI::Range(-2.0, 2.0));
  in_group(cmd.add_option("--frequency-penalty", f.penalties.frequency_penalty,
                          "subtracted from a token's logit once per time it was generated; 0 = off"))
      ->check(CLI::Range(-2.0, 2.0));
  in_group(cmd.add_option("--min-p", f.min_p,
                          "keep tokens with probability >= min-p x the best token's (after top-p); 0 = off"))
      ->check(CLI::Range(0.0, 1.0));
  cmd.add_option("--logit-bias", f.logit_bias,
                 "TOKEN_ID(+/-)BIAS added to that token's logit, e.g. 15043+1 or 15043-1 (repeatable)")
      ->group(group::kSampling);
}

std::vector<std::pair<int32_t, float>> parse_logit_bias_flags(const std::vector<std::string>& values) {
  std::vector<std::pair<int32_t, float>> out;
  for (const std::string& v : values) {
    const size_t sign = v.find_first_of("+-", 1);
    size_t id_end = 0, bias_end = 0;
    long id = -1;
    float bias = 0.0f;
    try {
      if (sign != std::string::npos && sign + 1 < v.size()) {
        id = std::stol(v.substr(0, sign), &id_end);
        bias = std::stof(v.substr(sign + 1), &bias_end);
      }
    } catch (const std::exception&) {
      id_end = 0;
    }
    if (sign == std::string::npos || id_end != sign || bias_end != v.size() - sign - 1 || id < 0 ||
        id > INT32_MAX || !std::isdigit(static_cast<unsigned char>(v[0])))
      throw Error("--logit-bias: expected TOKEN_ID(+/-)BIAS (e.g. 15043+1), got '" + v + "'");
    out.emplace_back(int32_t(id), v[sign] == '-' ? -bias : bias);
  }
  return out;
}

void add_log_verbosity_option(CLI::App& cmd) {
  cmd.add_option_function<int>(
         "--log-verbosity",
         [](int verbosity) {
           try {
             log::set_verbosity(verbosity);
           } catch (const Error& e) {
             throw CLI::ValidationError("--log-verbosity", e.what());
           }
         },
         "log levels printed: 0 none, 1 errors, 2 and warnings, 3 and information, 4 and debug. Every log line "
         "reads '2026-12-07T01:02:03.456Z I text': UTC time, level (E, W, I, D), text; a request's lines start "
         "with its id")
      ->default_str(std::to_string(log::kDefaultVerbosity))
      ->group(group::kOther);
}

LoadedModel open_model(const ModelArgs& args) {
  LoadedModel m;
  HfFolderOptions hf;
  if (!args.hf_type.empty()) hf.weight_type = parse_weight_type(args.hf_type);
  m.file = open_model_file(args.model_path, hf);
  m.tokenizer = Tokenizer::from_gguf(*m.file);
  return m;
}

LoadedModel load_model(const ModelArgs& args) {
  LoadedModel m = open_model(args);
  ModelOptions opt;
  opt.n_threads =
      args.threads > 0 ? args.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  opt.n_batch = args.n_batch;
  opt.kernels = args.kernels;
  opt.repack = args.repack;
  m.model = Model::load(*m.file, opt);
  return m;
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
