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

from conftest import ROOT, check_invariants, dump_of, env_for_tests, full, read, run_folders, run_ways
from msmemscope.capture import native

pytestmark = pytest.mark.skipif(native.load_module() is None,
                                reason="the native module is not built (python -m msmemscope.capture.native build)")


# {}: every step boundary a STEP record in the drains' bytes; --steps: the boundaries' other path
@pytest.mark.parametrize("opts", full([], [{}]) + [{"analysis": "inefficient", "call_stack": "python:5", "steps": "2,3,5"}])
def test_native_bytes_load_as_the_rows(tmp_path, opts):
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"  # a frame per step: pieces in several frames
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "handoff_rows.py"), str(tmp_path),
                        json.dumps(opts)], env=env, capture_output=True, text=True, timeout=300)
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
    got = run_ways(tmp_path, PROG, fmt, {"pieces": {}, "marshal": {"MSMEMSCOPE_HANDOFF": "marshal"}})
    dfs = {how: df for how, (_, df) in got.items()}
    a, b = dfs["pieces"], dfs["marshal"]
    assert a.height == b.height > 100
    cols = [c for c in STABLE if c in a.columns]
    assert a.select(cols).equals(b.select(cols))


NAPPING = """
import os, sys, time, torch, msmemscope
from msmemscope import capture
from msmemscope.io import spool
msmemscope.config(output=sys.argv[1], collect_mode="immediate", analysis="leaks")
m = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
flags = None
for i in range(8):
    m(torch.randn(4, 64)).sum().backward(); opt.step(); opt.zero_grad()
    msmemscope.step()
    time.sleep(3 * spool.NAP_MAX)  # frames then land while the writer naps
if sys.argv[2] == "sigkill":  # the last step's frame was written while the writer napped
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
w = capture.current().writer  # the writer process, started with the first batch, has the rows of all
for _ in range(100):
    with open(f"/proc/{w._proc.pid}/fdinfo/0") as f:
        flags = int(next(l for l in f if l.startswith("flags:")).split()[1], 8)
    if flags & os.O_NONBLOCK:
        break
    time.sleep(0.05)
msmemscope.stop()
print(flags & os.O_NONBLOCK != 0)
"""


@pytest.mark.parametrize("end", ["stop", "sigkill"])
def test_writer_naps_instead_of_waiting_in_read(tmp_path, end):
    """The writer process reads the pipe non-blocking and naps while it is empty (a process asleep
    in read() is woken by every write: 20-70 us of the traced process's time a frame on a virtual
    machine). Frames written while it naps all reach the dump, in order, steps and all, also when
    the program is killed (SIGKILL) while the writer naps: the frames were in the pipe."""
    from msmemscope.io import spool
    prog = tmp_path / "prog.py"
    prog.write_text(NAPPING)
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"  # a frame per step, each written while the writer naps
    r = subprocess.run([sys.executable, str(prog), str(tmp_path / "out"), end], env=env,
                       capture_output=True, text=True, timeout=300)
    if end == "sigkill":
        assert r.returncode == -9, r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-1] == "True", r.stdout
    [folder] = run_folders(tmp_path / "out")
    assert spool.wait_for_writer(dump_of(folder), timeout=60)
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps.height == 8
    assert df.filter(pl.col("event") == "MALLOC").height >= 8 * 2
