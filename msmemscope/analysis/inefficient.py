"""Inefficient memory (SPEC §4.5): early allocation, late deallocation, temporary idleness.

Operator level, per memory block. Positions on the op timeline:

* the *op index* of a row is the number of ``ATEN_START`` rows up to and including it;
* its *slot* is ``2*op`` while inside an op (between an ``ATEN_START`` and its
  ``ATEN_END``, both included) and ``2*op + 1`` outside any op. Slots never
  decrease along the dump, so "strictly between two ops" is a comparison of slots.

For a block allocated in slot ``sa``:

* **first access**: the first ``ACCESS`` by an op other than the allocating one
  (the allocating op's own output write does not count; a block first seen as an
  input, ``origin: before_op``, has no allocating op, so every access counts);
* **early_allocation**: another block was freed after the allocating op ended
  (or, for a block allocated outside any op, after its MALLOC row) and before
  the op of the first access started;
* **late_deallocation**: another block was allocated after the op of the last
  access ended and before the op that frees it started (or, for a free outside
  any op, before the FREE row). The allocating op counts as an access, so a
  block never used after it was made is late when others are allocated before
  it goes. A block never freed in the trace is not judged for this type;
* **temporary_idleness**: more than ``idle_threshold`` ops lie between two
  consecutive accesses (ops strictly between: ``op2 - op1 - 1``).

One implementation for both paths: :class:`Tracker` folds chunks of rows into a
table of live blocks (never a Python loop over rows: C++ loops, ``inefficient_fold`` in
msmemscope/_leakrule.cpp, where that module is built, else numpy, ``_fold``). Offline
the whole dump is one chunk; online every session flush is a chunk, so the
tracker's memory is the live blocks plus the blocks already flagged.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from ..events import (A_ALLOC_ID, A_SIZE, ACCESS_ALLOC_ID, ATTR, EVENT, EVENT_TYPE, NAME, PACKED_CHUNK,
                      PY_STACK, Event, Pool)

TYPES = ("early_allocation", "late_deallocation", "temporary_idleness")
_BIT = {t: 1 << i for i, t in enumerate(TYPES)}
DEFAULT_IDLE_THRESHOLD = 3000
IDLE_ENV = "MSMEMSCOPE_IDLE_THRESHOLD"
#: pools that are not tensor blocks (the original's driver-level HAL rows)
SKIP_POOLS = ("HAL",)
SEP = "|"  # several types in one Attr value
TOP = 10
INF = np.iinfo(np.int64).max

K_OTHER, K_START, K_END, K_MALLOC, K_FREE, K_ACCESS = 0, 1, 2, 3, 4, 5

# columns of one chunk (what both paths build)
CHUNK_SCHEMA = {"pos": pl.Int64, "kind": pl.Int8, "name": pl.String, "alloc_id": pl.Int64,
                "size": pl.Int64, "before": pl.Boolean, "stack": pl.String}

#: the numeric columns of the live blocks (``Tracker.b``)
_NUM = {
    "alloc_id": np.int64, "mpos": np.int64, "sa": np.int64, "aop": np.int64, "before": bool, "size": np.int64,
    "qf_slot": np.int64,      # slot of the first free of another block after the allocation (INF: none yet)
    "first_op": np.int64,     # op of the first access by another op (-1: none yet)
    "early": bool,
    "last_slot": np.int64, "last_pos": np.int64,   # last access (the allocation until then)
    "qm_slot": np.int64, "qm_pos": np.int64,       # first malloc of another block after the last access
    "prev_op": np.int64,      # op of the last counted access (-1: none yet), for idleness
    "max_gap": np.int64,      # largest number of ops between two consecutive accesses (-1: none)
}
_RESULT_SCHEMA = {"alloc_id": pl.Int64, "mpos": pl.Int64, "size": pl.Int64, "op": pl.String, "stack": pl.String,
                  "first_op": pl.Int64, "aop": pl.Int64, "max_gap": pl.Int64, "bits": pl.Int64}


def _first_after(keys: np.ndarray, vals: np.ndarray, after: np.ndarray, out_vals: list[np.ndarray]):
    """For each ``after``, the values of the first element with key > after (INF where none)."""
    idx = np.searchsorted(keys, after, side="right")
    ok = idx < len(keys)
    res = []
    for v in out_vals:
        r = np.full(len(after), INF, dtype=np.int64)
        if len(keys):
            r[ok] = v[idx[ok]]
        res.append(r)
    return res


def _first_qualifying(ev_pos, ev_slot, slot, pos):
    """First event (of the chunk's sorted ``ev_pos``/``ev_slot``) after a point given as
    (slot, pos): after the end of the op when ``slot`` is inside an op (even), else
    after the row itself. Returns (slot, pos) arrays, INF where there is none."""
    even = (slot % 2) == 0
    s1, p1 = _first_after(ev_slot, ev_slot, slot, [ev_slot, ev_pos])
    s2, p2 = _first_after(ev_pos, ev_slot, pos, [ev_slot, ev_pos])
    return np.where(even, s1, s2), np.where(even, p1, p2)


FOLD_ENV = "MSMEMSCOPE_INEFFICIENT_FOLD"  # numpy: the numpy fold even where the C++ one is built


def _native_fold():
    """The C++ fold (``inefficient_fold`` in msmemscope/_leakrule.cpp), or None: not built, or
    ``MSMEMSCOPE_INEFFICIENT_FOLD=numpy``."""
    if os.environ.get(FOLD_ENV, "").strip().lower() == "numpy":
        return None
    from .. import leak_native
    mod = leak_native.load_module()
    return getattr(mod, "inefficient_fold", None) if mod is not None else None


def _fold(kind, pos, aid, has_aid, before_col, size_col, k, depth, old):
    """One chunk folded into the live blocks ``old`` (the ``_NUM`` columns) with numpy: returns the
    blocks after it (``old``'s, then the chunk's new ones), the rows of the new blocks, whether
    each of those rows is inside an op, and which blocks the chunk freed and found late."""
    st, en = kind == K_START, kind == K_END
    cs, ce = np.cumsum(st, dtype=np.int64), np.cumsum(en, dtype=np.int64)
    op = k + cs
    slot = 2 * op + ((depth + cs - ce + en) <= 0)
    mi, fi, ai = (np.flatnonzero(kind == kd) for kd in (K_MALLOC, K_FREE, K_ACCESS))
    m_pos, m_slot = pos[mi], slot[mi]
    f_pos, f_slot = pos[fi], slot[fi]

    # new blocks: the first MALLOC of each allocation id that is not live already
    # (a MALLOC without an id is never matched, so it can never be flagged)
    mk = mi[has_aid[mi]]
    if len(mk):
        _, first = np.unique(aid[mk], return_index=True)
        mk = mk[np.sort(first)]
        if len(old["alloc_id"]):
            mk = mk[~np.isin(aid[mk], old["alloc_id"])]
    n_old = len(old["alloc_id"])
    if len(mk) or n_old == 0:
        k_new = len(mk)
        new = {"alloc_id": aid[mk], "mpos": pos[mk], "sa": slot[mk], "aop": op[mk], "before": before_col[mk],
               "size": size_col[mk], "qf_slot": np.full(k_new, INF),
               "first_op": np.full(k_new, -1), "early": np.zeros(k_new, bool), "last_slot": slot[mk],
               "last_pos": pos[mk], "qm_slot": np.full(k_new, INF), "qm_pos": np.full(k_new, INF),
               "prev_op": np.full(k_new, -1), "max_gap": np.full(k_new, -1)}
        b = {c: np.concatenate([old[c], new[c].astype(t, copy=False)]) for c, t in _NUM.items()}
    else:
        b = {c: v.copy() for c, v in old.items()}
    nb = len(b["alloc_id"])
    mk_inside = slot[mk] % 2 == 0
    if nb == 0:
        return b, mk, mk_inside, np.zeros(0, bool), np.zeros(0, bool)
    lo, hi = int(b["alloc_id"].min()), int(b["alloc_id"].max())
    if hi - lo < 8 * nb + 4096:  # ids are mostly dense: a table indexed by id
        table = np.full(hi - lo + 1, -1, dtype=np.int64)
        table[b["alloc_id"] - lo] = np.arange(nb)

        def block_of(rows):
            """The block index of each of ``rows`` (chunk positions with an id), -1 where none."""
            v = aid[rows] - lo
            ok = (v >= 0) & (v <= hi - lo)
            return np.where(ok, table[np.where(ok, v, 0)], -1)
    else:
        order = np.argsort(b["alloc_id"], kind="stable")
        ids_sorted = b["alloc_id"][order]

        def block_of(rows):
            j = np.minimum(np.searchsorted(ids_sorted, aid[rows]), nb - 1)
            return np.where(ids_sorted[j] == aid[rows], order[j], -1)

    newly = np.zeros(nb, bool)
    ak = ai[has_aid[ai]]
    if len(ak):
        bi = block_of(ak)
        ak, bi = ak[bi >= 0], bi[bi >= 0]
    if len(ak):
        a_slot, a_op, a_pos = slot[ak], op[ak], pos[ak]
        g = np.argsort(bi, kind="stable")  # accesses grouped by block, in dump order inside each
        bg = bi[g]
        brk = np.flatnonzero(np.r_[True, bg[1:] != bg[:-1]])
        last = np.r_[brk[1:], len(bg)] - 1
        blk = bg[brk]
        # the last access of each block (positions and slots never decrease along the dump)
        b["last_slot"][blk] = a_slot[g[last]]
        b["last_pos"][blk] = a_pos[g[last]]
        b["qm_slot"][blk] = INF
        b["qm_pos"][blk] = INF
        # counted accesses: by another op than the allocating one (every access of a before_op block)
        cg = g[(b["before"][bi] | (a_slot != b["sa"][bi]))[g]]
        if len(cg):
            cb, cop = bi[cg], a_op[cg]
            cbrk = np.flatnonzero(np.r_[True, cb[1:] != cb[:-1]])
            clast = np.r_[cbrk[1:], len(cb)] - 1
            cblk = cb[cbrk]
            prev = np.empty_like(cop)
            prev[1:] = cop[:-1]
            prev[cbrk] = b["prev_op"][cblk]
            gap = np.where(prev >= 0, cop - prev - 1, -1)
            fresh = b["first_op"][cblk] < 0
            newly[cblk[fresh]] = True
            b["first_op"][cblk[fresh]] = cop[cbrk][fresh]
            b["prev_op"][cblk] = cop[clast]
            b["max_gap"][cblk] = np.maximum(b["max_gap"][cblk], np.maximum.reduceat(gap, cbrk))

    # the first free / malloc of another block after the allocation / the last access
    todo = b["qf_slot"] == INF
    if todo.any() and len(f_pos):
        b["qf_slot"][todo], _ = _first_qualifying(f_pos, f_slot, b["sa"][todo], b["mpos"][todo])
    todo = b["qm_slot"] == INF
    if todo.any() and len(m_pos):
        b["qm_slot"][todo], b["qm_pos"][todo] = _first_qualifying(m_pos, m_slot, b["last_slot"][todo],
                                                                  b["last_pos"][todo])
    b["early"] |= newly & (b["qf_slot"] < 2 * b["first_op"])

    # blocks freed in this chunk (their first FREE) are judged now
    freed = np.zeros(nb, bool)
    late = np.zeros(nb, bool)
    fk = fi[has_aid[fi]]
    if len(fk):
        _, first = np.unique(aid[fk], return_index=True)
        fk = fk[first]
        fb = block_of(fk)
        fk, fb = fk[fb >= 0], fb[fb >= 0]
        fs, fp = slot[fk], pos[fk]
        freed[fb] = True
        late[fb] = np.where(fs % 2 == 0, b["qm_slot"][fb] < fs, b["qm_pos"][fb] < fp)
    return b, mk, mk_inside, freed, late


#: rows of a dump's chunk fed at a time (``Tracker.feed_all``)
FEED_ROWS = 1 << 20


class Tracker:
    """The incremental state of the analysis. ``feed(chunk)`` any number of times, then ``finish()``.

    The live blocks are numpy columns (``_NUM``) plus their op name and stack (a polars frame,
    ``self.text``, row for row); each chunk is folded by ``_native_fold()`` or ``_fold``, with
    the same result. In numpy's, accesses and frees are matched to blocks by a search over the
    sorted allocation ids, and the per-block aggregates (first and last counted access, largest
    gap) are segment reductions over the accesses grouped by block; C++ takes the same steps as
    loops. The strings of a new block are gathered only when it is flagged or stays
    live, so a chunk's many short-lived blocks never copy their stacks. ``texts`` False: no op
    name or stack is gathered at all (null), for a caller that wants only the totals."""

    def __init__(self, idle_threshold: int = DEFAULT_IDLE_THRESHOLD, texts: bool = True, top: int | None = None):
        self.idle_threshold = int(idle_threshold)
        self.texts = texts
        # ``top``: keep only what the online sink's close reads (the compact form): of every flagged
        # block its ID, row, size and bits, and the op name and stack of the ``top`` largest (by
        # size, then row) only; the other columns are null in ``finish()``'s frame
        self.top = top
        self.best = pl.DataFrame(schema=_RESULT_SCHEMA)  # (compact) the top largest flagged so far, whole
        self.k = 0            # ATEN_START rows so far
        self.depth = 0        # open ops
        self.op_name = None   # name of the current/last op
        self.b = {c: np.empty(0, dtype=t) for c, t in _NUM.items()}
        self.text = pl.DataFrame(schema={"op": pl.String, "stack": pl.String})
        self.flagged: list[pl.DataFrame] = []
        self.counts = {"malloc": 0, "free": 0, "access": 0, "ops": 0}

    def feed_all(self, ch: pl.DataFrame, rows: int = FEED_ROWS) -> None:
        """``feed`` a whole dump's chunk in slices of ``rows``: the same result (the state carries
        over), and each slice's arrays reuse the memory of the one before. Fed whole, 10M rows'
        arrays are fresh memory, whose first touch cost more than the work (3.9 s against 1.5 s)."""
        for i in range(0, ch.height, rows):
            self.feed(ch.slice(i, rows))

    # -------------------------------------------------------------- one chunk
    def feed(self, ch) -> None:
        """Fold one chunk: a frame of ``CHUNK_SCHEMA`` (offline) or its ``Columns`` (online)."""
        c = ch if type(ch) is Columns else Columns.of_frame(ch)
        n = c.n
        if n == 0:
            return
        kind = c.kind
        st, en = kind == K_START, kind == K_END
        names = c.names
        # the op name of a row: the last START row (with a name) up to it, else the chunk before's
        named_starts = np.flatnonzero(st & names.not_null())

        def last_start(rows):
            j = np.searchsorted(named_starts, rows, side="right") - 1
            return np.where(j >= 0, named_starts[np.maximum(j, 0)] if len(named_starts) else -1, -1)
        op_before = self.op_name
        n_start, n_end = int(np.count_nonzero(st)), int(np.count_nonzero(en))
        k0, depth0 = self.k, self.depth
        self.k += n_start
        self.depth = max(0, self.depth + n_start - n_end)
        if len(named_starts):
            self.op_name = names.at(int(named_starts[-1]))
        self.counts["ops"] += n_start
        self.counts["malloc"] += int(np.count_nonzero(kind == K_MALLOC))
        self.counts["free"] += int(np.count_nonzero(kind == K_FREE))
        self.counts["access"] += int(np.count_nonzero(kind == K_ACCESS))

        n_old = len(self.b["alloc_id"])
        cols = (kind, c.pos, c.aid, c.aid_ok, c.before, c.size)
        fold = _native_fold()
        if fold is not None:
            b, mk, mk_inside, freed, late = fold(*cols, k0, depth0, self.b)
        else:
            b, mk, mk_inside, freed, late = _fold(*cols, k0, depth0, self.b)
        nb = len(b["alloc_id"])
        if nb == 0:
            return
        bits = self._bits(b, late)
        flag = freed & (bits > 0)
        keep = ~freed

        def text_of(idx):
            """op and stack of blocks ``idx`` (ascending): carried rows, then this chunk's new blocks."""
            if not self.texts:
                return _no_text(len(idx))
            old, nw = idx[idx < n_old], idx[idx >= n_old] - n_old
            parts = [self.text[old]] if len(old) else []
            if len(nw):
                rows = mk[nw]
                inside = mk_inside[nw]
                ls = last_start(rows)
                src = np.where(inside & (ls >= 0), ls, rows)
                opn = names.gather(src)
                if op_before is not None:  # inside an op opened in an earlier chunk
                    opn = pl.select(pl.when(pl.Series(inside & (ls < 0))).then(pl.lit(op_before))
                                    .otherwise(opn)).to_series()
                parts.append(pl.DataFrame({"op": opn, "stack": c.stacks.gather(rows)}))
            if not parts:
                return self.text.clear()
            return pl.concat(parts, how="vertical")

        self._flag(b, np.flatnonzero(flag), bits, text_of)
        kept = np.flatnonzero(keep)
        self.text = text_of(kept)
        self.b = {c: v[kept] for c, v in b.items()}

    def _bits(self, b, late):
        return (b["early"].astype(np.int64) * _BIT["early_allocation"]
                + late.astype(np.int64) * _BIT["late_deallocation"]
                + (b["max_gap"] > self.idle_threshold).astype(np.int64) * _BIT["temporary_idleness"])

    def _flag(self, b, idx, bits, text_of):
        if not len(idx):
            return
        if self.top is None:
            self.flagged.append(_whole_rows(b, idx, bits, text_of(idx)))
            return
        # the compact form: the numbers every flagged block needs, and whole rows for the ``top``
        # largest so far (texts made for this chunk's candidates only: its own largest, by size
        # descending, then row ascending)
        size, mpos = b["size"][idx], b["mpos"][idx]
        self.flagged.append(pl.DataFrame({"alloc_id": b["alloc_id"][idx], "mpos": mpos, "size": size,
                                          "bits": bits[idx]}))
        cand = np.sort(idx[np.lexsort((mpos, -size))[:self.top]])
        self.best = (pl.concat([self.best, _whole_rows(b, cand, bits, text_of(cand))], how="vertical")
                     .sort(["size", "mpos"], descending=[True, False]).head(self.top))

    def finish(self, ordered: bool = True) -> pl.DataFrame:
        """Judge the blocks still live (not late: their free is not in the trace); all flagged
        blocks (in allocation order; ``ordered`` False: in no order, for totals)."""
        b = self.b
        bits = self._bits(b, np.zeros(len(b["alloc_id"]), bool))
        text = self.text
        self._flag(b, np.flatnonzero(bits > 0), bits,
                   (lambda idx: text[idx]) if self.texts else (lambda idx: _no_text(len(idx))))
        self.b = {c: np.empty(0, dtype=t) for c, t in _NUM.items()}
        self.text = text.clear()
        if not self.flagged:
            return pl.DataFrame(schema=_RESULT_SCHEMA)
        res = pl.concat(self.flagged, how="vertical")
        self.flagged = [res]
        if self.top is not None:  # every column, whole for the top largest, null elsewhere
            whole = self.best.drop("alloc_id", "size", "bits")
            res = (res.join(whole, on="mpos", how="left")
                   .select(list(_RESULT_SCHEMA)).cast(_RESULT_SCHEMA))
        return res.sort("mpos") if ordered else res


