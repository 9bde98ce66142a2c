"""Leaks and memory fluctuation (SPEC §4.1 online, §4.2 offline).

Step rule (online, and offline without marks): a block allocated in step
``s >= 2`` that is still live when step ``s + 1`` ends has outlived one full
step and is reported once, as "leaked at step s". Blocks of step 1 (weights,
optimizer state, warm-up caches) are never reported.

Fluctuation: per (device, pool) and per ended step from step 2 on, the
smallest and largest ``used`` within the step (the level carried into the step
counts as a value of the step); the ratio min/max is printed for the steps with
the smallest (MinGap) and largest (MaxGap) ratio.

Mark rule (offline, ``check_leaks``): marks A, B, C are the Mark rows whose
message equals ``mstx_info``, from ``start_index`` on, in ID order. A block
allocated between A and B and not freed before C is a leak.

The online sink consumes the session's raw rows through ``StepLeakTracker``;
the offline functions compute the same answers with polars over the reader's
columns (``step_leaks``, ``fluctuation``, ``leaks_between``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

log = logging.getLogger("msmemscope")

MB = 1048576.0
POOL_TITLES = {
    "PTA": "Pytorch Caching memory pool",
    "PTA_WORKSPACE": "Pytorch workspace memory pool",
    "HAL": "HAL memory pool",
    "HOST": "Host memory pool",
    "HOST_PINNED": "Host pinned memory pool",
}


class MarkError(ValueError):
    """The marks needed by the A/B/C rule are missing (message says which, and how many were found)."""


def pool_title(pool) -> str:
    return POOL_TITLES.get(pool, f"{pool} memory pool")


def short_op(name) -> str:
    if not name or name == "N/A":
        return "an unknown op"
    return name[len("torch._ops."):] if name.startswith("torch._ops.") else name


def hex_addr(addr) -> str:
    return "0x%x" % addr if addr is not None else "N/A"


from ..frames import user_line as _user_line  # noqa: E402


# ---------------------------------------------------------------------------- report text
def leak_line(leak: dict) -> str:
    where = f" at step {leak['step']}" if leak.get("step") is not None else ""
    if leak.get("step") is None and leak.get("id") is not None:
        where = f" (event ID {leak['id']})"
    text = (f"Direct {pool_title(leak['pool'])} leak of {leak['size'] / MB:.6f} Mb(s) at "
            f"{hex_addr(leak['addr'])} in {short_op(leak.get('op'))}{where}.")
    if leak.get("python"):
        text += f" Python: {leak['python']}"
    return text


def leak_report(leaks: list[dict]) -> list[str]:
    """The original's shape: per device an ERROR header, one line per leak, a SUMMARY line."""
    lines = []
    by_dev: dict = {}
    for lk in leaks:
        by_dev.setdefault(str(lk["device"]), []).append(lk)
    for dev, items in by_dev.items():
        lines.append(f"====== ERROR: Detected memory leaks on device {dev} ======")
        lines.extend(leak_line(lk) for lk in items)
        total = sum(lk["size"] for lk in items)
        lines.append(f"====== SUMMARY: {total / MB:.4f} Mb(s) leaked in {len(items)} allocation(s) ======")
    return lines


def gap_report(fluct: dict) -> list[str]:
    """MinGap/MaxGap table per (device, pool); ``fluct`` maps (device, pool) -> {step: (min, max)}."""
    lines = []
    for (dev, pool), steps in fluct.items():
        rows = [(s, mn, mx) for s, (mn, mx) in sorted(steps.items()) if mx and mx > 0]
        if not rows:
            continue
        ratio = lambda r: r[1] / r[2]  # noqa: E731
        lo = min(rows, key=ratio)
        hi = max(rows, key=ratio)
        lines.append(f"======= {pool_title(pool)} Gap Analysis of Device {dev} =======")
        lines.append(f"        {'MinAlloc/MaxAlloc(%)':<25}{'MinAllocMem(MB)':<25}StepId")
        for label, r in (("MinGap", lo), ("MaxGap", hi)):
            lines.append(f"{label:<8}{ratio(r) * 100:<25.4f}{r[1] / MB:<25.4f}{r[0]}")
    return lines


def fluct_json(fluct: dict) -> list[dict]:
    out = []
    for (dev, pool), steps in fluct.items():
        rows = [{"step": s, "min_used": mn, "max_used": mx, "ratio": (mn / mx if mx else None)}
                for s, (mn, mx) in sorted(steps.items())]
        valid = [r for r in rows if r["ratio"] is not None]
        out.append({"device": str(dev), "pool": pool, "steps": rows,
                    "min_gap": min(valid, key=lambda r: r["ratio"]) if valid else None,
                    "max_gap": max(valid, key=lambda r: r["ratio"]) if valid else None})
    return out


