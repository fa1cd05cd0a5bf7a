"""`microspec convert --eagle`: a published-layout EAGLE-2 head for SmolLM2 (written by
scripts/make_eagle_checkpoint_fixtures.py, torch.save'd pytorch_model.bin) converts to Q8_0 and
`generate --spec head` with it keeps greedy output identical to plain decoding; a folder whose
pytorch_model.bin carries a hostile pickle is refused naming the global, and its payload never
runs; a missing --target is a one-line error."""
import pathlib
import shutil
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from repo_paths import BIN, MODELS, REPO  # noqa: E402
from server_helpers import cli_generate  # noqa: E402

FIXTURES = REPO / "tests" / "data" / "eagle_checkpoint"
PROMPTS = ["Write a short poem about the sea.", "List three uses of a paperclip."]


def convert(*args):
    return subprocess.run([BIN, "convert", *map(str, args)], capture_output=True, text=True, timeout=300)


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
