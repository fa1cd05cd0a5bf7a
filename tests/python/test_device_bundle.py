"""scripts/device_bundle.sh packs the CUDA build for a GPU machine in parts that each fit one device
call beside the working tree; unpacked, the binaries run with the libraries packed beside them. A
build without the CUDA backend (no bench_cuda) is refused with the reason."""
import os
import pathlib
import subprocess
import tarfile

from repo_paths import BIN, REPO

CALL_LIMIT = 64 * 1024 * 1024
BUILD = pathlib.Path(BIN).parent


def test_bundle_parts_fit_a_call_and_unpack_to_runnable_binaries(tmp_path):
    parts_dir = tmp_path / "parts"
    p = subprocess.run(["bash", REPO / "scripts" / "device_bundle.sh", "--no-model", "--parts", parts_dir, BUILD],
                       capture_output=True, text=True, timeout=300)
    if not (BUILD / "bench_cuda").exists():
        assert p.returncode != 0 and "bench_cuda exists only in a CUDA build" in p.stderr, p.stderr
        return
    assert p.returncode == 0, p.stderr
    tree = int(p.stdout.split("(the tree is ")[1].split(")")[0])
    parts = sorted(parts_dir.glob("part-*"))
    assert parts and f"{len(parts)} part(s)" in p.stdout
    for part in parts:
        assert tree + part.stat().st_size <= CALL_LIMIT, part
    calls = [line for line in p.stdout.splitlines() if line.startswith("  carry [")]
    assert len(calls) == len(parts) and "scripts/device_check.sh build-device/bin" in calls[-1]

    packed = tmp_path / "packed.tar.gz"
    packed.write_bytes(b"".join(part.read_bytes() for part in parts))
    unpacked = tmp_path / "machine"
    with tarfile.open(packed) as tar:
        tar.extractall(unpacked, filter="tar")
    bin_dir = unpacked / "build-device" / "bin"
    libs = {f.name for f in (bin_dir / "lib").iterdir()}
    assert any(n.startswith("libstdc++") for n in libs), libs
    assert not any(n.startswith(("libc.so", "libm.so", "ld-linux", "libcuda")) for n in libs), libs
    assert not (unpacked / "models").exists()
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir / "lib"))
    for exe in ["microspec", "microspec_tests", "bench_cuda"]:
        assert os.access(bin_dir / exe, os.X_OK), exe
    run = subprocess.run([bin_dir / "microspec", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0 and "generate" in run.stdout, run.stderr
    # The packed test binary lists the device tests (they skip by name without a GPU).
    run = subprocess.run([bin_dir / "microspec_tests", "--gtest_list_tests", "--gtest_filter=Cuda*"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0 and "PlainTokensEqualCpu" in run.stdout, run.stderr


def test_bundle_refuses_unknown_options():
    p = subprocess.run(["bash", REPO / "scripts" / "device_bundle.sh", "--frobnicate"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "usage:" in p.stderr