def _whole_rows(b, idx, bits, t) -> pl.DataFrame:
    """The result rows (``_RESULT_SCHEMA``) of blocks ``idx`` of ``b``, ``t`` their op and stack."""
    return pl.DataFrame({
        "alloc_id": b["alloc_id"][idx], "mpos": b["mpos"][idx], "size": b["size"][idx], "op": t["op"],
        "stack": t["stack"], "first_op": b["first_op"][idx], "aop": b["aop"][idx],
        "max_gap": b["max_gap"][idx], "bits": bits[idx]}).cast(_RESULT_SCHEMA)


def _no_text(n: int) -> pl.DataFrame:
    """``n`` rows of no op and no stack (a Tracker without texts)."""
    none = pl.Series(dtype=pl.String).extend_constant(None, n)
    return pl.DataFrame({"op": none, "stack": none})


# ------------------------------------------------------------------ chunks from the two sources
def _kind_expr():
    """The row kind the tracker works on, from the ``event`` / ``event_type`` columns."""
    ev, et = pl.col("event"), pl.col("event_type")
    return (pl.when((ev == "OP_LAUNCH") & (et == "ATEN_START")).then(K_START)
            .when((ev == "OP_LAUNCH") & (et == "ATEN_END")).then(K_END)
            .when((ev == "MALLOC") & ~et.is_in(SKIP_POOLS)).then(K_MALLOC)
            .when((ev == "FREE") & ~et.is_in(SKIP_POOLS)).then(K_FREE)
            .when(ev == "ACCESS").then(K_ACCESS)
            .otherwise(K_OTHER).cast(pl.Int8))


