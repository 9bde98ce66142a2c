"""The native capture source (capture/_native.cpp) against the dispatch-mode source, on real
training runs: the same memory story, the same leaks, the same losses; and its fallbacks."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from conftest import EXAMPLES, FULL, source_env, check_invariants, config_of, dump_of, env_for_tests, read, run_cli, run_folders

from msmemscope.capture import native

needs_native = pytest.mark.skipif(native.load_module() is None,
                                reason=f"native source not built: {native.why_not()}")


_env = source_env


def _run(out, args, source, **extra):
    r = run_cli([f"--output={out}", *args], env=_env(source, **extra))
    assert r.returncode == 0, r.stderr[-3000:]
    (folder,) = run_folders(out)
    return r, folder


TRAIN_AND_LEAK = """
import torch, torch.nn.functional as F
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
keep, losses = [], []
for step in range(6):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
    loss.backward()
    opt.step()
    keep.append(torch.empty(300, 1000))   # leaks 1.2 MB a step
    losses.append(loss.item())
print("LOSSES", repr(losses))
"""


@needs_native
def test_native_and_dispatch_sources_tell_the_same_story(out_dir, tmp_path):
    prog = tmp_path / "train.py"
    prog.write_text(TRAIN_AND_LEAK)
    res = {}
    for source in ("native", "python"):
        out = out_dir / source
        r, folder = _run(out, [str(prog)], source)
        assert config_of(folder)["source"] == ("native" if source == "native" else "dispatch")
        df = read(dump_of(folder))
        live = check_invariants(df)  # used == running sum on every row, FREE after MALLOC, ops paired
        with open(os.path.join(folder, "analysis", "leaks.json")) as f:
            leaks = json.load(f)["leaks"]
        losses = [ln for ln in r.stdout.splitlines() if ln.startswith("LOSSES")]
        res[source] = (df, live, leaks, losses)
    (nd, nlive, nleaks, nloss), (pd, plive, pleaks, ploss) = res["native"], res["python"]
    assert nloss == ploss and nloss  # tracing never changes what the program computes
    # the leak rule finds the same blocks: one 1.2 MB block from each of steps 2..5, made by aten.empty
    def key(lk):
        return (lk["step"], lk["size"], lk["op"])
    assert sorted(map(key, nleaks)) == sorted(map(key, pleaks))
    assert [lk["step"] for lk in sorted(nleaks, key=key)] == [2, 3, 4, 5]
    assert {lk["op"] for lk in nleaks} == {"torch._ops.aten.empty.memory_format"}
    assert all(lk["size"] == 300 * 1000 * 4 for lk in nleaks)
    # the leaked bytes still allocated at the end are in both (the native source also counts
    # temporaries inside ops, which the dispatch mode never sees, but none of those outlive them)
    big = 300 * 1000 * 4
    assert sum(1 for s in nlive.values() if s == big) == sum(1 for s in plive.values() if s == big) == 6
    # step boundaries and the top-level ops agree
    def steps(df):
        return df.filter(df["event_type"] == "STEP").height
    assert steps(nd) == steps(pd) == 6
    def ops(df):
        return set(df.filter(df["event_type"] == "ATEN_START")["name"].to_list())
    common = ops(nd) & ops(pd)
    for name in ("torch._ops.aten.empty.memory_format", "torch._ops.aten.gelu.default",
                 "torch._ops.aten.addcmul_.default"):
        assert name in common, name
    # every native MALLOC names its op; the few outside any op are Python numbers made into
    # 0-dim tensors by the argument parser (AdamW's step count), which no dispatch mode sees
    nm = nd.filter(nd["event"] == "MALLOC")
    outside = nm.filter(~nm["name"].str.starts_with("torch._ops."))
    assert set(outside["name"].to_list()) <= {"N/A"} and outside["size"].max() <= 8, outside
    assert nm["used"].max() >= pd.filter(pd["event"] == "MALLOC")["used"].max()


@needs_native
def test_native_transformer_example_peak_matches(out_dir):
    """The transformer example on both sources (~10 s: in make test, as it reaches what the small
    programs do not: oneDNN's GELU frees a null pointer through the CPU allocator's raw deleter,
    which once crashed the native source)."""
    peaks = {}
    for source in ("native", "python"):
        _, folder = _run(out_dir / source, [os.path.join(EXAMPLES, "transformer.py"), "--steps", "3"], source)
        df = read(dump_of(folder))
        check_invariants(df)
        peaks[source] = df.filter(df["event"] == "MALLOC")["used"].max()
    # the same tensors are live at the peak; the native source may add short-lived temporaries
    assert peaks["python"] <= peaks["native"] <= peaks["python"] * 1.25, peaks


ORDER = """
import sys, threading, torch, msmemscope
msmemscope.config(output=sys.argv[1])
msmemscope.start()
a = torch.ones(1000)
msmemscope.mark("between")
b = torch.zeros(2000)
def worker():
    global c
    c = torch.full((3000,), 2.0)
