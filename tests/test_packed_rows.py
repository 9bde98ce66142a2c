"""A steady loop's flush takes the native source's records with no row tuple made (session.py
``_take_packed``, ``PackedRows``): the writer process gets their marshal bytes, the leak rule their
columns (``StepLeakTracker.consume_columns``). What such a flush writes and finds must be what the
row tuples gave (``MSMEMSCOPE_RECORDS=rows``), flush for flush, with the flushes that must drain
(a Python-side row, a free outside the window, another thread's rows) mixed in."""
import glob
import json
import os
import re
import subprocess
import sys

import polars as pl
import pytest

from conftest import ROOT, check_invariants, dump_of, env_for_tests, full, read, run_folders, run_ways
from msmemscope import leak_native
from msmemscope.capture import native

pytestmark = pytest.mark.skipif(native.load_module() is None or leak_native.load() is None,
                                reason="the native modules are not built (python -m msmemscope.capture.native build)")


ACCESS = {"analysis": "leaks,inefficient"}  # access rows, and the inefficient analysis' chunk columns too


@pytest.mark.parametrize("opts", full([{}, {"thread": True, "call_stack": "python:5", **ACCESS}],
                                      [{}, {"call_stack": "python:5"}, {"thread": True},
                                       {"thread": True, "call_stack": "python:3"}, ACCESS,
                                       {"thread": True, **ACCESS}]),
                         ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_packed_flushes_are_the_rows_they_stand_for(tmp_path, opts):
    """Every packed flush's columns are its bytes' MALLOC/FREE/STEP rows (IDs, names, numbers,
    stacks, STEP tuples, the FREE rows' ids), and a leak sink fed the row tuples of the same flushes
    ends with the very tracker of the sink fed the columns (tests/scripts/packed_rows.py)."""
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"  # a flush per step: many packed flushes between the drained ones
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "packed_rows.py"), str(tmp_path / "out"),
                        json.dumps(opts)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    packed, drained, rows, same = r.stdout.split()[-4:]
    if "analysis" in opts:  # every packed flush also made the chunk columns, access rows among them
        chunks, access = map(int, re.findall(r"^chunks (\d+) access (\d+)$", r.stdout, re.M)[-1])
        assert chunks == int(packed) and access > 100, r.stdout
    # marks at two steps, a stop/start gap, the held first step: those flushes drain; the others not
    # (with the other thread too: the leak sink reads its FREE records where they wait, no drain)
    assert int(packed) >= 3 and int(drained) >= 3, r.stdout
    assert int(rows) > 500
    assert same == "True"
    [folder] = run_folders(tmp_path / "out")
    df = read(dump_of(folder))
    check_invariants(df)
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    # the blocks the loop keeps, found (leaks of a growing site, or retained where the marks' labels
    # split the site)
    found = [lk for lk in res["leaks"] + res["retained"] if lk["op"] == "torch._ops.aten.ones.default"]
    assert len(found) >= 7, res


PROG = """
import torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
kept = []
for i in range(8):
    loss = m(torch.randn(8, 16)).sum()
    loss.backward(); opt.step(); opt.zero_grad()
    kept.append(torch.ones(100 * (i + 1)))
"""
STABLE = ["id", "event", "event_type", "name", "device", "alloc_id", "size", "used", "owner", "py_stack"]


def _flushes(folder):
    [log] = glob.glob(os.path.join(folder, "msmemscope_logs", "*.log"))
    with open(log) as f:
        got = re.findall(r"trace stopped \((\d+) flushes so far, (\d+) of them", f.read())
    return tuple(map(int, got[-1]))


@pytest.mark.parametrize("args", full([["--call-stack=python:4"], ["--analysis=leaks,inefficient"]],
                                      [[], ["--call-stack=python:4"], ["--data-format=db"], ["--keep-steps=3"],
                                       ["--analysis=leaks,inefficient"],
                                       ["--analysis=inefficient", "--call-stack=python:4"]]),
                         ids=lambda a: "+".join(x.lstrip("-") for x in a) or "default")