# ---------------------------------------------------------------------------- online: the tracker
class StepLeakTracker:
    """The step rule and fluctuation over a stream of MALLOC/FREE/STEP events, in ID order.
    Online it sees every allocation: a suspect is a tuple until it is judged a leak."""

    def __init__(self):
        self.step = 1
        # (device, pool, alloc_id) -> (step, row_id, addr, size, op, py_stack) for the live blocks
        # of steps >= 2 not yet judged (at most those of the last two steps)
        self.pending: dict = {}
        self.reported: dict = {}     # key -> leak record (to note a later free)
        self.leaks: list = []
        self.level: dict = {}        # (device, pool) -> used after the last event
        self.fluct: dict = {}        # (device, pool) -> {step: [min, max]}

    def _used(self, pk, used):
        s = self.step
        if s < 2 or used is None:
            if used is not None:
                self.level[pk] = used
            return
        steps = self.fluct.get(pk)
        if steps is None:
            steps = self.fluct[pk] = {}
        mm = steps.get(s)
        if mm is None:
            prev = self.level.get(pk)
            mm = steps[s] = [used, used] if prev is None else [min(prev, used), max(prev, used)]
        elif used < mm[0]:
            mm[0] = used
        elif used > mm[1]:
            mm[1] = used
        self.level[pk] = used

    def malloc(self, row_id, device, pool, alloc_id, addr, size, used, op, py_stack=None):
        self._used((device, pool), used)
        s = self.step
        if s >= 2:
            self.pending[(device, pool, alloc_id)] = (s, row_id, addr, size, op, py_stack)

    def free(self, device, pool, alloc_id, used):
        self._used((device, pool), used)
        key = (device, pool, alloc_id)
        if self.pending.pop(key, None) is None and self.reported:
            rec = self.reported.pop(key, None)
            if rec is not None:
                rec["freed_at_step"] = self.step

    def end_step(self, n, is_live=None) -> list:
        """Step ``n`` ended: blocks of steps <= n-1 still live have outlived a full step.

        ``is_live(alloc_id)``, when given, confirms a suspect against the allocator's own view: a
        FREE that was not recorded (``--steps``, a stop/start gap) must not make a leak."""
        new = []
        pending = self.pending
        due = [k for k, v in pending.items() if v[0] <= n - 1]  # in allocation order
        for key in sorted(due, key=lambda k: pending[k][0]):
            s, row_id, addr, size, op, stack = pending.pop(key)
            device, pool, alloc_id = key
            if is_live is not None and not is_live(alloc_id):
                continue
            rec = {"device": str(device), "pool": pool, "addr": addr, "size": size, "step": s, "op": op,
                   "alloc_id": alloc_id, "id": row_id, "detected_at_step": n, "python": _user_line(stack),
                   "address": hex_addr(addr)}
            self.reported[key] = rec
            new.append(rec)
        self.leaks.extend(new)
        self.step = n + 1
        return new


