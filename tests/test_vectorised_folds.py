"""The offline analyses' column folds against small per-row references (hypothesis).

Each vectorised fold of a dump's rows must give what the row-by-row rule gives, on row sequences
that real dumps rarely hold: reused and unknown allocation ids, frees before mallocs, owner
updates to the same owner or to none, zero sizes, steps without a number, and the same sequence
cut into several frames (the online sink's batches)."""
from __future__ import annotations

import json
import os

import pytest

from conftest import full

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import polars as pl  # noqa: E402

from msmemscope.analysis import decompose as D  # noqa: E402

SETTINGS = dict(max_examples=full(60, 600), deadline=None, derandomize=not os.environ.get("MSMEMSCOPE_TEST_FULL"),
                suppress_health_check=[HealthCheck.too_slow])

OWNERS = [None, "", "PTA@weight", "PTA@gradient", "PTA@optimizer_state", "mine", "a@b@c", "x@"]
_row = st.one_of(
    st.tuples(st.just(D.F_MALLOC), st.sampled_from(["cpu", "cuda:0"]), st.one_of(st.none(), st.integers(0, 6)),
              st.one_of(st.integers(0, 1000), st.just(None)), st.sampled_from(OWNERS), st.none()),
    st.tuples(st.just(D.F_FREE), st.sampled_from(["cpu", "cuda:0"]), st.one_of(st.none(), st.integers(0, 7)),
              st.none(), st.none(), st.none()),
    st.tuples(st.just(D.F_OWNER), st.just("cpu"), st.one_of(st.none(), st.integers(0, 7)), st.none(),
              st.sampled_from(OWNERS), st.none()),
    st.tuples(st.just(D.F_STEP), st.just("cpu"), st.none(), st.none(), st.none(),
              st.one_of(st.none(), st.integers(1, 50))),
)
rows_and_cuts = st.lists(_row, max_size=60).flatmap(
    lambda rows: st.tuples(st.just(rows), st.lists(st.integers(0, len(rows)), max_size=3)))


def per_row(rows) -> dict:
    """The reference: the rule one row at a time (what the online sink did before batches)."""
    dec = D.Decomposition()
    for kind, dev, aid, size, owner, stepno in rows:
        if kind == D.F_MALLOC:
            dec.malloc(dev, aid, size, owner)
        elif kind == D.F_FREE:
            dec.free(aid)
        elif kind == D.F_STEP:
            dec.end_step(stepno)
        else:
            dec.relabel(aid, owner)
    if dec.rows_since_step:
        dec.end_step(None)
    return dec.result()


def frame(rows) -> pl.DataFrame:
    return pl.DataFrame(rows, schema={"kind": pl.Int8, "device": pl.String, "alloc_id": pl.Int64, "size": pl.Int64,
                                      "owner": pl.String, "stepno": pl.Int64}, orient="row")


@settings(**SETTINGS)
@given(rows_and_cuts)
def test_decomposition_fold_is_the_per_row_rule(case):
    rows, cuts = case
    want = per_row(rows)
    dec = D.Decomposition()
    edges = sorted(set(cuts) | {0, len(rows)})
    for a, b in zip(edges, edges[1:]):
        dec.feed_frame(frame(rows[a:b]))
    if dec.rows_since_step:
        dec.end_step(None)
    got = dec.result()
    # equal as JSON text: the same numbers and the same key order in every step's dicts
    assert json.dumps(got) == json.dumps(want)


def test_decomposition_summarize_reads_the_dump_columns():
    """``summarize`` of a read_dump-shaped frame: the kinds come from event/event_type, the step
    number from the STEP row's Attr, an empty owner of a MALLOC is unlabelled."""
    df = pl.DataFrame({
        "event": ["MALLOC", "MALLOC", "SYSTEM", "FREE", "SYSTEM", "SYSTEM", "MALLOC"],
        "event_type": ["PTA", "PTA", "OWNER", "PTA", "STEP", "STEP", "PTA"],
        "device": ["cpu"] * 7,
        "alloc_id": [1, 2, 2, 1, None, None, 3],
        "size": [100, 50, None, 100, None, None, 7],
        "owner": ["PTA@weight", "", "PTA@gradient", None, None, None, None],
        "attr": [""] * 4 + ['{"step":1}', "{}", ""],
    })
    got = D.summarize(df)
    rows = [(D.F_MALLOC, "cpu", 1, 100, "PTA@weight", None), (D.F_MALLOC, "cpu", 2, 50, "", None),
            (D.F_OWNER, "cpu", 2, None, "PTA@gradient", None), (D.F_FREE, "cpu", 1, None, None, None),
            (D.F_STEP, "cpu", None, None, None, 1), (D.F_STEP, "cpu", None, None, None, None),
            (D.F_MALLOC, "cpu", 3, 7, None, None)]
    assert json.dumps(got) == json.dumps(per_row(rows))
    assert got["devices"]["cpu"]["owners"]["PTA@gradient"] == {"peak": 50, "current": 50}
    assert [s["step"] for s in got["steps"]] == [1, None, None]


