"""Leaks and memory fluctuation (SPEC §4.1 online, §4.2 offline). docs/leaks.md has the rules.

Growth by site (``growth.py``): live bytes per allocation site at every step end; a site whose
live bytes keep rising (>= 3 rises, one noisy step end skipped, ending at a new high) is a leak,
whether it keeps its blocks or re-makes a bigger one each step.

Block rule (the original's): a block allocated in step ``s >= 2`` that is still live when step
``s + 1`` ends has outlived one full step. It is a leak when its site is growing, else
"retained" (a cache, optimizer state, a window). Blocks of step 1 are never findings.

Fluctuation: per (device, pool) and per ended step from step 2 on, the smallest and largest
``used`` within the step (the level carried into the step counts as a value of the step); the
ratio min/max is printed for the steps with the smallest (MinGap) and largest (MaxGap) ratio.

Mark rule (offline, ``check_leaks``): marks A, B, C are the Mark rows whose message equals
``mstx_info``, from ``start_index`` on, in ID order. A block allocated between A and B and not
freed before C is a leak.

One implementation: ``StepLeakTracker`` consumes raw rows; the online sink feeds it each flush,
``replay(df)`` feeds it a dump's rows (``check-leaks`` without marks). ``step_leaks`` and
``fluctuation`` are the block rule and the gap table vectorized with polars over the reader's
columns (the run summary uses them; the tests hold them equal to the tracker's).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

log = logging.getLogger("msmemscope")

MB = 1048576.0
# The caching allocator's segments (the allocator-trace source's HAL rows): memory it keeps cached
# for reuse is no leak; the blocks inside them (pool PTA) are judged instead.
CACHED_SEGMENTS = "HAL"
POOL_TITLES = {
    "PTA": "Pytorch Caching memory pool",
    "PTA_WORKSPACE": "Pytorch workspace memory pool",
    "HAL": "HAL memory pool",
    "HOST": "Host memory pool",
    "HOST_PINNED": "Host pinned memory pool",
}


class MarkError(ValueError):
    """The marks needed by the A/B/C rule are missing (message says which, and how many were found)."""


class SummarisedMarksError(MarkError):
    """The marks A to C fall in summarised steps of a bounded dump (``--keep-steps``): the blocks
    born and freed inside those steps were dropped, so the A/B/C rule cannot be judged there."""


def pool_title(pool) -> str:
    return POOL_TITLES.get(pool, f"{pool} memory pool")


def short_op(name) -> str:
    if not name or name == "N/A":
        return "an unknown op"
    return name[len("torch._ops."):] if name.startswith("torch._ops.") else name


def hex_addr(addr) -> str:
    return "0x%x" % addr if addr is not None else "N/A"


from ..frames import user_line as _user_line  # noqa: E402
from .growth import MIN_RISES, SiteGrowth, fmt_bytes  # noqa: E402
from ..events import (A_ADDR, A_ALLOC_ID, A_OWNER, A_SIZE, A_USED, ATTR, DEVICE, EVENT, EVENT_TYPE,  # noqa: E402
                      NAME, PACKED_LEAK, PY_STACK, TID, Event, PackedRows, System, free_ids)


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
        title = "Pytorch CPU allocator" if str(dev) == "cpu" and pool == "PTA" else pool_title(pool)
        lines.append(f"======= {title} Gap Analysis of Device {dev} =======")
        lines.append(f"        {'MinAlloc/MaxAlloc(%)':<25}{'MinAllocMem(MB)':<25}StepId")
        for label, r in (("MinGap", lo), ("MaxGap", hi)):
            lines.append(f"{label:<8}{ratio(r) * 100:<25.4f}{r[1] / MB:<25.4f}{r[0]}")
    if lines:
        lines.append("(per step: the least memory in use as a % of the most; MinGap is the step where memory "
                     "swings most, MaxGap where it stays most; a MinAllocMem that grows step after step "
                     "is memory that is never given back)")
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


# ---------------------------------------------------------------------------- the tracker (online and offline)
MAX_BLOCKS = 50     # block findings kept per site (the counts cover all of them)
FLUCT_STEPS = 1024  # steps whose fluctuation the tracker keeps (plus the extreme ones: issue 21)
_STACK_CACHE = 4096


FIRST_SIGHT = "before_op"  # Attr origin of a MALLOC row that is a block's first sight, not its allocation


class StepLeakTracker:
    """The block rule, growth by site (``growth.SiteGrowth``) and fluctuation over a stream of
    raw rows in ID order: the online sink feeds it each flush, the offline check replays a dump's
    rows through it. Per MALLOC/FREE row it does a few dict operations; per step end, one pass
    over the sites. A suspect of the block rule is a tuple until it is judged."""

    def __init__(self):
        self.step = 1
        # (device, pool, alloc_id) -> (step, row_id, addr, size, op, py_stack) for the live blocks
        # of steps >= 2 not yet judged (at most those of the last two steps)
        self.pending: dict = {}
        self.reported: dict = {}     # key -> stored block record (to note a later free)
        self.level: dict = {}        # (device, pool) -> used after the last event
        self.fluct: dict = {}        # (device, pool) -> {step: [min, max]}, the last FLUCT_STEPS steps
        self.gaps: dict = {}         # (device, pool) -> {step: (min, max)} of the extreme steps dropped
        self.growth = SiteGrowth()
        self._sites, self._blocks = self.growth.sites, self.growth.blocks
        self.steps_ended = 0
        self.hits = 0                # blocks found by the block rule (the sites' hits summed)
        self.labels: dict = {}       # tid -> the label of its allocations (innermost range, else last mark)
        self._ranges: dict = {}      # tid -> [(range_id, message)] open ranges
        self._marks: dict = {}       # tid -> last mark message
        self._lines: dict = {}       # Python stack text -> the user's line
        self._level_at_end = None    # a summarised step's pools' last ``used`` (its STEP_SUMMARY row)
        # blocks whose MALLOC row is their first sight (Attr origin "before_op": made before the
        # traced window, or in a stop/start gap, and first met as an op's input): not allocated in
        # the step of that row, so never a finding of the block rule (the model's parameters were
        # leaks of the window's first step with --steps)
        self.first_sight: set = set()
        # online: the allocation ids the tracer knows to be live (a FREE that was not recorded,
        # --steps or a stop/start gap, must not make a finding); asked once per step end with suspects
        self.live_ids = None
        # the C++ row loop (msmemscope/_leakrule.cpp ``leak_rows``), set by use_native where the
        # module is built; None: every row goes through the Python loop
        self.fast_rows = None
        self.native = None  # that module (its column loop: consume_columns)

    def use_native(self, mod):
        """The native module's row loop, and its tables for the live and the pending blocks (the
        same (device, pool, alloc_id) keys and tuples as the dicts; put and taken in C++ by that
        loop with no Python object per row). Before the first row only."""
        if self._blocks or self.pending:
            raise RuntimeError("use_native: the tracker has seen rows")
        self.growth.blocks = self._blocks = mod.KeyTable(2)
        self.pending = mod.KeyTable(6)
        self.fast_rows = mod.leak_rows
        self.native = mod

    def consume_columns(self, cols, n, made):
        """``consume`` of ``n`` rows given as columns (``leak_columns``' and ``replay_rows``' form:
        the MALLOC/FREE rows among them taken in C++ with no row tuple; with ``use_native`` only).
        ``made``: {index: row tuple} of the other rows (STEP, MSTX, summaries: a few a step). A row
        the C++ loop does not take (a new site or stack line, a pool's first row in a step, the
        other rows) is made alone and given to the Python loop, the step's min/max kept between."""
        m = self.native
        consts = (Event.MALLOC, Event.FREE)
        cur: dict = {}
        at = 0
        while at < n:
            at = m.leak_columns(cols, at, n, self.step, *self.native_args(cur))
            if at >= n:
                break
            rows, ids, others = m.replay_rows(cols, at, at + 1, consts)
            if others:
                rows[0] = made[at]
            self.consume(rows, 0, ids, cur=cur)
            at += 1

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

    def _line(self, stack):
        line = self._lines.get(stack, False)
        if line is False:
            if len(self._lines) >= _STACK_CACHE:
                self._lines.clear()
            line = self._lines[stack] = _user_line(stack)
        return line

    def malloc(self, row_id, device, pool, alloc_id, addr, size, used, op, py_stack=None, tid=None, owner=None,
               origin=None):
        self._used((device, pool), used)
        if pool == CACHED_SEGMENTS:
            return
        if origin == FIRST_SIGHT:
            self.first_sight.add((device, pool, alloc_id))
        python = self._line(py_stack) if py_stack else None
        label = None
        if python is None:
            if owner and owner.count("@") >= 2:  # <pool>@<category>@<labels...>: describe labels
                label = owner.split("@", 2)[2]
            else:
                label = self.labels.get(tid)
        key = (device, pool, alloc_id)
        site = self._sites.get((device, pool, op, python, label))
        if site is None:
            site = self.growth.site(device, pool, op, python, label)
        size = size or 0
        site.live += size
        site.last_aid = alloc_id
        self._blocks[key] = (site, size)
        s = self.step
        if s >= 2:
            self.pending[key] = (s, row_id, addr, size, op, py_stack)

    def free(self, device, pool, alloc_id, used):
        self._used((device, pool), used)
        key = (device, pool, alloc_id)
        v = self._blocks.pop(key, None)
        if v is not None:
            site = v[0]
            site.live -= v[1]
            if site.last_aid == alloc_id:
                site.last_aid = None
        if self.pending.pop(key, None) is None and self.reported:
            rec = self.reported.pop(key, None)
            if rec is not None:
                rec["freed_at_step"] = self.step

    def mstx(self, kind, tid, msg, attr):
        if kind == "Mark":
            self._marks[tid] = msg
        elif kind == "Range_start":
            if msg != "step start":  # the step ranges say when a step ends, not what a block is for
                self._ranges.setdefault(tid, []).append((_range_id(attr), msg))
        elif kind == "Range_end":
            rid = _range_id(attr)
            for t in (tid, *self._ranges):
                opened = self._ranges.get(t)
                hit = [i for i, (r, _) in enumerate(opened or ()) if r == rid]
                if hit:
                    del opened[hit[-1]]
                    self._label(t)
                    break
        self._label(tid)

    def _label(self, tid):
        opened = self._ranges.get(tid)
        label = opened[-1][1] if opened else self._marks.get(tid)
        if label:
            self.labels[tid] = label
        else:
            self.labels.pop(tid, None)

    def end_step(self, n) -> list:
        """Step ``n`` ended: blocks of steps <= n-1 still live have outlived a full step; then the
        growth rule per site. Returns the block findings of this step end."""
        new = []
        live = None
        blocks = self.growth.blocks
        first_sight = self.first_sight
        for key, (s, row_id, addr, size, op, stack) in _take_due(self.pending, n - 1):
            device, pool, alloc_id = key
            if first_sight and key in first_sight:
                first_sight.discard(key)
                continue
            if self.live_ids is not None:
                if live is None:
                    live = self.live_ids()
                if alloc_id not in live:
                    continue
            site = blocks[key][0]
            site.hits += 1
            self.hits += 1
            site.hit_bytes += size or 0
            rec = {"device": str(device), "pool": pool, "addr": addr, "size": size, "step": s, "op": op,
                   "alloc_id": alloc_id, "id": row_id, "detected_at_step": n, "python": site.python,
                   "address": hex_addr(addr)}
            if site.label:
                rec["label"] = site.label
            if len(site.blocks) < MAX_BLOCKS:
                site.blocks.append(rec)
                self.reported[key] = rec
            new.append(rec)
        self.growth.end_step(n)
        self.steps_ended += 1
        self.step = n + 1
        if self._level_at_end:  # a summarised step ended: the next starts from its true last level
            self.level.update(self._level_at_end)
            self._level_at_end = None
        self._bound_fluct()
        return new

    def native_args(self, cur: dict) -> tuple:
        """``(consts, state)`` as the C++ row loops take them (``leak_rows``, ``leak_columns``);
        ``cur``: the step's lowest and highest ``used`` by pool, as the loops keep it."""
        return ((Event.OP_LAUNCH, Event.ACCESS, Event.MALLOC, Event.FREE, CACHED_SEGMENTS, "live", "last_aid",
                 "freed_at_step"),
                (self._sites, self._blocks, self.pending, self.level, cur, self._lines, self.labels, self.reported))

    def consume(self, rows, first_id, ids=None, cur=None):
        """Raw rows (``events`` field order) with IDs ``first_id, first_id + 1, ...`` (or ``ids``).
        Returns the block findings of the step ends among them. ``cur``: the step's lowest and
        highest ``used`` by pool, kept by a caller that takes rows in C++ between its calls (the
        offline replay's ``leak_columns``); a new one by default.

        The hot loop of the online leak analysis (every MALLOC/FREE row of a run): ``malloc`` and
        ``free`` inlined for the tuple attrs the sources make, with the step's state in locals
        (refreshed at each STEP row); dict attrs and every other event take the general path."""
        found = []
        MALLOC, FREE, MSTX, SYSTEM, STEP = Event.MALLOC, Event.FREE, Event.MSTX, Event.SYSTEM, System.STEP
        OP_LAUNCH, ACCESS = Event.OP_LAUNCH, Event.ACCESS
        sites, blocks, pending, level, fluct = self._sites, self._blocks, self.pending, self.level, self.fluct
        new_site = self.growth.site
        line_of, lines, labels = self._line, self._lines, self.labels
        step = self.step
        if cur is None:
            cur = {}  # (device, pool) -> [min, max] of ``used`` in this step (step >= 2)
        fast = self.fast_rows if type(rows) is list and (ids is None or type(ids) is list) else None
        first = first_id if ids is None else ids  # the row IDs as the C++ loop takes them
        if fast is not None:
            consts, state = self.native_args(cur)
        count = len(rows)
        at = 0
        while at < count:
            if fast is not None:
                # the rows this loop would take the inlined path for, in C++; it stops at the first
                # other row, which goes through the loop below, alone
                at = fast(rows, at, first, step, consts, state)
                if at >= count:
                    break
                end = at + 1
            else:
                end = count
            for i in range(at, end):
                r = rows[i]
                ev = r[EVENT]
                if ev == OP_LAUNCH or ev == ACCESS:  # most rows: nothing to do
                    continue
                a = r[ATTR]
                is_malloc = ev == MALLOC and type(a) is tuple and r[EVENT_TYPE] != CACHED_SEGMENTS
                if is_malloc or (ev == FREE and type(a) is tuple):
                    # the step's lowest and highest ``used`` (fluctuation), then the block's site
                    device, pool, used = r[DEVICE], r[EVENT_TYPE], a[A_USED]
                    pk = (device, pool)
                    if step >= 2:
                        mm = cur.get(pk)
                        if mm is None:
                            self._used(pk, used)
                            mm = cur[pk] = fluct[pk][step]
                        elif used < mm[0]:
                            mm[0] = used
                        elif used > mm[1]:
                            mm[1] = used
                    level[pk] = used
                if is_malloc:
                    stack = r[PY_STACK]
                    python = (lines[stack] if stack in lines else line_of(stack)) if stack else None
                    label = None
                    if python is None:
                        owner = a[A_OWNER] if len(a) > A_OWNER else None
                        if owner and owner.count("@") >= 2:  # <pool>@<category>@<labels...>: describe labels
                            label = owner.split("@", 2)[2]
                        else:
                            label = labels.get(r[TID])
                    op, aid, size = r[NAME], a[A_ALLOC_ID], a[A_SIZE] or 0
                    site = sites.get((device, pool, op, python, label))
                    if site is None:
                        site = new_site(device, pool, op, python, label)
                    site.live += size
                    site.last_aid = aid
                    key = (device, pool, aid)
                    blocks[key] = (site, size)
                    if step >= 2:
                        pending[key] = (step, first_id + i if ids is None else ids[i], a[A_ADDR], size, op, stack)
                elif ev == FREE and type(a) is tuple:
                    aid = a[A_ALLOC_ID]
                    key = (device, pool, aid)
                    v = blocks.pop(key, None)
                    if v is not None:
                        site = v[0]
                        site.live -= v[1]
                        if site.last_aid == aid:
                            site.last_aid = None
                    if pending.pop(key, None) is None and self.reported:
                        rec = self.reported.pop(key, None)
                        if rec is not None:
                            rec["freed_at_step"] = step
                elif ev == MALLOC:
                    if type(a) is tuple:  # the cached segments' pool
                        self.malloc(first_id + i if ids is None else ids[i], r[DEVICE], r[EVENT_TYPE], a[A_ALLOC_ID],
                                    a[A_ADDR], a[A_SIZE], a[A_USED], r[NAME], r[PY_STACK], r[TID],
                                    a[A_OWNER] if len(a) > A_OWNER else None)
                    else:
                        a = a or {}
                        self.malloc(first_id + i if ids is None else ids[i], r[DEVICE], r[EVENT_TYPE],
                                    a.get("allocation_id"), a.get("addr"), a.get("size"), a.get("used"), r[NAME],
                                    r[PY_STACK], r[TID], a.get("owner"), a.get("origin"))
                    cur.clear()
                elif ev == FREE:
                    a = a or {}
                    self.free(r[DEVICE], r[EVENT_TYPE], a.get("allocation_id"), a.get("used"))
                    cur.clear()
                elif ev == MSTX:
                    self.mstx(r[EVENT_TYPE], r[TID], r[NAME], a)
                elif ev == SYSTEM and r[EVENT_TYPE] == STEP:
                    a = a or {}
                    n = a.get("step", self.step) if isinstance(a, dict) else self.step
                    found.extend(self.end_step(n))
                    step = self.step
                    fluct = self.fluct  # _bound_fluct may have replaced it
                    cur.clear()
                elif ev == SYSTEM and r[EVENT_TYPE] == System.STEP_SUMMARY:
                    self.summary(a)
                    fluct = self.fluct
                    cur.clear()
            at = end
        return found

    def summary(self, attr):
        """A bounded dump's summarised step (io/bounded.py): the least and most ``used`` of each
        pool over the step's rows, dropped ones included, count for fluctuation; the pool's ``used``
        at the step's last row (``used_end``) is its level when the step ends (``end_step``)."""
        if not isinstance(attr, dict):
            return
        rng = attr.get("used_range")
        if isinstance(rng, dict):
            for k, v in rng.items():
                dev, _, pool = str(k).rpartition("/")
                if isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v):
                    self._used((dev, pool), v[0])
                    self._used((dev, pool), v[1])
        end = attr.get("used_end")
        if isinstance(end, dict):
            self._level_at_end = {tuple(str(k).rpartition("/")[::2]): v for k, v in end.items() if type(v) is int}

    # ------------------------------------------------------------------ results
    def results(self, judged=True) -> dict:
        """sites (growing), leaks (block findings of growing sites), retained (the others).
        ``judged=False`` (some steps not recorded): growth is not judged, the block findings
        are all leaks, as in the original's rule."""
        growing = self.growth.growing() if judged else []
        grow_ids = {id(s) for s in growing}
        hit_sites = [s for s in self.growth.sites.values() if s.hits]
        leaks, retained = [], []
        for s in hit_sites:
            (leaks if (id(s) in grow_ids or not judged) else retained).extend(s.blocks)
        leaks.sort(key=lambda r: r["id"])
        retained.sort(key=lambda r: r["id"])
        return {"growing": growing, "leaks": leaks, "retained": retained,
                "leak_sites": [s for s in hit_sites if id(s) in grow_ids or not judged],
                "retained_sites": [s for s in hit_sites if judged and id(s) not in grow_ids]}

    def _bound_fluct(self):
        """Keep the per-step fluctuation of the last FLUCT_STEPS steps only (it grew by ~180 B a step
        for ever, issue 21), and of the steps with the extreme ratios among those dropped, so that
        MinGap/MaxGap stay those of the whole run."""
        for pk, steps in self.fluct.items():
            if len(steps) <= FLUCT_STEPS:
                continue
            keep = self.gaps.setdefault(pk, {})
            while len(steps) > FLUCT_STEPS:
                s = next(iter(steps))
                mn, mx = steps.pop(s)
                if mx and mx > 0:
                    keep[s] = (mn, mx)
            if len(keep) > 2:  # only the lowest and the highest ratio (earliest on a tie) matter
                rows = sorted(keep.items())
                lo = min(rows, key=lambda r: r[1][0] / r[1][1])
                hi = max(rows, key=lambda r: r[1][0] / r[1][1])
                self.gaps[pk] = dict(sorted({lo[0]: lo[1], hi[0]: hi[1]}.items()))

    def fluctuation(self) -> dict:
        last = self.step - 1  # the rows after the last STEP row are not a full step
        return {k: {**self.gaps.get(k, {}), **{s: tuple(v) for s, v in steps.items() if s <= last}}
                for k, steps in self.fluct.items()}