#: what the analysis reads of a dump (``io.reader.read_dump(path, columns=COLUMNS, events=EVENTS)``)
COLUMNS = ("id", "event", "event_type", "name", "alloc_id", "size", "py_stack", "origin")
EVENTS = ("OP_LAUNCH", "MALLOC", "FREE", "ACCESS")


def chunk_from_frame(df: pl.DataFrame) -> pl.DataFrame:
    """Chunk columns from the reader's columns (``COLUMNS``; a full ``read_dump`` frame works too)."""
    ev = pl.col("event")
    kind = _kind_expr()
    if "origin" in df.columns:
        before = (ev == "MALLOC") & (pl.col("origin") == "before_op").fill_null(False)
    else:
        before = (ev == "MALLOC") & pl.col("attr").str.contains("before_op", literal=True)
    k = pl.col("kind")
    ch = (df.lazy().select("id", "name", "alloc_id", "size", "py_stack", kind=kind, before=before)
          .filter(k != K_OTHER)
          .select(pos="id", kind=k, name=pl.when(k.is_in([K_START, K_MALLOC])).then("name"),
                  alloc_id="alloc_id", size=pl.when(k == K_MALLOC).then("size"), before="before",
                  stack=pl.when(k == K_MALLOC).then("py_stack"))
          .collect())
    return ch.cast(CHUNK_SCHEMA)


