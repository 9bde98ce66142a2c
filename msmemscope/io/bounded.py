"""The bounded dump (``--keep-steps=N``): a long run's dump that grows with N, not with the run.

Every row of these steps is written: the last N steps (and the rows after the last step end),
the first step that leaves behind a block of an allocation site not seen leaving blocks
before (a step ``s >= 2`` with a block still live when step ``s + 1`` ends: what the step-leak
rule and growth by site look at), at most N such steps, and the first N steps in which an
allocation failed (an OOM_TRIGGER row: a program that catches the OOM and goes on keeps what led
to it, and every block its OOM rows name). Every other step is *summarised*:

- kept: every MALLOC/FREE row of a block that lives across a step boundary (allocated in an
  earlier step, or still live when the step ends) or that an OOM row of the step names, the ops
  (ATEN_START/END) that enclose a kept row or are open across the boundary, and every SYSTEM,
  MSTX, SNAPSHOT and OOM row;
- dropped: the blocks allocated and freed inside the step (their MALLOC and FREE rows), ACCESS
  and KERNEL_LAUNCH rows, the ops around nothing kept;
- one ``SYSTEM/STEP_SUMMARY`` row, with the ID of the first row dropped (so it sorts inside the
  step), says what was dropped: ``{"step", "rows", "malloc", "free", "access", "ops", "other",
  "bytes_dropped", "used_range": {"<device>/<pool>": [min, max]}}`` (``used_range``: the least and
  most bytes in use in the pool at any row of the step, dropped rows included; ``used_end``: the
  bytes in use at the pool's last row of the step, dropped or kept; ``total_max``:
  the most bytes reserved; ``step``: the
  reader's step, 1 + STEP rows before it).

What this keeps true: the dropped blocks are born and die inside their step, so the running sum
of kept MALLOC minus FREE sizes is still ``used`` on every row of a full step and at every step
end; inside a summarised step ``used`` is the true value, at least the running sum (the dropped
blocks live at that moment). Every FREE still has its MALLOC; IDs stay unique and increasing (with
gaps). The leak analyses judge blocks that outlive a step, and every such block is kept, with its
stack and the op around it, so their findings and sites are those of the full dump; fluctuation
uses the summary's ``used_range``. Analyses of whole steps (compare, inefficient, decompose, the
report's per-op views) are exact on the full steps; on a summarised one they see its kept rows.

Steps are held back (in the writer, as raw rows) until N more steps have ended; so ``stop()``
and the end of the run write what is held in full, and a writer killed by SIGKILL loses the held
steps (a traced program killed is not: the writer process outlives it). A step longer than
``MAX_HELD_ROWS`` is written in full as it comes, so the writer's memory stays bounded.
"""
from __future__ import annotations

from collections import deque

from ..events import Oom, System

MAX_HELD_ROWS = 1_000_000
_KEPT_ALWAYS = ("SYSTEM", "MSTX", "SNAPSHOT", "OOM_DETAIL")
_DROPPED_IN_SUMMARY = ("ACCESS", "KERNEL_LAUNCH")
CACHED_SEGMENTS = "HAL"  # the allocator's segments: not what leaks (analysis/leaks.py)


def _alloc(row):
    a = row[7]
    if type(a) is tuple:
        return a[0], a[2], a[3]
    a = a or {}
    return a.get("allocation_id"), a.get("size"), a.get("used")


def _total(row):
    a = row[7]
    if type(a) is tuple:
        return a[4] if len(a) > 4 else None
    return (a or {}).get("total")


class _Step:
    __slots__ = ("index", "rows", "ids", "c_syms", "mallocs", "transient", "full", "written", "named")

    def __init__(self, index):
        self.index = index
        self.rows: list = []
        self.ids: list = []
        self.c_syms: dict = {}      # index in rows -> C stack text
        self.mallocs: dict = {}     # key -> (index in rows, site) of blocks made here, live now
        self.transient: list = []   # indices of MALLOC/FREE rows of blocks born and dead here
        self.full = False           # written whole (a flagged step, or one too long to hold)
        self.written = 0            # rows already written (a step too long to hold)
        self.named: set = set()     # allocation ids the step's OOM rows name (live at a failure)


