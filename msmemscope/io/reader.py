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
import json
import os
import sqlite3
import warnings

import polars as pl

from ..events import COLUMNS, HEADER
from . import validate
from .files import dump_files, is_regular, polars_path

NAMES = ("id", "event", "event_type", "name", "ts", "pid", "tid", "device", "ptr", "attr", "py_stack", "c_stack")
#: what ``read_dump`` gives without ``columns`` (this order)
DEFAULT_COLUMNS = NAMES + ("alloc_id", "size", "used", "total", "owner", "addr", "step")
#: every column ``read_dump(columns=...)`` can give: the defaults, then the step number a STEP row
#: carries (``step_number``), the enclosing op (``op``), Attr's ``origin`` and the module attribution
#: (``module``, ``phase``: format_version 2; null in older dumps and rows made outside modules)
COLUMNS_OFFERED = DEFAULT_COLUMNS + ("step_number", "op", "origin", "module", "phase")
ATTR_INT_KEYS = ("allocation_id", "size", "used", "total")
DEFAULT_MAX_INPUT = 8 << 30
DEFAULT_MAX_LINE = 64 << 20   # no dump row comes near this; a longer line is a corrupt file
CHUNK = 16 << 20              # block size of the streaming line scan


from .errors import DumpError  # noqa: E402,F401  (re-exported: callers import it from here)


class DamagedDumpWarning(UserWarning):
    """A part of the dump could not be read (a damaged zstd frame) and was skipped."""


class TruncatedDumpWarning(UserWarning):
    pass


_WARNINGS = {"truncated": TruncatedDumpWarning, "implausible": validate.ImplausibleRowsWarning}


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
        found = sorted(p for p in glob.glob(os.path.join(path, "*.csv")) + glob.glob(os.path.join(path, "*.csv.zst"))
                       + glob.glob(os.path.join(path, "*.db")) if is_regular(p))
    if not found:
        raise DumpError(f"{path}: directory holds no msmemscope dump (memscope_dump_*.csv or .db)")
    return found


def resolve_one(path: str) -> str:
    dumps = find_dumps(path)
    if len(dumps) > 1:
        raise DumpError(f"{path}: holds {len(dumps)} dumps; name one of them (e.g. {dumps[0]})")
    return dumps[0]


def read_dump(path: str, columns=None, events=None, counts: dict | None = None, attr_of=None) -> pl.DataFrame:
    """Read one dump file (or a folder holding exactly one) into analysis columns, sorted by ID.

    ``columns``: the columns wanted (any of ``COLUMNS_OFFERED``; ``id`` always comes; default
    ``DEFAULT_COLUMNS``). ``events``: keep only the rows of these events (``step``, ``step_number``
    and ``op`` still count every row of the file). ``counts``: a dict to fill with the number of
    rows of each event in the whole file. ``attr_of``: the events whose rows keep their ``attr``
    text (null on the others; the Attr fields and ``origin`` are read from every row as ever): an
    analysis that reads only the SYSTEM rows' Attr spares the text of millions of MALLOC/FREE rows.
    Raises ``DumpError``."""
    want = _wanted(columns)
    keep = None if events is None else tuple(events)
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
    # handed over in a list that _derive empties: no reference is left to the file's columns
    # once _derive has taken those it keeps (the others are freed before Attr is parsed)
    if not head.startswith(b"SQLite format 3"):
        got = capture_parts(path)
        got = None if got is None else _from_capture(got, path, want, keep, counts, attr_of=attr_of)
        if got is not None:
            return got
    facts = {}
    if head.startswith(b"SQLite format 3"):
        frame = [_read_db(path, want, None if counts is not None else keep)]
    elif head.startswith(ZSTD_MAGIC):
        frame = [_read_csv(path, _unzstd(path), facts)]
    else:
        frame = [_read_csv(path, facts=facts)]
    return _derive(frame, path, want, keep, counts, attr_of, nul=facts.get("nul", True))


def _wanted(columns) -> tuple:
    if columns is None:
        return DEFAULT_COLUMNS
    bad = [c for c in columns if c not in COLUMNS_OFFERED]
    if bad:
        raise ValueError(f"read_dump: no column {bad[0]!r} (offered: {', '.join(COLUMNS_OFFERED)})")
    return tuple(c for c in COLUMNS_OFFERED if c in columns or c == "id")


def _source_columns(want: tuple, events=None) -> set:
    """The file's columns needed for ``want`` (and for the checks every read makes: a MALLOC/FREE
    row read has a size in Attr)."""
    need = {"id", "event", "event_type", "name", "ts", "ptr"} | {c for c in want if c in NAMES}  # name: every read checks it for NUL
    if (any(c in want for c in _ATTR_COLUMNS + ("step_number", "origin"))
            or events is None or {"MALLOC", "FREE"} & set(events)):
        need.add("attr")
    if "op" in want:
        need |= {"name", "tid"}
    return need


def _read_db(path: str, want: tuple = DEFAULT_COLUMNS, events=None) -> pl.DataFrame:
    """The table, with an SQL projection: only the columns ``want`` needs, only the rows of
    ``events`` (and the rows that number steps and ops), in ID order."""
    need = _source_columns(want, events)
    where = ""
    if events is not None:
        extra = ["SYSTEM"] + (["OP_LAUNCH"] if "op" in want else [])
        kinds = sorted(set(events) | set(extra))
        where = " WHERE Event IN (" + ",".join("?" * len(kinds)) + ")"
    else:
        kinds = []
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            cols = [r[1] for r in con.execute("PRAGMA table_info(memscope_dump)").fetchall()]
            if tuple(cols) != COLUMNS:
                if not cols:
                    con.execute("SELECT * FROM memscope_dump LIMIT 0")  # no such table: say so
                raise DumpError(f"{path}: table memscope_dump has columns {cols}, expected {list(COLUMNS)}")
            # no rows; too large for memory: said before fetching
            n = con.execute("SELECT COUNT(*) FROM memscope_dump").fetchone()[0]
            validate.after_scan(path, os.path.getsize(path), os.path.getsize(path), n)
            picked = [(n, c) for n, c in zip(NAMES, COLUMNS) if n in need]
            sel = ",".join(f'"{c}"' for _, c in picked)
            rows = con.execute(f"SELECT {sel} FROM memscope_dump{where} ORDER BY ID", kinds).fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise DumpError(f"{path}: not a readable msmemscope database ({e})") from None
    data = list(zip(*rows)) if rows else [[] for _ in picked]
    got = pl.DataFrame({n: [None if v is None else str(v) for v in col] for (n, _), col in zip(picked, data)},
                       schema={n: pl.String for n, _ in picked})
    return got.with_columns(pl.lit(None, dtype=pl.String).alias(n) for n in NAMES if n not in got.columns).select(NAMES)


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def open_text(path: str, end: int | None = None):
    """A binary file object on the dump's CSV text: the file itself, or its zstd stream
    (``.csv.zst``, any number of frames) decompressed as it is read. ``end``: only the file's
    first ``end`` bytes (compressed ones for a zstd dump), for a file another thread appends to."""
    f = open(path, "rb")
    if end is not None:
        with f:
            f = io.BytesIO(f.read(end))
    if f.read(4) != ZSTD_MAGIC:
        f.seek(0)
        return f
    f.seek(0)
    try:
        import zstandard
    except ImportError:
        f.close()
        raise DumpError(f"{path}: a zstd-compressed dump; reading it needs the zstandard package "
                        "(pip install zstandard)") from None
    return io.BufferedReader(ZstdFrames(f, path, zstandard), 1 << 20)


