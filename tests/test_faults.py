"""Faults in the traced program: the dump stays readable and complete up to the
last flush, the invariants hold, and the launcher returns the program's status."""
import os
import signal

import polars as pl
import pytest

from conftest import ROOT, check_invariants, dump_of, env_for_tests, full, read, run_cli, run_folders

SCRIPT = os.path.join(ROOT, "tests", "scripts", "faults.py")


# make test: one fault here (an exception in the program); test_reliability.py's test_fault_at_random_point
# runs every fault (at random points, with the same checks and more; make test: a refused allocation and
# SIGKILL), so the long form alone repeats them all here
@pytest.mark.parametrize("mode,at,status", full([("exception", 7, 1)], [
    ("exception", 7, 1),
    ("exit", 9, 3),
    ("os_exit", 5, 5),
    ("sigterm", 11, 128 + signal.SIGTERM),
    ("sigint", 6, 128 + signal.SIGINT),  # Python re-raises an uncaught KeyboardInterrupt as SIGINT
    ("sigkill", 8, 128 + signal.SIGKILL),
    ("alloc", 4, 1),
]))
def test_fault_keeps_dump(out_dir, mode, at, status):
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"  # every step flushed at its end: a SIGKILL keeps them all
    r = run_cli(["-o", str(out_dir), SCRIPT, mode, str(at)], env=env)
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


# ---------------------------------------------------------------- failures of the tool (issue 21)
# The rule: a failure of the tool is the tool's. It stops tracing, says so once on stderr and in
# config.json, keeps what it already wrote readable, and the program runs on with its own exit
# status and its own stdout.
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from conftest import config_of, env_for_tests  # noqa: E402

TRAIN = os.path.join(ROOT, "tests", "scripts", "train_small.py")
STEPS = 8


@pytest.fixture(scope="module")
def plain_stdout():
    r = subprocess.run([sys.executable, TRAIN, str(STEPS), "4"], capture_output=True, text=True,
                       env=env_for_tests(), timeout=300)
    assert r.returncode == 4
    return r.stdout


def _readable_prefix(folder):
    """The dump holds a readable prefix of the run: IDs 1..n, every FREE after its MALLOC, ops
    paired except at most one per thread left open where the writing stopped."""
    df = read(dump_of(folder))
    assert df["id"].to_list() == list(range(1, df.height + 1))
    open_rows = {}
    for rid, ev, et, tid in df.select("id", "event", "event_type", "tid").iter_rows():
        if ev == "OP_LAUNCH":
            st = open_rows.setdefault(tid, [])
            st.append(rid) if et == "ATEN_START" else st and st.pop()
    in_flight = [r for st in open_rows.values() for r in st]
    assert len(in_flight) <= max(1, len(open_rows))
    check_invariants(df.filter(~pl.col("id").is_in(in_flight)))
    return df


def _traced(out_dir, extra_env=None, args=(), preexec=None):
    env = env_for_tests()
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(out_dir), *args, TRAIN,
                           str(STEPS), "4"], capture_output=True, text=True, env=env, timeout=300,
                          preexec_fn=preexec)


def _check_tool_failure(r, out_dir, plain_stdout, said=True):
    assert r.returncode == 4, r.stderr          # the program's own status
    assert r.stdout == plain_stdout             # the program's own output, every step
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "tracing stopped" in ln or "tracing disabled" in ln]
    assert len(lines) == (1 if said else 0), r.stderr  # said once
    folders = run_folders(out_dir)
    assert len(folders) == 1
    if not os.path.isfile(os.path.join(folders[0], "config.json")):
        assert "tracing disabled" in r.stderr  # failed before the run existed: nothing traced
        return None
    if not said:
        return _readable_prefix(folders[0])
    cfg = config_of(folders[0])
    from msmemscope.io.writers import last_id_in
    df = _readable_prefix(folders[0]) if last_id_in(dump_of(folders[0])) else None  # else: the header alone
    if "tool_failure" in cfg:  # config.json could be written after the failure
        assert cfg["tool_failure"] in lines[0]
        assert df is None or cfg["rows_kept"] == df.height
    return df


def _limit_file_size(n):
    def set_it():
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return set_it


@pytest.mark.parametrize("fmt", full(["csv"], ["csv", "db", "zstd"]))
def test_disk_full_mid_run_the_program_runs_on(out_dir, plain_stdout, fmt):
    """Item 4: a file-size limit (RLIMIT_FSIZE, what a full disk looks like to a write) reached
    mid-run. Before: OSError (db: sqlite3.OperationalError) raised into optimizer.step() through
    the optimizer hook, exit 1, an atexit traceback. Now: tracing stops, said once, config.json says
    why, the dump holds every row up to the failure, the program finishes with its own status."""
    # zstd (--compress): the limit met inside a frame; the frames before it stay readable
    args = ["--compress=zstd"] if fmt == "zstd" else [f"--data-format={fmt}"]
    r = _traced(out_dir, args=args, preexec=_limit_file_size((12 if fmt == "zstd" else 96) << 10))
    df = _check_tool_failure(r, out_dir, plain_stdout)
    cfg = config_of(run_folders(out_dir)[0])
    assert "tool_failure" in cfg and ("File too large" in cfg["tool_failure"] or "full" in cfg["tool_failure"])
    assert df is not None and df.height > 100  # the steps before the failure are there
    assert df.filter(pl.col("event_type") == "STEP").height < STEPS  # and it did stop mid-run


def _fault_cases():
    """Every counted write of each process fails in turn (long form); a spread of them (short)."""
    if full(False, True):
        return [(role, n, e) for role, top in (("writer", 12), ("traced", 16))
                for e in ("ENOSPC", "EIO", "EPIPE") for n in range(1, top + 1)]
    return [("writer", 2, "ENOSPC"), ("traced", 6, "EPIPE"), ("traced", 4, "EACCES")]


def test_every_write_failing_in_turn(tmp_path, plain_stdout):
    """Past the list: fault injection (MSMEMSCOPE_FAULT) makes one write of the writer process or of
    the traced process fail (ENOSPC, EIO, EPIPE, EACCES: the folder made unwritable, item 5). The
    program's status and stdout are untouched; the dump is readable up to the failure; a refused
    handover to the writer process (EPIPE) is taken over without losing a row."""
    cases = _fault_cases()

    def one(case):
        role, n, err = case
        out = tmp_path / f"{role}-{n}-{err}"
        out.mkdir()
        return case, out, _traced(out, {"MSMEMSCOPE_FAULT": f"{role}:{n}:{err}"})

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, cases))
    for (role, n, err), out, r in results:
        said = "tracing stopped" in r.stderr or "tracing disabled" in r.stderr
        if role == "traced" and err == "EPIPE" and said is False:
            df = _check_tool_failure(r, out, plain_stdout, said=False)  # taken over: the whole run
            if df is not None:
                assert df.filter(pl.col("event") == "SYSTEM")["event_type"][-1] == "PROC_EXIT"
            continue
        _check_tool_failure(r, out, plain_stdout, said=said)
