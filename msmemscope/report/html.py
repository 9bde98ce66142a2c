"""``msmemscope report <output-folder-or-dump> [-o file.html]``: one self-contained
HTML file a person opens in a browser.

Memory over time per device and pool (allocated, and reserved where it differs),
step boundaries and marks on it, stacked by owner when MALLOC rows carry owners;
zoom and hover naming the op and the block; tables of leaks, inefficient blocks,
top ops, compare results and a per-step summary.

The browser never gets every event: the series is cut into ``BUCKETS`` time
buckets on the Python side (polars) and each bucket keeps the min and max of
``used``, the max of ``total``, and the op and block at its peak.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import glob
import html
import json
import os
import sys

import polars as pl

from .common import ReportError, check_output, human_bytes, locate, read_all, with_op
from .progress import progress

BUCKETS = 3000
MAX_OWNERS = 8
MAX_ROWS = 500
MAX_MARKS = 2000
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


# ---------------------------------------------------------------- data
def _series(mem: pl.DataFrame, t0: int, span: int, buckets: int) -> dict:
    """Downsample one (device, pool) memory series into time buckets."""
    b = ((pl.col("ts") - t0) * buckets // span).clip(0, buckets - 1).alias("b")
    mem = mem.with_columns(b)
    g = (mem.group_by("b", maintain_order=True)
         .agg(t=pl.col("ts").first(), t_last=pl.col("ts").last(),
              lo=pl.col("used").min(), hi=pl.col("used").max(), last=pl.col("used").last(),
              total=pl.col("total").max(), n=pl.len())
         .sort("b"))
    # the row at each bucket's peak: op and block for the hover
    idx = (mem.with_row_index("row").group_by("b", maintain_order=True)
           .agg(row=pl.col("row").get(pl.col("used").arg_max())).sort("b"))
    peak_rows = mem.with_row_index("row").join(idx, on="row", how="semi").sort("b")
    ops = peak_rows["op"].fill_null("").to_list()
    op_names = sorted(set(ops))
    op_index = {o: i for i, o in enumerate(op_names)}
    blocks = [f"{ev} #{aid if aid is not None else '?'} {human_bytes(sz)}" + (f" at 0x{ad:x}" if ad is not None else "")
              for ev, aid, sz, ad in peak_rows.select("event", "alloc_id", "size", "addr").iter_rows()]
    total = g["total"].to_list()
    used_hi = g["hi"].to_list()
    has_total = any(t is not None and h is not None and t != h for t, h in zip(total, used_hi))
    out = {
        "t": [round((x - t0) / 1e6, 6) for x in g["t"].to_list()],
        "t2": [round((x - t0) / 1e6, 6) for x in g["t_last"].to_list()],
        "lo": g["lo"].to_list(), "hi": used_hi, "last": g["last"].to_list(),
        "total": [t if t is not None else h for t, h in zip(total, used_hi)] if has_total else None,
        "n": g["n"].to_list(),
        "ops": op_names, "op": [op_index[o] for o in ops], "blk": blocks,
    }
    out["peak"] = int(mem["used"].max() or 0)
    out["peak_reserved"] = int(mem["total"].max() or 0) if has_total else None
    out["events"] = mem.height
    return out


def _owners(mem: pl.DataFrame, t0: int, span: int, buckets: int) -> dict | None:
    """Per-owner live bytes, sampled at each bucket's peak row, for the stacked view."""
    if "owner" not in mem.columns:
        return None
    mallocs = mem.filter((pl.col("event") == "MALLOC") & pl.col("owner").is_not_null() & (pl.col("owner") != ""))
    if not mallocs.height:
        return None
    owner_of = mallocs.select("alloc_id", o=pl.col("owner"))
    m = (mem.join(owner_of, on="alloc_id", how="left")
         .with_columns(o=pl.col("o").fill_null("(unlabelled)"),
                       signed=pl.when(pl.col("event") == "MALLOC").then(pl.col("size")).otherwise(-pl.col("size")),
                       b=((pl.col("ts") - t0) * buckets // span).clip(0, buckets - 1)))
    m = m.with_columns(live=pl.col("signed").cum_sum().over("o"))
    peaks = m.group_by("o").agg(p=pl.col("live").max()).sort("p", "o", descending=[True, False])  # ties: by name, every run alike
    names = [o for o in peaks["o"].to_list() if o != "(unlabelled)"]
    keep = names[:MAX_OWNERS]
    label = pl.when(pl.col("o").is_in(keep)).then(pl.col("o")).otherwise(pl.lit("(other)"))
    m = m.with_columns(lab=label)
    labels = keep + [x for x in ("(other)",) if m.filter(pl.col("lab") == x).height]
    cols = []
    m = m.with_row_index("row")
    for lab in labels:
        s = pl.when(pl.col("lab") == lab).then(pl.col("signed")).otherwise(0).cum_sum()
        cols.append(s.alias(f"_o{len(cols)}"))
    m = m.with_columns(cols)
    idx = m.group_by("b").agg(row=pl.col("row").get(pl.col("used").arg_max())).sort("b")
    at = m.join(idx, on="row", how="semi").sort("b")
    return {"names": labels, "values": [at[f"_o{i}"].to_list() for i in range(len(labels))]}


def _table(columns, rows, title, note=None, fmt=None):
    return {"title": title, "columns": list(columns), "rows": [list(r) for r in rows][:MAX_ROWS],
            "more": max(0, len(rows) - MAX_ROWS), "note": note, "fmt": fmt or {}}


def _json_tables(path: str, title: str) -> list[dict]:
    """Tables from an analysis JSON whatever its exact shape: lists of objects become tables."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return [_table(["problem"], [[f"cannot read {os.path.basename(path)}: {e}"]], title)]
    out = []

    def walk(obj, name):
        if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
            cols = []
            for x in obj:
                for k in x:
                    if k not in cols:
                        cols.append(k)
            rows = [[_cell(x.get(k)) for k in cols] for x in obj]
            out.append(_table(cols, rows, name))
        elif isinstance(obj, dict):
            scalars = [(k, v) for k, v in obj.items() if not isinstance(v, (dict, list))]
            if scalars:
                out.append(_table(["key", "value"], [[k, _cell(v)] for k, v in scalars], name))
            for k, v in obj.items():
                if isinstance(v, (dict, list)):
                    walk(v, f"{name} · {k}")
        elif isinstance(obj, list) and obj:
            out.append(_table(["value"], [[_cell(x)] for x in obj], name))

    walk(data, title)
    if not out:
        out.append(_table(["result"], [["nothing reported"]], title))
    return out


def _cell(v):
    if v is None or isinstance(v, (int, float, str, bool)):
        return v
    return json.dumps(v)[:300]


def _compare_tables(folder: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "compare", "*.csv"))):
        try:
            with open(path, encoding="utf-8", newline="") as f:
                rows = list(csv.reader(f))
        except (OSError, UnicodeDecodeError) as e:
            out.append(_table(["problem"], [[f"cannot read {path}: {e}"]], "Compare"))
            continue
        if len(rows) < 2:
            continue
        top, head, body = rows[0], rows[1], rows[2:]
        cols = [f"{t} {h}".strip() if t else h for t, h in zip(top + [""] * len(head), head)]

        def diff(r):
            try:
                return abs(float(r[-1]))
            except (ValueError, IndexError):
                return 0.0
        body.sort(key=diff, reverse=True)
        out.append(_table(cols, body, f"Compare: {os.path.basename(path)}",
                          note="ops ordered by |diff|"))
    return out


def build(path: str, buckets: int = BUCKETS, prog=None) -> dict:
    """Everything the page shows, small enough to inline (a few thousand points per series)."""
    stage = prog.stage if prog is not None else (lambda s: None)
    stage("reading dump")
    dumps, folder = locate(path)
    df = read_all(dumps)
    if not df.height:
        raise ReportError(f"{path}: the dump holds no rows")
    return build_frame(df, dumps, folder, buckets, stage)


def build_frame(df: pl.DataFrame, dumps: list[str], folder: str | None, buckets: int = BUCKETS,
                stage=lambda s: None) -> dict:
    """``build`` on a frame already read (``read_dump`` columns)."""
    path = folder or dumps[0]
    stage("memory series")
    df = with_op(df)
    ts = df["ts"].drop_nulls()
    # the axis starts at the first recorded activity, not at START_TRACE or at
    # a mark made before it (the program's imports would otherwise take most of
    # the width)
    active = df.filter(pl.col("event").is_in(["MALLOC", "FREE", "OP_LAUNCH", "ACCESS"]))["ts"].drop_nulls()
    t0 = int(active.min()) if active.len() else int(ts.min())
    t1 = int(ts.max())
    span = max(1, t1 - t0 + 1)
    mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]) & pl.col("used").is_not_null())
    series = []
    for (dev, pool), part in sorted(mem.partition_by(["device", "event_type"], as_dict=True).items(),
                                    key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        s = _series(part, t0, span, buckets)
        s["device"], s["pool"] = str(dev), str(pool)
        s["owners"] = _owners(part, t0, span, buckets)
        series.append(s)
    steps = [{"step": int(st), "t": round((t - t0) / 1e6, 6)} for st, t in
             df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
             .select("step", "ts").iter_rows()]
    marks_df = df.filter(pl.col("event") == "MSTX")
    marks = [{"t": round((t - t0) / 1e6, 6), "kind": k, "name": n}
             for t, k, n in marks_df.select("ts", "event_type", "name").head(MAX_MARKS).iter_rows()]

    stage("tables")
    tables = []
    mallocs = df.filter(pl.col("event") == "MALLOC")
    frees = df.filter(pl.col("event") == "FREE")
    # per-step summary
    per = (mem.group_by("step", "device", "event_type")
           .agg(peak=pl.col("used").max(),
                allocs=(pl.col("event") == "MALLOC").sum(), frees=(pl.col("event") == "FREE").sum(),
                alloc_bytes=pl.when(pl.col("event") == "MALLOC").then(pl.col("size")).otherwise(0).sum(),
                free_bytes=pl.when(pl.col("event") == "FREE").then(pl.col("size")).otherwise(0).sum())
           .sort("step", "device", "event_type"))
    step_ops = (df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("event_type") == "ATEN_START"))
                .group_by("step").agg(ops=pl.len()))
    per = per.join(step_ops, on="step", how="left").with_columns(pl.col("ops").fill_null(0))
    tables.append(_table(["step", "device", "pool", "peak used", "allocs", "frees", "bytes allocated",
                          "bytes freed", "ops"],
                         [list(r) for r in per.select("step", "device", "event_type", "peak", "allocs", "frees",
                                                      "alloc_bytes", "free_bytes", "ops").iter_rows()],
                         "Per-step summary", fmt={"3": "bytes", "6": "bytes", "7": "bytes"},
                         note="a SYSTEM/STEP row ends its step; rows before the first are step 1"))
    # top ops by bytes allocated
    if mallocs.height:
        top = (mallocs.group_by("op").agg(bytes=pl.col("size").sum(), count=pl.len(), largest=pl.col("size").max())
               .sort("bytes", descending=True))
        tables.append(_table(["op", "bytes allocated", "allocations", "largest block"],
                             [[o or "(outside any op)", b, c, m] for o, b, c, m in top.head(50).iter_rows()],
                             "Top ops by bytes allocated", fmt={"1": "bytes", "3": "bytes"}))
    # analyses' results, when present
    if folder:
        for name, title in (("leaks", "Leaks"), ("inefficient", "Inefficient blocks")):
            p = os.path.join(folder, "analysis", f"{name}.json")
            if os.path.isfile(p):
                tables.extend(_json_tables(p, title))
        tables.extend(_compare_tables(folder))
    freed = set(frees["alloc_id"].drop_nulls().to_list())
    live = mallocs.filter(~pl.col("alloc_id").is_in(list(freed)))
    summary = {
        "events": df.height, "steps": len(steps), "mallocs": mallocs.height, "frees": frees.height,
        "ops": int(df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("event_type") == "ATEN_START")).height),
        "marks": marks_df.height, "live_at_end": live.height, "live_bytes_at_end": int(live["size"].sum() or 0),
        "duration_ms": round((t1 - t0) / 1e6, 3),
    }
    return {"title": f"msmemscope report — {os.path.basename(os.path.normpath(folder or path))}",
            "source": [os.path.abspath(d) for d in dumps], "folder": folder,
            "generated": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
            "summary": summary, "series": series, "steps": steps, "marks": marks, "tables": tables,
            "buckets": buckets}


# ---------------------------------------------------------------- page
def _asset(name: str) -> str:
    with open(os.path.join(ASSETS, name), encoding="utf-8") as f:
        return f.read()


def render(data: dict) -> str:
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    return (_asset("report.html")
            .replace("/*CSS*/", _asset("report.css"))
            .replace("%TITLE%", html.escape(data["title"]))
            .replace("/*DATA*/", payload)
            .replace("/*JS*/", _asset("report.js")))


def default_output(path: str, folder: str | None) -> str:
    base = folder or (os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else os.path.abspath(path))
    return os.path.join(base, "msmemscope_report.html")


def write_report(path: str, output: str | None = None, buckets: int = BUCKETS) -> str:
    with progress("report", total=4) as p:
        data = build(path, buckets, prog=p)
        p.stage("writing html")
        target = check_output(output or default_output(path, data["folder"]))
        text = render(data)
        from ..io.files import create_new
        try:
            with create_new(target) as f:
                f.write(text)
        except OSError as e:
            raise ReportError(f"cannot write {target}: {e.strerror or e}") from None
    return target


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ReportError(message)


def main(argv) -> int:
    p = _Parser(prog="msmemscope report", description="Write a self-contained HTML report of a dump.")
    p.add_argument("path", help="an msmemscope output folder or a dump file")
    p.add_argument("-o", "--output", help="the HTML file to write (default <folder>/msmemscope_report.html; "
                                          "an existing file is never overwritten)")
    try:
        ns = p.parse_args(argv)
        target = write_report(ns.path, ns.output)
    except ReportError as e:
        print(f"msmemscope: error: {e}", file=sys.stderr)
        return 2
    print(f"[msmemscope] report: {target}", file=sys.stderr)
    return 0
