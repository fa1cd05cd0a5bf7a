"""`microspec bench` end to end on SmolLM2.

- The CI smoke mode (`--smoke`: 2 prompts per SpecBench category, 32 tokens) with methods ar and
  full: exit status 0, every report file written (records, summary JSON and Markdown, PNG plots),
  the Markdown printed, both turns of MT-bench questions run, and full's outputs equal ar's.
- A sweep over a tree setting on two categories, with a coverage CSV folded in: the study and
  coverage plots are written and the study rows carry the swept values.
- llama.cpp peer rows on one prompt: merged into the summary, compared with ar, never failing.
- Bad input (missing dataset, unknown method, bad sweep key, unknown peer) exits non-zero with a
  clear message; plot_report.py rejects a file that is not a summary.
The comparison that fails a run on a mismatch is tested on synthetic records in tests/test_bench.cpp.
"""
import json
import pathlib
import subprocess
import sys

import pytest

from repo_paths import BIN, REPO  # noqa: E402
MODEL = REPO / "models" / "smollm2-135m-instruct-q4_1.gguf"
DATASET = REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(args, out, timeout=600, dataset=DATASET):
    if not pathlib.Path(BIN).exists():
        pytest.fail(f"microspec binary not found at {BIN} (build it or set MICROSPEC_BIN)")
    for f in (MODEL, DATASET):  # the real files are part of the setup
        if not f.exists():
            pytest.fail(f"{f} is missing: run scripts/setup.sh")
    cmd = [BIN, "bench", "-m", str(MODEL), "--dataset", str(dataset), "-t", "2", "-o", str(out)] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def png(path):
    assert path.exists(), f"{path} not written"
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


