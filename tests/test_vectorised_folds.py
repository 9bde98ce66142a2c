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
from hypothesis import HealthCheck, given, settings  # noqa: E402
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
