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
A writer process that falls behind the program (its pipe still half full after each of
``spool.BEHIND_FRAMES`` frames in a row) drops the companion and writes the text alone, and one
busy more than ``spool.BUSY_MAX`` of the time with the text alone never starts it: making columns
is most of its work (~2 us a row), and a program of tiny ops makes rows faster than that
(bench's ``deep`` workload: 2.6x the plain program with it, 1.8x without).
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
_HEX_SLICE = 1 << 20


class _Stream:
    """An Arrow C stream made in C++ (``hex_texts``, ``template_texts``), handed to ``pl.Series``."""
    def __init__(self, capsule):
        self.capsule = capsule

    def __arrow_c_stream__(self, requested_schema=None):
        return self.capsule


def text_module(needs: str = "template_texts"):
    """The torch-free C++ module (built with the native source) for the Attr fields the reader
    parses, the texts it makes again and its scan of a CSV text, or None: not built, without
    ``needs``, or ``MSMEMSCOPE_ATTR_FIELDS=polars`` (polars', numpy's and Python's ways for all
    of them)."""
    if os.environ.get("MSMEMSCOPE_ATTR_FIELDS", "").strip().lower() == "polars":
        return None
    from .. import leak_native
    m = leak_native.load_module()
    return m if m is not None and hasattr(m, needs) else None


def _null_mask(s):
    return s.is_null().to_numpy() if s.null_count() else None


def hex16(s, prefix: str = "", null: str | None = None):
    """A polars Int64 Series as ``prefix`` + ``%016x`` text, ``null`` where it is null (None: stays
    null). In C++ where the module is built (one Arrow string array); else vectorised (numpy, a
    byte at a time through a table of the 256 two-digit texts), the whole text made in one buffer.
    On a big dump every column made is memory touched for the first time, which costs more than
    the work in it: no "0x" + text or when/then pass after it."""
    import polars as pl
    m = text_module()
    if m is not None and s.dtype == pl.Int64:
        try:
            got = pl.Series(_Stream(m.hex_texts(s.fill_null(0).to_numpy(), _null_mask(s), prefix, null)))
            return got.alias(s.name)
        except ValueError:  # a negative value: numpy's way, which refuses it as it always has
            pass
    return _hex16_numpy(s, prefix, null)


def _hex16_numpy(s, prefix: str = "", null: str | None = None):
    import numpy as np
    import polars as pl
    global _HEX2
    if _HEX2 is None:
        _HEX2 = np.frombuffer("".join(f"{i:02x}" for i in range(256)).encode(), dtype=np.uint16)
    pre = prefix.encode()
    if len(pre) % 2 or (null is not None and len(null.encode()) > len(pre) + 16):
        raise ValueError("hex16: an even-length prefix, and a null text that fits")
    k = len(pre) // 2
    n = len(s)
    if n > _HEX_SLICE:  # in slices: each slice's buffers reuse the memory of the one before
        return pl.concat([_hex16_numpy(s.slice(i, _HEX_SLICE), prefix, null) for i in range(0, n, _HEX_SLICE)],
                         rechunk=False)
    cells = np.empty((n, k + 8), dtype=np.uint16)
    if k:
        cells[:, :k] = np.frombuffer(pre, dtype=np.uint16)
    big = s.fill_null(0).cast(pl.UInt64).to_numpy().astype(">u8")
    cells[:, k:] = _HEX2[big.view(np.uint8).reshape(-1, 8)]  # most significant byte first
    del big
    nulls = s.null_count()
    if nulls and null is not None:
        # a fixed-width bytes cell loses its trailing NULs: the null text padded with them reads as itself
        fill = np.zeros(2 * (k + 8), dtype=np.uint8)
        fill[:len(null.encode())] = np.frombuffer(null.encode(), dtype=np.uint8)
        cells[s.is_null().to_numpy()] = fill.view(np.uint16)
    text = pl.Series(s.name, cells.view(f"S{2 * (k + 8)}").ravel()).cast(pl.String)
    if nulls and null is None:
        text = text.zip_with(s.is_not_null(), pl.Series(s.name, [], dtype=pl.String).extend_constant(None, n))
    return text


_TEMPLATE_NUMBERS = ("alloc_id", "addr", "size", "used", "total")


def _native_template(df):
    """``template_attr`` in C++ (one Arrow array), or None: the module is not there, a number
    column is not Int64, or an address is negative (polars' way then refuses it, as it always
    has)."""
    import polars as pl
    m = text_module()
    if m is None or not all(df.schema.get(c) == pl.Int64 for c in _TEMPLATE_NUMBERS):
        return None
    nums = tuple((df[c].fill_null(0).to_numpy(), df[c].is_null().to_numpy()) for c in _TEMPLATE_NUMBERS)
    texts = [df[c].cast(pl.String).__arrow_c_stream__() if c in df.columns else None
             for c in ("owner", "module", "phase")]
    try:
        return pl.Series(_Stream(m.template_texts(nums, *texts))).alias("attr")
    except ValueError:
        return None


def template_attr(df):
    """The Attr text of the MALLOC/FREE rows from their fields, as the writer's template prints
    it (``{"allocation_id":…,"addr":"0x…","size":…,"used":…,"total":…[,"owner":…][,"module":…[,"phase":…]]}``);
    null where one of its five first fields is. One concat over the fields (an optional key's part
    is null where its value is, and left out)."""
    import polars as pl
    got = _native_template(df)
    if got is not None:
        return got
    f = df.select("alloc_id", "size", "used", "total", "owner", "module", "phase", h=hex16(df["addr"], "0x"))
    part = [pl.lit('{"allocation_id":'), pl.col("alloc_id").cast(pl.String), pl.lit(',"addr":"'), pl.col("h"),
            pl.lit('","size":'), pl.col("size").cast(pl.String), pl.lit(',"used":'), pl.col("used").cast(pl.String),
            pl.lit(',"total":'), pl.col("total").cast(pl.String)]
    for k in ("owner", "module", "phase"):
        part.append(pl.concat_str([pl.lit(f',"{k}":"'), pl.col(k), pl.lit('"')]))
    whole = pl.all_horizontal(pl.col(c).is_not_null() for c in ("alloc_id", "h", "size", "used", "total"))
    text = f.select(pl.when(whole).then(pl.concat_str(part + [pl.lit("}")], ignore_nulls=True)).alias("attr"))["attr"]
    return text
