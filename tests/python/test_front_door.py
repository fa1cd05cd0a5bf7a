"""The front door: what a new user, or a llama.cpp user, meets first.

- `microspec --version`: version, git commit, the kernel table `--kernels auto` picks, CUDA on/off;
- llama.cpp's flag names: -s/--seed, -sys/--system-prompt, --draft-p-min as a probability in [0, 1],
  -np/--parallel, -md/--model-draft, -lv/--log-verbosity, shown in grouped --help texts, and the
  same names across subcommands (--no-plots, -n/--n-predict);
- the server's log lines: UTC timestamp, level, the request's id on each of its lines;
- `cmake --install` into a temporary prefix gives a binary that works on its own;
- a CPU without AVX2 (emulated by qemu-user) gets a one-line error, not SIGILL.
"""
import json
import pathlib
import re
import shutil
import subprocess

import pytest

from repo_paths import BIN, MODELS
from server_helpers import ServerProcess, http, metrics

SMOL = MODELS["smollm2"]
PROMPT = "The capital of France is"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [EWID] ")


def run(*args, binary=BIN, timeout=300):
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def generate_json(*args, binary=BIN):
    p = run("generate", "-m", SMOL, "-n", 8, "--json", *args, binary=binary)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_version_names_version_commit_kernels_and_cuda():
    p = run("--version")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert re.fullmatch(r"microspec \d+\.\d+\.\d+", lines[0]), lines
    fields = dict(line.split(": ", 1) for line in lines[1:])
    assert re.fullmatch(r"[0-9a-f]{4,40}|unknown", fields["commit"]), fields
    assert fields["kernels"].split()[0] in ("avx2", "avx512", "amx"), fields
    assert fields["cuda"].split()[0] in ("on", "off"), fields


def test_chat_template_flag(tmp_path):
    """--chat-template model renders SmolLM2's own Jinja template: the same prompt ids as the
    built-in ChatML format; a template file is used as given; mistakes are errors."""
    chat = ["--chat", "-sys", "Be brief.", "-p", "Who are you?"]
    builtin = generate_json(*chat)
    own = generate_json(*chat, "--chat-template", "model")
    assert own["prompt_ids"] == builtin["prompt_ids"] and own["tokens"] == builtin["tokens"]
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    mine = generate_json(*chat, "--chat-template", plain)
    assert mine["prompt_ids"] == generate_json("-p", "system: Be brief.\nuser: Who are you?\nassistant:")["prompt_ids"]
    for args, message in [(["-p", "x", "--chat-template", "model"], "--chat"),
                          ([*chat, "--chat-template", tmp_path / "missing.jinja"], "cannot open"),
                          ([*chat, "--chat-template", "mistral"], "cannot open")]:
        p = run("generate", "-m", SMOL, "-n", 1, *args)
        assert p.returncode != 0 and message in p.stderr, p.stderr


def test_short_seed_is_the_seed():
    sampled = ["-p", PROMPT, "--temp", "1.5"]
    short, long = generate_json(*sampled, "-s", 7), generate_json(*sampled, "--seed", 7)
    assert short["seed"] == 7 and short["tokens"] == long["tokens"]


def test_system_prompt_short_and_long_names():
    chat = ["--chat", "-p", "Who are you?"]
    plain = generate_json(*chat)
    short = generate_json(*chat, "-sys", "You are a pirate.")
    long = generate_json(*chat, "--system-prompt", "You are a pirate.")
    assert short["prompt_ids"] == long["prompt_ids"] and short["tokens"] == long["tokens"]
    assert short["prompt_ids"] != plain["prompt_ids"], "the system turn replaces the model's default one"


@pytest.mark.parametrize("value", ["1.5", "-0.1", "20"])
def test_draft_p_min_outside_a_probability_is_refused(value):
    p = run("generate", "-m", SMOL, "-p", PROMPT, "-n", 4, "--spec", "self", "--draft-p-min", value)
    assert p.returncode != 0
    assert "--draft-p-min must be in [0, 1], got " + value in p.stderr, p.stderr


def test_draft_p_min_probability_and_model_draft_keep_greedy_output():
    plain = generate_json("-p", PROMPT)["tokens"]
    cut = generate_json("-p", PROMPT, "--spec", "self", "--tree-topk", 2, "--tree-tokens", 6, "--draft-p-min", 0.2)
    assert cut["tokens"] == plain and "spec" in cut
    drafted = generate_json("-p", PROMPT, "--spec", "draft", "-md", SMOL)
    assert drafted["tokens"] == plain and drafted["spec"]["mode"] == "draft"


@pytest.mark.parametrize("command,shown", [
    ("generate", ["Model:", "Input:", "Sampling:", "Speculation:", "Output:", "-s,--seed", "-sys,--system-prompt",
                  "-md,--model-draft,--draft-model", "--draft-p-min"]),
    ("serve", ["Model:", "Server:", "Speculation:", "-np,--parallel", "-lv,--log-verbosity", "Z I text"]),
    ("bench", ["Sampling:", "Speculation:", "Benchmark:", "Output:", "-n,--n-predict", "-s,--seed", "--no-plots"]),
    ("coverage", ["-n,--n-predict", "--no-plots"]),
])
def test_help_groups_and_llama_cpp_names(command, shown):
    p = run(command, "--help")
    assert p.returncode == 0, p.stderr
    missing = [s for s in shown if s not in p.stdout]
    assert not missing, f"{command} --help lacks {missing}:\n{p.stdout}"