class ZstdFrames(io.RawIOBase):
    """The text of a ``.csv.zst`` dump, frame after frame (a frame per flush, each whole rows). A
    frame that cannot be decompressed (damaged in the middle of the file) is skipped whole, and the
    dump is read on from the next frame's magic number, with one warning: only that frame's rows
    are lost (docs/long-runs.md). Before, the stream stopped there, every later frame was dropped,
    and the readers said the dump was cut short. A frame cut short by the end of the file (a killed
    run) gives its text up to the cut."""

    def __init__(self, f, path: str, zstandard):
        self._f, self._path, self._z = f, path, zstandard
        self._rest = b""   # compressed bytes read and not yet decompressed
        self._out = b""    # text ready to be read
        self._done = False
        self.damaged = 0

    def readable(self):
        return True

    def readinto(self, b):
        while not self._out and not self._done:
            self._out = self._frame()
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _more(self) -> bytes:
        return self._f.read(1 << 20)

    def _frame(self) -> bytes:
        """The next frame's text (b"" and ``_done`` at the end)."""
        d = self._z.ZstdDecompressor().decompressobj()
        seen, parts = [], []  # the frame's compressed bytes (to look past it if damaged), its text
        data = self._rest or self._more()
        self._rest = b""
        while data:
            seen.append(data)
            try:
                parts.append(d.decompress(data))
            except self._z.ZstdError:
                # none of its text: zstd finds a damage late (the frame's checksum, at its end), and
                # what it gave before may already be wrong (rows repeated, ids that cannot be true)
                self._skip(b"".join(seen))
                return b""
            if d.eof:
                self._rest = d.unused_data
                return b"".join(parts)
            data = self._more()
        self._done = True  # the file ended (inside this frame: cut short, its text up to the cut)
        return b"".join(parts)

    def _skip(self, frame: bytes):
        """Past a damaged frame: on from the next frame's magic number after its start."""
        if not self.damaged:
            warnings.warn(f"{self._path}: a damaged zstd frame: its rows are skipped, the dump is read on "
                          f"from the next frame", DamagedDumpWarning, stacklevel=2)
        self.damaged += 1
        buf, start = frame, 1  # (not the damaged frame's own magic number)
        while True:
            i = buf.find(ZSTD_MAGIC, start)
            if i >= 0:
                self._rest = buf[i:]
                return
            more = self._more()
            if not more:
                self._done = True
                return
            buf, start = buf[-3:] + more, 0  # (a magic number across two reads)

    def close(self):
        try:
            self._f.close()
        finally:
            super().close()


def _unzstd(path: str, end: int | None = None) -> bytes:
    """The CSV text of a ``.csv.zst`` dump, at most ``max_input_bytes()`` of it; a stream cut short
    (a killed run) gives what it holds up to the cut. ``end``: see ``open_text``."""
    limit = max_input_bytes()
    out = bytearray()
    f = open_text(path, end)
    raw = getattr(f, "raw", f)  # unbuffered: a read that meets the cut loses at most its own block
    try:
        while True:
            try:
                block = raw.read(1 << 16)
            except Exception:  # a frame cut short: the rows before the cut still count
                break
            if not block:
                break
            out += block
            if len(out) > limit:
                raise DumpError(f"{path}: more than {limit} bytes of CSV once decompressed (set "
                                "MSMEMSCOPE_MAX_INPUT_BYTES to raise the input limit)")
    finally:
        f.close()
    if not out:
        raise DumpError(f"{path}: an empty or unreadable zstd stream")
    return bytes(out)


#: the columns of a CSV dump read as numbers in the first try (the others are texts)
_TYPED = {n: (pl.Int64 if n in ("id", "ts", "pid", "tid") else pl.String) for n in NAMES}


def _as_typed(df: pl.DataFrame) -> pl.DataFrame:
    """The number columns' texts as the typed read takes them (leading blanks dropped, a blank field
    missing), so that a file reads alike whichever read took it, whole or batch by batch; a value
    that is not a number stays as its text, for the error that names it."""
    def num(c):
        t = pl.col(c).str.strip_chars_start(" \t")
        return pl.when(t != "").then(t).alias(c)
    return df.with_columns(num(c) for c in _TYPED if _TYPED[c] == pl.Int64)


def csv_frame(source) -> pl.DataFrame:
    """polars' read of a CSV dump's text (a path or a buffer, header first): ``id``, ``ts``, ``pid``
    and ``tid`` as numbers (making their texts and casting them was a tenth of the read), or, where
    a value is not a number, every column as text, the numbers' as the typed read takes them
    (``_as_typed``: the error then names the row). Raises what polars raises."""
    try:
        with polars_path(source) as src:
            return pl.read_csv(src, has_header=True, new_columns=list(NAMES), schema_overrides=_TYPED,
                               infer_schema=False, quote_char="\"")
    except Exception:
        if hasattr(source, "seek"):
            source.seek(0)
    with polars_path(source) as src:
        return _as_typed(pl.read_csv(src, has_header=True, new_columns=list(NAMES),
                                     schema_overrides={n: pl.String for n in NAMES}, infer_schema=False,
                                     quote_char="\""))


def _read_csv(path: str, text: bytes | None = None, facts: dict | None = None) -> pl.DataFrame:
    """The CSV dump (or, with ``text``, its decompressed text) as text columns, ``id``, ``ts``,
    ``pid`` and ``tid`` as numbers where every value is one (else as texts: ``_as_typed``)
    (``facts``: see ``check_csv``)."""
    complete, size = check_csv(path, text, facts)
    source = path if text is None else io.BytesIO(text)
    if complete < size:
        # cut short by a kill: keep every complete row, say so
        if text is not None:
            data = text[:complete]
        else:
            with open(path, "rb") as f:
                data = f.read(complete)
        lines = data.count(b"\n")
        warnings.warn(f"{path}: last row is incomplete (the dump was cut short); read up to line {lines}",
                      TruncatedDumpWarning, stacklevel=3)
        source = io.BytesIO(data)
    try:
        df = csv_frame(source)
    except Exception:
        raise DumpError(_locate_csv_error(path, text)) from None
    if df.width != len(NAMES):
        raise DumpError(_locate_csv_error(path, text))
    # polars pads a short row with nulls: every row of a dump has these fields
    short = df["event"].is_null() | df["ts"].is_null() | df["ptr"].is_null()
    if short.any():
        i = int(short.arg_max())
        raise DumpError(f"{path}: line {i + 2} has too few fields, expected {len(NAMES)}")
    return df


#: the Python scan counts newlines exactly in this much of a file; past it the row count (for the
#: memory estimate only) is extrapolated: counting them all was a third of the bare read's time
#: (the C++ scan counts them all at no extra cost)
COUNT_BYTES = 64 << 20


