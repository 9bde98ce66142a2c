"""Faults in the traced program: the dump stays readable and complete up to the
last flush, the invariants hold, and the launcher returns the program's status."""
import os
import signal

import polars as pl
import pytest

from conftest import ROOT, check_invariants, dump_of, read, run_cli, run_folders

SCRIPT = os.path.join(ROOT, "tests", "scripts", "faults.py")


@pytest.mark.parametrize("mode,at,status", [
    ("exception", 7, 1),
    ("exit", 9, 3),
    ("os_exit", 5, 5),
    ("sigterm", 11, 128 + signal.SIGTERM),
    ("sigint", 6, 128 + signal.SIGINT),  # Python re-raises an uncaught KeyboardInterrupt as SIGINT
    ("sigkill", 8, 128 + signal.SIGKILL),
    ("alloc", 4, 1),
])
def test_fault_keeps_dump(out_dir, mode, at, status):
    r = run_cli(["-o", str(out_dir), SCRIPT, mode, str(at)])
    assert r.returncode == status, r.stderr
    assert r.stdout.count("step") == at - 1
    [folder] = run_folders(out_dir)
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height
    assert steps == at - 1  # every completed step is in the dump
    kinds = df.filter(pl.col("event") == "SYSTEM")["event_type"].to_list()
    if mode == "sigkill":
        assert "PROC_EXIT" not in kinds  # nothing runs after SIGKILL; the flushed steps remain
    else:
        assert kinds[-1] == "PROC_EXIT"
    if mode == "exception":
        assert "ValueError: planted failure" in r.stderr  # the program's own error, unchanged
    if mode == "alloc":
        assert "RuntimeError" in r.stderr
