"""The readers' one validation layer: what parses but cannot be true, and what would not fit.

``io/reader.py`` calls it at two points, so every offline command gets the same answer:

- ``after_scan`` — after the cheap streaming pass over a CSV dump (``check_csv``) or the row
  count of a database: a dump with no rows after its header is refused (one behaviour in every
  command), and so is a dump whose reading would need more memory than the machine has (said up
  front, in one line, with the figures), before polars is asked to hold it.
- ``check_rows`` — on the parsed columns: negative sizes, a FREE before its MALLOC (or, where the
  run recorded every allocation, without one), IDs or allocation ids used twice, NUL characters
  in a text field, numbers too large for 64 bits (which would otherwise be read as null). In our
  own dumps the first such row is an error naming it; the original tool's dumps (its unquoted
  ``Attr`` keys) are read as they are, with one warning counting the rows.

JSON that the commands read beside a dump (``config.json``, ``analysis/*.json``, an ``Attr``
value) goes through ``load_json_object``: a bounded nesting depth, and an object where an object
is expected, or a ``DumpError`` naming the file.
"""
from __future__ import annotations

import json
import os
import warnings

import polars as pl

from .errors import DumpError

# Peak memory of reading a dump into the analysis columns, measured with read_dump on dumps of
# short and of long rows (~400 B a row whatever its length, plus about the text itself).
BYTES_PER_ROW = 450
BYTES_PER_BYTE = 1.5
MAX_JSON_DEPTH = 64  # our files nest 4 levels deep


class ImplausibleRowsWarning(UserWarning):
    """Rows of the original tool's dump that cannot be true, read as they are."""


def _error(msg: str):
    return DumpError(msg)


# ---------------------------------------------------------------------- before parsing
def memory_budget() -> int:
    """Bytes an offline command may use to hold a dump: MSMEMSCOPE_MEMORY_LIMIT if set, else
    what the machine has available (MemAvailable, the cgroup's limit, RLIMIT_AS: the least)."""
    v = os.environ.get("MSMEMSCOPE_MEMORY_LIMIT", "").strip()
    if v.isdigit():
        return int(v)
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            top = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            cur = int(f.read().strip())
        if top.isdigit():
            limits.append(max(0, int(top) - cur))
    except (OSError, ValueError):
        pass
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else 1 << 62


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def after_scan(path: str, complete: int, size: int, rows: int, exact: bool = True) -> None:
    """Called once the size and the row count of a dump are known (``exact``: counted, not
    extrapolated from the start of the file), before it is parsed."""
    if rows == 0:
        raise _error(f"{path}: no rows after the header (nothing was recorded)")
    need = rows * BYTES_PER_ROW + complete * BYTES_PER_BYTE
    budget = memory_budget()
    if need > budget:
        raise _error(f"{path}: reading it would need about {_gib(need)} of memory ({'' if exact else 'about '}{rows} rows, {size} bytes) "
                     f"and {_gib(budget)} is available (MSMEMSCOPE_MEMORY_LIMIT sets the budget); "
                     "read a smaller part of the run (--steps) or on a larger machine")


# ---------------------------------------------------------------------- after parsing
def _first(df: pl.DataFrame, mask: pl.Series):
    i = int(mask.arg_max())
    return df.row(i, named=True)


INT64_MAX = "9223372036854775807"


#: the rows whose Attr may hold a number over 64 bits (a superset), where the reader's C++ Attr
#: fields found them: the pattern then runs on those rows only
BIG_MAYBE = "_attr_big_maybe"


def _attr_number_too_big(attr: pl.Series, maybe: pl.Series | None = None) -> pl.Series:
    """Numbers over 64 bits. 19 digits may still fit (ns timestamps since 1970 have 19), so those
    are compared with INT64_MAX as text; only rows with such a number are looked at closely.
    ``maybe``: the rows that may hold one (a superset); the others are not searched."""
    import numpy as np
    if maybe is not None:
        attr = pl.DataFrame({"a": attr, "m": maybe}).select(pl.when(pl.col("m")).then(pl.col("a")))[:, 0]
    suspect = attr.str.contains(r"[:,]\s*-?\d{19,}").fill_null(False)
    if not suspect.any():
        return suspect
    import re
    at = suspect.arg_true()
    big = np.zeros(attr.len(), dtype=bool)
    big[at.to_numpy()] = [any(len(d) > 19 or d > INT64_MAX for d in re.findall(r"[:,]\s*-?(\d{19,})", text))
                          for text in attr.gather(at).to_list()]
    return pl.Series(attr.name, big)


def _repeated(ids: pl.Series) -> pl.Series:
    """Rows whose ID an earlier row has (in ID order, the rows equal to the one before)."""
    if ids.is_sorted():
        return (ids.diff() == 0).fill_null(False)
    return ~ids.is_first_distinct()


