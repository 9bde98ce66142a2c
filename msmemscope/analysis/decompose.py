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

from ..events import (A_ALLOC_ID, A_MODULE, A_OWNER, A_PHASE, A_SIZE, A_USED, ATTR, DEVICE, EVENT, EVENT_TYPE,
                      PACKED_LEAK, Event, System, category_of)

OWNER_ROW = "OWNER"
UNLABELLED = "unlabelled"
OUTSIDE = "(outside modules)"
#: the per-module table's columns, from the owner's category
MODULE_COLUMNS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_COLUMN_OF = {"weight": "parameters", "gradient": "gradients", "optimizer_state": "optimizer_state",
              "activation": "activations", "ops": "temporaries"}


def category(owner: str) -> str:
    """``category_of``, naming a label without a category by itself (or "unlabelled")."""
    c = category_of(owner)
    return c if c is not None else (owner or UNLABELLED)


def _category_expr(owner):
    """``category`` as a column expression (on owners that are never empty)."""
    import polars as pl
    parts = owner.str.split("@")
    return pl.when(parts.list.len() > 1).then(parts.list.get(1, null_on_oob=True)).otherwise(owner)


#: row kinds of ``Decomposition.feed_frame`` (F_LIVE: a block live before the frame, internal)
F_MALLOC, F_FREE, F_OWNER, F_STEP, F_LIVE = 1, 2, 3, 4, 5
_NO_DEVICE = "\x00no device"  # a null device while devices are codes


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

    # ------------------------------------------------------------ columns (offline, and online batches)
    def feed_frame(self, rows) -> None:
        """Fold a frame of rows in dump order (columns ``kind`` = one of ``F_MALLOC``, ``F_FREE``,
        ``F_OWNER``, ``F_STEP``; ``device``, ``alloc_id``, ``size``, ``owner``, ``stepno``) with
        column operations: the same state and result as ``malloc``/``free``/``relabel``/``end_step``
        row by row. Python work is per (step, owner) touched, not per row."""
        import polars as pl
        if rows.height == 0:
            return
        k = pl.col("kind")
        rows = rows.select("kind", "device", "alloc_id", "size", "owner", "stepno").with_row_index("i").with_columns(
            pl.col("i").cast(pl.Int64))
        is_step = (k == F_STEP).cast(pl.Int64)
        rows = rows.with_columns(seg=is_step.cum_sum() - is_step)
        stepnos = rows.filter(k == F_STEP)["stepno"].to_list()
        ok_malloc = (k == F_MALLOC) & pl.col("alloc_id").is_not_null() & pl.col("size").is_not_null()
        # rows that count towards rows_since_step: valid MALLOC rows and every FREE row
        per_seg = dict(rows.filter(ok_malloc | (k == F_FREE)).group_by("seg").len().iter_rows())
        x = rows.filter(pl.col("alloc_id").is_not_null() & (ok_malloc | (k == F_FREE) | (
            (k == F_OWNER) & pl.col("owner").is_not_null() & (pl.col("owner") != ""))))
        x = x.select("i", "seg", "kind", "alloc_id", "device", "size",
                     owner=pl.when(k == F_MALLOC).then(
                         pl.when(pl.col("owner") != "").then("owner").otherwise(pl.lit(UNLABELLED)))
                     .otherwise("owner").fill_null(pl.lit(UNLABELLED)).cast(pl.String))
        live = [(a, *b) for a, b in self.blocks.items()]
        # devices and owners as small integer codes (few distinct values): the sorts and groups
        # below move and compare integers, the strings come back per (step, owner) at the end
        x = x.with_columns(device=pl.col("device").fill_null(_NO_DEVICE))
        devs = list(dict.fromkeys([b[1] if b[1] is not None else _NO_DEVICE for b in live]
                                  + x["device"].unique(maintain_order=True).to_list()))
        owns = list(dict.fromkeys([b[2] for b in live] + x["owner"].unique(maintain_order=True).to_list()))
        dcode, ocode = {d: i for i, d in enumerate(devs)}, {o: i for i, o in enumerate(owns)}
        nd = max(len(devs), 1)
        x = x.with_columns(device=pl.col("device").cast(pl.Enum(devs)).to_physical().cast(pl.Int64),
                           owner=pl.col("owner").cast(pl.Enum(owns)).to_physical().cast(pl.Int64))
        devs = [None if d == _NO_DEVICE else d for d in devs]
        if live:  # the live blocks open their instance before every row of this frame
            lf = pl.DataFrame({"i": [-1] * len(live), "seg": [-1] * len(live), "kind": [F_LIVE] * len(live),
                               "alloc_id": [b[0] for b in live],
                               "device": [dcode[b[1] if b[1] is not None else _NO_DEVICE] for b in live],
                               "size": [b[3] for b in live], "owner": [ocode[b[2]] for b in live]})
            x = pl.concat([lf.cast(x.schema), x], how="vertical")
        x = x.sort("alloc_id", maintain_order=True)  # stable: each alloc_id's rows stay in dump order
        opens = k.is_in([F_MALLOC, F_LIVE])
        is_free = (k == F_FREE).cast(pl.Int64)
        # one instance per MALLOC (or live block): the rows of its alloc_id up to the next MALLOC;
        # rows before an instance opens, and after its first FREE, change nothing (the dict's pop)
        x = x.with_columns(
            _oaid=pl.when(opens).then("alloc_id").forward_fill(),
            _cf=is_free.cum_sum() - is_free,
        ).with_columns(
            _cf0=pl.when(opens).then("_cf").forward_fill(),
            device=pl.when(opens).then("device").forward_fill(),
            size=pl.when(opens).then("size").forward_fill(),
            own=pl.when(opens | (k == F_OWNER)).then("owner").forward_fill(),
        ).filter((pl.col("_oaid") == pl.col("alloc_id")) & (pl.col("_cf") == pl.col("_cf0")))
        x = x.with_columns(prev=pl.col("own").shift(1))
        # what is left live after the frame: the last instance of each alloc_id, unless freed
        aid = pl.col("alloc_id")
        last = x.filter((aid != aid.shift(-1)).fill_null(True) & (k != F_FREE))
        self.blocks = {a: [devs[d], owns[o], s]
                       for a, d, o, s in last.select("alloc_id", "device", "own", "size").iter_rows()}
        # the byte moves, in dump order: +size at a MALLOC, -size at a FREE, -old/+new at an owner change;
        # key: device and owner in one integer
        sz, i2 = pl.col("size"), 2 * pl.col("i")
        moved = (k == F_OWNER) & (pl.col("own") != pl.col("prev"))
        dev = pl.col("device")
        ev = pl.concat([
            x.filter(k == F_MALLOC).select(seq=i2, seg="seg", key=pl.col("own") * nd + dev, n=sz),
            x.filter(k == F_FREE).select(seq=i2, seg="seg", key=pl.col("prev") * nd + dev, n=-sz),
            x.filter(moved).select(seq=i2, seg="seg", key=pl.col("prev") * nd + dev, n=-sz),
            x.filter(moved).select(seq=i2 + 1, seg="seg", key=pl.col("own") * nd + dev, n=sz),
        ], how="vertical").sort("seq")
        del x
        cats = list(dict.fromkeys(category(o) for o in owns))
        cat_of = [cats.index(category(o)) for o in owns]
        nseg = len(stepnos) + 1
        by_seg = {s: ([], []) for s in range(nseg)}
        for which in (0, 1):
            e = ev if which == 0 else ev.with_columns(
                key=(pl.col("key") // nd).replace_strict(list(range(len(owns))), cat_of, return_dtype=pl.Int64) * nd
                + pl.col("key") % nd)
            e = e.with_columns(run=pl.col("n").cum_sum().over("key"))
            pos = pl.col("n") > 0
            agg = (e.group_by("seg", "key")
                   .agg(first=pl.col("seq").min(), last=pl.col("run").last(),
                        pmax=pl.col("run").filter(pos).max(), pfirst=pl.col("seq").filter(pos).min())
                   .sort("seg", "first"))
            names = owns if which == 0 else cats
            for seg, key, first, lastv, pmax, pfirst in agg.iter_rows():
                by_seg[seg][which].append(((devs[key % nd], names[key // nd]), lastv, pmax, pfirst))
        cur0, cat0 = dict(self.cur), dict(self.cat_cur)
        for s in range(nseg):
            owners, catrows = by_seg[s]
            for key, rel, pmax, _ in owners:  # cur: keys in the order first touched
                self.cur[key] = cur0.get(key, 0) + rel
                if pmax is not None and cur0.get(key, 0) + pmax > self.peak.get(key, 0):
                    self.peak[key] = cur0.get(key, 0) + pmax
            for key, rel, pmax, pfirst in sorted((t for t in owners if t[2] is not None), key=lambda t: t[3]):
                v = cur0.get(key, 0) + pmax
                if v > self.step_peak.get(key, 0):
                    self.step_peak[key] = v
            for key, rel, pmax, _ in catrows:
                self.cat_cur[key] = cat0.get(key, 0) + rel
                if pmax is not None and cat0.get(key, 0) + pmax > self.cat_peak.get(key, 0):
                    self.cat_peak[key] = cat0.get(key, 0) + pmax
            self.rows_since_step += per_seg.get(s, 0)
            if s < nseg - 1:
                self.end_step(stepnos[s])

    # ------------------------------------------------------------ feeding
    def feed_raw(self, rows, start=0, to_step=False):
        """Raw session rows (online) from ``start``; with ``to_step`` only up to the first STEP row:
        its index (len(rows): none)."""
        for i in range(start, len(rows)):
            r = rows[i]
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
            elif ev == Event.SYSTEM:
                if r[EVENT_TYPE] == System.STEP:
                    if to_step:
                        return i
                elif r[EVENT_TYPE] == OWNER_ROW and r[ATTR]:
                    self.relabel(r[ATTR].get("allocation_id"), r[ATTR].get("owner"))
        return len(rows)


#: the SYSTEM rows a native fold leaves to the analysis: owner updates, and step ends
_FOLD_STOPS = (OWNER_ROW, System.STEP)


def _feed_fold(fold, rows, relabel, start=0, to_step=False):
    """Rows from ``start`` into a native fold; each OWNER row it stops at relabels its block. With
    ``to_step`` only up to the first STEP row: its index (len(rows): none)."""
    n = len(rows)
    i = fold.feed(rows, start)
    while i < n:
        r = rows[i]
        if r[EVENT_TYPE] == System.STEP:
            if to_step:
                return i
        else:
            a = r[ATTR]
            if a:
                relabel(a.get("allocation_id"), a.get("owner"), a.get("module"))
        i = fold.feed(rows, i + 1)
    return n


def feed_steps(rows, dec, mods):
    """Session rows into the decomposition and the module table, each step ended at its STEP row."""
    i, n = 0, len(rows)
    while i < n:
        j = dec.feed_raw(rows, i, to_step=True)
        mods.feed_raw(rows, i, to_step=True)  # stops at the same STEP row
        if j < n:
            step = step_of(rows[j])
            dec.end_step(step)
            mods.end_step(step)
        i = j + 1


def feed_packed(packed, dec, mods):
    """``feed_steps`` of a flush's ``PackedRows`` taken with their labels (its leak columns and
    modules' columns, no row tuple), into the native folds of both."""
    cols, extra, n = packed.cols, packed.mods, packed.column_rows()
    i = 0
    while i < n:
        j = dec._fold.feed_columns(cols, extra, i)
        mods._fold.feed_columns(cols, extra, i)  # stops at the same STEP row
        if j < n:
            step = step_of(packed.steps[j])
            dec.end_step(step)
            mods.end_step(step)
        i = j + 1


def step_of(row):
    """The step number a SYSTEM/STEP row ends (None where it does not say)."""
    a = row[ATTR]
    return a.get("step") if isinstance(a, dict) else None


class FoldedDecomposition(Decomposition):
    """``Decomposition`` whose rows are folded by the native ``Fold``: same state and result. The
    fold's counters are this class's ``cur``/``peak``/``step_peak`` and the categories', read back
    (``_sync``) at each step end and at the result; owner updates (``SYSTEM/OWNER``) stop the
    fold's pass and are applied here."""

    def __init__(self, mod):
        self._fold = None
        super().__init__()
        self._ctr = {}     # (0, dev, owner) or (1, dev, category) -> counter id
        self._cinfo = []   # counter id -> that key
        self._kinfo = []   # key id -> (dev, owner)
        self._by_owner = {}  # (dev, owner) -> key id
        self._fold = mod.Fold(self._key, _FOLD_STOPS)

    @property
    def rows_since_step(self):
        if self._fold is not None:
            self._rows += self._fold.take_rows()
        return self._rows

    @rows_since_step.setter
    def rows_since_step(self, v):
        if self._fold is not None:
            self._fold.take_rows()
        self._rows = v

    def _counter(self, k):
        c = self._ctr.get(k)
        if c is None:
            c = self._ctr[k] = len(self._cinfo)
            self._cinfo.append(k)
        return c

    def _spec(self, dev, owner):
        self._kinfo.append((dev, owner))
        self._by_owner.setdefault((dev, owner), len(self._kinfo) - 1)
        return [self._counter((0, dev, owner)), self._counter((1, dev, category(owner)))], -1, []

    def _key(self, pool, dev, owner, module, phase):
        return self._spec(dev, owner or UNLABELLED)

    def feed_raw(self, rows, start=0, to_step=False):
        return _feed_fold(self._fold, rows, self.relabel, start, to_step)

    def relabel(self, aid, owner, module=None):
        b = self._fold.block(aid) if isinstance(aid, int) else None
        if b is None or not owner:
            return
        dev, old = self._kinfo[b[0]]
        if old == owner:
            return
        k = self._by_owner.get((dev, owner))
        if k is None:
            k = self._fold.add_key(*self._spec(dev, owner))
        self._fold.rekey(aid, k)

    def _sync(self):
        cur, peak, held, _since, made, order = self._fold.counters()
        self.cur, self.peak, self.step_peak, self.cat_cur, self.cat_peak = {}, {}, {}, {}, {}
        step_peak = []
        for c, (kind, dev, name) in enumerate(self._cinfo):
            if c >= len(made) or not made[c]:
                continue
            k = (dev, name)
            if kind == 0:
                self.cur[k] = cur[c]
                if peak[c] is not None:
                    self.peak[k] = peak[c]
                if held[c] is not None:
                    step_peak.append((order[c], k, held[c]))
            else:
                self.cat_cur[k] = cur[c]
                if peak[c] is not None:
                    self.cat_peak[k] = peak[c]
        # the order the Python fold's dict has: what was held at the step's start, then first rises
        self.step_peak = {k: v for _, k, v in sorted(step_peak, key=lambda t: t[0])}

    def end_step(self, step):
        self._sync()
        super().end_step(step)
        self._fold.end_window()

    def result(self) -> dict:
        self._sync()
        return super().result()

    def feed_frame(self, rows):
        raise NotImplementedError("the folded decomposition is online only (Decomposition.feed_frame)")


def _column(owner):
    return _COLUMN_OF.get(category(owner), "other")


class ModuleTable:
    """Memory by nn.Module for one step (the step with the highest peak of each device, or ``step``):
    per module path and each of its ancestors (the module with its submodules), per column, the
    bytes live at the moment of the step's peak (``at_peak``) and the most held at once during the
    step (``held``); ``forward_peak`` / ``backward_peak``: the most bytes in use (the device's
    ``used``) at an allocation made in its forward / backward. Rows of the device's ``PTA`` pool.

    ``summarised``: a bounded dump's summarised steps, (device, step) -> (the step's peak over every
    row, dropped ones included; the bytes in use at its end), from their STEP_SUMMARY rows: the step
    is chosen by that peak, as the full dump's would be, and its table says ``summarised`` (its
    bytes by module are those of its kept rows)."""

    def __init__(self, step=None, summarised=None):
        self.want = step
        self.summarised = summarised or {}
        self.last_step = 0    # the last step ended (the rows after it are the next)
        self.blocks = {}      # alloc_id -> (dev, prefixes, column, size, the device's peak count at its MALLOC)
        self.peaks = {}       # dev -> how many times its peak moved (a new peak, a new step)
        self.cur = {}         # (dev, prefix, column) -> bytes
        self.held = {}        # (dev, prefix, column) -> most bytes during the step
        self.since = {}       # dev -> {(prefix, column): change since the step's peak}
        self.used = {}        # dev -> bytes in use now
        self.peak = {}        # dev -> the step's peak
        self.fwd = {}         # (dev, prefix) -> forward peak this step
        self.bwd = {}
        self.best = {}        # dev -> the table kept
        self.seen = False     # any row carried a module
        self._pre = {None: (OUTSIDE,)}

    def _prefixes(self, module):
        p = self._pre.get(module)
        if p is None:
            parts = module.split(".")
            p = self._pre[module] = tuple(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        return p

    def _move(self, dev, pres, col, n, at_peak=False):
        cur, held = self.cur, self.held
        since = self.since.get(dev)
        if since is None:
            since = self.since[dev] = {}
        for p in pres:
            k = (dev, p, col)
            v = cur.get(k, 0) + n
            cur[k] = v
            if n > 0 and v > held.get(k, 0):
                held[k] = v
            if not at_peak:
                sk = (p, col)
                since[sk] = since.get(sk, 0) + n

    def malloc(self, dev, aid, size, owner, module, phase, used):
        if aid is None or size is None:
            return
        if module is not None:
            self.seen = True
        pres = self._prefixes(module)
        col = _column(owner)
        self.blocks[aid] = (dev, pres, col, size, self.peaks.get(dev, 0))
        self._move(dev, pres, col, size)
        if used is not None:
            self.used[dev] = used
            if used > self.peak.get(dev, -1):
                self.peak[dev] = used
                self.since[dev] = {}
                self.peaks[dev] = self.peaks.get(dev, 0) + 1
            if phase is not None and module is not None:
                pk = self.fwd if phase == "forward" else self.bwd
                for p in pres:
                    k = (dev, p)
                    if used > pk.get(k, -1):
                        pk[k] = used

    def free(self, aid, used=None):
        b = self.blocks.pop(aid, None)
        if b is not None:
            self._move(b[0], b[1], b[2], -b[3])
            if used is not None:
                self.used[b[0]] = used

    def relabel(self, aid, owner, module=None):
        b = self.blocks.get(aid)
        if b is None:
            return
        col = _column(owner) if owner else b[2]
        pres = self._prefixes(module) if module is not None else b[1]
        if (col, pres) == (b[2], b[1]):
            return
        # what a block is (a parameter, its layer's) is often learnt after its MALLOC row was
        # written (an OWNER row at the step's end): a block live at the step's peak counts there
        # as what it is known to be, not as what its MALLOC row said
        back = b[4] != self.peaks.get(b[0], 0)
        self._move(b[0], b[1], b[2], -b[3], back)
        self.blocks[aid] = (b[0], pres, col, b[3], b[4])
        self._move(b[0], pres, col, b[3], back)

    def _keeps(self, dev, step, peak) -> bool:
        """Whether this step's table of ``dev`` is the one kept: the wanted step, else the highest peak."""
        if peak is None:
            return False
        return step == self.want if self.want is not None else peak > self.best.get(dev, {}).get("peak", -1)

    def _numbered(self, step):
        """``step``, or for the rows after the last STEP row (None) the number they have in the dump."""
        if step is None:
            step = self.last_step + 1
        self.last_step = step
        return step

    def end_step(self, step):
        step = self._numbered(step)
        summ = {d: v for (d, s), v in self.summarised.items() if s == step} if self.summarised else {}
        for dev in sorted({d for d, _, _ in self.cur} | set(self.peak) | set(summ)):
            peak = self.peak.get(dev)
            sm = summ.get(dev)
            if sm is not None and sm[0] is not None:
                peak = sm[0] if peak is None else max(peak, sm[0])
            if self._keeps(dev, step, peak):
                self.best[dev] = self._table(dev, step, peak)
                if sm is not None:
                    self.best[dev]["summarised"] = True
            if sm is not None and sm[1] is not None:
                self.used[dev] = sm[1]  # the level the next step starts from (its last row may be dropped)
        for dev in self.peak:
            self.peak[dev] = self.used.get(dev, 0)
            self.peaks[dev] = self.peaks.get(dev, 0) + 1  # the live blocks were live at the new step's start
        self.since = {}
        self.held = {k: v for k, v in self.cur.items() if v}
        self.fwd, self.bwd = {}, {}

    def _table(self, dev, step, peak):
        since = self.since.get(dev, {})
        rows = {}

        def row(p):
            r = rows.get(p)
            if r is None:
                r = rows[p] = {"module": p, "depth": 1 if p == OUTSIDE else p.count(".") + 1,
                               "at_peak": dict.fromkeys(MODULE_COLUMNS, 0), "held": dict.fromkeys(MODULE_COLUMNS, 0),
                               "forward_peak": self.fwd.get((dev, p)), "backward_peak": self.bwd.get((dev, p))}
            return r
        for (d, p, col), v in self.cur.items():
            if d != dev:
                continue
            at = v - since.get((p, col), 0)
            h = self.held.get((d, p, col), 0)
            if at or h:
                r = row(p)
                r["at_peak"][col] = at
                r["held"][col] = h
        for (d, p) in list(self.fwd) + list(self.bwd):
            if d == dev:
                row(p)
        out = []
        for r in rows.values():
            r["total"] = sum(r["at_peak"].values())
            out.append(r)
        out.sort(key=lambda r: (-r["total"], r["module"]))
        return {"step": step, "peak": peak, "modules": out}

    def result(self) -> dict:
        return {dev: t for dev, t in sorted(self.best.items())} if self.seen else {}

    def feed_raw(self, rows, start=0, to_step=False):
        """Raw session rows (online) from ``start``: MALLOC/FREE rows of the PTA pool, OWNER updates;
        with ``to_step`` only up to the first STEP row: its index (len(rows): none)."""
        for i in range(start, len(rows)):
            r = rows[i]
            ev = r[EVENT]
            if ev == Event.MALLOC:
                if r[EVENT_TYPE] != "PTA":
                    continue
                a = r[ATTR]
                if type(a) is tuple:
                    m = len(a) > A_MODULE
                    self.malloc(r[DEVICE], a[A_ALLOC_ID], a[A_SIZE], a[A_OWNER], a[A_MODULE] if m else None,
                                a[A_PHASE] if m else None, a[A_USED])
                elif a:
                    self.malloc(r[DEVICE], a.get("allocation_id"), a.get("size"), a.get("owner"), a.get("module"),
                                a.get("phase"), a.get("used"))
            elif ev == Event.FREE:
                a = r[ATTR]
                if type(a) is tuple:
                    self.free(a[A_ALLOC_ID], a[A_USED])
                elif a:
                    self.free(a.get("allocation_id"), a.get("used"))
            elif ev == Event.SYSTEM:
                if r[EVENT_TYPE] == System.STEP:
                    if to_step:
                        return i
                elif r[EVENT_TYPE] == OWNER_ROW and r[ATTR]:
                    self.relabel(r[ATTR].get("allocation_id"), r[ATTR].get("owner"), r[ATTR].get("module"))
        return len(rows)


class FoldedModuleTable(ModuleTable):
    """``ModuleTable`` whose rows are folded by the native ``Fold``: one counter per (device, module
    prefix, column), one gauge per device (its ``used``: the step's peak, and the counters at it),
    one mark per (device, prefix, phase) (the forward / backward peak). The dicts ``end_step`` reads
    are rebuilt from the fold there (``_sync``), so the table is the Python one's."""

    def __init__(self, mod, step=None):
        super().__init__(step)
        self._ctr, self._cinfo = {}, []     # (dev, prefix, column) <-> counter id
        self._gauge, self._ginfo = {}, []   # dev <-> gauge id
        self._mark, self._minfo = {}, []    # (dev, prefix, forward?) <-> mark id
        self._kinfo = []                    # key id -> (dev, prefixes, column)
        self._by_state = {}                 # (dev, prefixes, column) -> key id
        self._fold = mod.Fold(self._key, _FOLD_STOPS)

    @staticmethod
    def _id(table, info, k):
        i = table.get(k)
        if i is None:
            i = table[k] = len(info)
            info.append(k)
        return i

    def _spec(self, dev, pres, col, module=None, phase=None):
        self._kinfo.append((dev, pres, col))
        self._by_state.setdefault((dev, pres, col), len(self._kinfo) - 1)
        ctr = [self._id(self._ctr, self._cinfo, (dev, p, col)) for p in pres]
        marks = [] if phase is None or module is None else [
            self._id(self._mark, self._minfo, (dev, p, phase == "forward")) for p in pres]
        return ctr, self._id(self._gauge, self._ginfo, dev), marks

    def _key(self, pool, dev, owner, module, phase):
        if pool != "PTA":
            return None
        if module is not None:
            self.seen = True
        return self._spec(dev, self._prefixes(module), _column(owner), module, phase)

    def feed_raw(self, rows, start=0, to_step=False):
        return _feed_fold(self._fold, rows, self.relabel, start, to_step)

    def relabel(self, aid, owner, module=None):
        b = self._fold.block(aid) if isinstance(aid, int) else None
        if b is None:
            return
        dev, pres, col = self._kinfo[b[0]]
        ncol = _column(owner) if owner else col
        npres = self._prefixes(module) if module is not None else pres
        if (ncol, npres) == (col, pres):
            return
        k = self._by_state.get((dev, npres, ncol))
        if k is None:
            k = self._fold.add_key(*self._spec(dev, npres, ncol))
        self._fold.rekey(aid, k, True)  # as ModuleTable.relabel: counted at the peak as what it is

    def _sync(self):
        cur, _peak, held, since, made, _order = self._fold.counters()
        used, gpeak, marks = self._fold.gauges()
        self.cur, self.held, self.since = {}, {}, {}
        for c, (dev, p, col) in enumerate(self._cinfo):
            if c >= len(made) or not made[c]:
                continue
            k = (dev, p, col)
            self.cur[k] = cur[c]
            if held[c] is not None:
                self.held[k] = held[c]
            if since[c]:
                self.since.setdefault(dev, {})[(p, col)] = since[c]
        self.used = {dev: used[g] for g, dev in enumerate(self._ginfo) if g < len(used) and used[g] is not None}
        self.peak = {dev: gpeak[g] for g, dev in enumerate(self._ginfo) if g < len(gpeak) and gpeak[g] is not None}
        self.fwd, self.bwd = {}, {}
        for m, (dev, p, fwd) in enumerate(self._minfo):
            if m < len(marks) and marks[m] is not None:
                (self.fwd if fwd else self.bwd)[(dev, p)] = marks[m]

    def end_step(self, step):
        # most steps' tables are not kept (their peak is not the highest yet): only the gauges are
        # read back for that; the counters only where a table is kept (the fold holds the state)
        step = self._numbered(step)
        _used, gpeak, _marks = self._fold.gauges()
        if not any(self._keeps(dev, step, gpeak[g] if g < len(gpeak) else None)
                   for g, dev in enumerate(self._ginfo)):
            self._fold.end_window()
            return
        self._sync()
        super().end_step(step)
        self._fold.end_window()


def module_table(df, step=None) -> dict:
    """The per-module table of one dump (``read_dump`` with ``MODULE_COLUMNS_READ``), the online sink's numbers."""
    import polars as pl
    rows = df.filter((pl.col("event").is_in([Event.MALLOC, Event.FREE]) & (pl.col("event_type") == "PTA"))
                     | ((pl.col("event") == Event.SYSTEM) & pl.col("event_type").is_in([System.STEP, OWNER_ROW])))
    rows = rows.with_columns(stepno=pl.when(pl.col("event_type") == System.STEP).then(pl.col("attr"))
                             .str.extract(r'"?step"?\s*:\s*(\d+)', 1).cast(pl.Int64, strict=False))
    t = ModuleTable(step, _summarised_steps(df))
    pending = False
    for ev, et, dev, aid, size, owner, module, phase, used, stepno in rows.select(
            "event", "event_type", "device", "alloc_id", "size", "owner", "module", "phase", "used",
            "stepno").iter_rows():
        if ev == Event.MALLOC:
            t.malloc(dev, aid, size, owner, module, phase, used)
            pending = True
        elif ev == Event.FREE:
            t.free(aid, used)
            pending = True
        elif et == System.STEP:
            t.end_step(stepno)
            pending = False
        else:
            t.relabel(aid, owner, module)
    if pending:
        t.end_step(None)
    return t.result()


def _summarised_steps(df) -> dict:
    """(device, step) -> (peak, bytes in use at the end) of the PTA pool in each summarised step of
    a bounded dump (``io.bounded.step_peaks``, the STEP_SUMMARY rows' ``used_end``); {} for others."""
    import polars as pl
    if "attr" not in df.columns or not (df["event_type"] == System.STEP_SUMMARY).any():
        return {}
    from ..io.bounded import step_peaks, summaries
    if "step" not in df.columns:  # the reader's step: 1 + STEP rows before
        is_step = ((pl.col("event") == Event.SYSTEM) & (pl.col("event_type") == System.STEP)).cast(pl.Int64)
        df = df.sort("id").with_columns(step=is_step.cum_sum() - is_step + 1)
    mem = df.filter(pl.col("event").is_in([Event.MALLOC, Event.FREE]) & (pl.col("event_type") == "PTA"))
    per = step_peaks(df, mem).filter(pl.col("summarised") & (pl.col("event_type") == "PTA"))
    out = {(dev, step): [peak, None] for step, dev, _, peak, _, _ in per.iter_rows()}
    for step, a in summaries(df):
        for k, v in (a.get("used_end") or {}).items() if isinstance(a.get("used_end"), dict) else ():
            dev, _, pool = str(k).rpartition("/")
            if pool == "PTA" and type(v) is int:
                out.setdefault((dev, step), [None, None])[1] = v
    return {k: tuple(v) for k, v in out.items()}


def fold_depth(table: dict, depth: int) -> list:
    """The modules of a device's table down to ``depth`` (root = 1), sorted by what they hold at the peak."""
    return [r for r in table["modules"] if r["depth"] <= depth]


def format_modules(res: dict, depth: int = 2, top: int | None = None) -> str:
    def mb(n):
        return f"{n / 1048576:9.3f}" if n is not None else f"{'-':>9}"
    lines = []
    for dev, t in res.items():
        lines.append(f"[msmemscope] memory by module, device {dev}, at the peak of step {t['step']} "
                     f"({t['peak'] / 1048576:.3f} MB; MB, a module with its submodules)")
        if t.get("summarised"):
            lines.append(f"  step {t['step']} is summarised in this bounded dump (--keep-steps): its peak is its "
                         f"STEP_SUMMARY row's; the bytes by module are those of its kept rows only")
        lines.append(f"  {'module':<40} {'params':>9} {'grads':>9} {'opt':>9} {'activ':>9} {'temp':>9} "
                     f"{'other':>9} {'at peak':>9} {'fwd peak':>9} {'bwd peak':>9}")
        rows = fold_depth(t, depth)
        for r in rows[:top] if top else rows:
            a = r["at_peak"]
            lines.append(f"  {r['module'][-40:]:<40} " + " ".join(mb(a[c]) for c in MODULE_COLUMNS) +
                         f" {mb(r['total'])} {mb(r['forward_peak'])} {mb(r['backward_peak'])}")
    return "\n".join(lines)


def frame_rows(df):
    """The rows ``Decomposition.feed_frame`` folds, from a ``read_dump`` frame (MALLOC, FREE, and
    the SYSTEM rows STEP and OWNER, in dump order)."""
    import polars as pl
    ev, et = pl.col("event"), pl.col("event_type")
    kind = (pl.when(ev == Event.MALLOC).then(F_MALLOC).when(ev == Event.FREE).then(F_FREE)
            .when((ev == Event.SYSTEM) & (et == System.STEP)).then(F_STEP)
            .when((ev == Event.SYSTEM) & (et == OWNER_ROW)).then(F_OWNER).cast(pl.Int8))
    return (df.lazy().select("device", "alloc_id", "size", "owner", "attr", kind=kind).filter(pl.col("kind").is_not_null())
            .select("kind", "device", "alloc_id", "size", "owner",
                    stepno=pl.when(pl.col("kind") == F_STEP).then(pl.col("attr"))
                    .str.extract(r'"?step"?\s*:\s*(\d+)', 1).cast(pl.Int64, strict=False))
            .collect())


def summarize(df) -> dict:
    """The decomposition of one dump (a DataFrame from ``read_dump``), same numbers as the online sink."""
    dec = Decomposition()
    dec.feed_frame(frame_rows(df))
    if dec.rows_since_step:
        dec.end_step(None)
    return dec.result()


#: what the offline decomposition reads of a dump (the reader's column layer)
COLUMNS = ("id", "event", "event_type", "device", "alloc_id", "size", "owner", "attr")
MODULE_COLUMNS_READ = COLUMNS + ("used", "module", "phase")
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
    from ..io.files import make_dirs, unique_path, write_new
    out_dir = make_dirs(os.path.join(folder, "analysis"))
    path = unique_path(os.path.join(out_dir, "decompose.json"))
    with write_new(path) as f:
        json.dump(res, f, indent=1)
    return path


class DecomposeSink:
    def __init__(self, session):
        from ..capture.owners import labeler_for
        from .folds import native_module
        mod = native_module()  # no Python per row where the native folds are built
        self.dec = FoldedDecomposition(mod) if mod is not None else Decomposition()
        self.mods = FoldedModuleTable(mod) if mod is not None else ModuleTable()
        # a flush taken with its labels as columns (Session._drain_labelled) is folded as they are
        self.takes_packed = mod is not None and hasattr(mod.Fold, "feed_columns")
        self.packed_columns = (PACKED_LEAK,)
        self.labeler = labeler_for(session)
        session.labeler = self.labeler
        self.labeler.install()

    # step boundaries may share a flush (Session._may_wait): each step ends at its STEP row, as
    # the offline decomposition of the dump ends it
    batch_steps = True

    def consume(self, rows, first_id):
        feed_steps(rows, self.dec, self.mods)

    def consume_packed(self, packed, first_id):
        if packed.mods is None:  # taken without the labels: no owner or module to fold
            feed_steps(packed.rows(), self.dec, self.mods)
        else:
            feed_packed(packed, self.dec, self.mods)

    def step_end(self, session, step):
        pass  # ended at its STEP row, in consume

    def close(self, session):
        if session.labeler is not None:
            self.labeler = session.labeler  # the dispatch source's, after a handover (watch)
        self.labeler.remove()
        if self.dec.rows_since_step:
            self.dec.end_step(None)
            self.mods.end_step(None)
        res = self.dec.result()
        res["owner_updates"] = self.labeler.updates
        res["modules"] = self.mods.result()
        path = write_result(session.folder, res)
        from .._console import say
        if res["modules"]:
            say(format_modules(res["modules"], depth=2, top=10))
        say(format_table(res))
        say(f"[msmemscope] decomposition written to {path}")


def make_sink(session):
    return DecomposeSink(session)


def main(argv) -> int:
    """``msmemscope decompose [--by=owner|module] [--depth=N] [--step=N] [--json] <dump or folder>``:
    print the decomposition of a dump (by owner, or the per-module table), write JSON with -o."""
    from ..cli import UsageError, _Parser, error_exit
    from ..io.files import unique_path, write_new
    from ..io.reader import DumpError
    from ..io.ranks import find_rank_dumps, heading, ranks_of_job
    p = _Parser(prog="msmemscope decompose", allow_abbrev=False)
    p.add_argument("dump", help="a dump, a run folder, or the root of a distributed run (one report per rank)")
    p.add_argument("-o", "--output", help="write the JSON summary to this file (never overwrites: a new name)")
    p.add_argument("--by", default="owner", help="owner (default): bytes per owner label; module: per nn.Module")
    p.add_argument("--depth", default="2", help="with --by=module: modules down to this depth (the root is 1; default 2)")
    p.add_argument("--step", default=None, help="with --by=module: this step (default: the step with the highest peak)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout instead of the table")
    try:
        a = p.parse_args(argv)
    except UsageError as e:
        return error_exit(str(e))
    if a.by not in ("owner", "module"):
        return error_exit(f"--by={a.by}: choose owner or module")
    nums = {}
    for opt, v in (("depth", a.depth), ("step", a.step)):
        try:
            nums[opt] = None if v is None else int(v)
        except ValueError:
            return error_exit(f"--{opt}={v}: not a whole number")
    depth, step = nums["depth"], nums["step"]
    if depth < 1:
        return error_exit(f"--depth={a.depth}: at least 1 (the root module)")
    if step is not None and step < 1:
        return error_exit(f"--step={a.step}: steps are numbered from 1")
    if step is not None and a.by != "module":
        return error_exit(f"--step={a.step}: works with --by=module (the owner table covers the whole run)")
    if a.output:
        d = os.path.dirname(os.path.abspath(a.output))
        if not os.path.isdir(d):
            return error_exit(f"-o {a.output}: folder {d} does not exist")
        if os.path.isdir(a.output):
            return error_exit(f"-o {a.output}: is a folder; give a file name")

    def one(path):
        if a.by == "owner":
            r = summarize_dump(path)
            return r, format_table(r)
        from ..io.reader import read_dump
        df = read_dump(path, columns=MODULE_COLUMNS_READ, events=EVENTS)
        # steps 1 to the STEP rows + 1 (the rows after the last STEP row are a step too)
        last = 1 + df.filter((df["event"] == Event.SYSTEM) & (df["event_type"] == System.STEP)).height
        if step is not None and step > last:
            raise DumpError(f"--step={step}: {path} has steps 1 to {last}")
        r = module_table(df, step)
        if not r:
            raise DumpError(f"{path}: no MALLOC row carries a module{'' if step is None else f' in step {step}'} "
                            "(trace with --analysis=decompose, or MSMEMSCOPE_MODULES=1)")
        for t in r.values():
            t["modules"] = fold_depth(t, depth)
        return r, format_modules(r, depth)
    try:
        rds = ranks_of_job(find_rank_dumps(a.dump), "msmemscope decompose")
        if len(rds) == 1:
            res, text = one(rds[0].path)
            print(json.dumps(res, indent=1) if a.json else text)
        else:  # one report per rank
            res = {"ranks": []}
            for rd in rds:
                r, text = one(rd.path)
                if not a.json:
                    print(heading(rd))
                    print(text)
                res["ranks"].append({"label": rd.label, "rank": rd.rank, "dump": rd.path, "result": r})
            if a.json:
                print(json.dumps(res, indent=1))
    except DumpError as e:
        return error_exit(str(e))
    if a.output:
        path = unique_path(a.output)
        try:
            with write_new(path) as f:
                json.dump(res, f, indent=1)
        except OSError as e:
            return error_exit(f"-o {a.output}: cannot write {path}: {e.strerror or e}")
        print(f"written to {path}", file=sys.stderr)
    return 0