class BoundedWriter:
    """Wraps a dump writer (CsvWriter, ZstdCsvWriter, DbWriter): rows in, the bounded dump out."""

    def __init__(self, inner, keep_steps: int, max_held_rows: int = MAX_HELD_ROWS):
        self.inner = inner
        self.path = inner.path
        self.suffix = inner.suffix
        self.keep = max(1, int(keep_steps))
        self.max_held = max_held_rows
        self.held: deque = deque()      # ended steps not yet written, oldest first
        self.open = _Step(1)
        self.held_rows = 0
        self.pid = 0
        self.prev = None                # the last ended step and its blocks still live
        self.prev_left: dict = {}
        self.sites_seen: set = set()
        self.flagged = 0
        self.oom_steps = 0              # steps kept whole for an allocation failure in them
        self.summarised = 0

    # ------------------------------------------------------------------ rows in
    def write(self, rows, first, pid, c_syms=None, ids=None) -> None:
        self.pid = pid
        c_syms = c_syms or {}
        for n, r in enumerate(rows):
            st = self.open
            i = len(st.rows)
            st.rows.append(r)
            st.ids.append(first + n if ids is None else ids[n])
            if n in c_syms:
                st.c_syms[i] = c_syms[n]
            ev = r[0]
            if ev == "MALLOC":
                aid = _alloc(r)[0]
                st.mallocs[(r[5], r[1], aid)] = (i, (r[5], r[1], r[2], r[8]))
            elif ev == "FREE":
                key = (r[5], r[1], _alloc(r)[0])
                m = st.mallocs.pop(key, None)
                if m is not None:
                    st.transient.append(m[0])
                    st.transient.append(i)
                else:
                    self.prev_left.pop(key, None)
            elif ev == "SYSTEM" and r[1] == System.STEP:
                self._end_step()
            elif ev == "OOM_DETAIL":
                if r[1] == Oom.TRIGGER:
                    if not st.full and self.oom_steps < self.keep:
                        st.full = True
                        self.oom_steps += 1
                elif type(r[7]) is dict and r[7].get("allocation_id") is not None:
                    st.named.add(r[7]["allocation_id"])
        self.held_rows += len(rows)
        self._evict()

    def _end_step(self):
        st = self.open
        prev = self.prev
        if prev is not None and self.prev_left and prev.index >= 2:
            sites = {s for s in self.prev_left.values() if s[1] != CACHED_SEGMENTS}
            if not prev.full and sites - self.sites_seen and self.flagged < self.keep:
                prev.full = True
                self.flagged += 1
            self.sites_seen |= sites  # a step kept whole for another reason shows them too
        self.prev = st
        self.prev_left = {k: v[1] for k, v in st.mallocs.items()}
        self.held.append(st)
        self.open = _Step(st.index + 1)
        self.open.mallocs = {}

    def _evict(self):
        while len(self.held) > self.keep:
            self._write_step(self.held.popleft(), summarise=True)
        while self.held_rows > self.max_held and self.held:
            self._write_step(self.held.popleft(), summarise=True)
        if self.held_rows > self.max_held:  # one step longer than we hold: written as it comes
            st = self.open
            st.full = True
            self._write_rows(st, range(st.written, len(st.rows)))
            self.held_rows -= len(st.rows) - st.written
            st.written = len(st.rows)

    # ------------------------------------------------------------------ rows out
    def _write_rows(self, st, idx, extra=None):
        rows, ids, cs = st.rows, st.ids, st.c_syms
        out_rows, out_ids, out_cs = [], [], {}
        for i in idx:
            if extra is not None and extra[0] < ids[i]:
                out_rows.append(extra[1])
                out_ids.append(extra[0])
                extra = None
            if i in cs:
                out_cs[len(out_rows)] = cs[i]
            out_rows.append(rows[i])
            out_ids.append(ids[i])
        if extra is not None:
            out_rows.append(extra[1])
            out_ids.append(extra[0])
        if out_rows:
            self.inner.write(out_rows, out_ids[0], self.pid, out_cs or None, out_ids)

    def _write_step(self, st, summarise):
        n = len(st.rows)
        self.held_rows -= n - st.written
        if st is self.prev:
            self.prev, self.prev_left = None, {}
        if not summarise or st.full or st.written:
            self._write_rows(st, range(st.written, n))
            return
        keep = self._kept(st)
        dropped = [i for i in range(n) if not keep[i]]
        if not dropped:
            self._write_rows(st, range(n))
            return
        self.summarised += 1
        self._write_rows(st, (i for i in range(n) if keep[i]),
                         (st.ids[dropped[0]], self._summary_row(st, dropped)))

    def _kept(self, st) -> list:
        rows = st.rows
        keep = [True] * len(rows)
        named = st.named
        for i in st.transient:
            if not named or _alloc(rows[i])[0] not in named:
                keep[i] = False
        stacks: dict = {}   # tid -> [[index of ATEN_START, encloses a kept row]]
        for i, r in enumerate(rows):
            ev = r[0]
            if ev == "OP_LAUNCH":
                stk = stacks.get(r[4])
                if r[1] == "ATEN_START":
                    if stk is None:
                        stk = stacks[r[4]] = []
                    stk.append([i, False])
                    keep[i] = False  # until a kept row inside it is seen
                elif stk and rows[stk[-1][0]][2] == r[2]:
                    j, used = stk.pop()
                    keep[i] = keep[j] = used
                    if used and stk:
                        stk[-1][1] = True
                # an ATEN_END whose start is in an earlier step stays
            elif ev in _DROPPED_IN_SUMMARY:
                keep[i] = False
            elif keep[i]:
                stk = stacks.get(r[4])
                if stk:
                    stk[-1][1] = True
        for stk in stacks.values():  # open across the step end: kept with what they enclose
            for e in stk:
                keep[e[0]] = True
        return keep

    def _summary_row(self, st, dropped):
        rows = st.rows
        counts = {"malloc": 0, "free": 0, "access": 0, "ops": 0, "other": 0}
        nbytes = 0
        for i in dropped:
            ev = rows[i][0]
            if ev == "MALLOC":
                counts["malloc"] += 1
                nbytes += _alloc(rows[i])[1] or 0
            elif ev == "FREE":
                counts["free"] += 1
            elif ev == "ACCESS":
                counts["access"] += 1
            elif ev == "OP_LAUNCH":
                counts["ops"] += 1
            else:
                counts["other"] += 1
        used: dict = {}
        total: dict = {}
        last: dict = {}
        for r in rows:
            if r[0] == "MALLOC" or r[0] == "FREE":
                u = _alloc(r)[2]
                t = _total(r)
                k = f"{r[5]}/{r[1]}"
                if type(t) is int and t > total.get(k, -1):
                    total[k] = t
                if u is None:
                    continue
                last[k] = u
                mm = used.get(k)
                if mm is None:
                    used[k] = [u, u]
                elif u < mm[0]:
                    mm[0] = u
                elif u > mm[1]:
                    mm[1] = u
        first = rows[dropped[0]]
        # used_end: each pool's ``used`` at its last row of the step, which may be a dropped one: the
        # level the next step starts from (the last kept row's ``used`` can count a dropped block
        # still live then, and fluctuation would start the next step from there)
        attr = {"step": st.index, "rows": len(dropped), **counts, "bytes_dropped": nbytes, "used_range": used,
                "used_end": last, "total_max": total}
        return ("SYSTEM", System.STEP_SUMMARY, "N/A", first[3], first[4], first[5], None, attr, None, None)

    # ------------------------------------------------------------------ ending
    def flush_held(self) -> None:
        """Write every step held, in full (``stop()``, the end of the run)."""
        while self.held:
            self._write_step(self.held.popleft(), summarise=False)
        st = self.open
        self._write_step(st, summarise=False)
        self.open = _Step(st.index)
        self.held_rows = 0

    def last_id(self) -> int:
        return self.inner.last_id()

    def close(self) -> None:
        try:
            self.flush_held()
        finally:
            self.inner.close()


