#include "bench/harness.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "bench/dataset.h"
#include "bench/metrics.h"
#include "bench/runner.h"
#include "util/error.h"
#include "util/file.h"

namespace microspec::bench {

namespace {

namespace fs = std::filesystem;

// The command line as typed (for the report), from /proc/self/cmdline.
std::string command_line() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::string out;
  size_t start = 0;
  while (start < raw.size()) {
    size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    std::string arg = raw.substr(start, end - start);
    if (arg.find_first_of(" \t\"'$") != std::string::npos) arg = "'" + arg + "'";
    out += (out.empty() ? "" : " ") + arg;
    start = end + 1;
  }
  return out;
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

// Where benchmarks/*.py live: --scripts-dir, else benchmarks/ next to the build folder holding this
// binary, or share/microspec/benchmarks/ beside the bin/ of an installed one (cmake --install).
fs::path scripts_dir(const BenchOptions& a) {
  if (!a.scripts_dir.empty()) return a.scripts_dir;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec)
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path())
      for (const fs::path& scripts : {dir / "benchmarks", dir / "share" / "microspec" / "benchmarks"})
        if (fs::exists(scripts / "plot_report.py")) return scripts;
  throw Error("cannot find benchmarks/plot_report.py above " + exe.string() +
              ": pass --scripts-dir DIR (or --no-plots without --peers)");
}

