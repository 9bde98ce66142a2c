"""The native folds of the online analyses (capture/_native.cpp "analysis folds") against the Python
folds they replace, which stay as the fallback and the reference: the decomposition by owner and the
per-module table (``Fold`` driven by ``FoldedDecomposition`` / ``FoldedModuleTable``), the
inefficient analysis' chunk columns (``chunk_columns``) and the module attribution at a flush
(``attribute``). Random row streams (hypothesis: tuple and dict Attr, unknown and reused ids,
other pools, owner updates, steps, the stream cut into flushes) and the rows of a real training
run; results compared as JSON text, so the key order of every dict is the Python one's too."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from conftest import full, env_for_tests

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from msmemscope.analysis import decompose as D  # noqa: E402
from msmemscope.analysis import inefficient as I  # noqa: E402
from msmemscope.analysis.folds import native_module  # noqa: E402
from msmemscope.capture import modules as M  # noqa: E402
from msmemscope import events as EV  # noqa: E402

MOD = native_module()
pytestmark = pytest.mark.skipif(MOD is None, reason="the native module is not built (make native)")

SETTINGS = dict(max_examples=full(80, 800), deadline=None, derandomize=not os.environ.get("MSMEMSCOPE_TEST_FULL"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

OWNERS = [None, "", "PTA@weight", "PTA@gradient", "PTA@optimizer_state", "PTA@activation", "PTA@ops", "mine",
          "a@b@c"]
MODULES = [None, "GPT", "GPT.h.0", "GPT.h.0.attn", "GPT.h.1", "Other.x"]
PHASES = [None, "forward", "backward", "forward", "backward"]
# mostly valid values: the rare None and odd forms are there, the folds are mostly exercised
aids = st.one_of(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9), st.none())
sizes = st.one_of(st.integers(0, 1000), st.integers(0, 1000), st.none())
useds = st.one_of(st.integers(0, 5000), st.integers(0, 5000), st.none())


@st.composite
def malloc_row(draw):
    aid, size, used = draw(aids), draw(sizes), draw(useds)
    owner, module, phase = draw(st.sampled_from(OWNERS)), draw(st.sampled_from(MODULES)), draw(st.sampled_from(PHASES))
    if owner and draw(st.booleans()):  # an equal string, another object (the fold's map by address misses it)
        owner = "".join(list(owner))
    form = draw(st.sampled_from(["t6", "t8", "t8", "t8", "dict", "dict_m", "none", "empty"]))
    if form == "t6":
        attr = (aid, 0, size, used, used, owner)
    elif form == "t8":
        attr = (aid, 0, size, used, used, owner, module, phase)
    elif form in ("dict", "dict_m"):
        attr = {"allocation_id": aid, "size": size, "owner": owner}
        if used is not None:
            attr["used"] = used
        if form == "dict_m":
            attr["module"] = module
            if phase is not None:
                attr["phase"] = phase
        if draw(st.booleans()):
            attr["origin"] = "before_op"
    else:
        attr = None if form == "none" else {}
    pool = draw(st.sampled_from(["PTA", "PTA", "HAL", "PTA_WORKSPACE"]))
    dev = draw(st.sampled_from(["cpu", "cpu", "cuda:0"]))
    return ("MALLOC", pool, draw(st.sampled_from(["", "aten::add"])), draw(st.integers(0, 100)),
            draw(st.sampled_from([1, 2])), dev, 0, attr, draw(st.sampled_from([None, "a.py:1(f)"])), None)


@st.composite
def free_row(draw):
    aid, used = draw(aids), draw(useds)
    form = draw(st.sampled_from(["t5", "t5", "dict", "none", "empty"]))
    attr = {"t5": (aid, 0, 0, used, used), "dict": {"allocation_id": aid, "used": used}, "none": None,
            "empty": {}}[form]
    return ("FREE", draw(st.sampled_from(["PTA", "HAL"])), "", draw(st.integers(0, 100)), 1, "cpu", 0, attr, None,
            None)


@st.composite
def other_row(draw):
    kind = draw(st.sampled_from(["owner", "owner", "start", "end", "launch", "access", "access_d", "mark"]))
    if kind == "owner":
        a = draw(st.sampled_from(["none", "dict", "dict_m"]))
        attr = None if a == "none" else {"allocation_id": draw(aids), "owner": draw(st.sampled_from(OWNERS))}
        if a == "dict_m":
            attr["module"] = draw(st.sampled_from(MODULES))
        return ("SYSTEM", "OWNER", "", 0, 1, "cpu", None, attr, None, None)
    if kind in ("start", "end", "launch"):
        et = {"start": "ATEN_START", "end": "ATEN_END", "launch": "KERNEL"}[kind]
        return ("OP_LAUNCH", et, draw(st.sampled_from(["aten::mm", "aten::add_", None])), 0, 1, "cpu", None, None,
                draw(st.sampled_from([None, "b.py:2(g)"])), None)
    if kind == "access":
        return ("ACCESS", "READ", "", 0, 1, "cpu", 0, ("float32", "2,3", 24, draw(aids)), None, None)
    if kind == "access_d":
        return ("ACCESS", "WRITE", "", 0, 1, "cpu", 0, {"allocation_id": draw(aids)}, None, None)
    return ("SYSTEM", "MARK", "", 0, 1, "cpu", None, {"x": 1}, None, None)


STEP = object()  # a step end between two flushes
stream = st.lists(st.one_of(malloc_row(), malloc_row(), malloc_row(), free_row(), free_row(), other_row(), st.just(STEP)),
                  min_size=1, max_size=80)
cuts = st.lists(st.integers(0, 80), max_size=4)


def run_stream(rows, cut, dec, mods):
    """Feed ``rows`` as the sink gets them: flushes cut at ``cut``, a step end at each STEP."""
    edges = sorted({0, len(rows)} | {c for c in cut if c <= len(rows)})
    stepno = 0
    for a, b in zip(edges, edges[1:]):
        part = []
        for r in rows[a:b] + [None]:
            if r is STEP or r is None:
                if part:
                    dec.feed_raw(part)
                    mods.feed_raw(part)
                    part = []
                if r is STEP:
                    stepno += 1
                    dec.end_step(stepno)
                    mods.end_step(stepno)
            else:
                part.append(r)
    n = dec.rows_since_step
    if n:
        dec.end_step(None)
        mods.end_step(None)
    return json.dumps(dec.result()), json.dumps(mods.result()), n


def _m(aid, size, owner, used=0):
    return ("MALLOC", "PTA", "", 0, 1, "cpu", 0, (aid, 0, size, used, used, owner, "GPT.h.0", "forward"), None, None)


def _f(aid, used=0):
    return ("FREE", "PTA", "", 0, 1, "cpu", 0, (aid, 0, 0, used, used), None, None)


@settings(**SETTINGS)
@given(stream, cuts)
# an owner that rises in a step after one held from the step's start: the step's "peak" dict
# lists the held one first, as the Python dict does (not in the order the counters were made)
@hypothesis.example([_m(1, 10, "PTA@ops"), _f(1), _m(2, 5, "PTA@weight"), STEP, _m(3, 7, "PTA@ops")], [])
def test_folded_decomposition_and_module_table_are_the_python_folds(rows, cut):
    want = run_stream(rows, cut, D.Decomposition(), D.ModuleTable())
    got = run_stream(rows, cut, D.FoldedDecomposition(MOD), D.FoldedModuleTable(MOD))
    assert got == want


def test_folds_with_thousands_of_blocks_live_are_the_python_folds():
    """The C++ folds keep their live blocks in a table of their own (open addressing, deletion by
    backward shift): thousands live at once make it grow several times and collide, frees in a
    random order shift entries back, and unknown or reused ids come too; the result is the Python
    folds' to the byte."""
    import random
    rnd = random.Random(25)
    owners = ["PTA@ops", "PTA@weight", "PTA@activation", "PTA@gradient"]
    rows, live, nxt, used = [], [], 1, 0
    for i in range(40000):
        r = rnd.random()
        if r < 0.55 or not live:
            aid = nxt if rnd.random() < 0.98 else rnd.randrange(1, nxt)  # a few reused ids
            nxt += rnd.choice((1, 1, 1, 7, 4096))                         # ids with gaps, far apart
            size = rnd.randrange(1, 5000)
            used += size
            rows.append(("MALLOC", "PTA", "", 0, 1, "cpu", 0,
                         (aid, 0, size, used, used, rnd.choice(owners), rnd.choice(MODULES), "forward"), None, None))
            live.append((aid, size))
        elif r < 0.97:
            aid, size = live.pop(rnd.randrange(len(live)))
            used -= size
            rows.append(_f(aid, used))
        else:
            rows.append(_f(nxt + 10 ** 6))  # a FREE of a block no MALLOC made
        if i % 9000 == 8999:
            rows.append(STEP)
    cut = [len(rows) // 3, len(rows) // 2]
    want = run_stream(rows, cut, D.Decomposition(), D.ModuleTable())
    got = run_stream(rows, cut, D.FoldedDecomposition(MOD), D.FoldedModuleTable(MOD))
    assert got == want


@settings(**SETTINGS)
@given(stream, cuts, st.integers(0, 1 << 40))
def test_chunk_columns_are_chunk_from_rows(rows, cut, first):
    # (chunk_from_rows takes a MALLOC/FREE Attr to be a tuple or a dict, as every source makes it)
    rows = [r for r in rows if r is not STEP and not (r[0] in ("MALLOC", "FREE") and r[7] is None)]
    want = I.chunk_from_rows(rows, first)
    edges = sorted({0, len(rows)} | {c for c in cut if c <= len(rows)})
    parts = [MOD.chunk_columns(rows[a:b], first + a, I.SKIP_POOLS) for a, b in zip(edges, edges[1:])]
    got = I.chunk_from_columns(parts)
    assert got.equals(want), (got, want)
    assert got.schema == want.schema
    # the online tracker folds the parts as they are (no frame, texts made for the rows it keeps):
    # what it finds is what the frame gives, fed whole or a flush's parts at a time
    by_frame, whole, each = I.Tracker(3), I.Tracker(3), I.Tracker(3)
    by_frame.feed(want)
    whole.feed(I.Columns.of_parts(parts))
    for p in parts:
        each.feed(I.Columns.of_parts([p]))
    found = by_frame.finish()
    assert whole.finish().equals(found) and each.finish().equals(found)
    assert whole.counts == each.counts == by_frame.counts
    # the online sink's compact form: every flagged block's numbers, the whole rows of the largest
    # (size, then row), and what the sink's close makes of them, as the full form's
    for top in (1, 3, I.TOP):
        compact = I.Tracker(3, top=top)
        for p in parts:
            compact.feed(I.Columns.of_parts([p]))
        small = compact.finish()
        assert small.schema == found.schema
        assert small.select("alloc_id", "mpos", "size", "bits").equals(found.select("alloc_id", "mpos", "size", "bits"))
        sel_full, sel_small = I.select(found), I.select(small)
        assert I.marks_of(sel_small) == I.marks_of(sel_full)
        if top == I.TOP:  # the sink's summary: totals, and the worst blocks named with their op and line
            assert I.summarize(sel_small, {}, 3) == I.summarize(sel_full, {}, 3)
        best = sel_full.sort(["size", "mpos"], descending=[True, False]).head(top)
        assert sel_small.sort(["size", "mpos"], descending=[True, False]).head(top).equals(best)


@st.composite
def attribution_case(draw):
    rows = [r for r in draw(st.lists(st.one_of(malloc_row(), free_row()), max_size=40))
            if not (r[0] == "MALLOC" and isinstance(r[7], dict) and r[7].get("allocation_id") is None and draw(
                st.booleans()))]
    rows = [r[:3] + (draw(st.integers(0, 100)),) + r[4:] for r in rows]
    states = st.one_of(st.none(), st.tuples(st.sampled_from(MODULES[1:]), st.sampled_from(PHASES)))
    marks, base = {}, {}
    for tid in draw(st.lists(st.sampled_from([1, 2, 3]), unique=True)):
        ts = sorted(draw(st.lists(st.integers(0, 100), max_size=8)))
        marks[tid] = (ts, [draw(states) for _ in ts])
    for tid in draw(st.lists(st.sampled_from([1, 2, 3]), unique=True)):
        base[tid] = draw(states)
    owned = {a: draw(st.sampled_from(MODULES[1:])) for a in draw(st.lists(st.integers(0, 9), unique=True))}
    cats = {a: draw(st.sampled_from(["weight", "gradient", "optimizer_state"]))
            for a in draw(st.lists(st.integers(0, 9), unique=True))}
    return rows, marks, base, owned, cats


@settings(**SETTINGS)
@given(attribution_case())
def test_native_attribution_is_the_python_one(case):
    rows, marks, base, owned, cats = case
    want, got = list(rows), list(rows)
    n_want = M._attribute_py(want, marks, base, owned, cats)
    n_got = MOD.attribute(got, marks, base, owned, cats)
    assert (n_got, got) == (n_want, want)


# ------------------------------------------------------------------ a real run's rows
CAPTURE = textwrap.dedent(r'''
    import os, pickle, sys, tempfile
    import torch
    torch.manual_seed(0)
    from msmemscope.analysis import decompose, inefficient
    from msmemscope.capture import modules
    stream, bufs = [], []
    c0, s0 = decompose.DecomposeSink.consume, decompose.DecomposeSink.step_end
    def consume(self, rows, first_id):
        stream.append(("rows", list(rows), first_id)); return c0(self, rows, first_id)
    def step_end(self, session, step):
        stream.append(("step", step)); return s0(self, session, step)
    decompose.DecomposeSink.consume, decompose.DecomposeSink.step_end = consume, step_end
    real = modules._native_module()
    class Recorder:  # the native attribution's inputs and output at each flush
        def attribute(self, buf, marks, base, owned, cats, start=0):
            before = list(buf)
            n = real.attribute(buf, marks, base, owned, cats, start)
            bufs.append((before, marks, base, owned, cats, list(buf), n))
            return n
    modules._native_module = lambda: Recorder()
    from msmemscope.capture import native as native_source
    nm = native_source.load_module()
    real_relabel = nm.relabel_mallocs
    relabels = []
    def relabel(buf, owner, info, cats, plain, in_buf, prev_upto, consts):  # the owner labeller's loop
        before, ib = list(buf), set(in_buf)
        todo = real_relabel(buf, owner, info, cats, plain, in_buf, prev_upto, consts)
        relabels.append((before, dict(owner), set(info), dict(cats), plain, ib, prev_upto, list(buf),
                         set(in_buf), list(todo)))
        return todo
    nm.relabel_mallocs = relabel
    import msmemscope
    from examples.transformer import GPT
    import torch.nn.functional as F
    # immediate: the session starts before the model exists (the native source; a deferred start is the other one's)
    msmemscope.config(output=tempfile.mkdtemp(), analysis="decompose,inefficient", collect_mode="immediate")
    model = GPT(vocab=128, d=64, heads=2, layers=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 128, (4, 33)); x, y = data[:, :-1], data[:, 1:]
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward(); opt.step()
        msmemscope.step()
    msmemscope.stop()
    from msmemscope import capture
    pickle.dump({"stream": stream, "bufs": bufs, "relabels": relabels, "source": capture.current().config["source"]},
                open(sys.argv[1], "wb"))
''')


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "stream.pkl"
    env = env_for_tests()
    env["MSMEMSCOPE_QUIET"] = "1"
    # the row passes over tuples (the labels given at the drain are held to them in test_labels_at_drain.py)
    env["MSMEMSCOPE_LABELS"] = "rows"
    r = subprocess.run([sys.executable, "-c", CAPTURE, str(out)], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def test_real_run_folds_are_the_python_folds(real_run):
    assert real_run["source"] == "native"
    stream = real_run["stream"]
    rows = [r for x in stream if x[0] == "rows" for r in x[1]]
    assert sum(r[0] == "MALLOC" for r in rows) > 300 and any(r[0] == "ACCESS" for r in rows)
    assert any(r[0] == "MALLOC" and type(r[7]) is tuple and len(r[7]) == 8 and r[7][6] for r in rows)

    def replay(dec, mods):
        for x in stream:
            if x[0] == "rows":
                dec.feed_raw(x[1])
                mods.feed_raw(x[1])
            else:
                dec.end_step(x[1])
                mods.end_step(x[1])
        if dec.rows_since_step:
            dec.end_step(None)
            mods.end_step(None)
        return json.dumps(dec.result()), json.dumps(mods.result())
    want = replay(D.Decomposition(), D.ModuleTable())
    got = replay(D.FoldedDecomposition(MOD), D.FoldedModuleTable(MOD))
    assert got == want
    assert len(json.loads(want[1])["cpu"]["modules"]) > 5  # modules were attributed, the table is not empty
    first = stream[0][2]
    parts, n = [], first
    for x in stream:
        if x[0] == "rows":
            parts.append(MOD.chunk_columns(x[1], n, I.SKIP_POOLS))
            n += len(x[1])
    assert I.chunk_from_columns(parts).equals(I.chunk_from_rows(rows, first))
    # the attribution of each flush's buffer (the native one ran in the run) is the Python one's
    assert real_run["bufs"] and sum(b[-1] for b in real_run["bufs"]) > 100
    for before, marks, base, owned, cats, after, n in real_run["bufs"]:
        ref = list(before)
        assert (M._attribute_py(ref, marks, base, owned, cats), ref) == (n, after)


# ------------------------------------------------------------------ owner labels of the buffer's MALLOC rows
def _relabel_py(buf, owner, info, cats, plain, in_buf, prev_upto):
    """What NativeLabeler.before_flush's Python loop does with the rows the C++ loop takes; the
    indices of the others (handed back to that loop)."""
    todo = []
    for i, r in enumerate(buf):
        if r[EV.EVENT] != "MALLOC":
            continue
        a = r[EV.ATTR]
        if type(a) is not tuple:
            todo.append(i)
            continue
        aid = a[EV.A_ALLOC_ID]
        new = owner.get(aid)
        if new is None:
            if aid <= prev_upto:
                continue
            if aid in info or aid in cats:
                todo.append(i)
                continue
            new = plain
        in_buf.add(aid)
        if a[EV.A_OWNER] != new:
            buf[i] = r[:EV.ATTR] + (a[:EV.A_OWNER] + (new,) + a[EV.A_OWNER + 1:],) + r[EV.ATTR + 1:]
    return todo


CONSTS = ("MALLOC", EV.EVENT, EV.ATTR, EV.A_ALLOC_ID, EV.A_OWNER)


@st.composite
def relabel_case(draw):
    labels = st.sampled_from(["", "cpu@ops", "cpu@weight", "cpu@activation@GPT.h.0", "cpu@gradient"])
    rows = []
    for _ in range(draw(st.integers(0, 25))):
        ev = draw(st.sampled_from(["MALLOC", "MALLOC", "FREE", "OP_LAUNCH"]))
        aid = draw(st.integers(0, 12))
        if ev == "MALLOC" and draw(st.integers(0, 9)) == 0:
            attr = {"allocation_id": aid, "owner": draw(labels)}
        else:
            attr = (aid, 4096, 64, 128, 0, draw(labels))
        rows.append((ev, "PTA", "torch._ops.aten.empty.memory_format", 1, 2, "cpu", 4096, attr, "", ""))
    owner = {a: draw(labels) for a in draw(st.lists(st.integers(0, 12), unique=True))}
    info = set(draw(st.lists(st.integers(0, 12), unique=True)))
    cats = {a: ("weight", ()) for a in draw(st.lists(st.integers(0, 12), unique=True))}
    return rows, owner, info, cats, draw(labels), draw(st.integers(-1, 12))


@settings(**SETTINGS)
@given(relabel_case())
def test_native_relabel_is_the_python_loop(case):
    rows, owner, info, cats, plain, prev = case
    want, got = list(rows), list(rows)
    want_in, got_in = set(), set()
    want_todo = _relabel_py(want, owner, info, cats, plain, want_in, prev)
    got_todo = MOD.relabel_mallocs(got, owner, {a: None for a in info}, cats, plain, got_in, prev, CONSTS)
    assert (list(got_todo), got, got_in) == (want_todo, want, want_in)


def test_real_run_relabels_are_the_python_loop(real_run):
    calls = real_run["relabels"]
    assert calls and sum(len(c[0]) for c in calls) > 300
    changed = 0
    for before, owner, info, cats, plain, in_buf, prev, after, in_after, todo in calls:
        ref, ref_in = list(before), set(in_buf)
        assert _relabel_py(ref, owner, info, cats, plain, ref_in, prev) == todo
        assert ref == after and ref_in == in_after
        changed += sum(a is not b for a, b in zip(before, after))
    assert changed > 100  # most new blocks got their label here, in C++


def _mo(aid, size, owner, module, used):
    return ("MALLOC", "PTA", "", 0, 1, "cpu", 0, (aid, 0, size, used, used, owner, module, "forward"), None, None)


def _owner(aid, owner, module):
    return ("SYSTEM", "OWNER", "", 0, 1, "cpu", None, {"allocation_id": aid, "owner": owner, "module": module}, None,
            None)


@pytest.mark.parametrize("folded", [False, True])
def test_a_block_learnt_after_the_peak_counts_at_the_peak_as_what_it_is(folded):
    """A parameter whose MALLOC row was written before its layer was known (an OWNER row at the
    step's end names it) was a parameter of that layer at the step's peak too; a block made after
    the peak was not there at all, whatever it is learnt to be. In a step with no peak above its
    start, the blocks live at its start are the ones at its peak."""
    step1 = [_mo(1, 100, "PTA@ops", None, 100),           # the parameter, written unlabelled
             _mo(2, 50, "PTA@activation", "Net.fc", 150),  # the peak
             _f(2, 100),
             _mo(3, 30, "PTA@ops", None, 130),             # after the peak: a gradient, learnt below
             _owner(1, "PTA@weight", "Net.fc"),
             _owner(3, "PTA@gradient", "Net.fc")]
    step2 = [_owner(3, "PTA@gradient", "Net.out"),          # made after step 1's peak, live at step 2's start
             _f(3, 100), _mo(4, 10, "PTA@ops", None, 110), _owner(4, "PTA@activation", "Net.fc"),
             _owner(1, "PTA@weight", "Net.head")]           # live at the step's start: moves at its peak
    tables = {}
    for step in (1, 2):
        t = D.FoldedModuleTable(MOD, step=step) if folded else D.ModuleTable(step=step)
        t.feed_raw(step1)
        t.end_step(1)
        t.feed_raw(step2)
        t.end_step(2)
        res = t.result()["cpu"]
        assert res["step"] == step
        tables[step] = {r["module"]: {k: v for k, v in r["at_peak"].items() if v} for r in res["modules"]
                        if r["total"]}
    assert tables[1] == {"Net": {"parameters": 100, "activations": 50}, "Net.fc": {"parameters": 100, "activations": 50}}
    assert tables[2] == {"Net": {"parameters": 100, "gradients": 30}, "Net.out": {"gradients": 30},
                         "Net.head": {"parameters": 100}}


CATS = [None, ("weight", ()), ("gradient", ()), ("optimizer_state", ()), ("weight", ("fsdp",))]


@settings(**SETTINGS)
@given(st.data())
def test_label_live_is_the_labellers_python_loop(data):
    """``label_live`` (the owner labeller's loop over the live blocks at each step end and flush, in
    C++) leaves ``owner`` and ``at_step`` as the Python loop of ``NativeLabeler._label_live`` does, with
    the same changed blocks, and hands back exactly the blocks the loop must answer itself (those
    with facts in ``info``, or a (pool, category) not in the plain cache yet): random live sets,
    owners, pending step-end labels, categories (shared and equal-but-distinct objects)."""
    pool = "PTA"
    ids = data.draw(st.lists(st.integers(0, 40), unique=True, max_size=30))
    owner = data.draw(st.dictionaries(st.integers(0, 40), st.sampled_from(OWNERS[1:])))
    at_step = data.draw(st.dictionaries(st.integers(0, 40), st.sampled_from(OWNERS[1:]), max_size=5))
    info = {k: object() for k in data.draw(st.lists(st.integers(0, 40), max_size=6))}
    cats = {k: (tuple(c) if c is not None and data.draw(st.booleans()) else c)  # a copy: not the same object
            for k, c in data.draw(st.dictionaries(st.integers(0, 40), st.sampled_from(CATS))).items()}
    plain = {(pool, c): data.draw(st.sampled_from(OWNERS[1:]))
             for c in [None] + data.draw(st.lists(st.sampled_from(CATS), max_size=4))}
    # the boundary often a live block's own id (a block written at the last flush)
    prev_upto = data.draw(st.sampled_from(ids) if ids and data.draw(st.booleans()) else st.integers(-1, 40))
    at_step_end = data.draw(st.booleans())

    def owner_of(aid):  # what the labeller's _owner_of answers
        return "INFO" if aid in info else plain.setdefault((pool, cats.get(aid)), "NEW")

    def python_loop(live, own, pending):
        changed = []
        for aid in live:
            new = owner_of(aid)
            if own.get(aid) != new:
                own[aid] = new
                if aid <= prev_upto or aid in pending:
                    changed.append(aid)
                elif at_step_end:
                    pending[aid] = new
        return changed

    want_owner, want_at = dict(owner), dict(at_step)
    plain_before = dict(plain)
    want = python_loop(ids, want_owner, want_at)
    plain.clear()
    plain.update(plain_before)
    got_owner, got_at = dict(owner), dict(at_step)
    changed, todo = MOD.label_live(ids, got_owner, got_at, info, cats, plain, pool, prev_upto, at_step_end)
    assert set(todo) == {a for a in ids if a in info or (pool, cats.get(a)) not in plain_before}
    changed = list(changed) + python_loop(todo, got_owner, got_at)
    assert sorted(changed) == sorted(want)
    assert got_owner == want_owner and got_at == want_at