def test_log_verbosity_out_of_range_is_refused():
    p = run("serve", "-m", SMOL, "--port", 0, "-lv", 9)
    assert p.returncode != 0 and "--log-verbosity must be in [0, 4], got 9" in p.stderr, p.stderr


def chat_once(server):
    status, _, body = http(server, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    return body


ANSWER_TO_HI = {}  # the first server's greedy answer, which the second (its own template) must repeat


@pytest.mark.parametrize("verbosity", [3, 4])
def test_server_log_lines_have_time_level_and_request_id(verbosity):
    # The second server also runs without the prefix cache (--no-cache-prompt): the same request
    # again is served from the slot's cache by the first server only.
    # and with --chat-template model (SmolLM2's own Jinja template: the same prompts as the built-in format).
    cache_flags = ["--no-cache-prompt", "--chat-template", "model"] if verbosity == 4 else []
    s = ServerProcess(SMOL, "-np", 2, "-lv", verbosity, *cache_flags)
    try:
        status, _, health = http(s, "GET", "/health")
        assert status == 200 and health["slots"] == 2, health
        first = chat_once(s)
        request_id = first["id"]
        again = chat_once(s)
        assert again["choices"] == first["choices"]
        assert first["choices"][0]["message"]["content"] == (
            ANSWER_TO_HI.get("text") or ANSWER_TO_HI.setdefault("text", first["choices"][0]["message"]["content"]))
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if cache_flags:
            assert cached == 0 and metrics(s)["microspec_prompt_tokens_cached_total"] == 0
        else:
            assert cached == again["usage"]["prompt_tokens"] - 1, again["usage"]
            assert metrics(s)["microspec_prompt_tokens_cached_total"] == cached
    finally:
        assert s.terminate() == 0, s.stderr_text()
    lines = s.stderr_text().splitlines()
    assert lines and all(LOG_LINE.match(line) for line in lines), "\n".join(lines)
    levels = {line.split()[1] for line in lines}
    request_lines = [line for line in lines if request_id in line]
    assert all(line.split()[2] == request_id + ":" for line in request_lines), request_lines
    assert ("chat prompts in the model's template" in s.stderr_text()) == bool(cache_flags)
    if verbosity == 3:
        assert "D" not in levels and len(request_lines) == 1, lines
    else:
        assert "D" in levels and len(request_lines) >= 3, lines  # received, slot taken, done


def test_installed_binary_runs_on_its_own(tmp_path):
    build_dir = pathlib.Path(BIN).parent
    p = subprocess.run(["cmake", "--install", str(build_dir), "--prefix", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    installed = tmp_path / "bin" / "microspec"
    assert installed.is_file()
    assert (tmp_path / "share" / "microspec" / "benchmarks" / "plot_report.py").is_file(), "bench's plot script"
    assert run("--version", binary=installed).stdout == run("--version").stdout
    ours = generate_json("-p", PROMPT)
    theirs = generate_json("-p", PROMPT, binary=installed)
    assert theirs["tokens"] == ours["tokens"] and theirs["text"] == ours["text"]


QEMU = shutil.which("qemu-x86_64")


@pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 (Debian package qemu-user) is not installed")
def test_cpu_without_avx2_gets_one_line_error():
    p = subprocess.run([QEMU, "-cpu", "Nehalem", BIN, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert "needs an x86-64 CPU with AVX2" in p.stderr and "lacks AVX2, FMA, F16C, BMI2" in p.stderr, p.stderr


@pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 (Debian package qemu-user) is not installed")
def test_cpu_with_avx2_passes_the_check():
    p = subprocess.run([QEMU, "-cpu", "Haswell", BIN, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("microspec "), (p.returncode, p.stderr)


def test_spec_auto_is_the_default_and_a_seed_gives_the_same_text(tmp_path):
    """`--spec auto` runs by default, says which options ran, and decides from token counts and a
    cost file only: two sampled runs with one seed give the same text, the first measuring the
    costs into the cache directory and the second reading them."""
    import os
    env = dict(os.environ, MICROSPEC_CACHE_DIR=str(tmp_path / "cache"))
    args = [str(BIN), "generate", "-m", str(SMOL), "--chat", "-p", "List five colours, then list them again.",
            "-n", "48", "--temp", "0.8", "-s", "7"]
    runs = [subprocess.run(args, capture_output=True, text=True, timeout=300, env=env) for _ in range(2)]
    for p in runs:
        assert p.returncode == 0, p.stderr[-2000:]
        assert "speculative (auto: " in p.stderr and "steps by drafter: plain " in p.stderr, p.stderr
    assert "step costs measured and written to" in runs[0].stderr
    assert "step costs read from" in runs[1].stderr
    assert runs[0].stdout == runs[1].stdout
    cost_files = list((tmp_path / "cache").glob("step-costs-*.json"))
    assert len(cost_files) == 1
    costs = json.loads(cost_files[0].read_text())
    assert costs["rows"][0] == 1 and len(costs["forward"]) == len(costs["rows"])
    # A cost file the user names must parse; --step-costs belongs to auto.
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    p = run("generate", "-m", SMOL, "-p", PROMPT, "-n", 2, "--step-costs", bad)
    assert p.returncode != 0 and "step costs: malformed file" in p.stderr, p.stderr
    p = run("generate", "-m", SMOL, "-p", PROMPT, "-n", 2, "--spec", "ngram", "--step-costs", bad)
    assert p.returncode != 0 and "--step-costs applies to --spec auto" in p.stderr, p.stderr
