"""Console text: the short summary printed after a traced run."""
from __future__ import annotations

import os
import sys
import warnings

import polars as pl

from ..io.reader import DumpError, find_dumps, read_dump


def mb(n) -> str:
    return f"{(n or 0) / 1048576:.3f} MB"


def dump_summary(df: pl.DataFrame) -> dict:
    """Numbers a person wants first: steps, events, peak allocated per device, biggest allocators."""
    from ..io.bounded import peaks as run_peaks, summarised_steps
    mem = with_used(df.filter(pl.col("event").is_in(["MALLOC", "FREE"])))
    # a bounded dump's summarised step: its peak may be in a row it dropped (its STEP_SUMMARY says)
    peaks = [{"device": p["device"], "event_type": p["pool"], "peak": p["peak"], "step": p["step"],
              "summarised": p["summarised"]} for p in run_peaks(df, mem)]
    mallocs = df.filter(pl.col("event") == "MALLOC")
    frees = set(df.filter(pl.col("event") == "FREE")["alloc_id"].to_list())
    live = mallocs.filter(~pl.col("alloc_id").is_in(list(frees)))
    top = (allocating_ops(df, mallocs).group_by("name").agg(bytes=pl.col("size").sum(), count=pl.len())
           .sort("bytes", "name", descending=[True, False]).head(5).to_dicts()) if mallocs.height else []
    steps = int(df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height)
    counts = dict(df.group_by("event").len().iter_rows())
    return {"events": df.height, "counts": counts, "steps": steps, "peaks": peaks, "top_ops": top,
            "live_at_exit": live.height, "live_bytes_at_exit": int(live["size"].sum() or 0),
            "summarised_steps": len(summarised_steps(df))}


def with_used(mem: pl.DataFrame) -> pl.DataFrame:
    """MALLOC/FREE rows with ``used`` filled where the dump has none (the original's HAL rows carry
    only ``size``): the running sum of the sizes per device and pool, in ID order."""
    if mem.height == 0 or mem["used"].null_count() == 0:
        return mem
    delta = pl.when(pl.col("event") == "MALLOC").then(pl.col("size")).otherwise(-pl.col("size"))
    return (mem.sort("id")
            .with_columns(_run=delta.fill_null(0).cum_sum().over("device", "event_type"))
            .with_columns(used=pl.coalesce("used", "_run")).drop("_run"))


def allocating_ops(df: pl.DataFrame, mallocs: pl.DataFrame) -> pl.DataFrame:
    """MALLOC rows named by the op that allocated them. The original's dumps name a MALLOC 'N/A':
    the op is then the ATEN op open on the thread at that row. Backing memory of a caching pool
    (HAL) is left out where the pool's own blocks (PTA) are in the dump: they would count twice."""
    if mallocs.height and mallocs["event_type"].is_in(["PTA"]).any():
        mallocs = mallocs.filter(pl.col("event_type") != "HAL")
    unnamed = mallocs["name"].is_null() | (mallocs["name"] == "N/A")
    if not unnamed.any():
        return mallocs
    from ..analysis.leaks import enclosing_ops
    ops = enclosing_ops(df, mallocs)
    return mallocs.with_columns(name=pl.when(unnamed).then(pl.Series("op", ops.to_list(), dtype=pl.String))
                                .otherwise(pl.col("name")).fill_null("N/A"))


def format_summary(folder: str, dump: str, s: dict) -> str:
    lines = [f"[msmemscope] {folder}", f"  dump: {dump}"]
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items()))
    peaks = "; ".join(f"device {p['device']} pool {p['event_type']}: {mb(p['peak'])}" for p in s["peaks"]) or "none"
    top = ", ".join(f"{t['name'].replace('torch._ops.', '')} {mb(t['bytes'])} in {t['count']}"
                    for t in s["top_ops"][:3]) or "none"
    lines.append(
        f"  {s['events']} events ({counts}) over {s['steps']} step boundaries. "
        f"Peak allocated: {peaks}. The ops that allocated most{_in_kept_rows(s)}: {top}. "
        f"{s['live_at_exit']} blocks ({mb(s['live_bytes_at_exit'])}) were still allocated when tracing ended.")
    return "\n".join(lines)


def _in_kept_rows(s: dict) -> str:
    """A bounded dump: its summarised steps' blocks born and freed inside them were dropped, so
    what the ops allocated counts the rows kept only (the peaks take the steps' summaries)."""
    n = s.get("summarised_steps") or 0
    return f" (in the rows kept: {n} summarised step{'s' if n != 1 else ''} left out)" if n else ""