def check_csv(path: str, text: bytes | None = None, facts: dict | None = None,
              end: int | None = None) -> tuple[int, int]:
    """A cheap pass over a CSV dump before polars reads it, in bounded memory: the header, and no
    line longer than ``max_line_bytes()`` (a corrupt file with a gigabyte-long line is refused
    without being loaded); in C++ where the module is built (``_native_scan``), else streamed in
    blocks of at most ``CHUNK`` bytes. Returns ``(bytes up to the end of the last complete
    line, file size)``; raises ``DumpError`` naming the file and line. ``text``: the decompressed
    text of a ``.csv.zst`` dump, checked instead of the file. ``facts``: a dict given ``nul``,
    whether the text holds a NUL byte anywhere (none: no column of it can have one). ``end``: only
    the first ``end`` bytes (of a file another thread appends to)."""
    limit = max_line_bytes()
    block_size = min(CHUNK, limit)  # a line inside one block is never over the limit
    with (open(path, "rb") if text is None else io.BytesIO(text)) as f:
        header = f.readline(len(HEADER) + 8).rstrip(b"\r\n")  # bounded: a first line of 1 GB is not read whole
        try:
            header_text = header.decode("utf-8")
        except UnicodeDecodeError:
            raise DumpError(f"{path}: not a text file (line 1 is not UTF-8)") from None
        if header_text.lstrip("\ufeff") != HEADER:
            raise DumpError(f"{path}: line 1 is not the msmemscope header (expected '{HEADER[:40]}…')")
        got = _native_scan(path, text, end, limit, facts)
        if got is not None:
            return got
        f.seek(0)
        pos = 0          # bytes read
        since = 0        # bytes since the last newline
        lines = 0        # newlines seen (in the first COUNT_BYTES)
        counted = 0      # bytes whose newlines are counted
        tail = 0         # bytes of the last block past COUNT_BYTES (its newlines counted at the end)
        nul = False
        # one buffer read into again and again: a new 16 MB bytes object a block was fresh
        # memory, whose page faults cost more than the scan
        block = bytearray(block_size)
        view = memoryview(block)
        while True:
            k = f.readinto(block if end is None else view[:max(0, min(block_size, end - pos))])
            if not k:
                break
            if not nul and block.find(b"\x00", 0, k) >= 0:  # memchr: a fraction of the line count's time
                nul = True
            if counted < COUNT_BYTES:
                lines += block.count(b"\n", 0, k)
                counted += k
            else:
                tail = k  # lines grow longer as IDs and times grow: the last block is counted too
            first = block.find(b"\n", 0, k)
            if first < 0:
                since += k
            else:
                since += first
            if since > limit:
                line = _line_at(path, pos + k - since if first < 0 else pos + first - since, text)
                raise DumpError(f"{path}: line {line} is longer than {limit} bytes "
                                "(not a dump row; MSMEMSCOPE_MAX_LINE_BYTES sets the limit)")
            if first >= 0:
                since = k - 1 - block.rfind(b"\n", 0, k)
            pos += k
        tail_lines = block.count(b"\n", 0, tail) if tail else 0  # the buffer still holds the last block
    rows, exact = max(lines - 1, 0), counted >= pos
    if not exact and lines:  # about as many rows a byte as in the first and last blocks
        rows = max(rows, round((lines + tail_lines) * (pos - since) / (counted + tail)) - 1)
    if facts is not None:
        facts["nul"] = nul
    validate.after_scan(path, pos - since, pos, rows, exact)  # no rows; too large for memory
    return pos - since, pos


def _native_scan(path: str, text: bytes | None, end: int | None, limit: int, facts: dict | None = None):
    """``check_csv``'s scan in C++ (``csv_scan``: the file mapped, or read in blocks up to ``end``;
    every newline counted, the rows exact at any size), or None where the module is not built or
    the file cannot be opened (the streamed scan then reads it, and says why)."""
    from . import columns as C
    m = C.text_module("csv_scan")
    if m is None:
        return None
    got = m.csv_scan(None if text is not None else os.fsencode(path), text, -1 if end is None else end, limit)
    if got is None:
        return None
    complete, pos, lines, nul, long_line = got
    if long_line:
        raise DumpError(f"{path}: line {long_line} is longer than {limit} bytes "
                        "(not a dump row; MSMEMSCOPE_MAX_LINE_BYTES sets the limit)")
    if facts is not None:
        facts["nul"] = nul
    validate.after_scan(path, complete, pos, max(lines - 1, 0), True)  # no rows; too large for memory
    return complete, pos


def _line_at(path: str, offset: int, text: bytes | None = None) -> int:
    """The line number (1-based) of the byte at ``offset`` (errors only: counts newlines before it)."""
    n, done = 1, 0
    with (open(path, "rb") if text is None else io.BytesIO(text)) as f:
        while done < offset:
            block = f.read(min(CHUNK, offset - done))
            if not block:
                break
            n += block.count(b"\n")
            done += len(block)
    return n


def _locate_csv_error(path: str, text: bytes | None = None) -> str:
    """Slow path, errors only: find the first bad line, streaming."""
    with (open(path, "rb") if text is None else io.BytesIO(text)) as f:
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


def _attr_field(key: str, numeric: bool, attr=None):
    # value of key in '{"k":v,...}' or '{k:v,...}'; quotes optional
    pat = r'(?:^|[{,\s])"?' + key + r'"?\s*:\s*"?([^",}]*)'
    e = (pl.col("attr") if attr is None else attr).str.extract(pat, 1)
    return e.cast(pl.Int64, strict=False) if numeric else e


_ATTR_COLUMNS = ("alloc_id", "size", "used", "total", "owner", "addr", "module", "phase")
# The Attr texts our writer prints for MALLOC/FREE and for ACCESS, field for field (events.py
# format_attr): these regular expressions say what the fast path below accepts (tests compare).
# Any other text (the original's unquoted keys, rows with extra keys, an owner with a comma) goes
# through the per-key patterns, which accept them all.
_MEM_ATTR = (r'^\{"allocation_id":(?P<alloc_id>\d+),"addr":"(?P<addr>0x[0-9a-fA-F]+)","size":(?P<size>\d+),'
             r'"used":(?P<used>-?\d+),"total":(?P<total>-?\d+)(?:,"owner":"(?P<owner>[^",}\\]*)")?'
             r'(?:,"module":"(?P<module>[^",}\\]*)"(?:,"phase":"(?P<phase>[^",}\\]*)")?)?\}$')
_ACCESS_ATTR = r'^\{"dtype":"[^"]*","shape":\[[^\]]*\],"size":(?P<size>\d+),"allocation_id":(?P<alloc_id>\d+)\}$'


# column -> (Attr key, numeric)
_PER_KEY = {"alloc_id": ("allocation_id", True), "size": ("size", True), "used": ("used", True),
            "total": ("total", True), "owner": ("owner", False), "addr": ("addr", False),
            "module": ("module", False), "phase": ("phase", False)}


def _per_key_exprs(attr=None) -> dict:
    """Expressions for the Attr columns, key by key (any Attr text; ``attr``: the text expression,
    default the attr column)."""
    return {k: _attr_field(key, num, attr) for k, (key, num) in _PER_KEY.items()}