def read_chunk(path: str) -> pl.DataFrame:
    """The analysis' chunk of one dump, through the reader's column layer."""
    from ..io.reader import read_dump
    return chunk_from_frame(read_dump(path, columns=COLUMNS, events=EVENTS))


_KIND = {("OP_LAUNCH", "ATEN_START"): K_START, ("OP_LAUNCH", "ATEN_END"): K_END}


def chunk_from_rows(rows, first_id: int) -> pl.DataFrame:
    """Chunk columns from a session's raw row tuples (the online path)."""
    idx, kinds, names, aids, sizes, before, stacks = [], [], [], [], [], [], []
    for i, r in enumerate(rows):
        ev = r[EVENT]
        if ev == Event.OP_LAUNCH:
            k = _KIND.get((ev, r[EVENT_TYPE]))
            if k is None:
                continue
            a = None
            sz = None
        elif ev == Event.ACCESS:
            k = K_ACCESS
            a = r[ATTR]
            a = a[ACCESS_ALLOC_ID] if type(a) is tuple else a.get("allocation_id")
            sz = None
        elif ev == Event.MALLOC or ev == Event.FREE:
            if r[EVENT_TYPE] in SKIP_POOLS:
                continue
            k = K_MALLOC if ev == Event.MALLOC else K_FREE
            at = r[ATTR]
            if type(at) is tuple:
                a, sz, bf = at[A_ALLOC_ID], at[A_SIZE], False
            else:
                a, sz, bf = at.get("allocation_id"), at.get("size"), at.get("origin") == "before_op"
            if k == K_MALLOC:
                idx.append(i); kinds.append(k); names.append(r[NAME]); aids.append(a); sizes.append(sz)
                before.append(bf); stacks.append(r[PY_STACK])
                continue
        else:
            continue
        idx.append(i); kinds.append(k); names.append(r[NAME] if k == K_START else None); aids.append(a)
        sizes.append(sz); before.append(None); stacks.append(None)
    return pl.DataFrame({"pos": np.asarray(idx, dtype=np.int64) + first_id, "kind": kinds, "name": names,
                         "alloc_id": aids, "size": sizes, "before": before, "stack": stacks},
                        schema=CHUNK_SCHEMA)


