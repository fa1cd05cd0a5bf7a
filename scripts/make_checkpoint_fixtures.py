#!/usr/bin/env python3
"""Writes the fixtures of tests/test_pytorch_checkpoint.cpp into tests/data/checkpoint/:

  state_dict.bin     torch.save of an OrderedDict: F32 [2,3] = 0..5 / 4, F16 [4] = {1.5, -2, 0.25, 65504},
                     BF16 [2,2] = {3, -0.25, 1e30 -> bf16, -7}, int64 d2t [3] = {0, 1, 5}, bool t2d [4],
                     `row` = the second row of a [3,4] F16 tensor (a view with storage offset 4, sharing
                     its storage with `rows`)                                              (needs torch)
  transposed.bin     a non-contiguous view (`big.t()`), which the reader refuses          (needs torch)
  legacy.bin         torch.save(..., _use_new_zipfile_serialization=False)                 (needs torch)
  compressed.bin     state_dict.bin re-zipped with deflate (torch never compresses)
  hostile_*.bin      torch's zip layout around pickles made with the standard pickle module that would
                     run a command creating /tmp/microspec_pwned_<name> if unpickled by Python:
                     os.system (protocol 2: GLOBAL posix.system), builtins.eval (protocol 4:
                     STACK_GLOBAL), subprocess.call (protocol 3), an INST opcode naming os.system, and REDUCE on an
                     allowed storage type (torch.FloatStorage called with arguments).

    /work/torchenv/bin/python scripts/make_checkpoint_fixtures.py            # everything
    python3 scripts/make_checkpoint_fixtures.py --hostile-only               # no torch needed
    python3 scripts/make_checkpoint_fixtures.py --check-hostile              # proves the payloads are live:
                                                                             # Python's own pickle runs them
"""
import argparse
import builtins
import io
import os
import pathlib
import pickle
import struct
import subprocess
import zipfile

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "checkpoint"


def pwned(name):
    return f"/tmp/microspec_pwned_{name}"


class System:
    def __reduce__(self):
        return (os.system, (f"touch {pwned('system')}",))


class Eval:
    def __reduce__(self):
        return (builtins.eval, (f"open('{pwned('eval')}', 'w').close()",))


class Subprocess:
    def __reduce__(self):
        return (subprocess.call, (["touch", pwned("subprocess")],))


def hostile_pickles():
    inst = b"(X" + struct.pack("<I", len(f"touch {pwned('inst')}")) + f"touch {pwned('inst')}".encode() + b"ios\nsystem\n."
    # REDUCE on a storage type: a persistent-id-only global used as a callable.
    storage_call = b"\x80\x02}q\x00X\x01\x00\x00\x00wctorch\nFloatStorage\nK\x03\x85Rs."
    return {
        "hostile_system.bin": pickle.dumps({"weight": System()}, protocol=2),
        "hostile_eval.bin": pickle.dumps({"weight": Eval()}, protocol=4),
        "hostile_subprocess.bin": pickle.dumps({"weight": Subprocess()}, protocol=3),
        "hostile_inst.bin": inst,
        "hostile_storage_call.bin": storage_call,
    }


def torch_zip(path, pkl, archive="archive"):
    """torch.save's container: stored entries under one folder."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", pkl)
        z.writestr(f"{archive}/byteorder", "little")
        z.writestr(f"{archive}/version", "3\n")


def write_torch_fixtures():
    import collections
    import torch
    sd = collections.OrderedDict()
    sd["a"] = (torch.arange(6, dtype=torch.float32) / 4).reshape(2, 3)
    sd["b"] = torch.tensor([1.5, -2, 0.25, 65504], dtype=torch.float16)
    sd["c"] = torch.tensor([[3, -0.25], [1e30, -7]], dtype=torch.bfloat16)
    sd["d2t"] = torch.tensor([0, 1, 5], dtype=torch.int64)
    sd["t2d"] = torch.tensor([True, False, False, True])
    rows = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    sd["rows"] = rows
    sd["row"] = rows[1]
    torch.save(sd, OUT / "state_dict.bin")
    torch.save({"t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t()}, OUT / "transposed.bin")
    torch.save({"a": sd["a"]}, OUT / "legacy.bin", _use_new_zipfile_serialization=False)
    with zipfile.ZipFile(OUT / "state_dict.bin") as src, \
            zipfile.ZipFile(OUT / "compressed.bin", "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hostile-only", action="store_true")
    ap.add_argument("--check-hostile", action="store_true")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if a.check_hostile:
        for name, pkl in hostile_pickles().items():
            if name == "hostile_storage_call.bin":
                continue  # needs torch to resolve
            target = pwned(name[len("hostile_"):-len(".bin")])
            if os.path.exists(target):
                os.remove(target)
            with zipfile.ZipFile(OUT / name) as z:
                try:
                    pickle.loads(z.read("archive/data.pkl"))
                except Exception:
                    pass
            print(f"{name}: Python's pickle {'RAN the payload' if os.path.exists(target) else 'did not run it'}")
            if os.path.exists(target):
                os.remove(target)
        return
    for name, pkl in hostile_pickles().items():
        torch_zip(OUT / name, pkl)
    if not a.hostile_only:
        write_torch_fixtures()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