def _attr_exprs() -> dict:
    """Expressions for the Attr columns, key by key (any Attr text)."""
    return _per_key_exprs()


#: a column the C++ Attr fields add for the checks (validate.BIG_MAYBE), never in a result
BIG_MAYBE = validate.BIG_MAYBE


def _attr_module():
    """The C++ module with ``attr_fields`` (``columns.text_module``), or None."""
    from . import columns as C
    return C.text_module("attr_fields")


def _native_fields(df: pl.DataFrame, fields):
    """The templates' fields in C++ (``attr_fields``), in one pass over the Attr column: the
    MALLOC/FREE template's on those rows, ``alloc_id`` and ``size`` also from the ACCESS template
    on ACCESS rows, null elsewhere, as columns in the chunks of ``df``; None when the module is
    not there."""
    m = _attr_module()
    if m is None:
        return None
    ev = pl.col("event")
    kinds = df.select(pl.when(ev.is_in(["MALLOC", "FREE"])).then(1).when(ev == "ACCESS").then(2).otherwise(0)
                      .cast(pl.UInt8))[:, 0]
    try:
        matched, aid, size, used, total, addr, over, *texts = m.attr_fields(
            df["attr"].__arrow_c_stream__(), 0, kinds.to_numpy())
    except (AttributeError, TypeError, ValueError):
        return None  # a polars without the Arrow stream, or a layout the parse does not know: polars' way
    # each number with its bit in ``over`` (past 64 bits: null, as polars' cast of the digits)
    both = {"alloc_id": (aid, 1), "size": (size, 2)}
    mem_only = {"used": (used, 4), "total": (total, 8), "addr": (addr, 16)}
    texts = dict(zip(("owner", "module", "phase"), texts))
    got = pl.DataFrame({"_m": matched, "_over": over, "_k": kinds,
                        **{f"_{k}": v for k, (v, _) in {**both, **mem_only}.items()},
                        **{f"_{k}": codes for k, (codes, _) in texts.items() if k in fields}})
    exprs = {k: pl.when(pl.col("_over") & bit == 0).then(pl.col(f"_{k}")) for k, (_, bit) in both.items()}
    is_mem = pl.col("_k") == 1
    for k, (_, bit) in mem_only.items():
        exprs[k] = pl.when(is_mem & (pl.col("_over") & bit == 0)).then(pl.col(f"_{k}"))
    for k, (_, values) in texts.items():  # codes into the distinct texts (-1: none)
        if k in fields:
            c = pl.col(f"_{k}")
            exprs[k] = (pl.when(c >= 0).then(pl.lit(pl.Series(values, dtype=pl.String)).gather(c.clip(0)))
                        if values else pl.lit(None, dtype=pl.String))
    exprs = {k: pl.when(pl.col("_m")).then(e) for k, e in exprs.items()}
    # may hold a number over 64 bits (validate.check_rows looks at these rows only)
    exprs[BIG_MAYBE] = is_mem & (pl.col("_over") & 32 != 0)
    got = got.select(**exprs)
    return pl.DataFrame([_aligned(got[c], df) for c in got.columns])


def _mem_template(df: pl.DataFrame, fields) -> pl.DataFrame:
    """The Attr fields of the MALLOC/FREE rows whose text is the writer's template (``_MEM_ATTR``,
    null on the others). The pattern only says which rows (a match without captures is several
    times cheaper); the values are then cut at the commas, since a template's values hold no comma,
    quote or brace and its keys come in one order: five fixed, then owner, module, phase. (In C++
    where the module is built: ``_native_fields``, 3-4x faster on 850k rows.)"""
    want = dict.fromkeys(("alloc_id", "size") + tuple(fields))
    # when/then computes its branch on every row: the text is nulled off the other rows first, so
    # that the pattern and the cuts skip the ACCESS and op rows' text (over half of a dump's)
    mem = pl.when(pl.col("event").is_in(["MALLOC", "FREE"])).then(pl.col("attr"))
    body = pl.when(mem.str.contains(_MEM_ATTR)).then(mem).str.strip_prefix("{").str.strip_suffix("}")
    parts = df.select(f=body.str.split_exact(",", 7)).unnest("f")
    f = [pl.col(f"field_{i}") for i in range(8)]

    def num(e, key):
        return e.str.strip_prefix(f'"{key}":').cast(pl.Int64, strict=False)

    def text(e, key):
        return e.str.strip_prefix(f'"{key}":"').str.strip_suffix('"')

    def has(e, key):
        return e.str.starts_with(f'"{key}":"')

    exprs = {"alloc_id": num(f[0], "allocation_id"), "addr": text(f[1], "addr"), "size": num(f[2], "size"),
             "used": num(f[3], "used"), "total": num(f[4], "total"),
             "owner": pl.when(has(f[5], "owner")).then(text(f[5], "owner")),
             "module": pl.when(has(f[5], "module")).then(text(f[5], "module"))
                         .when(has(f[6], "module")).then(text(f[6], "module")),
             "phase": pl.when(has(f[6], "phase")).then(text(f[6], "phase"))
                        .when(has(f[7], "phase")).then(text(f[7], "phase"))}
    return parts.select(**{c: exprs[c] for c in want})


def _attr_columns(df: pl.DataFrame, fields=_ATTR_COLUMNS, maybe_big: bool = False) -> pl.DataFrame:
    """alloc_id, size, used, total, owner, addr (those in ``fields``) from Attr (null where the key
    is absent): the writer's templates by one pattern each, the rest per key, on those rows only.
    ``maybe_big``: also ``BIG_MAYBE`` where the C++ fields made it (for validate.check_rows)."""
    attr, ev = pl.col("attr"), pl.col("event")
    # each template only on the rows of its events (a template text on another row reads alike per key)
    want = dict.fromkeys(("alloc_id", "size") + tuple(fields))
    mem = _native_fields(df, want)
    if mem is not None:
        mem = mem.select(list(want) + [BIG_MAYBE])
    else:
        mem = _mem_template(df, fields)
        if df.select((ev == "ACCESS").any()).item():
            acc = df.select(_a=pl.when(ev == "ACCESS").then(attr).str.extract_groups(_ACCESS_ATTR))["_a"].struct
            acc_aid = acc.field("alloc_id").cast(pl.Int64, strict=False)
            acc_size = acc.field("size").cast(pl.Int64, strict=False)
            mem = mem.with_columns(alloc_id=pl.coalesce(pl.col("alloc_id"), acc_aid),
                                   size=pl.coalesce(pl.col("size"), acc_size))
    cols = mem.select("alloc_id", *(c for c in fields if c != "alloc_id"))
    maybe = mem[BIG_MAYBE] if maybe_big and BIG_MAYBE in mem.columns else None
    del mem
    other = cols["alloc_id"].is_null() & df["attr"].is_not_null() & (df["attr"] != "")
    if other.any():
        # The rest, per key, on those rows' text only (null elsewhere: the patterns pass over it),
        # in one select over the frame, so that the columns keep its chunks (a scatter made
        # one-chunk columns, and polars then copied the whole frame at the next operation), and
        # only for the fields those rows have: they are mostly STEP and MSTX rows, with none.
        addr_is_number = cols.schema.get("addr") == pl.Int64  # the C++ fields give it as a number

        def per(attr):
            got = _per_key_exprs(attr)
            if addr_is_number:
                got["addr"] = _addr_number(got["addr"])
            return got
        few = df.select("attr").filter(other).select(**{c: e for c, e in per(pl.col("attr")).items()
                                                        if c in cols.columns})
        have = [c for c in few.columns if few[c].null_count() < few.height]
        if have:
            full = per(pl.when(pl.lit(other)).then(pl.col("attr")))
            slow = df.select(**{c: full[c] for c in have})
            cols = cols.with_columns(pl.coalesce(pl.col(c), slow[c]) for c in have)
    if "addr" in fields and cols.schema["addr"] == pl.String:
        cols = cols.with_columns(addr=_addr_number(pl.col("addr")))
    cols = _unescaped(cols, [c for c in ("owner", "module", "phase") if c in fields])
    out = df.with_columns(_aligned(cols[c], df) for c in fields)
    return out if maybe is None else out.with_columns(maybe)


