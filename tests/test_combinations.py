"""Features meeting in one run, on both capture sources: every dump keeps the SPEC §1 invariants.

Each program mixes what broke the dump before: stop/start gaps with frees and allocations in the
gap, threads inside ops while tracing stops, starts or hands over to the dispatch-mode source
(watch), FSDP2's ``UntypedStorage.resize_`` storage games under the launcher, fork/spawn
DataLoader workers, torch.compile, --steps, a signal during a flush.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import pytest

from conftest import FSDP2_LAUNCHER, FULL, ROOT, run_python, source_env, fsdp2_launcher_run, check_invariants, threads_run, config_of, dump_of, full, read, run_cli, run_folders

import subprocess

PROGS = os.path.join(ROOT, "tests", "progs")
SOURCES = ["native", "python"]


_env, _python = source_env, run_python


def _rows(df, event, **where):
    import polars as pl
    q = df.filter(pl.col("event") == event)
    for k, v in where.items():
        q = q.filter(pl.col(k) == v)
    return q


@pytest.mark.parametrize("source,analysis", full([("python", None), ("native", "leaks,decompose"),  # (make test's time)
                                                   ("native", "inefficient")],  # (access rows in packed flushes)
                                                  [(s, None) for s in SOURCES] + [("native", "leaks,decompose"),
                                                                                  ("native", "inefficient")]),
                         ids=lambda v: str(v))
def test_stop_start_gaps_threads_and_watch(tmp_path, source, analysis):
    """Frees between stop() and start() get their FREE row (flagged ``untraced``), so ``used`` stays
    the running sum after the restart; other threads are inside ops at every stop, start and at
    the handover that watch() makes; the blocks the dump leaves live are the ones still held.
    With decompose, the native owner labeller (its C++ row loop) labels every flush meanwhile."""
    out = tmp_path / "out"
    r = _python([os.path.join(PROGS, "combo_gaps.py"), str(out), "all", *([analysis] if analysis else [])],
                source)
    (folder,) = run_folders(out)
    cfg = config_of(folder)
    assert cfg["source"].startswith("native" if source == "native" else "dispatch"), cfg["source"]
    df = read(dump_of(folder))
    live = check_invariants(df)
    frees = _rows(df, "FREE")
    untraced = [json.loads(a) for a in frees["attr"].to_list() if '"untraced"' in a]
    assert all(a["untraced"] is True for a in untraced)
    # keep[:2] in the first gap, keep[0] and `both` in the second: 4 blocks of 4000 bytes
    assert sum(1 for a in untraced if a["size"] == 4000) >= 4, untraced
    # every untraced FREE lies in a gap: after a STOP_TRACE, before the next START_TRACE / PROC_EXIT
    state = None
    for ev, et, attr in df.select("event", "event_type", "attr").iter_rows():
        if ev == "SYSTEM":
            state = et
        elif ev == "FREE" and '"untraced"' in (attr or ""):
            assert state == "STOP_TRACE", (state, attr)
    # what the program still holds of the blocks it made while tracing is live in the dump
    held = json.loads(r.stdout.split("HELD", 1)[1])
    assert held == [4000]
    # every step boundary once, in order, whether it was a STEP record waiting in the native source
    # at a stop or at watch()'s handover, or a row the session wrote
    import polars as pl
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))["attr"]
    numbers = [json.loads(a)["step"] for a in steps.to_list()]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 5, numbers
    sizes = sorted(live.values())
    assert sizes.count(4000) >= 1, sizes
    if analysis == "inefficient":
        # the sink's C++ fold fed across the gaps, the threads and the handover marks in the dump the
        # blocks that the offline analysis finds in the whole file
        from msmemscope import check_inefficient
        import polars as pl
        mal = _rows(df, "MALLOC")
        online = {(i, t) for i, t in zip(mal["id"].to_list(),
                                          mal["attr"].str.extract(r'"inefficient_type":"([^"]*)"', 1).to_list())
                  if t is not None}
        res = check_inefficient(dump_of(folder), write=False, quiet=True)
        offline = set(zip(res.blocks["mpos"].to_list(), res.blocks["inefficient_type"].to_list()))
        assert online == offline and online, (sorted(online)[:5], sorted(offline)[:5])
        with open(os.path.join(folder, "analysis", "inefficient.json")) as f:
            assert json.load(f)["by_type"]
    elif analysis:
        # every MALLOC row has its owner label, and the optimizer's blocks are told apart
        owners = _rows(df, "MALLOC")["owner"].to_list()
        assert owners and all(owners), sorted({o for o in owners if not o})
        assert any("@weight" in o for o in owners) and any("@ops" in o for o in owners), sorted(set(owners))


# make test: decompose on both sources (where each defect showed); the full run adds the leaks alone
@pytest.mark.parametrize("source,analysis,mode", full([("python", "leaks,decompose", "steps"),
                                                       ("native", "leaks,decompose", "steps2")],  # (make test's time)
                                                      [(s, a, m) for s in SOURCES for a in ["leaks,decompose", "leaks"]
                                                       for m in ("steps", "steps2")]))
def test_two_threads_each_stepping_an_optimizer_number_every_step_once(tmp_path, source, analysis, mode):
    """Each optimizer step of either thread ends a step: 2 x N STEP rows, numbered 1..2N once each
    (check_invariants), and each thread's losses are the plain run's. With ``steps2`` each thread
    also steps a second optimizer after the first at every iteration: each thread's lead (the first)
    ends its steps, still 2 x N (Session._leads is per thread; 4 x N before it). Two boundaries that met
    (the held first step's release in one thread, the next boundary in the other) wrote STEP 2
    twice and no STEP 3 (native source, decompose: every run); Session.step is one at a time now.
    The dispatch-mode source's owner labeller iterated its live blocks and per-block facts while the
    other thread's ops changed them, and raised (in the program's thread, or logged at a flush)."""
    # the owner labeller's dicts changed by the other thread at a flush: ~1 run in 2 at 200 (steps2 counts
    # step ends only: fewer in make test)
    n = full(200 if mode == "steps" else 60, 400)
    folder, df = threads_run(tmp_path, [mode, str(n)], _env(source), [f"--analysis={analysis}"])
    import polars as pl
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert [json.loads(a)["step"] for a in steps["attr"].to_list()] == list(range(1, 2 * n + 1))
    # nothing of ours failed on the way (the owner labeller iterated the dispatch-mode source's live
    # blocks while the other thread's ops changed them, and raised in the program's thread)
    for log in glob.glob(os.path.join(folder, "msmemscope_logs", "*.log")):
        with open(log) as f:
            bad = [ln for ln in f if "failed" in ln or "Traceback" in ln]
        assert not bad, bad[:3]


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test stops and starts while "
                    "another thread runs ops in test_stop_and_start_while_another_thread_is_in_an_op, "
                    "test_stop_start_gaps_threads_and_watch and ..._runs_torchs_global_hooks")
@pytest.mark.parametrize("source,analysis", full([("python", "inefficient")],
                                                  [(s, a) for s in SOURCES for a in ("leaks", "inefficient")]))
def test_stop_and_start_while_another_thread_is_in_its_ops(tmp_path, source, analysis):
    """The main thread stops and starts tracing while another thread trains: at each stop that
    thread is inside an op. Every ATEN_START in the dump has its ATEN_END (check_invariants), and
    the losses are the plain run's. (On the dispatch-mode source an op the other thread registered
    during stop()'s close of the ops in flight lost its ATEN_END for good: seen once in a probe of
    this kind; test_session_units.py forces that interleaving.)"""
    pairs = full(6, 12)
    _, df = threads_run(tmp_path, ["gaps", str(pairs)], _env(source), [f"--analysis={analysis}"])
    import polars as pl
    assert df.filter(pl.col("event_type") == "STOP_TRACE").height == pairs + 1


HOOKS_MID_GAP = r"""
import sys, threading, torch, msmemscope
import msmemscope.capture
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.nn.modules.module import register_module_module_registration_hook
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(32, 8)
armed, inside, resumed = [None], threading.Event(), threading.Event()