def run_summary(folders, seconds=None, out=sys.stderr):
    for folder in folders:
        try:
            dumps = find_dumps(folder)
        except DumpError as e:
            print(f"[msmemscope] {e}", file=out)
            continue
        for d in dumps:
            try:
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    df = read_dump(d)
            except DumpError as e:
                print(f"[msmemscope] {e}", file=out)
                continue
            print(format_summary(folder, d, dump_summary(df)), file=out)
        cfg = os.path.join(folder, "config.json")
        if os.path.exists(cfg):
            try:
                from ..io.validate import load_json_object
                conf = load_json_object(cfg)  # an object, never nested past 64 levels, or DumpError
                rank = conf.get("rank")
                if rank is not None:
                    print(f"  rank {rank}", file=out)
                if conf.get("native_missing"):  # the run paid for the slower source, and need not have
                    print(f"  captured through the dispatch mode, slower: {conf.get('source_note')}", file=out)
                if conf.get("tool_failure"):  # the run stopped tracing on a failure of the tool's own
                    print(f"  tracing stopped early: {conf['tool_failure']}", file=out)
            except (OSError, ValueError, DumpError):
                pass


def summary_tables(df: pl.DataFrame, s: dict | None = None):
    """``rich`` tables for a dump: peak per device and pool, the ops that allocated most, per step."""
    from rich.table import Table
    s = s or dump_summary(df)
    peaks = Table(title="Peak allocated", title_justify="left")
    for c in ("device", "pool", "peak"):
        peaks.add_column(c, justify="right" if c == "peak" else "left")
    for p in s["peaks"]:
        peaks.add_row(str(p["device"]), str(p["event_type"]), mb(p["peak"]))
    top = Table(title="Ops that allocated most", title_justify="left")
    for c in ("op", "bytes", "allocations"):
        top.add_column(c, justify="left" if c == "op" else "right")
    for t in s["top_ops"]:
        top.add_row(str(t["name"] or "N/A").replace("torch._ops.", ""), mb(t["bytes"]), str(t["count"]))
    from ..io.bounded import step_peaks
    mem = with_used(df.filter(pl.col("event").is_in(["MALLOC", "FREE"])))
    per = step_peaks(df, mem)
    summarised = per["summarised"].any() if per.height else False
    steps = Table(title="Per step" + (" (* summarised: peak from its STEP_SUMMARY row, "
                                      "allocs and frees of its kept rows)" if summarised else ""),
                  title_justify="left")
    for c in ("step", "device", "pool", "peak", "allocs", "frees"):
        steps.add_column(c, justify="right" if c in ("peak", "allocs", "frees", "step") else "left")
    if per.height:
        counts = (mem.group_by(pl.col("step").cast(pl.Int64), pl.col("device").cast(pl.String),
                               pl.col("event_type").cast(pl.String))
                  .agg(allocs=(pl.col("event") == "MALLOC").sum(), frees=(pl.col("event") == "FREE").sum()))
        per = (per.join(counts, on=["step", "device", "event_type"], how="left")
               .with_columns(pl.col("allocs", "frees").fill_null(0)).sort("step", "device", "event_type"))
        for st, dev, pool, peak, summ, na, nf in per.select("step", "device", "event_type", "peak", "summarised",
                                                            "allocs", "frees").iter_rows():
            steps.add_row(f"{st}{'*' if summ else ''}", str(dev), str(pool), mb(peak), str(na), str(nf))
    return [peaks, top, steps]


def print_tables(df: pl.DataFrame, out=sys.stdout, s: dict | None = None):
    from rich.console import Console
    console = Console(file=out, width=max(100, min(160, _width())), highlight=False)
    for t in summary_tables(df, s):
        console.print(t)


def _width():
    import shutil
    return shutil.get_terminal_size((120, 40)).columns


def main(argv) -> int:
    """``msmemscope show <folder-or-dump>``: print the summary of a dump. A dump that cannot be
    read is an error (one line, exit 2); a dump cut short is read with a warning."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: msmemscope show <output-folder-or-dump>\n\n" + main.__doc__.split("\n\n")[0].split(": ", 1)[1]
              .replace("\n    ", " "))
        return 0
    if len(argv) != 1:
        print("msmemscope: error: show takes one path: msmemscope show <output-folder-or-dump>", file=sys.stderr)
        return 2
    path = argv[0]
    frames = []
    try:
        for d in find_dumps(path):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                df = read_dump(d)
            for w in caught:
                print(f"msmemscope: warning: {w.message}", file=sys.stderr)
            frames.append((d, df, dump_summary(df)))
    except DumpError as e:
        print(f"msmemscope: error: {e}", file=sys.stderr)
        return 2
    for d, df, s in frames:
        print(format_summary(path, d, s))
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        try:
            from ..io.validate import load_json_object
            rank = load_json_object(cfg).get("rank")
            if rank is not None:
                print(f"  rank {rank}")
        except (OSError, ValueError, DumpError):
            pass
    for d, df, s in frames:
        print_tables(df, sys.stdout, s)
    return 0
