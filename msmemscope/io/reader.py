"""Reading dumps: CSV or SQLite, ours or the original tool's, into the columns
every offline analysis uses (one polars DataFrame, sorted by ID).

Parsed columns: ``id, event, event_type, name, ts, pid, tid, device, ptr, attr,
py_stack, c_stack`` as in the file, plus ``alloc_id, addr, size, used, total,
owner`` pulled out of ``Attr`` (both the JSON form and the original's unquoted
``{allocation_id:4,addr:0x…}``) and ``step`` (1 + STEP rows before the row).
"""
from __future__ import annotations

import csv
import glob
import io
import os
import sqlite3
import warnings

import polars as pl

from ..events import COLUMNS, HEADER
from . import validate
from .files import dump_files, is_regular, polars_path

NAMES = ("id", "event", "event_type", "name", "ts", "pid", "tid", "device", "ptr", "attr", "py_stack", "c_stack")
ATTR_INT_KEYS = ("allocation_id", "size", "used", "total")
DEFAULT_MAX_INPUT = 8 << 30
DEFAULT_MAX_LINE = 64 << 20   # no dump row comes near this; a longer line is a corrupt file
CHUNK = 16 << 20              # block size of the streaming line scan


from .errors import DumpError  # noqa: E402,F401  (re-exported: callers import it from here)


class TruncatedDumpWarning(UserWarning):
    pass


def max_input_bytes() -> int:
    v = os.environ.get("MSMEMSCOPE_MAX_INPUT_BYTES")
    try:
        return int(v) if v else DEFAULT_MAX_INPUT
    except ValueError:
        return DEFAULT_MAX_INPUT


def max_line_bytes() -> int:
    v = os.environ.get("MSMEMSCOPE_MAX_LINE_BYTES")
    try:
        return max(1024, int(v)) if v else DEFAULT_MAX_LINE
    except ValueError:
        return DEFAULT_MAX_LINE