def hold(kind):  # the program's own global hook, after ours in torch's dict: the main thread's
    def hook(*args):  # stop() and start() run while the worker's torch loop is inside it
        if armed[0] == kind:
            armed[0] = None
            inside.set()
            resumed.wait(60)
            resumed.clear()
    return hook

register_optimizer_step_pre_hook(hold("pre"))
register_optimizer_step_post_hook(hold("post"))
register_module_module_registration_hook(hold("registration"))
losses, failed = [], []
threading.excepthook = lambda a: failed.append(repr(a.exc_value))

def work():
    holder = nn.Module()
    for kind in ("pre", "post", "registration", None):
        armed[0] = kind
        if kind == "registration":
            holder.sub = nn.Identity()
        else:
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
t = threading.Thread(target=work)
t.start()
traced = msmemscope.capture.current() is not None  # (a plain run's start() would trace)
for _ in range(3):
    inside.wait(60)
    inside.clear()
    if traced:
        msmemscope.stop()
        msmemscope.start()
    resumed.set()
t.join()
print("LOSSES", losses, "FAILED", failed, flush=True)
"""


@pytest.mark.parametrize("source,analysis", full([("native", "leaks,decompose")],
                                                  [(s, a) for s in SOURCES for a in ("leaks", "leaks,decompose")]))
def test_stop_and_start_while_another_thread_runs_torchs_global_hooks(tmp_path, source, analysis):
    """The main thread stops and starts tracing while another thread is inside torch's loop over
    the global optimizer pre- and post-hooks and the module registration hooks (held there by the
    program's own hook). The worker's optimizer step and module assignment run as they do untraced:
    before, stop() and start() removed and added ours in those dicts, and the worker's step raised
    "OrderedDict mutated during iteration" (seen first with the optimizer in backward, two threads
    and a gap). Our hooks now stay from the first start to the session's close, inert while stopped."""
    prog = tmp_path / "hooks_mid_gap.py"
    prog.write_text(HOOKS_MID_GAP)
    plain = subprocess.run([sys.executable, str(prog)], env=_env(source), capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "FAILED []" in plain.stdout, plain.stdout + plain.stderr[-2000:]
    out = tmp_path / "out"
    r = run_cli([f"--analysis={analysis}", "-o", str(out), sys.executable, str(prog)], env=_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1], r.stdout[-2000:]
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    import polars as pl
    assert df.filter(pl.col("event_type") == "STOP_TRACE").height == 4  # three gaps and the end
    assert df.filter(pl.col("event_type") == "STEP").height >= 1


STEP_FAILS = """
import sys, torch, msmemscope
from torch import nn
from msmemscope import capture
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(32, 8), torch.randn(32, 1)
s = capture.current()
if s is not None:  # traced: the boundary after step 3 fails once, before anything of it is done
    orig_step, calls = type(s)._step, []

    def failing(self, source):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return orig_step(self, source)
    type(s)._step = failing
for _ in range(6):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), flush=True)
"""


@pytest.mark.parametrize("source", full(["native"], SOURCES))
def test_a_failing_step_boundary_never_reaches_the_program(tmp_path, source):
    """A failure of ours inside a step boundary (here injected at its start) is said
    once on stderr and in the log; the program's optimizer step returns as without us, its losses
    are the plain run's, tracing goes on, and the dump keeps its invariants (the failed boundary
    writes no STEP row: the next one ends that step)."""
    prog = tmp_path / "step_fails.py"
    prog.write_text(STEP_FAILS)
    plain = subprocess.run([sys.executable, str(prog)], env=_env(source), capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]
    out = tmp_path / "out"
    r = run_cli(["--analysis=leaks,decompose", "--output", str(out), sys.executable, str(prog)], env=_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("loss")] == plain.stdout.splitlines()
    assert r.stderr.count("a step boundary failed") == 1 and "injected" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    import polars as pl
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps.height == 5 and df.filter(pl.col("event") == "MALLOC").height > 0


STOP_FAILS = """
import torch, msmemscope
from msmemscope import capture
torch.manual_seed(0)
s = capture.current()
fail = []
if s is not None:  # traced: the flush of the program's stop() fails, before anything of it is done
    orig = type(s)._flush

    def flush(self, *a, **k):
        if fail:
            fail.pop()
            raise RuntimeError("injected")
        return orig(self, *a, **k)
    type(s)._flush = flush
m = torch.nn.Linear(8, 8)
x = torch.randn(4, 8)
for _ in range(3):
    m(x).sum().backward()
if s is not None:
    s.flush()  # (rows in the dump before the failure)
fail.append(1)
msmemscope.stop()
print("stopped", flush=True)
print("after", m(x).sum().item().hex())
"""


@pytest.mark.parametrize("source", full(["native"], SOURCES))
def test_a_failing_flush_in_the_programs_stop_never_reaches_it(tmp_path, source):
    """A failure of ours in the flush of the program's ``msmemscope.stop()`` (an unexpected one: the
    writer's and the analyses' are caught inside it) is the tool's: stop() returns, the program runs
    on and computes what it computes without us, one line says it, and the dump keeps what was
    written before, readable, with its invariants."""
    prog = tmp_path / "stop_fails.py"
    prog.write_text(STOP_FAILS)
    out = tmp_path / "out"
    r = run_cli(["--analysis=leaks", "--output", str(out), sys.executable, str(prog)], env=_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    plain = subprocess.run([sys.executable, str(prog)], env=_env(source), capture_output=True, text=True, timeout=300)
    assert [ln for ln in r.stdout.splitlines() if ln.startswith(("stopped", "after"))] == plain.stdout.splitlines()
    assert r.stderr.count("tracing stopped in process") == 1 and "cannot write the dump: injected" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    assert df.filter(df["event"] == "MALLOC").height > 0


def _torchrun():
    t = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return t if os.path.exists(t) else shutil.which("torchrun")


@pytest.mark.parametrize("prog,source,analysis", full(
    [FSDP2_LAUNCHER],
    [FSDP2_LAUNCHER] + [(p, s, a) for p in ("fsdp2_ranks.py", "fsdp1_ranks.py") for s in SOURCES
                        for a in ("leaks", "leaks,decompose")]))
def test_fsdp_under_the_launcher_keeps_the_running_sum(out_dir, shared_run, prog, source, analysis):
    """FSDP2 (and FSDP1's flat parameters) free and re-grow storages with resize_: the rank dumps
    keep every invariant and the leak gap table has no negative number, with owner labels
    (decompose: a handover to the dispatch-mode source) or without."""
    if (prog, source, analysis) == FSDP2_LAUNCHER:  # the job test_summary.py checks too: run once
        out_dir, r = fsdp2_launcher_run(shared_run)
    else:
        torchrun = _torchrun()
        if torchrun is None:
            pytest.skip("torchrun not installed")
        env = _env(source)
        env["PATH"] = os.path.dirname(torchrun) + os.pathsep + env.get("PATH", "")
        r = run_cli([f"--analysis={analysis}", "--output", str(out_dir), "torchrun", "--standalone",
                     "--nproc_per_node=2", os.path.join(PROGS, prog)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    folders = run_folders(out_dir)
    assert len(folders) == 2, folders
    for f in folders:
        df = read(dump_of(f))
        check_invariants(df)
        assert _rows(df, "MALLOC").height > 50
        if "decompose" in analysis and prog == "fsdp2_ranks.py":
            # FSDP2's all-gather and reduce-scatter are wrapped when the program imports FSDP2
            # (after tracing started, as here: the labeller waits for that import)
            with open(os.path.join(f, "analysis", "decompose.json")) as fh:
                peaks = [s["peak"] for s in json.load(fh)["steps"] if s["step"] is not None]
            assert peaks and all(p.get("PTA@ops@fsdp2@all_gather", 0) > 0 for p in peaks), peaks
            assert all(p.get("PTA@weight@fsdp2@unsharded", 0) > 0 for p in peaks), peaks
    gap_lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("MinGap", "MaxGap"))]
    assert len(gap_lines) == 4, gap_lines
    for ln in gap_lines:
        nums = [float(x) for x in ln.split()[1:3]]
        assert all(n >= 0 for n in nums), ln


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test's time; DataLoader workers are "
                    "traced in make test by test_capture.py and test_reliability.py (only the parent traced)")
@pytest.mark.parametrize("source", SOURCES)
def test_dataloader_workers_threads_and_steps(out_dir, source):
    """Fork and spawn DataLoader workers, a thread allocating all along, ``--steps=2,3``: the losses
    are those of the plain run, only the parent is traced, and its dump keeps the invariants (the
    blocks of step 2-3 freed in step 4 get their FREE, flagged untraced)."""
    prog = os.path.join(PROGS, "combo_loader.py")
    plain = _python([prog], source)
    r = run_cli(["-o", str(out_dir), "--steps=2,3", prog], env=_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [ln for ln in r.stdout.splitlines() if ln.startswith("loss")]
    assert losses == [ln for ln in plain.stdout.splitlines() if ln.startswith("loss")] and len(losses) == 4
    (folder,) = run_folders(out_dir)
    df = read(dump_of(folder))
    check_invariants(df)
    import polars as pl
    # ops start only in the recorded steps (an op in flight at the end of step 3 ends after it)
    starts = df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("event_type") == "ATEN_START"))
    assert set(starts["step"].unique().to_list()) == {2, 3}
    assert df.filter(pl.col("event") == "MALLOC").height > 0
    assert df.filter(pl.col("attr").str.contains('"untraced":true')).height > 0


ALL_ONLINE = "leaks,decompose,inefficient"


@pytest.mark.parametrize("mode,source,analysis", full(
    [("term", "python", None)],  # (make test's time: compiled code is traced in test_capture, test_modules, test_transformers_kv)
    [(m, s, None) for m in ("", "term", "opt") for s in SOURCES]
    + [(m, s, ALL_ONLINE) for m in ("", "term", "opt", "compile") for s in SOURCES]
    + [("term", "native", "inefficient")]))  # (flushes of access rows that stay packed)
def test_signals_during_flushes(tmp_path, source, mode, analysis):
    """A SIGUSR1 every millisecond while the buffer flushes every 64 rows, the handler allocating
    (it runs inside flushes); with ``term``, a SIGTERM mid-run. The losses are the plain run's, the
    dump keeps the invariants, the handler's blocks it still holds are live, and its growth is found.
    With every online analysis (owner labels, module hooks, the inefficient sink), the same, and
    their results are written. With ``opt``, the optimizer's steps: step 1's boundary is held until
    the second optimizer step, through the flushes and the handler's rows. With ``compile``, the
    model compiled in place: the native source's flushes come from ops inside compiled code, and
    the program's stderr says nothing of Dynamo (before: Dynamo tried to compile our flush there,
    with a warning on the program's stderr for each call it could not trace)."""
    prog = os.path.join(PROGS, "combo_signals.py")
    plain = _python([prog, "-", *([mode] if mode == "compile" else [])], source)
    want = [ln for ln in plain.stdout.splitlines() if ln.startswith("loss")]
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, prog, str(out), mode, *([analysis] if analysis else [])], env=_env(source),
                       capture_output=True, text=True, timeout=300)
    losses = [ln for ln in r.stdout.splitlines() if ln.startswith("loss")]
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    live = check_invariants(df)
    import polars as pl
    ends = [json.loads(a)["step"] for a in df.filter(pl.col("event_type") == "STEP")["attr"].to_list()]
    # each step once, in order (the message a string: pytest shows it whole)
    assert ends == list(range(1, len(ends) + 1)) and len(ends) >= 3, f"steps {ends}, exit {r.returncode}\n{r.stderr[-8000:]}"
    if mode == "term":
        assert r.returncode in (-15, 143), (r.returncode, r.stderr[-2000:])
        assert "TERM" in r.stdout and losses == want[:len(losses)] and len(losses) >= 4
        return
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses == want and len(losses) == 6
    assert "Dynamo" not in r.stderr, r.stderr[-3000:]
    sig = json.loads(r.stdout.split("SIGNALS ", 1)[1])
    assert sig["hits"] > 0 and sig["kept"], sig
    sizes = sorted(live.values())
    made = {n for n in _rows(df, "MALLOC")["size"].to_list() if 3001 <= n < 5000 and n % 2}
    assert config_of(folder)["source"].startswith("native" if source == "native" else "dispatch")
    if source == "native":  # every block the handler made and still holds is live in the dump
        assert all(n in sizes for n in sig["kept"]), (sig["kept"], sizes[:40])
    else:
        # the dispatch mode does not see calls made inside its own op handler, where a handler that
        # interrupts it runs (README, limits): what it saw of them is all live, none freed
        assert made and all(n in sizes for n in made), (made, sizes[:40])
    assert "leak: +" in r.stderr and "aten.empty" in r.stderr.split("leak: +", 1)[1].splitlines()[0]
    if analysis:
        for a in ("decompose", "inefficient", "leaks"):
            assert os.path.isfile(os.path.join(folder, "analysis", f"{a}.json")), a
        from msmemscope.io.reader import read_dump
        mods = read_dump(dump_of(folder), columns=("event", "module", "phase"), events=("MALLOC",))
        assert mods["module"].drop_nulls().len() > 10 and set(mods["phase"].drop_nulls()) == {"forward", "backward"}


