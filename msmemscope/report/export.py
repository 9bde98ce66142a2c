"""``msmemscope export --format=memory-snapshot|perfetto <dump> [-o path] [--step N]``

memory-snapshot: a pickle in PyTorch's memory-snapshot layout (what
``torch.cuda.memory._snapshot()`` returns), so pytorch.org/memory_viz and
``torch.cuda._memory_viz`` read it: ``device_traces`` (per device index, one list of
``alloc`` / ``free_requested`` / ``free_completed`` entries with addr, size,
stream, time_us, frames) and ``segments`` (the blocks still allocated at the end,
one segment per block, plus the reserved-but-free bytes where ``total`` says so).

perfetto: Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing): a counter
track per device and pool (allocated, reserved), complete slices for ops
(ATEN_START/END), steps and mstx ranges, instant events for marks.

``--step N`` keeps the events up to the end of step N (the snapshot is then the
memory as it stood there).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

import polars as pl

from .common import ReportError, check_output, locate, read_all, with_op
from .progress import progress

FORMATS = ("memory-snapshot", "perfetto")


# ---------------------------------------------------------------- helpers
def device_index(dev) -> int:
    """PyTorch's traces are indexed by device number; CPU (and anything unnumbered) is 0."""
    try:
        return int(dev)
    except (TypeError, ValueError):
        return 0


def parse_frames(py_stack, op=None) -> list[dict]:
    """``file:line(func);…`` (innermost first, as we record it) into PyTorch frame dicts;
    the op comes first as a frame of its own so the viewer names it."""
    frames = []
    if op:
        frames.append({"filename": "<aten op>", "line": 0, "name": op})
    if py_stack and py_stack != "N/A":
        for part in py_stack.split(";"):
            part = part.strip()
            if not part:
                continue
            loc, _, func = part.partition("(")
            func = func[:-1] if func.endswith(")") else func
            fname, _, line = loc.rpartition(":")
            if not fname:
                fname, line = loc, "0"
            try:
                ln = int(line)
            except ValueError:
                fname, ln = loc, 0
            frames.append({"filename": fname, "line": ln, "name": func or "?"})
    return frames


def _cut(df: pl.DataFrame, step: int | None) -> pl.DataFrame:
    if step is None:
        return df
    if step < 1 or step > int(df["step"].max() or 1):
        raise ReportError(f"--step {step}: the dump has steps 1 to {int(df['step'].max() or 1)}")
    return df.filter(pl.col("step") <= step)


# ---------------------------------------------------------------- memory snapshot
SEGMENT_POOLS = ("HAL",)  # driver-level pools: their blocks are the allocator's segments


def _block(a, size, state, fr):
    return {"address": a, "size": size, "requested_size": size if state == "active_allocated" else 0,
            "state": state, "frames": fr}


def _segment(di, a, size, blocks, fr, pool=None):
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    seg = {"device": di, "address": a, "total_size": size, "allocated_size": active, "active_size": active,
           "requested_size": active, "stream": 0, "segment_type": "large" if size >= (1 << 20) else "small",
           "segment_pool_id": (0, 0), "is_expandable": False, "frames": fr, "blocks": blocks}
    if pool:
        seg["pool"] = pool
    return seg


def memory_snapshot(df: pl.DataFrame) -> dict:
    df = with_op(df)
    mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]) & pl.col("size").is_not_null())
    ndev = 1 + max([device_index(d) for d in mem["device"].unique().to_list()] or [0])
    traces: list[list[dict]] = [[] for _ in range(ndev)]
    live: dict = {}
    live_segs: dict = {}
    frames_of: dict = {}
    for ev, pool, dev, aid, addr, size, ts, op, stack in mem.select(
            "event", "event_type", "device", "alloc_id", "addr", "size", "ts", "op", "py_stack").iter_rows():
        di = device_index(dev)
        a = int(addr) if addr is not None else int(aid or 0)
        t_us = int(ts // 1000) if ts is not None else 0
        seg = pool in SEGMENT_POOLS
        key = (pool, aid)
        if ev == "MALLOC":
            fr = parse_frames(stack, op)
            frames_of[key] = fr
            (live_segs if seg else live)[key] = (di, a, int(size), fr)
            traces[di].append({"action": "segment_alloc" if seg else "alloc", "addr": a, "size": int(size),
                               "stream": 0, "time_us": t_us, "frames": fr})
        else:
            fr = frames_of.pop(key, None) or parse_frames(stack, op)
            (live_segs if seg else live).pop(key, None)
            for action in (("segment_free",) if seg else ("free_requested", "free_completed")):
                traces[di].append({"action": action, "addr": a, "size": int(size), "stream": 0,
                                   "time_us": t_us, "frames": fr})
    # segments at the end: driver segments holding the live blocks inside them,
    # else one segment per live block
    segments = []
    blocks = sorted(live.values(), key=lambda v: (v[0], v[1]))
    placed = set()
    for di, a, size, fr in sorted(live_segs.values(), key=lambda v: (v[0], v[1])):
        inner, pos = [], a
        for j, (bd, ba, bs, bfr) in enumerate(blocks):
            if j in placed or bd != di or ba < pos or ba + bs > a + size:
                continue
            if ba > pos:
                inner.append(_block(pos, ba - pos, "inactive", []))
            inner.append(_block(ba, bs, "active_allocated", bfr))
            placed.add(j)
            pos = ba + bs
        if pos < a + size:
            inner.append(_block(pos, a + size - pos, "inactive", []))
        segments.append(_segment(di, a, size, inner, fr))
    for j, (di, a, size, fr) in enumerate(blocks):
        if j not in placed:
            segments.append(_segment(di, a, size, [_block(a, size, "active_allocated", fr)], fr))
    # reserved but not allocated, known only from ``total``: one free segment per device and pool
    seg_devices = {v[0] for v in live_segs.values()}
    counted = mem.filter(~pl.col("event_type").is_in(list(SEGMENT_POOLS)) & pl.col("used").is_not_null())
    if counted.height:
        last = counted.group_by("device", "event_type").agg(used=pl.col("used").last(), total=pl.col("total").last())
        top = max([s["address"] + s["total_size"] for s in segments] or [0])
        for dev, pool, used, total in last.sort("device", "event_type").iter_rows():
            if used is None or total is None or total <= used or device_index(dev) in seg_devices:
                continue
            gap = int(total - used)
            addr = top + (1 << 21)  # past every live block: never taken for one of them
            top = addr + gap
            segments.append(_segment(device_index(dev), addr, gap, [_block(addr, gap, "inactive", [])], [],
                                     pool=str(pool)))
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {}, "external_annotations": []}