def _unescaped(cols: pl.DataFrame, texts) -> pl.DataFrame:
    """The text fields as the program wrote them: Attr is JSON, which writes a label or module name
    beyond ASCII (or with a quote) as escapes (``\\u6807``); the patterns cut the text as it is.
    The few values with a backslash are decoded, one by one (online, the analyses saw the text)."""
    for c in texts:
        if cols.schema.get(c) != pl.String:
            continue
        idx = cols[c].str.contains("\\", literal=True).fill_null(False).arg_true()
        if len(idx):
            vals = [_json_text(v) for v in cols[c].gather(idx).to_list()]
            cols = cols.with_columns(cols[c].scatter(idx, vals))
    return cols


def _json_text(v: str) -> str:
    try:
        out = json.loads('"' + v + '"')
    except ValueError:  # not JSON's escapes (another writer's text): as it is
        return v
    return out if isinstance(out, str) else v


def _addr_number(a: pl.Expr) -> pl.Expr:
    # hex ("0x…", the contract); a bare number is decimal (the JSON of a MALLOC row with extra keys)
    return (pl.when(a.str.starts_with("0x")).then(a.str.strip_prefix("0x").str.to_integer(base=16, strict=False))
            .otherwise(a.str.to_integer(base=10, strict=False)))


_IS_STEP = (pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")
# Attr's ``origin``: the pattern on the rows that name it only (when/then would run it on every row's text)
_ORIGIN = _attr_field("origin", False, pl.when(pl.col("attr").str.contains("origin", literal=True)).then(pl.col("attr")))


def _refuse_sizeless(df: pl.DataFrame, path: str, mem_rows) -> None:
    """A MALLOC/FREE row without a size: the first is named. Two columns are looked at (a filter of
    the frame copied every column: ~0.9 s on 10M rows). No size column: no MALLOC/FREE row was read."""
    if "size" not in df.columns:
        return
    no_size = df.select(mem_rows & pl.col("size").is_null()).to_series()
    if no_size.any():
        i = no_size.arg_max()
        raise DumpError(f"{path}: {df['event'][i]} row ID {df['id'][i]} has no size in Attr ('{df['attr'][i]}')")


def _aligned(s: pl.Series, df: pl.DataFrame) -> pl.Series:
    """``s`` cut into the chunks of ``df``'s columns (slices: no copy). A column of one chunk (a
    cumulative sum, a scatter) next to columns of many (the companion's parts) makes polars copy
    every column of the frame into one chunk at the next operation: ~1.7 s on 10M rows."""
    lens = df.get_column(df.columns[0]).chunk_lengths() if df.width else []
    if s.chunk_lengths() == lens or not lens:
        return s
    s, out, at = s.rechunk(), [], 0
    if len(lens) == 1:
        return s
    for n in lens:
        out.append(s.slice(at, n))
        at += n
    return pl.concat(out, rechunk=False)


def _in_order_with_steps(df: pl.DataFrame, want) -> pl.DataFrame:
    """Rows in ID order (the original writes them out of order) with the columns every read derives
    the same way, from the text or the companion: ``step``, and ``step_number`` / ``op`` if asked."""
    if not df["id"].is_sorted():
        df = df.sort("id")
    # said sorted: an analysis' sort by ID (the step rule's replay, compare's ops) is then free,
    # not 0.1 s of sorting 1M sorted rows
    if not df["id"].null_count():
        df = df.with_columns(pl.col("id").set_sorted())
    is_step = _IS_STEP.cast(pl.Int32)
    df = df.with_columns(_aligned(df.select(step=(is_step.cum_sum() - is_step + 1))["step"], df))
    if "step_number" in want:
        df = df.with_columns(_aligned(_step_number(df), df))
    if "op" in want:
        df = df.with_columns(_aligned(_enclosing_op(df), df))
    return df


def _step_number(df: pl.DataFrame) -> pl.Series:
    """The step of each row as the dump numbers it: a STEP row with ``{"step": N}`` ends step N, so
    a row belongs to the number of the next STEP row, rows after the last one to the step after it.
    Uses the numbers in the STEP rows (right under ``--steps``), the count where they carry none."""
    # the pattern runs on the STEP rows' text only (when/then would run it on every row)
    nums = df.select(n=pl.when(_IS_STEP).then(pl.col("attr")).str.extract(r'"?step"?\s*:\s*(\d+)', 1)
                     .cast(pl.Int64, strict=False))["n"]
    n_steps = int(df.select(_IS_STEP.sum()).item() or 0)
    given = nums.drop_nulls()
    if n_steps == 0 or given.len() != n_steps:
        return df["step"].cast(pl.Int64).alias("step_number")
    return nums.backward_fill().fill_null(int(given[-1]) + 1).alias("step_number")


def _enclosing_op(df: pl.DataFrame) -> pl.Series:
    """For each row (frame in ID order), the innermost ATEN op open on its thread at that row
    (a START row's own op), by depth: the last ATEN_START on the thread that opened the row's depth."""
    ev, et = pl.col("event"), pl.col("event_type")
    start = (ev == "OP_LAUNCH") & (et == "ATEN_START")
    end = (ev == "OP_LAUNCH") & (et == "ATEN_END")
    if not df.select(start.any()).item():  # no op opened (a dump without launch events): none open
        return pl.Series("op", [], dtype=df.schema["name"]).extend_constant(None, df.height)
    d = pl.when(start).then(1).when(end).then(-1).otherwise(0)
    q = df.lazy().select(_s=start, _e=end, _n=pl.col("name"), _t=pl.col("tid"), _d=d.cum_sum().over("tid"))
    q = q.with_columns(_op=pl.when(pl.col("_e")).then(None).otherwise(
        pl.when(pl.col("_s")).then(pl.col("_n")).forward_fill().over("_t", "_d")))
    return q.select(op=pl.when(pl.col("_d") > 0).then(pl.col("_op"))).collect()["op"]


def _derive(frame, path: str, want: tuple = DEFAULT_COLUMNS, events=None, counts=None, attr_of=None,
            nul: bool = True) -> pl.DataFrame:
    """The analysis columns from the file's string columns (``frame``: the frame, or a list holding
    it, which is emptied so that the columns not kept are freed here). ``nul``: False when the
    file is known to hold no NUL byte (its columns are then not searched for one)."""
    df = frame.pop() if isinstance(frame, list) else frame
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
    need = _source_columns(want, events)
    out = df.select([c for c in NAMES if c in need]).with_columns(id=ids, ts=ts)
    del df
    out = out.with_columns(pl.col(c).cast(pl.Int64, strict=False) for c in ("pid", "tid") if c in out.columns)
    out = _in_order_with_steps(out, want)
    if counts is not None:
        counts.update((k, int(v)) for k, v in out.group_by("event").len().iter_rows())
    # every row of the file is checked, whatever is kept: the checks of every row (IDs, NUL in the
    # text columns) on the whole frame here, those of Attr on every MALLOC/FREE row below; the
    # other events' Attr is parsed only where the analysis keeps their rows
    every = out.select(c for c in ("id", "event", "event_type", "name", "device", "ptr") if c in out.columns)
    late = events is not None and "attr" in out.columns  # the MALLOC/FREE rows are kept to be checked
    if events is not None:
        out = out.filter(pl.col("event").is_in(sorted(set(events) | ({"MALLOC", "FREE"} if late else set()))))
    fields = tuple(c for c in _ATTR_COLUMNS if c in want)
    mem_rows = pl.col("event").is_in(["MALLOC", "FREE"])
    if fields or out.select(mem_rows.any()).item():
        # every MALLOC/FREE row read has a size, whatever the analysis asks for
        out = _attr_columns(out, tuple(dict.fromkeys(fields + ("alloc_id", "size"))), maybe_big=True)
    _refuse_sizeless(out, path, mem_rows)
    validate.check_rows(out, path, every, nul=nul)  # rows that parse but cannot be true: on every row, whatever is kept
    del every
    if late and not {"MALLOC", "FREE"} <= set(events):
        out = out.filter(pl.col("event").is_in(list(events)))
    if "origin" in want:
        out = out.with_columns(_aligned(out.select(origin=_ORIGIN)["origin"], out))
    if attr_of is not None and "attr" in want:
        attr = out.select(attr=pl.when(pl.col("event").is_in(list(attr_of))).then(pl.col("attr")))["attr"]
        out = out.with_columns(_aligned(attr, out))
    # (a column in other chunks than the frame's makes the select copy every column: 0.66 s at 3M rows)
    return out.select(want)


#: text columns a batched read keeps as categoricals (few distinct values, millions of rows)
CATEGORICAL = ("event", "event_type", "name", "device", "ptr", "py_stack", "owner")
BATCH_BYTES = 32 << 20


def read_dump_batched(path: str, columns=None, events=None, batch_bytes: int = BATCH_BYTES) -> pl.DataFrame:
    """``read_dump`` for dumps of millions of rows: a plain CSV dump is parsed a batch of lines at
    a time and only the analysis columns of each batch are kept, the text columns as categoricals
    (``CATEGORICAL``; ``attr`` only on the rows other than MALLOC/FREE/ACCESS), so that the memory
    is about the result's, not the file's text. Every row is checked as ``read_dump`` checks it
    (the text checks batch by batch: ``validate.row_flags``; those across rows on the whole).
    Other dumps (db, ``.csv.zst``) are read by ``read_dump`` and converted."""
    want = _wanted(columns)
    keep = None if events is None else tuple(events)
    path = resolve_one(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
        size = os.path.getsize(path)
    except OSError as e:
        raise DumpError(f"{path}: cannot be read ({e.strerror})") from None
    if size > max_input_bytes() or size == 0 or head.startswith(b"SQLite format 3") or head.startswith(ZSTD_MAGIC):
        df = read_dump(path, columns=columns, events=events)
        return df.with_columns(pl.col(c).cast(pl.Categorical) for c in CATEGORICAL if c in df.columns)
    got = capture_parts(path)
    df = None if got is None else _from_capture(got, path, want, keep, None, batched=True)
    if df is not None:
        return df.with_columns(pl.col(c).cast(pl.Categorical) for c in CATEGORICAL + ("op",) if c in df.columns)
    try:
        key = _companion_key(path, size) if keep is None else None
        if key is not None:
            got = _companion_read(path, key, want)
            if got is not None:
                return got
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                df = _read_batched(path, want, None, batch_bytes)
            said = _replay(caught)
            _companion_write(path, key, df, said)
            return df
        return _read_batched(path, want, keep, batch_bytes)
    except DumpError as e:
        # a bad file is said as read_dump says it (which of its faults comes first, in the same
        # words): read it whole, on this error path only
        try:
            read_dump(path, columns=columns, events=events)
        except DumpError as whole:
            if "reading it would need" in str(whole):  # too large to read whole: the batch's words
                raise e from None
            raise whole from None
        raise e from None


# ---------------------------------------------------------------- capture-time companion
# The columns the dump writer kept beside the dump while it wrote it (io/columns.py): used while its
# manifest describes the dump file as it is now, and the code that wrote them is this code.
_capture_code = None


def capture_parts(path: str):
    """``(parquet parts, rows)`` of the dump's capture-time companion, or None (none, stale, another
    code's, turned off with ``MSMEMSCOPE_COLUMN_CACHE=0``)."""
    global _capture_code
    from . import columns as C
    if not C.enabled():
        return None
    folder = C.folder_of(path)
    meta = C.read_manifest(folder)
    if meta is None or meta.get("version") != C.VERSION:
        return None
    try:
        if meta.get("file") != C.file_key(path):
            return None
        if _capture_code is None:
            _capture_code = C.code_key()
        if meta.get("code") != _capture_code:
            return None
        parts = [os.path.join(folder, name) for name, _ in meta["parts"]]
        rows = int(meta["rows"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
    if not parts or not all(os.path.isfile(p) for p in parts):
        return None
    return parts, rows


def _from_capture(got, path: str, want: tuple, keep, counts, batched: bool = False, attr_of=None) -> pl.DataFrame:
    """``_derive``'s columns from the stored ones: the same steps, ops, checks and Attr fields (the
    Attr texts that are not the writer's template parsed here, as the text read parses them)."""
    from . import columns as C
    parts, rows = got
    fields = tuple(dict.fromkeys(tuple(c for c in _ATTR_COLUMNS if c in want) + ("alloc_id", "size")))
    remake = "attr" in want and not batched and (attr_of is None or {"MALLOC", "FREE"} & set(attr_of))
    if remake:  # the template rows' text is made again from all their fields
        fields = fields + tuple(c for c in _ATTR_COLUMNS if c not in fields)
    # id, event, event_type (steps), attr (the rows whose fields come from their text), what is asked
    base = {"id", "event", "event_type", "attr"} | (set(want) & set(NAMES)) | ({"name", "tid"} if "op" in want else set())
    read = [c for c in C.SCHEMA_NAMES if c in base or c in fields]
    try:
        df = pl.scan_parquet(parts).select(read).collect()
    except Exception:  # parts that cannot be read (a disk error, a file replaced): the text
        return None
    if df.height != rows:  # parts that are not the ones the manifest counted: the text
        return None
    # Steps, enclosing ops and the rows an analysis keeps are worked out on the stored categorical
    # columns, and only the kept rows' text is made: a filter after the cast moved 10M rows of
    # strings (2.5 s of the summary's read)
    df = _in_order_with_steps(df, want)
    if counts is not None:
        counts.update((k, int(v)) for k, v in df.group_by("event").len().iter_rows())
    every = df.select("id")  # the text columns hold no NUL: the writer stores none (io/columns.py)
    mem_rows = pl.col("event").is_in(["MALLOC", "FREE"])
    if keep is not None:
        df = df.filter(pl.col("event").is_in(sorted(set(keep) | {"MALLOC", "FREE"})))
    # the text read's types (a batched read keeps its CATEGORICAL ones categorical); ``op`` is made
    # from ``name`` and takes its type
    as_text = [c for c in C.CATEGORICAL if c in df.columns and not (batched and c in CATEGORICAL)]
    if "op" in df.columns and "name" in as_text:
        as_text.append("op")
    try:
        df = df.with_columns(pl.col(c).cast(pl.String) for c in as_text)
    except Exception:
        return None
    # the rows whose Attr fields were not stored (ACCESS rows keep their text and their fields);
    # a column is remade only where one of these rows gets another value (mostly none is: the
    # SYSTEM and MSTX rows have no such fields, and each remade column is ~10M cells of new memory)
    text_rows = (df["attr"].is_not_null() & df["alloc_id"].is_null()).arg_true()
    if text_rows.len():
        slow = _attr_columns(df[text_rows].select("event", "attr"), fields)
        moved = [c for c in fields if not slow[c].eq_missing(df[c].gather(text_rows)).all()]
        if moved:
            df = df.with_columns(*(_aligned(df[c].scatter(text_rows, slow[c]), df) for c in moved))
    _refuse_sizeless(df, path, mem_rows)
    text = pl.when(mem_rows).then(pl.col("attr"))
    flags = df.select(text.str.contains(r"[:,]\s*-?\d{19,}").any()).item()
    df = df.with_columns(_attr_big=validate._attr_number_too_big(df.select(text)[:, 0]) if flags else pl.lit(False),
                         _attr_original=text.str.contains(validate._ORIGINAL_ATTR).fill_null(False))
    validate.check_rows(df, path, every)
    del every
    if keep is not None and not {"MALLOC", "FREE"} <= set(keep):
        df = df.filter(pl.col("event").is_in(list(keep)))
    # the columns made here are cut to the frame's chunks (``_aligned``): one that is not makes the
    # last select copy the whole frame (0.2 s of the summary's read at 3M rows)
    if "origin" in want:
        df = df.with_columns(_aligned(df.select(origin=pl.when(pl.col("attr").str.contains("origin", literal=True))
                                                .then(_attr_field("origin", False)))["origin"], df))
    if batched and "origin" not in want:  # as _batch keeps it: Attr text only where a later step reads it
        df = df.with_columns(attr=pl.when(pl.col("event").is_in(["MALLOC", "FREE", "ACCESS"])).then(None)
                             .otherwise(pl.col("attr")))
    elif attr_of is not None and "attr" in want:
        df = df.with_columns(_aligned(df.select(attr=pl.when(pl.col("event").is_in(list(attr_of)))
                                                .then(pl.col("attr")))["attr"], df))
    if remake:
        tmpl = (df["attr"].is_null() & df["alloc_id"].is_not_null()
                & df["event"].is_in([e for e in ("MALLOC", "FREE") if attr_of is None or e in attr_of]))
        if tmpl.any():
            # the template rows only (a pass over every row, copying the other texts, was slower)
            idx = tmpl.arg_true()
            tmpl_cols = df.select("alloc_id", "addr", "size", "used", "total", "owner", "module", "phase")
            df = df.with_columns(_aligned(df["attr"].scatter(idx, C.template_attr(tmpl_cols[idx])), df))
    if "ptr" in want:
        df = df.with_columns(_aligned(C.hex16(df["ptr"], "0x", "N/A"), df))
    return df.select(want)


# ---------------------------------------------------------------- columnar companion
# A big CSV dump's batched read is kept beside it, in a hidden parquet file, so that the next
# report of the same dump reads columns instead of parsing text (~20x less CPU). It is a cache,
# never a source: used only when it matches the dump byte for byte as far as the file system says
# (size, mtime and ctime in ns, inode) and was made by this reader's code (a hash of the modules
# whose logic shapes the columns), else ignored and made again; unreadable, absent or unwritable
# (a read-only folder) it changes nothing but the time. Small dumps (under
# MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES, default 64 MiB) are read from their text each time and leave
# no file; MSMEMSCOPE_COLUMN_CACHE=0 turns it off. It holds the columns last asked for (the report's).
COMPANION_VERSION = 1
COMPANION_MIN_BYTES = 64 << 20
_META_KEY = "msmemscope.columns"
_code_hash = None


def companion_path(path: str) -> str:
    d, b = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{b}.columns.parquet")


def _reader_code() -> str:
    global _code_hash
    if _code_hash is None:
        import hashlib
        from .. import events
        h = hashlib.sha256(pl.__version__.encode())
        for mod in (__file__, validate.__file__, events.__file__):
            with open(mod, "rb") as f:
                h.update(f.read())
        _code_hash = h.hexdigest()[:32]
    return _code_hash


def _companion_key(path: str, size: int) -> dict | None:
    """What a companion must say of the dump to be used (None: no companion for this dump)."""
    if os.environ.get("MSMEMSCOPE_COLUMN_CACHE", "").strip().lower() in ("0", "off", "no", "false"):
        return None
    try:
        least = int(os.environ.get("MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES", COMPANION_MIN_BYTES))
    except ValueError:
        least = COMPANION_MIN_BYTES
    if size < least:
        return None
    try:
        st = os.stat(path)
        code = _reader_code()
    except OSError:
        return None
    # the run's config.json decides one check (validate._records_every_allocation): its state too
    cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path)))), "config.json")
    try:
        c = os.stat(cfg)
        config = [c.st_size, c.st_mtime_ns, c.st_ino]
    except OSError:
        config = None
    return {"version": COMPANION_VERSION, "code": code, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev, "config": config}