def rewrite(src: str, dst: str, keep_steps: int, compress: str = "none", data_format: str = "csv",
            max_held_rows: int = MAX_HELD_ROWS) -> str:
    """The bounded form of the CSV dump ``src`` (plain or .csv.zst), written to the new file
    ``dst`` (its suffix chosen by ``compress``): what ``--keep-steps`` would have written for the
    same rows. Streams the file. Returns the path written."""
    import csv
    import io as _io
    import json
    from .reader import open_text
    from .writers import open_writer
    base = dst
    for ext in (".csv.zst", ".csv", ".db"):
        if base.endswith(ext):
            base = base[:-len(ext)]
            break
    out = BoundedWriter(open_writer(data_format, base, compress), keep_steps, max_held_rows)
    with open_text(src) as f:
        text = _io.TextIOWrapper(f, encoding="utf-8", newline="")
        reader = csv.reader(text)
        next(reader)  # the header
        batch, ids, c_syms, pid = [], [], {}, 0
        for fields in reader:
            rid, ev, et, name, ts, pid, tid, dev, ptr, attr, ps, cs = fields
            a = json.loads(attr) if attr else None
            batch.append((ev, et, name, int(ts), int(tid), dev, None if ptr in ("N/A", "") else int(ptr, 16),
                          a, ps or None, None))
            ids.append(int(rid))
            if cs:
                c_syms[len(batch) - 1] = cs
            if len(batch) >= 65536:
                out.write(batch, ids[0], int(pid), c_syms, ids)
                batch, ids, c_syms = [], [], {}
        if batch:
            out.write(batch, ids[0], int(pid), c_syms, ids)
    out.close()
    return out.path


