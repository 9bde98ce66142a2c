"""Memory-block watch (SPEC §4.6, issue 5): real programs under the CLI, the
dumps and analysis/watch.json they leave behind."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import FULL as LONG
from conftest import (EXAMPLES, ROOT, TRANSFORMER_SMALL, check_invariants, dump_of, env_for_tests, plain_transformer,
                      full, read, run_cli, run_folders, threads_run)

HAS_CUDA = torch.cuda.is_available()

BUGGY_OPS = '''
import torch

@torch.library.custom_op("bug::poke", mutates_args=())
def poke(x: torch.Tensor) -> torch.Tensor:
    """A buggy kernel: its schema says it only reads x, but it writes x's first element."""
    r = x.sum()
    x.view(-1)[0].add_(1)
    return r

@torch.library.custom_op("bug::tag", mutates_args=())
def tag(x: torch.Tensor) -> torch.Tensor:
    return x.clone()
'''


def write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def line_of(path, marker):
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if marker in line:
                return i
    raise AssertionError(marker)


def one_run(out):
    folders = run_folders(out)
    assert len(folders) == 1, folders
    return folders[0]


def watch_json(folder):
    with open(os.path.join(folder, "analysis", "watch.json")) as f:
        return json.load(f)


def checksum_rows(folder):
    files = glob.glob(os.path.join(folder, "device_*", "watch_dump", "watch_dump_data_check_sum_*.csv"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        lines = f.read().splitlines()
    assert lines[0] == "Tensor info,Check data sum"
    return [tuple(line.rsplit(",", 1)) for line in lines[1:]]


def bins(folder):
    return {os.path.basename(p)[:-4]: open(p, "rb").read()
            for p in glob.glob(os.path.join(folder, "device_*", "watch_dump", "*.bin"))}


def check(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# ---------------------------------------------------------------- the stomp in a training loop
TRAIN_API = BUGGY_OPS + '''
import sys
sys.path.insert(0, {examples!r})
import torch.nn.functional as F
from transformer import GPT
import msmemscope

dev = sys.argv[1]
torch.manual_seed(0)
model = GPT(vocab=64, d=32, heads=2, layers=1, ctx=16).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 64, (2, 17), device=dev)
x, y = data[:, :-1], data[:, 1:]
msmemscope.watcher.watch(model.tok.weight, name="tok_weight")
for step in range(3):
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    if step == 1:
        stat = torch.ops.bug.poke(model.tok.weight.detach())   # THE BUG
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    opt.step()
    print("loss", loss.item())
'''


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device"))])
def test_stomp_by_custom_op_in_training_loop(tmp_path, out_dir, dev):
    script = write(tmp_path, "train_api.py", TRAIN_API.format(examples=EXAMPLES))
    bug_line = line_of(script, "THE BUG")
    p = check(run_cli(["-o", str(out_dir), script, dev]))
    assert p.stdout.count("loss") == 3
    folder = one_run(out_dir)
    rep = watch_json(folder)
    stomps = rep["stomps"]
    # exactly one stomp, at the buggy op, with the user's line
    assert len(stomps) == 1, stomps
    s = stomps[0]
    assert s["kind"] == "stomp"
    assert s["op"] == "bug.poke.default" and s["name"] == "torch._ops.bug.poke.default"
    assert s["call"] == 1 and s["watched"] == "tok_weight" and s["step"] == 2
    assert s["line"].startswith(f"{script}:{bug_line}("), s["line"]
    # the optimizer's in-place updates of the weight are declared writes, listed as such
    writes = [c for c in rep["changes"] if c["kind"] == "write"]
    assert len(writes) >= 3
    assert all(c["watched"] == "tok_weight" for c in writes)
    assert {c["step"] for c in writes} == {1, 2, 3}
    assert "bug.poke.default" not in {c["op"] for c in writes}
    # console and log say it too
    assert "STOMP: 'tok_weight' changed by bug.poke.default (call 1" in p.stderr
    assert f"{script}:{bug_line}" in p.stderr
    log = glob.glob(os.path.join(folder, "msmemscope_logs", "*.log"))[0]
    text = open(log).read()
    assert "STOMP" in text and "bug.poke.default" in text
    # every op was checked before and after: the checksum file pairs up
    rows = checksum_rows(folder)
    assert len(rows) % 2 == 0 and len(rows) >= 2 * len(rep["changes"])
    assert all(r[0].endswith(("_before", "_after")) and r[1].startswith("0x") for r in rows)
    poke_rows = [r for r in rows if "_bug.poke.default_1-tok_weight_0_" in r[0]]
    assert len(poke_rows) == 2 and poke_rows[0][1] != poke_rows[1][1]


TRAIN_CLI = BUGGY_OPS + '''
import sys
sys.path.insert(0, {examples!r})
import torch.nn.functional as F
from transformer import GPT