# ------------------------------------------------------------------ inefficient memory
from msmemscope.analysis import inefficient as I  # noqa: E402


@st.composite
def traces(draw):
    """A well-formed op timeline: ops (some nested one level) and rows outside any op; MALLOCs of new
    ids (some first seen as an op input, ``before``), FREEs and ACCESSes of live ids or of ids the
    trace never allocated (blocks made before tracing began)."""
    rows, live, nxt = [], [], [0]

    def mem():
        c = draw(st.sampled_from("MMFAAA"))
        if c == "M":
            rows.append((I.K_MALLOC, "alloc", nxt[0], draw(st.booleans())))
            live.append(nxt[0])
            nxt[0] += 1
        elif c == "F":
            aid = live.pop(draw(st.integers(0, len(live) - 1))) if live and draw(st.integers(0, 4)) else 1000
            rows.append((I.K_FREE, None, aid, None))
        else:
            aid = draw(st.sampled_from(live)) if live and draw(st.integers(0, 4)) else 1001
            rows.append((I.K_ACCESS, None, aid, None))

    def op(level):
        rows.append((I.K_START, draw(st.sampled_from(["aten::mm", "aten::add", None])), None, None))
        for _ in range(draw(st.integers(0, 3))):
            if level == 0 and draw(st.integers(0, 3)) == 0:
                op(1)
            else:
                mem()
        rows.append((I.K_END, None, None, None))
    for _ in range(draw(st.integers(1, 14))):
        if draw(st.integers(0, 2)):
            op(0)
        else:
            mem()
    return rows


def inefficient_per_row(rows, thr):
    """The definitions of analysis/inefficient.py's docstring, block by block over the row list."""
    op = depth = 0
    pos_slot = []
    for kind, *_ in rows:
        if kind == I.K_START:
            op += 1
            depth += 1
        pos_slot.append((op, 2 * op if depth > 0 else 2 * op + 1))
        if kind == I.K_END:
            depth -= 1
    out = {}
    for i, (kind, name, aid, before) in enumerate(rows):
        if kind != I.K_MALLOC:
            continue
        aop, sa = pos_slot[i]
        acc = [j for j, r in enumerate(rows) if r[0] == I.K_ACCESS and r[2] == aid]
        counted = [pos_slot[j][0] for j in acc if before or pos_slot[j][1] != sa]
        free = next((j for j, r in enumerate(rows) if r[0] == I.K_FREE and r[2] == aid), None)

        def after(j0, s0, j):  # row j lies after the op of slot s0 (or after row j0 outside any op)
            return pos_slot[j][1] > s0 if s0 % 2 == 0 else j > j0
        early = bool(counted) and any(r[0] == I.K_FREE and after(i, sa, j) and pos_slot[j][1] < 2 * counted[0]
                                      for j, r in enumerate(rows))
        late = False
        if free is not None:
            lj = acc[-1] if acc else i
            ls, fs = pos_slot[lj][1], pos_slot[free][1]
            late = any(r[0] == I.K_MALLOC and after(lj, ls, j) and (pos_slot[j][1] < fs if fs % 2 == 0 else j < free)
                       for j, r in enumerate(rows))
        gaps = [b - a - 1 for a, b in zip(counted, counted[1:])]
        gap = max(gaps) if gaps else -1
        bits = early * 1 + late * 2 + (gap > thr) * 4
        if bits:
            inside = sa % 2 == 0
            opname = next((rows[j][1] for j in range(i, -1, -1) if rows[j][0] == I.K_START and rows[j][1]), None)
            out[i + 1] = (bits, gap, counted[0] if counted else -1, aop, opname if inside and opname else name)
    return out


