"""Session, the sources and the leak tracker without a subprocess: a fresh session in this process
for each test (inline writer), torn down after it."""
from __future__ import annotations

import json
import os
import sys
import threading

import pytest
import torch

from conftest import check_invariants, read


@pytest.fixture
def session_factory(tmp_path, monkeypatch):
    import msmemscope
    from msmemscope import capture
    from msmemscope.options import Options, build

    monkeypatch.setenv("MSMEMSCOPE_WRITER", "inline")
    made = []

    left = capture.current()  # a session another test file left in this (xdist) worker
    if left is not None:
        left.close()
        capture._session = None

    def make(source="python", **opts):
        assert capture.current() is None
        os.environ["MSMEMSCOPE_SOURCE"] = source
        if source == "native":  # framework hooks imported by an earlier test keep the native source off
            monkeypatch.delitem(sys.modules, "msmemscope.integrations", raising=False)
        msmemscope._config = build(Options(collect_mode="deferred"), output=str(tmp_path / f"o{len(made)}"),
                                   **({"events": "alloc,free,launch"} | opts))
        msmemscope.start()
        s = capture.current()
        made.append(s)
        return s

    prev = os.environ.get("MSMEMSCOPE_SOURCE")
    yield make
    for s in made:
        s.close()
    capture._session = None
    msmemscope._config = None
    if prev is None:
        os.environ.pop("MSMEMSCOPE_SOURCE", None)
    else:
        os.environ["MSMEMSCOPE_SOURCE"] = prev


def _native_or_skip():
    from msmemscope.capture import native
    if native.load_module() is None:
        pytest.skip("the native source is not built")


def _memory_rows(buf):
    from msmemscope.events import ATTR, EVENT, Event, attr_dict
    return [(r[EVENT], attr_dict(r[EVENT], r[ATTR])) for r in buf if r[EVENT] in (Event.MALLOC, Event.FREE)]


@pytest.mark.parametrize("source", ["python", "native"])
def test_sources_behind_one_interface(session_factory, source):
    from msmemscope.capture.source import Source
    if source == "native":
        _native_or_skip()
    s = session_factory(source)
    assert isinstance(s.source, Source) and isinstance(s.dispatch, Source)
    assert s.source.name == ("native" if source == "native" else "dispatch")
    assert s.config["source"] == ("native" if source == "native" else "dispatch")
    assert s.config["format_version"] >= 1
    # what a source can see: the dispatch-mode one everything, the native one the default events
    assert {"alloc", "free", "launch", "access", "storages", "stacks"} <= s.dispatch.sees
    if source == "native":
        assert s.native.sees == {"alloc", "free", "launch", "access", "stacks"}


@pytest.mark.parametrize("source", ["python", "native"])
def test_a_free_in_a_stop_gap_is_a_flagged_free_row(session_factory, source):
    if source == "native":
        _native_or_skip()
    s = session_factory(source)
    a = torch.ones(1000) + 1  # an op's output: seen by both sources
    b = torch.ones(500) + 1
    s.sync_sources()
    rows = _memory_rows(s.buf)
    mine = [x for e, x in rows if e == "MALLOC" and x["size"] in (4000, 2000)]
    assert len(mine) >= 2
    used_before = s.used[("cpu", "PTA")]
    s.stop()
    del a  # freed while stopped
    c = torch.ones(250) + 1  # allocated while stopped: not in the dump, not counted
    s.sync_sources()
    assert s.used[("cpu", "PTA")] == used_before - 4000
    frees = [x for e, x in _memory_rows(s.buf) if e == "FREE"]
    assert [x["size"] for x in frees if x.get("untraced")] == [4000], frees
    assert not any(x["size"] == 1000 for e, x in _memory_rows(s.buf) if e == "MALLOC")
    s.start()
    d = c + b[:250]
    s.stop()
    s.close()
    df = read(s.dump_path)
    check_invariants(df)
    del b, c, d