def _take_due(pending, last):
    """[(key, record)] of the pending blocks of steps <= last, taken out: by step, then in
    allocation order (a native KeyTable does the same in C++)."""
    if type(pending) is not dict:
        return pending.due(last)
    due = [k for k, v in pending.items() if v[0] <= last]  # in allocation order
    due.sort(key=lambda k: pending[k][0])
    return [(k, pending.pop(k)) for k in due]


def _range_id(attr):
    if isinstance(attr, dict):
        return attr.get("range_id")
    return None


def _where(python, label) -> str:
    if python:
        head, _, func = python.partition("(")
        return f"at {os.path.basename(head)} ({func.rstrip(')')})" if func else f"at {os.path.basename(head)}"
    if label:
        return f"at '{label}'"
    return ""


_NO_LINE = " (--call-stack=python names the line)"


def _op_short(op) -> str:
    op = short_op(op)
    return op[:-len(".default")] if op.endswith(".default") else op


def site_line(site) -> str:
    """``leak: +32.0 KB/step over steps 3-10 at train.py:45 (hook) in aten.clone``"""
    v = site.verdict
    where = _where(site.python, site.label)
    return (f"leak: +{fmt_bytes(v['bytes_per_step'])}/step over steps {v['first_step']}-{v['last_step']} "
            f"{where + ' ' if where else ''}in {_op_short(site.op)}{'' if site.python else _NO_LINE}")