class Texts:
    """A string column as the tracker reads it: which rows have a text, one row's text, the texts
    of some rows (a String series). Of a polars series (``Texts(series)``, offline) or, online, of
    the codes of each flush's columns into its distinct strings (``of_codes``): only the strings of
    the rows asked for are made, not a column of every row."""
    __slots__ = ("series", "codes", "uniq")

    def __init__(self, series=None, codes=None, uniq=None):
        self.series, self.codes, self.uniq = series, codes, uniq

    @classmethod
    def of_codes(cls, parts, codes_at, uniq_at):
        """Each part's int32 codes (-1: none) into its own distinct strings, as one column."""
        codes, uniq = [], []
        for p in parts:
            c = np.frombuffer(p[codes_at], dtype=np.int32).astype(np.int64)
            codes.append(np.where(c >= 0, c + len(uniq), -1))
            uniq.extend(p[uniq_at])
        c = np.concatenate(codes) if codes else np.empty(0, np.int64)
        return cls(codes=c, uniq=uniq)

    def not_null(self) -> np.ndarray:
        return self.series.is_not_null().to_numpy() if self.codes is None else self.codes >= 0

    def at(self, i: int):
        if self.codes is None:
            return self.series[i]
        k = int(self.codes[i])
        return self.uniq[k] if k >= 0 else None

    def gather(self, idx) -> pl.Series:
        if self.codes is None:
            return self.series.gather(idx)
        c = self.codes[idx]
        # the texts by code, and one null past them for the rows that have none
        return pl.Series(self.uniq + [None], dtype=pl.String).gather(np.where(c >= 0, c, len(self.uniq)))


class Columns:
    """A chunk as the tracker folds it: numpy columns (``kind``, ``pos``, ``aid`` with ``aid_ok``,
    ``before``, ``size``; 0 / False where the frame has null) and the op names and stacks as
    ``Texts``. Online it is made from the native columns of one or more flushes (``of_parts``:
    ``chunk_columns`` of row tuples, or ``take_packed``'s chunk of the records) with no frame and no
    string per row; offline from a ``CHUNK_SCHEMA`` frame (``of_frame``)."""
    __slots__ = ("n", "kind", "pos", "aid", "aid_ok", "before", "before_ok", "size", "size_ok", "names", "stacks")

    @classmethod
    def of_parts(cls, parts):
        def cat(j, dtype):
            return np.frombuffer(b"".join(p[j] for p in parts), dtype=dtype)
        c = cls()
        c.pos, c.kind = cat(0, np.int64), cat(1, np.int8)
        c.aid, c.aid_ok = cat(2, np.int64), cat(3, np.bool_)
        c.size, c.size_ok = cat(4, np.int64), cat(5, np.bool_)
        before = cat(6, np.int8)  # -1: none
        c.before, c.before_ok = before == 1, before >= 0
        c.names, c.stacks = Texts.of_codes(parts, 7, 8), Texts.of_codes(parts, 9, 10)
        c.n = len(c.pos)
        return c

    @classmethod
    def of_frame(cls, ch: pl.DataFrame):
        c = cls()
        c.n = ch.height
        c.kind, c.pos = ch["kind"].to_numpy(), ch["pos"].to_numpy()
        aid = ch["alloc_id"]
        c.aid, c.aid_ok = aid.fill_null(0).to_numpy(), aid.is_not_null().to_numpy()
        c.before = ch["before"].fill_null(False).to_numpy().astype(bool, copy=False)
        c.before_ok = ch["before"].is_not_null().to_numpy()
        c.size, c.size_ok = ch["size"].fill_null(0).to_numpy(), ch["size"].is_not_null().to_numpy()
        c.names, c.stacks = Texts(ch["name"]), Texts(ch["stack"])
        return c

    def frame(self) -> pl.DataFrame:
        """The chunk as a ``CHUNK_SCHEMA`` frame, nulls where the rows have none (what
        ``chunk_from_rows`` makes of the same rows)."""
        every = np.arange(self.n)
        df = pl.DataFrame({"pos": self.pos, "kind": self.kind, "name": self.names.gather(every),
                           "alloc_id": self.aid, "aid_ok": self.aid_ok, "size": self.size, "size_ok": self.size_ok,
                           "before": self.before, "before_ok": self.before_ok, "stack": self.stacks.gather(every)})
        return df.select(
            "pos", "kind", "name", alloc_id=pl.when("aid_ok").then("alloc_id"), size=pl.when("size_ok").then("size"),
            before=pl.when("before_ok").then("before"), stack="stack").cast(CHUNK_SCHEMA)


def chunk_from_columns(parts) -> pl.DataFrame:
    """``chunk_from_rows``'s frame from the native ``chunk_columns`` of one or more flushes (in
    order); the tracker itself reads them as ``Columns.of_parts``."""
    return Columns.of_parts(parts).frame()


# ------------------------------------------------------------------ results
def type_names(bits: int, wanted=TYPES) -> list[str]:
    return [t for t in TYPES if bits & _BIT[t] and t in wanted]


def _mask(types) -> int:
    return sum(_BIT[t] for t in types)


def select(res: pl.DataFrame, mem_size: int = 0, types=TYPES) -> pl.DataFrame:
    """Apply the filters: blocks of at least ``mem_size`` bytes, flagged with one of ``types``."""
    mask = _mask(types)
    return (res.filter((pl.col("size") >= mem_size) & ((pl.col("bits") & mask) > 0))
            .with_columns(bits=pl.col("bits") & mask)
            .with_columns(inefficient_type=pl.concat_str(
                [pl.when((pl.col("bits") & _BIT[t]) > 0).then(pl.lit(t)) for t in TYPES],
                separator=SEP, ignore_nulls=True)))


from ..frames import user_line as _user_line  # noqa: E402


def totals(res: pl.DataFrame, types=TYPES) -> dict:
    """What ``summarize`` says of ``select(res)``'s blocks in number (``blocks``, ``bytes``,
    ``by_type``), without naming the worst: no type texts made, nothing sorted."""
    return _counts(res.select("size", bits=pl.col("bits") & _mask(types)).filter(pl.col("bits") > 0))


def _counts(sel: pl.DataFrame) -> dict:
    """``by_type``, ``blocks`` and ``bytes`` of selected blocks (their ``bits`` masked to the types asked for)."""
    by_type = {}
    for t in TYPES:
        s = sel.filter((pl.col("bits") & _BIT[t]) > 0)
        by_type[t] = {"count": s.height, "bytes": int(s["size"].sum() or 0)}
    return {"by_type": by_type, "blocks": sel.height, "bytes": int(sel["size"].sum() or 0)}


def summarize(sel: pl.DataFrame, counts: dict, idle_threshold: int, note: str | None = None) -> dict:
    worst = sel.sort(["size", "mpos"], descending=[True, False]).head(TOP)
    return {
        "idle_threshold": idle_threshold,
        "events": counts,
        **_counts(sel),
        "worst": [{"allocation_id": r["alloc_id"], "row_id": r["mpos"], "size": r["size"],
                   "op": r["op"], "python_line": _user_line(r["stack"]), "types": r["inefficient_type"].split(SEP)}
                  for r in worst.iter_rows(named=True)],
        "note": note,
    }