@pytest.mark.slow  # a benchmark run: minutes; left out of scripts/test.sh --quick
def test_smoke_mode(tmp_path):
    p = bench(["--methods", "ar,full", "--smoke"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "### Overall" in p.stdout and "| full |" in p.stdout
    assert "[bench] prompt 26/26" in p.stderr  # the progress line

    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 26 * 2
    by = {(r["method"], r["question_id"]): r for r in records}
    two_turn = [r for r in records if r["method"] == "ar" and len(r["turns"]) == 2]
    assert len(two_turn) == 16  # 8 MT-bench categories x 2
    for r in two_turn:
        first, second = r["turns"]
        assert second["prompt_tokens"] > first["prompt_tokens"] + len(first["tokens"]) - 2
        assert r["new_tokens"] == len(first["tokens"]) + len(second["tokens"])
    for (method, qid), r in by.items():
        if method == "full":
            assert [t["tokens"] for t in r["turns"]] == [t["tokens"] for t in by[("ar", qid)]["turns"]]
            assert r["steps"] > 0
        assert 0 < r["new_tokens"] <= 32 * len(r["turns"])
        assert r["wall_seconds"] > r["prefill_seconds"] > 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is True and summary["mismatches"] == []
    assert summary["run"]["questions"] == 26 and len(summary["categories"]) == 13
    methods = {m["info"]["label"]: m for m in summary["methods"]}
    assert methods["ar"]["overall"]["speedup"] == pytest.approx(1.0)
    full = methods["full"]
    assert full["agreement"]["identical"] == full["agreement"]["compared"] == 26
    assert full["overall"]["mean_acceptance_length"] >= 1.0
    assert full["overall"]["mean_active_vocab"] == 49152
    assert full["overall"]["speedup"] > 0 and len(full["by_category"]) == 13
    g = full["overall"]
    parts = g["prefill_seconds"] + g["draft_backbone_seconds"] + g["draft_lm_head_seconds"] + g["target_seconds"] + \
        g["bookkeeping_seconds"]
    assert parts <= g["wall_seconds"] * 1.001 and parts > 0.9 * g["wall_seconds"]
    md = (tmp_path / "summary.md").read_text()
    assert "Every method's output tokens equal ar's" in md and "interleaved per prompt" in md
    png(tmp_path / "speedup_by_category.png")
    png(tmp_path / "time_breakdown.png")


@pytest.mark.slow  # a benchmark run: minutes; left out of scripts/test.sh --quick
def test_sweep_with_coverage(tmp_path):
    cov = tmp_path / "cov.csv"
    cov.write_text("vocab_size,series,coverage\n256,ctx,0.41\n1024,ctx,0.63\n4096,ctx,0.85\n"
                   "256,both,0.52\n1024,both,0.74\n4096,both,0.93\n")
    out = tmp_path / "out"
    p = bench(["--methods", "full", "--sweep", "tree-tokens=2,4", "--categories", "qa,writing", "--per-category", "1",
               "-n", "16", "--coverage-csv", str(cov)], out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "adding method ar" in p.stderr
    summary = json.loads((out / "summary.json").read_text())
    labels = [m["info"]["label"] for m in summary["methods"]]
    assert labels == ["ar", "full:tree-tokens=2", "full:tree-tokens=4"]
    assert [m["info"]["study_value"] for m in summary["methods"][1:]] == ["2", "4"]
    assert summary["methods"][1]["info"]["config"]["tree-tokens"] == 2
    assert "### Study" in p.stdout
    assert "### Draft-vocabulary coverage (cov.csv)" in p.stdout and "| 4096 | both | 0.93 |" in p.stdout
    png(out / "study.png")
    png(out / "coverage.png")


@pytest.mark.slow  # a benchmark run: minutes; left out of scripts/test.sh --quick
def test_llama_cpp_peer_rows(tmp_path):
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.fail("llama-cpp-python is missing: run scripts/install_llama_cpp.sh")
    p = bench(["--methods", "ar", "--categories", "qa", "--per-category", "1", "-n", "8", "-c", "1024",
               "--peers", "llama.cpp", "--no-plots"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    peers = [m for m in summary["methods"] if m["info"]["peer"]]
    assert [m["info"]["label"] for m in peers] == ["llama.cpp", "llama.cpp:prompt-lookup"]
    for m in peers:
        assert m["overall"]["prompts"] == 1 and m["overall"]["tokens_per_second"] > 0
        assert m["agreement"]["compared"] == 1
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    ours = next(r for r in records if r["method"] == "ar")
    for r in records:
        assert r["turns"][0]["prompt_tokens"] == ours["turns"][0]["prompt_tokens"]  # same chat-formatted prompt
    assert summary["passed"] is True  # peers differing from ar never fail the run


@pytest.mark.parametrize("args,message", [
    (["--dataset=/nonexistent.jsonl"], "cannot open the dataset file"),
    (["--methods", "ar,medusa"], "unknown benchmark method 'medusa'"),
    (["--methods", "ar,full", "--sweep", "bogus=1,2"], "unknown speculative setting 'bogus'"),
    (["--methods", "ar,full", "--sweep", "tree-tokens=2", "--ablation"], "not both"),
    (["--peers", "vllm"], "unknown peer 'vllm'"),
    (["--peers", "llama.cpp", "--presence-penalty", "0.5"], "the peers run without penalties"),
    (["--logit-bias", "7x"], "--logit-bias: expected TOKEN_ID(+/-)BIAS"),
    (["--categories", "poetry"], "no category 'poetry'"),
    (["--coverage-csv", "/nonexistent.csv"], "/nonexistent.csv: cannot open file"),
])
def test_bad_input(tmp_path, args, message):
    dataset = args[0].split("=", 1)[1] if args[0].startswith("--dataset=") else DATASET
    args = args[1:] if args[0].startswith("--dataset=") else args
    p = bench(["--no-plots"] + args, tmp_path, timeout=120, dataset=dataset)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr


def test_plot_script_reads_the_coverage_command_csv(tmp_path):
    (tmp_path / "coverage.csv").write_text(
        "kind,param,category,steps,covered,coverage,mean_active\n"
        "static,512,qa,10,5,0.5,514\nstatic,512,all,100,52,0.52,514\nstatic,4096,all,100,81,0.81,4098\n"
        "dynamic,1024,all,100,77,0.77,903.5\ndynamic,3072,all,100,90,0.9,2710\n")
    (tmp_path / "summary.json").write_text(json.dumps(
        {"reference": "ar", "categories": [], "methods": [], "coverage_csv": "coverage.csv",
         "run": {"model": "models/x.gguf"}}))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot_report.py"), str(tmp_path / "summary.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    png(tmp_path / "coverage.png")
    assert not (tmp_path / "speedup_by_category.png").exists()


def test_plot_script_rejects_bad_summary(tmp_path):
    bad = tmp_path / "summary.json"
    bad.write_text('{"methods": 3}')
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot_report.py"), str(bad)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "not a bench summary" in p.stderr


def test_penalties_apply_to_every_method(tmp_path):
    """bench takes generate's penalty flags: every method decodes with them (the n-gram drafter's
    output still equals plain decoding's, penalised alike), they are in the run's settings, and
    they change the output."""
    def run(out, extra):
        p = bench(["--methods", "ar,ngram", "--categories", "coding", "--per-category", "1", "-n", "24",
                   "--no-plots", *extra], out, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["passed"] is True and summary["mismatches"] == []
        records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        return summary, [t["tokens"] for r in records if r["method"] == "ar" for t in r["turns"]]

    summary, penalised = run(tmp_path / "penalised", ["--repeat-penalty", "1.3", "--frequency-penalty", "0.5"])
    assert summary["run"]["repeat_penalty"] == pytest.approx(1.3)
    assert summary["run"]["frequency_penalty"] == pytest.approx(0.5)
    _, plain = run(tmp_path / "plain", [])
    assert penalised != plain