def retained_line(site) -> str:
    steps = sorted({b["step"] for b in site.blocks})
    when = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    n = site.hits
    where = _where(site.python, site.label)
    return (f"retained: {fmt_bytes(site.hit_bytes)} in {n} block{'s' if n != 1 else ''} from {when} "
            f"{where + ' ' if where else ''}in {_op_short(site.op)} (kept, not growing: not a leak)")


NO_STEP = ("msmemscope: no step ended in this run, so leaks were not checked: call msmemscope.step() at "
           "the end of each iteration (or open and close an mstx range named 'step start' around it; "
           "an optimizer.step() also ends a step)")


def report_lines(t: StepLeakTracker, judged=True, res=None) -> list:
    """The console report of a finished run (online at exit, offline per dump)."""
    res = t.results(judged) if res is None else res
    lines = []
    if t.steps_ended == 0:
        lines.append(NO_STEP)
    lines.extend(site_line(s) for s in res["growing"])
    if res["leaks"]:
        by_dev: dict = {}
        for lk in res["leaks"]:
            by_dev.setdefault(lk["device"], []).append(lk)
        totals: dict = {}
        for s in res["leak_sites"]:
            c = totals.setdefault(str(s.device), [0, 0])
            c[0] += s.hits
            c[1] += s.hit_bytes
        for dev, items in by_dev.items():
            lines.append(f"====== ERROR: Detected memory leaks on device {dev} ======")
            lines.extend(leak_line(lk) for lk in items)
            n, total = totals.get(dev, (len(items), sum(lk["size"] or 0 for lk in items)))
            if n > len(items):
                lines.append(f"... and {n - len(items)} more block(s) at the same site(s)")
            lines.append(f"====== SUMMARY: {total / MB:.4f} Mb(s) leaked in {n} allocation(s)"
                         + (f" on device {dev} ======" if len(by_dev) > 1 else " ======"))
    if not judged:
        lines.append("msmemscope: growth by site not judged: some steps were not recorded (--steps); "
                     "the blocks above follow the original's rule only")
    if t.steps_ended and not res["growing"] and not res["leaks"]:
        lines.append(f"no leaks found ({t.steps_ended} step{'s' if t.steps_ended != 1 else ''} checked"
                     + (")" if t.steps_ended > MIN_RISES - 1 else
                        f"; growth needs at least {MIN_RISES} step ends)"))
    lines.extend(retained_line(s) for s in res["retained_sites"])
    return lines