def format_summary(s: dict, where: str | None = None) -> str:
    from ..report.console import mb
    lines = [f"[msmemscope] inefficient memory (idle threshold {s['idle_threshold']} ops)"
             + (f": {where}" if where else "")]
    if s.get("note"):
        lines.append(f"  {s['note']}")
        return "\n".join(lines)
    for t, v in s["by_type"].items():
        lines.append(f"  {t}: {v['count']} blocks, {mb(v['bytes'])}")
    if s["worst"]:
        lines.append("  largest flagged blocks:")
        for w in s["worst"]:
            op = (w["op"] or "N/A").replace("torch._ops.", "")
            line = w["python_line"] or "N/A (for the line: --call-stack=python, or msmemscope.config(call_stack=\"python\"))"
            lines.append(f"    {w['size']} B  {'+'.join(w['types'])}  op {op}  at {line}  "
                         f"(allocation_id {w['allocation_id']}, row {w['row_id']})")
    return "\n".join(lines)


# ------------------------------------------------------------------ writing the annotation
_OLD_TYPE = re.compile(r'"?inefficient_type"?\s*:\s*"?[^",}]*"?\s*,?')


def _add_type(attr: str | None, value: str | None) -> str:
    """Attr with ``inefficient_type`` set to ``value`` (removed when None), in the form the Attr
    already has (JSON or the original's unquoted keys); an earlier annotation is replaced."""
    a = (attr or "").strip()
    if not a.startswith("{"):
        a = "{}"
    body = _OLD_TYPE.sub("", a[1:-1]).strip().rstrip(",")
    if value is None:
        return "{" + body + "}"
    quoted = body.startswith('"') or not body
    item = f'"inefficient_type":"{value}"' if quoted else f"inefficient_type:{value}"
    return "{" + (body + "," if body else "") + item + "}"


def _csv_field(v: str) -> str:
    if '"' in v or "," in v or "\n" in v or "\r" in v:
        return '"' + v.replace('"', '""') + '"'
    return v


def annotate_csv(src: str, dst_file, marks: dict[int, str]) -> int:
    """Copy the CSV ``src`` to the open binary file ``dst_file``, adding ``inefficient_type`` to the
    Attr of the rows whose ID is in ``marks``. Streams (bounded memory); a row that spans lines
    (a quoted newline) is copied as it is. Returns the number of rows changed."""
    import csv
    import io
    from ..io.reader import open_text
    changed = 0
    in_quote = False
    with open_text(src) as f:  # a .csv.zst dump is read decompressed (the copy is plain CSV)
        for line in f:
            if not in_quote:
                c = line.find(b",")
                if c > 0 and line[:c].isdigit() and line.startswith(b"MALLOC,", c + 1):
                    rid = int(line[:c])
                    val = marks.get(rid)
                    if (val is not None or b"inefficient_type" in line) and line.count(b'"') % 2 == 0:
                        text = line.decode("utf-8")
                        end = text[len(text.rstrip("\r\n")):]
                        fields = next(csv.reader(io.StringIO(text.rstrip("\r\n"))))
                        if len(fields) == 12:
                            fields[9] = _add_type(fields[9], val)
                            out = ",".join(_csv_field(x) if i != 9 else '"' + x.replace('"', '""') + '"'
                                           for i, x in enumerate(fields))
                            dst_file.write((out + (end or "\n")).encode("utf-8"))
                            changed += 1
                            continue
            if line.count(b'"') % 2:
                in_quote = not in_quote
            dst_file.write(line)
    return changed


def annotate_db(path: str, marks: dict[int, str]) -> int:
    """Set ``inefficient_type`` on the MALLOC rows of the db dump ``path`` whose ID ``marks`` names
    (and take it off the rows an earlier annotation marked that ``marks`` does not name). One pass
    over the table: the marks go to a temporary table joined on ID (the dump's ID column has no
    index, so a lookup per mark was a scan per mark: a 1M-row dump with ~10^5 flagged blocks did
    not finish in 13 minutes); the rows are then updated by rowid."""
    con = sqlite3.connect(path)
    try:
        with con:
            con.execute("CREATE TEMP TABLE msmemscope_marks (id INTEGER PRIMARY KEY, val TEXT)")
            con.executemany("INSERT OR REPLACE INTO msmemscope_marks VALUES (?, ?)", marks.items())
            rows = con.execute(
                "SELECT d.rowid, d.Attr, m.val FROM memscope_dump d LEFT JOIN msmemscope_marks m ON m.id = d.ID "
                "WHERE d.Event='MALLOC' AND (m.id IS NOT NULL OR d.Attr LIKE '%inefficient_type%')").fetchall()
            con.executemany("UPDATE memscope_dump SET Attr=? WHERE rowid=?",
                            [(_add_type(attr, val), rowid) for rowid, attr, val in rows])
            con.execute("DROP TABLE msmemscope_marks")
        return len(rows)
    finally:
        con.close()