class LeakSink:
    """``--analysis=leaks``: the online sink."""

    def __init__(self, session):
        self.t = StepLeakTracker()
        self.pending: list = []
        self.session = session
        self._live_ids = None

    def _is_live(self, alloc_id) -> bool:
        if self._live_ids is None:
            self._live_ids = self.session.live_alloc_ids()
        return alloc_id in self._live_ids

    def consume(self, rows, first_id):
        t = self.t
        for i, r in enumerate(rows):
            ev = r[0]
            if ev == "OP_LAUNCH":  # most rows: nothing to do
                continue
            if ev == "MALLOC":
                a = r[7]
                if type(a) is tuple:
                    aid, addr, size, used = a[0], a[1], a[2], a[3]
                else:
                    aid, addr, size, used = a.get("allocation_id"), a.get("addr"), a.get("size"), a.get("used")
                t.malloc(first_id + i, r[5], r[1], aid, addr, size, used, r[2], r[8])
            elif ev == "FREE":
                a = r[7]
                if type(a) is tuple:
                    t.free(r[5], r[1], a[0], a[3])
                else:
                    t.free(r[5], r[1], a.get("allocation_id"), a.get("used"))
            elif ev == "SYSTEM" and r[1] == "STEP":
                a = r[7] or {}
                n = a.get("step", t.step) if isinstance(a, dict) else t.step
                self._live_ids = None
                self.pending.extend(t.end_step(n, self._is_live))
                self._live_ids = None

    def step_end(self, session, step):
        self._emit_pending()

    def _emit_pending(self):
        if not self.pending:
            return
        lines = []
        by_dev: dict = {}
        for lk in self.pending:
            by_dev.setdefault(lk["device"], []).append(lk)
        for dev, items in by_dev.items():
            lines.append(f"====== ERROR: Detected memory leaks on device {dev} ======")
            lines.extend(leak_line(lk) for lk in items)
        self.pending = []
        _say(lines)

    def close(self, session):
        self._emit_pending()
        leaks = self.t.leaks
        lines = []
        by_dev: dict = {}
        for lk in leaks:
            by_dev.setdefault(lk["device"], []).append(lk)
        for dev, items in by_dev.items():
            total = sum(lk["size"] for lk in items)
            lines.append(f"====== SUMMARY: {total / MB:.4f} Mb(s) leaked in {len(items)} allocation(s) "
                         f"on device {dev} ======" if len(by_dev) > 1 else
                         f"====== SUMMARY: {total / MB:.4f} Mb(s) leaked in {len(items)} allocation(s) ======")
        last = self.t.step - 1  # the rows after the last STEP row are not a full step
        fluct = {k: {s: tuple(v) for s, v in steps.items() if s <= last} for k, steps in self.t.fluct.items()}
        lines.extend(gap_report(fluct))
        _say(lines)
        result = {"analysis": "leaks",
                  "rule": "blocks allocated in step s >= 2 still live at the end of step s+1",
                  "steps_ended": self.t.step - 1,
                  "leaks": [_leak_json(lk) for lk in leaks],
                  "summary": [{"device": d, "count": len(v), "bytes": sum(x["size"] for x in v)}
                              for d, v in by_dev.items()],
                  "fluctuation": fluct_json(fluct)}
        write_result(session.folder, "leaks", result)


def _leak_json(lk):
    keys = ("device", "pool", "address", "addr", "size", "step", "detected_at_step", "op", "python",
            "alloc_id", "id", "freed_at_step")
    return {k: lk.get(k) for k in keys if k in lk}


def _say(lines):
    for ln in lines:
        print(ln, file=sys.stderr)
        log.info("%s", ln)
    if lines:
        sys.stderr.flush()


def write_result(folder, name, result) -> str:
    from ..io.files import create_new, make_dirs, unique_path
    d = make_dirs(os.path.join(folder, "analysis"))
    path = unique_path(os.path.join(d, f"{name}.json"))
    with create_new(path) as f:
        json.dump(result, f, indent=2, default=str)
    return path


def make_sink(session):
    return LeakSink(session)


# ---------------------------------------------------------------------------- offline (polars)
def _pl():
    import polars as pl
    return pl


_KEY = ["device", "event_type", "alloc_id"]


def _mem(df):
    """MALLOC/FREE rows, as a lazy query (the filters of each analysis fuse into one scan)."""
    pl = _pl()
    return df.lazy().filter(pl.col("event").is_in(["MALLOC", "FREE"]))


def enclosing_ops(df, rows):
    """For each row of ``rows`` (id, tid), the innermost ATEN op open on the same thread at that ID."""
    pl = _pl()
    q = rows.select("id", "tid").with_row_index("_i").sort("id")
    if q.height == 0:
        return pl.Series("op", [], dtype=pl.String)
    tids = q["tid"].unique()
    ops = (df.lazy()
           .filter((pl.col("id") <= q["id"].max()) & pl.col("tid").is_in(tids.implode())
                   & (pl.col("event") == "OP_LAUNCH") & pl.col("event_type").is_in(["ATEN_START", "ATEN_END"]))
           .select("id", "tid", "name",
                   delta=pl.when(pl.col("event_type") == "ATEN_START").then(1).otherwise(-1))
           .sort("id")
           .with_columns(depth=pl.col("delta").cum_sum().over("tid"))
           .collect())
    if ops.height == 0:
        return pl.Series("op", [None] * rows.height, dtype=pl.String)
    # depth on the thread just before the row, then the last ATEN_START that opened that depth
    at = q.join_asof(ops.select("id", "tid", "depth"), on="id", by="tid", strategy="backward",
                     check_sortedness=False).with_columns(pl.col("depth").fill_null(0))
    starts = ops.filter(pl.col("delta") == 1).select("id", "tid", "depth", op="name")
    found = at.join_asof(starts, on="id", by=["tid", "depth"], strategy="backward", check_sortedness=False)
    found = found.with_columns(op=pl.when(pl.col("depth") > 0).then(pl.col("op")))
    return found.sort("_i")["op"]