t = threading.Thread(target=worker); t.start(); t.join()
# a top-level op with nested ops (linear -> t, matmul, mm): nested ops make no rows, and a
# profiler started inside the traced window (or after it) still sees them
x, w = torch.randn(4, 8), torch.randn(6, 8)
y = torch.nn.functional.linear(x, w)
from torch.profiler import profile
def seen():
    with profile() as p:
        torch.nn.functional.linear(x, w)
    return sorted({e.name for e in p.events()} & {"aten::linear", "aten::t", "aten::mm"})
print("PROF_TRACED", seen())
msmemscope.step()
del a
msmemscope.stop()
d = torch.ones(5000)          # after stop: not recorded
print("PROF_AFTER", seen())   # nothing left RecordFunction off on this thread
print("TIDS", threading.get_ident(), t.ident)
"""


@needs_native
def test_native_rows_keep_their_order_threads_and_stop(tmp_path):
    prog = tmp_path / "order.py"
    prog.write_text(ORDER)
    out = tmp_path / "o"
    env = _env("native")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(prog), str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    main_tid, worker_tid = map(int, [ln for ln in r.stdout.splitlines() if ln.startswith("TIDS")][0].split()[1:])
    (folder,) = run_folders(out)
    assert config_of(folder)["source"] == "native"
    df = read(dump_of(folder))
    check_invariants(df)
    rows = [(e, t, n, s) for e, t, n, s in df.select("event", "event_type", "name", "size").iter_rows()]
    sizes = [(s, i) for i, (e, t, n, s) in enumerate(rows) if e == "MALLOC"]
    order = {s: i for s, i in sizes}
    mark = next(i for i, r in enumerate(rows) if r[0] == "MSTX")
    step = next(i for i, r in enumerate(rows) if r[1] == "STEP")
    assert order[4000] < mark < order[8000] < order[12000] < step
    free_a = next(i for i, r in enumerate(rows) if r[0] == "FREE" and r[3] == 4000)
    assert step < free_a
    assert 20000 not in order  # allocated after stop()
    tids = dict(df.filter(df["event"] == "MALLOC").select("size", "tid").iter_rows())
    assert tids[12000] == worker_tid and tids[4000] == main_tid
    # a profiler inside and after the traced window sees nested ops as without tracing
    want = ["aten::linear", "aten::mm", "aten::t"]
    for tag in ("PROF_TRACED", "PROF_AFTER"):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(tag))
        assert line == f"{tag} {want}", line
    # the linear is one top-level op, its output made inside it; its nested ops make no rows
    starts = df.filter(df["event_type"] == "ATEN_START")["name"].to_list()
    assert starts.count("torch._ops.aten.linear.default") == 2  # once bare, once under the profiler
    assert not any(n.startswith(("torch._ops.aten.mm", "torch._ops.aten.t.")) for n in starts), starts
    out = df.filter((df["event"] == "MALLOC") & (df["size"] == 4 * 6 * 4))["name"].to_list()
    assert out and set(out) == {"torch._ops.aten.linear.default"}, out


@needs_native
def test_native_buffer_drains_without_steps(tmp_path):
    """An inference loop with no step boundary: the C++ buffer is drained from the op exit
    whenever it passes its bound, so it stays small and rows reach the writer."""
    code = textwrap.dedent("""
        import torch, msmemscope
        from msmemscope import capture
        from msmemscope.capture import session as S
        S.FLUSH_ROWS = 500
        msmemscope.config(output=%r)
        msmemscope.start()
        s = capture.current()
        assert s.native is not None
        written = []
        x = torch.randn(64, 64)
        for i in range(3000):
            y = (x @ x).relu()
            if i %% 500 == 499:
                written.append(s.next_id)
        msmemscope.stop()
        print("WRITTEN", written)
    """ % str(tmp_path / "o"))
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], env=_env("native"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    written = eval(r.stdout.split("WRITTEN", 1)[1])
    # rows were numbered (flushed) while the loop ran, and kept growing
    assert written[0] > 0 and all(b > a for a, b in zip(written, written[1:])), written
    df = read(dump_of(run_folders(tmp_path / "o")[0]))
    check_invariants(df)
    assert df.filter(df["event_type"] == "ATEN_START").height >= 3000 * 2


@needs_native
def test_source_choice_and_fallbacks(out_dir, tmp_path):
    prog = os.path.join(EXAMPLES, "mlp.py")
    # options that need the dispatch mode choose it, and MSMEMSCOPE_SOURCE=native says why
    r, folder = _run(out_dir / "a", ["--call-stack=c:5", prog, "--steps", "2"], "native")
    assert config_of(folder)["source"] == "dispatch"
    assert "C call stacks are taken by the dispatch-mode source" in r.stdout + r.stderr
    # not built (an empty build folder): the dispatch-mode source, and the log says why (long form:
    # test_native_build.py's runs fall back in make test)
    if FULL:
        r, folder = _run(out_dir / "b", [prog, "--steps", "2"], "auto", MSMEMSCOPE_NATIVE_DIR=str(tmp_path / "none"))
        assert config_of(folder)["source"] == "dispatch"
        log = open(next(iter(__import__("glob").glob(os.path.join(folder, "msmemscope_logs", "*.log"))))).read()
        assert "not native: the native source is not built" in log
        assert "captured through the dispatch mode, slower: the native source is not built" in r.stderr
        df = read(dump_of(folder))
        assert df.filter(df["event"] == "MALLOC").height > 0
    # a broken build is not loaded, and the run still traces
    bad = tmp_path / "bad"
    d = bad / native.module_name()
    d.mkdir(parents=True)
    (d / (native.module_name() + ".so")).write_bytes(b"not an ELF file")
    r, folder = _run(out_dir / "c", [prog, "--steps", "2"], "auto", MSMEMSCOPE_NATIVE_DIR=str(bad))
    assert config_of(folder)["source"] == "dispatch"
    assert read(dump_of(folder)).filter(read(dump_of(folder))["event"] == "MALLOC").height > 0


STOMP = """
import torch, msmemscope
from msmemscope import capture, watcher
msmemscope.config(output=%r)
msmemscope.start()
assert capture.current().native is not None
w = torch.zeros(256)
watcher.watch(w, name="weights")
x = torch.ones(256)
y = x * 2
w.add_(1.0)            # the stomp
z = y + 1
msmemscope.stop()
print("done")
"""


@needs_native
def test_watch_api_on_a_native_session(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", STOMP % str(tmp_path / "o")], env=_env("native"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    folder = run_folders(tmp_path / "o")[0]
    with open(os.path.join(folder, "analysis", "watch.json")) as f:
        rep = json.load(f)
    # the one op that wrote the watched block, seen through the watch's op hooks
    assert [c["op"] for c in rep["changes"] if c["watched"] == "weights"] == ["aten.add_.Tensor"], rep
    (w,) = [w for w in rep["watched"] if w["name"] == "weights"]
    assert w["allocation_id"] is not None  # the native source's block id for that storage


HANDOVER = """
import sys, torch, msmemscope
from torch import nn
from msmemscope import capture, watcher
msmemscope.config(output=sys.argv[1])
msmemscope.start()
torch.manual_seed(0)
model = nn.Linear(32, 32)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
early = torch.ones(5000)          # counted by the native source, freed after the handover
for step in range(4):
    if step == 2:
        watcher.watch(model.weight, name="w")   # the session goes over to the dispatch mode
    opt.zero_grad(set_to_none=True)
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
del early
late = torch.zeros(7000)
del late
msmemscope.stop()
print("source", capture.current().config["source"])
"""


@needs_native
def test_handover_to_the_dispatch_source_keeps_one_story(tmp_path):
    """watch() (or owner labels) on a native session: the dispatch mode takes over; blocks the
    native source counted are still reported when freed, ids and bytes in use stay one sequence."""
    import subprocess
    import sys
    prog = tmp_path / "h.py"
    prog.write_text(HANDOVER)
    r = subprocess.run([sys.executable, str(prog), str(tmp_path / "o")], env=_env("native"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "source native, then dispatch" in r.stdout
    (folder,) = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)  # used == running sum across both sources, no id reused, FREE after MALLOC
    m = df.filter(df["event"] == "MALLOC")
    f = df.filter(df["event"] == "FREE")
    early = m.filter(m["size"] == 20000)["alloc_id"].to_list()
    late = m.filter(m["size"] == 28000)["alloc_id"].to_list()
    assert len(early) == 1 and len(late) == 1 and late[0] > early[0]
    assert early[0] in f["alloc_id"].to_list() and late[0] in f["alloc_id"].to_list()
    # ops before the handover come from RecordFunction names, after it from the dispatch mode:
    # both write the same names, and the optimizer's steps are all there
    steps = df.filter(df["event_type"] == "STEP").height
    assert steps == 4
    with open(os.path.join(folder, "analysis", "watch.json")) as fh:
        rep = json.load(fh)
    assert {c["op"] for c in rep["changes"] if c["watched"] == "w"} >= {"aten.addcdiv_.default"}


def test_native_source_is_built_where_it_can_be():
    """`make` builds the native source; a machine with a C++ compiler and ninja must have it
    (else a broken build would only show as skipped tests)."""
    import shutil
    have_tools = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(__import__("sys").executable))
    if not (shutil.which("c++") and have_tools):
        pytest.skip("no C++ compiler or ninja here: the dispatch-mode source is used")
    assert native.load_module() is not None, native.why_not()


STRESS = """
import sys, threading, torch, msmemscope
from msmemscope import capture
from msmemscope.capture import session as S
S.FLUSH_ROWS = 2000          # the op exits of every thread ask for flushes all the time
msmemscope.config(output=sys.argv[1])
msmemscope.start()
assert capture.current().native is not None
def work(k):
    x = torch.randn(32, 32)
    keep = []
    for i in range(3000):
        y = (x @ x).relu_()
        if i % 7 == 0:
            keep.append(y)
        if len(keep) > 20:
            keep.pop(0)
threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for i in range(200):
    msmemscope.mark(f"m{i}")
    if i % 20 == 0:
        msmemscope.step()
for t in threads:
    t.join()
msmemscope.stop()
print("ok")
"""


@needs_native
def test_native_source_under_threads_and_concurrent_flushes(tmp_path):
    """Four threads allocating and freeing while the main thread writes marks and steps and every
    thread's op exits ask for flushes: the dump keeps every invariant (bytes in use equal the
    running sum in row order, no id twice, every FREE after its MALLOC, ops paired per thread)."""
    import subprocess
    import sys
    prog = tmp_path / "stress.py"
    prog.write_text(STRESS)
    r = subprocess.run([sys.executable, str(prog), str(tmp_path / "o")], env=_env("native"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    (folder,) = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    starts = df.filter(df["event_type"] == "ATEN_START")
    assert starts["tid"].n_unique() == 4  # the four workers (the main thread runs no op)
    assert starts.height >= 4 * 3000 * 2
    assert df.filter(df["event"] == "MSTX").height == 200


@needs_native
def test_block_ids_answer_as_counted_block(tmp_path):
    """``block_ids`` (one C++ call for the tensors of a walk: owner labels, owning modules, saved
    tensors) gives each tensor the allocation id ``counted_block`` gives its storage's address:
    views and slices share their base's block, a parameter and its gradient have their own, a
    tensor made before tracing and freed blocks have none (-1), and what is not a tensor is -1."""
    code = textwrap.dedent("""
        import json, torch, msmemscope
        from msmemscope import capture
        before = torch.ones(32)           # allocated through the wrapper, but before tracing: not counted
        msmemscope.config(output=%r, collect_mode="immediate")
        s = capture.current()
        assert s.native is not None
        base = torch.randn(64, 8)
        lin = torch.nn.Linear(8, 4)
        lin(base).sum().backward()
        gone = torch.ones(16); gone_ptr = gone.untyped_storage().data_ptr(); del gone
        ts = [base, base[3:], base.t(), base.view(-1), lin.weight, lin.weight.grad, lin.bias, before,
              torch.tensor(3.0), None, "text", 7]
        ids = s.native.block_ids(ts)
        def one(t):
            if not isinstance(t, torch.Tensor):
                return -1
            hit = s.native.counted_block(t.untyped_storage().data_ptr())
            return hit[0] if hit is not None else -1
        print("IDS", json.dumps([ids, [one(t) for t in ts], s.native.counted_block(gone_ptr)]))
        msmemscope.stop()
    """ % str(tmp_path / "o"))
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], env=_env("native"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ids, expected, gone = json.loads(r.stdout.split("IDS", 1)[1])
    assert ids == expected
    assert ids[0] > 0 and ids[1] == ids[2] == ids[3] == ids[0]          # views: the base's block
    assert len({ids[0], ids[4], ids[5], ids[6]}) == 4 and min(ids[4:7]) > 0
    assert ids[7] == -1 and ids[9:] == [-1, -1, -1] and gone is None


@needs_native
def test_a_failed_drain_keeps_every_record_in_order(tmp_path):
    """A drain that fails after taking the records (here: a names tuple too short, which raises as
    the tuples are made, as a failure of memory would) puts them back at the head of the buffer:
    the next drains write them, in order, before the records made since."""
    code = textwrap.dedent("""
        import torch, msmemscope
        from msmemscope import capture
        from msmemscope.capture import native as N
        msmemscope.config(output=%r)
        msmemscope.start()
        s = capture.current()
        m = s.native.m
        keep, failed = [], 0
        x = torch.randn(32, 32)
        for i in range(40):
            keep.append(x @ x)
            if i %% 3 == 0:
                del keep[0]
            if i %% 10 == 9:
                lost = []
                try:
                    m.drain(lost, N._NAMES[:8], True)
                except Exception:
                    failed += 1
                assert lost == [], lost
        msmemscope.stop()
        print("FAILED", failed)
    """ % str(tmp_path / "o"))
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], env=_env("native"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FAILED 4" in r.stdout, r.stdout
    df = read(dump_of(run_folders(tmp_path / "o")[0]))
    check_invariants(df)
    mallocs = df.filter(df["event"] == "MALLOC")
    ids = [a["allocation_id"] for a in map(json.loads, mallocs["attr"].to_list())]
    assert ids == list(range(ids[0], ids[0] + len(ids))) and len(ids) >= 40, ids  # none lost, in order
    assert df.filter(df["event_type"] == "ATEN_START").height >= 40


@needs_native
def test_side_table_under_churn_and_a_null_raw_free(tmp_path):
    """The wrapper's table of blocks (open addressing): 20,000 blocks live at once (past its first
    size, so it grows while full of blocks), half of them freed in a shuffled order, then a free
    of the rest interleaved with new ones; oneDNN's GELU, whose scratch tensor is freed through
    ``raw_deallocate`` with a null pointer (a null key once matched an empty slot and called a
    null deleter). The bytes in use the source counts equal the sizes of the tensors the program
    holds, at each point, and the dump keeps every invariant."""
    code = textwrap.dedent("""
        import random, torch, msmemscope
        from msmemscope import capture
        torch.manual_seed(0)
        rnd = random.Random(1)
        msmemscope.config(output=%r, collect_mode="immediate", analysis="none")
        s = capture.current()
        x = torch.randn(64, 4096)
        y = torch.nn.functional.gelu(x)
        base = s.native.counters()[0]
        keep = [torch.empty(rnd.randint(1, 300)) for _ in range(20000)]
        held = lambda: sum(t.untyped_storage().nbytes() for t in keep if t is not None)
        assert s.native.counters()[0] - base == held()
        order = list(range(len(keep)))
        rnd.shuffle(order)
        for i in order[:10000]:
            keep[i] = None
        assert s.native.counters()[0] - base == held()
        for i in order[10000:]:
            keep[i] = torch.empty(rnd.randint(1, 300)) if rnd.random() < 0.5 else None
        assert s.native.counters()[0] - base == held()
        ids = s.native.block_ids([t for t in keep if t is not None])
        assert len(set(ids)) == len(ids) and min(ids) > 0
        del keep
        assert s.native.counters()[0] == base
        z = torch.nn.functional.gelu(y)
        msmemscope.stop()
        print("ok", float(z.sum()))
    """ % str(tmp_path / "o"))
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], env=_env("native"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    (folder,) = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    assert df.filter(df["event"] == "MALLOC").height >= 25000


SESSIONS_IN_ONE_PROCESS = r'''
import sys, torch
from msmemscope.capture import native
from msmemscope.capture.source import Flags
mod = native.load_module()
on = Flags(*[True] * 6, access=False)
missed = []
for i in range(int(sys.argv[1])):
    src = native.NativeSource(mod, 1 << 16, None)  # a new session's source: the recorder reset
    src.start()
    src.set_flags(on)
    t = torch.ones(256 + i)  # made through the wrapper, counted now
    if src.counted_block(t.untyped_storage().data_ptr()) is None:
        missed.append(i)
    rows = []
    src.drain(rows)
    src.stop()  # the session's end: the wrapper taken out
    del t
print("MISSED", missed[:3], len(missed))
'''


def test_the_allocator_wrapper_is_installed_by_every_session_of_a_process(tmp_path):
    """Each session of a process puts the allocator wrapper in and its end takes it out
    (c10::SetCPUAllocator, whose priority must be at least the current one's and is a uint8_t).
    A priority raised by one at each set wrapped to 0 after ~155 sets: from the ~78th session in a
    process no allocation was recorded, silently (the property test's in-process sessions found it:
    "held blocks not live in the dump", ops recorded and no MALLOC row). 300 sessions: each counts
    the block it makes."""
    if native.load_module() is None:
        pytest.skip(f"native source not built: {native.why_not()}")
    import subprocess
    import sys
    prog = tmp_path / "sessions.py"
    prog.write_text(SESSIONS_IN_ONE_PROCESS)
    r = subprocess.run([sys.executable, str(prog), "300"], env=env_for_tests(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "MISSED [] 0", r.stdout[-500:]


GC_UNDER_LOCK = r"""
import gc, sys, torch
from msmemscope.capture import native
m = native.load_module()
assert m is not None
x = torch.empty(64)   # a counted block: its address for counted_block
addr = x.data_ptr()


class Cycle:
    pass


calls = 0
for fn in (m.counters, lambda: m.account(0), lambda: m.counted_block(addr)):
    for _ in range(20):
        gc.disable()
        c = Cycle()
        c.me, c.t = c, torch.empty(4096)   # garbage only the collector frees, holding a counted block
        del c
        # no 2-tuple left on CPython's free list: the answer's tuple is made anew
        pairs = [(i, -i) for i in range(4000)]
        gc.set_threshold(1)
        gc.enable()                        # the next tracked object made runs the collector:
        fn()                               # the tuple of its answer, which frees the block
        del pairs
        gc.set_threshold(700)
        calls += 1
print("ok", calls, flush=True)
"""


@needs_native
def test_a_block_freed_by_the_collector_inside_a_native_call_never_deadlocks(tmp_path):
    """counters(), account() and counted_block() made their answer's tuple while holding the
    recorder's lock; making it can run the collector, which can free a tensor, whose free takes
    that lock: the thread deadlocked itself (a two-thread training hung so at a flush, every thread
    with it). Each call here runs the collector on garbage holding a counted block, 20 times;
    before, the first call hung."""
    prog = tmp_path / "gc_under_lock.py"
    prog.write_text(GC_UNDER_LOCK)
    import signal
    import subprocess
    out = tmp_path / "out"
    # its own process group, killed whole on a hang (the program would keep the pipes open)
    p = subprocess.Popen([sys.executable, "-m", "msmemscope", "--output", str(out), sys.executable, str(prog)],
                         env=source_env("native"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail("the traced program hung (a lock held while the collector ran)")
    assert p.returncode == 0, stderr[-3000:]
    assert stdout.split() == ["ok", "60"], stdout
    (folder,) = run_folders(out)
    check_invariants(read(dump_of(folder)))