def test_a_free_inside_the_making_of_a_row_waits_for_it(session_factory):
    """A storage freed on the thread that is between account() and the append of a MALLOC row (the
    garbage collector, a signal handler, here the labeler's hook) gets its FREE after that row, so
    ``used`` stays the running sum in row order."""
    s = session_factory("python")
    held = [torch.ones(300) + 1 for _ in range(3)]  # followed blocks, 1200 bytes each

    class DropsOne:  # runs inside the new block's row section
        def on_new(self, b):
            if held and b.size == 4004:
                held.pop()  # its storage's free callback fires here, synchronously

        def before_flush(self):
            pass

    s.labeler = DropsOne()
    keep = [torch.ones(1001) + 1 for _ in range(3)]
    assert not held
    s.labeler = None
    s.sync_sources()
    rows = _memory_rows(s.buf)
    sizes = [(e, x["size"]) for e, x in rows]
    first_big = sizes.index(("MALLOC", 4004))
    assert ("FREE", 1200) in sizes[first_big + 1:first_big + 2], sizes  # right after, not before
    s.close()
    check_invariants(read(s.dump_path))
    del keep


def test_a_block_made_while_another_thread_changes_the_flags_is_counted_only_with_its_malloc_row(session_factory):
    """Session._update_flags (a step boundary's pause, not under the session's lock) sets ``emit``
    and then ``emit_alloc``: a block the dispatch-mode source registered between the two (another
    thread's op, two threads stepping) was counted, with no MALLOC row, and got a FREE row (a CI
    run's dump: 'FREE row ... frees allocation_id 2267, which no MALLOC row made'). It decides both
    from one snapshot of the flags (``Session.flags``): here the pause half set, then its end half
    set."""
    s = session_factory("python")
    src = s.dispatch
    base = torch.ones(77)
    for paused in (True, False):
        s._update_flags(pause=paused)
        s.emit, s.emit_alloc = True, False  # the other half of _update_flags not yet run
        at = len(s.buf)
        x = base + 1  # one new block, of an op made in that moment
        s._update_flags()
        followed = [b for b in src.live.values() if b.size == 308 and b.key == id(x.untyped_storage())]
        rows = [a for e, a in _memory_rows(s.buf[at:]) if e == "MALLOC" and a["size"] == 308]
        # counted (followed) only with its MALLOC row: both (the flags say record) or neither (paused)
        assert len(followed) == len(rows) == (0 if paused else 1), (paused, followed, rows)
        del x
    s.close()
    check_invariants(read(s.dump_path))


def test_account_is_the_one_count_per_device_and_pool(session_factory):
    s = session_factory("python")
    with s.lock:
        assert s.account("0", "PTA", 100) [0] == 100
        assert s.account("0", "PTA", 50)[0] == 150
        assert s.account("1", "PTA", 7)[0] == 7
        assert s.account("0", "PTA", -150)[0] == 0
    assert s.used[("0", "PTA")] == 0 and s.peak[("0", "PTA")] == 150 and s.peak[("1", "PTA")] == 7


def test_dispatch_source_registry_follows_the_window(session_factory):
    s = session_factory("python", steps="2")
    src = s.dispatch
    x = torch.ones(64) + 1          # step 1: outside --steps, not in the dump, not followed
    assert not any(b.size == 256 for b in src.live.values())
    s.step()
    y = x + 1                       # step 2: x is first seen as an input, y is made by the op
    sizes = sorted(b.size for b in src.live.values() if b.size == 256)
    assert len(sizes) == 2
    s.step()
    del x                           # step 3: freed outside the window, its FREE flagged
    frees = [a for e, a in _memory_rows(s.buf) if e == "FREE"]
    assert any(a.get("untraced") and a["size"] == 256 for a in frees), frees
    s.close()
    check_invariants(read(s.dump_path))
    del y


def test_session_hook_points_instead_of_patching(session_factory):
    s = session_factory("python")
    calls = []

    class Obs:
        def before(self, func, name, args, kwargs):
            calls.append(("before", name))

        def after(self, func, name, args, kwargs, out, touched):
            calls.append(("after", name))
    stop = type(s).stop
    s.set_op_observer(Obs())
    s.on_stop(lambda: calls.append("stopped"))
    s.watch_active = True
    torch.ones(3) + 1
    s.watch_active = False
    s.stop()
    assert ("before", "torch._ops.aten.add.Tensor") in calls and ("after", "torch._ops.aten.add.Tensor") in calls
    assert calls[-1] == "stopped"
    assert "stop" not in vars(s) and type(s).stop is stop  # nothing replaced on the live object