def test_dump_and_leaks_are_those_of_the_row_tuples(tmp_path, args):
    """The same program with packed flushes and with every flush drained into tuples: the dumps'
    rows and the leak analysis' result are the same (addresses aside: two processes)."""
    ways = run_ways(tmp_path, PROG, args, {"packed": {"MSMEMSCOPE_STEP_FLUSH_S": "0"},
                                           "rows": {"MSMEMSCOPE_STEP_FLUSH_S": "0", "MSMEMSCOPE_RECORDS": "rows"}})
    got = {}
    access = any("inefficient" in a for a in args)
    for how, (folder, df) in ways.items():
        res = {}
        if not args or args[0] != "--analysis=inefficient":
            with open(os.path.join(folder, "analysis", "leaks.json")) as f:
                res = json.load(f)
            for lk in res["leaks"] + res["retained"]:
                lk.pop("addr", None), lk.pop("address", None)
        if access:
            with open(os.path.join(folder, "analysis", "inefficient.json")) as f:
                res["inefficient"] = json.load(f)
            res["inefficient"].pop("dump")
        got[how] = (df, res, _flushes(folder))
    (a, ra, fa), (b, rb, fb) = got["packed"], got["rows"]
    assert fb[1] == 0 and fa[1] >= 5, (fa, fb)  # (the steps after the held first one)
    assert a.height == b.height > 100
    cols = [c for c in STABLE if c in a.columns]
    assert a.select(cols).equals(b.select(cols))
    assert ra == rb
    if access:  # found on the access rows, whose flushes were packed too
        assert (a["event"] == "ACCESS").sum() > 100
        assert ra["inefficient"]["events"]["access"] > 100 and ra["inefficient"]["blocks"] > 0
    else:
        assert ra["sites"]
    steps = a.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps.height == 8


def test_a_writer_process_killed_before_a_packed_flush(tmp_path):
    """The writer process dies (SIGKILL, as the OOM killer does) after step 4 of
    tests/scripts/writer_killed.py, so the next flush is a packed one that meets the broken pipe:
    the traced process writes it itself, from the tuples made of its bytes. The dump must be the
    dump of the same run with row tuples (the rows the writer had not written when killed are lost
    on both sides, by design: that dump has FREEs without their MALLOC, so it is compared with its
    twin, not checked alone for the invariants), and the program's output unchanged."""
    script = os.path.join(ROOT, "tests", "scripts", "writer_killed.py")
    got = {}
    for how in ("packed", "rows"):
        env = env_for_tests()
        env.update(MSMEMSCOPE_SOURCE="native", MSMEMSCOPE_STEP_FLUSH_S="0", MSMEMSCOPE_TEST_KILL_AT="3")
        if how == "rows":
            env["MSMEMSCOPE_RECORDS"] = "rows"
        r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / how), sys.executable,
                            script], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        [folder] = run_folders(tmp_path / how)
        made = int(re.findall(r"packed rows made from their bytes: (\d+)", r.stdout)[-1])
        got[how] = ([ln for ln in r.stdout.splitlines() if ln.startswith("loss")], read(dump_of(folder)), made,
                    _flushes(folder))
    (la, a, made_a, fa), (lb, b, made_b, fb) = got["packed"], got["rows"]
    assert made_a == 1 and made_b == 0 and fa[1] >= 1 and fb[1] == 0, (made_a, made_b, fa, fb)
    assert la == lb and len(la) == 6
    assert a.height == b.height > 100
    cols = [c for c in STABLE if c in a.columns]
    assert a.select(cols).equals(b.select(cols))
    # the steps after the kill (those before it were in the pipe, lost with the writer)
    assert a.filter(pl.col("event_type") == "STEP").height == b.filter(pl.col("event_type") == "STEP").height >= 2
