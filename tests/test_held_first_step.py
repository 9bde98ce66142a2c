"""The first optimizer step's boundary, held until the program shows how it numbers its steps
(Session._release_held_step), meeting flushes inside steps, other threads, stop/start gaps and other
options: every row stays in its step, in order, and the buffer bounded. (Out of
test_combinations.py, whose length made it the last file make test finished.)"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import FULL, ROOT, check_invariants, dump_of, full, read, run_cli, run_folders, run_python, source_env

PROGS = os.path.join(ROOT, "tests", "progs")
SOURCES = ["native", "python"]
_env, _python = source_env, run_python


# the short form: each source and watch once, the analyses taking turns (make test's time)
@pytest.mark.parametrize("source,watch,analysis", full(
    [("python", "", "leaks"), ("native", "watch", "leaks,decompose")],  # (make test's time)
    [(s, w, a) for s, w in [(s, "") for s in SOURCES] + [("native", "watch")] for a in ("leaks,decompose", "leaks")]))
def test_a_held_first_step_keeps_the_rows_in_order_when_a_thread_records_inside_its_flush(tmp_path, source,
                                                                                        analysis, watch):
    """The first optimizer step's boundary is held until the second (Session._release_held_step):
    then step 1's rows and its STEP row are flushed alone while the rows of step 2 wait in the
    buffer. A thread that records inside that flush (the owner labeller drains the native source
    there) must have its rows written after the waiting ones: written between the STEP 1 row and
    them (as in CI, ~2% of runs of the test above), ``used`` broke its running sum and times went
    backwards on the thread. With watch, the native source hands over to the dispatch-mode source
    first and its later rows are merged by time into the buffer at each drain."""
    import polars as pl
    out = tmp_path / "out"
    r = _python([os.path.join(PROGS, "held_step_threads.py"), str(out), analysis, *([watch] if watch else [])],
                source)
    fired = int(r.stdout.split("FIRED", 1)[1])
    assert fired >= 1  # the thread did record inside the release of the held step
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    backwards = df.filter(pl.col("ts").diff().over("tid") < 0)
    assert backwards.height == 0, backwards.select("id", "event", "tid", "ts")
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert [json.loads(a)["step"] for a in steps["attr"].to_list()][:3] == [1, 2, 3]
    # the blocks the other thread keeps are in the dump, in step 2
    kept = df.filter((pl.col("event") == "MALLOC") & (pl.col("size") == 12000))
    assert kept.height >= fired and set(kept["step"].to_list()) == {2}, kept.select("id", "step", "tid")


# 64 rows, the flush bound of these runs, and one op's rows (Adam's first step: 37); rows kept in the
# buffer past a flush not counted against the native source's drain: 132-139 at a flush
BOUND = 64 + 44


def _held_run(tmp_path, source, numbering, rows, extra, options=("--analysis=leaks,decompose",), early=None,
              main_only=False):
    """held_first_step.py's dump: (rows of each step but OWNER rows, as a multiset, only the main
    thread's with ``main_only``; step ends of the decomposition, where it ran; what the program printed)."""
    import collections
    out = tmp_path / f"{numbering}-{rows}-{extra}-{early}"
    r = run_cli([*options, "--output", str(out), sys.executable, os.path.join(PROGS, "held_first_step.py"),
                 numbering, str(rows), str(extra), *([early] if early else [])], env=_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    printed = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    df = read(dump_of(printed["folder"]))
    check_invariants(df)
    per = collections.defaultdict(collections.Counter)
    for e, t, size, step, tid in df.select("event", "event_type", "size", "step", "tid").iter_rows():
        if main_only and e != "SYSTEM" and str(tid) != str(printed["main"]):
            continue
        if t != "OWNER":  # a flush inside a step writes MALLOC rows before their owner is known
            per[step][(e, t, size)] += 1
    ends = None
    if os.path.exists(os.path.join(printed["folder"], "analysis", "decompose.json")):
        with open(os.path.join(printed["folder"], "analysis", "decompose.json")) as f:
            ends = {s["step"]: s["bytes"] for s in json.load(f)["steps"] if s["step"] is not None}
    return per, ends, printed


_HELD_ORDERS = [("optimizer", False), ("api", False), ("optimizer", "early"), ("optimizer", "gap"), ("api", "gap")]


# the short form: each way of numbering and flushing once, the sources taking turns (make test's time)
@pytest.mark.parametrize("source,numbering,early", full(
    [("native", "optimizer", "early"), ("python", "api", "gap")],  # (each numbering, each extra: make test's time)
    [(s, n, e) for n, e in _HELD_ORDERS for s in SOURCES]))
def test_flushes_while_the_first_step_is_held_keep_each_row_in_its_step(tmp_path, source, numbering, early):
    """Step 1's boundary is held from the first optimizer step until the program shows how it
    numbers its steps. Flushes in that time (FLUSH_ROWS = 64: several a step) write only the rows
    before it: every step then has the rows and the step end it has with the default bound, where
    step 1 took all of step 2's rows (985 rows of 517, and step 2 one row). The buffer and each
    write stay within the bound plus one op's rows: the rows kept past a flush count against the
    native source's next drain. ``early="early"``: the program flushes right after its first optimizer
    step, so that the boundary is first in the buffer with few rows after it (the native source's
    records were not drained before the check that lets them wait: 561 rows at a flush);
    ``"gap"``: it stops and starts tracing while the boundary is held (stop() writes it), against
    the same program with the default bound."""
    per0, ends0, _ = _held_run(tmp_path, source, numbering, 0, 3, early=early if early == "gap" else None)
    per, ends, printed = _held_run(tmp_path, source, numbering, 64, 3, early=early)
    assert len(printed["writes"]) > 3 * 6  # flushes inside every step
    assert max(printed["writes"]) <= BOUND and printed["full"] <= BOUND, printed
    # five steps ended, then the rows after them; stop() writes the held boundary where it happened,
    # so a program numbering its steps that stops inside step 1 has its own steps from 2 (docs)
    assert sorted(per) == sorted(per0) == list(range(1, 7 + ((numbering, early) == ("api", "gap"))))
    for step in per0:
        assert per[step] == per0[step], (step, sum(per[step].values()), sum(per0[step].values()))
    assert ends == ends0 and sorted(ends)[:5] == [1, 2, 3, 4, 5]


_HELD_OPTIONS = {
    "steps": ("--steps=2,3",),                            # only some steps recorded: the flags follow the hold
    "inefficient": ("--analysis=inefficient",),           # access and launch events, the inefficient fold
    "watch": ("--watch=torch._ops.aten.relu.default,torch._ops.aten.threshold_backward.default",
              "--analysis=leaks,decompose"),              # watch: a handover to the dispatch-mode source
    "stacks-oom": ("--call-stack=python:5", "--analysis=leaks,oom"),  # stacks in the rows, the OOM analysis's hooks
}


# the short form: two options, the sources taking turns (watch hands over to the dispatch-mode
# source, so it runs on the native one); the long form: every option on both
@pytest.mark.parametrize("source,options", full(
    [("native", _HELD_OPTIONS["watch"])],  # (make test's time)
    [(s, o) for o in _HELD_OPTIONS.values() for s in SOURCES]),
    ids=lambda v: v if isinstance(v, str) else next(k for k, o in _HELD_OPTIONS.items() if o == v))
def test_flushes_while_the_first_step_is_held_with_other_options(tmp_path, source, options):
    """The held first step's flushes (FLUSH_ROWS = 64) with other options on: every step has the rows
    it has with the default bound, every dump keeps its invariants (_held_run)."""
    per0, ends0, _ = _held_run(tmp_path, source, "optimizer", 0, 3, options)
    per, ends, printed = _held_run(tmp_path, source, "optimizer", 64, 3, options)
    assert len(printed["writes"]) > 10 and printed["full"] <= BOUND, printed  # flushes inside steps
    assert sorted(per) == sorted(per0) == [1, 2, 3, 4, 5, 6]
    for step in per0:
        assert per[step] == per0[step], (step, sum(per[step].values()), sum(per0[step].values()))
    assert ends == ends0


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test has a thread recording inside a held first step's flush in test_a_held_first_step_keeps_the_rows_in_order_when_a_thread_records_inside_its_flush")
@pytest.mark.parametrize("source,numbering", full([("native", "optimizer")],
                                                 [(s, n) for s in SOURCES for n in ("optimizer", "api")]))
def test_flushes_while_the_first_step_is_held_with_a_thread_allocating(tmp_path, source, numbering):
    """The held first step's flushes (FLUSH_ROWS = 128) while another thread allocates and frees all
    along: its rows land anywhere among the main thread's, before and after the held boundary and
    between the flushes' drains. The main thread's rows of every step are those of the run at the
    default bound; every thread's times never go backwards; the buffer stays bounded (the other
    thread adds a few rows between an op's exit and the flush it asks for); invariants hold."""
    import polars as pl
    per0, ends0, _ = _held_run(tmp_path, source, numbering, 0, 3, early="thread", main_only=True)
    per, _, printed = _held_run(tmp_path, source, numbering, 128, 3, early="thread", main_only=True)
    assert len(printed["writes"]) > 2 * 6 and printed["full"] <= 128 + 44 + 64, printed
    assert sorted(k for k in per if k is not None) == sorted(k for k in per0 if k is not None) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert per[step] == per0[step], (step, sum(per[step].values()), sum(per0[step].values()))
    df = read(dump_of(printed["folder"]))
    assert df.filter(pl.col("ts").diff().over("tid") < 0).height == 0
    other = df.filter((pl.col("event") == "MALLOC") & (pl.col("tid").cast(pl.String) != str(printed["main"])))
    assert other["step"].n_unique() >= 4, other["step"].unique().to_list()  # a thread in every part of the run


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test settles a held first step by a full buffer in test_held_steps.py::test_a_held_first_step_with_later_boundaries_settled_by_a_full_buffer")
def test_a_held_first_step_is_settled_when_the_buffer_fills_before_the_program_numbers_a_step(tmp_path):
    """A program that calls msmemscope.step() more than FLUSH_ROWS rows after its first optimizer
    step: the buffer stays bounded, so the hold ends when it fills (Session._flush_around_held) and
    step 1 ends at the first optimizer step, exactly as a program numbered by its optimizer steps;
    its own steps are numbered from 2 (docs)."""
    per_opt, _, _ = _held_run(tmp_path, "native", "optimizer", 64, 100)
    per, _, printed = _held_run(tmp_path, "native", "api", 64, 100)
    assert max(printed["writes"]) <= BOUND and printed["full"] <= BOUND, printed
    assert per[1] == per_opt[1] and sum(per[1].values()) > 100
    steps = sorted(s for s in per if s is not None)
    assert steps == list(range(1, 8))  # step 1, then the program's five msmemscope.step() calls, then the rest