torch.manual_seed(0)
model = GPT(vocab=64, d=32, heads=2, layers=1, ctx=16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 64, (2, 17))
x, y = data[:, :-1], data[:, 1:]
for step in range(3):
    opt.zero_grad(set_to_none=True)
    targets = torch.ops.bug.tag(y)
    logits = model(x)
    if step == 1:
        torch.ops.bug.poke(targets)          # THE BUG
    targets.view(-1)[-1:].add_(64).sub_(64)  # declared in-place writes
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    opt.step()
    print("loss", loss.item())
'''


def test_cli_window_watches_start_output(tmp_path, out_dir):
    """--watch=start#N:outid,end alone: the start op's output is watched until the end op."""
    script = write(tmp_path, "train_cli.py", TRAIN_CLI.format(examples=EXAMPLES))
    bug_line = line_of(script, "THE BUG")
    p = check(run_cli(["-o", str(out_dir), "--watch=bug.tag#2:0,aten.nll_loss_forward", script]))
    folder = one_run(out_dir)
    rep = watch_json(folder)
    assert rep["window"] == {"opened": "bug.tag.default#2", "closed": "aten.nll_loss_forward.default#2"}
    [w] = rep["watched"]
    assert w["name"] == "bug.tag.default" and w["source"] == "start op" and w["stopped"] == "end op reached"
    assert w["length"] == 2 * 16 * 8
    [s] = rep["stomps"]
    assert s["op"] == "bug.poke.default" and s["call"] == 1 and s["step"] == 2
    assert s["line"].startswith(f"{script}:{bug_line}(")
    assert [c["op"] for c in rep["changes"] if c["kind"] == "write"] == ["aten.add_.Tensor", "aten.sub_.Tensor"]
    rows = checksum_rows(folder)
    names = [r[0] for r in rows]
    # the start op: only 'after' (the block did not exist before); the end op: both
    assert names[0].endswith("_bug.tag.default_2-bug.tag.default_0_after")
    assert names[-2].endswith("_aten.nll_loss_forward.default_2-bug.tag.default_0_before")
    assert names[-1].endswith("_aten.nll_loss_forward.default_2-bug.tag.default_0_after")
    assert not any("_bug.tag.default_3-" in n for n in names)
    assert "STOMP" in p.stderr


# ---------------------------------------------------------------- legitimate writes, untraced writes
INPLACE = '''
import torch, msmemscope
w = torch.zeros(16)
msmemscope.watcher.watch(w, name="w")
w.add_(1)
w[2:4].mul_(3)
y = w * 2
torch.add(w, 1, out=w)
w.copy_(y)
z = y + 1
w.numpy()[0] = 7.0          # UNTRACED WRITE
z = z + 1
print("done")
'''


def test_inplace_writes_are_not_stomps(tmp_path, out_dir):
    script = write(tmp_path, "inplace.py", INPLACE)
    p = check(run_cli(["-o", str(out_dir), script]))
    rep = watch_json(one_run(out_dir))
    writes = [c["op"] for c in rep["changes"] if c["kind"] == "write"]
    assert writes == ["aten.add_.Tensor", "aten.mul_.Tensor", "aten.add.out", "aten.copy_.default"]
    assert not [s for s in rep["stomps"] if s["kind"] == "stomp"]
    # the write through numpy is outside every op: reported as an untraced change, not blamed on an op
    [u] = rep["stomps"]
    assert u["kind"] == "untraced" and u["op"] is None and u["before_op"] == "aten.add.Tensor#2"
    assert "changed outside any traced op" in p.stderr


# ---------------------------------------------------------------- full-content dumps
FULL = '''
import sys, torch, msmemscope
out = sys.argv[1]
a = torch.ones(4)
w = torch.arange(8, dtype=torch.float32)
msmemscope.watcher.watch(w, name="w")
msmemscope.watcher.watch(w.data_ptr() + 8, length=12, name="mid")
b = a * 3                 # start: aten.mul.Tensor
w.add_(1)
snap = w.clone()
b.add_(1)
s = b.sum()               # end
w.mul_(2)                 # outside the window
open(out + "/w_after_add.bin", "wb").write(snap.numpy().tobytes())
open(out + "/b.bin", "wb").write(b.numpy().tobytes())
'''


def test_full_content_bins_hold_the_block_bytes(tmp_path, out_dir):
    script = write(tmp_path, "full.py", FULL)
    keep = tmp_path / "keep"
    keep.mkdir()
    check(run_cli(["-o", str(out_dir), "--watch=aten.mul.Tensor:0,aten.sum,full-content", script, str(keep)]))
    folder = one_run(out_dir)
    got = bins(folder)
    assert not glob.glob(os.path.join(folder, "device_*", "watch_dump", "*.csv"))
    w_after_add = (keep / "w_after_add.bin").read_bytes()
    b_final = (keep / "b.bin").read_bytes()
    assert len(w_after_add) == 32 and len(b_final) == 16

    def one(suffix):
        hits = [k for k in got if k.endswith(suffix)]
        assert len(hits) == 1, (suffix, sorted(got))
        return got[hits[0]]

    arange = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    assert one("_aten.add_.Tensor_1-w_0_before") == arange
    assert one("_aten.add_.Tensor_1-w_0_after") == w_after_add
    assert one("_aten.add_.Tensor_1-mid_0_after") == w_after_add[8:20]
    assert one("_aten.sum.default_1-w_0_after") == w_after_add
    # the start op's output: 3.0s after the start op, then b.add_ makes them 4.0s
    assert one("_aten.mul.Tensor_1-aten.mul.Tensor_0_after") == torch.full((4,), 3.0).numpy().tobytes()
    assert one("_aten.add_.Tensor_2-aten.mul.Tensor_0_after") == b_final
    assert one("_aten.sum.default_1-aten.mul.Tensor_0_after") == b_final
    # the start op's output only inside the window [mul.Tensor#1, sum#1]; the blocks given to
    # watcher.watch() around every op until remove() (or the end), the window's or not (issue #18)
    outside = sorted(k for k in got if "aten.mul_.Tensor" in k)
    assert [k.split("-", 1)[1] for k in outside] == ["mid_0_after", "mid_0_before", "w_0_after", "w_0_before"]
    doubled = (torch.frombuffer(bytearray(w_after_add), dtype=torch.float32) * 2).numpy().tobytes()
    assert one("_aten.mul_.Tensor_1-w_0_after") == doubled
    # w and mid: before+after each op from watch() on; the start output: after mul, then 4 ops
    ops = ["aten.mul.Tensor_1", "aten.add_.Tensor_1", "aten.clone.default_1", "aten.add_.Tensor_2",
           "aten.sum.default_1", "aten.mul_.Tensor_1", "aten.detach.default_1", "aten.detach.default_2"]
    for name in ("w", "mid"):
        assert sorted(k.split("_", 2)[2] for k in got if f"-{name}_0_" in k) == \
            sorted(f"{op}-{name}_0_{ph}" for op in ops for ph in ("before", "after"))
    assert len([k for k in got if "-aten.mul.Tensor_0_" in k]) == 9
    rep = watch_json(folder)
    assert rep["bin_files"] == len(got) and rep["stomps"] == []


# ---------------------------------------------------------------- dump_nums, remove, freed blocks
LIMITS = '''
import torch, msmemscope
a = torch.zeros(4); b = torch.zeros(4); c = torch.zeros(4); d = torch.zeros(4)
msmemscope.watcher.watch(a, name="a", dump_nums=2)
msmemscope.watcher.watch(b, name="b")
msmemscope.watcher.watch(c, name="c")
msmemscope.watcher.watch(d.data_ptr(), length=8, name="d")
for i in range(3):
    a.add_(1)
