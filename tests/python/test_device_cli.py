"""`generate --device cuda` and `serve --device cuda` on any machine: what the device path accepts and refuses is decided before
the model is loaded, with the list of what it supports; an accepted run then either generates (a GPU
is present) or ends with a clear error naming why it cannot (no GPU here, or a build without the CUDA
backend). The device-against-CPU tests themselves are the `Cuda*` tests of microspec_tests."""
import json
import subprocess

import pytest

from repo_paths import BIN, MODELS, REPO
from server_helpers import ServerProcess, http

SMOL = MODELS["smollm2"]
GEMMA_HEAD = REPO / "models" / "heads" / "gemma-3-270m-q4_k_m.eagle3.gguf"
NO_DEVICE = ("no CUDA device is available", "this build has no CUDA backend")


def generate(*args):
    return subprocess.run([BIN, "generate", "-m", SMOL, "-p", "Hello", "-n", "8", "--device", "cuda", *map(str, args)],
                          capture_output=True, timeout=300, text=True)


@pytest.mark.parametrize("args", [
    [],
    ["--spec", "self", "--tree-topk", "1", "--draft-vocab", "full"],
    ["--spec", "self", "--tree-topk", "1"],  # the default vocabulary: MicroSpec's dynamic one
    ["--spec", "self", "--tree-topk", "1", "--vocab-window", "512", "--vocab-source", "ext", "--no-async-gather"],
    ["--spec", "draft", "--draft-model", SMOL, "--tree-topk", "1"],
    # FR-Spec's frequent set and MicroSpec's window with it pinned (the frequency file the setup
    # writes beside the model)
    ["--spec", "self", "--tree-topk", "1", "--draft-vocab", "freq", "--freq-top", "4096"],
    ["--spec", "self", "--tree-topk", "1", "--draft-vocab", "hybrid", "--hybrid-top", "512"],
    # the EAGLE-3 head trained for SmolLM2 (found beside the model), scored through each vocabulary
    ["--spec", "head", "--tree-topk", "1", "--draft-vocab", "full"],
    ["--spec", "head", "--tree-topk", "1"],
    # what the CPU path's output offers: stop strings, one JSON line
    ["--json", "--stop", "\n\n"],
    ["--spec", "self", "--tree-topk", "1", "--json", "--stop", "."],
    # a tree drafted by the target's first layers: the full head, MicroSpec's window
    ["--spec", "self", "--tree-topk", "3", "--tree-depth", "2", "--tree-tokens", "8", "--draft-vocab", "full"],
    ["--spec", "self", "--tree-topk", "2", "--tree-depth", "3", "--tree-tokens", "6"],
    # sampling: the CPU sampler's draw from the top-k best (the defaults: top-k 40, top-p 0.95)
    ["--temp", "0.7", "--seed", "3"],
    ["--temp", "1.2", "--top-k", "64", "--top-p", "1", "--seed", "1"],
    # speculative sampling on a chain: the self-draft with MicroSpec's window, a draft model, the head
    ["--temp", "0.7", "--seed", "3", "--spec", "self", "--tree-topk", "1"],
    ["--temp", "0.9", "--spec", "draft", "--draft-model", SMOL, "--tree-topk", "1", "--draft-vocab", "full"],
    ["--temp", "0.9", "--top-k", "8", "--spec", "head", "--tree-topk", "1"],
    # speculative sampling on a self-drafted tree: MicroSpec's window, the full head
    ["--temp", "0.7", "--seed", "3", "--spec", "self", "--tree-topk", "2", "--tree-depth", "3", "--tree-tokens", "6"],
    ["--temp", "1.0", "--top-k", "16", "--spec", "self", "--tree-topk", "4", "--tree-depth", "2", "--draft-vocab", "full"],
    # a tree drafted by the EAGLE-3 head, greedy and sampled
    ["--spec", "head", "--tree-topk", "3", "--tree-depth", "3", "--tree-tokens", "8"],
    ["--temp", "0.8", "--spec", "head", "--tree-topk", "2", "--tree-depth", "3", "--tree-tokens", "6", "--draft-vocab", "full"],
    # a tree drafted by a separate draft model, greedy and sampled
    ["--spec", "draft", "--draft-model", SMOL, "--tree-topk", "3", "--tree-depth", "2", "--tree-tokens", "8"],
    ["--temp", "0.8", "--spec", "draft", "--draft-model", SMOL, "--tree-topk", "2", "--tree-depth", "3", "--draft-vocab", "full"],
])
def test_accepted_settings_reach_the_device(args):
    p = generate(*args)
    if p.returncode == 0:  # a GPU machine
        assert p.stdout.strip(), "no text generated"
        return
    assert any(m in p.stderr for m in NO_DEVICE), p.stderr[-2000:]


def test_a_prompts_file_reaches_the_device(tmp_path):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "Hello"}\n{"prompt_ids": [1, 2, 3]}\n')
    p = subprocess.run([BIN, "generate", "-m", SMOL, "--prompts-jsonl", rows, "-n", "8", "--device", "cuda",
                        "--spec", "self", "--tree-topk", "1"], capture_output=True, timeout=300, text=True)
    if p.returncode == 0:  # a GPU machine: one JSON line per row
        assert len(p.stdout.strip().splitlines()) == 2, p.stdout
        return
    assert any(m in p.stderr for m in NO_DEVICE), p.stderr[-2000:]