def _with_ops(df, blocks):
    """Fill N/A op names of MALLOC rows (the original's dumps) with the enclosing aten op."""
    pl = _pl()
    if blocks.height == 0:
        return blocks.with_columns(op=pl.col("name"))
    missing = blocks["name"].is_null() | (blocks["name"] == "N/A")
    if not missing.any():
        return blocks.with_columns(op=pl.col("name"))
    enc = enclosing_ops(df, blocks)
    return blocks.with_columns(op=pl.when(missing).then(enc).otherwise(pl.col("name")))


def _records(df, blocks, extra=()):
    blocks = _with_ops(df, blocks.sort("id"))
    cols = ["device", "event_type", "addr", "size", "id", "alloc_id", "op", "py_stack", *extra]
    out = []
    for r in blocks.select([c for c in cols if c in blocks.columns]).iter_rows(named=True):
        rec = {"device": r["device"], "pool": r["event_type"], "addr": r["addr"], "address": hex_addr(r["addr"]),
               "size": r["size"], "id": r["id"], "alloc_id": r["alloc_id"], "op": r["op"],
               "python": _user_line(r.get("py_stack"))}
        for e in extra:
            rec[e] = r[e]
        out.append(rec)
    return out


def ended_steps(df) -> int:
    pl = _pl()
    v = (df.lazy().filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
         .select(pl.col("step").max()).collect().item())
    return int(v) if v is not None else 0


def step_leaks(df) -> list[dict]:
    """The online step rule over a dump's columns (vectorized)."""
    pl = _pl()
    last = ended_steps(df)
    mem = _mem(df)
    m = mem.filter((pl.col("event") == "MALLOC") & (pl.col("step") >= 2) & (pl.col("step") + 1 <= last))
    f = mem.filter(pl.col("event") == "FREE").select(*_KEY, freed_at_step=pl.col("step"))
    leaked = (m.join(f, on=_KEY, how="left", nulls_equal=True)
              .filter(pl.col("freed_at_step").is_null() | (pl.col("freed_at_step") > pl.col("step") + 1))
              .collect())
    recs = _records(df, leaked, extra=("step", "freed_at_step"))
    for r in recs:
        r["detected_at_step"] = r["step"] + 1
        if r["freed_at_step"] is None:
            del r["freed_at_step"]
    return recs


def fluctuation(df) -> dict:
    """(device, pool) -> {step: (min used, max used)} for ended steps >= 2 (vectorized)."""
    pl = _pl()
    last = ended_steps(df)
    g = (_mem(df).filter(pl.col("used").is_not_null()).sort("id")
         .with_columns(prev=pl.col("used").shift(1).over("device", "event_type"))
         .filter((pl.col("step") >= 2) & (pl.col("step") <= last))
         .group_by("device", "event_type", "step")
         .agg(mn=pl.min_horizontal(pl.col("used").min(), pl.col("prev").min()),
              mx=pl.max_horizontal(pl.col("used").max(), pl.col("prev").max()))
         .sort("device", "event_type", "step")
         .collect())
    out: dict = {}
    for dev, pool, step, mn, mx in g.iter_rows():
        out.setdefault((dev, pool), {})[step] = (mn, mx)
    return out


def find_marks(df, mstx_info: str):
    pl = _pl()
    return (df.lazy().filter((pl.col("event") == "MSTX") & (pl.col("event_type") == "Mark")
                             & (pl.col("name") == mstx_info)).select("id").sort("id").collect()["id"].to_list())


def leaks_between(df, a_id: int, b_id: int, c_id: int) -> list[dict]:
    """Blocks allocated between IDs A and B and not freed before ID C (every pool, every device)."""
    pl = _pl()
    mem = _mem(df).filter(pl.col("id") < c_id)
    m = mem.filter((pl.col("event") == "MALLOC") & (pl.col("id") > a_id) & (pl.col("id") < b_id))
    f = mem.filter((pl.col("event") == "FREE") & (pl.col("id") > a_id)).select(_KEY)
    leaked = m.join(f, on=_KEY, how="anti", nulls_equal=True).collect()
    return _records(df, leaked)