TEXT_CHECKED = ("event", "event_type", "name", "device", "ptr")
_ORIGINAL_ATTR = r"^\{\s*allocation_id\s*:"


def row_flags(df: pl.DataFrame) -> pl.DataFrame:
    """What ``check_rows`` looks for in each row's text, as bool columns (``_nul_<column>``,
    ``_attr_big``, ``_attr_original``): for a reader that parses a dump in batches and keeps the
    text as categoricals, so that the checks of the whole file still see every row's text."""
    mem = df["event"].is_in(["MALLOC", "FREE"])
    out = {f"_nul_{c}": df[c].str.contains("\x00", literal=True).fill_null(False)
           for c in TEXT_CHECKED if c in df.columns}
    if "attr" in df.columns:
        attr = df.select(pl.when(mem).then(pl.col("attr")))[:, 0]  # only MALLOC/FREE rows are looked at
        out["_attr_big"] = _attr_number_too_big(attr)
        out["_attr_original"] = attr.str.contains(_ORIGINAL_ATTR).fill_null(False) & mem
    return pl.DataFrame(out)


def check_rows(df: pl.DataFrame, path: str, every: pl.DataFrame | None = None, nul: bool = True) -> None:
    """Rows that parse but cannot be true: an error naming the first one in our dumps, one counted
    warning in the original's (see the module's text). ``df`` has the reader's columns; it holds
    at least every MALLOC/FREE row of the file. ``every``: all the file's rows (their ID and text
    columns) when ``df`` holds only some, for the checks that look at every row. ``nul``: False
    when the file is known to hold no NUL byte (the text columns are not searched for one)."""
    every = df if every is None else every
    if every.height == 0:
        raise _error(f"{path}: no rows after the header (nothing was recorded)")
    mem_mask = pl.col("event").is_in(["MALLOC", "FREE"])
    flags = "_attr_big" in df.columns  # the text checked batch by batch (row_flags)
    # only the columns the checks read: a filter copies every column it keeps
    mem = df.select(c for c in ("id", "event", "alloc_id", "size", "attr", "_attr_big", "_attr_original", BIG_MAYBE)
                    if c in df.columns and (c != "attr" or not flags)).filter(mem_mask)
    original = bool(mem.height) and bool(mem["_attr_original"].head(1000).any() if flags else
                                         mem["attr"].head(1000).str.contains(_ORIGINAL_ATTR).any())
    problems = []  # (row id, what)

    def found(mask: pl.Series, frame: pl.DataFrame, what):
        if mask.any():
            r = _first(frame, mask)
            problems.append((int(mask.sum()), r["id"], what(r) if callable(what) else what))

    found(_repeated(every["id"]), every, lambda r: f"ID {r['id']} appears more than once")
    for c in TEXT_CHECKED:
        if f"_nul_{c}" in every.columns:
            found(every[f"_nul_{c}"], every, lambda r, c=c: f"row ID {r['id']} has a NUL character in its "
                                                           f"{c.replace('_', ' ')}")
        elif c in every.columns and nul:
            found(every[c].str.contains("\x00", literal=True).fill_null(False), every,
                  lambda r, c=c: f"row ID {r['id']} has a NUL character in its {c.replace('_', ' ')}")
    if mem.height:
        found(mem["size"] < 0, mem, lambda r: f"{r['event']} row ID {r['id']} has a negative size ({r['size']})")
        found(mem["_attr_big"] if flags else
              _attr_number_too_big(mem["attr"], mem[BIG_MAYBE] if BIG_MAYBE in mem.columns else None), mem,
              lambda r: f"{r['event']} row ID {r['id']} has a number too large for 64 bits in Attr")
        mallocs = mem.filter(pl.col("event") == "MALLOC").select("id", "alloc_id").drop_nulls()
        frees = mem.filter(pl.col("event") == "FREE").select("id", "alloc_id").drop_nulls()
        reused = _seen_before(mallocs["alloc_id"])
        found(reused, mallocs, lambda r: f"MALLOC row ID {r['id']} reuses allocation_id {r['alloc_id']}")
        found(_seen_before(frees["alloc_id"]), frees,
              lambda r: f"FREE row ID {r['id']} frees allocation_id {r['alloc_id']} a second time")
        j = _with_malloc_id(frees, mallocs, bool(reused.any()))
        found((j["id_malloc"] > j["id"]).fill_null(False), j,
              lambda r: f"FREE row ID {r['id']} comes before the MALLOC of allocation_id {r['alloc_id']} "
                        f"(ID {r['id_malloc']})")
        if original or _records_every_allocation(path):
            found(j["id_malloc"].is_null(), j,
                  lambda r: f"FREE row ID {r['id']} frees allocation_id {r['alloc_id']}, which no MALLOC row made")
    if not problems:
        return
    problems.sort(key=lambda p: p[1])
    count, rid, what = problems[0]
    if not original:
        raise _error(f"{path}: {what}; this row cannot be true (the dump was altered or is not ours)")
    total = sum(p[0] for p in problems)
    warnings.warn(f"{path}: {total} rows cannot be true (first: {what}); read as they are",
                  ImplausibleRowsWarning, stacklevel=3)