TERM_INSIDE_AN_OP = r"""
import os, signal, sys, torch, msmemscope

@torch.library.custom_op("msmemscope_test::term_inside", mutates_args=())
def term_inside(x: torch.Tensor) -> torch.Tensor:
    y = x * 3                             # a block made inside the op
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode: inside the op
    for _ in range(10000):
        pass
    return y + 1

msmemscope.config(output=sys.argv[1], collect_mode="immediate")
msmemscope.start()
a = torch.ones(256)
b = a * 2
print("before", flush=True)
term_inside(b)
print("after", flush=True)
"""


@pytest.mark.parametrize("source", full(["native"], SOURCES))  # (make test's time)
def test_sigterm_inside_an_op_leaves_no_op_open(tmp_path, source):
    """SIGTERM delivered while an op runs (a Python custom op signals itself): the session's handler
    writes the dump and the process ends with the signal, inside the op. The dump keeps every
    invariant: the op's ATEN_START has its ATEN_END (written at the stop), and the op's own end,
    which never comes, is not needed (the dispatch-mode source once left the op open)."""
    prog = tmp_path / "prog.py"
    prog.write_text(TERM_INSIDE_AN_OP)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(prog), str(out)], env=_env(source), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode in (-15, 143), (r.returncode, r.stderr[-2000:])
    assert "before" in r.stdout and "after" not in r.stdout
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    import polars as pl
    ops = df.filter(pl.col("event") == "OP_LAUNCH")
    assert ops.filter(pl.col("event_type") == "ATEN_START")["name"].str.contains("term_inside").any(), \
        ops["name"].to_list()


