"""Shared test helpers: run the CLI for real, read what it wrote, check the SPEC invariants."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings

import polars as pl
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the original's examples (test_*.py by their own names) are programs test_compat.py runs, not tests
collect_ignore = ["orig_examples"]
EXAMPLES = os.path.join(ROOT, "examples")
# `make test` runs every test in its short form; MSMEMSCOPE_TEST_FULL=1 (make test-full) runs the
# long forms (more steps, more hypothesis examples, more repetitions). Scale with `full(short, long)`.
FULL = os.environ.get("MSMEMSCOPE_TEST_FULL") == "1"


def full(short, long):
    return long if FULL else short


PEER = os.path.join(os.path.dirname(ROOT), "shared", "peer-dumps")
if not os.path.isdir(PEER):
    PEER = os.path.join(ROOT, "tests", "data", "peer-dumps")


# make test's workers take whole files (--dist loadfile) in collection order: the longest files go
# first, so that none of them starts last and runs on alone at the end (the Ray file also waits on
# Ray's own start-up, longer on a loaded machine). By the CPU each took in make test, heaviest first.
HEAVY_FIRST = ("test_ray.py", "test_combinations.py", "test_capture.py", "test_reliability.py",
               "test_held_first_step.py", "test_modules.py", "test_native_source.py", "test_step_flush.py",
               "test_compat.py", "test_watch.py", "test_decompose.py", "test_leak_sites.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda it: rank.get(os.path.basename(str(it.fspath)), len(HEAVY_FIRST)))  # stable


def env_for_tests():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    # no test compiles the native source by surprise (a run with an empty build folder would);
    # the tests of the build on first use turn it on
    env.setdefault("MSMEMSCOPE_NATIVE_BUILD", "0")
    return env


def source_env(source, **extra):
    """The tests' environment with the capture source forced (``native`` / ``python``) and ``extra``."""
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    env.update(extra)
    return env