def _companion_read(path: str, key: dict, want: tuple) -> pl.DataFrame | None:
    """The dump's columns from its companion, or None (absent, stale, another reader's, corrupt)."""
    import json as _json
    cache = companion_path(path)
    try:
        if not os.path.isfile(cache):
            return None
        meta = _json.loads(pl.read_parquet_metadata(cache).get(_META_KEY, "null"))
        if not isinstance(meta, dict) or meta.get("key") != key or not set(want) <= set(meta.get("columns", ())):
            return None
        df = pl.read_parquet(cache, columns=list(want))
        if df.height != meta.get("rows"):
            return None
    except Exception:  # a cache that cannot be read is no cache
        return None
    for category, message in meta.get("warnings", ()):
        warnings.warn(message, _WARNINGS.get(category, UserWarning), stacklevel=3)
    return df


def _replay(caught) -> list:
    """The warnings of a read, said again to the caller (the filters in force outside apply);
    those a dump itself causes kept to be said again when its companion is read."""
    said = []
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        name = next((k for k, v in _WARNINGS.items() if v is w.category), None)
        if name is not None:
            said.append([name, str(w.message)])
    return said


def _companion_write(path: str, key: dict, df: pl.DataFrame, said: list) -> None:
    """Writes the companion beside the dump, atomically; any failure leaves no file behind."""
    import json as _json
    cache = companion_path(path)
    tmp = f"{cache}.{os.getpid()}.tmp"
    try:
        try:
            if _companion_key(path, key["size"]) != key:  # the dump changed while it was read
                return
            meta = {"key": key, "columns": list(df.columns), "rows": df.height, "warnings": said}
            df.write_parquet(tmp, compression="lz4", statistics=False, metadata={_META_KEY: _json.dumps(meta)})
            os.replace(tmp, cache)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except Exception:  # a folder we cannot write to, a full disk: the read stands without it
        pass