def _seen_before(ids: pl.Series) -> pl.Series:
    """``~ids.is_first_distinct()``; for small non-negative ids that never repeat (every dump we
    write) found by counting instead of hashing."""
    import numpy as np
    if ids.len() and ids.min() >= 0 and ids.max() <= 4 * ids.len() + 1024:
        if np.bincount(ids.to_numpy()).max() <= 1:
            return pl.Series(ids.name, [], dtype=pl.Boolean).extend_constant(False, ids.len())
    return ~ids.is_first_distinct()


def _with_malloc_id(frees: pl.DataFrame, mallocs: pl.DataFrame, reused: bool) -> pl.DataFrame:
    """``frees.join(mallocs, on="alloc_id", how="left")`` (``id_malloc``: the ID of the MALLOC row of
    the FREE's allocation id, null: none). Where no allocation id has two MALLOC rows and the ids
    are small numbers (every dump we write), a table indexed by them gives the same rows."""
    import numpy as np
    lo = min(frees["alloc_id"].min() if frees.height else 0, mallocs["alloc_id"].min() if mallocs.height else 0)
    hi = max(frees["alloc_id"].max() if frees.height else 0, mallocs["alloc_id"].max() if mallocs.height else 0)
    if reused or frees.height == 0 or lo < 0 or hi > 4 * (frees.height + mallocs.height) + 1024:
        return frees.join(mallocs, on="alloc_id", how="left", suffix="_malloc")
    none = np.iinfo(np.int64).min
    table = np.full(hi + 1, none, dtype=np.int64)
    table[mallocs["alloc_id"].to_numpy()] = mallocs["id"].to_numpy()
    got = pl.Series(table[frees["alloc_id"].to_numpy()])
    return frees.with_columns(id_malloc=pl.when(got != none).then(got))


def check_raw(raw: pl.DataFrame, path: str) -> None:
    """``check_rows`` on the text columns of a lean read (summary's, check-inefficient's fast
    paths), so that they accept exactly what the reader accepts."""
    mem = pl.col("event").is_in(["MALLOC", "FREE"])

    def num(key):
        return pl.when(mem).then(pl.col("attr").str.extract(r'(?:^|[{,\s])"?' + key + r'"?\s*:\s*"?([^",}]*)', 1)
                                 .cast(pl.Int64, strict=False))
    check_rows(raw.select(*(c for c in ("event", "event_type", "name", "device", "ptr", "attr") if c in raw.columns),
                          id=pl.col("id").cast(pl.Int64, strict=False), alloc_id=num("allocation_id"),
                          size=num("size")), path)


def _records_every_allocation(dump: str) -> bool:
    """The run that wrote this dump recorded every allocation it saw free (all steps, alloc and
    free events): its config.json says so. Unknown (no config.json): False."""
    folder = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(dump))))
    try:
        cfg = load_json_object(os.path.join(folder, "config.json"))
    except Exception:
        return False
    opts = cfg.get("options")
    if not isinstance(opts, dict):
        return False
    events = opts.get("events")
    events = events if isinstance(events, (list, str)) else ""
    return (not opts.get("steps") and "alloc" in events and "free" in events and not cfg.get("tool_failure")
            and cfg.get("rows_lost_after") is None)


# ---------------------------------------------------------------------- JSON beside a dump
def _depth(text: str) -> int:
    """Deepest nesting of [ and { outside strings (cheap; no recursion)."""
    depth = top = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > top:
                top = depth
                if top > MAX_JSON_DEPTH:
                    return top
        elif ch in "]}":
            depth -= 1
    return top


def parse_json_object(text: str, what: str):
    """``text`` as a JSON object (dict), or a DumpError naming ``what``."""
    if _depth(text) > MAX_JSON_DEPTH:
        raise _error(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _error(f"{what}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise _error(f"{what}: a JSON {type(obj).__name__} where an object was expected")
    return obj


def load_json_object(path: str, max_bytes: int = 64 << 20):
    """A JSON file that must hold an object (config.json, analysis/*.json)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise _error(f"{path}: cannot be read ({e.strerror})") from None
    if len(data) > max_bytes:
        raise _error(f"{path}: over {max_bytes} bytes; not one of our files")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _error(f"{path}: not UTF-8 text") from None
    return parse_json_object(text, path)


def attr_object(text):
    """An Attr value as a dict for the readers of single rows (export, load): {} when it is not
    a JSON object or nests too deep; never an exception."""
    if not isinstance(text, str) or not text or _depth(text) > MAX_JSON_DEPTH:
        return {}
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}
