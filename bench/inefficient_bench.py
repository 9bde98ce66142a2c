"""Offline speed of the inefficient-memory analysis on a generated dump.

    PYTHONPATH=. python bench/inefficient_bench.py [--events 10000000] [--out /tmp/ineff_bench.csv] [--keep]

Generates (with polars, vectorized) a dump in our CSV format shaped like a traced
training loop: per op ``ATEN_START``, two ``ACCESS`` READs of live blocks, a
``MALLOC`` of the output and its ``ACCESS`` WRITE, ``ATEN_END``, then a ``FREE``
outside the op. Inputs are mostly recent blocks, some a few dozen ops old, a few
thousands of ops old (idle), so every type of inefficiency occurs. Then measures:

* ``polars.read_csv`` of the file (all columns as strings): the cost of merely reading it;
* ``read_dump`` (the reader every analysis uses: CSV + Attr fields);
* the analysis alone (``Tracker`` over the columns);
* ``check_inefficient(write=False)`` end to end;

and prints events per second for each.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import polars as pl

ROWS_PER_OP = 7
WINDOW = 5000  # blocks live at once


def generate(path: str, events: int, seed: int = 0, steps: int = 0) -> int:
    """Write the dump; with ``steps`` > 0 also STEP rows and a Mark named 'step' ending each of that many steps."""
    rng = np.random.default_rng(seed)
    n_ops = events // ROWS_PER_OP + WINDOW // ROWS_PER_OP  # some FREE and ACCESS rows of the first ops are left out
    i = np.arange(n_ops, dtype=np.int64)
    aid = i + 1                                   # block made by op i
    # inputs: the previous block, and one of: 2 back (90%), 40 back (9%), 4000 back (1%)
    r = rng.random(n_ops)
    back = np.where(r < 0.90, 2, np.where(r < 0.99, 40, 4000))
    in1 = aid - 1                                 # < 1: no such block yet, row left out
    in2 = aid - back
    # the block freed after op i: the one made WINDOW ops ago (freed outside any op)
    freed = aid - WINDOW
    size = (rng.integers(1, 4096, n_ops) * 512).astype(np.int64)
    name = np.array(["torch._ops.aten.mul.Tensor", "torch._ops.aten.add.Tensor", "torch._ops.aten.mm.default",
                     "torch._ops.aten.relu.default"])[rng.integers(0, 4, n_ops)]
    # running allocated bytes (the pool counters): + size at each MALLOC, - size of the freed block
    fsize = np.where(freed >= 1, size[np.maximum(freed - 1, 0)], 0)
    used_after_malloc = np.cumsum(size) - np.concatenate([[0], np.cumsum(fsize)[:-1]])
    used_after_free = used_after_malloc - fsize

    base = i * ROWS_PER_OP
    na = pl.lit("N/A")

    def rows(k, event, etype, nm, ptr, attr):
        return pl.DataFrame({"ID": base + k + 1}).with_columns(
            Event=pl.lit(event), **{"Event Type": pl.lit(etype) if isinstance(etype, str) else etype},
            Name=nm, **{"Timestamp(ns)": pl.Series(1_700_000_000_000_000_000 + (base + k) * 1000)},
            **{"Process Id": pl.lit(4242), "Thread Id": pl.lit(4242), "Device Id": pl.lit("0")},
            Ptr=ptr, Attr=attr)

    names = pl.Series(name)

    def hexs(ids):
        # synthetic addresses: 16 digits that read as a unique hex number per block
        return pl.format("0x{}000", pl.Series(ids).cast(pl.String).str.zfill(13))

    a_hex = hexs(aid)
    malloc_attr = pl.format('{{"allocation_id":{},"addr":"{}","size":{},"used":{},"total":{},"owner":""}}',
                            pl.Series(aid), a_hex, pl.Series(size), pl.Series(used_after_malloc),
                            pl.Series(used_after_malloc))

    def acc_attr(ids):
        return pl.format('{{"dtype":"float32","shape":[{}],"size":{},"allocation_id":{}}}',
                         pl.Series(size[ids - 1] // 4), pl.Series(size[ids - 1]), pl.Series(ids))

    fr_ok = freed >= 1
    fid = np.where(fr_ok, freed, 1)
    free_attr = pl.format('{{"allocation_id":{},"addr":"{}","size":{},"used":{},"total":{}}}',
                          pl.Series(fid), hexs(fid), pl.Series(fsize), pl.Series(used_after_free),
                          pl.Series(used_after_free))
    parts = [
        rows(0, "OP_LAUNCH", "ATEN_START", names, na, pl.lit(None, pl.String)),
        rows(1, "ACCESS", "READ", names, hexs(in1), acc_attr(np.maximum(in1, 1))).filter(pl.Series(in1 >= 1)),
        rows(2, "ACCESS", "READ", names, hexs(in2), acc_attr(np.maximum(in2, 1))).filter(pl.Series(in2 >= 1)),
        rows(3, "MALLOC", "PTA", names, a_hex, malloc_attr),
        rows(4, "ACCESS", "WRITE", names, a_hex, acc_attr(aid)),
        rows(5, "OP_LAUNCH", "ATEN_END", names, na, pl.lit(None, pl.String)),
        rows(6, "FREE", "PTA", na, hexs(fid), free_attr).filter(pl.Series(fr_ok)),
    ]
    if steps > 0:
        # a Mark 'step' then the STEP row after the last row of every (n_ops // steps)-th op
        per = max(1, n_ops // steps)
        ends = np.arange(per - 1, n_ops, per)[:steps]
        k = len(ends)
        num = pl.Series(np.arange(1, k + 1))
        for off, ev, et, nm, attr in ((6.3, "MSTX", "Mark", pl.lit("step"), pl.lit(None, pl.String)),
                                      (6.6, "SYSTEM", "STEP", pl.lit("N/A"),
                                       pl.format('{{"step":{}}}', num))):
            parts.append(pl.DataFrame({"ID": ends * ROWS_PER_OP + off + 1}).with_columns(
                Event=pl.lit(ev), **{"Event Type": pl.lit(et)}, Name=nm,
                **{"Timestamp(ns)": pl.Series(1_700_000_000_000_000_000 + ends * ROWS_PER_OP * 1000 + 999)},
                **{"Process Id": pl.lit(4242), "Thread Id": pl.lit(4242), "Device Id": pl.lit("0")},
                Ptr=pl.lit("N/A"), Attr=attr))
    df = pl.concat([p.select(pl.all().cast(pl.String)) for p in parts]).sort(pl.col("ID").cast(pl.Float64))
    df = df.with_columns(**{"Call Stack(Python)": pl.lit(None, pl.String), "Call Stack(C)": pl.lit(None, pl.String)})
    # renumber: the skipped FREE rows of the first ops leave gaps otherwise
    df = df.with_columns(ID=pl.int_range(1, df.height + 1).cast(pl.String))
    df.write_csv(path, quote_style="necessary")
    return df.height


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=10_000_000)
    p.add_argument("--out", default="/tmp/ineff_bench.csv")
    p.add_argument("--keep", action="store_true", help="keep the generated dump")
    p.add_argument("--reuse", action="store_true", help="use --out as it is if it exists")
    ns = p.parse_args(argv)
    from msmemscope.analysis.inefficient import Tracker, check_inefficient, chunk_from_frame
    from msmemscope.io.reader import read_dump

    if not (ns.reuse and os.path.exists(ns.out)):
        if os.path.exists(ns.out):
            os.unlink(ns.out)
        n, t_gen = timed(lambda: generate(ns.out, ns.events))
        print(f"generated {n} events ({os.path.getsize(ns.out) / 1e6:.0f} MB) in {t_gen:.1f} s: {ns.out}")
    raw, t_csv = timed(lambda: pl.read_csv(ns.out, infer_schema=False))
    n = raw.height
    del raw
    df, t_read = timed(lambda: read_dump(ns.out))

    def analysis_only():
        tr = Tracker(3000)
        tr.feed(chunk_from_frame(df))
        return tr.finish()
    res, t_ana = timed(analysis_only)
    del df
    full, t_full = timed(lambda: check_inefficient(ns.out, write=False, quiet=True))
    kinds = ", ".join("%s %d" % (k, v["count"]) for k, v in full.summary["by_type"].items())
    print(f"{n} events, {res.height} flagged blocks ({kinds})")
    for label, t in (("polars.read_csv (strings only)", t_csv), ("read_dump (reader + Attr fields)", t_read),
                     ("analysis alone (Tracker over the columns)", t_ana),
                     ("check_inefficient end to end", t_full)):
        print(f"  {label:45s} {t:7.2f} s  {n / t / 1e6:6.2f} M events/s")
    if not ns.keep:
        os.unlink(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
