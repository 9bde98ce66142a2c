"""Random programs, traced: hypothesis generates interleavings of allocations, frees and ops on
1-3 threads, with start/stop, steps, marks, watch and describe among them; each runs traced in
this process (a fresh session each), on both capture sources. Every dump keeps the SPEC §1
invariants, and the bytes the dump leaves in use are the bytes of blocks the program still holds.

Short form (``make test``): a few small programs per source; ``MSMEMSCOPE_TEST_FULL=1``: many more.
"""
from __future__ import annotations

import gc
import os
import sys
import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch  # noqa: E402

from conftest import check_invariants, full, read  # noqa: E402

SIZES = (64, 256, 1000, 4096)
SLOTS = 6


def _action():
    slot = st.integers(0, SLOTS - 1)
    thread = st.integers(0, 2)
    return st.one_of(
        st.tuples(st.just("alloc"), thread, slot, st.sampled_from(SIZES)),
        st.tuples(st.just("free"), thread, slot),
        st.tuples(st.just("op"), thread, slot, slot, slot),
        st.tuples(st.just("start")),
        st.tuples(st.just("stop")),
        st.tuples(st.just("step")),
        st.tuples(st.just("mark")),
        st.tuples(st.just("watch"), slot),
        st.tuples(st.just("describe"), slot),
        # a training iteration of model m (its own Adam) on a thread; a model dropped with its optimizer
        st.tuples(st.just("train"), thread, st.integers(0, 1)),
        st.tuples(st.just("drop_model"), thread, st.integers(0, 1)),
    )


programs = st.fixed_dictionaries({
    "threads": st.integers(1, 3),
    "threads_before_start": st.booleans(),
    "analysis": st.sampled_from(["leaks", "decompose"]),
    "optimizer_in_backward": st.booleans(),  # the models' Adam per parameter, stepped in the backward
    "actions": st.lists(_action(), min_size=1, max_size=full(25, 80)),
})


class Worker(threading.Thread):
    """Runs the actions given to it one at a time, each to completion, so the interleaving is
    the generated one while the work really happens on this thread."""

    def __init__(self):
        super().__init__(daemon=True)
        self.todo, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.fn = None
        self.exc = None

    def run(self):
        while True:
            self.todo.acquire()
            fn = self.fn
            if fn is None:
                return
            try:
                fn()
            except BaseException as e:  # handed to the main thread
                self.exc = e
            self.done.release()

    def call(self, fn):
        self.fn = fn
        self.todo.release()
        self.done.acquire()
        if self.exc is not None:
            e, self.exc = self.exc, None
            raise e

    def finish(self):
        self.fn = None
        self.todo.release()
        self.join(10)


def _model(in_backward):
    """A small model and its optimizer (after the backward, or one per parameter stepped from the
    parameter's post-accumulate-grad hook)."""
    from torch import nn
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if not in_backward:
        return m, [torch.optim.Adam(m.parameters(), foreach=False)]
    opts = {p: torch.optim.Adam([p], foreach=False) for p in m.parameters()}

    def step_now(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)
    # the hooks' handles: torch keeps a parameter with such a hook alive, cycle or not, until removed
    m.hook_handles = [p.register_post_accumulate_grad_hook(step_now) for p in m.parameters()]
    return m, list(opts.values())


def _drop(models, m):
    model, _ = models.pop(m, (None, None))
    for h in getattr(model, "hook_handles", ()):
        h.remove()
    del model
    gc.collect()  # parameters, hooks and optimizers make a cycle


def _train(model, opts, in_backward):
    loss = model(torch.ones(8, 16)).square().mean()
    loss.backward()
    if not in_backward:
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)


