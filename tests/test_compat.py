"""The original's documented command lines, API and files (issue #18, docs/compat.md).

Every example of the original's ``example/`` folder runs here moved to CPU with the least
edits (tests/orig_examples/README.md lists them), the ways its README shows: the API inside
the script (``python test_x.py``) and the command line (``msmemscope python test_x.py
--option=...``), and the files and console lines its docs describe are checked. The runs
are made once, side by side (module fixture), and shared by the assertions.
"""
from __future__ import annotations

import concurrent.futures as cf
import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import polars as pl
import pytest

from conftest import FULL, ROOT, check_invariants, dump_of, env_for_tests, read, run_cli, run_folders

EXAMPLES = os.path.join(ROOT, "tests", "orig_examples")
PEER = os.path.join(ROOT, "tests", "data", "peer-dumps")
API_SCRIPT = os.path.join(ROOT, "tests", "scripts", "compat_api.py")
TRACE_HEADER = ["FuncInfo", "StartTime(ns)", "EndTime(ns)", "Thread Id", "Process Id"]
WATCH_CLI = "--watch=torch._ops.aten.mse_loss.default,torch._ops.aten.mse_loss_backward.default,full-content"

# name -> (argv after the interpreter or launcher, launched?)
RUNS = {
    "leaks_api": (["test_leaks.py"], False),
    "leaks_cli": (["-q", "python", "test_leaks.py"], True),
    "profile_cli": (["python", "test_profile.py", "--events=alloc,free,launch,traceback"], True),
    "inefficient_api": (["test_inefficient.py"], False),
    "decompose_api": (["test_decompose.py"], False),
    "watch_api": (["test_watch.py"], False),
    "watch_cli": (["python", "test_watch.py", WATCH_CLI], True),
    "example_api": (["example_api.py"], False),
    "example_cmd_cli": (["python", "example_cmd.py", "--analysis=inefficient"], True),
    "api_extras": ([API_SCRIPT, "out"], False),
    "api_extras_cli": (["--analysis=oom:5", "python", API_SCRIPT, "out"], True),
}


# make test runs each example one of the ways its README shows; make test-full runs both
SHORT_LEAVES_OUT = set() if FULL else {"leaks_cli", "watch_api", "example_cmd_cli", "api_extras_cli"}


class _Runs(dict):
    def __missing__(self, name):
        pytest.skip(f"the {name} run is in the long form only (make test-full)")


class Run:
    def __init__(self, name, cwd, proc):
        self.name, self.cwd, self.proc = name, cwd, proc
        self.out, self.err, self.rc = proc.stdout, proc.stderr, proc.returncode

    def folders(self, root):
        return sorted(glob.glob(os.path.join(self.cwd, root, "msmemscope_*")))

    def folder(self, root):
        f = self.folders(root)
        assert len(f) == 1, (self.name, f, self.err[-2000:])
        return f[0]