@pytest.mark.parametrize("args, says", [
    (["--spec", "self", "--tree-topk", "1", "--draft-vocab", "freq", "--freq-file", "/nonexistent/x.freq.bin"],
     "/nonexistent/x.freq.bin"),
    (["--spec", "ngram"], "--spec self|draft|head"),
    (["--spec", "head", "--tree-topk", "1", "--draft-head", "/nonexistent/h.gguf"], "/nonexistent/h.gguf"),
    # Gemma's head on SmolLM2: refused with both hidden sizes, before any device is asked for
    (["--spec", "head", "--tree-topk", "1", "--draft-head", GEMMA_HEAD], "expected 576"),
    (["--spec", "self", "--tree-topk", "1", "--draft-p-min", "0.2"], "--draft-p-min 0"),
    (["--temp", "0.7", "--top-k", "0"], "top_k must be in 1..64"),
    (["--temp", "0.7", "--top-k", "100"], "top_k must be in 1..64"),
    (["--temp", "0.7", "--spec", "self", "--tree-topk", "8", "--tree-depth", "8"], "--tree-depth 8 takes 520"),
    (["--temp", "0.7", "--top-k", "0", "--spec", "self", "--tree-topk", "1"], "top_k must be in 1..64"),
])
def test_refused_settings_name_what_the_device_supports(args, says):
    p = generate(*args)
    assert p.returncode != 0
    assert says in p.stderr, p.stderr[-2000:]
    assert not any(m in p.stderr for m in NO_DEVICE), "refused only after trying the device"


def generate_text(*args):
    """`generate --device cuda --json` on SmolLM2 (a GPU machine): the text."""
    p = subprocess.run([BIN, "generate", "-m", SMOL, "--device", "cuda", "--json", *map(str, args)],
                       capture_output=True, timeout=300, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.splitlines()[-1])["text"]


def serve(*args):
    return subprocess.run([BIN, "serve", "-m", SMOL, "--port", "0", "--device", "cuda", *map(str, args)],
                          capture_output=True, timeout=300, text=True)


@pytest.mark.parametrize("args", [
    [],
    ["--spec", "self", "--tree-topk", "1"],
    ["--spec", "self", "--tree-topk", "2", "--tree-depth", "3", "--tree-tokens", "6", "--draft-vocab", "full"],
    ["--spec", "draft", "--draft-model", SMOL, "--tree-topk", "2", "--tree-depth", "3", "--tree-tokens", "6"],
])
def test_serve_reaches_the_device(args):
    """Started on a GPU machine: a greedy completion is `generate --device cuda`'s text (speculative or
    not, streamed or not: the device's greedy tokens, which equal the CPU's up to near ties); a sampled
    one is generate's sample with the same seed and settings (speculative sampling with the chain or
    the tree) and a top_k the device cannot sample from gets 400
    naming it; SIGTERM ends it with 0. Elsewhere the server ends at start with the reason it has no
    device."""
    try:
        server = ServerProcess(SMOL, "--device", "cuda", *args, startup_timeout=300)
    except RuntimeError as e:
        assert any(m in str(e) for m in NO_DEVICE), str(e)[-2000:]
        return
    try:
        prompt, n = "The capital of France is", 24
        expected = generate_text("-p", prompt, "-n", n)
        # a speculative server also runs a request that turns speculation off
        for extra in [{}, {"microspec": {"spec": "none"}}] if args else [{}]:
            request = {"prompt": prompt, "max_tokens": n, "temperature": 0, **extra}
            status, _, body = http(server, "POST", "/v1/completions", request, timeout=300)
            assert status == 200, body
            assert body["choices"][0]["text"] == expected, (extra, body)
            assert body["usage"]["microspec"]["device"] == "cuda"
            status, _, events = http(server, "POST", "/v1/completions", {**request, "stream": True}, timeout=300)
            assert status == 200, events
            chunks = [json.loads(line[6:]) for line in events.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected, (extra, events)
        sampled = {"prompt": prompt, "max_tokens": n, "temperature": 0.8, "seed": 5}
        status, _, body = http(server, "POST", "/v1/completions", sampled, timeout=300)
        assert status == 200, body
        p = generate_text("-p", prompt, "-n", n, "--temp", "0.8", "--seed", "5", *args)
        assert body["choices"][0]["text"] == p, (body, p)
        assert "note" not in body["usage"]["microspec"], body["usage"]
        status, _, body = http(server, "POST", "/v1/completions", {**sampled, "top_k": 0})
        assert status == 400 and body["error"]["param"] == "top_k", body
    finally:
        assert server.terminate() == 0, "".join(server.log)[-2000:]


@pytest.mark.parametrize("args, says", [
    (["--parallel", "2"], "--parallel 1"),
    (["--spec", "ngram"], "--spec self|draft|head"),
    (["--spec", "self", "--tree-topk", "2", "--draft-p-min", "0.2"], "--draft-p-min 0"),
    (["--spec", "self", "--tree-topk", "1", "--draft-vocab", "freq", "--freq-file", "/nonexistent/x.freq.bin"],
     "/nonexistent/x.freq.bin"),
])
def test_serve_refuses_what_the_device_cannot_run(args, says):
    p = serve(*args)
    assert p.returncode != 0
    assert says in p.stderr, p.stderr[-2000:]
    assert not any(m in p.stderr for m in NO_DEVICE), "refused only after trying the device"