def result_json(t: StepLeakTracker, judged=True, res=None) -> dict:
    res = t.results(judged) if res is None else res
    summary: dict = {}
    for s in res["leak_sites"]:
        c = summary.setdefault(str(s.device), {"device": str(s.device), "count": 0, "bytes": 0})
        c["count"] += s.hits
        c["bytes"] += s.hit_bytes
    return {"analysis": "leaks",
            "rule": "blocks allocated in step s >= 2 still live at the end of step s+1",
            "site_rule": (f"live bytes of the site strictly increasing over its last step ends, at least "
                          f"{MIN_RISES} rises, one step end may be skipped, ending at a new high"),
            "growth_judged": judged,
            "steps_ended": t.steps_ended,
            "sites": [s.record() for s in res["growing"]],
            "leaks": [_leak_json(lk) for lk in res["leaks"]],
            "retained": [_leak_json(lk) for lk in res["retained"]],
            "summary": list(summary.values()),
            # per retained site, all its block findings (the lists above keep MAX_BLOCKS per site)
            "retained_sites": [{"device": str(s.device), "pool": s.pool,
                                "op": s.op if not s.label else f"{s.op}@{s.label}", "python": s.python,
                                "count": s.hits, "bytes": s.hit_bytes} for s in res["retained_sites"]],
            "fluctuation": fluct_json(t.fluctuation())}