// Runs argv (no shell), its output going to our stderr. Returns its exit status; 127 when it
// could not be started.
int run_process(const std::vector<std::string>& argv) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) throw Error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    dup2(STDERR_FILENO, STDOUT_FILENO);
    std::vector<char*> args;
    for (const std::string& s : argv) args.push_back(const_cast<char*>(s.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw Error(std::string("waitpid: ") + std::strerror(errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f) throw Error(path.string() + ": cannot write");
}

// The coverage CSV as a Markdown table: the rows of category "all" where the CSV has categories
// (`microspec coverage` writes one row per vocabulary and category), else every row.
std::string coverage_markdown(const std::string& path) {
  std::istringstream in(read_file_bytes(path));
  std::string line;
  std::vector<std::vector<std::string>> rows;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    rows.push_back(std::move(cells));
  }
  if (rows.size() < 2) throw Error(path + ": expected a header row and at least one data row");
  const auto& head = rows.front();
  const auto cat = std::find(head.begin(), head.end(), "category");
  const size_t cat_col = static_cast<size_t>(cat - head.begin());
  std::string md = "\n### Draft-vocabulary coverage (" + fs::path(path).filename().string() + ")\n\n|";
  for (const std::string& h : head) md += " " + h + " |";
  md += "\n|";
  for (size_t i = 0; i < head.size(); ++i) md += "---|";
  md += "\n";
  for (size_t r = 1; r < rows.size(); ++r) {
    if (rows[r].size() != head.size())
      throw Error(path + ": row " + std::to_string(r + 1) + " has " + std::to_string(rows[r].size()) +
                  " cells, the header " + std::to_string(head.size()));
    if (cat != head.end() && rows[r][cat_col] != "all") continue;
    md += "|";
    for (const std::string& c : rows[r]) md += " " + c + " |";
    md += "\n";
  }
  return md;
}

// The live progress line: rewritten in place on a terminal, one line per run otherwise.
void print_progress(const Progress& p) {
  static const bool tty = isatty(STDERR_FILENO);
  const int eta = static_cast<int>(p.eta_seconds + 0.5);
  std::fprintf(stderr, "%s[bench] prompt %d/%d  %-28s %7.1f tok/s so far  run %d/%d  ETA %d:%02d%s",
               tty ? "\r\033[K" : "", p.question + 1, p.questions, p.method.c_str(),
               p.method_tokens_per_second, p.runs_done, p.runs_total, eta / 60, eta % 60, tty ? "" : "\n");
  std::fflush(stderr);
}

// Writes the job for benchmarks/peer_llama_cpp.py: the same questions, rendered through our chat template
// with placeholders where the peer puts its own earlier answers.
nlohmann::json peer_job(const BenchOptions& a, const BenchRunner& runner,
                        const std::vector<BenchQuestion>& qs, int n_threads) {
  nlohmann::json questions = nlohmann::json::array();
  for (size_t i = 0; i < qs.size(); ++i) {
    nlohmann::json turns = nlohmann::json::array();
    for (size_t t = 0; t < qs[i].turns.size(); ++t)
      turns.push_back(runner.render_with_placeholders(qs[i], t));
    questions.push_back(
        {{"index", i}, {"question_id", qs[i].id}, {"category", qs[i].category}, {"turns", turns}});
  }
  nlohmann::json placeholders = nlohmann::json::array();
  size_t max_turns = 0;
  for (const BenchQuestion& q : qs) max_turns = std::max(max_turns, q.turns.size());
  for (size_t i = 0; i < max_turns; ++i) placeholders.push_back(BenchRunner::placeholder(i));
  return {{"model", a.model_path},
          {"n_ctx", a.n_ctx},
          {"n_batch", a.n_batch},
          {"threads", n_threads},
          {"max_new_tokens", a.max_new_tokens},
          {"ignore_eos", a.ignore_eos},
          {"temperature", a.temperature},
          {"top_k", a.top_k},
          {"top_p", a.top_p},
          {"seed", a.seed},
          {"repeats", a.repeats},
          {"trim_answers", runner.trims_contents()},
          {"placeholders", placeholders},
          {"questions", questions}};
}

// --- run_bench's parts, in the order it runs them ----------------------------------------------

// The options with --smoke's sizes applied, checked before anything is read or run.
BenchOptions checked_options(BenchOptions a) {
  if (a.smoke) {
    a.per_category = 2;
    a.max_new_tokens = 32;
  }
  if (a.max_new_tokens < 1) throw Error("--max-new-tokens must be >= 1");
  if (a.sweep.size() && a.ablation) throw Error("give --sweep or --ablation, not both");
  for (const std::string& p : a.peers)
    if (p != "llama.cpp") throw Error("--peers: unknown peer '" + p + "' (peers: llama.cpp)");
  if (const char* field = first_active_penalty(a.penalties, a.min_p); field && !a.peers.empty())
    throw Error(
        std::string("--peers: the peers run without penalties or filters, so their outputs and speeds "
                    "would not compare; drop ") +
        field + " or --peers");
  return a;
}

bool is_greedy(const BenchOptions& a) {
  return a.temperature <= 0.0f;
}

// The methods to run: ar always first (speedups and the output check are against it), then those
// asked for, expanded by --sweep or --ablation.
std::vector<MethodSpec> bench_methods(const BenchOptions& a) {
  std::string list =
      a.methods.empty() ? (a.ablation ? "ar,dynamic" : "ar,full,dynamic,auto") : join(a.methods, ",");
  std::vector<MethodSpec> methods = parse_methods(list, a.spec);
  if (methods.empty() || methods.front().info.label != "ar") {
    auto it = std::find_if(methods.begin(), methods.end(),
                           [](const MethodSpec& m) { return m.info.label == "ar"; });
    MethodSpec ar = it != methods.end() ? *it : parse_methods("ar", a.spec).front();
    if (it != methods.end())
      methods.erase(it);
    else
      std::fprintf(stderr,
                   "[bench] adding method ar: speedups and the output check are measured against it\n");
    methods.insert(methods.begin(), ar);
  }
  if (!a.sweep.empty()) {
    const size_t eq = a.sweep.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error("--sweep: expected key=v1,v2,... got '" + a.sweep + "'");
    return sweep_methods(methods, a.sweep.substr(0, eq), split_list(a.sweep.substr(eq + 1)));
  }
  if (a.ablation) return ablation_methods(methods);
  return methods;
}

std::vector<BenchQuestion> bench_questions(const BenchOptions& a) {
  DatasetOptions dopt;
  dopt.categories = split_list(a.categories);
  dopt.per_category = a.per_category;
  return load_questions(a.dataset, dopt);
}

fs::path output_folder(const std::string& output) {
  const fs::path out_dir = output;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec || !fs::is_directory(out_dir)) throw Error(output + ": cannot create the output folder");
  return out_dir;
}

