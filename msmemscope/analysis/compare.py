"""Step compare (SPEC §4.3): align the op (or kernel) sequences of two dumps, or
of two steps of one dump, with a minimal edit script, and give for each aligned
op the memory it allocated on each side.

    msmemscope --compare --input=<a>,<b> [--level=op|kernel]

Each side is a dump file, an output folder holding one dump, or either of those
followed by ``:step=N`` (only the ops of step N). A side written as just
``step=N`` reuses the other side's dump: ``--input=dump.csv:step=2,step=3``.

Memory an op allocated: the sum of the sizes of the MALLOC rows that lie
between its ATEN_START and ATEN_END on the same thread (by ID; a MALLOC inside
nested ops counts for the innermost one). ``HAL`` rows (the original's
driver-level pool, which backs the framework pool) are left out so that one
allocation is not counted twice. At kernel level, a kernel's memory is the
MALLOCs on its thread since the previous kernel launch on that thread (the
allocations made for it). The alignment is Myers' O(ND) diff over the
integer-coded names, after the common prefix and suffix are stripped; runs of
equal names are followed with numpy slice compares, so a few hundred edits
over a million ops take well under a second.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from ..io.reader import DumpError, find_dumps, read_dump, resolve_one

PROG = "msmemscope"
HEADER = (",,,Base,Compare\r\n"
          "Event,Name,Device Id,Allocated Memory(byte),Allocated Memory(byte),Diff Memory(byte)\r\n")
OP_STARTS = ("ATEN_START", "ATB_START")
OP_ENDS = ("ATEN_END", "ATB_END")
UNCOUNTED_POOLS = ("HAL",)  # driver-level pool under the framework pool: counting it would count twice
TOP = 10
#: past this many edits per device, or this many seconds, the alignment stops being minimal
#: (see ``align``); 1,000 edits over a million ops take about a second
MAX_EDITS = 5000
MAX_SECONDS = 30.0


class CompareError(Exception):
    """Bad input for a compare; the message is one line for the user."""


# ---------------------------------------------------------------------------
# Sides: "path", "path:step=N", "step=N"

@dataclass
class Side:
    spec: str
    path: str | None
    step: int | None

    @property
    def label(self) -> str:
        return f"{self.path}" + (f" step {self.step}" if self.step is not None else "")


def parse_side(text: str) -> Side:
    text = text.strip()
    if not text:
        raise CompareError("--input: empty side (expected <a>,<b>; each a dump, an output folder, "
                           "or <dump>:step=N)")
    if os.path.exists(text):
        return Side(text, text, None)
    path, step_text = text, None
    if text.startswith("step="):
        path, step_text = None, text[len("step="):]
    elif ":step=" in text:
        path, _, step_text = text.rpartition(":step=")
    step = None
    if step_text is not None:
        try:
            step = int(step_text)
        except ValueError:
            step = 0
        if step < 1:
            raise CompareError(f"--input: '{text}': step '{step_text}' is not a step number "
                               "(expected <dump>:step=N, N = 1, 2, …)")
    return Side(text, path, step)


def parse_input(input_spec) -> tuple[Side, Side]:
    from ..options import split_list
    items = split_list(input_spec)
    if len(items) != 2:
        raise CompareError(f"--input: {len(items)} side(s) given, expected two: --input=<base>,<compare> "
                           "(each a dump, an output folder, or <dump>:step=N)")
    a, b = (parse_side(i) for i in items)
    if a.path is None and b.path is None:
        raise CompareError("--input: neither side names a dump (e.g. --input=dump.csv:step=2,step=3)")
    if a.path is None:
        a.path = b.path
    if b.path is None:
        b.path = a.path
    return a, b


def _as_side(x) -> Side:
    if isinstance(x, Side):
        return x
    s = parse_side(str(x))
    if s.path is None:
        raise CompareError(f"'{x}' names no dump")
    return s


# ---------------------------------------------------------------------------
# Reading a side into its op sequence

#: what the compare reads of a dump (the reader's column layer): ops, kernels, MALLOC, and the
#: SYSTEM rows (every step a STEP row numbers has at least that row)
COLUMNS = ("id", "event", "event_type", "name", "tid", "device", "size", "py_stack", "step", "step_number")
EVENTS = ("OP_LAUNCH", "KERNEL_LAUNCH", "MALLOC", "SYSTEM")


def _read(path: str) -> tuple[pl.DataFrame, str]:
    dump = resolve_one(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = read_dump(dump, columns=COLUMNS, events=EVENTS)
    for w in caught:
        print(f"{PROG}: warning: {w.message}", file=sys.stderr)
    return df, dump


def _source_of(dump: str):
    """The capture source a run of ours recorded ``dump`` with (its run folder's config.json), or None."""
    from ..io.ranks import run_folder_of
    src = run_folder_of(dump)[1].get("source")
    return src.split(",")[0].strip() if isinstance(src, str) else None


def _say_if_sources_differ(dump_a: str, dump_b: str) -> None:
    """Two runs recorded by different capture sources (one fell back to the dispatch-mode source,
    e.g. for --call-stack=c) name and size some ops differently (aten.linear against addmm; the
    profiler's record_function ops on one side): differences the programs did not make. Said."""
    a, b = _source_of(dump_a), _source_of(dump_b)
    if a and b and a != b:
        print(f"{PROG}: warning: the two dumps were recorded by different capture sources ({a}, {b}): some "
              "ops are named and sized differently by each, so they differ here without a difference in "
              "the programs (docs/compare.md)", file=sys.stderr)


def step_numbers(df: pl.DataFrame) -> pl.Series:
    """Step of each row as the dump numbers it (the reader's ``step_number``: a STEP row with
    ``{"step": N}`` ends step N; the count of STEP rows where they carry no numbers)."""
    if "step_number" in df.columns:
        return df["step_number"]
    from ..io.reader import _step_number
    return _step_number(df)


def sequence(df: pl.DataFrame, level: str, step: int | None, where: str, cache: dict | None = None) -> pl.DataFrame:
    """The ops (or kernels) of a dump in ID order with the bytes each allocated.

    Columns: ``device, event, name, bytes, id, py_stack``. ``cache``: a dict kept between the
    two sides of a compare, so that two steps of one dump share the work on the whole dump."""
    key = (id(df), level)
    if cache is not None and key in cache:
        ops, present = cache[key][1:]
    else:
        ops, present = _all_ops(df, level)
        if cache is not None:
            cache[key] = (df, ops, present)  # df held: its id stays its own while cached
    if step is not None:
        if step not in present:
            rng = f"{present[0]}-{present[-1]}" if present else "none"
            raise CompareError(f"{where}: no step {step} (the dump has steps {rng})")
        ops = ops.filter(pl.col("step") == step)
    return ops.select("device", "event", "name", "bytes", "id", "py_stack")


def _all_ops(df: pl.DataFrame, level: str):
    """Every op (or kernel) of the dump with its bytes and step, and the steps the dump has."""
    df = df.with_columns(step=step_numbers(df))
    present = sorted(set(df["step"].unique().to_list()))
    mem = (pl.col("event") == "MALLOC") & ~pl.col("event_type").is_in(UNCOUNTED_POOLS)
    if level == "op":
        is_start = (pl.col("event") == "OP_LAUNCH") & pl.col("event_type").is_in(OP_STARTS)
        is_end = (pl.col("event") == "OP_LAUNCH") & pl.col("event_type").is_in(OP_ENDS)
    else:
        is_start = pl.col("event") == "KERNEL_LAUNCH"
        is_end = pl.lit(False)
    # the row kinds once (string compares on every row), then narrow integer columns only
    kind = df.select(k=pl.when(is_start).then(pl.lit(1, pl.Int8)).when(is_end).then(pl.lit(2, pl.Int8))
                     .when(mem).then(pl.lit(3, pl.Int8)))["k"]
    rows = df.select("id", "tid", "size").with_columns(k=kind).filter(pl.col("k").is_not_null())
    one_thread = rows["tid"].n_unique() <= 1
    if not one_thread:
        rows = rows.sort("tid", "id", maintain_order=True)

    def per(e, *by):  # a window per thread (the whole column when the dump has one thread)
        by = tuple(c for c in by if c != "tid") if one_thread else by
        return e.over(*by) if by else e
    k = pl.col("k")
    if level == "op":
        # depth after each row on its thread; a MALLOC belongs to the last START that
        # opened its depth on that thread (the innermost open op)
        rows = (rows.with_columns(
            _depth=per(pl.when(k == 1).then(1).when(k == 2).then(-1).otherwise(0).cum_sum(), "tid"))
            .filter(k != 2))
        rows = rows.with_columns(_owner=per(pl.when(k == 1).then(pl.col("id")).forward_fill(), "tid", "_depth"))
    else:
        # a kernel owns the MALLOCs on its thread since the previous kernel launch there
        rows = rows.with_columns(_owner=per(pl.when(k == 1).then(pl.col("id")).backward_fill(), "tid"))
    owned = rows.filter((k == 3) & pl.col("_owner").is_not_null()).select("_owner", "size")
    ops = df.filter(kind == 1).select(pl.col("device").fill_null("N/A"), "event", "name", "id", "step", "py_stack")
    if not ops["id"].is_sorted():
        ops = ops.sort("id")
    ids = ops["id"].to_numpy()
    nbytes = np.zeros(len(ids), dtype=np.int64)
    if owned.height and len(ids):
        # each MALLOC's size added to its op's: the owners in ID order where the rows are (one
        # thread), else sorted first (numpy's search for a million owners in random order was
        # 0.4 s at 10M events; a group_by over them 0.2 s)
        own, size = owned["_owner"].to_numpy(), owned["size"].fill_null(0).to_numpy()
        if not (own[1:] >= own[:-1]).all():
            order = np.argsort(own, kind="stable")
            own, size = own[order], size[order]
        np.add.at(nbytes, np.searchsorted(ids, own), size)
    return ops.with_columns(bytes=pl.Series(nbytes)), present


# ---------------------------------------------------------------------------
# Alignment

def encode(a_names, b_names) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes for two name sequences (equal names, equal codes)."""
    a = pl.Series(a_names, dtype=pl.String)
    b = pl.Series(b_names, dtype=pl.String)
    both = pl.concat([a, b]).fill_null("")
    # categorical codes: one dictionary for the concatenated series, so equal names share a code
    codes = both.cast(pl.Categorical).to_physical().cast(pl.Int64).to_numpy() if both.len() \
        else np.zeros(0, np.int64)
    return codes[:a.len()], codes[a.len():]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ne = np.flatnonzero(a[:n] != b[:n])
    return int(ne[0]) if ne.size else n


def _snake(a, b, al, bl, x, y, n, m) -> int:
    """Follow equal items from (x, y); returns the new x. ``al``/``bl`` are Python lists for the
    cheap first checks, ``a``/``b`` numpy arrays for long runs (galloping slice compares)."""
    # most snakes are short: a few scalar compares first
    for _ in range(8):
        if x >= n or y >= m or al[x] != bl[y]:
            return x
        x += 1
        y += 1
    step = 64
    while x < n and y < m:
        L = min(step, n - x, m - y)
        ne = np.flatnonzero(a[x:x + L] != b[y:y + L])
        if ne.size:
            return x + int(ne[0])
        x += L
        y += L
        step = min(step * 4, 1 << 20)
    return x


class AlignmentTooLong(Exception):
    pass


#: diagonals whose snake is still running after this many vectorised steps finish one by one
_VECTOR_STEPS = 8


def _myers(a: np.ndarray, b: np.ndarray, max_d: int, max_seconds: float = MAX_SECONDS):
    """Myers' greedy O(ND) forward pass; returns the edit script as segments
    ``("=", x, y, length)``, ``("-", x)`` (only in a), ``("+", y)`` (only in b), in order.

    Each round d works on all its diagonals at once with numpy (the reads of round d are the
    other parity of V, so the order of the diagonals within a round does not matter); snakes
    longer than a few items finish one by one with galloping slice compares. The path is the
    one the textbook loop finds, diagonal for diagonal."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return [("-", i) for i in range(n)] + [("+", j) for j in range(m)]
    # no script is shorter than the difference of the two multisets of names
    if max_d < n + m:
        hist = np.bincount(np.concatenate([a, b]) - min(int(a.min()), int(b.min())))
        ha = np.bincount(a - min(int(a.min()), int(b.min())), minlength=len(hist))
        if int(np.abs(2 * ha - hist).sum()) > max_d:
            raise AlignmentTooLong(max_d)
    al, bl = a.tolist(), b.tolist()
    off = max_d + 1
    dt = np.int32 if n + m < 2**31 - 2 else np.int64
    V = np.zeros(2 * max_d + 3, dtype=np.int64)
    trace = []  # the entries of V that round d reads (k = -d-1, -d+1, .., d+1), before round d
    deadline = time.monotonic() + max_seconds
    for d in range(max_d + 1):
        trace.append(V[off - d - 1:off + d + 2:2].astype(dt))
        if d & 63 == 0 and time.monotonic() > deadline:
            raise AlignmentTooLong(d)
        ks = np.arange(-d, d + 1, 2)
        lo, hi = V[off + ks - 1], V[off + ks + 1]
        down = (ks == -d) | ((ks != d) & (lo < hi))
        x = np.where(down, hi, lo + 1)
        y = x - ks
        live = np.ones(len(ks), dtype=bool)
        for _ in range(_VECTOR_STEPS):
            live &= (x < n) & (y < m)
            if not live.any():
                break
            idx = np.flatnonzero(live)
            eq = a[x[idx]] == b[y[idx]]
            live[idx[~eq]] = False
            x[idx[eq]] += 1
            y[idx[eq]] += 1
        else:
            for i in np.flatnonzero(live & (x < n) & (y < m)).tolist():
                x[i] = _snake(a, b, al, bl, int(x[i]), int(y[i]), n, m)
        V[off + ks] = x
        done = np.flatnonzero((x >= n) & (x - ks >= m))
        if done.size:
            return _backtrack(trace, d, n, m)
    raise AlignmentTooLong(max_d)


def _backtrack(trace, D, n, m):
    segs = []
    x, y = n, m
    for d in range(D, -1, -1):
        Vd = trace[d]  # index i holds k = 2*i - d - 1
        k = x - y
        get = lambda kk: int(Vd[(kk + d + 1) // 2])  # noqa: E731
        if k == -d or (k != d and get(k - 1) < get(k + 1)):
            pk = k + 1
        else:
            pk = k - 1
        px = get(pk) if d > 0 else 0
        py = px - pk if d > 0 else 0
        # the snake after the move: (mx, my) -> (x, y)
        mx = px if (d > 0 and pk == k + 1) else (px + 1 if d > 0 else 0)
        run = x - mx
        if run > 0:
            segs.append(("=", mx, mx - k, run))
        if d > 0:
            if pk == k + 1:
                segs.append(("+", py))  # down: b[py] only in compare
            else:
                segs.append(("-", px))  # right: a[px] only in base
        x, y = px, py
    segs.reverse()
    return segs


#: the first, short Myers search of ``align``; past it the exact distance decides
QUICK_EDITS = 256
#: the banded bit-parallel LCS runs where len(b) * (3 * limit + 1024) is at most this (about a second)
LCS_BITS_BUDGET = 10**10


def edit_distance(a: np.ndarray, b: np.ndarray, band: int | None = None, block: int | None = None) -> int:
    """The number of insertions and deletions of a minimal script, ``len(a) + len(b) - 2 * LCS``;
    the LCS by the bit-parallel row recurrence (one bit per item of ``a``, Python integers as
    bit vectors: ``len(b)`` rounds of four word-parallel operations).

    With ``band``: matches only between items at most about ``band`` positions apart (rows in
    blocks of ``block``, each block a window of ``2 * band + block`` bits): the result is exact
    when the distance is at most ``band`` and above ``band`` otherwise (a script of at most
    ``band`` edits never leaves the band; a banded script is a script), so ``> band`` decides
    whether one within ``band`` exists, at a cost that does not grow with ``len(a)``."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return n + m
    masks = {}
    for c in np.unique(a).tolist():  # bit i of masks[c]: a[i] == c
        packed = np.packbits((a == c)[::-1].astype(np.uint8))
        masks[c] = int.from_bytes(packed.tobytes(), "big") >> ((-n) % 8)
    get = masks.get
    bl = b.tolist()
    if band is None or band >= max(n, m):
        full = (1 << n) - 1
        v = full
        for i, ch in enumerate(bl):
            mk = get(ch)
            if mk is None:
                continue
            u = v & mk
            v = (v + u) | (v - u)
            if i & 63 == 63:  # the carries out of the top bit are dropped now and then
                v &= full
        return n + m - 2 * (n - (v & full).bit_count())
    w = int(band)
    step = int(block or max(w, 1024))
    lo = hi = -w     # the window holds the bits of positions [lo, hi) of a; below it, bits are final
    v = 0
    zeros = 0        # final zero bits (matched items of a) below the window

    def zeros_in(v, lo, s, e):  # zero bits of positions [s, e) in a window starting at lo
        s, e = max(s, 0), min(e, n)
        if e <= s:
            return 0
        return (e - s) - ((v >> (s - lo)) & ((1 << (e - s)) - 1)).bit_count()
    for j0 in range(0, m, step):
        j1 = min(j0 + step, m)
        new_lo, new_hi = j0 - w, j1 + w
        zeros += zeros_in(v, lo, lo, new_lo)  # no later row can match below j0 - w: final
        v >>= new_lo - lo
        width = new_hi - new_lo
        # the positions entering from above: never matched yet, all ones
        v |= ((1 << width) - 1) ^ ((1 << max(hi - new_lo, 0)) - 1)
        lo, hi = new_lo, new_hi
        full = (1 << width) - 1
        wm = {}
        for ch in set(bl[j0:j1]):
            mk = get(ch)
            if mk is not None:
                wm[ch] = ((mk << -lo) if lo < 0 else (mk >> lo)) & full
        wget = wm.get
        for ch in bl[j0:j1]:
            mk = wget(ch)
            if mk is None:
                continue
            u = v & mk
            v = ((v + u) | (v - u)) & full  # a carry out of the window would be or-ed back to one
    lcs = zeros + zeros_in(v, lo, lo, hi)
    return n + m - 2 * lcs


def align(a, b, max_edits: int = MAX_EDITS, max_seconds: float = MAX_SECONDS
          ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Align two integer sequences by a minimal edit script.

    Returns ``(ai, bi, minimal)``: for each aligned position the index in ``a`` and in ``b``
    (-1 where the item exists on one side only), in order. Past ``max_edits`` edits the middle
    part left after stripping the common prefix and suffix is reported as removed and added
    (``minimal`` False) rather than running for minutes; likewise past ``max_seconds``."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    b = np.ascontiguousarray(b, dtype=np.int64)
    n, m = len(a), len(b)
    p = _common_prefix(a, b)
    s = _common_prefix(a[p:][::-1], b[p:][::-1])
    ma, mb_ = a[p:n - s], b[p:m - s]
    minimal = True
    limit = max(0, min(max_edits, len(ma) + len(mb_)))
    try:
        t0 = time.monotonic()
        try:  # most compares need few edits: a short first try, the same path as the full search
            segs = _myers(ma, mb_, min(limit, QUICK_EDITS), max_seconds)
        except AlignmentTooLong:
            if limit <= QUICK_EDITS:
                raise
            # many edits: the exact distance (bit-parallel LCS) says at once whether a script
            # within the limit exists, instead of thousands of Myers rounds that end in giving up
            if len(mb_) * (3 * limit + 1024) <= LCS_BITS_BUDGET and edit_distance(ma, mb_, band=limit) > limit:
                raise
            segs = _myers(ma, mb_, limit, max(0.0, max_seconds - (time.monotonic() - t0)))
    except AlignmentTooLong:
        # the middle part: every item of a removed, then every item of b added
        ar = np.arange
        return (np.concatenate([ar(p), ar(p, n - s), np.full(len(mb_), -1), ar(n - s, n)]).astype(np.int64),
                np.concatenate([ar(p), np.full(len(ma), -1), ar(p, m - s), ar(m - s, m)]).astype(np.int64), False)
    ai_parts = [np.arange(p, dtype=np.int64)]
    bi_parts = [np.arange(p, dtype=np.int64)]
    pending_a, pending_b = [], []

    def flush():
        if pending_a:
            ai_parts.append(np.asarray(pending_a, dtype=np.int64))
            bi_parts.append(np.asarray(pending_b, dtype=np.int64))
            pending_a.clear()
            pending_b.clear()
    for seg in segs:
        if seg[0] == "=":
            flush()
            _, x, y, L = seg
            ai_parts.append(np.arange(p + x, p + x + L, dtype=np.int64))
            bi_parts.append(np.arange(p + y, p + y + L, dtype=np.int64))
        elif seg[0] == "-":
            pending_a.append(p + seg[1])
            pending_b.append(-1)
        else:
            pending_a.append(-1)
            pending_b.append(p + seg[1])
    flush()
    ai_parts.append(np.arange(n - s, n, dtype=np.int64))
    bi_parts.append(np.arange(m - s, m, dtype=np.int64))
    return np.concatenate(ai_parts), np.concatenate(bi_parts), minimal


# ---------------------------------------------------------------------------
# The compare

@dataclass
class CompareResult:
    """The aligned sequences. ``table`` has one row per aligned op, in order, per device:
    ``event, name, device, base_pos, compare_pos`` (1-based position in each side's sequence,
    null where the op is on one side only), ``base_bytes, compare_bytes`` (null likewise),
    ``diff`` (compare − base, a missing side counting 0), ``base_id, compare_id`` (dump row IDs)."""
    base: Side
    compare: Side
    level: tuple
    table: pl.DataFrame
    base_dump: str = ""
    compare_dump: str = ""
    minimal: bool = True
    path: str | None = None
    stacks: dict = field(default_factory=dict, repr=False)  # (side, id) -> python stack

    @property
    def differences(self) -> pl.DataFrame:
        t = self.table
        return t.filter((pl.col("diff") != 0) | pl.col("base_pos").is_null() | pl.col("compare_pos").is_null())

    def top(self, k: int = TOP) -> pl.DataFrame:
        d = self.differences
        return (d.with_columns(_abs=pl.col("diff").abs()).sort("_abs", "device", descending=[True, False],
                                                                maintain_order=True)
                .head(k).drop("_abs"))

    def line_of(self, side: str, row_id) -> str | None:
        if row_id is None:
            return None
        stack = self.stacks.get((side, row_id))
        if not stack:
            return None
        return _user_line(stack)


def _user_line(stack: str) -> str:
    from ..frames import user_line
    return user_line(stack)


def _levels(level) -> tuple:
    from ..options import parse_level, OptionError
    try:
        return parse_level(level)
    except OptionError as e:
        raise CompareError(str(e)) from None


def compare(a, b, level="op", output: str | None = None) -> CompareResult:
    """Compare two dumps (or two steps): ``a``/``b`` are dump files, output folders or
    ``<dump>:step=N``. With ``output``, writes ``<output>/compare/memory_compare_<ts>.csv``
    (``result.path``). Raises ``CompareError`` / ``DumpError`` on bad input."""
    sa, sb = _as_side(a), _as_side(b)
    levels = _levels(level)
    df_a, dump_a = _read(sa.path)
    df_b = df_a if resolve_one(sb.path) == dump_a else None
    dump_b = dump_a
    if df_b is None:
        df_b, dump_b = _read(sb.path)
        _say_if_sources_differ(dump_a, dump_b)
    parts, stacks, minimal, cache = [], {}, True, {}
    for lv in levels:
        seq_a = sequence(df_a, lv, sa.step, sa.label, cache)
        seq_b = sequence(df_b, lv, sb.step, sb.label, cache)
        what = "ATEN_START (op)" if lv == "op" else "KERNEL_LAUNCH"
        for side, seq, sd, df in (("base", seq_a, sa, df_a), ("compare", seq_b, sb, df_b)):
            if seq.height == 0:
                label = sa.label if side == "base" else sb.label
                if sd.step is not None and sequence(df, lv, None, sd.label, cache).height:
                    raise CompareError(f"{label}: step {sd.step} has no {what} rows, where the dump's other steps "
                                       "have them (an empty step, or one outside the --steps it was recorded with)")
                if lv == "kernel":
                    raise CompareError(
                        f"{label}: no KERNEL_LAUNCH rows, so there is nothing to compare at --level=kernel "
                        "(CPU runs launch no device kernels; use --level=op)")
                raise CompareError(f"{label}: no {what} rows to compare (trace with the 'launch' event "
                                   "and --level=op)")
        dev_a = sorted(set(seq_a["device"].to_list()))
        dev_b = sorted(set(seq_b["device"].to_list()))
        if dev_a != dev_b:
            raise CompareError(f"devices differ: base ({sa.label}) has {lv}s on device {', '.join(dev_a)}, "
                               f"compare ({sb.label}) on device {', '.join(dev_b)}")
        for dev in dev_a:
            da = seq_a.filter(pl.col("device") == dev)
            db = seq_b.filter(pl.col("device") == dev)
            ca, cb = encode(da["name"], db["name"])
            ai, bi, ok = align(ca, cb)
            minimal &= ok
            parts.append(_assemble(da, db, ai, bi, dev))
            for side, d in (("base", da), ("compare", db)):
                if d["py_stack"].null_count() < d.height:
                    for rid, st in d.filter(pl.col("py_stack").is_not_null()).select("id", "py_stack").iter_rows():
                        stacks[(side, rid)] = st
    table = pl.concat(parts) if parts else pl.DataFrame()
    res = CompareResult(sa, sb, levels, table, dump_a, dump_b, minimal, None, stacks)
    if output is not None:
        res.path = write_csv(res, output)
    return res


def _assemble(da: pl.DataFrame, db: pl.DataFrame, ai: np.ndarray, bi: np.ndarray, dev: str) -> pl.DataFrame:
    ha, hb = pl.Series(ai >= 0), pl.Series(bi >= 0)

    def take(df, col, idx, have):
        if df.height == 0:
            return pl.Series(col, [None] * len(idx), dtype=df[col].dtype)
        vals = df[col].gather(np.where(idx >= 0, idx, 0))
        return pl.select(pl.when(have).then(vals).alias(col)).to_series()

    def either(col):
        x, y = take(da, col, ai, ha), take(db, col, bi, hb)
        return pl.select(pl.coalesce(x, y).alias(col)).to_series()
    t = pl.DataFrame([
        either("event"), either("name"),
        pl.Series("device", [dev] * len(ai), dtype=pl.String),
        pl.select(pl.when(ha).then(pl.Series(ai + 1)).alias("base_pos")).to_series(),
        pl.select(pl.when(hb).then(pl.Series(bi + 1)).alias("compare_pos")).to_series(),
        take(da, "bytes", ai, ha).cast(pl.Int64).alias("base_bytes"),
        take(db, "bytes", bi, hb).cast(pl.Int64).alias("compare_bytes"),
        take(da, "id", ai, ha).cast(pl.Int64).alias("base_id"),
        take(db, "id", bi, hb).cast(pl.Int64).alias("compare_id"),
    ])
    t = t.with_columns(diff=pl.col("compare_bytes").fill_null(0) - pl.col("base_bytes").fill_null(0))
    return t.select("event", "name", "device", "base_pos", "compare_pos", "base_bytes", "compare_bytes",
                    "diff", "base_id", "compare_id")


def write_csv(res: CompareResult, output: str) -> str:
    from ..io.files import create_new, make_dirs, remove_quietly, unique_path
    from ..io.writers import csv_safe
    make_dirs(os.path.abspath(output))  # a symlink planted at the output root is refused
    folder = make_dirs(os.path.join(os.path.abspath(output), "compare"))
    ts = time.strftime("%Y%m%d%H%M%S")
    for _ in range(100):
        path = unique_path(os.path.join(folder, f"memory_compare_{ts}.csv"))
        try:
            f = create_new(path, binary=True)
            break
        except FileExistsError:
            continue
    else:
        raise OSError(f"cannot create a new file in {folder}")
    try:
        with f:
            f.write(HEADER.replace("\r\n", "\n").encode())
            res.table.select(csv_safe("event"), csv_safe("name"), csv_safe("device"),
                             "base_bytes", "compare_bytes", "diff").write_csv(
                f, include_header=False, null_value="N/A")
    except BaseException:
        remove_quietly(path)  # no part of a table that could not be written (write_new's rule)
        raise
    return path


# ---------------------------------------------------------------------------
# Console

def _short(name: str | None) -> str:
    return (name or "").replace("torch._ops.", "")


def render(res: CompareResult, k: int = TOP, out=None) -> None:
    """Print the summary per device and the top differences as a table."""
    from rich.console import Console
    from rich.table import Table
    out = out or sys.stdout
    width = None if out.isatty() else 200
    con = Console(file=out, width=width, soft_wrap=False, highlight=False)
    t = res.table
    con.print(f"Compare ({'/'.join(res.level)} level): base {res.base.label}  vs  compare {res.compare.label}")
    for (dev,), g in t.group_by(["device"], maintain_order=True):
        n_a = g["base_pos"].drop_nulls().len()
        n_b = g["compare_pos"].drop_nulls().len()
        only_a = g.filter(pl.col("compare_pos").is_null()).height
        only_b = g.filter(pl.col("base_pos").is_null()).height
        changed = g.filter(pl.col("base_pos").is_not_null() & pl.col("compare_pos").is_not_null()
                           & (pl.col("diff") != 0)).height
        total = int(g["diff"].sum() or 0)
        con.print(f"device {dev}: {n_a} ops in base, {n_b} in compare; {g.height - only_a - only_b} aligned "
                  f"({changed} allocate differently), {only_a} only in base, {only_b} only in compare; "
                  f"total difference {total:+,} bytes")
    if not res.minimal:
        con.print(f"note: the sequences differ in more than {MAX_EDITS} places (or aligning them took over "
                  f"{MAX_SECONDS:.0f} s); past the common start and end they are shown as removed and added, "
                  "not aligned op by op")
    top = res.top(k)
    if top.height == 0:
        con.print("No differences: every op aligns and allocates the same memory.")
    else:
        tab = Table(title=f"Top {top.height} differences (of {res.differences.height})", title_justify="left")
        rows = list(top.iter_rows(named=True))
        lines = [res.line_of("compare", r["compare_id"]) or res.line_of("base", r["base_id"]) or "" for r in rows]
        cols = [("Op", "left"), ("Device", "left"), ("Base #", "right"), ("Compare #", "right"),
                ("Base bytes", "right"), ("Compare bytes", "right"), ("Diff bytes", "right")]
        if any(lines):  # only where the dump has Call Stack(Python)
            cols.append(("Python line", "left"))
        for col, just in cols:
            tab.add_column(col, justify=just, overflow="fold")

        def num(v):
            return "N/A" if v is None else f"{v:,}"
        for r, line in zip(rows, lines):
            cells = [_short(r["name"]), str(r["device"]), num(r["base_pos"]), num(r["compare_pos"]),
                     num(r["base_bytes"]), num(r["compare_bytes"]), f"{r['diff']:+,}"]
            tab.add_row(*(cells + [line] if any(lines) else cells))
        con.print(tab)


# ---------------------------------------------------------------------------
# Command line

def _err(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def main_from_cli(input_spec, opts) -> int:
    try:
        a, b = parse_input(input_spec)
        for s in (a, b):
            find_dumps(s.path)  # does it exist at all
        res = compare(a, b, level=opts.level, output=None)
    except (CompareError, DumpError) as e:
        return _err(str(e))
    except OSError as e:
        return _err(f"{getattr(e, 'filename', None) or ''}: {e.strerror or e}".lstrip(": "))
    try:
        res.path = write_csv(res, opts.output)
    except OSError as e:
        return _err(f"--output: cannot write the result under {opts.output}: {e.strerror or e}")
    render(res)
    print(f"[{PROG}] compare result: {res.path}", file=sys.stderr)
    return 0