def _one(name, tmp):
    args, launched = RUNS[name]
    cwd = os.path.join(tmp, name)
    shutil.copytree(EXAMPLES, cwd)
    env = env_for_tests()
    # the README's "msmemscope python test_x.py": `python` is this interpreter
    bindir = os.path.join(cwd, "bin")
    os.mkdir(bindir)
    with open(os.path.join(bindir, "python"), "w") as f:   # a wrapper: a symlink would lose the venv
        f.write(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    os.chmod(os.path.join(bindir, "python"), 0o755)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    cmd = [sys.executable, "-m", "msmemscope", *args] if launched else [sys.executable, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return Run(name, cwd, proc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("compat"))
    with cf.ThreadPoolExecutor(max_workers=3) as ex:
        futs = {n: ex.submit(_one, n, tmp) for n in RUNS if n not in SHORT_LEAVES_OUT}
        return _Runs({n: f.result() for n, f in futs.items()})


def _ok(r):
    assert r.rc == 0, (r.name, r.err[-3000:])
    assert "Traceback" not in r.err, (r.name, r.err[-3000:])


def _dump(folder):
    df = read(dump_of(folder))
    check_invariants(df)
    return df


def _layout(folder):
    """output_file_spec.md: msmemscope_<pid>_<ts>_<backend>/device_<id>/dump/memscope_dump_<ts>.csv,
    msmemscope_logs/msmemscope_<ts>.log, config.json."""
    assert os.path.basename(folder).startswith("msmemscope_") and folder.endswith("_cpu")
    assert glob.glob(os.path.join(folder, "device_cpu", "dump", "memscope_dump_*.csv"))
    assert glob.glob(os.path.join(folder, "msmemscope_logs", "msmemscope_*.log"))
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _leak_lines(err):
    return [ln for ln in err.splitlines() if ln.startswith("Direct ") and " leak of " in ln]


# ---------------------------------------------------------------------------- leaks (point 4)
def test_leaks_example_api_prints_four_leaks_steps_2_to_5(runs):
    r = runs["leaks_api"]
    _ok(r)
    assert r.out.count("Epoch ") == 3 and r.out.rstrip().endswith("Test finished.")
    lines = _leak_lines(r.err)
    assert len(lines) == 4, r.err
    assert [int(ln.rsplit("at step ", 1)[1].rstrip(".")) for ln in lines] == [2, 3, 4, 5]
    assert all("3.814697 Mb(s)" in ln and "aten.randn.default" in ln for ln in lines)
    assert r.err.count("====== ERROR: Detected memory leaks on device cpu ======") >= 1
    assert "leaked in 4 allocation(s)" in r.err
    folder = r.folder("output")           # config(output_path='./output')
    _layout(folder)
    df = _dump(folder)
    # six msmemscope.step() calls: six boundaries, none from the optimizer
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps.height == 6
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        assert [lk["step"] for lk in json.load(f)["leaks"]] == [2, 3, 4, 5]


def test_leaks_example_cli_quiet_and_script_config_merged(runs):
    r = runs["leaks_cli"]
    _ok(r)
    assert r.out.rstrip().endswith("Test finished.")
    # -q: no leak report, no summary on the console (the log and leaks.json keep them)
    assert not _leak_lines(r.err) and "SUMMARY" not in r.err and "Gap Analysis" not in r.err, r.err
    # the script's config() is honoured for what the command line did not set (output, events, format)
    assert not os.path.exists(os.path.join(r.cwd, "memscopeDumpResults"))
    folder = r.folder("output")
    conf = _layout(folder)
    assert conf["options"]["data_format"] == "csv" and sorted(conf["options"]["events"]) == ["alloc", "free", "launch"]
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        assert [lk["step"] for lk in json.load(f)["leaks"]] == [2, 3, 4, 5]
    log = open(glob.glob(os.path.join(folder, "msmemscope_logs", "*.log"))[0]).read()
    assert log.count("Detected memory leaks") >= 1 and len(re.findall(r"Direct .* leak of 3\.814697 Mb", log)) == 4


# ---------------------------------------------------------------------------- profile + Python trace (point 5)
def test_profile_example_cli_with_traceback(runs):
    r = runs["profile_cli"]
    _ok(r)
    assert "taken as msmemscope options (they came after the program): --events=alloc,free,launch,traceback" in r.err
    assert "kept the command line's" not in r.err or "events" not in r.err.split("kept the command line's")[0]
    assert "msmemscope.config() in the script: applied format='csv', output_path='./output'" in r.err
    assert "no leaks found (6 steps checked)" in r.err   # a default run says so (6 optimizer steps)
    folder = r.folder("output")
    conf = _layout(folder)
    assert "traceback" in conf["options"]["events"]
    df = _dump(folder)
    assert df.filter(pl.col("event") == "MALLOC").height > 0
    traces = glob.glob(os.path.join(folder, "device_cpu", "dump", "python_trace_*_*.csv"))
    assert len(traces) == 1, traces
    with open(traces[0]) as f:
        rows = list(csv.reader(f))
    assert rows[0] == TRACE_HEADER
    body = rows[1:]
    tid = int(os.path.basename(traces[0]).split("_")[2])
    pid = int(os.path.basename(folder).split("_")[1])
    assert {int(x[3]) for x in body} == {tid} and {int(x[4]) for x in body} == {pid}
    assert tid in set(df["tid"].to_list())           # the dump's Thread Id
    funcs = [x[0] for x in body]
    assert any(f.endswith("test_profile.py(33): forward") for f in funcs), funcs[:20]   # its def line
    assert funcs.count("nn.Module: SimpleModel") == 6 and funcs.count("nn.Module: MSELoss") == 6
    # the dump's clock: every call lies inside the traced window
    t0, t1 = df["ts"].min(), df["ts"].max()
    for x in body:
        assert t0 <= int(x[1]) <= int(x[2]) <= t1


def test_tracer_api_every_thread_and_the_dumps_clock(runs):
    r = runs["api_extras"]
    _ok(r)
    folder = r.folder("out")
    df = _dump(folder)
    traces = glob.glob(os.path.join(folder, "device_cpu", "dump", "python_trace_*.csv"))
    assert len(traces) == 2, traces                    # the main thread and side_work's
    by_func = {}
    for p in traces:
        with open(p) as f:
            rows = list(csv.reader(f))
        assert rows[0] == TRACE_HEADER
        for x in rows[1:]:
            by_func.setdefault(x[0].split(": ")[-1], set()).add(int(x[3]))
    assert len(by_func["side_work"]) == 1 and len(by_func["train_steps"]) == 1
    assert by_func["side_work"] != by_func["train_steps"]
    assert "nn.Module: TinyModel" in {x for p in traces for x in (r[0] for r in csv.reader(open(p)))}
    # take_snapshot() before start() wrote its row; mstx(msg, stream) marks are in the dump
    snaps = df.filter(pl.col("event") == "SNAPSHOT")
    assert "before start" in snaps["name"].to_list()
    mstx = df.filter(pl.col("event") == "MSTX")
    assert {"compat mark", "compat range"} <= set(mstx["name"].to_list())


PY312 = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3.1[2-9]")))


@pytest.mark.skipif(sys.version_info < (3, 12) and not PY312,
                    reason="no Python 3.12+ here to run the sys.monitoring path")
def test_python_trace_sys_monitoring_sees_running_threads(tmp_path):
    """On 3.12+ the trace uses sys.monitoring: a thread already running at start() is traced too."""
    py = sys.executable if sys.version_info >= (3, 12) else PY312[0]
    prog = tmp_path / "mon.py"
    prog.write_text(f"""
import sys, threading
sys.path.insert(0, {ROOT!r})
from msmemscope.capture.pytrace import PyTracer
ready, go = threading.Event(), threading.Event()
def bg_work():
    return sum(range(3))
def bg():
    ready.set(); go.wait(); bg_work()
def gen():
    yield 1
    yield 2
th = threading.Thread(target=bg); th.start(); ready.wait()
t = PyTracer({str(tmp_path)!r}); t.start()
list(gen())
go.set(); th.join()
t.stop()
print(t.mode)
""")
    p = subprocess.run([py, str(prog)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "sys.monitoring"
    rows = []
    for f in glob.glob(str(tmp_path / "python_trace_*.csv")):
        rows += list(csv.reader(open(f)))[1:]
    names = [x[0].split(": ")[-1] for x in rows]
    assert "bg_work" in names and names.count("gen") == 3     # two yields and the final return
    assert not any("pytrace.py" in x[0] for x in rows)


OWN_CPROFILE = """
import cProfile, glob, io, pstats, sys, torch, msmemscope
from msmemscope import capture
pr = cProfile.Profile()
pr.enable()                        # the program profiles itself, then asks for the Python trace
msmemscope.config(output=sys.argv[1], events="alloc,free,launch,traceback")
msmemscope.start()

def work():
    x = torch.ones(64)
    return (x * 2).sum().item()

for _ in range(3):
    work()
msmemscope.stop()
pr.disable()
calls = {f[2]: st[1] for f, st in pstats.Stats(pr).stats.items()}
print("WORK", calls.get("work", 0), flush=True)
"""


def test_the_python_trace_leaves_the_programs_own_profiler_alone(tmp_path):
    """A program that runs cProfile and asks for the Python trace (events=traceback): its profile
    stays whole (before: our sys.setprofile replaced cProfile's hook, and stop() cleared it, so
    cProfile saw none of the calls after start()), the trace is off with one line saying why, and
    the dump is whole."""
    prog = tmp_path / "own_cprofile.py"
    prog.write_text(OWN_CPROFILE)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(prog), str(out)], env=env_for_tests(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WORK 3" in r.stdout, r.stdout
    assert r.stderr.count("no Python trace (events=traceback)") == 1, r.stderr[-2000:]
    from conftest import run_folders
    (folder,) = run_folders(out)
    assert not glob.glob(os.path.join(folder, "device_cpu", "dump", "python_trace_*.csv"))
    df = read(dump_of(folder))
    check_invariants(df)
    assert df.filter(pl.col("event") == "MALLOC").height >= 3


# ---------------------------------------------------------------------------- inefficient, decompose
def test_inefficient_example_api_marks_the_dump(runs):
    r = runs["inefficient_api"]
    _ok(r)
    folder = r.folder("output")
    _layout(folder)
    text = open(dump_of(folder)).read()
    assert '""inefficient_type"":""' in text           # Attr of the flagged MALLOC rows (the original's key)
    assert "early_allocation" in r.err and "late_deallocation" in r.err
    assert "--call-stack=python, or msmemscope.config(call_stack=" in r.err


def test_decompose_example_api_owner_train(runs):
    r = runs["decompose_api"]
    _ok(r)
    folder = r.folder("output")
    _layout(folder)
    df = _dump(folder)
    owners = df.filter(pl.col("event") == "MALLOC")["owner"].drop_nulls().to_list()
    assert owners and all(o.endswith("@train") for o in owners)
    assert {"PTA@weight@train", "PTA@gradient@train"} <= set(owners) or "PTA@activation@train" in owners


# ---------------------------------------------------------------------------- watch (point 3)
def _bins(folder):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "device_cpu", "watch_dump", "*.bin")))


def test_watch_example_api_alone_dumps_around_each_op(runs):
    r = runs["watch_api"]
    _ok(r)
    folder = r.folder("memscopeDumpResults")
    bins = _bins(folder)
    # watch() .. remove() brackets criterion(outputs, targets): one mse_loss per epoch, before and after
    mine = [b for b in bins if "-leaksStWatch_0_" in b]
    assert len(mine) == 10, bins
    assert {b.split("_aten.")[1].split("-")[0] for b in mine} == {f"mse_loss.default_{i}" for i in range(1, 6)}
    for p in glob.glob(os.path.join(folder, "device_cpu", "watch_dump", "*leaksStWatch*.bin")):
        assert os.path.getsize(p) == 100 * 100 * 4
    assert "nothing was watched" not in r.err
    assert "only the 5 block(s) given to msmemscope.watcher.watch() were watched" in r.err
    assert "5 block(s) watched, 0 change(s) by declared writes, 0 stomp(s)" in r.err


def test_watch_example_cli_window_and_api_block(runs):
    r = runs["watch_cli"]
    _ok(r)
    assert f"taken as msmemscope options (they came after the program): {WATCH_CLI}" in r.err
    assert "kept the command line's watch" in r.err
    folder = r.folder("memscopeDumpResults")
    bins = _bins(folder)
    # the start op's output 0 from mse_loss#1 until mse_loss_backward#1 closes the window
    assert "cpu_" in bins[0]
    start = [b for b in bins if "-aten.mse_loss.default_0_" in b]
    assert any(b.endswith("aten.mse_loss.default_1-aten.mse_loss.default_0_after.bin") for b in start)
    assert any("aten.mse_loss_backward.default_1-aten.mse_loss.default_0_after" in b for b in start)
    assert len([b for b in bins if "-leaksStWatch_0_" in b]) == 10
    assert "6 block(s) watched" in r.err and "never ran" not in r.err


# ---------------------------------------------------------------------------- example_api / example_cmd
def test_example_api_every_option(runs):
    r = runs["example_api"]
    _ok(r)
    folder = r.folder("output")
    conf = _layout(folder)
    assert conf["options"]["level"] == ["kernel", "op"] or sorted(conf["options"]["level"]) == ["kernel", "op"]
    df = _dump(folder)
    assert df.filter(pl.col("event") == "ACCESS").height > 0
    mallocs = df.filter(pl.col("event") == "MALLOC")
    assert mallocs["owner"].drop_nulls().len() > 0
    assert mallocs["py_stack"].drop_nulls().len() == mallocs.height
    assert "example_api.py" in mallocs["py_stack"][0]
    assert "Test finished." in r.out
    assert "no KERNEL_LAUNCH rows will be written" in r.err   # level kernel on CPU, said once


def test_example_cmd_cli_inefficient(runs):
    r = runs["example_cmd_cli"]
    _ok(r)
    assert "taken as msmemscope options (they came after the program): --analysis=inefficient" in r.err
    folder = r.folder("memscopeDumpResults")
    conf = _layout(folder)
    assert conf["options"]["analysis"] == ["inefficient"]
    assert '""inefficient_type"":""' in open(dump_of(folder)).read()
    assert "Test finished." in r.out


# ---------------------------------------------------------------------------- OOM (point 6)
def _verify_oom(csv_path, k):
    sys.path.insert(0, EXAMPLES)
    try:
        import oom_utils
    finally:
        sys.path.remove(EXAMPLES)
    orig = oom_utils.parse_oom_attr
    # its parser reads the original's unquoted Attr; ours is JSON
    oom_utils.parse_oom_attr = lambda s: {key: str(v) for key, v in json.loads(s).items()}
    try:
        v = oom_utils.OOMDumpVerifier(csv_path)
        ok = v.verify_all(expected_k=k)
    finally:
        oom_utils.parse_oom_attr = orig
    return ok, v


@pytest.mark.parametrize("name,k", [("api_extras", 10), ("api_extras_cli", 5)])
def test_oom_rows_pass_the_originals_verifier(runs, name, k):
    r = runs[name]
    _ok(r)
    assert "caught RuntimeError" in r.out and "done 3" in r.out
    folder = r.folder("out")
    ok, v = _verify_oom(dump_of(folder), k)
    assert ok, v.summary()
    assert v.errors == []
    # its one warning: on CPU the failing function is not the NPU driver's halMemAlloc
    assert v.warnings == ["OOM_TRIGGER func=c10::alloc_cpu (expected halMemAlloc/halMemCreate)"], v.warnings
    assert v.trigger_count == 1
    df = _dump(folder)
    oom = df.filter(pl.col("event") == "OOM_DETAIL")
    top = oom.filter(pl.col("event_type") == "OOM_TOP_ALLOC")
    assert top["size"].to_list()[:3] == [1 << 20, 1 << 19, 1 << 18]   # the kept blocks, largest first
    assert oom.filter(pl.col("event_type") == "OOM_TRIGGER")["attr"][0].count('"req_size":4503599627370496')


# ---------------------------------------------------------------------------- command line (points 1, 7, 8)
def test_late_options_split():
    from msmemscope.cli import split_late_options
    assert split_late_options(["t.py", "--steps=3", "--lr=1", "-x", "--watch=a,b"]) == \
        (["--steps=3", "--watch=a,b"], ["t.py", "--lr=1", "-x"])
    # `--` ends our scan; what follows goes to the program untouched, and the `--` too unless it
    # ended options of ours (a program's own `--` was dropped before: argv not as without us)
    assert split_late_options(["t.py", "a", "--", "--steps=3"]) == ([], ["t.py", "a", "--", "--steps=3"])
    assert split_late_options(["t.py", "a", "--", "d"]) == ([], ["t.py", "a", "--", "d"])
    assert split_late_options(["t.py", "--steps=3", "--", "--steps=5"]) == (["--steps=3"], ["t.py", "--steps=5"])
    assert split_late_options(["t.py", "--steps", "3"]) == ([], ["t.py", "--steps", "3"])


def test_late_option_checked_like_any_other(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("print('ran')\n")
    r = run_cli(["-o", str(tmp_path / "o"), str(prog), "--steps=x"])
    assert r.returncode == 2 and r.stderr.startswith("msmemscope: error: --steps: 'x' is not a step number")
    assert "ran" not in r.stdout


@pytest.mark.parametrize("dev", ["npu", "npu:1", "cuda"])
def test_missing_device_is_an_error(tmp_path, dev):
    try:
        import torch
        if dev == "cuda" and torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    except ImportError:
        pass
    prog = tmp_path / "p.py"
    prog.write_text("print('ran')\n")
    r = run_cli(["-o", str(tmp_path / "o"), f"--device={dev}", str(prog)])
    assert r.returncode == 2 and "ran" not in r.stdout
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith(f"msmemscope: error: --device={dev}: no ")


def test_original_values():
    from msmemscope import options as O
    assert O.build(None, level="0").level == ("op",) and O.build(None, level="1").level == ("kernel",)
    assert O.build(None, level="1,0").level == ("kernel", "op")
    assert O.build(None, log_level="warn").log_level == "warning"
    assert O.build(None, events="none").events == set()
    assert O.build(None, analysis="none").analysis == ()


def test_none_mixed_warns_as_the_original(capsys):
    from msmemscope import options as O
    assert O.build(None, events="alloc,none").events == set()
    assert O.build(None, analysis="leaks,none").analysis == ()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith("[msmemscope] warning: --") and "'none' wins" in e for e in err)


def test_input_path_alias_and_show_of_a_peer_dump(tmp_path):
    base, leaks = os.path.join(PEER, "baseline.csv"), os.path.join(PEER, "leaks.csv")
    r = run_cli(["-o", str(tmp_path), "--compare", f"-i={base},{leaks}"], cwd=str(tmp_path))
    r2 = run_cli(["-o", str(tmp_path), "--compare", f"--input-path={base},{leaks}"], cwd=str(tmp_path))
    assert r.returncode == 0 and r2.returncode == 0, r.stderr + r2.stderr
    outs = glob.glob(str(tmp_path / "**" / "memory_compare_*.csv"), recursive=True)
    assert len(outs) == 2
    s = run_cli(["show", base])
    assert s.returncode == 0, s.stderr
    # the peer dump's HAL rows carry only `size`: the peak is the running sum's, computed here from the file
    cur = peak = 0
    with open(base) as f:
        rows = sorted((int(r[0]), r[1], int(re.search(r"size:(\d+)", r[9]).group(1)))
                      for r in csv.reader(f) if r[1] in ("MALLOC", "FREE") and r[2] == "HAL")
    for _, ev, size in rows:
        cur += size if ev == "MALLOC" else -size
        peak = max(peak, cur)
    assert peak >= 18874368
    assert f"pool HAL: {peak / 1048576:.3f} MB" in s.stdout, s.stdout
    # MALLOC rows named N/A in the original's dumps: the op is the enclosing ATEN op
    assert "The ops that allocated most: aten.mse_loss.default " in s.stdout, s.stdout


def test_describer_tensor_labels_not_capped():
    import torch
    from msmemscope import describe
    for i in range(5):
        describe.describer(torch.ones(1), owner=f"tensor{i}")   # no trace: labels only checked


def test_analyzer_names(runs, tmp_path):
    """api.md's analyzer classes, on the dumps of the examples above."""
    from msmemscope.analysis.leaks import MarkError
    from msmemscope.analyzer import InefficientAnalyzer, InefficientConfig, LeaksAnalyzer, LeaksConfig
    dump = tmp_path / "ex.csv"
    shutil.copy(dump_of(runs["example_api"].folder("output")), dump)   # has ACCESS rows
    cfg = InefficientConfig(input_path=str(dump), mem_size=0,
                            inefficient_type=["early_allocation", "late_deallocation", "temporary_idleness"],
                            idle_threshold=3000)
    res = InefficientAnalyzer().analyze(cfg)
    assert len(res) > 0 and res.output and '""inefficient_type"":""' in open(res.output).read()
    leaks_cfg = LeaksConfig(input_path=dump_of(runs["api_extras"].folder("out")), mstx_info="compat mark",
                            start_index=0)
    assert leaks_cfg.mstx_info == "compat mark"
    with pytest.raises(MarkError, match="compat mark"):   # one mark in that dump; the rule needs A, B, C
        LeaksAnalyzer().analyze(leaks_cfg)
    with pytest.raises(TypeError, match="unknown parameter 'bogus'"):
        LeaksConfig(input_path="x", bogus=1)
    with pytest.raises(TypeError, match="takes a LeaksConfig"):
        LeaksAnalyzer().analyze(cfg)


def test_config_before_import_torch_under_the_launcher(tmp_path):
    """config() before `import torch` (no trace yet in that process) is merged when tracing starts."""
    prog = tmp_path / "early.py"
    prog.write_text("import msmemscope\n"
                    "msmemscope.config(output_path='./early_out', analysis='decompose', steps='1,2')\n"
                    "import torch\n"
                    "x = [torch.ones(100) for _ in range(3)]\n"
                    "print('ok')\n")
    r = run_cli(["--analysis=leaks", str(prog)], cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    assert ("msmemscope.config() in the script: applied output_path='./early_out', steps='1,2'; "
            "kept the command line's analysis") in r.stderr
    folders = glob.glob(str(tmp_path / "early_out" / "msmemscope_*"))
    assert len(folders) == 1 and not os.path.exists(tmp_path / "memscopeDumpResults")
    with open(os.path.join(folders[0], "config.json")) as f:
        o = json.load(f)["options"]
    assert o["analysis"] == ["leaks"] and o["steps"] == [1, 2]
    assert _dump(folders[0]).filter(pl.col("event") == "MALLOC").height == 3


def test_a_programs_own_double_dash_reaches_it(tmp_path):
    """``msmemscope prog.py a -- d``: the program's argv is what it is without us (``a -- d``); it lost
    the ``--`` before. A ``--`` that ends options of ours after the program is still ours."""
    prog = tmp_path / "argv.py"
    prog.write_text("import sys, json\nprint(json.dumps(sys.argv[1:]))\n")
    for i, (args, want) in enumerate(((["a", "--", "d"], ["a", "--", "d"]), (["--steps=1", "--", "d"], ["d"]))):
        r = run_cli(["-q", "-o", str(tmp_path / f"out{i}"), str(prog), *args])
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1]) == want
        plain = subprocess.run([sys.executable, str(prog), *want], capture_output=True, text=True)
        assert plain.stdout == r.stdout
        for folder in run_folders(tmp_path / f"out{i}"):
            check_invariants(read(dump_of(folder)))