def _fold_path(path):
    """Both implementations of the tracker's fold: the C++ one (where it is built) and numpy's."""
    m = pytest.MonkeyPatch()
    m.setenv(I.FOLD_ENV, path)
    if path == "native" and I._native_fold() is None:
        m.undo()
        pytest.skip("the leak rule's C++ module is not built")
    return m


@pytest.mark.parametrize("fold", ["native", "numpy"])
def test_inefficient_tracker_is_the_per_row_definitions(fold):
    m = _fold_path(fold)
    try:
        _tracker_is_the_per_row_definitions()
    finally:
        m.undo()


@settings(**SETTINGS)
@given(traces(), st.integers(0, 2), st.lists(st.integers(1, 12), max_size=4))
def _tracker_is_the_per_row_definitions(rows, thr, cuts):
    ch = pl.DataFrame([{"pos": i + 1, "kind": k, "name": nm, "alloc_id": aid, "size": 16,
                        "before": b, "stack": None} for i, (k, nm, aid, b) in enumerate(rows)],
                      schema=I.CHUNK_SCHEMA)
    want = inefficient_per_row(rows, thr)
    tr = I.Tracker(thr)
    at = 0
    for n in cuts + [ch.height]:  # the online path: the same rows in several chunks
        tr.feed(ch.slice(at, n))
        at += n
    got = {r["mpos"]: (r["bits"], r["max_gap"], r["first_op"], r["aop"], r["op"]) for r in tr.finish().to_dicts()}
    assert got == want


# rows no well-formed trace holds: ENDs without a START, an id allocated twice or accessed and freed
# before its MALLOC, ids without a MALLOC, rows without an id, unnamed ops, sizes and the before flag
_messy_row = st.tuples(st.sampled_from([I.K_START, I.K_END, I.K_MALLOC, I.K_MALLOC, I.K_FREE, I.K_ACCESS,
                                         I.K_ACCESS, I.K_ACCESS, I.K_OTHER]),
                       st.sampled_from(["aten::mm", None, "x"]), st.sampled_from([None, 0, 1, 2, 3, 4]),
                       st.sampled_from([None, False, True, True]), st.one_of(st.none(), st.integers(0, 64)))


@settings(**dict(SETTINGS, max_examples=full(200, 1000)))
# a second FREE of a freed id, after another MALLOC: the block is judged at its first FREE only
@example(rows=[(I.K_MALLOC, None, 1, False, 8), (I.K_FREE, None, 1, None, 8), (I.K_MALLOC, None, 2, False, 8),
               (I.K_FREE, None, 1, None, 8)], thr=0, cuts=[], sparse_ids=False)
@given(st.lists(_messy_row, max_size=50), st.integers(0, 3), st.lists(st.integers(1, 8), max_size=6),
       st.booleans())
def test_inefficient_native_fold_is_the_numpy_fold(rows, thr, cuts, sparse_ids):
    """The C++ fold and the numpy one give the same blocks and flags, chunk after chunk, on any rows;
    ``sparse_ids`` spreads the ids so that the numpy fold takes its search instead of its table."""
    if I._native_fold() is None:
        pytest.skip("the leak rule's C++ module is not built")
    scale = 10 ** 12 if sparse_ids else 1
    ch = pl.DataFrame([{"pos": i + 1, "kind": k, "name": nm, "alloc_id": None if aid is None else aid * scale - 3,
                        "size": sz, "before": b, "stack": f"s{i}"} for i, (k, nm, aid, b, sz) in enumerate(rows)],
                      schema=I.CHUNK_SCHEMA)

    def run(path):
        with pytest.MonkeyPatch.context() as m:
            m.setenv(I.FOLD_ENV, path)
            tr, at, states = I.Tracker(thr), 0, []
            for n in cuts + [ch.height]:
                tr.feed(ch.slice(at, n))
                at += n
                states.append(({c: v.tolist() for c, v in tr.b.items()}, tr.text.to_dicts(), tr.k, tr.depth,
                               tr.op_name, dict(tr.counts)))
            return states, tr.finish().to_dicts()
    assert run("native") == run("numpy")


# ------------------------------------------------------------------ compare
import numpy as np  # noqa: E402

from msmemscope.analysis import compare as C  # noqa: E402