# ---------------------------------------------------------------- perfetto / chrome trace
def _op_slices(df: pl.DataFrame) -> pl.DataFrame:
    """Pair ATEN_START/END per thread by nesting depth: (tid, name, start ts, end ts)."""
    ops = df.filter(pl.col("event") == "OP_LAUNCH").select("id", "tid", "ts", "event_type", "op")
    if not ops.height:
        return pl.DataFrame(schema={"tid": pl.Int64, "op": pl.String, "ts": pl.Int64, "end": pl.Int64})
    is_start = pl.col("event_type") == "ATEN_START"
    ops = ops.with_columns(delta=pl.when(is_start).then(1).otherwise(-1))
    ops = ops.with_columns(level=pl.col("delta").cum_sum().over("tid"))
    ops = ops.with_columns(depth=pl.when(is_start).then(pl.col("level")).otherwise(pl.col("level") + 1))
    ops = ops.with_columns(k=pl.col("id").cum_count().over("tid", "depth", "event_type"))
    starts = ops.filter(is_start).select("tid", "depth", "k", "op", "ts")
    ends = ops.filter(~is_start).select("tid", "depth", "k", end=pl.col("ts"))
    last_ts = int(df["ts"].max())
    return (starts.join(ends, on=["tid", "depth", "k"], how="left")
            .with_columns(pl.col("end").fill_null(last_ts)).sort("ts"))


