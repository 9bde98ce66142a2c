"""Memory decomposition (SPEC §4.4): bytes per device and owner.

One accumulator (``Decomposition``) serves both sides: the online sink feeds it
the raw rows of each flush, the offline ``summarize(df)`` feeds it the columns of
a dump read by ``io.reader.read_dump``. It follows MALLOC, FREE and the
``SYSTEM/OWNER`` owner-update rows, and at each ``SYSTEM/STEP`` row records, per
(device, owner), the bytes live at the step end and the step's peak.

Result (``analysis/decompose.json``)::

    {"devices": {"cpu": {"owners": {"PTA@weight": {"peak": .., "current": ..}, ...},
                         "categories": {"weight": {"peak": .., "current": ..}, ...}}},
     "steps": [{"step": 1, "device": "cpu", "bytes": {owner: n}, "peak": {owner: n},
                "grew": {owner: +delta}}, ...]}

``peak`` of an owner is the most bytes that owner held at once; ``current`` is
what it held at the end of the trace. A category is the second label of the
owner chain (``weight``, ``gradient``, ``optimizer_state``, ``activation``, ``ops``).
"""
from __future__ import annotations

import json
import os
import sys

from ..events import A_ALLOC_ID, A_OWNER, A_SIZE, ATTR, DEVICE, EVENT, EVENT_TYPE, Event, System

OWNER_ROW = "OWNER"
UNLABELLED = "unlabelled"


def category(owner: str) -> str:
    parts = (owner or "").split("@")
    return parts[1] if len(parts) > 1 else (owner or UNLABELLED)


class Decomposition:
    def __init__(self):
        self.blocks = {}   # alloc_id -> [device, owner, size]
        self.cur = {}      # (device, owner) -> bytes
        self.peak = {}     # (device, owner) -> bytes, whole run
        self.cat_cur = {}  # (device, category) -> bytes
        self.cat_peak = {}
        self.step_peak = {}  # (device, owner) -> bytes, current step
        self.steps = []
        self._last = {}    # (device, owner) -> bytes at the previous step end
        self.rows_since_step = 0

    def _add(self, dev, owner, n):
        k = (dev, owner)
        v = self.cur.get(k, 0) + n
        self.cur[k] = v
        if n > 0:
            if v > self.peak.get(k, 0):
                self.peak[k] = v
            if v > self.step_peak.get(k, 0):
                self.step_peak[k] = v
        c = (dev, category(owner))
        cv = self.cat_cur.get(c, 0) + n
        self.cat_cur[c] = cv
        if n > 0 and cv > self.cat_peak.get(c, 0):
            self.cat_peak[c] = cv

    def malloc(self, dev, aid, size, owner):
        owner = owner or UNLABELLED
        if aid is None or size is None:
            return
        self.blocks[aid] = [dev, owner, size]
        self._add(dev, owner, size)
        self.rows_since_step += 1

    def free(self, aid):
        b = self.blocks.pop(aid, None)
        if b is not None:
            self._add(b[0], b[1], -b[2])
        self.rows_since_step += 1

    def relabel(self, aid, owner):
        b = self.blocks.get(aid)
        if b is None or not owner or b[1] == owner:
            return
        self._add(b[0], b[1], -b[2])
        b[1] = owner
        self._add(b[0], owner, b[2])

    def end_step(self, step):
        devs = sorted({d for d, _ in self.cur} | {d for d, _ in self.step_peak})
        for dev in devs:
            now = {o: n for (d, o), n in self.cur.items() if d == dev and (n or self._last.get((d, o)))}
            pk = {o: n for (d, o), n in self.step_peak.items() if d == dev}
            grew = {}
            for o, n in now.items():
                delta = n - self._last.get((dev, o), 0)
                if delta:
                    grew[o] = delta
            self.steps.append({"step": step, "device": dev, "bytes": now, "peak": pk, "grew": grew})
        self._last = dict(self.cur)
        self.step_peak = {k: v for k, v in self.cur.items() if v}
        self.rows_since_step = 0

    def result(self) -> dict:
        devices = {}
        for (dev, o), p in sorted(self.peak.items()):
            d = devices.setdefault(dev, {"owners": {}, "categories": {}})
            d["owners"][o] = {"peak": p, "current": self.cur.get((dev, o), 0)}
        for (dev, c), p in sorted(self.cat_peak.items()):
            d = devices.setdefault(dev, {"owners": {}, "categories": {}})
            d["categories"][c] = {"peak": p, "current": self.cat_cur.get((dev, c), 0)}
        return {"devices": devices, "steps": self.steps}

    # ------------------------------------------------------------ feeding
    def feed_raw(self, rows):
        """Raw session rows (online)."""
        for r in rows:
            ev = r[EVENT]
            if ev == Event.MALLOC:
                a = r[ATTR]
                if type(a) is tuple:
                    self.malloc(r[DEVICE], a[A_ALLOC_ID], a[A_SIZE], a[A_OWNER])
                elif a:
                    self.malloc(r[DEVICE], a.get("allocation_id"), a.get("size"), a.get("owner"))
            elif ev == Event.FREE:
                a = r[ATTR]
                self.free(a[A_ALLOC_ID] if type(a) is tuple else (a or {}).get("allocation_id"))
            elif ev == Event.SYSTEM and r[EVENT_TYPE] == OWNER_ROW and r[ATTR]:
                self.relabel(r[ATTR].get("allocation_id"), r[ATTR].get("owner"))