msmemscope.watcher.remove(b)
msmemscope.watcher.remove(d.data_ptr(), length=8)
del c
b.add_(1)
a.add_(1)
print("finished", float(a.sum()), float(b.sum()))
'''


def test_dump_nums_remove_and_freed_block(tmp_path, out_dir):
    script = write(tmp_path, "limits.py", LIMITS)
    p = check(run_cli(["-o", str(out_dir), script]))
    assert "finished 16.0 4.0" in p.stdout
    assert "watched block 'c' was freed; watching it stopped" in p.stderr
    assert "Traceback" not in p.stderr
    folder = one_run(out_dir)
    rows = checksum_rows(folder)
    per = {}
    for info, _ in rows:
        name = info.split("-", 1)[1].rsplit("_", 2)[0]
        per[name] = per.get(name, 0) + 1
    # a: dump_nums=2 -> two ops; b, c, d: the three add_ before remove()/free
    assert per == {"a": 4, "b": 6, "c": 6, "d": 6}
    rep = watch_json(folder)
    stopped = {w["name"]: w["stopped"] for w in rep["watched"]}
    assert stopped == {"a": "reached dump_nums=2", "b": "removed", "c": "was freed", "d": "removed"}
    assert any("'c' was freed" in w for w in rep["warnings"])
    assert rep["stomps"] == []


# ---------------------------------------------------------------- the original's example; config(); errors
SEED_EXAMPLE = '''
import torch
import msmemscope

