#include "bench/coverage.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench/dataset.h"
#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "tokenizer/chat.h"
#include "util/error.h"
#include "util/file.h"
#include "vocab/candidate_stream.h"
#include "vocab/freq_file.h"

namespace microspec::bench {
namespace {

struct Tally {
  int64_t steps = 0, covered = 0;
  double active_sum = 0.0;
};

struct Prompt {
  std::string category;
  std::vector<int32_t> ids;
};

const char* kPlotScript =
    R"PY(# Written by `microspec coverage`: coverage.csv -> coverage.png (needs matplotlib).
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

src, dst = sys.argv[1], sys.argv[2]
rows = [r for r in csv.DictReader(open(src, encoding="utf-8")) if r["category"] == "all"]
fig, ax = plt.subplots(figsize=(6.4, 4.2))
static = sorted((float(r["mean_active"]), 100 * float(r["coverage"])) for r in rows if r["kind"] == "static")
if static:
    ax.plot([s for s, _ in static], [c for _, c in static], "o-", label="static top-K (frequency file)")
dyn = [(float(r["mean_active"]), 100 * float(r["coverage"]), r["param"]) for r in rows if r["kind"] == "dynamic"]
if dyn:
    ax.scatter([s for s, _, _ in dyn], [c for _, c, _ in dyn], marker="*", s=120, color="C3",
               label="dynamic window (MicroSpec)", zorder=3)
    # Windows that never fill give the same point: one label for each distinct point.
    labels = {}
    for s, c, p in dyn:
        labels.setdefault((round(s), round(c, 2)), []).append(p)
    for (s, c), ps in labels.items():
        ax.annotate("W=" + ",".join(ps), (s, c), textcoords="offset points", xytext=(6, -12), fontsize=8)
ax.set_xscale("log", base=2)
ax.set_xlabel("draft vocabulary size (mean active rows)")
ax.set_ylabel("coverage of the target's greedy token (%)")
ax.set_title(sys.argv[3] if len(sys.argv) > 3 else "draft vocabulary coverage")
ax.grid(True, which="both", alpha=0.3)
ax.legend(loc="lower right")
fig.tight_layout()
fig.savefig(dst, dpi=120)
)PY";

std::vector<Prompt> load_prompts(const CoverageOptions& a, const GgufFile& file, const Tokenizer& tok) {
  const std::string data = read_file_bytes(a.dataset);
  std::map<std::string, int32_t> taken;
  std::vector<Prompt> out;
  const ChatStyle style = chat_style_for(file, tok, a.chat_template);
  size_t at = 0, line_no = 0;
  while (at < data.size()) {
    size_t end = data.find('\n', at);
    if (end == std::string::npos) end = data.size();
    ++line_no;
    const std::string line = data.substr(at, end - at);
    at = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(a.dataset + ":" + std::to_string(line_no) + ": not JSON (" + e.what() + ")");
    }
    std::vector<std::string> turns;
    try {
      turns = row_turns(j);
    } catch (const Error& e) {
      throw Error(a.dataset + ":" + std::to_string(line_no) + ": " + e.what());
    }
    if (turns.empty())
      throw Error(a.dataset + ":" + std::to_string(line_no) +
                  ": expected {\"turns\": [text, ...]} or {\"prompt\": text}");
    const std::string& text = turns[0];
    const std::string category = j.contains("category") && j["category"].is_string()
                                     ? j["category"].get<std::string>()
                                     : "all-prompts";
    if (taken[category] >= a.per_category) continue;
    ++taken[category];
    const std::vector<ChatMessage> messages = {{"user", text}};
    out.push_back({category, encode_chat(tok, style, messages)});
  }
  if (out.empty()) throw Error(a.dataset + ": no prompts");
  return out;
}

void progress(bool quiet, int64_t done, int64_t total, size_t prompt, size_t prompts) {
  if (quiet) return;
  const int width = 30, filled = total ? int(width * done / total) : width;
  std::fprintf(stderr, "\rcoverage [%s%s] %3d%% prompt %zu/%zu", std::string(size_t(filled), '#').c_str(),
               std::string(size_t(width - filled), '.').c_str(), total ? int(100 * done / total) : 100,
               prompt, prompts);
  std::fflush(stderr);
}

}  // namespace