STOP_WHILE_ANOTHER_THREAD_IS_IN_AN_OP = r"""
import sys, threading, time, torch, msmemscope
torch.set_num_threads(1)
msmemscope.config(output=sys.argv[1], collect_mode="immediate")
msmemscope.start()
a = torch.randn(1200, 1200)
done = []

def work():                            # started after start(): followed on both sources
    t0, n = time.time(), 0
    while time.time() - t0 < 1.5:
        (a @ a).sum()                  # ~0.1 s an op: stop() lands inside one
        n += 1
    done.append(n)

th = threading.Thread(target=work)
th.start()
time.sleep(0.45)
msmemscope.stop()
time.sleep(0.3)
msmemscope.start()
th.join()
msmemscope.stop()
print("ops", done[0])
"""


@pytest.mark.parametrize("source", full(["python"], SOURCES))  # (make test's time)
def test_stop_and_start_while_another_thread_is_in_an_op(tmp_path, source):
    """stop() on the main thread while a worker thread is inside a long op, then start() again: the
    op open at the stop gets its ATEN_END there (written by the stop), and its own end writes no
    second one; the worker's ops after the start pair again. Every invariant holds."""
    prog = tmp_path / "prog.py"
    prog.write_text(STOP_WHILE_ANOTHER_THREAD_IS_IN_AN_OP)
    r = _python([str(prog), str(tmp_path / "out")], source)
    assert "ops" in r.stdout
    (folder,) = run_folders(tmp_path / "out")
    df = read(dump_of(folder))
    check_invariants(df)
    import polars as pl
    main_tid = df.filter(pl.col("event") == "SYSTEM")["tid"].mode()[0]
    worker = df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("tid") != main_tid))
    assert worker.height >= 4, worker  # ops of the worker on both sides of the gap


