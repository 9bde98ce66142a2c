"""A held first optimizer step while two threads train (Session._hold_later, _flush_held_later):
the order of the threads' optimizer steps and ``msmemscope.step()`` calls forced with events
(tests/progs/held_step_orders.py), on both capture sources."""
from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT, check_invariants, dump_of, full, read, run_folders, run_python as _python

PROGS = os.path.join(ROOT, "tests", "progs")
_ORDERS = ["numbered-main-first", "numbered-other-first", "optimizer"]


# make test: each order once, each source and the labeller met; the full run: every order with each
@pytest.mark.parametrize("order,source,analysis", full(
    [("numbered-main-first", "native", "leaks,decompose"), ("optimizer", "python", "leaks")],  # (make test's time)
    [(o, s, a) for o in _ORDERS for s, a in [("native", "leaks"), ("python", "leaks"), ("native", "leaks,decompose")]]))
def test_a_held_first_step_waits_for_each_thread_to_step_twice(tmp_path, source, analysis, order):
    """The first optimizer step's boundary is held until the program shows how it numbers its steps.
    Another thread's optimizer (a model trained beside the one the program numbers) stepped in that
    time and was taken for the program's second step: its steps became boundaries, 10-11 STEP rows
    for 6 ``msmemscope.step()`` calls (100 calls gave 106-112, by timing). A hold now settles as
    optimizer steps only once every thread that stepped has stepped twice; the boundaries met
    meanwhile are kept where they happened and go with step 1's when the program numbers."""
    import polars as pl
    out = tmp_path / "out"
    r = _python([os.path.join(PROGS, "held_step_orders.py"), str(out), analysis, order, "5"], source)
    made = int(r.stdout.split("BOUNDARIES", 1)[1].split()[0])
    # an analysis told of each step end is told of each once, in order, after its STEP row
    assert r.stdout.split("ENDS", 1)[1].strip() == str([(k, k) for k in range(1, made + 1)])
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert [json.loads(a)["step"] for a in steps["attr"].to_list()] == list(range(1, made + 1))
    assert f"({made} steps checked)" in r.stderr, r.stderr[-2000:]
    if order == "optimizer":
        # each boundary where it happened: the forced turns of the two threads are steps 1-4, each
        # with the MALLOC rows of one thread only, and its STEP row on that thread
        main = steps["tid"][0]
        turns = [main, None, main, None]
        per_step = df.filter(pl.col("event") == "MALLOC").group_by("step").agg(pl.col("tid").unique())
        by_step = {s: set(t) for s, t in per_step.iter_rows()}
        other = (by_step[2] - {main}).pop()
        for k, tid in enumerate(turns, 1):
            assert by_step[k] == {tid or other}, (k, by_step[k])
            assert steps["tid"][k - 1] == (tid or other)
    if "decompose" in analysis:
        owners = df.filter(pl.col("event") == "MALLOC")["owner"].to_list()
        assert owners and all(owners), sorted({o for o in owners if not o})


def test_a_held_first_step_with_later_boundaries_settled_by_a_full_buffer(tmp_path):
    """The buffer holds every row since step 1's held boundary; when it fills (here a 600-row bound;
    FLUSH_ROWS in a run) before the program shows how it numbers its steps, the optimizer steps are
    taken to be the steps: step 1's rows, then each later boundary's, are flushed each through its
    STEP row, and an analysis is told of every step end once, in order, after its STEP row (the
    later boundaries' went out unannounced when only step 1's was flushed apart)."""
    import polars as pl
    out = tmp_path / "out"
    r = _python([os.path.join(PROGS, "held_step_orders.py"), str(out), "leaks", "numbered-other-first", "5", "600"],
                "python")
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    k = steps.height
    assert k > 6  # settled as optimizer steps: the other thread's three boundaries and the main thread's
    assert [json.loads(a)["step"] for a in steps["attr"].to_list()] == list(range(1, k + 1))
    assert r.stdout.split("ENDS", 1)[1].strip() == str([(j, j) for j in range(1, k + 1)])
