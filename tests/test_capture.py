"""End to end through the CLI on the examples: the dump's shape and the SPEC §1 invariants."""
import os
import sqlite3
import subprocess
import sys

import polars as pl
import pytest

from conftest import (EXAMPLES, FULL, ROOT, TRANSFORMER_SMALL, check_invariants, mlp_all_events, config_of, dump_of, env_for_tests, full, read, read_after_stop,
                      plain_transformer, run_cli, run_folders)
from msmemscope.events import HEADER

SCRIPTS = os.path.join(ROOT, "tests", "scripts")


@pytest.mark.parametrize("fmt", ["csv", "db"])
def test_mlp_all_events(shared_run, fmt):
    out_dir, r = mlp_all_events(shared_run, fmt)  # test_reader.py reads these dumps too
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("loss") == 4  # the program's stdout passes through
    [folder] = run_folders(out_dir)
    path = dump_of(folder)
    assert path.endswith("." + fmt)
    if fmt == "csv":
        with open(path) as f:
            assert f.readline().rstrip("\n") == HEADER
    else:
        con = sqlite3.connect(path)
        cols = [r[1] for r in con.execute("PRAGMA table_info(memscope_dump)")]
        con.close()
        assert ",".join(cols) == HEADER
    cfg = config_of(folder)
    assert cfg["pid"] > 0 and cfg["device"] == "cpu" and "host" in cfg
    df = read(path)
    check_invariants(df)
    counts = dict(df.group_by("event").len().iter_rows())
    assert counts["ACCESS"] > 0 and counts["MALLOC"] > 0 and counts["FREE"] > 0
    system = df.filter(pl.col("event") == "SYSTEM")["event_type"].to_list()
    assert system[0] == "START_TRACE" and system[-2:] == ["STOP_TRACE", "PROC_EXIT"]
    assert system.count("STEP") == 4
    # backward ops are traced too
    names = set(df.filter(pl.col("event") == "OP_LAUNCH")["name"].to_list())
    assert "torch._ops.aten.threshold_backward.default" in names
    # reads vs writes from the schema: SGD's in-place update writes the weight
    acc = df.filter((pl.col("event") == "ACCESS") & (pl.col("name") == "torch._ops.aten.add_.Tensor"))
    assert "WRITE" in acc["event_type"].to_list()
    assert (os.stat(path).st_mode & 0o777) == 0o640
    logs = os.listdir(os.path.join(folder, "msmemscope_logs"))
    assert len(logs) == 1


@pytest.mark.skipif(not FULL, reason="long form: make test checks the same on the 20-step default-events run "
                    "of test_leaks.py::test_clean_transformer_reports_no_leak")
def test_transformer_default_events(out_dir):
    r = run_cli(["-o", str(out_dir), os.path.join(EXAMPLES, "transformer.py"), "--steps", "2", "--layers", "1"])
    assert r.returncode == 0, r.stderr
    df = read(dump_of(run_folders(out_dir)[0]))
    check_invariants(df)
    counts = dict(df.group_by("event").len().iter_rows())
    assert "ACCESS" not in counts  # only the requested events are written
    assert df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height == 2
    names = set(df["name"].to_list())
    assert "torch._ops.aten.native_layer_norm_backward.default" in names
    # MALLOC rows name the op that allocated the block
    mm = df.filter((pl.col("event") == "MALLOC") & (pl.col("name") == "torch._ops.aten.mm.default"))
    assert mm.height > 0