// What our methods produced: every prompt's record, the methods, and the wall time of the run.
struct OwnRun {
  std::vector<PromptRecord> records;
  std::vector<MethodInfo> infos;
  double run_seconds = 0.0;
};

// Runs every method on every question, methods interleaved per prompt, each record written to
// records_out as it completes.
OwnRun run_own_methods(const BenchOptions& a, BenchRunner& runner, const std::vector<MethodSpec>& methods,
                       const std::vector<BenchQuestion>& questions, std::ofstream& records_out) {
  RunOptions ro;
  ro.params.max_new_tokens = a.max_new_tokens;
  ro.params.ignore_eos = a.ignore_eos;
  ro.params.sampling.temperature = a.temperature;
  ro.params.sampling.top_k = a.top_k;
  ro.params.sampling.top_p = a.top_p;
  ro.params.sampling.seed = static_cast<uint64_t>(a.seed);
  ro.params.sampling.min_p = a.min_p;
  ro.params.penalties = a.penalties;
  ro.repeats = a.repeats;

  std::vector<std::string> labels;
  for (const MethodSpec& s : methods) labels.push_back(s.info.label);
  std::fprintf(
      stderr,
      "[bench] %zu questions x %zu methods (%s), up to %d new tokens, %s; methods interleaved per prompt\n",
      questions.size(), methods.size(), join(labels, ", ").c_str(), a.max_new_tokens,
      is_greedy(a) ? "greedy" : "sampling");
  OwnRun run;
  const auto started = std::chrono::steady_clock::now();
  run.records = runner.run(questions, ro, print_progress, [&](const PromptRecord& r) {
    records_out << to_json(r).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    records_out.flush();
  });
  if (isatty(STDERR_FILENO)) std::fputc('\n', stderr);
  run.run_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  run.infos = runner.methods();
  return run;
}

// The peer's records (peer_out, JSON lines) appended to run's records and to records_out, each new
// method label to run's methods.
void read_peer_records(const fs::path& peer_out, OwnRun& run, std::ofstream& records_out) {
  std::ifstream in(peer_out);
  std::string line;
  std::set<std::string> labels;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) throw Error(peer_out.string() + ": not JSON lines");
    PromptRecord r = record_from_json(j);
    if (labels.insert(r.method).second) {
      MethodInfo info;
      info.label = r.method;
      info.base = "llama.cpp";
      info.peer = true;
      info.description = j.value("description", "llama.cpp via llama-cpp-python");
      run.infos.push_back(info);
    }
    run.records.push_back(std::move(r));
    records_out << line << "\n";
  }
}

// Peers run after ours, in their own process, on the same prompts; their records join run's.
// Returns why the last failed peer failed ("" when none did): a failed peer leaves microspec's own
// results intact, the report is written without its rows and the command fails at the end.
std::string run_peers(const BenchOptions& a, const BenchRunner& runner,
                      const std::vector<BenchQuestion>& questions, int n_threads, const fs::path& scripts,
                      const fs::path& out_dir, OwnRun& run, std::ofstream& records_out) {
  std::string peer_error;
  for (const std::string& peer : a.peers) {
    (void)peer;  // llama.cpp, the only one
    const fs::path job = out_dir / "peer_job.json", peer_out = out_dir / "peer_records.jsonl";
    write_text(job, peer_job(a, runner, questions, n_threads).dump(1));
    std::fprintf(stderr, "[bench] peer llama.cpp (benchmarks/peer_llama_cpp.py) on the same prompts\n");
    const int rc = run_process({a.python, (scripts / "peer_llama_cpp.py").string(), "--job", job.string(),
                                "--out", peer_out.string()});
    if (rc == 127) {
      peer_error = a.python + " could not be started (install Python 3 or pass --python)";
      continue;
    }
    if (rc != 0) {
      peer_error = "benchmarks/peer_llama_cpp.py failed (exit status " + std::to_string(rc) +
                   "); the report has no peer rows";
      continue;
    }
    read_peer_records(peer_out, run, records_out);
  }
  return peer_error;
}