def _read_batched(path: str, want: tuple, keep, batch_bytes: int) -> pl.DataFrame:
    complete, size = check_csv(path)
    if complete < size:
        with open(path, "rb") as f:
            lines = f.read(complete).count(b"\n")
        warnings.warn(f"{path}: last row is incomplete (the dump was cut short); read up to line {lines}",
                      TruncatedDumpWarning, stacklevel=3)
    need = _source_columns(want, keep) | {"attr"}
    parts, rows = [], 0
    with open(path, "rb") as f:
        header = f.readline()  # each batch is parsed under the header, as read_dump parses the file

    def parse(text: bytes, row0: int):
        try:
            raw = csv_frame(io.BytesIO(header + text))
        except Exception:
            raise DumpError(_locate_csv_error(path)) from None
        if raw.width != len(NAMES):
            raise DumpError(_locate_csv_error(path))
        return raw.height, _batch(raw, path, row0, want, keep, need)

    # batches on as many threads as there are cores (most string work of polars runs on one
    # thread per column), at most one more in flight than threads; taken in file order. The row
    # numbers in a batch's errors need the rows before it: a batch that fails is parsed again
    # once those are known, so it says what a read in order says.
    workers = max(1, min(2, os.cpu_count() or 1))
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()

        def settle():
            nonlocal rows
            fut, text = pending.popleft()
            try:
                height, part = fut.result()
            except DumpError:
                height, part = parse(text, rows)  # raises, with this batch's true line numbers
            parts.append(part)
            rows += height

        for text in _line_batches(path, complete, batch_bytes):
            pending.append((pool.submit(parse, text, 0), text))
            if len(pending) > workers:
                settle()
        while pending:
            settle()
    out = pl.concat(parts, how="vertical_relaxed", rechunk=False)  # chunked: never two copies at once
    del parts
    out = _in_order_with_steps(out, want)
    every = out.select("id", *(c for c in out.columns if c.startswith("_nul_")))
    validate.check_rows(out, path, every)
    del every
    if keep is not None:
        out = out.filter(pl.col("event").is_in(list(keep)))
    if "origin" in want:
        out = out.with_columns(origin=_ORIGIN)
    return out.select(want)