@pytest.mark.parametrize("case", ["compress-vs-db", "db-vs-compress", "unwritable-output"])
def test_a_scripts_config_the_launchers_options_refuse_is_said_not_raised(tmp_path, case):
    """The script's config() valid alone but not with the command line's options (compress with a
    db dump), or naming an output that cannot be written (the launcher's dump had begun to be set
    up there): the program runs as untraced (it raised OptionError, or FileExistsError after the
    launcher's dump was given up), one stderr line says what was not applied, the dump is where
    the command line put it."""
    kw, cli = {"compress-vs-db": ("compress='zstd'", ["--data-format=db"]),
               "db-vs-compress": ("data_format='db'", ["--compress=zstd"]),
               "unwritable-output": ("output='/dev/null/x'", [])}[case]
    prog = tmp_path / "prog.py"
    prog.write_text("import torch, msmemscope\n"
                    f"msmemscope.config({kw})\n"
                    "x = [torch.ones(1000) for _ in range(3)]\n"
                    "msmemscope.step()\n"
                    "print('sum', float(sum(t.sum() for t in x)))\n")
    plain = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    out = ["-o", str(tmp_path / "out")] if cli else []
    r = run_cli([*out, *cli, str(prog)], cwd=str(tmp_path))
    assert r.returncode == plain.returncode == 0 and r.stdout == plain.stdout, (r.stderr, plain.stderr)
    assert "Traceback" not in r.stderr
    [said] = [ln for ln in r.stderr.splitlines() if "config() in the script" in ln]
    assert "not applied" in said and "applied " + kw.split("=")[0] not in said.replace("not applied", ""), said
    [folder] = run_folders(tmp_path / ("out" if cli else "memscopeDumpResults"))
    df = read(dump_of(folder))
    check_invariants(df)
    assert df.filter(pl.col("event") == "MALLOC").height >= 3