# ------------------------------------------------------------------ reading a bounded dump's summaries
def summaries(df) -> list[tuple[int, dict]]:
    """A bounded dump's ``STEP_SUMMARY`` rows as (step, Attr object), in dump order, from a reader
    frame whose ``attr`` column holds their text (none without that column or without such rows).
    The step is the row's ``step`` (the reader's, 1 + STEP rows before it), else its Attr's."""
    import polars as pl
    from .validate import attr_object
    if "attr" not in df.columns or "event_type" not in df.columns:
        return []
    cols = ["attr"] + (["step"] if "step" in df.columns else [])
    rows = df.filter(pl.col("event_type") == System.STEP_SUMMARY).select(cols)
    out = []
    for r in rows.iter_rows():
        a = attr_object(r[0])
        step = r[1] if len(r) > 1 and type(r[1]) is int else a.get("step")
        if type(step) is int:
            out.append((step, a))
    return out


def summarised_steps(df) -> list[int]:
    """The steps of a bounded dump kept in summary (its STEP_SUMMARY rows' steps), in order."""
    return sorted({s for s, _ in summaries(df)})


def _pool_values(obj, pick):
    """(device, pool, value) of a summary's per-pool map ``{"<device>/<pool>": v}``, ``pick(v)`` an
    int or None."""
    for k, v in (obj.items() if isinstance(obj, dict) else ()):
        dev, _, pool = str(k).rpartition("/")
        n = pick(v)
        if type(n) is int:
            yield dev, pool, n


