"""The HTML report on a long dump: time to write it (``msmemscope report``, reading the CSV
included), its size, and the time headless Chromium takes to draw it. Two reports, each in a
process of its own: cold (the CSV alone: the dump's columnar companion deleted first) and warm
(reading the companion the cold one left); ``--warm-only`` keeps the companion and times the warm one;
``--writer`` writes the dump through the tool's own dump writer, capture-time companion included
(io/columns.py), and times the first report of it (what a user's first report of a run costs).

    python bench/report_bench.py --events 10000000 [--keep DIR] [--warm-only | --writer]

The dump is synthetic but shaped like training: weights and optimizer state made once,
gradients and activations made and freed every step, temporaries inside ops, a STEP row
every ``events / 200`` rows, owners on every block, 24 distinct Python stacks, 40 ops.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import polars as pl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICE_ROWS = 1_000_000
HEADER = ("ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,"
          "Call Stack(Python),Call Stack(C)\n")


def synth(path: str, n_events: int, seed: int = 0, writer: bool = False) -> dict | None:
    """The dump, written by polars (``writer=False``: the fastest way to make one) or by the tool's
    own dump writer (``writer=True``: ``CsvWriter`` fed raw rows in flushes of ``FLUSH_ROWS``, with the
    capture-time columnar companion unless ``MSMEMSCOPE_COLUMN_CACHE=0``; returns its CPU seconds)."""
    rng = np.random.default_rng(seed)
    n_alloc = n_events // 2
    steps = 200
    per_step = max(1, n_alloc // steps)
    cats = np.array(["PTA@weight", "PTA@gradient", "PTA@optimizer_state", "PTA@activation", "PTA@ops",
                     "PTA@ops@loader"])
    ops = np.array([f"torch._ops.aten.op{i}.default" for i in range(40)])
    stacks = np.array([f"/work/train.py:{10 + i}(step_fn);/work/train.py:{200 + i % 5}(main);/work/train.py:300(<module>)"
                       for i in range(24)])
    i = np.arange(n_alloc)
    step = np.minimum(i // per_step, steps - 1)
    cat = rng.choice(len(cats), n_alloc, p=[0.002, 0.05, 0.004, 0.3, 0.6, 0.044])
    size = (rng.integers(1, 256, n_alloc) * 512).astype(np.int64)
    t_alloc = i * 2 + rng.random(n_alloc)
    # lifetimes: weights and optimizer state forever, gradients to the step end, activations
    # to mid-step backward, temporaries a few events
    life = np.where(cat == 4, rng.integers(1, 20, n_alloc) * 2.0,
                    np.where(cat == 3, rng.integers(min(100, per_step - 1), per_step, n_alloc) * 1.0,
                             np.where(cat == 1, (per_step - i % per_step) * 2.0, 1e18)))
    t_free = t_alloc + life
    keep = t_free < n_alloc * 2
    ev_t = np.concatenate([t_alloc, t_free[keep]])
    ev_kind = np.concatenate([np.zeros(n_alloc, np.int8), np.ones(int(keep.sum()), np.int8)])
    ev_a = np.concatenate([i, i[keep]])
    order = np.argsort(ev_t, kind="stable")
    ev_t, ev_kind, ev_a = ev_t[order], ev_kind[order], ev_a[order]
    signed = np.where(ev_kind == 0, size[ev_a], -size[ev_a])
    used = np.cumsum(signed)
    n = len(ev_t)
    ts = (1_700_000_000_000_000_000 + (ev_t * 1000).astype(np.int64))
    ev_step = step[ev_a]
    # a STEP row after the last event of each step: its place in the output, by numpy
    # (the last event of the blocks made in each step)
    last_of = np.full(steps, -1, dtype=np.int64)
    np.maximum.at(last_of, ev_step, np.arange(len(ev_step)))
    has = last_of >= 0
    order_s = np.argsort(last_of[has])
    last, last_step = last_of[has][order_s], np.flatnonzero(has)[order_s]
    if writer:
        return _write_through_writer(path, n, ev_kind, ev_a, size, used, ts, cat, cats, ops, stacks, last,
                                     last_step)
    with open(path, "w", encoding="utf-8") as f:
        f.write(HEADER)
    # written in slices of rows so that a 10M-event dump needs little memory; IDs count the
    # STEP rows written before each row
    slice_rows = SLICE_ROWS
    for lo in range(0, n, slice_rows):
        hi = min(n, lo + slice_rows)
        k = np.arange(lo, hi)
        before = np.searchsorted(last, k, side="left")  # STEP rows before event k
        df = pl.DataFrame({
            "kind": ev_kind[lo:hi], "a": ev_a[lo:hi], "size": size[ev_a[lo:hi]], "used": used[lo:hi],
            "ts": ts[lo:hi], "owner": cats[cat[ev_a[lo:hi]]], "op": ops[ev_a[lo:hi] % 40],
            "stack": stacks[ev_a[lo:hi] % 24], "ID": k + before + 1})
        attr = pl.format('{{"allocation_id":{},"addr":"0x{}","size":{},"used":{},"total":{}{}}}',
                         pl.col("a") + 1, pl.col("a") * 4096 + 1_000_000_000,
                         "size", "used", "used",
                         pl.when(pl.col("kind") == 0).then(pl.format(',"owner":"{}"', "owner")).otherwise(pl.lit("")))
        rows = df.select(
            ID="ID", Event=pl.when(pl.col("kind") == 0).then(pl.lit("MALLOC")).otherwise(pl.lit("FREE")),
            EventType=pl.lit("PTA"), Name=pl.when(pl.col("kind") == 0).then(pl.col("op")).otherwise(pl.lit("N/A")),
            ts="ts", pid=pl.lit(4242), tid=pl.lit(4242), dev=pl.lit("cpu"), ptr=pl.lit("N/A"), Attr=attr,
            py=pl.when(pl.col("kind") == 0).then(pl.col("stack")).otherwise(pl.lit("")), c=pl.lit(""))
        ends = last[(last >= lo) & (last < hi)]
        if len(ends):
            j = np.searchsorted(last, ends)
            srows = pl.DataFrame({"ID": ends + j + 2, "ts": ts[ends], "s": last_step[j] + 1}).select(
                ID="ID", Event=pl.lit("SYSTEM"), EventType=pl.lit("STEP"), Name=pl.lit("N/A"), ts="ts",
                pid=pl.lit(4242), tid=pl.lit(4242), dev=pl.lit("cpu"), ptr=pl.lit("N/A"),
                Attr=pl.format('{{"step":{}}}', "s"), py=pl.lit(""), c=pl.lit(""))
            rows = pl.concat([rows, srows], how="vertical_relaxed").sort("ID")
        with open(path, "a", encoding="utf-8") as f:
            rows.write_csv(f, include_header=False, quote_style="necessary")


FLUSH_ROWS = 4096


def _write_through_writer(path, n, ev_kind, ev_a, size, used, ts, cat, cats, ops, stacks, last, last_step):
    """The synthetic run as the writer process gets it: raw rows (events.RawRow order), a flush at a
    time, into ``CsvWriter`` (and its ``ColumnWriter``, as io/spool.py's writer process sets it up)."""
    sys.path.insert(0, ROOT)
    from msmemscope.io import column_writer as W
    from msmemscope.io import columns as C
    from msmemscope.io.writers import CsvWriter
    w = CsvWriter(path)
    if C.enabled():
        w.columns = W.ColumnWriter(path)
    cpu = {"rows": 0.0, "write": 0.0, "columns": 0.0}
    inner_add = w.columns.add if w.columns is not None else None
    if inner_add is not None:
        def timed_add(*a, **k):
            c = time.process_time()
            inner_add(*a, **k)
            cpu["columns"] += time.process_time() - c
        w.columns.add = timed_add
    step_at = dict(zip(last.tolist(), (last_step + 1).tolist()))
    next_id = 1
    pending = []
    for lo in range(0, n, SLICE_ROWS):
        c0 = time.process_time()
        hi = min(n, lo + SLICE_ROWS)
        kind = ev_kind[lo:hi].tolist()
        a = ev_a[lo:hi]
        aid = (a + 1).tolist()
        addr = (a * 4096 + 1_000_000_000).tolist()
        sz = size[a].tolist()
        us = used[lo:hi].tolist()
        tss = ts[lo:hi].tolist()
        own = cats[cat[a]].tolist()
        op = ops[a % 40].tolist()
        st = stacks[a % 24].tolist()
        rows = []
        for j in range(hi - lo):
            if kind[j] == 0:
                rows.append(("MALLOC", "PTA", op[j], tss[j], 4242, "cpu", addr[j],
                             (aid[j], addr[j], sz[j], us[j], us[j], own[j]), st[j], None))
            else:
                rows.append(("FREE", "PTA", "N/A", tss[j], 4242, "cpu", addr[j],
                             (aid[j], addr[j], sz[j], us[j], us[j]), None, None))
            s = step_at.get(lo + j)
            if s is not None:
                rows.append(("SYSTEM", "STEP", "N/A", tss[j], 4242, "cpu", None, {"step": s}, None, None))
        cpu["rows"] += time.process_time() - c0
        # the writer process holds one flush of rows at a time: the million made here are kept out
        # of the collector's way, as they would not be there
        import gc
        gc.freeze()
        pending += rows
        del rows
        done = 0  # flushes taken by index: no copy of the rest of the slice per flush
        while len(pending) - done >= FLUSH_ROWS or (hi == n and done < len(pending)):
            batch = pending[done:done + FLUSH_ROWS]
            done += len(batch)
            c = time.process_time()
            w.write(batch, next_id, 4242)
            cpu["write"] += time.process_time() - c
            next_id += len(batch)
        pending = pending[done:]
    c = time.process_time()
    w.close()
    cpu["write"] += time.process_time() - c
    cpu["csv_only"] = cpu["write"] - cpu["columns"]
    return {k: round(v, 2) for k, v in cpu.items()}


def reader_frame(n_events: int) -> pl.DataFrame:
    """The same synthetic run as ``synth``, as the columns ``read_dump`` returns (no CSV)."""
    import tempfile as _t
    d = _t.mkdtemp(prefix="msmemscope-bench-frame-")
    small = os.path.join(d, "memscope_dump_probe.csv")
    synth(small, 20000)  # the CSV layout read back once, for the exact column types
    sys.path.insert(0, ROOT)
    from msmemscope.io.reader import read_dump
    probe = read_dump(small)
    shutil.rmtree(d, ignore_errors=True)
    rng = np.random.default_rng(0)
    n_alloc = n_events // 2
    steps = 200
    per_step = max(1, n_alloc // steps)
    cats = np.array(["PTA@weight", "PTA@gradient", "PTA@optimizer_state", "PTA@activation", "PTA@ops",
                     "PTA@ops@loader"])
    ops = np.array([f"torch._ops.aten.op{i}.default" for i in range(40)])
    stacks = np.array([f"/work/train.py:{10 + i}(step_fn);/work/train.py:{200 + i % 5}(main);/work/train.py:300(<module>)"
                       for i in range(24)])
    i = np.arange(n_alloc)
    cat = rng.choice(len(cats), n_alloc, p=[0.002, 0.05, 0.004, 0.3, 0.6, 0.044])
    size = (rng.integers(1, 256, n_alloc) * 512).astype(np.int64)
    t_alloc = i * 2 + rng.random(n_alloc)
    life = np.where(cat == 4, rng.integers(1, 20, n_alloc) * 2.0,
                    np.where(cat == 3, rng.integers(min(100, per_step - 1), per_step, n_alloc) * 1.0,
                             np.where(cat == 1, (per_step - i % per_step) * 2.0, 1e18)))
    t_free = t_alloc + life
    keep = t_free < n_alloc * 2
    ev_t = np.concatenate([t_alloc, t_free[keep]])
    ev_kind = np.concatenate([np.zeros(n_alloc, np.int8), np.ones(int(keep.sum()), np.int8)])
    ev_a = np.concatenate([i, i[keep]])
    order = np.argsort(ev_t, kind="stable")
    ev_t, ev_kind, ev_a = ev_t[order], ev_kind[order], ev_a[order]
    signed = np.where(ev_kind == 0, size[ev_a], -size[ev_a])
    used = np.cumsum(signed)
    n = len(ev_t)
    step = np.minimum(np.arange(n) // max(1, n // steps), steps - 1) + 1
    is_m = ev_kind == 0
    df = pl.DataFrame({
        "id": np.arange(1, n + 1), "event": np.where(is_m, "MALLOC", "FREE"), "event_type": "PTA",
        "name": np.where(is_m, ops[ev_a % 40], "N/A"),
        "ts": 1_700_000_000_000_000_000 + (ev_t * 1000).astype(np.int64), "pid": 4242, "tid": 4242,
        "device": "cpu", "ptr": "N/A", "attr": "", "py_stack": np.where(is_m, stacks[ev_a % 24], None),
        "c_stack": None, "alloc_id": ev_a + 1, "addr": ev_a * 4096, "size": size[ev_a], "used": used,
        "total": used, "owner": np.where(is_m, cats[cat[ev_a]], None), "step": step})
    # STEP rows at each step's end
    ends = df.group_by("step").agg(pl.col("id").max(), pl.col("ts").max()).sort("step")
    srows = ends.select(id=pl.col("id"), event=pl.lit("SYSTEM"), event_type=pl.lit("STEP"), name=pl.lit("N/A"),
                        ts="ts", pid=pl.lit(4242), tid=pl.lit(4242), device=pl.lit("cpu"), ptr=pl.lit("N/A"),
                        attr=pl.format('{{"step":{}}}', "step"), step="step")
    df = pl.concat([df.with_columns(o=pl.col("id") * 2), srows.with_columns(o=pl.col("id") * 2 + 1)],
                   how="diagonal_relaxed").sort("o").drop("o").with_columns(id=pl.int_range(1, n + ends.height + 1))
    return df.select([pl.col(c).cast(t) for c, t in probe.schema.items()])


def browser_time(page: str) -> float:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_report import DevTools, find_chromium
    exe = find_chromium()
    if exe is None:
        return float("nan")
    prof = tempfile.mkdtemp(prefix="msmemscope-bench-")
    dt = DevTools(exe, prof)
    try:
        target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        dt.send("Page.enable", session=sid)
        dt.send("Runtime.enable", session=sid)
        t = time.perf_counter()
        dt.send("Page.navigate", {"url": "file://" + page}, session=sid)
        dt.wait_event("Page.loadEventFired", wait=120)
        while True:
            r = dt.send("Runtime.evaluate", {"expression": "document.body.getAttribute('data-ready')",
                                             "returnByValue": True}, session=sid)
            if r["result"].get("value") == "1":
                break
            time.sleep(0.05)
        took = time.perf_counter() - t
        errors = [e for e in dt.events if e["method"] == "Runtime.exceptionThrown"]
        assert not errors, errors
        shot = dt.send("Page.captureScreenshot", {"format": "png"}, session=sid)["data"]
        with open(page + ".png", "wb") as f:
            f.write(base64.b64decode(shot))
        return took
    finally:
        dt.close()
        shutil.rmtree(prof, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--keep", help="keep the dump and the page in this folder")
    ap.add_argument("--in-memory", action="store_true",
                    help="build the page from a frame of the reader's columns (no CSV: the reader's own "
                         "time and memory are left out)")
    ap.add_argument("--warm-only", action="store_true",
                    help="keep the dump's columnar companion and time the warm report only")
    ap.add_argument("--writer", action="store_true",
                    help="write the dump through the tool's own dump writer (with its capture-time columnar "
                         "companion, io/columns.py) and time the first report of it")
    ns = ap.parse_args()
    d = ns.keep or tempfile.mkdtemp(prefix="msmemscope-report-bench-")
    os.makedirs(d, exist_ok=True)
    dump = os.path.join(d, "memscope_dump_bench.csv")
    page = os.path.join(d, "report.html")
    for p in (page, page + ".png"):
        if os.path.exists(p):
            os.remove(p)
    if ns.in_memory:
        import resource
        t = time.perf_counter()
        df = reader_frame(ns.events)
        t_synth = time.perf_counter() - t
        from msmemscope.report.html import build_frame, render
        stages = {}
        last = [time.perf_counter()]

        def stage(name):
            now = time.perf_counter()
            stages[name] = round(now - last[0], 2)
            last[0] = now
        t = time.perf_counter()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        data = build_frame(df, ["synthetic"], None, stage=stage)
        text = render(data)
        t_report = time.perf_counter() - t
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        with open(page, "w", encoding="utf-8") as f:
            f.write(text)
        t_browser = browser_time(page)
        print(json.dumps({"rows": df.height, "synth_s": round(t_synth, 1), "build_and_render_s": round(t_report, 2), "build_cpu_s": round(cpu, 1), "loadavg_after": load,
                          "stages_s (time before each named stage)": stages,
                          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "page_bytes": len(text.encode()), "browser_ready_s": round(t_browser, 2), "folder": d},
                         indent=1))
        if not ns.keep:
            shutil.rmtree(d, ignore_errors=True)
        return
    t = time.perf_counter()
    writer_cpu = None
    if not os.path.exists(dump):
        writer_cpu = synth(dump, ns.events, writer=ns.writer)
    t_synth = time.perf_counter() - t
    sys.path.insert(0, ROOT)
    from msmemscope.io.reader import capture_parts, companion_path
    companion = companion_path(dump)
    if os.path.exists(companion) and not ns.warm_only:
        os.remove(companion)  # the cold run: the CSV alone, as a run leaves it (and its capture companion)
    if ns.writer:
        assert capture_parts(dump) is not None, "the dump has no current capture-time companion"
    env = dict(os.environ, PYTHONPATH=ROOT)
    rows = sum(1 for _ in open(dump, "rb")) - 1
    out = {"rows": rows, "dump_bytes": os.path.getsize(dump), "synth_s": round(t_synth, 1), "folder": d}
    if writer_cpu:
        out["writer_cpu_s"] = writer_cpu
    runs = (["warm"] if ns.warm_only else ["first"] if ns.writer else ["cold", "warm"])
    for kind in runs:
        for p in (page, page + ".png"):
            if os.path.exists(p):
                os.remove(p)
        # each report in a process of its own, timed by /usr/bin/time-like rusage of that child only
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "msmemscope", "report", dump, "-o", page], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, _, ru = os.wait4(proc.pid, 0)
        t_report = time.perf_counter() - t
        err = proc.stderr.read()
        assert os.path.exists(page), err
        size = os.path.getsize(page)
        t_browser = browser_time(page)
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        out[kind] = {"report_s": round(t_report, 2), "report_cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
                     "report_peak_rss_bytes": ru.ru_maxrss * 1024, "page_bytes": size,
                     "browser_ready_s": round(t_browser, 2),
                     "end_to_end_s": round(t_report + t_browser, 2), "loadavg_after": load}
        if kind == "cold":
            out["companion_bytes"] = os.path.getsize(companion) if os.path.exists(companion) else None
        print(json.dumps({kind: out[kind]}), flush=True)
    print(json.dumps(out, indent=1))
    if not ns.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