def _losses(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test checks the losses under more options in test_reliability.py::test_losses_bit_identical_more_options, and beside most traced runs")
@pytest.mark.parametrize("script,args", full([("transformer.py", TRANSFORMER_SMALL)],
                                              [("transformer.py", TRANSFORMER_SMALL),
                                               ("mlp.py", ["--steps", "5"])]))
def test_losses_bit_identical(out_dir, shared_run, script, args):
    path = os.path.join(EXAMPLES, script)
    env = env_for_tests()
    # the transformer's plain run is shared with test_watch.py
    plain = plain_transformer(shared_run) if script == "transformer.py" else _losses([sys.executable, path, *args], env)
    traced = _losses([sys.executable, "-m", "msmemscope", "-o", str(out_dir), "--events=alloc,free,launch,access",
                      "--call-stack=python:5", path, *args], env)
    assert "loss" in plain and plain == traced


@pytest.mark.skipif(not FULL, reason="long form: make test traces this program with more options "
                    "(test_reliability.py::test_losses_bit_identical_more_options, the same checks)")
def test_threads_and_dataloader_workers(out_dir):
    path = os.path.join(SCRIPTS, "threads_loader.py")
    env = env_for_tests()
    plain = _losses([sys.executable, path], env)
    traced = _losses([sys.executable, "-m", "msmemscope", "-o", str(out_dir), path], env)
    assert plain == traced
    folders = run_folders(out_dir)
    assert len(folders) == 1  # DataLoader workers are not traced
    df = read(dump_of(folders[0]))
    check_invariants(df)
    tids = df.filter(pl.col("event") == "OP_LAUNCH")["tid"].unique()
    assert len(tids) >= 2  # the side thread's ops are recorded in its own thread


def test_python_api_deferred(tmp_path):
    out = tmp_path / "api"
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "api_marks.py"), str(out)],
                       capture_output=True, text=True, env=env_for_tests())
    assert r.returncode == 0, r.stderr
    [folder] = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    mstx = df.filter(pl.col("event") == "MSTX")
    marks = mstx.filter(pl.col("event_type") == "Mark")["name"].to_list()
    assert marks == ["A", "B", "nv"]
    starts = mstx.filter(pl.col("event_type") == "Range_start")["name"].to_list()
    ends = mstx.filter(pl.col("event_type") == "Range_end")["name"].to_list()
    assert starts == ["phase", "rf", "decorated"] and ends == ["phase", "rf", "decorated"]
    assert df.filter(pl.col("event_type") == "STEP").height == 3
    sizes = df.filter(pl.col("event") == "MALLOC")["size"].to_list()
    assert 4242 * 4 not in sizes  # after stop()
    # the tensor made before start() shows up when first used, marked as such
    before = df.filter((pl.col("event") == "MALLOC") & pl.col("attr").str.contains('"origin":"before_op"'))
    assert before["size"].to_list() == [4000]
    assert before["name"][0] == "torch._ops.aten.mul.Tensor"
    # the other thread's allocation, in its own thread
    t77 = df.filter((pl.col("event") == "MALLOC") & (pl.col("size") == 77 * 4))
    assert t77["name"].to_list() == ["torch._ops.aten.ones.default", "torch._ops.aten.mul.Tensor"]
    assert t77["tid"].n_unique() == 1 and t77["tid"][0] != df["tid"][0]
    # python call stacks name the script's lines
    assert "api_marks.py" in (df.filter(pl.col("event") == "MALLOC")["py_stack"][0] or "")


def test_step_start_ranges(out_dir):
    r = run_cli(["-o", str(out_dir), os.path.join(SCRIPTS, "step_ranges.py")])
    assert r.returncode == 0, r.stderr
    df = read(dump_of(run_folders(out_dir)[0]))
    steps = df.filter(pl.col("event_type") == "STEP")["attr"].to_list()
    assert steps == ['{"step":1}', '{"step":2}', '{"step":3}', '{"step":4}']  # not doubled by the optimizer hook


def test_steps_option_records_only_those_steps(out_dir):
    r = run_cli(["-o", str(out_dir), "--steps=2，4", os.path.join(EXAMPLES, "mlp.py"), "--steps", "5"])
    assert r.returncode == 0, r.stderr
    df = read(dump_of(run_folders(out_dir)[0]))
    ops = df.filter(pl.col("event") == "OP_LAUNCH")
    assert set(ops["step"].unique().to_list()) == {2, 4}


def test_deferred_mode_without_start_records_nothing(out_dir):
    r = run_cli(["-o", str(out_dir), "--collect-mode=deferred", os.path.join(EXAMPLES, "mlp.py"), "--steps", "2"])
    assert r.returncode == 0, r.stderr
    dump = dump_of(run_folders(out_dir)[0])
    # nothing recorded: the header alone, which every reader refuses in one line (issue 21)
    from msmemscope.io.reader import DumpError
    with pytest.raises(DumpError, match="no rows after the header"):
        read(dump)
    assert open(dump).read().count("\n") == 1