def native_module():
    """The leak rule's C++ module (msmemscope/_leakrule.cpp: the row loop ``leak_rows`` and the block
    tables ``KeyTable``, no torch in it) where it is built, else None (the Python loop and dicts).
    Online and offline alike; ``MSMEMSCOPE_LEAK_ROWS=python`` keeps the Python loop."""
    from .. import leak_native
    return leak_native.load()


class LeakSink:
    """``--analysis=leaks``: the online sink."""

    # step boundaries may share a flush (Session._may_wait): the tracker ends each step at its STEP
    # row, and the blocks live at that end are those live now or freed later in the same rows
    batch_steps = True

    def __init__(self, session):
        self.t = StepLeakTracker()
        self.t.live_ids = self._live_ids
        m = native_module()
        if m is not None:
            self.t.use_native(m)
        # a flush's rows as columns (no row tuple made) where the C++ loop takes them
        self.takes_packed = m is not None and hasattr(m, "leak_columns")
        self.packed_columns = (PACKED_LEAK,)
        self.session = session
        self._rows = self._live = None  # the rows being consumed, the blocks live at their step ends

    def consume(self, rows, first_id):
        self._rows, self._live = rows, None
        try:
            self.t.consume(rows, first_id)
        finally:
            self._rows = self._live = None

    def consume_packed(self, packed, first_id):
        """``consume`` of a flush's ``PackedRows``: its columns through the C++ loop (``takes_packed``)."""
        self._rows, self._live = packed, None
        try:
            self.t.consume_columns(packed.cols, packed.column_rows(), packed.steps)
        finally:
            self._rows = self._live = None

    def _live_ids(self):
        """The blocks live at the step ends among the rows being consumed: those the tracer held
        when these rows were drained (freed since by another thread included), and those freed in
        these rows (later step boundaries of a shared flush). One set serves every step end of the
        flush: a block freed before a step end's STEP row has already left the suspects."""
        if self._live is not None:
            return self._live
        live = self.session.live_when_drained()
        rows = self._rows
        if rows:  # once a flush: a leaking program has suspects at every step end
            live |= rows.free_ids() if type(rows) is PackedRows else free_ids(rows)
            self._live = live
        return live

    def step_end(self, session, step):
        pass  # findings are judged at exit: a block hit is a leak only if its site keeps growing

    def findings(self, session, count_only=False):
        """The result as ``close`` would write it now, and how many findings it holds (block hits,
        growing sites): saved at step ends by analysis.StepCheckpoint."""
        # counted as they happen: summing over the sites at every step end was 1% of a small step
        count = (self.t.hits, self.t.growth.n_growing)
        if count_only:
            return "leaks", None, count
        return "leaks", result_json(self.t, not session.opts.steps), count

    def close(self, session):
        judged = not session.opts.steps
        res = self.t.results(judged)
        lines = report_lines(self.t, judged, res)
        lines.extend(gap_report(self.t.fluctuation()))
        _say(lines)
        write_result(session.folder, "leaks", result_json(self.t, judged, res))


def _leak_json(lk):
    keys = ("device", "pool", "address", "addr", "size", "step", "detected_at_step", "op", "python", "label",
            "alloc_id", "id", "freed_at_step")
    return {k: lk.get(k) for k in keys if k in lk}


def _say(lines):
    from .._console import say
    for ln in lines:
        say(ln)  # silenced by the launcher's -q; the log keeps it
        log.info("%s", ln)
    if lines:
        sys.stderr.flush()


def write_result(folder, name, result) -> str:
    from . import save_result  # replaces this process's step-end findings, never another's file
    return save_result(folder, name, result)


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


def _with_ops(df, blocks, enclosing=True):
    """Fill N/A op names of MALLOC rows (the original's dumps) with the enclosing aten op (with
    ``enclosing`` False: none)."""
    pl = _pl()
    if blocks.height == 0:
        return blocks.with_columns(op=pl.col("name"))
    missing = blocks["name"].is_null() | (blocks["name"] == "N/A")
    if not missing.any():
        return blocks.with_columns(op=pl.col("name"))
    if not enclosing:
        return blocks.with_columns(op=pl.when(missing).then(None).otherwise(pl.col("name")))
    enc = enclosing_ops(df, blocks)
    return blocks.with_columns(op=pl.when(missing).then(enc).otherwise(pl.col("name")))


