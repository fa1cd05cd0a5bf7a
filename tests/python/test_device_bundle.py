"""scripts/device_bundle.sh packs the CUDA build for a GPU machine in parts that each fit one device
call beside the working tree. The binaries travel in the last call, so a machine that went cold
between calls (and lost the staged parts) still runs the check; unpacked, they run with the
libraries packed beside them. The model is unpacked only when every part arrived intact, else the
unpacking says so and the binaries are still there. A build without the CUDA backend (no
bench_cuda) is refused with the reason."""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from repo_paths import BIN, MODELS, REPO

CALL_LIMIT = 64 * 1024 * 1024
BUILD = pathlib.Path(BIN).parent
CUDA_BUILD = (BUILD / "bench_cuda").exists()


def pack(tmp_path, *args):
    parts_dir = tmp_path / "parts"
    p = subprocess.run(["bash", REPO / "scripts" / "device_bundle.sh", *args, "--parts", parts_dir,
                        "--staging", tmp_path / "staging", BUILD], capture_output=True, text=True, timeout=300)
    return p, parts_dir


def calls_of(stdout):
    """The printed calls as (carried path, command)."""
    return [re.match(r'  carry \["([^"]+)"\]: (.*)$', line).groups() for line in stdout.splitlines()
            if line.startswith("  carry [")]


def machine_checkout(tmp_path):
    """What a device call finds: the scripts of the working tree (the unpacking is run from there)."""
    root = tmp_path / "machine"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "device_bundle.sh", root / "scripts")
    return root


def run_call(root, carried, command):
    """One device call, run in the machine's checkout (the carried path, absolute in a pack made
    with --parts outside the checkout, is read where it is; the check itself needs a GPU)."""
    assert pathlib.Path(carried).exists(), carried
    command = command.split(" && bash scripts/device_check.sh")[0]
    return subprocess.run(["bash", "-c", command], cwd=root, capture_output=True, text=True, timeout=300)


def assert_binaries_run(root):
    bin_dir = root / "build-device" / "bin"
    libs = {f.name for f in (bin_dir / "lib").iterdir()}
    assert any(n.startswith("libstdc++") for n in libs), libs
    assert not any(n.startswith(("libc.so", "libm.so", "ld-linux", "libcuda")) for n in libs), libs
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir / "lib"))
    for exe in ["microspec", "microspec_tests", "bench_cuda"]:
        assert os.access(bin_dir / exe, os.X_OK), exe
    run = subprocess.run([bin_dir / "microspec", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0 and "generate" in run.stdout, run.stderr
    # The packed test binary lists the device tests (they skip by name without a GPU).
    run = subprocess.run([bin_dir / "microspec_tests", "--gtest_list_tests", "--gtest_filter=Cuda*"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0 and "PlainTokensEqualCpu" in run.stdout, run.stderr


def test_bundle_without_the_model_is_one_call_of_runnable_binaries(tmp_path):
    p, parts_dir = pack(tmp_path, "--no-model")
    if not CUDA_BUILD:
        assert p.returncode != 0 and "bench_cuda exists only in a CUDA build" in p.stderr, p.stderr
        return
    assert p.returncode == 0, p.stderr
    calls = calls_of(p.stdout)
    assert len(calls) == 1 and calls[0][0] == str(parts_dir / "last"), p.stdout
    assert "scripts/device_check.sh build-device/bin" in calls[0][1]
    root = machine_checkout(tmp_path)
    r = run_call(root, *calls[0])
    assert r.returncode == 0 and "no model packed" in r.stdout, r.stdout + r.stderr
    assert_binaries_run(root)
    assert not (root / "models").exists()


@pytest.mark.skipif(not CUDA_BUILD or not MODELS["smollm2"].exists(), reason="needs a CUDA build and SmolLM2")
def test_bundle_with_the_model_stages_it_across_calls_and_checks_it(tmp_path):
    p, parts_dir = pack(tmp_path)
    assert p.returncode == 0, p.stderr
    tree = int(p.stdout.split("(the tree is ")[1].split(")")[0])
    calls = calls_of(p.stdout)
    assert len(calls) >= 2 and calls[-1][0] == str(parts_dir / "last"), p.stdout
    for carried, _ in calls:
        src = pathlib.Path(carried)
        size = sum(f.stat().st_size for f in src.rglob("*")) if src.is_dir() else src.stat().st_size
        assert tree + size <= CALL_LIMIT, carried

    # Every call made on a warm machine: the model arrives whole.
    root = machine_checkout(tmp_path)
    for carried, command in calls:
        r = run_call(root, carried, command)
        assert r.returncode == 0, r.stdout + r.stderr
    assert "model unpacked to models/" in r.stdout, r.stdout
    assert (root / "models" / MODELS["smollm2"].name).read_bytes() == MODELS["smollm2"].read_bytes()
    assert_binaries_run(root)

    # The second call found the machine cold (a bare one: the first part is gone): the binaries
    # still unpack, the model does not, and the unpacking says why.
    shutil.rmtree(root)
    root = machine_checkout(tmp_path)
    for i, (carried, command) in enumerate(calls):
        if i == 1:
            shutil.rmtree(tmp_path / "staging")
        r = run_call(root, carried, command)
        assert r.returncode == 0, r.stdout + r.stderr
    n_parts = int((parts_dir / "last" / "model.sha256").read_text().split()[1])
    assert f"model is NOT staged: {n_parts - 1} of {n_parts} parts" in r.stdout, r.stdout
    assert not (root / "models").exists()
    assert_binaries_run(root)

    # A part that arrived damaged: refused by its checksum.
    shutil.rmtree(root)
    root = machine_checkout(tmp_path)
    for i, (carried, command) in enumerate(calls):
        r = run_call(root, carried, command)
        if i == 0:
            first = tmp_path / "staging" / "model-00"
            data = bytearray(first.read_bytes())
            data[len(data) // 2] ^= 1
            first.write_bytes(bytes(data))
    assert "model is NOT staged" in r.stdout and "checksum differs" in r.stdout, r.stdout
    assert not (root / "models").exists()


def test_bundle_refuses_unknown_options():
    p = subprocess.run(["bash", REPO / "scripts" / "device_bundle.sh", "--frobnicate"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "usage:" in p.stderr
