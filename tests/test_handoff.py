"""The hand-off to the dump's writer process: the native source's rows go as the marshal bytes it
makes in C++ (``drain(..., want_bytes=True)``, io/spool.py ``join_pieces``), the other rows as
tuples. The bytes must load as the very rows the sinks see, and a dump written that way must be
the dump written by marshalling every row (``MSMEMSCOPE_HANDOFF=marshal``), in every format."""
import json
import os
import subprocess
import sys

import polars as pl
import pytest

from conftest import ROOT, check_invariants, dump_of, env_for_tests, full, read, run_folders
from msmemscope.capture import native

pytestmark = pytest.mark.skipif(native.load_module() is None,
                                reason="the native module is not built (python -m msmemscope.capture.native build)")


@pytest.mark.parametrize("opts", full([{"analysis": "inefficient", "call_stack": "python:5", "steps": "2,3,5"}],
                                      [{}, {"analysis": "inefficient", "call_stack": "python:5", "steps": "2,3,5"}]))
def test_native_bytes_load_as_the_rows(tmp_path, opts):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "handoff_rows.py"), str(tmp_path),
                        json.dumps(opts)], env=env_for_tests(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows, frames, fast = r.stdout.split()
    assert int(rows) > 500 and int(frames) >= 4, r.stdout
    assert fast == "True"  # the leak rule's C++ row loop and block tables (tests/test_leak_rows_native.py) ran too
    [folder] = run_folders(tmp_path)
    df = read(dump_of(folder))
    check_invariants(df)
    if opts:  # the dict attrs of both kinds went through the bytes
        assert df.filter(pl.col("event") == "ACCESS").height > 0
        assert df.filter((pl.col("event") == "MALLOC") & pl.col("attr").str.contains("before_op")).height >= 1
    assert df.filter((pl.col("event") == "FREE") & pl.col("attr").str.contains("untraced")).height >= 1


PROG = """
import torch, msmemscope
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
kept = []
for i in range(6):
    msmemscope.mark(f"step {i}")
    loss = m(torch.randn(8, 16)).sum()
    loss.backward(); opt.step(); opt.zero_grad()
    kept.append(torch.ones(100 * (i + 1)))
"""
STABLE = ["id", "event", "event_type", "name", "device", "alloc_id", "size", "used", "owner", "module", "phase"]


@pytest.mark.parametrize("fmt", full([["--compress=zstd", "--keep-steps=2"]],
                                      [["--data-format=csv"], ["--data-format=db"], ["--compress=zstd"],
                                       ["--keep-steps=2"], ["--compress=zstd", "--keep-steps=2"],
                                       ["--analysis=decompose"], ["--data-format=db", "--analysis=decompose"]]),
                         ids=lambda f: "+".join(x.split("=")[-1] for x in f))
def test_dump_is_the_marshalled_rows_dump(tmp_path, fmt):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    dfs = {}
    procs = {}
    for how in ("pieces", "marshal"):
        env = env_for_tests()
        env["MSMEMSCOPE_SOURCE"] = "native"
        if how == "marshal":
            env["MSMEMSCOPE_HANDOFF"] = "marshal"
        procs[how] = subprocess.Popen([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / how), *fmt,
                                       sys.executable, str(prog)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
    for how, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        [folder] = run_folders(tmp_path / how)
        with open(os.path.join(folder, "config.json")) as f:
            assert json.load(f)["source"] == "native"
        df = read(dump_of(folder))
        check_invariants(df)
        dfs[how] = df
    a, b = dfs["pieces"], dfs["marshal"]
    assert a.height == b.height > 100
    cols = [c for c in STABLE if c in a.columns]
    assert a.select(cols).equals(b.select(cols))