def _model_storages(models) -> dict:
    """data_ptr -> nbytes of every block the models hold: parameters, gradients, optimizer state."""
    out = {}
    for model, opts in models.values():
        ts = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
        ts += [v for o in opts for st_ in o.state.values() for v in st_.values() if isinstance(v, torch.Tensor)]
        for t in ts:
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def run_program(prog, out, source):
    """Run one generated program traced; returns (the dump, bytes per held block at the end)."""
    import msmemscope
    from msmemscope import capture
    from msmemscope.options import Options, build

    left = capture.current()  # a session another test file left in this (xdist) worker, e.g. test_hooks
    if left is not None:
        left.close()
        capture._session = None
    os.environ["MSMEMSCOPE_SOURCE"] = source
    # framework hooks imported by an earlier decompose example would keep the native source off
    # (native.unsupported_by): a native example runs without them, and without decompose (a
    # Python-API session labels owners through the dispatch-mode source)
    hidden = sys.modules.pop("msmemscope.integrations", None) if source == "native" else None
    if source == "native":
        prog = {**prog, "analysis": "leaks"}
    msmemscope._config = build(Options(collect_mode="deferred"), output=str(out), analysis=prog["analysis"],
                               events="alloc,free,launch")
    hold: dict = {}
    models: dict = {}     # m -> (model, its optimizers): held by the program like ``hold``
    in_backward = prog.get("optimizer_in_backward", False)
    seen: dict = {}       # slot -> the source must have this block in the dump (the model below)
    watched: set = set()  # storages the watch engine keeps (it holds them, not the program)
    workers = []
    traced_workers = [False]

    def spawn():
        s = capture.current()
        # the dispatch-mode source follows the threads started after it started; the native one all
        traced_workers[0] = s is not None and s.active and s.source is s.dispatch
        for _ in range(prog["threads"] - 1):
            w = Worker()
            w.start()
            workers.append(w)

    def sees(t):
        # what the run's source is sure to see: inside the traced window, any thread for the
        # native source, the traced threads for the dispatch-mode one
        s = capture.current()
        if not s.emit:
            return False
        return s.native_ops or t == 0 or traced_workers[0]

    def on(t, fn):
        if t == 0 or not workers:
            fn()
        else:
            workers[(t - 1) % len(workers)].call(fn)

    if prog["threads_before_start"]:
        spawn()
    msmemscope.start()
    if not workers:
        spawn()
    s = capture.current()
    try:
        for a in prog["actions"]:
            kind = a[0]
            if kind == "alloc":
                _, t, k, n = a
                on(t, lambda: hold.__setitem__(k, torch.ones(n // 4)))
                seen[k] = sees(t)
            elif kind == "free":
                _, t, k = a
                on(t, lambda: hold.pop(k, None))
                seen.pop(k, None)
            elif kind == "op":
                _, t, i, j, k = a
                if i in hold and j in hold:
                    x, y = hold[i], hold[j]

                    def op():
                        m = min(x.numel(), y.numel())
                        hold[k] = torch.add(x[:m], y[:m]).relu()
                    on(t, op)
                    v = sees(t)
                    if v and not s.native_ops:  # inputs an op shows are registered (MALLOC before_op)
                        seen[i] = seen[j] = True
                    seen[k] = v
                    x = y = None  # no reference left here: the program holds what ``hold`` holds
            elif kind == "start":
                msmemscope.start()
            elif kind == "stop":
                msmemscope.stop()
            elif kind == "step":
                msmemscope.step()
            elif kind == "mark":
                msmemscope.mark("m")
            elif kind == "watch":
                if a[1] in hold and s.active:
                    watched.add(hold[a[1]].untyped_storage().data_ptr())
                    msmemscope.watcher.watch(hold[a[1]], name=f"w{a[1]}", dump_nums=2)
                    seen[a[1]] = seen.get(a[1]) or s.emit  # watch registers the block it watches
            elif kind == "describe":
                if a[1] in hold:
                    msmemscope.describe.describer(hold[a[1]], owner="held")
            elif kind == "train":
                _, t, m = a

                def train(m=m):
                    if m not in models:
                        models[m] = _model(in_backward)
                    _train(*models[m], in_backward)
                on(t, train)
            elif kind == "drop_model":
                _, t, m = a
                on(t, lambda: _drop(models, m))
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in hold.values()}
        held.update(_model_storages(models))
        must = {hold[k].untyped_storage().data_ptr() for k, v in seen.items() if v and k in hold}
        s.close()
    finally:
        for w in workers:
            w.finish()
        capture._session = None
        msmemscope._config = None
        if hidden is not None:
            sys.modules["msmemscope.integrations"] = hidden
    if source == "native":
        assert s.config["source"].startswith("native"), s.config
    return s.dump_path, held, must, watched


def _check(prog, out, source):
    dump, held, must, watched = run_program(prog, out, source)
    import polars as pl
    df = read(dump)
    live = check_invariants(df)
    # blocks the dump leaves in use are blocks the program holds: no false leak, no lost free
    mallocs = df.filter(pl.col("event") == "MALLOC")
    addr_of = dict(zip(mallocs["alloc_id"].to_list(), mallocs["addr"].to_list()))
    live_addrs = set()
    for aid, size in live.items():
        a = addr_of[aid]
        a = int(a, 16) if isinstance(a, str) else a
        live_addrs.add(a)
        if a in held:
            assert held[a] == size, (aid, a, size, held[a])
        else:
            # the program holds nothing but ``hold``: a block live in the dump and not held is a
            # lost FREE (or one the watch engine keeps alive)
            assert a in watched, f"allocation {aid} ({size} bytes at {a:#x}) live in the dump, not held"
    # and every block the source was sure to see and the program still holds is live in the dump
    missing = must - live_addrs
    assert not missing, f"held blocks not live in the dump: {sorted(hex(a) for a in missing)}"
    last_used = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))["used"].to_list()
    assert (last_used[-1] if last_used else 0) == sum(live.values())


@pytest.mark.parametrize("source", ["native", "python"])
def test_random_programs_keep_the_dump_true(tmp_path_factory, source):
    from msmemscope.capture import native
    if source == "native" and native.load_module() is None:
        pytest.skip("the native source is not built")

    @settings(max_examples=full(15, 300), deadline=None, derandomize=not os.environ.get("MSMEMSCOPE_TEST_FULL"),
              suppress_health_check=list(HealthCheck))
    @given(programs)
    def prop(prog):
        _check(prog, tmp_path_factory.mktemp("p"), source)

    saved = {k: os.environ.get(k) for k in ("MSMEMSCOPE_SOURCE", "MSMEMSCOPE_WRITER")}
    os.environ.setdefault("MSMEMSCOPE_WRITER", "inline")
    try:
        prop()
    finally:  # leave the process as it was: other test files may run in this worker next
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import msmemscope.capture as cap
        cap._session = None