def test_native_ops_in_flight_at_stop_get_their_end(session_factory):
    _native_or_skip()
    s = session_factory("native")
    go = threading.Event()
    done = threading.Event()

    def busy():
        m = torch.randn(256, 256)
        go.set()
        while not done.is_set():
            (m @ m).sum()
    t = threading.Thread(target=busy)
    t.start()
    go.wait()
    for _ in range(20):  # stop and start while the other thread is inside its ops
        s.stop()
        s.start()
    done.set()
    t.join()
    s.close()
    check_invariants(read(s.dump_path))


def test_an_op_registered_while_stop_closes_the_ops_in_flight_gets_one_end():
    """The dispatch-mode source's stop() writes an ATEN_END for each op in flight on any thread
    (close_in_flight). Another thread registers an op while that runs (forced here: at the moment
    the END of its previous op is appended): that op's ATEN_END is written exactly once, by stop()
    or by the op's own end. The lists were cleared after the loop, which lost it (an ATEN_START with
    no ATEN_END: one run in three of two threads stopping and starting)."""
    import types

    from msmemscope.capture.dispatch import DispatchSource
    from msmemscope.events import Event, Op

    other, last = 12345, 67890
    src = None

    class Buf(list):
        def append(self, row):
            super().append(row)
            if row[2] == "last's":  # stop() has passed ``other``'s ops: that thread starts its next one
                src.op_started(other, "other's second")
    sess = types.SimpleNamespace(buf=Buf(), closed=False, op_device="cpu")
    src = DispatchSource(sess)
    src.op_started(other, "other's first")
    src.op_started(last, "last's")
    src.close_in_flight()
    ends = [r[2] for r in sess.buf if r[0] == Event.OP_LAUNCH and r[1] == Op.END]
    assert ends == ["other's first", "last's"]
    # ended by the op itself (stop() had passed its thread), exactly once
    assert src.op_ended(other) is True and not src.op_ended(other) and not src.op_ended(last)


def test_leak_tracker_takes_an_untraced_free_as_a_free():
    from msmemscope.analysis.leaks import StepLeakTracker
    t = StepLeakTracker()
    t.end_step(1)
    t.malloc(10, "cpu", "PTA", 7, 0x1000, 4096, 4096, "aten.ones")  # step 2
    t.free("cpu", "PTA", 7, 0)  # its FREE row written at the restart-free, flagged untraced
    assert t.end_step(2) == [] and t.end_step(3) == []
    t.malloc(11, "cpu", "PTA", 8, 0x2000, 64, 64, "aten.ones")  # step 4, never freed
    t.end_step(4)
    assert [lk["alloc_id"] for lk in t.end_step(5)] == [8]