FORK_IN_GAP = r"""
import os, sys, torch, msmemscope
from torch import nn
msmemscope.config(output=sys.argv[1], collect_mode="immediate", analysis="leaks,decompose")
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
def fit(n):
    for _ in range(n):
        m(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
fit(3)
msmemscope.stop()
extra = nn.Linear(4, 4)                  # made in the gap: the native source's wrapper stays
made = [torch.ones(1000) for _ in range(5)]
pid = os.fork()                          # a child forked in the gap allocates and exits
if pid == 0:
    xs = [torch.randn(256) for _ in range(50)]
    os._exit(0 if sum(x.numel() for x in xs) == 12800 else 3)
_, status = os.waitpid(pid, 0)
del made[:3]                             # gap blocks freed in the gap: never in the dump
m.append(extra)
opt.add_param_group({"params": extra.parameters()})
msmemscope.start()
fit(3)
del made                                 # gap blocks freed while tracing: uncounted, no FREE row
msmemscope.stop()
print("CHILD", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("source", full(["native"], SOURCES))  # (make test's time)
def test_a_fork_and_frees_inside_a_stop_start_gap(tmp_path, source):
    """Tracing stopped: the native source keeps its allocator wrapper (recording nothing) through the
    gap. A child forked then allocates and exits normally; blocks made and freed in the gap never
    reach the dump, those made in it and freed after start() write no FREE row; the module built in
    the gap is weights after start() on both sources; every invariant holds."""
    prog = tmp_path / "gap.py"
    prog.write_text(FORK_IN_GAP)
    r = _python([str(prog), str(tmp_path / "o")], source)
    assert "CHILD 0" in r.stdout, r.stdout + r.stderr[-2000:]
    [folder] = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    assert _rows(df, "MALLOC", size=4000).height == 0 and _rows(df, "FREE", size=4000).height == 0
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        ends = [s for s in json.load(f)["steps"] if s["step"] is not None]
    weight = lambda s: sum(n for o, n in s["bytes"].items() if o.split("@")[1] == "weight")  # noqa: E731
    base = (16 * 32 + 32 + 32 * 4 + 4) * 4
    assert [weight(s) for s in ends[:3]] == [base] * 3
    assert [weight(s) for s in ends[3:6]] == [base + (4 * 4 + 4) * 4] * 3, ends


FORK_WHILE_LOCKED = r"""
import os, sys, threading, time, torch, msmemscope
from torch import nn
from msmemscope import capture
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(8, 16)