def find_dumps(path: str) -> list[str]:
    """The dump files under an output folder (any depth), or the file itself."""
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DumpError(f"{path}: not a regular file or directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise DumpError(f"{path}: directory cannot be read (permission denied)")
    found = dump_files(path)
    if not found:
        found = sorted(p for p in glob.glob(os.path.join(path, "*.csv")) + glob.glob(os.path.join(path, "*.db"))
                       if is_regular(p))
    if not found:
        raise DumpError(f"{path}: directory holds no msmemscope dump (memscope_dump_*.csv or .db)")
    return found


def resolve_one(path: str) -> str:
    dumps = find_dumps(path)
    if len(dumps) > 1:
        raise DumpError(f"{path}: holds {len(dumps)} dumps; name one of them (e.g. {dumps[0]})")
    return dumps[0]


def read_dump(path: str) -> pl.DataFrame:
    """Read one dump file (or a folder holding exactly one) into analysis columns."""
    path = resolve_one(path)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise DumpError(f"{path}: {e.strerror}") from None
    if size > max_input_bytes():
        raise DumpError(f"{path}: {size} bytes is over the input limit of {max_input_bytes()} bytes "
                        "(set MSMEMSCOPE_MAX_INPUT_BYTES to raise it)")
    if size == 0:
        raise DumpError(f"{path}: empty file")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise DumpError(f"{path}: cannot be read ({e.strerror})") from None
    if head.startswith(b"SQLite format 3"):
        df = _read_db(path)
    else:
        df = _read_csv(path)
    return _derive(df, path)


def _read_db(path: str) -> pl.DataFrame:
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            cur = con.execute('SELECT * FROM memscope_dump ORDER BY ID')
            cols = [d[0] for d in cur.description]
            if tuple(cols) == COLUMNS:  # no rows; too large for memory: said before fetching
                n = con.execute("SELECT COUNT(*) FROM memscope_dump").fetchone()[0]
                validate.after_scan(path, os.path.getsize(path), os.path.getsize(path), n)
            rows = cur.fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise DumpError(f"{path}: not a readable msmemscope database ({e})") from None
    if tuple(cols) != COLUMNS:
        raise DumpError(f"{path}: table memscope_dump has columns {cols}, expected {list(COLUMNS)}")
    data = list(zip(*rows)) if rows else [[] for _ in NAMES]
    return pl.DataFrame({n: [None if v is None else str(v) for v in col] for n, col in zip(NAMES, data)},
                        schema={n: pl.String for n in NAMES})


def _read_csv(path: str) -> pl.DataFrame:
    complete, size = check_csv(path)
    source = path
    if complete < size:
        # cut short by a kill: keep every complete row, say so
        with open(path, "rb") as f:
            data = f.read(complete)
        lines = data.count(b"\n")
        warnings.warn(f"{path}: last row is incomplete (the dump was cut short); read up to line {lines}",
                      TruncatedDumpWarning, stacklevel=3)
        source = io.BytesIO(data)
    try:
        with polars_path(source) as source:
            df = pl.read_csv(source, has_header=True, new_columns=list(NAMES),
                             schema_overrides={n: pl.String for n in NAMES}, infer_schema=False,
                             quote_char="\"")
    except Exception:
        raise DumpError(_locate_csv_error(path)) from None
    if df.width != len(NAMES):
        raise DumpError(_locate_csv_error(path))
    # polars pads a short row with nulls: every row of a dump has these fields
    short = df["event"].is_null() | df["ts"].is_null() | df["ptr"].is_null()
    if short.any():
        i = int(short.arg_max())
        raise DumpError(f"{path}: line {i + 2} has too few fields, expected {len(NAMES)}")
    return df


def check_csv(path: str) -> tuple[int, int]:
    """A cheap streaming pass over a CSV dump (blocks of at most ``CHUNK`` bytes, bounded memory):
    the header, and no line longer than ``max_line_bytes()`` (a corrupt file with a gigabyte-long
    line is refused without being loaded). Returns ``(bytes up to the end of the last complete
    line, file size)``; raises ``DumpError`` naming the file and line."""
    limit = max_line_bytes()
    block_size = min(CHUNK, limit)  # a line inside one block is never over the limit
    with open(path, "rb") as f:
        header = f.readline(len(HEADER) + 8).rstrip(b"\r\n")  # bounded: a first line of 1 GB is not read whole
        try:
            header_text = header.decode("utf-8")
        except UnicodeDecodeError:
            raise DumpError(f"{path}: not a text file (line 1 is not UTF-8)") from None
        if header_text.lstrip("\ufeff") != HEADER:
            raise DumpError(f"{path}: line 1 is not the msmemscope header (expected '{HEADER[:40]}…')")
        f.seek(0)
        pos = 0          # bytes read
        since = 0        # bytes since the last newline
        lines = 0        # newlines seen
        while True:
            block = f.read(block_size)
            if not block:
                break
            first = block.find(b"\n")
            if first < 0:
                since += len(block)
            else:
                since += first
            if since > limit:
                raise DumpError(f"{path}: line {lines + 1} is longer than {limit} bytes "
                                "(not a dump row; MSMEMSCOPE_MAX_LINE_BYTES sets the limit)")
            if first >= 0:
                lines += block.count(b"\n")
                since = len(block) - 1 - block.rfind(b"\n")
            pos += len(block)
    validate.after_scan(path, pos - since, pos, max(lines - 1, 0))  # no rows; too large for memory
    return pos - since, pos


def _locate_csv_error(path: str) -> str:
    """Slow path, errors only: find the first bad line, streaming."""
    with open(path, "rb") as f:
        f.readline()
        for n, raw in enumerate(f, start=2):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                return f"{path}: line {n} is not UTF-8 text"
            try:
                row = next(csv.reader([line]))
            except (csv.Error, StopIteration) as e:
                return f"{path}: line {n}: {e}"
            if len(row) != len(NAMES):
                return f"{path}: line {n} has {len(row)} fields, expected {len(NAMES)}"
    return f"{path}: malformed CSV"


def _attr_field(key: str, numeric: bool):
    # value of key in '{"k":v,...}' or '{k:v,...}'; quotes optional
    pat = r'(?:^|[{,\s])"?' + key + r'"?\s*:\s*"?([^",}]*)'
    e = pl.col("attr").str.extract(pat, 1)
    return e.cast(pl.Int64, strict=False) if numeric else e


_ATTR_COLUMNS = ("alloc_id", "size", "used", "total", "owner", "addr")
# The Attr texts our writer prints for MALLOC/FREE and for ACCESS, field for field: one pass of
# one pattern reads all their fields. Any other text (the original's unquoted keys, rows with
# extra keys, an owner with a comma) goes through the per-key patterns, which accept them all.
_MEM_ATTR = (r'^\{"allocation_id":(?P<alloc_id>\d+),"addr":"(?P<addr>0x[0-9a-fA-F]+)","size":(?P<size>\d+),'
             r'"used":(?P<used>-?\d+),"total":(?P<total>-?\d+)(?:,"owner":"(?P<owner>[^",}\\]*)")?\}$')
_ACCESS_ATTR = r'^\{"dtype":"[^"]*","shape":\[[^\]]*\],"size":(?P<size>\d+),"allocation_id":(?P<alloc_id>\d+)\}$'


def _attr_exprs(mem=None, acc=None) -> dict:
    """Expressions for the Attr columns: from the fast patterns' groups, or per key."""
    if mem is None:
        return {"alloc_id": _attr_field("allocation_id", True), "size": _attr_field("size", True),
                "used": _attr_field("used", True), "total": _attr_field("total", True),
                "owner": _attr_field("owner", False), "addr": _attr_field("addr", False)}
    f = mem.struct.field
    g = acc.struct.field
    return {"alloc_id": pl.coalesce(f("alloc_id"), g("alloc_id")).cast(pl.Int64, strict=False),
            "size": pl.coalesce(f("size"), g("size")).cast(pl.Int64, strict=False),
            "used": f("used").cast(pl.Int64, strict=False), "total": f("total").cast(pl.Int64, strict=False),
            "owner": f("owner"), "addr": f("addr")}


def _attr_columns(df: pl.DataFrame) -> pl.DataFrame:
    """alloc_id, size, used, total, owner, addr from Attr (null where the key is absent)."""
    attr = pl.col("attr")
    fast = df.select(_m=attr.str.extract_groups(_MEM_ATTR), _a=attr.str.extract_groups(_ACCESS_ATTR))
    cols = fast.select(**_attr_exprs(pl.col("_m"), pl.col("_a")))
    other = (cols["alloc_id"].is_null() & df["attr"].is_not_null() & (df["attr"] != "")).arg_true()
    if other.len():  # the rest, per key, on those rows only
        slow = df[other].select(**_attr_exprs())
        cols = cols.with_columns(*(cols[c].scatter(other, slow[c]) for c in _ATTR_COLUMNS))
    # hex ("0x…", the contract); a bare number is decimal (the JSON of a MALLOC row with extra keys)
    a = pl.col("addr")
    cols = cols.with_columns(addr=pl.when(a.str.starts_with("0x"))
                             .then(a.str.strip_prefix("0x").str.to_integer(base=16, strict=False))
                             .otherwise(a.str.to_integer(base=10, strict=False)))
    return df.with_columns(cols)


def _derive(df: pl.DataFrame, path: str) -> pl.DataFrame:
    ids = df["id"].cast(pl.Int64, strict=False)
    bad = ids.is_null() & df["id"].is_not_null() | df["id"].is_null()
    if bad.any():
        i = int(bad.arg_max())
        raise DumpError(f"{path}: row {i + 1} has ID '{df['id'][i]}', not a number")
    ts = df["ts"].cast(pl.Int64, strict=False)
    bad = ts.is_null() & df["ts"].is_not_null()
    if bad.any():
        i = int(bad.arg_max())
        raise DumpError(f"{path}: row {i + 1} (ID {ids[i]}) has timestamp '{df['ts'][i]}', not a number")
    out = df.with_columns(
        id=ids, ts=ts,
        pid=pl.col("pid").cast(pl.Int64, strict=False),
        tid=pl.col("tid").cast(pl.Int64, strict=False),
    )
    out = _attr_columns(out)
    if not out["id"].is_sorted():
        out = out.sort("id")  # the original writes rows out of ID order
    mem = out.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
    if mem.height and mem["size"].null_count():
        i = mem["size"].is_null().arg_max()
        raise DumpError(f"{path}: {mem['event'][i]} row ID {mem['id'][i]} has no size in Attr "
                        f"('{mem['attr'][i]}')")
    validate.check_rows(out, path)  # rows that parse but cannot be true
    is_step = (pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")
    return out.with_columns(step=(is_step.cast(pl.Int32).cum_sum() - is_step.cast(pl.Int32) + 1))


def load(path: str):
    """The dump as a pandas DataFrame, ``Attr`` expanded into columns (for notebooks)."""
    import json
    df = read_dump(path).to_pandas()
    attrs = df["attr"].map(_parse_attr_loose)
    keys = sorted({k for a in attrs for k in a})
    for k in keys:
        if k not in df.columns:
            df[k] = attrs.map(lambda a, k=k: a.get(k))
    del json
    return df


def _parse_attr_loose(text):
    import json
    if not isinstance(text, str) or not text or validate._depth(text) > validate.MAX_JSON_DEPTH:
        return {}
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, dict) else {}
    except (ValueError, RecursionError):
        out = {}
        for part in text.strip("{}").split(","):
            k, _, v = part.partition(":")
            v = v.strip().strip('"')
            out[k.strip().strip('"')] = int(v) if v.lstrip("-").isdigit() else v
        return out
