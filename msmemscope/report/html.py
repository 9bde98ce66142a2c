"""``msmemscope report <output-folder-or-dump | job root> [-o file.html]``: one self-contained
HTML file a person opens in a browser, offline (Apache ECharts inlined).

Views (ids a link opens): ``#findings`` (the analyses' results as sentences), ``#timeline``
(memory over time per device and pool, stacked by what it is, with zoom levels),
``#live`` (what is live at the peak or a clicked moment, a flame graph by Python stack;
what grew between two step ends), ``#compare`` (two steps side by side), ``#details`` (raw
tables). On the root of a job's rank folders: one page per rank and a root page (``#ranks``).

The browser never gets every event: ``report/views.py`` downsamples each series into a
bounded number of buckets per zoom level (min/max of ``used``, every layer at the max row),
and samples the live blocks at a bounded number of moments.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import glob
import html
import json
import os
import re
import sys

import numpy as np
import polars as pl

from .common import ReportError, check_output, human_bytes, locate, read_all, with_op
from .progress import progress
from ..frames import user_line

BUCKETS = None  # kept for callers of build(path, buckets): the zoom levels' sizes are views.BASE_BUCKETS
MAX_ROWS = 500
MAX_MARKS = 2000
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


# ---------------------------------------------------------------- data
def _table(columns, rows, title, note=None, fmt=None):
    return {"title": title, "columns": list(columns), "rows": [list(r) for r in rows][:MAX_ROWS],
            "more": max(0, len(rows) - MAX_ROWS), "note": note, "fmt": fmt or {}}


def _json_tables(path: str, title: str) -> list[dict]:
    """Tables from an analysis JSON whatever its exact shape: lists of objects become tables."""
    from ..io.validate import load_json_object
    try:
        data = load_json_object(path)
    except Exception as e:  # shown as a problem row, never a crash
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
    df = read_all(dumps, batched=True)
    if not df.height:
        raise ReportError(f"{path}: the dump holds no rows")
    return build_frame(df, dumps, folder, buckets, stage)


def build_frame(df: pl.DataFrame, dumps: list[str], folder: str | None, buckets: int = BUCKETS,
                stage=lambda s: None) -> dict:
    """``build`` on a frame already read (``read_dump`` columns)."""
    from . import views
    path = folder or dumps[0]
    stage("memory series")
    marks_df = df.filter(pl.col("event") == "MSTX")
    if "module" not in df.columns and "attr" in df.columns:  # module attribution (format 2), for the live view
        has = pl.col("attr").str.contains('"module":', literal=True)
        if df.select(has.any()).item():
            df = df.with_columns(module=pl.when(has).then(pl.col("attr").str.extract(r'"module":"([^"]*)"', 1)))
    # a bounded dump's STEP_SUMMARY rows (with their Attr): a summarised step's peak may be in a
    # row the writer dropped (io.bounded.step_peaks)
    summ = (df.filter(pl.col("event_type") == "STEP_SUMMARY").select("event_type", "step", "attr")
            if "attr" in df.columns else None)
    # the text columns no view reads: dropped before the frame is copied by the steps below
    df = with_op(df.drop([c for c in ("attr", "c_stack", "ptr") if c in df.columns]))
    # the text columns the views group, join and filter on, as categoricals: each row holds a
    # number, the text once per value (millions of rows, tens of distinct values)
    df = df.with_columns(pl.col(c).cast(pl.Categorical) for c in ("event", "event_type", "device", "name", "op",
                                                                   "py_stack", "owner") if c in df.columns)
    ts = df["ts"].drop_nulls()
    # the axis starts at the first recorded activity, not at START_TRACE or at
    # a mark made before it (the program's imports would otherwise take most of
    # the width)
    first = df.select(pl.col("ts").filter(pl.col("event").is_in(["MALLOC", "FREE", "OP_LAUNCH", "ACCESS"])).min()).item()
    t0 = int(first) if first is not None else int(ts.min())
    t1 = int(ts.max())
    span = max(1, t1 - t0 + 1)

    def us(t):
        return None if t is None else int((t - t0) // 1000)

    mem = (df.select(c for c in df.columns if c not in ("name", "tid", "owner"))
           .filter(pl.col("event").is_in(["MALLOC", "FREE"]) & pl.col("size").is_not_null()))
    if mem["used"].null_count():
        # a pool whose rows carry no ``used`` (the original's HAL, driver segments): its bytes in use
        # are the running sum of its blocks
        counted = mem.group_by("device", "event_type").agg(k=pl.col("used").is_not_null().any())
        mem = (mem.join(counted, on=["device", "event_type"], how="left")
               .with_columns(used=pl.when(pl.col("k")).then(pl.col("used")).otherwise(
                   pl.when(pl.col("event") == "MALLOC").then(pl.col("size")).otherwise(-pl.col("size"))
                   .cum_sum().over("device", "event_type")))
               .filter(pl.col("used").is_not_null()).drop("k"))
    step_rows_df = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).select("id", "step", "ts")
    steps = [{"step": int(st), "t": us(t)} for _, st, t in step_rows_df.iter_rows()]
    owners = views.final_owners(df)
    one = False
    if mem.height and mem.schema["device"] == pl.Categorical and mem.schema["event_type"] == pl.Categorical:
        # one (device, pool) when each code's least and greatest are the same: no grouping of every row
        lo_d, hi_d, lo_p, hi_p = mem.select(
            pl.col("device").to_physical().min().alias("a"), pl.col("device").to_physical().max().alias("b"),
            pl.col("event_type").to_physical().min().alias("c"), pl.col("event_type").to_physical().max().alias("d")).row(0)
        one = lo_d == hi_d and lo_p == hi_p and mem["device"].null_count() == 0 and mem["event_type"].null_count() == 0
    if one:
        parts = [((mem["device"][0], mem["event_type"][0]), mem)]
    else:
        parts = sorted(mem.partition_by(["device", "event_type"], as_dict=True).items(),
                       key=lambda kv: (str(kv[0][0]), str(kv[0][1])))
    total_events = max(1, mem.height)
    step_peaks = None
    if summ is not None and summ.height:
        from ..io.bounded import step_peaks as _step_peaks
        step_peaks = _step_peaks(summ, mem.select("event", "step", "device", "event_type", "used", "total"))
    series = []
    for (dev, pool), part in parts:
        m, names, by = views.layer_frame(part, owners)
        budget = max(4 * views.BASE_BUCKETS, int(views.POINT_BUDGET * part.height / total_events))
        index = views.LayerIndex(m, names)  # each layer's bytes after any row: the timeline's and the peak's
        s = views.timeline(m, names, t0, span, budget, index)
        peak_i = int(m["used"].arg_max())
        pk = m.row(peak_i, named=True)
        tot = m["total"].drop_nulls()
        s.update({"device": str(dev), "pool": str(pool), "layers": names, "by": by,
                  "peak": int(pk["used"]), "peak_t": us(pk["ts"]), "peak_step": pk["step"],
                  "peak_op": pk["op"], "peak_reserved": int(tot.max()) if tot.len() else None,
                  "events": part.height, "first_t": us(m["ts"].min()), "last_t": us(m["ts"].max())})
        s["peak_layers"] = [v[0] for v in index.at([peak_i])]
        s["peak_summarised"] = False
        if step_peaks is not None:
            _summarised_peak(s, step_peaks, step_rows_df, us)
        # the step ends as rows of this series: the last MALLOC/FREE row at or before each STEP row
        ids = m["id"].to_numpy()
        step_rows = [(int(st), int(np.searchsorted(ids, rid, side="right")) - 1)
                     for rid, st, _ in step_rows_df.iter_rows()]
        stage("live blocks")
        s["live"] = views.live(m, names, by, t0, peak_i, step_rows)
        if not s["peak_summarised"]:
            s["peak_line"] = _peak_line(m, peak_i)
        series.append(s)
    # the main series: the one with the largest peak (the live view opens on it)
    # (an allocator's pool before the driver segments it sits in: the original's HAL rows)
    main_i = max(range(len(series)), key=lambda i: (series[i]["pool"] not in ("HAL",), series[i]["peak"])) \
        if series else None

    marks, ranges, open_r = [], [], {}
    for t, k, n, attr in marks_df.select("ts", "event_type", "name", "attr").iter_rows():
        if k == "Mark":
            if len(marks) < MAX_MARKS:
                marks.append({"t": us(t), "name": n})
        else:
            try:
                rid = json.loads(attr).get("range_id") if attr else None
            except (ValueError, AttributeError):
                rid = None
            if k == "Range_start":
                open_r[rid] = (t, n)
            elif k == "Range_end" and rid in open_r and len(ranges) < MAX_MARKS:
                ts0, nm = open_r.pop(rid)
                ranges.append({"t0": us(ts0), "t1": us(t), "name": nm})

    stage("tables")
    tables = []
    # the columns the tables read, before the rows are picked (a copy of every column costs more)
    mallocs = df.select("id", "ts", "op", "size", "alloc_id", "event").filter(pl.col("event") == "MALLOC")
    frees = df.select("alloc_id", "event").filter(pl.col("event") == "FREE")
    is_m = pl.col("event") == "MALLOC"
    # grouped on the categories' codes (much cheaper than on categorical values), named after them
    keys, named = ["step", "device", "event_type"], True
    if one:  # one key of integers (the pool is the same on every row)
        keys, named = ["step"], False
    elif mem.schema["device"] == pl.Categorical and mem.schema["event_type"] == pl.Categorical:
        keys, named = ["step", pl.col("device").to_physical().alias("dc"), pl.col("event_type").to_physical().alias("pc")], False
    per = (mem.select("step", "used", "size", "device", "event_type", m=is_m)
           .group_by(*keys)
           .agg(*([] if named else [pl.col("device").first(), pl.col("event_type").first()]),
                peak=pl.col("used").max(),
                allocs=pl.col("m").sum(), frees=(~pl.col("m")).sum(),
                alloc_bytes=pl.when(pl.col("m")).then(pl.col("size")).otherwise(0).sum(),
                free_bytes=pl.when(~pl.col("m")).then(pl.col("size")).otherwise(0).sum())
           .select("step", "device", "event_type", "peak", "allocs", "frees", "alloc_bytes", "free_bytes")
           .sort("step", "device", "event_type"))
    if step_peaks is not None:  # a summarised step's peak, from its STEP_SUMMARY row
        keys = ["step", "device", "event_type"]
        sp = step_peaks.select(*(pl.col(k).cast(per.schema[k]) for k in keys), _sp="peak")
        per = (per.join(sp, on=keys, how="left")
               .with_columns(peak=pl.max_horizontal("peak", "_sp")).drop("_sp"))
    step_ops = (df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("event_type") == "ATEN_START"))
                .group_by("step").agg(ops=pl.len()))
    per = per.join(step_ops, on="step", how="left").with_columns(pl.col("ops").fill_null(0))
    tables.append(_table(["step", "device", "pool", "peak used", "allocs", "frees", "bytes allocated",
                          "bytes freed", "ops"],
                         [list(r) for r in per.select("step", "device", "event_type", "peak", "allocs", "frees",
                                                      "alloc_bytes", "free_bytes", "ops").iter_rows()],
                         "Per-step summary", fmt={"3": "bytes", "6": "bytes", "7": "bytes"},
                         note="a SYSTEM/STEP row ends its step; rows before the first are step 1"))
    if mallocs.height:
        top = (mallocs.group_by("op").agg(bytes=pl.col("size").sum(), count=pl.len(), largest=pl.col("size").max())
               .sort("bytes", "op", descending=[True, False]))
        tables.append(_table(["op", "bytes allocated", "allocations", "largest block"],
                             [[o or "(outside any op)", b, c, m_] for o, b, c, m_ in top.head(50).iter_rows()],
                             "Top ops by bytes allocated", fmt={"1": "bytes", "3": "bytes"}))
    compare_tables = []
    if folder:
        for name, title in (("leaks", "Leaks"), ("inefficient", "Inefficient blocks"), ("oom", "Out of memory")):
            p = os.path.join(folder, "analysis", f"{name}.json")
            if os.path.isfile(p):
                tables.extend(_json_tables(p, title))
        compare_tables = _compare_tables(folder)

    stage("findings")
    step_t = {int(x["step"]): x["t"] for x in steps}
    ctx = {"step_t": step_t, "fragmentation": []}
    if main_i is not None:
        s = series[main_i]
        made = ", ".join(f"{n} {human_bytes(v)}" for n, v in sorted(zip(s["layers"], s["peak_layers"]),
                                                                     key=lambda kv: -kv[1]) if v > 0)[:400]
        ctx["peak"] = {"kind": "peak", "severity": 2, "at": s["peak_t"], "line": s["peak_line"],
                       "text": f"Peak: {human_bytes(s['peak'])} allocated on {s['device']} {s['pool']} "
                               f"(step {s['peak_step']}, a summarised step of this bounded dump: the rows at its "
                               f"peak were dropped, its STEP_SUMMARY row gives the bytes; trace that step whole "
                               f"to see when and of what it was made)."
                       if s["peak_summarised"] else
                               f"Peak: {human_bytes(s['peak'])} allocated on {s['device']} {s['pool']} at "
                               f"{views.human_time(s['peak_t'])} (step {s['peak_step']})"
                               + (f", in {s['peak_op']}" if s["peak_op"] else "")
                               + (f" at {views.pretty_line(s['peak_line'])}" if s["peak_line"] else "")
                               + (f"; made of {made}" if made else "") + ".",
                       "raw": {"device": s["device"], "pool": s["pool"], "peak_bytes": s["peak"],
                               "step": s["peak_step"], "summarised": s["peak_summarised"],
                               "layers": {} if s["peak_summarised"] else dict(zip(s["layers"], s["peak_layers"]))}}
    for s in series:
        if s["peak_reserved"] and s["peak_reserved"] > s["peak"] * 1.2 and s["peak_reserved"] - s["peak"] > (1 << 20):
            gap = s["peak_reserved"] - s["peak"]
            ctx["fragmentation"].append({
                "kind": "fragmentation", "severity": 1, "at": s["peak_t"],
                "text": f"Reserved but not allocated: {s['device']} {s['pool']} reserved up to "
                        f"{human_bytes(s['peak_reserved'])} for an allocated peak of {human_bytes(s['peak'])}: "
                        f"{human_bytes(gap)} ({100.0 * gap / s['peak_reserved']:.0f}%) held by the allocator's cache "
                        f"or lost to fragmentation.",
                "raw": {"peak_reserved": s["peak_reserved"], "peak_allocated": s["peak"]}})
    ids = mallocs.select("id", "ts")
    ctx["row_t"] = {}
    if folder and os.path.isfile(os.path.join(folder, "analysis", "inefficient.json")):
        ctx["row_t"] = {int(i): us(t) for i, t in ids.iter_rows()} if ids.height <= 2_000_000 else {}
    found = views.findings(folder, ctx)

    live = mallocs.filter(mallocs["alloc_id"].is_not_null() & ~_freed(mallocs["alloc_id"], frees["alloc_id"]))
    summary = {
        "events": df.height, "steps": len(steps), "mallocs": mallocs.height, "frees": frees.height,
        "ops": int(df.filter((pl.col("event") == "OP_LAUNCH") & (pl.col("event_type") == "ATEN_START")).height),
        "marks": marks_df.height, "live_at_end": live.height, "live_bytes_at_end": int(live["size"].sum() or 0),
        "duration_ms": round((t1 - t0) / 1e6, 3), "duration_us": int((t1 - t0) // 1000),
    }
    stage("compare")
    return {"title": f"msmemscope report — {os.path.basename(os.path.normpath(folder or path))}",
            "source": [os.path.abspath(d) for d in dumps], "folder": folder,
            "generated": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
            "summary": summary, "series": series, "main": main_i, "steps": steps[:views.MAX_STEP_SAMPLES * 50],
            "marks": marks, "ranges": ranges, "tables": tables, "findings": found,
            "compare": views.compare_steps(df), "compare_tables": compare_tables, "ranks": None}


def _freed(ids: pl.Series, freed: pl.Series) -> pl.Series:
    """Whether each of ``ids`` is among ``freed`` (nulls never are): a table indexed by id where the
    ids are small numbers (allocation ids count from 1), else a hash set."""
    lo = min(ids.min() or 0, freed.min() or 0)
    hi = max(ids.max() or 0, freed.max() or 0)
    if lo >= 0 and hi <= 8 * (ids.len() + freed.len()) + (1 << 20):
        table = np.zeros(hi + 2, dtype=bool)
        table[freed.drop_nulls().to_numpy()] = True
        return pl.Series(table[ids.fill_null(hi + 1).to_numpy()])
    return ids.is_in(freed.drop_nulls().unique().implode()).fill_null(False)


def _summarised_peak(s: dict, step_peaks: pl.DataFrame, step_rows_df: pl.DataFrame, us) -> None:
    """A series' peak (``s``) where a summarised step of a bounded dump went higher than its kept
    rows (its STEP_SUMMARY row says): the peak, its step, that step's end as its time, the
    reserved peak; the op and line at the peak are not known (their rows were dropped)."""
    mine = step_peaks.filter((pl.col("device") == s["device"]) & (pl.col("event_type") == s["pool"]))
    rsv = mine["reserved"].max()
    if rsv is not None and (s["peak_reserved"] is None or rsv > s["peak_reserved"]):
        s["peak_reserved"] = int(rsv)
    top = mine.filter(pl.col("peak").is_not_null()).sort("peak", "step", descending=[True, False]).head(1)
    if not top.height or top["peak"][0] <= s["peak"] or not top["summarised"][0]:
        return
    step = int(top["step"][0])
    end = step_rows_df.filter(pl.col("step") == step)["ts"]
    s.update({"peak": int(top["peak"][0]), "peak_step": step, "peak_op": None, "peak_line": None,
              "peak_summarised": True, "peak_t": us(end[0]) if end.len() else s["last_t"]})


def _peak_line(m: pl.DataFrame, i: int):
    """The user's line of the block allocated at (or last before) the peak row."""
    if "py_stack" not in m.columns:
        return None
    hit = (m.select("event", "py_stack").head(i + 1)
           .select(((pl.col("event") == "MALLOC") & pl.col("py_stack").is_not_null()).arg_true().last()).item())
    return user_line(m["py_stack"][hit]) if hit is not None else None


