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


# {}: every step boundary a STEP record in the drains' bytes; --steps: the boundaries' other path;
# decompose: the owner labels and modules given as the records are drained (owner and module texts,
# 8-item attrs, a dict attr labelled)
@pytest.mark.parametrize("opts", full([], [{}]) + [{"analysis": "inefficient", "call_stack": "python:5", "steps": "2,3,5"},
                                                   {"analysis": "decompose"}])
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
    if opts.get("analysis") == "decompose":  # labelled rows went through the bytes
        m = df.filter(pl.col("event") == "MALLOC")
        assert {"PTA@weight", "PTA@gradient", "PTA@optimizer_state"} <= set(m["owner"]), set(m["owner"])
        assert '"module"' in " ".join(m["attr"].to_list())
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


def _some_rows(n):
    return [("MALLOC", "PTA", f"op{i % 7}", 1_700_000_000_000_000_000 + i, 140_000_000_000_000 + i, "cpu",
             1 << 40 | i, (i, 1 << 40 | i, 64 * i, 10 * i, 20 * i, ""), None, None) for i in range(n)]


def test_a_frame_carries_the_native_bytes_as_they_are():
    """Marshal bytes among a frame's pieces are sent after a marshalled head that names their
    lengths (the length flagged ``_RAW``), not copied into one marshalled frame; the writer process
    reads back the same rows in the same order whatever the mix of bytes and row lists, and a
    frame whose bytes do not add up is refused, never read short."""
    import marshal
    from msmemscope.io import spool
    rows = _some_rows(40)
    for pieces in ([marshal.dumps(rows[:15]), rows[15:22], marshal.dumps(rows[22:])],
                   [rows[:5], marshal.dumps(rows[5:])], [marshal.dumps(rows)]):
        parts, raw = spool._frame_parts(11, 4242, None, pieces)
        assert raw and len(parts) == 2 + sum(type(p) is bytes for p in pieces)
        assert parts[-1] is pieces[-1]  # the bytes object itself: nothing copied
        data = b"".join(parts)
        assert spool._read_frame(data, True) == (11, 4242, rows, None)
        with pytest.raises(ValueError):
            spool._read_frame(data[:-3], True)
    parts, raw = spool._frame_parts(11, 4242, {"x": 1}, [rows[:3], rows[3:]])  # no bytes: one marshalled frame
    assert not raw and len(parts) == 1 and spool._read_frame(parts[0], False) == (11, 4242, rows, {"x": 1})


def test_a_frame_larger_than_the_pipe_arrives_whole():
    """``_send`` writes a frame's parts with writev and resumes after each partial write at the
    right byte of the right part: a frame of megabytes through a pipe of 64 KB, read slowly, while
    a timer's signal cuts the blocking writes short (a signal after some bytes ends a write there)."""
    import marshal
    import signal
    import threading
    import time
    from msmemscope.io import spool
    rows = _some_rows(30_000)
    pieces = [marshal.dumps(rows[:10_000]), rows[10_000:10_007], marshal.dumps(rows[10_007:])]
    parts, _ = spool._frame_parts(1, 2, None, pieces)
    size = sum(len(p) for p in parts)
    assert size > 1 << 20
    r, w = os.pipe()
    got = []

    def read():
        while True:
            b = os.read(r, 7_000)
            if not b:
                return
            got.append(b)
            time.sleep(0.0005)
    t = threading.Thread(target=read)
    t.start()
    s = object.__new__(spool.SpoolWriter)
    s._fd, s._bell, s._room = w, None, 1 << 16
    cuts = []
    old = signal.signal(signal.SIGALRM, lambda *a: cuts.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    try:
        s._send((size | spool._RAW).to_bytes(spool._LEN, "little"), *parts)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    os.close(w)
    assert len(cuts) > 3
    t.join(60)
    os.close(r)
    assert s._whole
    data = b"".join(got)
    n = int.from_bytes(data[:spool._LEN], "little")
    assert n & spool._RAW and n & ~spool._RAW == len(data) - spool._LEN == size
    assert spool._read_frame(data[spool._LEN:], True) == (1, 2, rows, None)