// How the run was made, for summary.json's "run" and the report's header line.
nlohmann::json run_metadata(const BenchOptions& a, const std::vector<BenchQuestion>& questions,
                            const std::vector<std::string>& categories, int n_threads, double run_seconds) {
  return {{"command", command_line()},
          {"date", now_utc()},
          {"machine",
           cpu_model_name() + ", " + std::to_string(std::thread::hardware_concurrency()) + " hardware threads"},
          {"threads", n_threads},
          {"model", a.model_path},
          {"dataset", a.dataset},
          {"questions", questions.size()},
          {"categories", categories},
          {"per_category", a.per_category},
          {"max_new_tokens", a.max_new_tokens},
          {"temperature", a.temperature},
          {"min_p", a.min_p},
          {"repeat_penalty", a.penalties.repeat_penalty},
          {"repeat_last_n", a.penalties.repeat_last_n},
          {"presence_penalty", a.penalties.presence_penalty},
          {"frequency_penalty", a.penalties.frequency_penalty},
          {"logit_bias", a.penalties.logit_bias},
          {"greedy", is_greedy(a)},
          {"repeats", a.repeats},
          {"ignore_eos", a.ignore_eos},
          {"run_seconds", run_seconds},
          {"peak_memory_per_prompt", reset_peak_memory()},
          {"study", a.sweep.empty() ? (a.ablation ? "ablation" : "") : a.sweep},
          {"interleaved", true}};
}