def test_module_and_shell_programs(out_dir, tmp_path):
    r = run_cli(["-o", str(out_dir), "--", "-m", "examples.mlp", "--steps", "1"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert len(run_folders(out_dir)) == 1
    # as the README shows, without "--" (argparse took -m for an option of ours); the module's own
    # -m stays its own
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import sys, torch\nx = torch.ones(1000)\nprint(sys.argv[1:], float(x.sum()))\n")
    plain = subprocess.run([sys.executable, "-m", "pkg", "a", "-m", "b"], cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=300)
    before = set(run_folders(out_dir))
    r = run_cli(["-q", "-o", str(out_dir), "-m", "pkg", "a", "-m", "b"], cwd=str(tmp_path))
    assert r.returncode == plain.returncode == 0 and r.stdout == plain.stdout == "['a', '-m', 'b'] 1000.0\n", r.stderr
    [new] = set(run_folders(out_dir)) - before
    check_invariants(read(dump_of(new)))
    sh = tmp_path / "job.sh"
    sh.write_text(f"#!/bin/sh\n{sys.executable} {os.path.join(EXAMPLES, 'mlp.py')} --steps 1\n"
                  f"echo no-torch-here\nexit 7\n")
    sh.chmod(0o755)
    r = run_cli(["-o", str(out_dir), str(sh)])
    assert r.returncode == 7  # the program's own status
    assert "no-torch-here" in r.stdout
    assert len(run_folders(out_dir)) == 3  # the python child traced, the shell itself not


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test traces compiled code in test_our_api_inside_a_compiled_training_step_is_called_never_traced, test_modules, test_signals_during_flushes and test_transformers_kv")
@pytest.mark.parametrize("source", full(["native"], ["python", "native"]))
def test_torch_compile_under_tracing(out_dir, tmp_path, source):
    """A torch.compile'd loss under tracing: the losses are those of the plain run and the ops are
    recorded. Dynamo never compiles the tracer's own frames (without the code flag of
    capture/ops.py it compiles ~30 frames of it, with graph breaks and recompilation warnings);
    under either source it compiles what it compiles in the plain run."""
    from msmemscope.capture import native
    if source == "native" and native.load_module() is None:
        pytest.skip(f"native source not built: {native.why_not()}")
    script = os.path.join(SCRIPTS, "compiled.py")
    plain = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env_for_tests())
    assert plain.returncode == 0, plain.stderr
    r = run_cli(["-o", str(out_dir), script], env={**env_for_tests(), "MSMEMSCOPE_SOURCE": source})
    assert r.returncode == 0, r.stderr
    losses = [l for l in r.stdout.splitlines() if l.startswith("loss")]
    assert losses == [l for l in plain.stdout.splitlines() if l.startswith("loss")] and len(losses) == 3
    frames = [l for l in r.stdout.splitlines() if l.startswith("dynamo frames")]
    # both sources: Dynamo compiles what it compiles in the plain run (the dispatch-mode source's
    # mode lets it compile under it since f940096; the expectation of 0 frames here was stale)
    assert frames == [l for l in plain.stdout.splitlines() if l.startswith("dynamo frames")] != ["dynamo frames 0"]
    assert "recompil" not in r.stderr.lower() and "graph break" not in r.stderr.lower()
    [folder] = run_folders(out_dir)
    df = read(dump_of(folder))
    check_invariants(df)
    names = set(df.filter(pl.col("event") == "OP_LAUNCH")["name"].to_list())
    assert "torch._ops.aten.gelu.default" in names and "torch._ops.aten.mse_loss.default" in names
    assert df.filter(pl.col("event_type") == "STEP").height == 3


COMPILED_STEP = """
import torch, msmemscope
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(4, 32)

@torch.compile(backend="aot_eager")
def train_step(x):
    msmemscope.mark("step begins")
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    msmemscope.step()
    return loss

for i in range(4):
    print("loss", round(train_step(x).item(), 5))
from torch._dynamo.utils import counters
for reason in counters["graph_break"]:
    print("BREAK", reason.splitlines()[0])
"""


@pytest.mark.parametrize("source", full(["native"], ["python", "native"]))
def test_our_api_inside_a_compiled_training_step_is_called_never_traced(out_dir, tmp_path, source):
    """A compiled training step that marks its start and ends its step (msmemscope.mark() and
    msmemscope.step() inside torch.compile'd code): the plain run's losses, each mark in its step,
    and the calls are a silent break each (torch._dynamo.disable). Before: Dynamo traced into the
    session and stopped at what it cannot trace: a warning on the program's stderr ("Dynamo does not
    know how to trace the builtin ... drain" on the native source, time.time_ns on the other) and
    breaks at our lock."""
    script = tmp_path / "compiled_step.py"
    script.write_text(COMPILED_STEP)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env_for_tests())
    assert plain.returncode == 0, plain.stderr
    r = run_cli(["-o", str(out_dir), str(script)], env={**env_for_tests(), "MSMEMSCOPE_SOURCE": source})
    assert r.returncode == 0, r.stderr
    losses = [ln for ln in r.stdout.splitlines() if ln.startswith("loss")]
    assert losses == [ln for ln in plain.stdout.splitlines() if ln.startswith("loss")] and len(losses) == 4
    assert "Dynamo does not know" not in r.stderr, r.stderr[-3000:]
    breaks = [ln for ln in r.stdout.splitlines() if ln.startswith("BREAK")]
    assert not [b for b in breaks if "does not know" in b or "context manager" in b], breaks
    [folder] = run_folders(out_dir)
    df = read(dump_of(folder))
    check_invariants(df)
    rows = df.filter((pl.col("event") == "MSTX") | (pl.col("event_type") == "STEP")).select("event", "step").rows()
    assert rows == [(e, k) for k in range(1, 5) for e in ("MSTX", "SYSTEM")], rows