test_tensor = torch.randn(2,3).to('cpu')
msmemscope.watcher.watch(test_tensor, name="test", dump_nums=2)
y = test_tensor * 2
test_tensor.mul_(2)
z = y + 1
msmemscope.watcher.remove(test_tensor)

test_tensor = torch.randn(2,3).to('cpu')
msmemscope.watcher.watch(test_tensor.data_ptr(), length=1000, name="test", dump_nums=2)
y = test_tensor * 2
msmemscope.watcher.remove(test_tensor.data_ptr(), length=1000)
print("ok")
'''


def test_original_example_runs_unchanged(tmp_path, out_dir):
    script = write(tmp_path, "seed_watch.py", SEED_EXAMPLE)
    p = check(run_cli(["-o", str(out_dir), script]))
    assert p.stdout.strip() == "ok"
    assert "length 1000 runs past the end of its block" in p.stderr
    rows = checksum_rows(one_run(out_dir))
    assert len(rows) == 2 * 2 + 1 * 2
    # without a trace the API warns once (before: twice, by logging's last-resort handler too) and
    # does nothing
    plain = subprocess.run([sys.executable, script], env=env_for_tests(), capture_output=True, text=True,
                           cwd=str(tmp_path), timeout=600)
    assert plain.returncode == 0 and plain.stdout.strip() == "ok"
    assert plain.stderr.count("nothing is traced") == 1, plain.stderr


CONFIG = '''
import sys, torch, msmemscope
msmemscope.config(watch="aten.mul.Tensor:0,aten.sum.default", output=sys.argv[1])
msmemscope.start()
a = torch.ones(4)
b = a * 3
b.add_(1)
s = b.sum()
msmemscope.stop()
print(float(s))
'''


def test_config_watch(tmp_path, out_dir):
    script = write(tmp_path, "cfg.py", CONFIG)
    p = subprocess.run([sys.executable, script, str(out_dir)], env=env_for_tests(), capture_output=True,
                       text=True, cwd=str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "16.0"
    folder = one_run(out_dir)
    names = [r[0].split("_", 2)[2] for r in checksum_rows(folder)]
    assert names == ["aten.mul.Tensor_1-aten.mul.Tensor_0_after",
                     "aten.add_.Tensor_1-aten.mul.Tensor_0_before", "aten.add_.Tensor_1-aten.mul.Tensor_0_after",
                     "aten.sum.default_1-aten.mul.Tensor_0_before", "aten.sum.default_1-aten.mul.Tensor_0_after"]
    rep = watch_json(folder)
    assert [c["kind"] for c in rep["changes"]] == ["write"] and rep["stomps"] == []


@pytest.mark.parametrize("value", ["aten.mm#x,aten.add", "full-content", "a,b,c", "aten.mm:x,aten.add",
                                   "aten.mm#0,aten.add"])
def test_bad_watch_option(tmp_path, value):
    p = run_cli([f"--watch={value}", "-o", str(tmp_path / "o"), os.path.join(EXAMPLES, "mlp.py")])
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msmemscope: error: --watch"), p.stderr
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


def test_op_patterns():
    from msmemscope.capture.watch import OpPattern
    for text in ("torch._ops.aten.mm.default", "aten.mm.default", "aten.mm", "mm.default", "mm", "aten.mm#3"):
        assert OpPattern(text).matches("aten.mm.default"), text
    for text in ("aten.mm.out", "aten.add", "addmm", "default", "mm.out"):
        assert not OpPattern(text).matches("aten.mm.default"), text
    assert OpPattern("aten.mm#3").nth == 3 and OpPattern("aten.mm").nth == 1


@pytest.mark.skipif(not LONG, reason="long form only (make test-full): make test compares the losses under watch in "
                    "test_watch_from_another_thread_blames_no_op_for_the_owners_declared_writes and the optimizer-in-backward test")
def test_watching_does_not_change_results(tmp_path, out_dir, shared_run):
    """SPEC §6: the same losses, bit for bit, with a watch window over the forward pass."""
    args = [os.path.join(EXAMPLES, "transformer.py"), *TRANSFORMER_SMALL]
    plain = plain_transformer(shared_run)  # one plain run for this file and test_capture.py
    p = check(run_cli(["-o", str(out_dir), "--watch=aten.mm.default:0,aten.nll_loss_forward", *args]))
    assert p.stdout == plain and plain.count("loss") == 2
    rep = watch_json(one_run(out_dir))
    assert rep["window"]["closed"] == "aten.nll_loss_forward.default#1" and rep["stomps"] == []


COMPILED_WRITE = '''
import torch, msmemscope
w = torch.arange(8, dtype=torch.float32)
msmemscope.watcher.watch(w, name="w")
w.add_(1)                                   # eager: a declared write
f = torch.compile(lambda t: t.mul_(2), backend="inductor")
f(w)                                        # compiled: inductor's kernel writes w, no op call
print("sum", w.sum().item())
'''


@pytest.mark.skipif(not LONG, reason="long form only (make test-full): inductor's compile is ~30 CPU s; make test "
                    "watches a compiled model across a stop/start gap in test_modules.py")
def test_a_write_by_compiled_code_is_said_to_be_likely_its_own(tmp_path, out_dir):
    """watch() hands over to the dispatch-mode source, under which torch.compile'd code stays
    compiled: an inductor kernel that writes a watched block in place runs no operator call, so the
    change is an untraced one. It is reported as such, with the hint that compiled code runs in
    this program (``compiled_code``), not as an op's stomp; the program's result is the plain one."""
    script = write(tmp_path, "compiled_write.py", COMPILED_WRITE)
    if LONG:  # the plain run (a second inductor compile) in the long form; its result is the same sum
        plain = subprocess.run([sys.executable, script], env=env_for_tests(), capture_output=True, text=True,
                               timeout=300)
        assert plain.returncode == 0, plain.stderr[-2000:]
        assert plain.stdout.splitlines()[-1] == "sum 72.0"
    p = check(run_cli(["-o", str(out_dir), script]))
    assert p.stdout.splitlines()[-1] == "sum 72.0"
    check_invariants(read(dump_of(one_run(out_dir))))
    rep = watch_json(one_run(out_dir))
    assert [(c["kind"], c["op"]) for c in rep["changes"]] == [("write", "aten.add_.Tensor"), ("untraced", None)]
    assert rep["changes"][1].get("compiled_code") is True and "compiled_code" not in rep["changes"][0]
    assert "torch.compile'd code" in p.stderr


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))  # make test: the handover's path
def test_watch_from_another_thread_blames_no_op_for_the_owners_declared_writes(tmp_path, source):
    """A thread watches a weight that another thread's optimizer updates at every step. Every
    change is that optimizer's declared write (its op, on its thread), none a stomp, and the first
    thread's ops stay in the dump after the watch began. Before: on the native source the handover
    to the dispatch mode followed only the watching thread (the first one's ops and new blocks left
    the dump; ~130 stomps 'outside any traced op'); on both, a change made by one thread's op inside
    another thread's op was blamed on the latter (~25 stomps)."""
    out = []
    folder, df = threads_run(tmp_path, ["watch", "150"], {**env_for_tests(), "MSMEMSCOPE_SOURCE": source},
                             ["--analysis=leaks"], stdout=out)
    rep = watch_json(folder)
    (w,) = rep["watched"]
    assert w["stomps"] == 0 and not rep["stomps"], rep["stomps"][:3]
    writes = [c for c in rep["changes"] if c["kind"] == "write"]
    assert {c["op"] for c in writes} <= {"aten.addcdiv_.default", "aten._foreach_addcdiv_.Scalar",
                                         "aten._foreach_addcdiv_.ScalarList", "aten.add_.Tensor"}, \
        sorted({c["op"] for c in writes})
    assert len({c["tid"] for c in writes}) == 1  # the optimizer's thread, the one that trains the model
    # one write for each of that optimizer's steps after the watch began: at least the steps it took
    # after watch() returned, at most those after it was asked for (where the first thread was
    # then depends on the scheduler, so no constant; one step less: its count is taken after its
    # optimizer step). Before: a write that another thread's op saw first was never reported.
    asked, returned = (int(v) for v in out[0].split("WATCHED", 1)[1].split()[:2])
    assert 150 - returned - 1 <= len(writes) <= 150 - asked and 150 - returned >= 10, (len(writes), asked, returned)
    import polars as pl
    launches = df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("tid") == writes[0]["tid"]))
    # its ops are in the dump after the watch began (each step of it: ~40 launch rows)
    assert launches.filter(pl.col("step") > writes[0]["step"]).height >= 40 * (len(writes) - 1), launches.height


OWN_PROFILER = """
import sys, threading, time, torch, msmemscope
calls = {"n": 0}
def prof(frame, event, arg):
    calls["n"] += 1
go, done, kept = threading.Event(), threading.Event(), []
def work():
    sys.setprofile(prof)                   # the program profiles this thread itself
    a = torch.randn(32, 32)
    go.set()
    while not done.is_set():
        (a @ a).sum()
        time.sleep(0.001)
    kept.append(sys.getprofile() is prof)
t = threading.Thread(target=work)
t.start()
go.wait()
time.sleep(0.05)
msmemscope.watcher.watch(torch.ones(8), name="w")   # the other thread is followed from its next call
n, after = calls["n"], time.time_ns()
time.sleep(0.2)
done.set()
t.join()
print("PROFILED", calls["n"] > n, kept, t.ident, after)
"""


def test_a_thread_with_its_own_profiler_keeps_it_when_the_tracer_follows_it(tmp_path, out_dir):
    """The handover to the dispatch mode (watch) follows a thread already running through a one-shot
    profile function on it: the program's own profile function on that thread is put back (and sees
    the event), it keeps profiling, and the thread's ops are in the dump from then on."""
    script = write(tmp_path, "own_profiler.py", OWN_PROFILER)
    p = check(run_cli(["-o", str(out_dir), script], env={**env_for_tests(), "MSMEMSCOPE_SOURCE": "native"}))
    profiled, kept, tid, after = p.stdout.split("PROFILED", 1)[1].split()
    assert profiled == "True" and kept == "[True]", p.stdout
    df = read(dump_of(one_run(out_dir)))
    check_invariants(df)
    import polars as pl
    ops = df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("tid") == int(tid)) & (pl.col("ts") > int(after)))
    assert ops.height >= 50, ops.height  # ~0.2 s of its loop after the watch began


STRADDLE = '''
import sys, threading, torch, msmemscope