def _is_db(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(16).startswith(b"SQLite format 3")


def _plain_name(base: str) -> str:
    """The name of a dump's plain form (``x.csv.zst`` -> ``x.csv``)."""
    return base[:-4] if base.endswith(".csv.zst") else base


def write_annotated_copy(src: str, marks: dict[int, str]) -> str:
    """A new file beside ``src`` (``inefficient_<name>``; never overwrites): the dump with the annotation."""
    from ..io.files import remove_quietly, unique_path, write_new
    d, base = os.path.split(src)
    dst = unique_path(os.path.join(d, "inefficient_" + _plain_name(base)))
    with write_new(dst, binary=True) as out:
        if _is_db(src):
            with open(src, "rb") as f:
                shutil.copyfileobj(f, out)
        else:
            annotate_csv(src, out, marks)
    if _is_db(dst):
        try:
            annotate_db(dst, marks)
        except BaseException:
            remove_quietly(dst)  # no copy without its annotation
            raise
    return dst


def annotate_in_place(path: str, marks: dict[int, str]) -> None:
    """The online run's own dump: SQLite is updated in one transaction; a CSV is rewritten to a
    hidden temporary file beside it and moved over it atomically, so the dump is whole at every moment."""
    if not marks:
        return
    if _is_db(path):
        annotate_db(path, marks)
        return
    from ..io.files import create_new
    d, base = os.path.split(path)
    tmp = os.path.join(d, f".{base}.inefficient.tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    try:
        with create_new(tmp, binary=True) as out:
            if path.endswith(".csv.zst"):  # --compress=zstd: the annotated dump stays compressed
                import zstandard
                with zstandard.ZstdCompressor(level=3, write_checksum=True).stream_writer(out, closefd=False) as z:
                    annotate_csv(path, z, marks)
            else:
                annotate_csv(path, out, marks)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def marks_of(sel: pl.DataFrame) -> dict[int, str]:
    return dict(zip(sel["mpos"].to_list(), sel["inefficient_type"].to_list()))


# ------------------------------------------------------------------ offline API
@dataclass
class InefficientResult:
    """``blocks``: one row per flagged block (``alloc_id``, ``mpos`` = the MALLOC row's ID, ``size``,
    ``op``, ``stack``, ``first_op``, ``aop``, ``max_gap``, ``inefficient_type``); ``summary`` as in
    the JSON file; ``output``: the annotated copy of the dump (None when nothing was written)."""
    blocks: pl.DataFrame
    summary: dict
    output: str | None = None
    summary_path: str | None = None
    note: str | None = None
    extra: dict = field(default_factory=dict)

    def __len__(self):
        return self.blocks.height


def _check_types(inefficient_type) -> tuple:
    if inefficient_type is None:
        return TYPES
    if isinstance(inefficient_type, str):
        inefficient_type = [x for x in inefficient_type.replace("，", ",").split(",") if x.strip()]
    types = tuple(t.strip() for t in inefficient_type)
    bad = [t for t in types if t not in TYPES]
    if bad or not types:
        raise ValueError(f"inefficient_type: unknown value {bad[0] if bad else '(empty)'!r} "
                         f"(allowed: {', '.join(TYPES)})")
    return types


def _check_int(name, v, minimum=0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        try:
            v = int(str(v), 0)
        except ValueError:
            raise ValueError(f"{name}: '{v}' is not a whole number") from None
    if v < minimum:
        raise ValueError(f"{name}: {v} must be at least {minimum}")
    return int(v)


def analyze_frame(df: pl.DataFrame, idle_threshold=DEFAULT_IDLE_THRESHOLD):
    """Raw result (all types, no filter) and event counts for a ``read_dump`` frame."""
    tr = Tracker(idle_threshold)
    tr.feed_all(chunk_from_frame(df))
    return tr.finish(), tr.counts


NO_ACCESS_NOTE = ("the dump has no ACCESS rows (recorded without --events=access, or by the original tool "
                  "without access events): inefficient memory cannot be judged")
NO_OPS_NOTE = ("the dump has no ATEN_START rows (recorded without --events=launch, or with --level=kernel "
               "alone): op positions are unknown")


def check_inefficient(input_path: str, mem_size: int = 0, inefficient_type=TYPES,
                      idle_threshold: int = DEFAULT_IDLE_THRESHOLD, write: bool = True,
                      quiet: bool = False) -> InefficientResult:
    """Find inefficient memory blocks in a dump (CSV or db, ours or the original's).

    ``mem_size``: leave out blocks smaller than this many bytes. ``inefficient_type``: the types
    to report (list or comma-separated). ``idle_threshold``: more than this many ops between two
    consecutive accesses is temporary idleness. Unless ``write=False``, writes beside the dump
    ``inefficient_<dump name>`` (the dump with ``inefficient_type`` in the Attr of flagged MALLOC
    rows) and ``inefficient_<dump stem>.json`` (the summary); the input is never changed."""
    from ..io.reader import resolve_one
    types = _check_types(inefficient_type)
    mem_size = _check_int("mem_size", mem_size)
    idle_threshold = _check_int("idle_threshold", idle_threshold)
    path = resolve_one(input_path)
    ch = read_chunk(path)
    note = None
    if not (ch["kind"] == K_ACCESS).any():
        note = NO_ACCESS_NOTE
    elif not (ch["kind"] == K_START).any():
        note = NO_OPS_NOTE
    tr = Tracker(idle_threshold)
    if not note:
        tr.feed_all(ch)
    del ch
    raw, counts = tr.finish(), tr.counts
    sel = select(raw, mem_size, types)
    summary = summarize(sel, counts, idle_threshold, note)
    summary.update(input=path, mem_size=mem_size, types=list(types))
    res = InefficientResult(sel, summary, note=note)
    if write and not note:
        res.output = write_annotated_copy(path, marks_of(sel))
        summary["output"] = res.output
    if write and not note:
        from ..io.files import create_new, unique_path
        d, base = os.path.split(path)
        sp = unique_path(os.path.join(d, "inefficient_" + os.path.splitext(_plain_name(base))[0] + ".json"))
        with create_new(sp) as f:
            json.dump(summary, f, indent=2)
        res.summary_path = sp
    if not quiet:
        print(format_summary(summary, path), file=sys.stderr)
    return res


# ------------------------------------------------------------------ online sink
class InefficientSink:
    # its rows are folded in order whatever the flushes (in batches of BATCH_ROWS), and step_end is
    # nothing: step boundaries may share a flush (Session._may_wait)
    batch_steps = True

    def __init__(self, session):
        self.session = session
        v = os.environ.get(IDLE_ENV)
        try:
            self.idle_threshold = int(v) if v else DEFAULT_IDLE_THRESHOLD
        except ValueError:
            self.idle_threshold = DEFAULT_IDLE_THRESHOLD
        # the compact form: what close reads (every flagged block's row, size and bits; the texts of
        # the TOP largest), not every block's op name and stack held to the end
        self.tracker = Tracker(self.idle_threshold, top=TOP)
        self.failed = None
        self.pending, self.pending_first = [], None
        from .folds import native_module
        mod = native_module()  # the chunk's columns made in C++ at each flush, where built
        self._columns = mod.chunk_columns if mod is not None else None
        # a flush's rows as the chunk's columns made from the native records (no row tuple made),
        # where the native source's pool is one this analysis reads
        self.takes_packed = self._columns is not None and Pool.PTA not in SKIP_POOLS
        self.packed_columns = (PACKED_CHUNK,)
        self.n_pending = 0
        # polars' Series from numpy reaches for numpy.ma, whose first import (~30 ms) would
        # otherwise land in the program's step that first feeds the tracker
        import numpy.ma  # noqa: F401

    # The tracker's columnar work has a fixed cost per call: feed it in batches of
    # BATCH_ROWS (and at close), not at every step of a fast training loop.
    BATCH_ROWS = 1 << 16

    def consume(self, rows, first_id):
        if self.failed:
            return
        if self._columns is not None:  # the flush's columns now: no row tuple is kept
            try:
                self.pending.append(self._columns(rows, first_id, SKIP_POOLS))
            except Exception as e:
                self._fail(e)
                return
        else:
            if self.pending_first is None:
                self.pending_first = first_id
            self.pending.extend(rows)
        self.n_pending += len(rows)
        if self.n_pending >= self.BATCH_ROWS:
            self._feed()

    def consume_packed(self, packed, first_id):
        """``consume`` of a flush's ``PackedRows``: the chunk columns made with it (the session asks
        for the columns every sink names in ``packed_columns``)."""
        if self.failed:
            return
        self.pending.append(packed.chunk)
        self.n_pending += len(packed)
        if self.n_pending >= self.BATCH_ROWS:
            self._feed()

    def _fail(self, e):
        self.failed = f"{type(e).__name__}: {e}"
        logging.getLogger("msmemscope").error("inefficient analysis stopped: %s", self.failed)

    def _feed(self):
        rows, first = self.pending, self.pending_first
        self.pending, self.pending_first, self.n_pending = [], None, 0
        if not rows or self.failed:
            return
        try:
            self.tracker.feed(Columns.of_parts(rows) if self._columns is not None else chunk_from_rows(rows, first))
        except Exception as e:  # never let the analysis break the traced program
            self.failed = f"{type(e).__name__}: {e}"
            logging.getLogger("msmemscope").error("inefficient analysis stopped: %s", self.failed)

    def step_end(self, session, step):
        pass

    def close(self, session):
        self._feed()
        if self.failed:
            print(f"[msmemscope] inefficient memory: analysis failed ({self.failed}); the dump is complete",
                  file=sys.stderr)
            return
        raw = self.tracker.finish()
        c = self.tracker.counts
        note = None
        if not c["access"]:
            note = "no ACCESS rows were recorded: inefficient memory cannot be judged"
        elif not c["ops"]:
            note = NO_OPS_NOTE
        sel = select(raw)
        summary = summarize(sel, c, self.idle_threshold, note)
        summary["dump"] = session.dump_path
        try:
            annotate_in_place(session.dump_path, marks_of(sel))
            summary["annotated_rows"] = sel.height
        except OSError as e:
            summary["annotation_error"] = str(e)
        from ..io.files import create_new, make_dirs, unique_path
        d = make_dirs(os.path.join(session.folder, "analysis"))
        with create_new(unique_path(os.path.join(d, "inefficient.json"))) as f:
            json.dump(summary, f, indent=2)
        if os.environ.get("MSMEMSCOPE_QUIET") != "1":
            print(format_summary(summary), file=sys.stderr)


def make_sink(session):
    return InefficientSink(session)


# ------------------------------------------------------------------ command line
def main(argv) -> int:
    """``msmemscope check-inefficient <dump> [--mem-size=N] [--type=a,b] [--idle-threshold=N]``"""
    from ..cli import UsageError, _Parser, error_exit
    from ..io.reader import DumpError
    p = _Parser(prog="msmemscope check-inefficient", allow_abbrev=False,
                description="Find inefficient memory blocks in a dump (SPEC 4.5). Writes "
                            "inefficient_<dump> and inefficient_<dump>.json beside the dump.")
    p.add_argument("dump", help="a dump (.csv or .db) or an output folder holding one")
    p.add_argument("--mem-size", default="0", help="leave out blocks smaller than N bytes (default 0)")
    p.add_argument("--type", default=",".join(TYPES), help="types to report (default all): " + ",".join(TYPES))
    p.add_argument("--idle-threshold", default=str(DEFAULT_IDLE_THRESHOLD),
                   help=f"ops between two accesses above which a block is idle (default {DEFAULT_IDLE_THRESHOLD})")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    try:
        ns = p.parse_args(argv)
    except UsageError as e:
        return error_exit(str(e))
    from ..io.ranks import find_rank_dumps, heading, ranks_of_job
    try:
        rds = ranks_of_job(find_rank_dumps(ns.dump), "msmemscope check-inefficient")
    except DumpError as e:
        return error_exit(str(e))
    if len(rds) > 1:  # the root of a distributed run: one report per rank
        out, rc = [], 0
        for rd in rds:
            print(heading(rd), file=sys.stderr)
            one = _check_one(rd.path, ns)
            if isinstance(one, str):
                print(f"msmemscope: error: {one}", file=sys.stderr)
                out.append({"label": rd.label, "rank": rd.rank, "dump": rd.path, "error": one})
                rc = 2
                continue
            out.append({"label": rd.label, "rank": rd.rank, "dump": rd.path, "summary": one.summary})
            if not ns.json:
                _say_written(one)
        if ns.json:
            print(json.dumps({"ranks": out}, indent=2))
        return rc
    res = _check_one(rds[0].path, ns)
    if isinstance(res, str):
        return error_exit(res)
    if ns.json:
        print(json.dumps(res.summary, indent=2))
    else:
        _say_written(res)
    return 0


def _say_written(res):
    if res.output:
        print(f"[msmemscope] annotated dump: {res.output}", file=sys.stderr)
    if res.summary_path:
        print(f"[msmemscope] summary: {res.summary_path}", file=sys.stderr)


def _check_one(path, ns):
    """``check_inefficient`` for the command line: the result, or the one-line error message."""
    from ..io.reader import DumpError
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = check_inefficient(path, mem_size=ns.mem_size, inefficient_type=ns.type,
                                    idle_threshold=ns.idle_threshold, quiet=ns.json)
        for w in caught:
            print(f"msmemscope: warning: {w.message}", file=sys.stderr)
    except (ValueError, DumpError) as e:
        return (str(e).replace("mem_size", "--mem-size").replace("idle_threshold", "--idle-threshold")
                .replace("inefficient_type", "--type"))
    except OSError as e:
        return f"{e.filename or path}: {e.strerror}"
    return res