def test_dump_writer_process_and_its_fallback(out_dir, tmp_path):
    """The rows reach the same dump whether a writer process writes them (the default) or the
    traced process does (MSMEMSCOPE_WRITER=inline, or a writer process that cannot start)."""
    mlp = os.path.join(EXAMPLES, "mlp.py")
    seqs = {}
    # the broken writer process writes in this process, the path MSMEMSCOPE_WRITER=inline takes too
    for how in full(("spool", "broken"), ("spool", "inline", "broken")):
        out = tmp_path / how
        env = env_for_tests()
        if how == "inline":
            env["MSMEMSCOPE_WRITER"] = "inline"
        prog = [mlp, "--steps", "3"]
        if how == "broken":  # the writer process's interpreter does not exist: the run writes itself
            wrapper = tmp_path / "broken.py"
            wrapper.write_text(f"import sys, runpy\nsys.executable = '/nonexistent/python'\n"
                               f"sys.argv = [{mlp!r}, '--steps', '3']\nrunpy.run_path({mlp!r}, run_name='__main__')\n")
            prog = [str(wrapper)]
        r = subprocess.run([sys.executable, "-m", "msmemscope", "-o", str(out), *prog], capture_output=True,
                           text=True, env=env)
        assert r.returncode == 0, r.stderr
        [folder] = run_folders(out)
        df = read(dump_of(folder))
        check_invariants(df)
        seqs[how] = df.select("event", "event_type", "name", "size").rows()
        log = open(os.path.join(folder, "msmemscope_logs", os.listdir(os.path.join(folder, "msmemscope_logs"))[0])).read()
        assert ("writing in this process" in log) == (how == "broken"), log
    assert len(seqs["spool"]) > 500
    assert all(seq == seqs["spool"] for seq in seqs.values())


def test_dump_writer_process_killed(out_dir):
    """The writer process dies mid-run (as under the OOM killer): the program goes on unchanged,
    the traced process writes the rest itself, the dump stays readable and says what was lost."""
    script = os.path.join(SCRIPTS, "writer_killed.py")
    plain = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env_for_tests())
    assert plain.returncode == 0, plain.stderr
    r = run_cli(["-o", str(out_dir), script])
    assert r.returncode == 0, r.stderr
    assert [l for l in r.stdout.splitlines() if l.startswith("loss")] == plain.stdout.splitlines()
    [folder] = run_folders(out_dir)
    df = read(dump_of(folder))
    assert df["id"].is_sorted()
    steps = df.filter(pl.col("event_type") == "STEP")["attr"].to_list()
    assert any('"step":6' in a for a in steps) and any('"step":4' in a for a in steps), steps
    assert df.filter(pl.col("event") == "SYSTEM")["event_type"][-1] == "PROC_EXIT"
    logs = os.path.join(folder, "msmemscope_logs")
    assert "dump writer process ended" in open(os.path.join(logs, os.listdir(logs)[0])).read()


def test_read_dump_after_stop_in_the_same_process(tmp_path):
    """stop() returns with every row on disk (the writer process has caught up), and start()
    afterwards goes on appending to the same dump."""
    seen = read_after_stop(tmp_path / "o")
    for which in ("first", "second"):
        height, written, last = seen[which]
        assert height == written == last, (which, seen)
    assert seen["second"][0] > seen["first"][0] > 1000
    [folder] = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    kinds = df.filter(pl.col("event") == "SYSTEM")["event_type"].to_list()
    assert kinds.count("START_TRACE") == 2 and kinds.count("STOP_TRACE") == 2