// summary.json: the summary, the run's metadata, whether every greedy output matched ar's, and the
// coverage CSV (copied beside it) when one was given.
void write_summary_json(const BenchOptions& a, const Summary& summary, const nlohmann::json& run,
                        const std::vector<Mismatch>& failing, const fs::path& out_dir) {
  nlohmann::json sj = to_json(summary);
  sj["run"] = run;
  sj["passed"] = failing.empty();
  if (!a.coverage_csv.empty()) {
    std::error_code ec;
    fs::copy_file(a.coverage_csv, out_dir / "coverage.csv", fs::copy_options::overwrite_existing, ec);
    if (ec) throw Error(a.coverage_csv + ": cannot copy to the output folder: " + ec.message());
    sj["coverage_csv"] = "coverage.csv";
  }
  write_text(out_dir / "summary.json",
             sj.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

// summary.md: the command, the run's header line, how methods were timed, the tables, the coverage
// table and the plots' names.
std::string report_markdown(const BenchOptions& a, const Summary& summary, const nlohmann::json& run,
                            const std::vector<std::string>& categories, const std::string& coverage_md) {
  const bool greedy = is_greedy(a);
  std::string md = "## microspec bench: " + fs::path(a.model_path).filename().string() + "\n\n";
  md += "`" + command_line() + "`\n\n";
  md += run["date"].get<std::string>() + "; " + run["machine"].get<std::string>() + "; " +
        std::to_string(run["threads"].get<int>()) + " threads; " +
        std::to_string(run["questions"].get<size_t>()) + " questions (" + join(categories, ", ") +
        "); up to " + std::to_string(a.max_new_tokens) + " new tokens; " +
        (greedy ? std::string("greedy") : "temperature " + std::to_string(a.temperature)) +
        (a.repeats > 1 ? "; median of " + std::to_string(a.repeats) + " repeats per prompt" : "") + ".\n";
  md +=
      "Methods run interleaved per prompt (prompt 1: every method, prompt 2: every method, ...) after one "
      "warm-up "
      "generation each, so drift in machine load affects them alike; peers run afterwards in their own "
      "process. "
      "tok/s = new tokens / wall time of the whole generation (prefill included, both turns for MT-bench), "
      "mean over prompts; speedup = that mean / ar's on the same prompts.\n\n";
  md += summary_markdown(summary, greedy);
  md += coverage_md;
  if (!a.no_plots) {
    md += "\nPlots: speedup_by_category.png, time_breakdown.png";
    if (!a.sweep.empty() || a.ablation) md += ", study.png";
    if (!a.coverage_csv.empty()) md += ", coverage.png";
    md += "\n";
  }
  return md;
}

// The plots (benchmarks/plot_report.py) from summary.json.
void plot_report(const BenchOptions& a, const fs::path& scripts, const fs::path& out_dir) {
  const int rc =
      run_process({a.python, (scripts / "plot_report.py").string(), (out_dir / "summary.json").string()});
  if (rc == 127)
    throw Error(a.python + " could not be started: install Python 3 with matplotlib, or pass --no-plots");
  if (rc != 0)
    throw Error("benchmarks/plot_report.py failed (exit status " + std::to_string(rc) +
                "): the tables are written; pass --no-plots to skip the plots");
}

// Fails the command for a failed peer or greedy outputs that differ from ar's.
void fail_on_errors(const std::string& peer_error, const std::vector<Mismatch>& failing,
                    const fs::path& out_dir) {
  std::string failure = peer_error;
  if (!failing.empty())
    failure += (failure.empty() ? "" : "; ") + std::to_string(failing.size()) +
               " prompt(s) differ from ar under greedy decoding (see " + (out_dir / "summary.md").string() +
               ")";
  if (!failure.empty()) throw Error(failure);
}

}  // namespace

void run_bench(BenchOptions options, const std::function<LoadedTarget()>& load_target) {
  const BenchOptions a = checked_options(std::move(options));
  // Read before the run, so that a bad CSV is reported before any time is spent.
  const std::string coverage_md = a.coverage_csv.empty() ? "" : coverage_markdown(a.coverage_csv);
  const std::vector<MethodSpec> methods = bench_methods(a);
  const std::vector<BenchQuestion> questions = bench_questions(a);
  const std::vector<std::string> categories = categories_of(questions);
  const fs::path out_dir = output_folder(a.output);
  const bool want_scripts = !a.no_plots || !a.peers.empty();
  const fs::path scripts = want_scripts ? scripts_dir(a) : fs::path();

  const LoadedTarget m = load_target();
  const int n_threads = m.model.pool().size();
  BenchRunner runner(m.file, m.model, m.tokenizer, a.n_ctx, methods,
                     chat_style_for(m.file, m.tokenizer, a.chat_template));
  std::ofstream records_out(out_dir / "records.jsonl", std::ios::binary);
  if (!records_out) throw Error((out_dir / "records.jsonl").string() + ": cannot write");
  OwnRun run = run_own_methods(a, runner, methods, questions, records_out);
  const std::string peer_error =
      run_peers(a, runner, questions, n_threads, scripts, out_dir, run, records_out);
  records_out.close();

  const Summary summary = summarize(run.infos, run.records, categories, "ar");
  const std::vector<Mismatch> failing = failing_mismatches(summary, is_greedy(a));
  const nlohmann::json run_info = run_metadata(a, questions, categories, n_threads, run.run_seconds);
  write_summary_json(a, summary, run_info, failing, out_dir);
  const std::string md = report_markdown(a, summary, run_info, categories, coverage_md);
  write_text(out_dir / "summary.md", md);
  std::fwrite(md.data(), 1, md.size(), stdout);
  std::fflush(stdout);
  if (!a.no_plots) plot_report(a, scripts, out_dir);
  fail_on_errors(peer_error, failing, out_dir);
}

}  // namespace microspec::bench