def _records(df, blocks, extra=(), enclosing=True):
    blocks = _with_ops(df, blocks.sort("id"), enclosing)
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


def step_leaks(df, enclosing=True) -> list[dict]:
    """The online step rule over a dump's columns (vectorized). ``enclosing`` False: a MALLOC row
    named N/A (the original's) keeps no op, where True finds the aten op open around it."""
    pl = _pl()
    last = ended_steps(df)
    mem = _mem(df)
    m = mem.filter((pl.col("event") == "MALLOC") & (pl.col("step") >= 2) & (pl.col("step") + 1 <= last)
                   & (pl.col("event_type") != CACHED_SEGMENTS))
    if "origin" in df.columns:  # a first sight is not an allocation in its step (StepLeakTracker.first_sight)
        m = m.filter(pl.col("origin").is_null() | (pl.col("origin") != FIRST_SIGHT))
    f = mem.filter(pl.col("event") == "FREE").select(*_KEY, freed_at_step=pl.col("step"))
    # the rule on the keys only; the leaked rows' other columns gathered after (filtering every
    # column of the MALLOC rows first copied their texts: ~0.3 s at 10M events)
    hit = (m.select("id", *_KEY, "step").join(f, on=_KEY, how="left", nulls_equal=True)
           .filter(pl.col("freed_at_step").is_null() | (pl.col("freed_at_step") > pl.col("step") + 1))
           .select("id", "freed_at_step").collect())
    leaked = (df.lazy().filter(pl.col("id").is_in(hit["id"].implode()))
              .join(hit.lazy(), on="id", how="left").collect())
    recs = _records(df, leaked, extra=("step", "freed_at_step"), enclosing=enclosing)
    for r in recs:
        r["detected_at_step"] = r["step"] + 1
        if r["freed_at_step"] is None:
            del r["freed_at_step"]
    return recs


def fluctuation(df) -> dict:
    """(device, pool) -> {step: (min used, max used)} for ended steps >= 2 (vectorized)."""
    pl = _pl()
    last = ended_steps(df)
    sums = (df.lazy().filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP_SUMMARY"))
            .select("step", "attr").collect()) if "attr" in df.columns else None
    # a summarised step's pools' level at its end (its last row may be a dropped one): where the
    # next step's first row starts from, not the last kept row's ``used``
    ends = [(str(k).rpartition("/")[0], str(k).rpartition("/")[2], step, v)
            for step, text in (sums.iter_rows() if sums is not None else ())
            for k, v in ((_attr_json(text) or {}).get("used_end") or {}).items() if type(v) is int]
    q = (_mem(df).filter(pl.col("used").is_not_null()).sort("id")
         .with_columns(prev=pl.col("used").shift(1).over("device", "event_type"),
                       prev_step=pl.col("step").shift(1).over("device", "event_type")))
    if ends:
        e = pl.DataFrame(ends, schema={"device": pl.String, "event_type": pl.String, "prev_step": pl.Int64,
                                       "_end": pl.Int64}, orient="row").lazy()
        q = (q.with_columns(pl.col("device", "event_type").cast(pl.String), pl.col("prev_step").cast(pl.Int64))
             .join(e, on=["device", "event_type", "prev_step"], how="left")
             .with_columns(prev=pl.when((pl.col("prev_step") != pl.col("step")) & pl.col("_end").is_not_null())
                           .then(pl.col("_end")).otherwise(pl.col("prev"))))
    g = (q.filter((pl.col("step") >= 2) & (pl.col("step") <= last))
         .group_by("device", "event_type", "step")
         .agg(mn=pl.min_horizontal(pl.col("used").min(), pl.col("prev").min()),
              mx=pl.max_horizontal(pl.col("used").max(), pl.col("prev").max()))
         .sort("device", "event_type", "step")
         .collect())
    out: dict = {}
    for dev, pool, step, mn, mx in g.iter_rows():
        out.setdefault((dev, pool), {})[step] = (mn, mx)
    # a bounded dump's summarised steps: the range over every row of the step, dropped ones included
    for step, text in (sums.iter_rows() if sums is not None else ()):
        if step is None or not 2 <= step <= last:
            continue
        rng = (_attr_json(text) or {}).get("used_range")
        for k, v in (rng.items() if isinstance(rng, dict) else ()):
            dev, _, pool = str(k).rpartition("/")
            if not (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)):
                continue
            steps = out.setdefault((dev, pool), {})
            mn, mx = steps.get(step, (v[0], v[1]))
            steps[step] = (min(mn, v[0]), max(mx, v[1]))
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


def _summarised_between(df, a_id: int, c_id: int) -> str | None:
    """Where the rows from ID ``a_id`` to ``c_id`` lie in summarised steps of a bounded dump: the
    words for them ("summarised step 2 of this bounded dump (--keep-steps)"), else None."""
    from ..io.bounded import summarised_steps
    summ = summarised_steps(df)
    if not summ:
        return None
    pl = _pl()
    lo, hi = (df.filter(pl.col("id").is_in([a_id, c_id]))
              .select(lo=pl.col("step").min(), hi=pl.col("step").max()).row(0))
    hit = [s for s in summ if lo is not None and lo <= s <= hi]
    if not hit:
        return None
    steps = f"step {hit[0]}" if len(hit) == 1 else f"steps {', '.join(map(str, hit))}"
    return f"summarised {steps} of this bounded dump (--keep-steps)"