def run_python(args, source, timeout=300, **extra):
    """``python args`` under ``source_env``; it must exit 0. Returns the CompletedProcess."""
    r = subprocess.run([sys.executable, *args], env=source_env(source, **extra), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def run_cli(args, cwd=None, timeout=600, env=None):
    """Run ``python -m msmemscope args`` and return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "msmemscope", *args], cwd=cwd, env=env or env_for_tests(),
                          capture_output=True, text=True, timeout=timeout)


def read_after_stop(out, opts=None):
    """Run tests/scripts/read_after_stop.py (trace, stop, read the dump, start again) into ``out``;
    return {"first"|"second": (rows read, rows written, last ID)} as the script printed them."""
    args = [sys.executable, os.path.join(ROOT, "tests", "scripts", "read_after_stop.py"), str(out)]
    r = subprocess.run(args + ([json.dumps(opts)] if opts else []), capture_output=True, text=True,
                       env=env_for_tests(), timeout=600)
    assert r.returncode == 0, r.stderr
    seen = {}
    for line in r.stdout.splitlines():
        which, height, written, last = line.split()
        seen[which] = (int(height), int(written), int(last))
    return seen


def run_folders(out_root):
    return sorted(glob.glob(os.path.join(str(out_root), "msmemscope_*")))


def dump_of(folder):
    files = glob.glob(os.path.join(folder, "device_*", "dump", "memscope_dump_*"))
    assert len(files) == 1, files
    return files[0]


def run_ways(tmp_path, prog, args, ways, timeout=300):
    """The program text ``prog`` run under the launcher (``args`` before it) once per way, side by
    side on the native source: ``ways`` maps a name to the environment it adds. Returns {name: (run
    folder, its dump read and checked for the invariants)}."""
    path = tmp_path / "prog.py"
    path.write_text(prog)
    procs, got = {}, {}
    for name, extra in ways.items():
        env = env_for_tests()
        env["MSMEMSCOPE_SOURCE"] = "native"
        env.update(extra)
        procs[name] = subprocess.Popen([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / name), *args,
                                        sys.executable, str(path)], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    for name, p in procs.items():
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        [folder] = run_folders(tmp_path / name)
        assert config_of(folder)["source"] == "native"
        df = read(dump_of(folder))
        check_invariants(df)
        got[name] = (folder, df)
    return got


def config_of(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def read(path):
    from msmemscope.io.reader import read_dump
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return read_dump(path)


def check_invariants(df: pl.DataFrame):
    """SPEC §1: per (device, pool) the running sum of sizes equals ``used`` on every row;
    every FREE has exactly one MALLOC; ATEN_START/END pair per thread; ACCESS names a live block.
    A bounded dump (``--keep-steps``, io/bounded.py): in a step with a ``SYSTEM/STEP_SUMMARY`` row
    the blocks born and dead inside the step are left out, so there ``used`` is at least the
    running sum (the dropped blocks live then), equal again at the step's end. Every step boundary
    is there once and in order: the SYSTEM/STEP rows number consecutive steps."""
    assert df["id"].is_sorted() and df["id"].n_unique() == df.height
    ended = [json.loads(a)["step"] for a in
             df.filter((df["event"] == "SYSTEM") & (df["event_type"] == "STEP"))["attr"].to_list()]
    if ended:
        assert ended == list(range(ended[0], ended[0] + len(ended))), f"STEP rows {ended}"
    summarised = set(df.filter((df["event"] == "SYSTEM") & (df["event_type"] == "STEP_SUMMARY"))["step"].to_list())
    running, live, freed, stacks = {}, {}, set(), {}
    for r in df.select("event", "event_type", "name", "tid", "device", "alloc_id", "size", "used", "step").iter_rows():
        ev, et, name, tid, dev, aid, size, used, step = r
        if ev == "MALLOC":
            assert aid not in live and aid not in freed, f"allocation_id {aid} reused"
            live[aid] = size
            running[(dev, et)] = running.get((dev, et), 0) + size
            if step in summarised:
                assert used >= running[(dev, et)], f"MALLOC {aid}: used {used} < running {running[(dev, et)]}"
            else:
                assert used == running[(dev, et)], f"MALLOC {aid}: used {used} != running {running[(dev, et)]}"
        elif ev == "FREE":
            assert aid in live, f"FREE {aid} without a live MALLOC"
            assert live.pop(aid) == size
            freed.add(aid)
            running[(dev, et)] -= size
            if step in summarised:
                assert used >= running[(dev, et)], f"FREE {aid}: used {used} < running {running[(dev, et)]}"
            else:
                assert used == running[(dev, et)], f"FREE {aid}: used {used} != running {running[(dev, et)]}"
        elif ev == "OP_LAUNCH":
            st = stacks.setdefault(tid, [])
            if et == "ATEN_START":
                st.append(name)
            else:
                assert st and st[-1] == name, f"ATEN_END {name} without its ATEN_START"
                st.pop()
        elif ev == "ACCESS":
            assert aid in live, f"ACCESS to allocation_id {aid} that is not live"
    assert all(not s for s in stacks.values()), f"unclosed ops: {stacks}"
    return live


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, worker_id):
    """``shared_run(name, make)``: one traced run that tests of several files assert on, made once
    per test session however xdist spreads those files over its workers. ``make(folder)`` runs
    the program into ``folder`` and returns what the tests need (JSON-able: stdout, stderr, status);
    every worker gets the same folder and value. A run that failed fails every test that uses it."""
    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # the workers' temp folders share their parent
        base = base.parent
    base = base / "shared-runs"
    base.mkdir(exist_ok=True)

    def get(name, make):
        folder, done = base / name, base / f"{name}.json"
        with FileLock(str(base / f"{name}.lock")):
            if not done.exists():
                folder.mkdir(exist_ok=True)
                done.write_text(json.dumps(make(folder)))
        return folder, json.loads(done.read_text())
    return get


def mlp_all_events(shared_run, fmt):
    """``msmemscope --data-format=<fmt> --events=alloc,free,launch,access examples/mlp.py --steps 4``,
    made once for the session (test_capture.py checks the run, test_reader.py reads its dumps):
    (output root, CompletedProcess-like result)."""
    import types

    def make(folder):
        r = run_cli(["-o", str(folder), f"--data-format={fmt}", "--events=alloc,free,launch,access",
                     os.path.join(EXAMPLES, "mlp.py"), "--steps", "4"])
        return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}
    folder, res = shared_run(f"mlp-all-events-{fmt}", make)
    return folder, types.SimpleNamespace(**res)


#: the transformer example as test_capture.py and test_watch.py compare it, plain and traced
TRANSFORMER_SMALL = ["--steps", "2", "--batch", "1", "--layers", "1"]


def plain_transformer(shared_run):
    """stdout of the plain (untraced) run of examples/transformer.py with ``TRANSFORMER_SMALL``,
    made once for the session: the losses the traced runs must print bit for bit."""
    def make(folder):
        r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "transformer.py"), *TRANSFORMER_SMALL],
                           env=env_for_tests(), capture_output=True, text=True, timeout=600)
        return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr[-3000:]}
    _, res = shared_run("plain-transformer", make)
    assert res["returncode"] == 0, res["stderr"]
    return res["stdout"]


#: the FSDP2 job that test_summary.py and test_combinations.py both assert on (one run, shared)
FSDP2_LAUNCHER = ("fsdp2_ranks.py", "native", "leaks,decompose,inefficient")


def fsdp2_launcher_run(shared_run):
    """``msmemscope --analysis=leaks,decompose,inefficient torchrun --standalone --nproc_per_node=2
    tests/progs/fsdp2_ranks.py`` (gloo, CPU, the native source), made once for the session:
    (the output root, the launcher's CompletedProcess-like result)."""
    import shutil
    import types
    prog, source, analysis = FSDP2_LAUNCHER

    def make(folder):
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        torchrun = torchrun if os.path.exists(torchrun) else shutil.which("torchrun")
        if torchrun is None:
            return {"skip": "torchrun not installed"}
        env = env_for_tests()
        env["MSMEMSCOPE_SOURCE"] = source
        env["PATH"] = os.path.dirname(torchrun) + os.pathsep + env.get("PATH", "")
        r = run_cli([f"--analysis={analysis}", "-o", str(folder), "torchrun", "--standalone",
                     "--nproc_per_node=2", os.path.join(ROOT, "tests", "progs", prog)], env=env)
        return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}
    folder, res = shared_run("fsdp2-launcher", make)
    if "skip" in res:
        pytest.skip(res["skip"])
    return folder, types.SimpleNamespace(**res)


@pytest.fixture
def out_dir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


_THREADS_PLAIN: dict = {}  # args -> the plain run's stdout (the cases of a file share it: one worker runs them)


def threads_run(tmp_path, args, env, options, stdout=None):
    """tests/progs/threads_training.py ``args`` plain and traced with ``options``: (run folder, its
    dump, invariants checked), the traced program's losses the plain one's (the plain run made once
    per test process for the same ``args``: it traces nothing, whatever the source). The traced
    run's stdout is appended to the list ``stdout`` if one is given."""
    prog = os.path.join(ROOT, "tests", "progs", "threads_training.py")
    key = tuple(args)
    if key not in _THREADS_PLAIN:
        plain = subprocess.run([sys.executable, prog, *args], env=env, capture_output=True, text=True, timeout=300)
        assert plain.returncode == 0, plain.stderr[-2000:]
        _THREADS_PLAIN[key] = plain
    plain = _THREADS_PLAIN[key]
    out = tmp_path / "out"
    r = run_cli([*options, "--output", str(out), sys.executable, prog, *args], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]
    if stdout is not None:
        stdout.append(r.stdout)
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    return folder, df
