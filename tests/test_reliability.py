"""Reliability and safety (issue 12): faults at random points of a 50-step run, inside backward
and inside a flush; the launcher forwarding SIGTERM; bit-identical losses under more options;
millions of events; every bad input for every offline command; what we write is never
overwritten, never written through a planted symlink, 0o640/0o750, and safe in a spreadsheet."""
import csv
import importlib.util
import io
import json
import os
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import warnings

import polars as pl
import pytest

from conftest import (EXAMPLES, ROOT, check_invariants, dump_of, env_for_tests, read, run_cli, run_folders)
from msmemscope import cli
from msmemscope.events import HEADER

SCRIPTS = os.path.join(ROOT, "tests", "scripts")
STATUS = {"exception": 1, "exit": 3, "os_exit": 5, "sigterm": 128 + signal.SIGTERM,
          "sigint": 128 + signal.SIGINT, "sigkill": 128 + signal.SIGKILL, "alloc": 1}


def _fault_cases():
    """Each fault at a random step of the 50 and a random point inside it; fixed seeds, so a
    failure reproduces. Plus every fault inside backward and SIGTERM/SIGINT inside a flush."""
    cases = []
    for mode in STATUS:
        rng = random.Random(f"fault-{mode}")
        cases.append((mode, rng.randint(2, 50), rng.choice(["start", "forward", "backward", "optimizer"])))
    cases += [(m, 13, "backward") for m in ("exception", "sigterm", "alloc", "sigkill")]
    cases += [("sigterm", 9, "flush"), ("exit", 4, "flush")]
    return cases


def _check_stopped_run(df):
    """SPEC §1 invariants on a run stopped from outside: an op in flight when the signal came
    has its ATEN_START and no ATEN_END (at most one per thread); everything else pairs up."""
    open_rows = {}
    for rid, ev, et, tid in df.select("id", "event", "event_type", "tid").iter_rows():
        if ev == "OP_LAUNCH":
            st = open_rows.setdefault(tid, [])
            if et == "ATEN_START":
                st.append(rid)
            elif st:
                st.pop()
    in_flight = [r for st in open_rows.values() for r in st]
    assert len(in_flight) <= len(open_rows)
    check_invariants(df.filter(~pl.col("id").is_in(in_flight)))


def _ids_contiguous(df):
    assert df["id"].to_list() == list(range(1, df.height + 1)), "rows lost: IDs are not 1..n"


@pytest.mark.parametrize("mode,at,phase", _fault_cases())
def test_fault_at_random_point(out_dir, mode, at, phase):
    r = run_cli(["-o", str(out_dir), os.path.join(SCRIPTS, "faults_phase.py"), mode, str(at), phase])
    assert r.returncode == STATUS[mode], r.stderr  # the program's own status
    assert r.stdout.count("step") == at - 1
    [folder] = run_folders(out_dir)
    df = read(dump_of(folder))
    check_invariants(df)
    _ids_contiguous(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height
    # every completed step is there; a fault inside the step-end flush loses nothing of it
    assert steps == (at if phase == "flush" else at - 1)
    kinds = df.filter(pl.col("event") == "SYSTEM")["event_type"].to_list()
    assert ("PROC_EXIT" in kinds) == (mode != "sigkill")
    if mode == "exception":
        assert "ValueError: planted failure" in r.stderr


def _wait_for(proc, text):
    for line in proc.stdout:
        if text in line:
            return True
    return False


@pytest.mark.parametrize("how,status", [("default", 128 + signal.SIGTERM), ("7", 7)])
def test_launcher_forwards_sigterm(out_dir, how, status):
    """SIGTERM sent to the launcher (what a scheduler does) reaches the program; the launcher
    returns the program's status: 128+15 if it dies of it, its own exit code if it handles it."""
    p = subprocess.Popen([sys.executable, "-m", "msmemscope", "-o", str(out_dir),
                          os.path.join(SCRIPTS, "sigterm_handler.py"), how], env=env_for_tests(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(p, "step 3")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == status, err
    assert ("saved at" in out) == (how != "default")
    [folder] = run_folders(out_dir)
    df = read(dump_of(folder))
    _check_stopped_run(df)
    _ids_contiguous(df)
    assert df.filter(pl.col("event_type") == "STEP").height >= 3
    assert df.filter(pl.col("event") == "SYSTEM")["event_type"][-1] == "PROC_EXIT"