def check_leaks(input_path, mstx_info, start_index=0, out=None):
    """SPEC §4.2: take the Mark rows whose message equals ``mstx_info``, in ID order; A = marks[start_index],
    B and C the next two. Blocks allocated between A and B and not freed before C are leaks.

    ``input_path``: a CSV or db dump (ours or the original's) or an output folder. Prints the report
    (to ``out``, default stdout) and returns the leaked blocks as dicts: device, pool, addr, address,
    size, id, alloc_id, op, python (and dump when a folder held several dumps).
    Raises ``DumpError`` (unreadable input) or ``MarkError`` (fewer than three matching marks; its
    ``SummarisedMarksError`` where the marks fall in summarised steps of a bounded dump, whose rows
    were dropped: the check cannot tell, docs/long-runs.md). A folder of several dumps skips such a
    dump with a line saying so."""
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
    results, errors, reports, cut_off = [], [], [], 0
    for d in dumps:
        df = _read(d)
        marks = find_marks(df, str(mstx_info))
        if len(marks) < start_index + 3:
            errors.append(f"{d}: found {len(marks)} mark(s) with message '{mstx_info}'; start_index "
                          f"{start_index} needs at least {start_index + 3} (marks A, B, C)")
            continue
        a, b, c = marks[start_index:start_index + 3]
        from ..io.bounded import kept_whole
        cut = _summarised_between(df, a, c)
        if cut:
            errors.append(f"{d}: marks '{mstx_info}' A (ID {a}) to C (ID {c}) fall in {cut}; the blocks born and "
                          f"freed inside a summarised step were dropped, so the check cannot tell whether "
                          f"anything leaked (steps kept whole: {kept_whole(df)}; choose marks there, or trace "
                          f"without --keep-steps)")
            cut_off += 1
            continue
        leaks = leaks_between(df, a, b, c)
        if len(dumps) > 1:
            for lk in leaks:
                lk["dump"] = d
        results.extend(leaks)
        head = f"msmemscope: leak check of {d} between marks '{mstx_info}' A (ID {a}), B (ID {b}), C (ID {c})"
        reports.append(head)
        reports.extend(leak_report(leaks) or ["====== No memory leaks detected ======"])
    if errors and not reports:
        kind = SummarisedMarksError if cut_off == len(errors) else MarkError
        raise kind(errors[0] if len(errors) == 1 else "; ".join(errors))
    for e in errors:
        reports.append(f"msmemscope: skipped {e}")
    print("\n".join(reports), file=out)
    return results


#: what the offline leak checks read of a dump (the reader's column layer); ``owner`` for the describe
#: labels a site carries without Python stacks, as online (without it the replay merged a labelled
#: site with its op's unlabelled blocks)
COLUMNS = ("id", "event", "event_type", "name", "tid", "device", "alloc_id", "addr", "size", "used", "owner",
           "py_stack", "step", "origin")
EVENTS = ("MALLOC", "FREE", "MSTX", "OP_LAUNCH", "SYSTEM")
#: the step rule's (``replay``): no op rows (the marks' check names the enclosing op; the step rule
#: takes the op from the MALLOC row's name), half the rows of a dump with launch events
STEP_EVENTS = ("MALLOC", "FREE", "MSTX", "SYSTEM")


def with_summaries(df, path):
    """A bounded dump's ``STEP_SUMMARY`` rows given their Attr (null on the other rows), read
    apart so that a dump without them costs nothing more."""
    pl = _pl()
    if "attr" in df.columns or not (df["event_type"] == "STEP_SUMMARY").any():
        return df
    from ..io.reader import read_dump
    s = read_dump(path, columns=("event_type", "attr"), events=("SYSTEM",))
    s = s.filter(pl.col("event_type") == "STEP_SUMMARY").select("id", "attr")
    return df.join(s, on="id", how="left").sort("id")


def _read(path, events=EVENTS):
    import warnings
    from ..io.reader import read_dump
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = read_dump(path, columns=COLUMNS, events=events)
        df = with_summaries(df, path)
    for w in caught:
        print(f"msmemscope: warning: {w.message}", file=sys.stderr)
    return df


def _attr_json(text):
    if not text or text == "N/A":
        return None
    try:
        v = json.loads(text)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def replay(df) -> StepLeakTracker:
    """The online tracker run over a dump's rows (the same implementation, offline). With --steps
    too: the FREE rows of counted blocks are in the dump at every step, recorded or not (flagged
    ``untraced``), so every step end is judged as online."""
    pl = _pl()
    t = StepLeakTracker()
    m = native_module()
    if m is not None:
        t.use_native(m)  # the online sink's C++ loop and tables, where built; its rows from the columns
    if "origin" in df.columns:
        t.first_sight = {(d, p, a) for d, p, a in df.lazy().filter(
            (pl.col("event") == "MALLOC") & (pl.col("origin") == FIRST_SIGHT)).select(
            "device", "event_type", "alloc_id").collect().iter_rows()}
    cols = [c for c in ("id", "event", "event_type", "name", "tid", "device", "alloc_id", "addr", "size", "used",
                        "owner", "py_stack", "attr", "step") if c in df.columns]
    q = (df.lazy().filter(pl.col("event").is_in(["MALLOC", "FREE", "MSTX"])
                          | ((pl.col("event") == "SYSTEM") & pl.col("event_type").is_in(["STEP", "STEP_SUMMARY"])))
         .sort("id").select(cols).collect())
    has = set(cols)
    n = q.height
    # rows made from whole columns (no dict per row): MALLOC/FREE attr tuples, the rest from Attr.
    # The tracker keeps a tuple per live block: no collector passes over millions of them (they
    # hold no cycles)
    import gc
    was = gc.isenabled()
    gc.disable()
    try:
        cols = _native_columns(q, has) if m is not None else None
        if cols is not None:
            _replay_columns(t, q, has, n, m, cols)
        else:
            _replay_rows(t, q, has, n)
    finally:
        if was:
            gc.enable()
    return t


def _other_attr(ev, et, text, step):
    """The Attr of a row other than MALLOC/FREE, from its text, as the online sink gets it: a STEP
    row's as ``{"step": N}``, N its place (``step``, None: not known) where the text gives none."""
    a = _attr_json(text) or {}
    if ev == Event.SYSTEM and et == System.STEP:
        k = a.get("step")
        if isinstance(k, bool) or not isinstance(k, int):  # absent or not a number: its place
            k = step
        a = {"step": k} if k is not None else {}
    return a