def step_peaks(df, mem=None):
    """Per (step, device, pool) the peak of bytes in use (``peak``) and of bytes reserved
    (``reserved``), null where no row says, over every row of the step: the most ``used`` / ``total``
    of its MALLOC and FREE rows and, for a summarised step of a bounded dump, its STEP_SUMMARY
    row's ``used_range`` maximum and ``total_max`` (the step's rows the writer dropped included);
    ``summarised``: the step is one. THE peak per step of every reader (the run's exit summary,
    ``show``, ``summary``, the HTML report, ``decompose --by=module``'s choice of step).

    ``df``: a reader frame (its STEP_SUMMARY rows with their ``attr`` text, where the dump has them);
    ``mem``: its MALLOC/FREE rows with ``used`` filled in where the caller fills it (default: those of
    ``df``, a missing ``used`` as the running sum of sizes per device and pool). Columns: step, device,
    event_type, peak, reserved, summarised; sorted by step, device, event_type."""
    import polars as pl
    if mem is None:
        mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
        if mem.height and mem["used"].null_count():
            delta = pl.when(pl.col("event") == "MALLOC").then(pl.col("size")).otherwise(-pl.col("size"))
            mem = (mem.sort("id").with_columns(_run=delta.fill_null(0).cum_sum().over("device", "event_type"))
                   .with_columns(used=pl.coalesce("used", "_run")).drop("_run"))
    schema = {"step": pl.Int64, "device": pl.String, "event_type": pl.String, "peak": pl.Int64,
              "reserved": pl.Int64}
    total = pl.col("total") if "total" in mem.columns else pl.lit(None)
    rows = (mem
            .select(pl.col("step").cast(pl.Int64), pl.col("device").cast(pl.String),
                    pl.col("event_type").cast(pl.String), peak=pl.col("used").cast(pl.Int64),
                    reserved=total.cast(pl.Int64)))
    sums = summaries(df)
    extra = []
    for step, a in sums:
        rsv = {(d, p): n for d, p, n in _pool_values(a.get("total_max"), lambda v: v)}
        used = {(d, p): n for d, p, n in _pool_values(
            a.get("used_range"), lambda v: v[1] if isinstance(v, list) and len(v) == 2 else None)}
        for k in used.keys() | rsv.keys():
            extra.append((step, k[0], k[1], used.get(k), rsv.get(k)))
    if extra:
        rows = pl.concat([rows, pl.DataFrame(extra, schema=schema, orient="row")])
    summ = sorted({s for s, _ in sums})
    return (rows.group_by("step", "device", "event_type")
            .agg(pl.col("peak").max(), pl.col("reserved").max())
            .with_columns(summarised=pl.col("step").is_in(summ))
            .sort("step", "device", "event_type"))


def peaks(df, mem=None) -> list[dict]:
    """Per (device, pool), from ``step_peaks``: the run's peak of bytes in use (``peak``), the first
    step that reached it (``step``) and whether that step is summarised (``summarised``: the rows
    at the peak were dropped), and the peak of bytes reserved (``reserved``, None where no row says)."""
    per = step_peaks(df, mem)
    out = {}
    for step, dev, pool, peak, rsv, summ in per.iter_rows():
        p = out.get((dev, pool))
        if p is None:
            p = out[(dev, pool)] = {"device": dev, "pool": pool, "peak": peak, "step": step,
                                    "summarised": summ, "reserved": rsv}
            continue
        if peak is not None and (p["peak"] is None or peak > p["peak"]):
            p.update(peak=peak, step=step, summarised=summ)
        if rsv is not None and (p["reserved"] is None or rsv > p["reserved"]):
            p["reserved"] = rsv
    return [out[k] for k in sorted(out)]


def kept_whole(df) -> str:
    """The steps of a bounded dump kept whole (every row), as ranges: ``"1-3, 7, 12-13"``."""
    import polars as pl
    summ = set(summarised_steps(df))
    last = int(df.select(pl.col("step").max()).item() or 1) if "step" in df.columns else 1
    whole = [s for s in range(1, last + 1) if s not in summ]
    parts, i = [], 0
    while i < len(whole):
        j = i
        while j + 1 < len(whole) and whole[j + 1] == whole[j] + 1:
            j += 1
        parts.append(str(whole[i]) if i == j else f"{whole[i]}-{whole[j]}")
        i = j + 1
    return ", ".join(parts) or "none"