def perfetto_events(df: pl.DataFrame):
    """Yield Chrome trace events (dicts) for the dump, times in µs from the first row."""
    df = with_op(df)
    t0 = int(df["ts"].min())
    pid = int(df["pid"].drop_nulls().first() or 0) if df["pid"].drop_nulls().len() else 0

    def us(ts):
        return round((ts - t0) / 1000.0, 3)

    # Perfetto's JSON importer takes a tid above 2**32 for a pid, which folds every thread of
    # ours (pthread ids) into one track: threads become 1, 2, ... here, named by their real id
    tids = df["tid"].drop_nulls().unique().sort().to_list()
    tid_of = {t: i + 1 for i, t in enumerate(tids)}

    def tid(t):
        return tid_of.get(t, 0)

    yield {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"msmemscope pid {pid}"}}
    yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "steps"}}
    for t in tids:
        yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid_of[t], "args": {"name": f"thread {t}"}}
    # memory counters: one sample per MALLOC/FREE row, per device and pool
    mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]) & pl.col("used").is_not_null())
    for ts, dev, pool, used, total in mem.select("ts", "device", "event_type", "used", "total").iter_rows():
        args = {"allocated": int(used)}
        if total is not None:
            args["reserved"] = int(total)
        yield {"name": f"memory device {dev} {pool}", "cat": "memory", "ph": "C", "ts": us(ts), "pid": pid,
               "tid": 0, "args": args}
    # one counter per owner category (or per op when the dump has no owners), per device and pool:
    # a sample where that category's bytes change
    from .views import final_owners, layer_frame
    owners = final_owners(df)
    for (dev, pool), part in sorted(mem.partition_by(["device", "event_type"], as_dict=True).items(),
                                    key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        m, names, by = layer_frame(part, owners)
        m = m.with_columns(v=pl.col("signed").cum_sum().over("layer"))
        for ts, layer, v in m.select("ts", "layer", "v").iter_rows():
            yield {"name": f"{by} {names[layer]} device {dev} {pool}", "cat": f"memory by {by}", "ph": "C",
                   "ts": us(ts), "pid": pid, "tid": 0, "args": {"bytes": int(v)}}
    # ops
    for tid_, name, ts, end in _op_slices(df).select("tid", "op", "ts", "end").iter_rows():
        yield {"name": name or "?", "cat": "op", "ph": "X", "ts": us(ts), "dur": max(0.0, round((end - ts) / 1000.0, 3)),
               "pid": pid, "tid": tid(tid_)}
    # steps: a STEP row ends its step
    prev = t0
    for step, ts in (df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
                     .select("step", "ts").iter_rows()):
        yield {"name": f"step {step}", "cat": "step", "ph": "X", "ts": us(prev),
               "dur": max(0.0, round((ts - prev) / 1000.0, 3)), "pid": pid, "tid": 0, "args": {"step": int(step)}}
        prev = ts
    # marks and ranges
    mstx = df.filter(pl.col("event") == "MSTX").select("ts", "tid", "event_type", "name", "attr")
    open_ranges = {}
    for ts, mtid, kind, name, attr in mstx.iter_rows():
        if kind == "Mark":
            yield {"name": name or "mark", "cat": "mark", "ph": "i", "s": "t", "ts": us(ts), "pid": pid,
                   "tid": tid(mtid)}
        else:
            try:
                from ..io.validate import attr_object
                rid = attr_object(attr).get("range_id") if attr else None  # never deeper than 64 levels
            except (ValueError, TypeError):
                rid = None
            if kind == "Range_start":
                open_ranges[rid] = (ts, name, mtid)
            elif kind == "Range_end" and rid in open_ranges:
                t_start, n, t_tid = open_ranges.pop(rid)
                yield {"name": n or "range", "cat": "range", "ph": "X", "ts": us(t_start),
                       "dur": max(0.0, round((ts - t_start) / 1000.0, 3)), "pid": pid, "tid": tid(t_tid)}


def write_perfetto(df: pl.DataFrame, f, source: str) -> int:
    n = 0
    f.write('{"displayTimeUnit":"ms","otherData":')
    f.write(json.dumps({"tool": "msmemscope", "source": source, "t0_ns": int(df["ts"].min())}))
    f.write(',"traceEvents":[\n')
    for ev in perfetto_events(df):
        if n:
            f.write(",\n")
        f.write(json.dumps(ev, separators=(",", ":")))
        n += 1
    f.write("\n]}\n")
    return n


# ---------------------------------------------------------------- command
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ReportError(message)


def export(path: str, fmt: str, output: str | None = None, step: int | None = None) -> str:
    if fmt not in FORMATS:
        raise ReportError(f"--format: '{fmt}' is not one of {', '.join(FORMATS)}")
    with progress(f"export {fmt}", total=3) as p:
        p.stage("reading dump")
        dumps, folder = locate(path)
        df = read_all(dumps)
        if not df.height:
            raise ReportError(f"{path}: the dump holds no rows")
        df = _cut(df, step)
        base = folder or os.path.dirname(os.path.abspath(dumps[0]))
        suffix = f"_step{step}" if step is not None else ""
        default = (f"msmemscope_snapshot{suffix}.pickle" if fmt == "memory-snapshot"
                   else f"msmemscope_trace{suffix}.json")
        target = check_output(output or os.path.join(base, default))
        p.stage("converting")
        from ..io.files import write_new
        try:
            if fmt == "memory-snapshot":
                snap = memory_snapshot(df)
                p.stage("writing")
                with write_new(target, binary=True) as f:
                    pickle.dump(snap, f, protocol=4)
            else:
                p.stage("writing")
                with write_new(target) as f:
                    write_perfetto(df, f, ", ".join(os.path.abspath(d) for d in dumps))
        except OSError as e:
            raise ReportError(f"cannot write {target}: {e.strerror or e}") from None
    return target


def main(argv) -> int:
    p = _Parser(prog="msmemscope export",
                description="Export a dump to PyTorch's memory snapshot (pytorch.org/memory_viz) "
                            "or to Chrome/Perfetto trace JSON (ui.perfetto.dev).")
    p.add_argument("--format", required=True, help="memory-snapshot or perfetto")
    p.add_argument("path", help="an msmemscope output folder or a dump file")
    p.add_argument("-o", "--output", help="the file to write (an existing file is never overwritten)")
    p.add_argument("--step", help="keep the events up to the end of this step")
    try:
        ns = p.parse_args(argv)
        step = None
        if ns.step is not None:
            try:
                step = int(ns.step)
            except ValueError:
                raise ReportError(f"--step: '{ns.step}' is not a step number") from None
        target = export(ns.path, ns.format, ns.output, step)
    except ReportError as e:
        print(f"msmemscope: error: {e}", file=sys.stderr)
        return 2
    print(f"[msmemscope] {ns.format}: {target}", file=sys.stderr)
    return 0