void run_coverage(const CoverageOptions& a, const GgufFile& file, Model& model, const Tokenizer& tokenizer) {
  const int32_t V = model.config().n_vocab;
  const std::vector<Prompt> prompts = load_prompts(a, file, tokenizer);

  // Static sets: rank of every id (EOG tokens are always in, as --draft-vocab freq adds them).
  std::vector<int32_t> rank(size_t(V), V);
  const TokenFrequencies freq = read_freq_file(a.freq_file, V);
  for (size_t i = 0; i < freq.ids.size(); ++i) rank[size_t(freq.ids[i])] = int32_t(i);
  // The ids --draft-vocab freq adds to its set (sorted; EOS is among them).
  const std::vector<int32_t>& eog = tokenizer.end_of_generation_ids();
  std::vector<int32_t> static_size;
  for (int32_t k : a.static_sizes) {
    int32_t extra = 0;
    for (int32_t e : eog) extra += rank[size_t(e)] >= k;
    static_size.push_back(std::min(k, V) + extra);
  }
  auto is_eog = [&](int32_t t) { return std::binary_search(eog.begin(), eog.end(), t); };

  std::vector<CandidateStream> streams;
  for (int32_t w : a.windows) {
    CandidateStreamParams p;
    p.w_max = w;
    p.k_pre = a.kpre;
    p.k_ver = a.kver;
    streams.emplace_back(V, p);
  }
  const size_t n_static = a.static_sizes.size(), n_dyn = a.windows.size();
  std::map<std::string, std::vector<Tally>> tallies;  // category -> [static..., dynamic...]

  // Plain greedy decoding through the one generation path; the observer sees the prompt's top ids
  // and every token with the logits it was chosen from, before it is emitted.
  Generator gen(model, tokenizer, a.n_ctx);
  Decoder decoder(SpecConfig{.mode = SpecMode::None}, file, gen, tokenizer);  // plain: it observes the target
  GenerateParams params;
  params.max_new_tokens = a.max_new_tokens;
  std::vector<int32_t> emitted(1);
  const int64_t total = int64_t(prompts.size()) * a.max_new_tokens;
  int64_t done = 0;
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    const Prompt& p = prompts[pi];
    if (int64_t(p.ids.size()) + a.max_new_tokens + 1 > a.n_ctx)
      throw Error("coverage: a prompt of " + std::to_string(p.ids.size()) + " tokens plus " +
                  std::to_string(a.max_new_tokens) + " new ones does not fit the context (raise -c)");
    std::vector<Tally>& tally = tallies[p.category];
    tally.resize(n_static + n_dyn);
    int32_t step = 0;
    DecodeObserver observer;
    observer.prompt_top_k = std::max(a.kpre, 1);
    observer.on_prompt = [&](const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) {
      for (CandidateStream& s : streams) s.begin(prompt, prompt_top, observer.prompt_top_k);
    };
    // Token x was chosen from `logits`: is it in each vocabulary as it stands before this step?
    observer.on_token = [&](int32_t x, const float* logits) {
      for (size_t i = 0; i < n_static; ++i) {
        tally[i].steps++;
        tally[i].covered += rank[size_t(x)] < a.static_sizes[i] || is_eog(x);
        tally[i].active_sum += static_size[i];
      }
      for (size_t i = 0; i < n_dyn; ++i) {
        Tally& t = tally[n_static + i];
        t.steps++;
        t.covered += streams[i].window().contains(x);
        t.active_sum += streams[i].window().active_size();
        emitted[0] = x;
        const int32_t row0 = 0;
        streams[i].step(emitted, logits, std::span<const int32_t>(&row0, 1));
      }
      ++done;
      if (step++ % 8 == 0) progress(a.quiet, done, total, pi + 1, prompts.size());
    };
    decoder.generate(p.ids, params, nullptr, &observer);
    done = int64_t(pi + 1) * a.max_new_tokens;
    progress(a.quiet, done, total, pi + 1, prompts.size());
  }
  if (!a.quiet) std::fprintf(stderr, "\n");

  std::filesystem::create_directories(a.output);
  const std::string csv_path = (std::filesystem::path(a.output) / "coverage.csv").string();
  std::ofstream csv(csv_path);
  if (!csv) throw Error(csv_path + ": cannot write");
  csv << "kind,param,category,steps,covered,coverage,mean_active\n";
  std::vector<Tally> all(n_static + n_dyn);
  auto write_rows = [&](const std::string& cat, const std::vector<Tally>& t) {
    for (size_t i = 0; i < n_static + n_dyn; ++i) {
      const bool st = i < n_static;
      const int32_t param = st ? a.static_sizes[i] : a.windows[i - n_static];
      const double cov = t[i].steps ? double(t[i].covered) / t[i].steps : 0.0;
      const double act = t[i].steps ? t[i].active_sum / t[i].steps : 0.0;
      csv << (st ? "static" : "dynamic") << ',' << param << ',' << cat << ',' << t[i].steps << ','
          << t[i].covered << ',' << cov << ',' << act << '\n';
    }
  };
  for (const auto& [cat, t] : tallies) {
    write_rows(cat, t);
    for (size_t i = 0; i < t.size(); ++i) {
      all[i].steps += t[i].steps;
      all[i].covered += t[i].covered;
      all[i].active_sum += t[i].active_sum;
    }
  }
  write_rows("all", all);
  csv.close();
  if (!csv) throw Error(csv_path + ": write failed");
  std::printf("%-8s %7s %9s %11s\n", "kind", "param", "coverage", "mean size");
  for (size_t i = 0; i < all.size(); ++i) {
    const bool st = i < n_static;
    std::printf("%-8s %7d %8.2f%% %11.0f\n", st ? "static" : "dynamic",
                st ? a.static_sizes[i] : a.windows[i - n_static],
                all[i].steps ? 100.0 * all[i].covered / all[i].steps : 0.0,
                all[i].steps ? all[i].active_sum / all[i].steps : 0.0);
  }
  std::printf("wrote %s\n", csv_path.c_str());
  if (a.no_plot) return;
  const std::filesystem::path script = std::filesystem::path(a.output) / "plot_coverage.py";
  const std::filesystem::path png = std::filesystem::path(a.output) / "coverage.png";
  {
    std::ofstream f(script);
    f << kPlotScript;
    if (!f) throw Error(script.string() + ": cannot write");
  }
  auto quote = [](const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  const std::string title = std::filesystem::path(file.name()).filename().string() + ", " +
                            std::to_string(prompts.size()) + " prompts, " + std::to_string(all[0].steps) +
                            " steps";
  const std::string cmd = "python3 " + quote(script.string()) + " " + quote(csv_path) + " " +
                          quote(png.string()) + " " + quote(title);
  if (std::system(cmd.c_str()) != 0)
    throw Error("coverage: plotting failed (" + cmd +
                "); is matplotlib installed? (--no-plots skips the plot)");
  std::printf("wrote %s\n", png.string().c_str());
}

}  // namespace microspec::bench