def test_dump_format_version(tmp_path, session_factory):
    from msmemscope.events import FORMAT_VERSION
    s = session_factory("python", data_format="db")
    torch.ones(8) + 1
    s.close()
    import sqlite3
    with sqlite3.connect(s.dump_path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
    with open(os.path.join(s.folder, "config.json")) as f:
        assert json.load(f)["format_version"] == FORMAT_VERSION
    check_invariants(read(s.dump_path))


def test_fsdp2_wrapped_when_already_imported_kept_over_a_gap_restored_at_close(session_factory):
    """The decompose labeller's FSDP2 wrappers (after_import): FSDP2 imported before tracing
    starts is wrapped at start, stays wrapped over a stop/start gap, and is given back at close."""
    pg = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    orig = pg.foreach_all_gather, pg.foreach_reduce
    s = session_factory("python", analysis="decompose")
    assert s.labeler is not None
    assert getattr(pg.foreach_all_gather, "_msmemscope", False) and getattr(pg.foreach_reduce, "_msmemscope", False)
    s.stop()
    s.start()
    assert getattr(pg.foreach_all_gather, "_msmemscope", False)
    s.close()
    assert (pg.foreach_all_gather, pg.foreach_reduce) == orig
    assert s.labeler is None or s.labeler._fsdp2_wait is None
    check_invariants(read(s.dump_path))



def test_fsdp2_first_imported_during_a_gap_is_wrapped_and_labels_after_the_restart(session_factory, monkeypatch):
    """FSDP2 imported for the first time while tracing is stopped: the labeller's finder (after_import)
    wraps it then, the wrapper labels the blocks made inside it once tracing starts again, and close
    gives the module back. (A Python-API decompose session runs on the dispatch-mode source.) The
    module is executed afresh as a new module object; the worker's own is put back after."""
    from msmemscope.capture.owners import FSDP2_PARAM_GROUP as name
    pytest.importorskip(name)
    monkeypatch.delitem(sys.modules, name)  # put back at the test's end
    import importlib
    import torch
    s = session_factory("python", analysis="decompose")
    lab = s.labeler
    assert lab is not None and lab._fsdp2_wait in sys.meta_path
    s.stop()
    pg = importlib.import_module(name)  # the program's first import, in the gap
    wrapper = pg.foreach_all_gather
    assert getattr(wrapper, "_msmemscope", False) and getattr(pg.foreach_reduce, "_msmemscope", False)
    assert lab._fsdp2_wait is None
    s.start()
    # the wrapper around a stand-in for the all-gather that allocates (no process group here): the
    # wrapper calls the original through its closure, so the stand-in goes into that cell
    inner = wrapper.__wrapped__
    cells = [c for c in wrapper.__closure__ if c.cell_contents is inner]
    assert len(cells) == 1
    cells[0].cell_contents = lambda *a, **k: torch.empty(4096, dtype=torch.float32).add_(1)
    try:
        kept = wrapper()
    finally:
        cells[0].cell_contents = inner
    s.flush()
    s.close()
    assert pg.foreach_all_gather is inner  # given back at close
    df = read(s.dump_path)
    check_invariants(df)
    mine = df.filter((df["event"] == "MALLOC") & (df["size"] == kept.untyped_storage().nbytes()))
    assert mine.height >= 1 and all(o.split("@")[-2:] == ["fsdp2", "all_gather"] for o in mine["owner"].to_list()), mine["owner"]


def test_walk_live_objects_names_every_parameter_buffer_gradient_and_state_once_first_category_kept():
    """The labeller's walk of the live objects at each flush (one walk of each tree): tied
    parameters, a buffer registered as None, a BatchNorm's buffers, a frozen parameter without a
    gradient, and the optimizer's state, each given the category its object says; the first
    category given to a tensor stays (a parameter the optimizer also lists stays a weight)."""
    from torch import nn

    from msmemscope.capture.owners import GRADIENT, OPT_STATE, WEIGHT, walk_live_objects

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight          # tied: one parameter, two modules
            self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
            self.register_buffer("nothing", None)

        def forward(self, x):
            return self.head(self.body(self.emb(x)))

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    net(torch.randint(0, 10, (4,))).sum().backward()
    opt.step()

    got = {}

    def add(t, cat, comp=()):
        if t is not None and id(t) not in got:
            got[id(t)] = cat

    walk_live_objects([net], [opt], add)
    want = {}
    for p in net.parameters():
        want.setdefault(id(p), WEIGHT)
    for b in net.buffers():
        want.setdefault(id(b), WEIGHT)
    for p in net.parameters():
        if p.grad is not None:
            want.setdefault(id(p.grad), GRADIENT)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                want.setdefault(id(v), OPT_STATE)
    assert got == want
    assert sum(c == WEIGHT for c in got.values()) == 9      # emb=head, lin w+b, bn w+b, frozen; 3 bn buffers
    assert sum(c == GRADIENT for c in got.values()) == 5
    assert sum(c == OPT_STATE for c in got.values()) == 15  # step, exp_avg, exp_avg_sq of 5 parameters