def _line_batches(path: str, end: int, batch_bytes: int):
    """The file's rows after the header, up to byte ``end``, in blocks of whole lines (a newline
    inside a quoted field is not a line's end: a cut is made where the quotes before it pair up).
    Quotes are counted once per byte, whatever the file (an unclosed quote costs no rescans)."""
    with open(path, "rb") as f:
        f.readline()
        pos = f.tell()
        rest, rest_q = b"", 0  # the text carried to the next block, and its quotes
        while pos < end:
            block = f.read(min(batch_bytes, end - pos))
            if not block:
                break
            pos += len(block)
            if pos >= end:
                rest += block
                break
            q = rest_q + block.count(b'"')  # quotes before the candidate cut, walking back
            seg_end = len(block)
            cut = block.rfind(b"\n")
            while cut >= 0:
                q -= block.count(b'"', cut, seg_end)
                seg_end = cut
                if q % 2 == 0:
                    break
                cut = block.rfind(b"\n", 0, cut)
            if cut < 0:
                rest, rest_q = rest + block, rest_q + block.count(b'"')
                continue
            yield rest + block[:cut + 1]
            rest = block[cut + 1:]
            rest_q = rest.count(b'"')
            del block
        if rest:
            yield rest


def _batch(raw: pl.DataFrame, path: str, row0: int, want: tuple, keep, need: set) -> pl.DataFrame:
    """One batch of a batched read: the checks of each row, the Attr fields, the compact columns."""
    short = raw["event"].is_null() | raw["ts"].is_null() | raw["ptr"].is_null()
    if short.any():
        raise DumpError(f"{path}: line {row0 + int(short.arg_max()) + 2} has too few fields, expected {len(NAMES)}")
    ids = raw["id"].cast(pl.Int64, strict=False)
    bad = ids.is_null()
    if bad.any():
        i = int(bad.arg_max())
        raise DumpError(f"{path}: row {row0 + i + 1} has ID '{raw['id'][i]}', not a number")
    ts = raw["ts"].cast(pl.Int64, strict=False)
    bad = ts.is_null() & raw["ts"].is_not_null()
    if bad.any():
        i = int(bad.arg_max())
        raise DumpError(f"{path}: row {row0 + i + 1} (ID {ids[i]}) has timestamp '{raw['ts'][i]}', not a number")
    flags = validate.row_flags(raw)
    rows = raw.select([c for c in NAMES if c in need]).with_columns(id=ids, ts=ts)
    del raw
    if keep is not None:
        # the rows kept, every MALLOC/FREE row for the checks, the rows that number steps and ops
        sel = pl.col("event").is_in(sorted(set(keep) | {"MALLOC", "FREE", "SYSTEM"}
                                           | ({"OP_LAUNCH"} if "op" in want else set())))
        mask = rows.select(sel)[:, 0]
        rows, flags = rows.filter(mask), flags.filter(mask)
    rows = rows.with_columns(pl.col(c).cast(pl.Int64, strict=False) for c in ("pid", "tid") if c in rows.columns)
    rows = _attr_columns(rows, tuple(dict.fromkeys(tuple(c for c in _ATTR_COLUMNS if c in want) + ("alloc_id", "size"))))
    no_size = rows.select(pl.col("event").is_in(["MALLOC", "FREE"]) & pl.col("size").is_null())[:, 0]
    if no_size.any():
        i = int(no_size.arg_max())
        raise DumpError(f"{path}: {rows['event'][i]} row ID {rows['id'][i]} has no size in Attr "
                        f"('{rows['attr'][i]}')")
    if "origin" not in want:
        # Attr's text stays only where a later step reads it (STEP numbers, marks, the few other rows)
        big = pl.col("event").is_in(["MALLOC", "FREE", "ACCESS"])
        rows = rows.with_columns(attr=pl.when(big).then(None).otherwise(pl.col("attr")))
    rows = rows.with_columns(pl.col(c).cast(pl.Categorical) for c in CATEGORICAL if c in rows.columns)
    return pl.concat([rows, flags], how="horizontal")


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