def train():
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    msmemscope.step()
    msmemscope.mark("m")
    msmemscope.watcher.watch(model[0].weight, name="w")

train()                       # every part of the session made (labeller, module tracker, watch)
s = capture.current()
locks = list(s._locks())
held, release = threading.Event(), threading.Event()

def holder():                 # another thread of the parent, inside our code at the fork
    for lock in locks:
        lock.acquire()
    held.set()
    release.wait(60)
    for lock in reversed(locks):
        lock.release()

t = threading.Thread(target=holder)
t.start()
held.wait(60)
pid = os.fork()
if pid == 0:                  # the child trains on, as a forked worker of the program may
    for _ in range(2):
        train()
    os._exit(0)
deadline, status = time.time() + 30, None
while time.time() < deadline:
    done, code = os.waitpid(pid, os.WNOHANG)
    if done:
        status = code
        break
    time.sleep(0.02)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
release.set()
t.join()
train()
print("LOCKS", len(locks), "CHILD", "hung" if status is None else status, flush=True)
"""


@pytest.mark.parametrize("source", SOURCES)
def test_a_child_forked_while_another_thread_holds_our_locks_runs_on(tmp_path, source):
    """Another thread of the program is inside our code (it holds the session's locks, the watch
    engine's, the module tracker's, the labeller's) when the main thread forks. The child trains on,
    ends steps, marks and watches: it runs to its end (before: a child's msmemscope.step() waited for
    good on the step lock the parent's thread held at the fork). The parent's dump is whole."""
    prog = tmp_path / "fork_locked.py"
    prog.write_text(FORK_WHILE_LOCKED)
    out = tmp_path / "out"
    r = run_cli(["--analysis=leaks,decompose", "-o", str(out), sys.executable, str(prog)], env=_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout.split("LOCKS", 1)[1].split()
    assert int(said[0]) >= 5 and said[1:] == ["CHILD", "0"], r.stdout[-2000:]
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    import polars as pl
    assert df.filter(pl.col("event_type") == "STEP").height == 2  # the parent's two steps only