def summarize(df) -> dict:
    """The decomposition of one dump (a DataFrame from ``read_dump``), same numbers as the online sink."""
    import polars as pl
    rows = df.filter(pl.col("event").is_in([Event.MALLOC, Event.FREE])
                     | ((pl.col("event") == Event.SYSTEM) & pl.col("event_type").is_in([System.STEP, OWNER_ROW])))
    rows = rows.with_columns(stepno=pl.when(pl.col("event_type") == System.STEP).then(pl.col("attr"))
                             .str.extract(r'"?step"?\s*:\s*(\d+)', 1).cast(pl.Int64, strict=False))
    dec = Decomposition()
    for ev, et, dev, aid, size, owner, stepno in rows.select(
            "event", "event_type", "device", "alloc_id", "size", "owner", "stepno").iter_rows():
        if ev == Event.MALLOC:
            dec.malloc(dev, aid, size, owner)
        elif ev == Event.FREE:
            dec.free(aid)
        elif et == System.STEP:
            dec.end_step(stepno)
        else:
            dec.relabel(aid, owner)
    if dec.rows_since_step:
        dec.end_step(None)
    return dec.result()


#: what the offline decomposition reads of a dump (the reader's column layer)
COLUMNS = ("id", "event", "event_type", "device", "alloc_id", "size", "owner", "attr")
EVENTS = (Event.MALLOC, Event.FREE, Event.SYSTEM)


def summarize_dump(path: str) -> dict:
    """``summarize`` of one dump, reading only its columns and rows."""
    from ..io.reader import read_dump
    return summarize(read_dump(path, columns=COLUMNS, events=EVENTS))


def format_table(res: dict) -> str:
    def mb(n):
        return f"{n / 1048576:10.3f}"
    lines = ["[msmemscope] memory decomposition (MB)"]
    for dev, d in res["devices"].items():
        last = [s for s in res["steps"] if s["device"] == dev and s["step"] is not None]
        last = last[-1] if last else None
        head = f"  device {dev}: {'owner':<44} {'peak':>10} {'step end':>10} {'now':>10}"
        lines.append(head)
        for o, v in sorted(d["owners"].items(), key=lambda kv: -kv[1]["peak"]):
            se = last["bytes"].get(o, 0) if last else 0
            lines.append(f"  {'':>{len(dev) + 9}}{o:<44} {mb(v['peak'])} {mb(se)} {mb(v['current'])}")
    grew = [s for s in res["steps"] if s["grew"] and s["step"] is not None]
    for s in grew[:10]:
        top = sorted(s["grew"].items(), key=lambda kv: -abs(kv[1]))[:3]
        lines.append(f"  step {s['step']} device {s['device']}: " +
                     ", ".join(f"{o} {'+' if n > 0 else ''}{n / 1048576:.3f} MB" for o, n in top))
    return "\n".join(lines)


def write_result(folder: str, res: dict) -> str:
    from ..io.files import create_new, make_dirs, unique_path
    out_dir = make_dirs(os.path.join(folder, "analysis"))
    path = unique_path(os.path.join(out_dir, "decompose.json"))
    with create_new(path) as f:
        json.dump(res, f, indent=1)
    return path


class DecomposeSink:
    def __init__(self, session):
        from ..capture.owners import labeler_for
        self.dec = Decomposition()
        self.labeler = labeler_for(session)
        session.labeler = self.labeler
        self.labeler.install()

    def consume(self, rows, first_id):
        self.dec.feed_raw(rows)

    def step_end(self, session, step):
        self.dec.end_step(step)

    def close(self, session):
        if session.labeler is not None:
            self.labeler = session.labeler  # the dispatch source's, after a handover (watch)
        self.labeler.remove()
        if self.dec.rows_since_step:
            self.dec.end_step(None)
        res = self.dec.result()
        res["owner_updates"] = self.labeler.updates
        path = write_result(session.folder, res)
        from .._console import say
        say(format_table(res))
        say(f"[msmemscope] decomposition written to {path}")


def make_sink(session):
    return DecomposeSink(session)


def main(argv) -> int:
    """``msmemscope decompose <dump or folder>``: print the decomposition of a dump, write JSON with -o."""
    from ..cli import UsageError, _Parser, error_exit
    from ..io.files import create_new, unique_path
    from ..io.reader import DumpError
    from ..io.ranks import find_rank_dumps, heading
    p = _Parser(prog="msmemscope decompose", allow_abbrev=False)
    p.add_argument("dump", help="a dump, a run folder, or the root of a distributed run (one report per rank)")
    p.add_argument("-o", "--output", help="write the JSON summary to this file (never overwrites: a new name)")
    try:
        a = p.parse_args(argv)
    except UsageError as e:
        return error_exit(str(e))
    if a.output:
        d = os.path.dirname(os.path.abspath(a.output))
        if not os.path.isdir(d):
            return error_exit(f"-o {a.output}: folder {d} does not exist")
        if os.path.isdir(a.output):
            return error_exit(f"-o {a.output}: is a folder; give a file name")
    try:
        rds = find_rank_dumps(a.dump)
        if len(rds) == 1:
            res = summarize_dump(rds[0].path)
            print(format_table(res))
        else:  # one report per rank
            res = {"ranks": []}
            for rd in rds:
                r = summarize_dump(rd.path)
                print(heading(rd))
                print(format_table(r))
                res["ranks"].append({"label": rd.label, "rank": rd.rank, "dump": rd.path, "result": r})
    except DumpError as e:
        return error_exit(str(e))
    if a.output:
        path = unique_path(a.output)
        try:
            with create_new(path) as f:
                json.dump(res, f, indent=1)
        except OSError as e:
            return error_exit(f"-o {a.output}: cannot write {path}: {e.strerror or e}")
        print(f"written to {path}", file=sys.stderr)
    return 0