def _replay_rows(t, q, has, n):
    def col(c):
        return q[c].to_list() if c in has else [None] * n
    batch, ids = [], []
    for i, ev, et, name, tid, dev, aid, addr, size, used, owner, ps, attr, step in zip(
            col("id"), col("event"), col("event_type"), col("name"), col("tid"), col("device"), col("alloc_id"),
            col("addr"), col("size"), col("used"), col("owner"), col("py_stack"), col("attr"), col("step")):
        if ev == Event.MALLOC:
            a = (aid, addr, size, used, None, owner)
        elif ev == Event.FREE:
            a = (aid, addr, size, used, None)
            ps = None
        else:
            ps = None
            a = _other_attr(ev, et, attr, step)
        # a plain tuple in events.RawRow order (what the online sink gets)
        batch.append((ev, et, name, None, tid, dev, None, a, ps, None))
        ids.append(i)
        if len(batch) >= 65536:
            t.consume(batch, 0, ids)
            batch, ids = [], []
    t.consume(batch, 0, ids)
    return t


_REPLAY_COLUMNS = (("id", False), ("event", True), ("event_type", True), ("name", True), ("tid", False),
                   ("device", True), ("alloc_id", False), ("addr", False), ("size", False), ("used", False),
                   ("owner", True), ("py_stack", True))


def _native_columns(q, has):
    """The columns as ``replay_rows`` takes them: text as (categorical codes, the strings by code:
    each distinct string one object, short ones interned), ints as (int64 values, null mask or
    None), a missing column None; None where a column does not convert (the Python rows then)."""
    pl = _pl()
    try:
        text = {c: q[c].cast(pl.String).cast(pl.Categorical) for c, t in _REPLAY_COLUMNS if t and c in has}
        cats = [s.dtype.categories for s in text.values()]
        if any(c != cats[0] for c in cats):  # not one mapping: the codes could not share the strings
            return None
        values = [sys.intern(x) if type(x) is str and len(x) < 64 else x
                  for x in (cats[0].to_series().to_list() if cats else [])]
        cols = []
        for c, is_text in _REPLAY_COLUMNS:
            if c not in has:
                cols.append(None)
            elif is_text:
                cols.append((text[c].to_physical().fill_null(len(values)).cast(pl.UInt32).to_numpy(), values))
            else:
                s = q[c].cast(pl.Int64)
                cols.append((s.fill_null(0).to_numpy(), s.is_null().to_numpy() if s.null_count() else None))
    except (pl.exceptions.PolarsError, ValueError, TypeError, OverflowError):
        return None
    return tuple(cols)


def _replay_columns(t, q, has, n, m, cols):
    """``_replay_rows`` with the MALLOC/FREE rows taken in C++ straight from the columns
    (``leak_columns``: no row tuples; each distinct string one object and the event and pool names
    interned, so that the loop finds them by identity). A row it does not take (a new site or stack
    line, a pool's first row in a step, the other events) is made alone and given to the Python
    loop, with the step's min/max kept between."""
    pl = _pl()
    # the other rows (MSTX, STEP and summaries: a few per step) from their Attr text, as _replay_rows
    other = q.with_row_index("_at").filter(~pl.col("event").is_in([Event.MALLOC, Event.FREE]))
    oc = {c: (other[c].to_list() if c in has else [None] * other.height)
          for c in ("event", "event_type", "name", "tid", "device", "attr", "step")}
    made = {at: (oc["event"][k], oc["event_type"][k], oc["name"][k], None, oc["tid"][k], oc["device"][k], None,
                 _other_attr(oc["event"][k], oc["event_type"][k], oc["attr"][k], oc["step"][k]), None, None)
            for k, at in enumerate(other["_at"].to_list())}
    t.consume_columns(cols, n, made)
    return t


def _recorded_steps(dump):
    """The steps a ``--steps`` run recorded (from its config.json), or None: every step."""
    folder = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(dump))))
    try:
        with open(os.path.join(folder, "config.json")) as f:
            steps = (json.load(f).get("options") or {}).get("steps")
        return [int(x) for x in steps] if steps else None
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def analyze(input_path) -> list[dict]:
    """The online analysis recomputed from each dump under ``input_path``: a list of
    ``leaks.json``-shaped dicts (``sites``, ``leaks``, ``retained``, ...), each with ``dump``,
    and the console report of each in ``lines``."""
    from ..io.reader import find_dumps
    out = []
    for d in find_dumps(os.fspath(input_path)):
        recorded = _recorded_steps(d)
        t = replay(_read(d, STEP_EVENTS))
        judged = recorded is None
        res = t.results(judged)
        lines = report_lines(t, judged, res) + gap_report(t.fluctuation())
        out.append({"dump": d, **result_json(t, judged, res), "lines": lines})
    return out


def check_step_leaks(input_path, out=None):
    """The online analysis (growth by site, block rule, fluctuation), recomputed from a dump:
    prints the report and returns the leaks.json-shaped result of each dump."""
    out = sys.stdout if out is None else out
    results = analyze(input_path)
    for r in results:
        print(f"msmemscope: leak check of {r['dump']} ({r['steps_ended']} steps ended)", file=out)
        print("\n".join(r.pop("lines")), file=out)
    return results


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise MarkError(message)


def main(argv=None) -> int:
    p = _Parser(prog="msmemscope check-leaks", add_help=True,
                description="Offline leak check of a dump (CSV or db, ours or the original's). With --mark: "
                            "blocks allocated between marks A and B and not freed before mark C. Without: the "
                            "online analysis (growing sites, block findings, fluctuation table).")
    p.add_argument("input", help="a dump file or an output folder")
    p.add_argument("--mark", "--mstx-info", dest="mark", help="message of the marks A, B, C")
    p.add_argument("--start-index", "--start_index", dest="start_index", default="0",
                   help="which matching mark is A (default 0)")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of the report: with --mark the leaked blocks, without it the "
                        "structure of analysis/leaks.json (sites, leaks, retained, ...)")
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
        if ns.mark is None:  # leaks.json's structure: one dict, or a list when a folder held several dumps
            leaks = leaks[0] if len(leaks) == 1 else leaks
        print(json.dumps(leaks, indent=2, default=str))
    return 0
