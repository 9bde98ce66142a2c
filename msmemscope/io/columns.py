"""The dump's columns, written beside it while it is written (the capture-time columnar companion).

The CSV stays the contract and is written exactly as before; the dump writer process hands each
batch of rows it wrote to ``ColumnWriter.add`` (io/column_writer.py) as well, which keeps them as typed columns (the
``Attr`` fields of the MALLOC/FREE rows as numbers, not text) in parquet parts in a hidden folder
beside the dump, ``.<dump name>.columns/``. At the writer's close a ``manifest.json`` commits them
with what the dump file was at that moment (size, mtime and ctime in ns, inode, device): the
reader (io/reader.py ``capture_parts``) takes the columns from there only while the dump is still
exactly that file, and reads the text otherwise (a dump edited, cut, appended to by another
writer, a writer process killed before its close: no manifest, or one that no longer matches).

What is stored is what the reader makes of the text, row for row: the text columns as the CSV
reader sees them (neutralised as ``writers.csv_field`` writes them, "" as null), ``ptr`` as its
number (null: ``N/A``), and for each MALLOC/FREE row whose Attr is the writer's template the
parsed fields with ``attr`` null (``template_attr`` gives the text back, byte for byte); every
other row keeps its Attr text and the reader parses it as it parses the CSV's. A row this module
cannot hold exactly (a number over 64 bits, a NUL in a text, a value of an odd type) turns the
companion off for the dump: the text is then the only source, as for any other CSV.

Cost: nothing for a dump under ``MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES`` (64 MiB of CSV): bytes are
only counted. The write that passes it reads the CSV written so far once (the reader's own parse)
and from then on each batch is turned into columns (one tuple per row in Python, then polars),
in the writer process, never in the traced one. ``MSMEMSCOPE_COLUMN_CACHE=0`` turns it off.
"""
from __future__ import annotations

import json
import os

VERSION = 1
MANIFEST = "manifest.json"
PART_ROWS = 1 << 18           # rows of one parquet part
BUILD_ROWS = 1 << 16          # rows gathered as Python values before polars makes them columns
DEFAULT_MIN_BYTES = 64 << 20  # the reader's companion threshold (io/reader.py COMPANION_MIN_BYTES)

#: the stored columns (the reader's names; ``ptr`` a number, ``attr`` null on template rows)
SCHEMA_NAMES = ("id", "event", "event_type", "name", "ts", "pid", "tid", "device", "ptr", "attr", "py_stack",
                "c_stack", "alloc_id", "addr", "size", "used", "total", "owner", "module", "phase")
_INTS = {"id", "ts", "pid", "tid", "ptr", "alloc_id", "addr", "size", "used", "total"}
#: text columns of few distinct values, stored as categoricals (dictionary pages: read back small)
CATEGORICAL = ("event", "event_type", "name", "device", "py_stack", "c_stack", "owner", "module", "phase")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # writers.csv_field's neutralising rule
_FIELD_OK = frozenset('",}\\')  # characters the reader's MALLOC/FREE template refuses in a text value


def enabled() -> bool:
    return os.environ.get("MSMEMSCOPE_COLUMN_CACHE", "").strip().lower() not in ("0", "off", "no", "false")


def min_bytes() -> int:
    try:
        return int(os.environ.get("MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES", DEFAULT_MIN_BYTES))
    except ValueError:
        return DEFAULT_MIN_BYTES


def folder_of(dump: str) -> str:
    d, b = os.path.split(os.path.abspath(dump))
    return os.path.join(d, f".{b}.columns")


def file_key(path: str) -> dict:
    """What the dump file is now, as far as the file system says (the manifest keeps it)."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


_code = None


def code_key() -> str:
    """The code whose rules the stored columns follow (the CSV's writer and reader, this module, the
    polars version), as loaded by this process (computed once: a writer running while the package is
    upgraded keeps its own)."""
    global _code
    if _code is not None:
        return _code
    import hashlib
    from importlib.metadata import version
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(f"{VERSION}:{version('polars')}".encode())
    for name in ("columns.py", "column_writer.py", "writers.py", "reader.py", os.path.join("..", "events.py")):
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    _code = h.hexdigest()[:32]
    return _code


def read_manifest(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            meta = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


# ---------------------------------------------------------------------- shared with the reader
_HEX2 = None  # the 256 two-digit hex texts as uint16 cells (made on first use)


def hex16(s):
    """A polars Int64 Series as ``%016x`` text (null stays null): vectorised (numpy, a byte at a time
    through a table of the 256 two-digit texts)."""
    import numpy as np
    import polars as pl
    global _HEX2
    if _HEX2 is None:
        _HEX2 = np.frombuffer("".join(f"{i:02x}" for i in range(256)).encode(), dtype=np.uint16)
    a = s.fill_null(0).cast(pl.UInt64).to_numpy().astype(">u8")
    digits = _HEX2[a.view(np.uint8).reshape(-1, 8)]  # (n, 8) two-character cells, most significant first
    text = pl.Series(s.name, np.ascontiguousarray(digits).view("S16").ravel()).cast(pl.String)
    return text.zip_with(s.is_not_null(), pl.Series(s.name, [], dtype=pl.String).extend_constant(None, len(s))) \
        if s.null_count() else text


def template_attr(df):
    """The Attr text of the MALLOC/FREE rows from their fields, as the writer's template prints
    it (``{"allocation_id":…,"addr":"0x…","size":…,"used":…,"total":…[,"owner":…][,"module":…[,"phase":…]]}``);
    null where ``alloc_id`` is null."""
    import polars as pl
    f = df.select("alloc_id", "size", "used", "total", "owner", "module", "phase", h=hex16(df["addr"]))
    f = f.select(pl.format('{{"allocation_id":{},"addr":"0x{}","size":{},"used":{},"total":{}', "alloc_id", "h",
                           "size", "used", "total").alias("a"), "owner", "module", "phase")
    part = [pl.col("a")]
    for k in ("owner", "module", "phase"):
        part.append(pl.when(pl.col(k).is_not_null()).then(pl.format(f',"{k}":"{{}}"', k)).otherwise(pl.lit("")))
    return f.select(pl.concat_str(part + [pl.lit("}")]).alias("attr"))["attr"]