def lcs_per_cell(a, b):
    """The textbook LCS table, one cell at a time."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


_seqs = st.integers(1, 5).flatmap(lambda v: st.tuples(st.lists(st.integers(0, v), max_size=90),
                                                        st.lists(st.integers(0, v), max_size=90)))


@settings(**SETTINGS)
@given(_seqs, st.integers(0, 30), st.integers(1, 12))
def test_edit_distance_is_the_lcs_table(ab, band, block):
    """Exact without a band; with one (rows in blocks of any size), exact up to the band and
    above it past the band: what ``align`` needs to decide whether to search."""
    a, b = (np.asarray(x, dtype=np.int64) for x in ab)
    D = len(a) + len(b) - 2 * lcs_per_cell(ab[0], ab[1])
    assert C.edit_distance(a, b) == D
    got = C.edit_distance(a, b, band=band, block=block)
    assert got >= D
    assert got == D if D <= band else got > band


@settings(**SETTINGS)
@given(_seqs)
def test_alignment_past_the_quick_search_is_the_same(monkeypatch_ab):
    """With the short first search cut to one edit, the exact distance decides and the full search
    gives the very pairs (and gives up at the very limit) of the search without the shortcut."""
    a, b = (np.asarray(x, dtype=np.int64) for x in monkeypatch_ab)
    D = len(a) + len(b) - 2 * lcs_per_cell(*monkeypatch_ab)
    want = [C.align(a, b, max_edits=e) for e in (max(D - 1, 0), D)]
    quick = C.QUICK_EDITS
    C.QUICK_EDITS = 1
    try:
        got = [C.align(a, b, max_edits=e) for e in (max(D - 1, 0), D)]
    finally:
        C.QUICK_EDITS = quick
    for (ga, gb, gm), (wa, wb, wm) in zip(got, want):
        assert gm == wm and ga.tolist() == wa.tolist() and gb.tolist() == wb.tolist()
    assert want[1][2]


@st.composite
def threaded_ops(draw):
    """Rows of two or three threads, interleaved: each thread's ops nest properly (a few left open
    at the end), MALLOCs inside and outside ops, some in the HAL pool (not counted)."""
    n_threads = draw(st.integers(1, 3))
    open_ = {t: 0 for t in range(n_threads)}
    rows = []
    for _ in range(draw(st.integers(0, 50))):
        t = draw(st.integers(0, n_threads - 1))
        c = draw(st.sampled_from("SSEMMH"))
        if c == "E" and not open_[t]:
            c = "M"
        if c == "S":
            open_[t] += 1
            rows.append(("OP_LAUNCH", "ATEN_START", draw(st.sampled_from(["mm", "add"])), t, None))
        elif c == "E":
            open_[t] -= 1
            rows.append(("OP_LAUNCH", "ATEN_END", "x", t, None))
        else:
            rows.append(("MALLOC", "HAL" if c == "H" else "PTA", "m", t, draw(st.integers(1, 99))))
    return rows


def op_bytes_per_row(rows):
    """Each ATEN_START's bytes: the MALLOCs (not HAL) while it is the innermost open op of its thread."""
    stacks, out = {}, {}
    for i, (ev, et, name, tid, size) in enumerate(rows):
        st_ = stacks.setdefault(tid, [])
        if et == "ATEN_START":
            st_.append(i + 1)
            out[i + 1] = 0
        elif et == "ATEN_END":
            st_.pop()
        elif et != "HAL" and st_:
            out[st_[-1]] += size
    return out


@settings(**SETTINGS)
@given(threaded_ops())
def test_compare_op_bytes_are_the_per_thread_stacks(rows):
    df = pl.DataFrame([{"id": i + 1, "event": ev, "event_type": et, "name": nm, "tid": tid, "device": "0",
                        "py_stack": None, "size": size, "step": 1, "step_number": 1}
                       for i, (ev, et, nm, tid, size) in enumerate(rows)],
                      schema={"id": pl.Int64, "event": pl.String, "event_type": pl.String, "name": pl.String,
                              "tid": pl.Int64, "device": pl.String, "py_stack": pl.String, "size": pl.Int64,
                              "step": pl.Int32, "step_number": pl.Int64})
    seq = C.sequence(df, "op", None, "x")
    assert dict(zip(seq["id"].to_list(), seq["bytes"].to_list())) == op_bytes_per_row(rows)
