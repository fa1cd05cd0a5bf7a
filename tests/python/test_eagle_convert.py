"""`microspec convert --eagle`: a published-layout EAGLE-2 head for SmolLM2 (written by
scripts/make_eagle_checkpoint_fixtures.py, torch.save'd pytorch_model.bin) converts to Q8_0 and
`generate --spec head` with it keeps greedy output identical to plain decoding; a random EAGLE-3
head for SmolLM2 in the published layout (own 2048-row LM head, d2t offsets, t2d; written here with
numpy as model.safetensors) converts, loads in llama.cpp itself, and drafts losslessly with the
full and the dynamic vocabulary; a folder whose
pytorch_model.bin carries a hostile pickle is refused naming the global, and its payload never
runs; a missing --target is a one-line error."""
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from repo_paths import BIN, MODELS, REPO  # noqa: E402
from eagle3_checkpoint import write_eagle3_checkpoint  # noqa: E402
from server_helpers import cli_generate  # noqa: E402

FIXTURES = REPO / "tests" / "data" / "eagle_checkpoint"
PROMPTS = ["Write a short poem about the sea.", "List three uses of a paperclip."]


def convert(*args):
    return subprocess.run([BIN, "convert", *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~10 s: conversions and generations on SmolLM2
def test_converted_eagle2_head_drafts_losslessly(tmp_path):
    head = tmp_path / "eagle2.gguf"
    out = convert("--eagle", FIXTURES / "eagle2_smollm2", "--target", MODELS["smollm2"], "-o", head, "--type", "q8_0")
    assert out.returncode == 0, out.stderr
    assert "EAGLE-2 head" in out.stderr
    plain = cli_generate(MODELS["smollm2"], PROMPTS, 32, True, ["--json"])
    spec = cli_generate(MODELS["smollm2"], PROMPTS, 32, True,
                        ["--json", "--spec", "head", "--draft-head", head, "--draft-vocab", "dynamic"])
    for p, s in zip(plain, spec):
        assert s["tokens"] == p["tokens"]
        assert s["spec"]["steps"] > 0 and s["spec"]["drafted_tokens"] > 0


def test_hostile_pytorch_model_bin_is_refused_and_never_runs(tmp_path):
    pwned = pathlib.Path("/tmp/microspec_pwned_system")
    pwned.unlink(missing_ok=True)
    folder = tmp_path / "hostile"
    folder.mkdir()
    shutil.copy(FIXTURES / "eagle3" / "config.json", folder / "config.json")
    shutil.copy(REPO / "tests" / "data" / "checkpoint" / "hostile_system.bin", folder / "pytorch_model.bin")
    out = convert("--eagle", folder, "--target", MODELS["smollm2"], "-o", tmp_path / "h.gguf")
    assert out.returncode != 0
    assert "the global 'posix.system'" in out.stderr and "nothing was run" in out.stderr
    assert not pwned.exists()
    assert not (tmp_path / "h.gguf").exists()


def test_convert_needs_a_target(tmp_path):
    out = convert("--eagle", FIXTURES / "eagle2_smollm2", "-o", tmp_path / "h.gguf")
    assert out.returncode != 0
    assert "needs --target MODEL.gguf" in out.stderr


@pytest.mark.slow
def test_converted_eagle3_head_with_own_lm_head_loads_in_llama_cpp_and_drafts_losslessly(tmp_path):
    write_eagle3_checkpoint(tmp_path / "eagle3")
    head = tmp_path / "eagle3.gguf"
    out = convert("--eagle", tmp_path / "eagle3", "--target", MODELS["smollm2"], "-o", head, "--type", "q8_0")
    assert out.returncode == 0, out.stderr
    assert "EAGLE-3 head" in out.stderr and "own LM head of 2048 rows" in out.stderr
    # llama.cpp's own loader accepts the file (eagle3 metadata, d2t, output, every tensor's shape).
    code = ("import llama_cpp, sys\n"
            "llama_cpp.llama_backend_init()\n"
            "m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())\n"
            "print('LOADED' if m else 'FAILED')\n")
    p = subprocess.run([sys.executable, "-c", code, str(head)], capture_output=True, text=True, timeout=300)
    assert "LOADED" in p.stdout, p.stderr[-2000:]
    plain = cli_generate(MODELS["smollm2"], PROMPTS, 32, True, ["--json"])
    for vocab in ("full", "dynamic"):
        spec = cli_generate(MODELS["smollm2"], PROMPTS, 32, True,
                            ["--json", "--spec", "head", "--draft-head", head, "--draft-vocab", vocab])
        for p_row, s_row in zip(plain, spec):
            assert s_row["tokens"] == p_row["tokens"], vocab
        assert sum(s["spec"]["drafted_tokens"] for s in spec) > 0, vocab


def test_target_may_be_a_hugging_face_folder(tmp_path):
    """--target takes a Hugging Face folder as every model path does: the head written against the
    folder is byte for byte the one written against the folder's own conversion to GGUF."""
    folder = REPO / "tests" / "data" / "hf" / "llama"
    head = tmp_path / "eagle3"
    write_eagle3_checkpoint(head, seed=11, shape=dict(H=64, V=1400, D=256, nh=4, nkv=2, hd=16, ff=96, id_range=1400),
                            dtype="float32", target_layers=[0, 1, 1])
    target_gguf = tmp_path / "llama.gguf"
    out = convert("--hf", folder, "-o", target_gguf)
    assert out.returncode == 0, out.stderr
    heads = []
    for target in (folder, target_gguf):
        path = tmp_path / f"head-{target.name}.gguf"
        out = convert("--eagle", head, "--target", target, "-o", path, "--type", "f32")
        assert out.returncode == 0, out.stderr
        heads.append(path.read_bytes())
    assert heads[0] == heads[1]
