"""Console text: the short summary printed after a traced run."""
from __future__ import annotations

import json
import os
import sys
import warnings

import polars as pl

from ..io.reader import DumpError, find_dumps, read_dump


def mb(n) -> str:
    return f"{(n or 0) / 1048576:.3f} MB"


def dump_summary(df: pl.DataFrame) -> dict:
    """Numbers a person wants first: steps, events, peak allocated per device, biggest allocators."""
    mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
    peaks = (mem.group_by("device", "event_type").agg(peak=pl.col("used").max())
             .sort("device").to_dicts()) if mem.height else []
    mallocs = df.filter(pl.col("event") == "MALLOC")
    frees = set(df.filter(pl.col("event") == "FREE")["alloc_id"].to_list())
    live = mallocs.filter(~pl.col("alloc_id").is_in(list(frees)))
    top = (mallocs.group_by("name").agg(bytes=pl.col("size").sum(), count=pl.len())
           .sort("bytes", descending=True).head(5).to_dicts()) if mallocs.height else []
    steps = int(df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height)
    counts = dict(df.group_by("event").len().iter_rows())
    return {"events": df.height, "counts": counts, "steps": steps, "peaks": peaks, "top_ops": top,
            "live_at_exit": live.height, "live_bytes_at_exit": int(live["size"].sum() or 0)}


def format_summary(folder: str, dump: str, s: dict) -> str:
    lines = [f"[msmemscope] {folder}", f"  dump: {dump}"]
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items()))
    peaks = "; ".join(f"device {p['device']} pool {p['event_type']}: {mb(p['peak'])}" for p in s["peaks"]) or "none"
    top = ", ".join(f"{t['name'].replace('torch._ops.', '')} {mb(t['bytes'])} in {t['count']}"
                    for t in s["top_ops"][:3]) or "none"
    lines.append(
        f"  {s['events']} events ({counts}) over {s['steps']} step boundaries. "
        f"Peak allocated: {peaks}. The ops that allocated most: {top}. "
        f"{s['live_at_exit']} blocks ({mb(s['live_bytes_at_exit'])}) were still allocated when tracing ended.")
    return "\n".join(lines)


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
                with open(cfg) as f:
                    rank = json.load(f).get("rank")
                if rank is not None:
                    print(f"  rank {rank}", file=out)
            except (OSError, ValueError):
                pass


def main(argv) -> int:
    """``msmemscope show <folder-or-dump>``: print the summary of a dump."""
    if len(argv) != 1:
        print("msmemscope: error: show takes one path: msmemscope show <output-folder-or-dump>", file=sys.stderr)
        return 2
    try:
        find_dumps(argv[0])
    except DumpError as e:
        print(f"msmemscope: error: {e}", file=sys.stderr)
        return 2
    run_summary([argv[0]], out=sys.stdout)
    return 0