# ---------------------------------------------------------------- page
def _asset(name: str) -> str:
    with open(os.path.join(ASSETS, name), encoding="utf-8") as f:
        return f.read()


_SLOT = re.compile(r"/\*(CSS|LIB|DATA|JS)\*/|%TITLE%")
# characters that could end the script element or confuse an HTML parser, and the two
# line separators older JavaScript parsers reject: escaped inside the JSON text
_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def embed_json(data) -> str:
    """JSON text that can sit inside ``<script type="application/json">`` whatever its strings hold."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=str)
    return re.sub("[<>&\u2028\u2029]", lambda m: _JSON_ESCAPES[m.group(0)], text)


def render(data: dict, template: str = "report.html", script: str = "report.js") -> str:
    """The page: the template's slots filled in one pass, so nothing in the data (a name
    holding ``/*JS*/`` or ``%TITLE%``) is ever taken for a slot."""
    fill = {"/*CSS*/": _asset("report.css"), "/*LIB*/": _asset("echarts.min.js").replace("</script", "<\\/script"),
            "/*DATA*/": embed_json(data), "/*JS*/": _asset(script), "%TITLE%": html.escape(data["title"])}
    return _SLOT.sub(lambda m: fill[m.group(0)], _asset(template))


def default_output(path: str, folder: str | None) -> str:
    base = folder or (os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else os.path.abspath(path))
    return os.path.join(base, "msmemscope_report.html")


def _write(target: str, text: str) -> str:
    from ..io.files import write_new
    try:
        with write_new(target) as f:
            f.write(text)
    except OSError as e:
        raise ReportError(f"cannot write {target}: {e.strerror or e}") from None
    return target


def rank_runs(path: str):
    """The rank dumps under ``path`` when it is the root of several run folders, else None."""
    if not os.path.isdir(path):
        return None
    from ..io.ranks import find_rank_dumps
    from ..io.reader import DumpError
    try:
        rds = find_rank_dumps(path)
    except DumpError:
        return None
    if len({r.folder for r in rds}) < 2:
        return None
    return rds


def write_report(path: str, output: str | None = None, buckets: int = BUCKETS) -> str:
    rds = rank_runs(path)
    if rds is not None:
        return write_rank_report(path, rds, output)
    with progress("report", total=8) as p:
        data = build(path, buckets, prog=p)
        p.stage("writing html")
        target = check_output(output or default_output(path, data["folder"]))
        return _write(target, render(data))


def _step_progress(t_delta: list[int], steps: list[dict]) -> list[float]:
    """Each point's place in the run counted in steps (2.5 = half-way through step 3): ranks that
    started at different times (a slow rendezvous) line up step for step."""
    import numpy as np
    t = np.cumsum(np.asarray(t_delta, dtype=np.int64))
    ends = [x["t"] for x in steps if x.get("t") is not None]
    if not len(t) or not ends:
        return []
    last = max(int(t[-1]), ends[-1] + 1)
    xp = np.asarray([0] + ends + [last], dtype=np.float64)
    fp = np.arange(len(xp), dtype=np.float64)
    keep = np.concatenate([[True], np.diff(xp) > 0])  # interp needs increasing points
    return np.round(np.interp(t, xp[keep], fp[keep]), 4).tolist()


def write_rank_report(root: str, rds, output: str | None = None) -> str:
    """One page per rank (in its run folder) and the root page: the cross-rank summary,
    each rank's peak and memory over time, the outlier, links to the rank pages."""
    from . import summary as cross
    target = check_output(output or os.path.join(os.path.abspath(root), "msmemscope_report.html"))
    base = os.path.dirname(os.path.abspath(target))
    ranks = []
    with progress("report", total=len(rds) + 2) as p:
        for rd in rds:
            p.stage(f"{rd.label}")
            try:
                data = build_frame(read_all([rd.path], batched=True), [rd.path], rd.folder)
            except ReportError as e:  # one unreadable rank: said in its row, the others are shown
                ranks.append({"label": rd.label, "rank": rd.rank, "host": rd.host, "dump": os.path.abspath(rd.path),
                              "href": None, "error": str(e), "peak": 0, "events": 0, "steps": 0, "t": [], "hi": [],
                              "findings": [f"error: {e}"], "layers": {}})
                continue
            page = _write(check_output(os.path.join(rd.folder, "msmemscope_report.html")), render(data))
            main = data["series"][data["main"]] if data["main"] is not None else None
            lvl = main["levels"][0] if main else None
            ranks.append({"label": rd.label, "rank": rd.rank, "host": rd.host, "dump": os.path.abspath(rd.path),
                          "href": os.path.relpath(page, base),
                          "peak": main["peak"] if main else 0, "peak_step": main["peak_step"] if main else None,
                          "peak_t": main["peak_t"] if main else None,
                          "device": main["device"] if main else None, "pool": main["pool"] if main else None,
                          "peak_reserved": main["peak_reserved"] if main else None,
                          "layers": dict(zip(main["layers"], main["peak_layers"]))
                          if main and not main["peak_summarised"] else {},
                          "events": data["summary"]["events"], "steps": data["summary"]["steps"],
                          "t": lvl["t"] if lvl else [], "hi": lvl["hi"] if lvl else [],
                          "progress": _step_progress(lvl["t"], data["steps"]) if lvl else [],
                          "findings": [f["text"] for f in data["findings"] if f.get("kind") in ("leak", "oom")][:5]})
        p.stage("cross-rank summary")
        try:
            s = cross.build(root, show_progress=False)
            lines = cross.verdict_lines(s)
            imb = s.get("imbalance")
        except Exception as e:  # the per-rank pages stand on their own
            lines, imb = [f"cross-rank summary not available: {e}"], None
        ok = [r for r in ranks if r["peak"]]
        outlier = None
        if len(ok) >= 2:
            import statistics
            med = statistics.median(r["peak"] for r in ok)
            far = max(ok, key=lambda r: (abs(r["peak"] - med), r["peak"]))  # a tie: the larger one (as summary)
            pct = 100.0 * (far["peak"] - med) / med if med else 0.0
            outlier = {"label": far["label"], "peak": far["peak"], "median": med, "pct": pct,
                       "flagged": abs(pct) >= cross.IMBALANCE_PCT}
        data = {"title": f"msmemscope report — {len(ranks)} ranks under {os.path.basename(os.path.normpath(root))}",
                "root": os.path.abspath(root), "generated": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
                "ranks": ranks, "outlier": outlier, "imbalance": imb, "verdict": lines}
        p.stage("writing html")
        return _write(target, render(data, "ranks.html", "ranks.js"))


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ReportError(message)


def main(argv) -> int:
    p = _Parser(prog="msmemscope report", description="Write a self-contained HTML report of a dump.")
    p.add_argument("path", help="an msmemscope output folder, a dump file, or the root of a job's rank folders")
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