entered, release = threading.Event(), threading.Event()


@torch.library.custom_op("straddle::wait_here", mutates_args=())
def wait_here(x: torch.Tensor) -> torch.Tensor:
    r = x.clone()      # before the wait: an op inside this one would be checked on its own
    entered.set()
    release.wait(60)   # the other thread's op is in flight while the main thread stops tracing
    return r


order = sys.argv[1]
w = torch.zeros(64)
msmemscope.watcher.watch(w, name="w")
y = w + 1                          # checked: the baseline
t = threading.Thread(target=lambda: wait_here(torch.ones(4)))
t.start()
entered.wait(60)
msmemscope.stop()
if order == "ends_in_gap":         # the op ends inside the gap, before the untraced write
    release.set()
    t.join()
w.add_(5)                          # the gap: untraced, not checked (docs/watch.md)
if order == "ends_after_gap":      # the op ends after the gap's write, and after start()
    msmemscope.start()
    release.set()
    t.join()
else:
    msmemscope.start()
z = w * 2                          # traced ops after the gap: their checks start afresh
w.mul_(3)                          # a declared write, reported
print("sum", float(w.sum()))
'''


@pytest.mark.parametrize("order", full(["ends_in_gap"], ["ends_in_gap", "ends_after_gap"]))
@pytest.mark.parametrize("source", full(["python"], ["python", "native"]))
def test_an_op_in_flight_across_a_stop_takes_no_baseline_from_the_gap(tmp_path, out_dir, order, source):
    """Another thread's op begins before stop() and ends inside the gap or after start(). The watch
    forgets its checksums at stop(), but that op's after() used to check the block and note a new
    baseline: ending in the gap it noted the checksum before the gap's untraced write, and the first
    op after start() reported that write as an untraced stomp (the optimizer-in-backward test with
    threads, a gap and watch, once under load); ending after start() it blamed the gap's write on
    itself, a stomp by an op that declares no write. Now the op's check is dropped; the next op
    starts afresh and the write after the gap is reported as the declared write it is."""
    script = write(tmp_path, "straddle.py", STRADDLE)
    p = check(run_cli(["-o", str(out_dir), script, order], env={**env_for_tests(), "MSMEMSCOPE_SOURCE": source}))
    assert p.stdout.splitlines()[-1] == "sum 960.0"
    folder = one_run(out_dir)
    check_invariants(read(dump_of(folder)))
    rep = watch_json(folder)
    assert not rep["stomps"], rep["stomps"]
    assert [(c["kind"], c["op"]) for c in rep["changes"]] == [("write", "aten.mul_.Tensor")], rep["changes"]