def check_leaks(input_path, mstx_info, start_index=0, out=None):
    """SPEC §4.2: take the Mark rows whose message equals ``mstx_info``, in ID order; A = marks[start_index],
    B and C the next two. Blocks allocated between A and B and not freed before C are leaks.

    ``input_path``: a CSV or db dump (ours or the original's) or an output folder. Prints the report
    (to ``out``, default stdout) and returns the leaked blocks as dicts: device, pool, addr, address,
    size, id, alloc_id, op, python (and dump when a folder held several dumps).
    Raises ``DumpError`` (unreadable input) or ``MarkError`` (fewer than three matching marks)."""
    from ..io.reader import find_dumps
    out = sys.stdout if out is None else out
    if isinstance(start_index, bool) or not isinstance(start_index, int) or start_index < 0:
        try:
            start_index = int(start_index)
        except (TypeError, ValueError):
            raise MarkError(f"start_index must be a whole number >= 0, not {start_index!r}") from None
        if start_index < 0:
            raise MarkError(f"start_index must be >= 0, not {start_index}")
    input_path = os.fspath(input_path)
    dumps = find_dumps(input_path)
    results, errors, reports = [], [], []
    for d in dumps:
        df = _read(d)
        marks = find_marks(df, str(mstx_info))
        if len(marks) < start_index + 3:
            errors.append(f"{d}: found {len(marks)} mark(s) with message '{mstx_info}'; start_index "
                          f"{start_index} needs at least {start_index + 3} (marks A, B, C)")
            continue
        a, b, c = marks[start_index:start_index + 3]
        leaks = leaks_between(df, a, b, c)
        if len(dumps) > 1:
            for lk in leaks:
                lk["dump"] = d
        results.extend(leaks)
        head = f"msmemscope: leak check of {d} between marks '{mstx_info}' A (ID {a}), B (ID {b}), C (ID {c})"
        reports.append(head)
        reports.extend(leak_report(leaks) or ["====== No memory leaks detected ======"])
    if errors and not reports:
        raise MarkError(errors[0] if len(errors) == 1 else "; ".join(errors))
    for e in errors:
        reports.append(f"msmemscope: skipped {e}")
    print("\n".join(reports), file=out)
    return results


#: what the offline leak checks read of a dump (the reader's column layer)
COLUMNS = ("id", "event", "event_type", "name", "tid", "device", "alloc_id", "addr", "size", "used", "py_stack", "step")
EVENTS = ("MALLOC", "FREE", "MSTX", "OP_LAUNCH", "SYSTEM")


def _read(path):
    import warnings
    from ..io.reader import read_dump
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = read_dump(path, columns=COLUMNS, events=EVENTS)
    for w in caught:
        print(f"msmemscope: warning: {w.message}", file=sys.stderr)
    return df


def check_step_leaks(input_path, out=None):
    """The online step rule and fluctuation table, recomputed from a dump."""
    from ..io.reader import find_dumps
    out = sys.stdout if out is None else out
    results = []
    for d in find_dumps(os.fspath(input_path)):
        df = _read(d)
        leaks = step_leaks(df)
        print(f"msmemscope: step leak check of {d} ({ended_steps(df)} steps ended)", file=out)
        lines = leak_report(leaks) or ["====== No memory leaks detected ======"]
        lines += gap_report(fluctuation(df))
        print("\n".join(lines), file=out)
        results.extend(leaks)
    return results


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise MarkError(message)


def main(argv=None) -> int:
    p = _Parser(prog="msmemscope check-leaks", add_help=True,
                description="Offline leak check of a dump (CSV or db, ours or the original's). With --mark: "
                            "blocks allocated between marks A and B and not freed before mark C. Without: the "
                            "online step rule and the fluctuation table.")
    p.add_argument("input", help="a dump file or an output folder")
    p.add_argument("--mark", "--mstx-info", dest="mark", help="message of the marks A, B, C")
    p.add_argument("--start-index", "--start_index", dest="start_index", default="0",
                   help="which matching mark is A (default 0)")
    p.add_argument("--json", action="store_true", help="print the leaked blocks as JSON instead of the report")
    from ..io.reader import DumpError
    try:
        ns = p.parse_args(argv)
        try:
            start = int(ns.start_index)
        except ValueError:
            raise MarkError(f"--start-index: '{ns.start_index}' is not a whole number") from None
        sink = open(os.devnull, "w") if ns.json else sys.stdout
        try:
            if ns.mark is not None:
                leaks = check_leaks(ns.input, ns.mark, start, out=sink)
            else:
                leaks = check_step_leaks(ns.input, out=sink)
        finally:
            if ns.json:
                sink.close()
    except (DumpError, MarkError) as e:
        print(f"msmemscope: error: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(leaks, indent=2, default=str))
    return 0
