"""Dump writers: CSV and SQLite, both streaming (rows appended at each flush).

A writer receives batches of rows already numbered and formatted by
``format_rows``; formatting happens once per flush, off the per-op hot path.
"""
from __future__ import annotations

import os
import sqlite3

from ..events import COLUMNS, FORMAT_VERSION, HEADER, format_attr, format_ptr
from .files import FILE_MODE, create_new, fault_point

SQL_TABLE = "memscope_dump"
SQL_COLUMNS = ('ID INTEGER, Event TEXT, "Event Type" TEXT, Name TEXT, "Timestamp(ns)" INTEGER, '
               '"Process Id" INTEGER, "Thread Id" INTEGER, "Device Id" TEXT, Ptr TEXT, Attr TEXT, '
               '"Call Stack(Python)" TEXT, "Call Stack(C)" TEXT')

# Every CSV we write (the dump, the compare table, the watch checksums) goes through these: a
# text that a spreadsheet would run as a formula (it starts with = + - @, or with a TAB or CR
# before one, which some strip) gets a leading ', and a field holding a quote, comma or line
# break is quoted, so no text can start a row of its own.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_FORMULA_RE = r"^[=+\-@\t\r]"


def csv_field(v) -> str:
    """One CSV field: neutralised, quoted only where it must be."""
    v = "" if v is None else str(v)
    if not v:
        return v
    if v[0] in _FORMULA_START:
        v = "'" + v
    if '"' in v or "," in v or "\n" in v or "\r" in v:
        return '"' + v.replace('"', '""') + '"'
    return v


_csv_text = csv_field


def csv_line(fields) -> str:
    """One CSV row of fields, each through ``csv_field``, ended by a newline."""
    return ",".join(csv_field(f) for f in fields) + "\n"


def _plain(text: str) -> bool:
    """Text that JSON and CSV carry as it is (no quote, backslash or control character)."""
    return not text or (text.isprintable() and '"' not in text and "\\" not in text)


def csv_safe(column: str):
    """A polars expression: the string ``column`` neutralised as ``csv_field`` does (polars's
    writer then quotes what must be quoted), so a spreadsheet shows it instead of running it."""
    import polars as pl
    c = pl.col(column).cast(pl.String)
    return pl.when(c.str.contains(_FORMULA_RE)).then(pl.lit("'") + c).otherwise(c).alias(column)


def table_rows(rows, first, pid, c_syms=None):
    """Raw rows -> tuples of the 12 dump columns."""
    c_syms = c_syms or {}
    return [(first + i, ev, et, name, ts, pid, tid, dev, format_ptr(ptr), format_attr(ev, attr),
             ps or "", c_syms.get(i, ""))
            for i, (ev, et, name, ts, tid, dev, ptr, attr, ps, _cs) in enumerate(rows)]


_CSV_CONSTS = ("OP_LAUNCH", "MALLOC", "FREE", "ACCESS")
_csv_fast = None  # the C++ line maker, False once looked for and absent


def _csv_rows():
    """``csv_rows`` of the torch-free C++ module where it is built (the writer process loads it
    too), else None: the Python loop (``MSMEMSCOPE_CSV_ROWS=python`` forces it)."""
    global _csv_fast
    if _csv_fast is None:
        _csv_fast = False
        if os.environ.get("MSMEMSCOPE_CSV_ROWS", "").strip().lower() != "python":
            try:
                from ..leak_native import load_module
                mod = load_module()
                _csv_fast = getattr(mod, "csv_rows", None) or False
            except Exception:  # a broken build: the Python loop writes the same text
                _csv_fast = False
    return _csv_fast or None


class CsvWriter:
    suffix = ".csv"

    def __init__(self, path: str):
        self.path = path
        self._f = create_new(path)
        self._esc: dict = {}  # text -> its CSV field
        self.columns = None   # the capture-time columnar companion (io/columns.py), in the writer process
        self._f.write(HEADER + "\n")
        self._f.flush()

    @classmethod
    def attach(cls, fd: int) -> "CsvWriter":
        """A writer on a dump another process created (the spool's writer process)."""
        w = cls.__new__(cls)
        w._f = os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace", newline="")
        w.path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        w._esc = {}
        w.columns = None
        return w

    def detach(self) -> None:
        """This process stops writing; the file stays open elsewhere."""
        self._f.close()

    def reopen(self) -> "CsvWriter":
        """Write here again after another process wrote the file: appending after its last
        complete row (a row it was cut off in the middle of is dropped)."""
        fd = os.open(self.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        end = os.lseek(fd, 0, os.SEEK_END)
        pos = end
        while pos > 0:
            n = min(1 << 16, pos)
            chunk = os.pread(fd, n, pos - n)
            i = chunk.rfind(b"\n")
            if i >= 0:
                pos = pos - n + i + 1
                break
            pos -= n
        if pos != end:
            os.ftruncate(fd, pos)
        os.lseek(fd, 0, os.SEEK_END)
        self._f = os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace", newline="")
        return self

    def write(self, rows, first, pid, c_syms=None, ids=None) -> None:
        """Rows numbered ``first, first + 1, ...``, or ``ids`` (a bounded dump leaves gaps)."""
        fault_point()
        esc = self._esc
        if len(esc) > 200_000:
            esc.clear()
        fast = _csv_rows()
        if fast is not None and not c_syms and type(rows) is list and (ids is None or type(ids) is list):
            # the frequent rows in C++ (_leakrule.cpp csv_rows); each row it stops at goes through
            # the loop below alone (which caches its name's and stack's texts), then C++ goes on
            out, at, n = [], 0, len(rows)
            while at < n:
                at, text = fast(rows, at, first, ids, pid, esc, _CSV_CONSTS)
                out.append(text)
                if at < n:
                    out.append(self._lines(rows[at:at + 1], first + at, pid, None,
                                           None if ids is None else ids[at:at + 1]))
                    at += 1
            text = "".join(out)
        else:
            text = self._lines(rows, first, pid, c_syms, ids)
        self._put(text)
        if self.columns is not None:
            self.columns.add(rows, first, pid, c_syms, ids, len(text))

    def _lines(self, rows, first, pid, c_syms, ids) -> str:
        """The CSV lines of ``rows`` in Python: the reference of ``csv_rows`` and every row it leaves."""
        # One f-string per row, specialised for the frequent kinds; op names and
        # stacks repeat, so their CSV text is cached.
        c_syms = c_syms or {}
        esc = self._esc
        out = []
        add = out.append
        i = first
        for n, (ev, et, name, ts, tid, dev, ptr, attr, ps, _cs) in enumerate(rows):
            if ids is not None:
                i = ids[n]
            nm = esc.get(name)
            if nm is None:
                nm = esc[name] = _csv_text(name)
            if ps:
                st = esc.get(ps)
                if st is None:
                    st = esc[ps] = _csv_text(ps)
            else:
                st = ""
            cs = _csv_text(c_syms[n]) if n in c_syms else ""
            if ev == "OP_LAUNCH":
                add(f"{i},OP_LAUNCH,{et},{nm},{ts},{pid},{tid},{dev},N/A,,{st},{cs}\n")
            elif type(attr) is tuple and ev == "MALLOC" and len(attr) == 6 and _plain(attr[5]):
                ow = attr[5]
                add(f'{i},MALLOC,{et},{nm},{ts},{pid},{tid},{dev},0x{ptr:016x},"{{""allocation_id"":{attr[0]},'
                    f'""addr"":""0x{attr[1]:016x}"",""size"":{attr[2]},""used"":{attr[3]},""total"":{attr[4]},'
                    f'""owner"":""{ow}""}}",{st},{cs}\n')
            elif type(attr) is tuple and ev == "FREE":
                add(f'{i},FREE,{et},{nm},{ts},{pid},{tid},{dev},0x{ptr:016x},"{{""allocation_id"":{attr[0]},'
                    f'""addr"":""0x{attr[1]:016x}"",""size"":{attr[2]},""used"":{attr[3]},""total"":{attr[4]}}}",'
                    f'{st},{cs}\n')
            else:
                a = format_attr(ev, attr)
                add("%d,%s,%s,%s,%d,%d,%d,%s,%s,%s,%s,%s\n" % (
                    i, ev, et, nm, ts, pid, tid, dev,
                    "N/A" if ptr is None else "0x%016x" % ptr,
                    '"' + a.replace('"', '""') + '"' if a else "", st, cs))
            i += 1
        return "".join(out)

    def _put(self, text: str) -> None:
        self._f.write(text)
        self._f.flush()  # reaches the kernel: survives SIGKILL of this process

    def last_id(self) -> int:
        """ID of the last row in the file (0 if none): what reached it, whatever interrupted a write."""
        self._f.flush()
        return last_id_in(self.path)


    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()
        if getattr(self, "columns", None) is not None:
            self.columns.close()  # commits the columns with the file as it is now
            self.columns = None


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class ZstdCsvWriter(CsvWriter):
    """The CSV dump compressed with zstd (``--compress=zstd[:LEVEL]``, ``memscope_dump_*.csv.zst``):
    each write (one flush of rows, about a step) is one whole zstd frame, written and flushed at
    once, so a run killed at any moment leaves a file whose complete frames hold complete rows
    (a frame cut in the middle by a kill is the only loss; the readers stop before it)."""
    suffix = ".csv.zst"

    def __init__(self, path: str, level: int = 3):
        import zstandard
        self.path = path
        self.level = level
        self._z = zstandard.ZstdCompressor(level=level, write_checksum=True)  # a damaged frame is found, not read as rows
        self._f = create_new(path, binary=True)
        self._esc = {}
        self.columns = None
        self._put(HEADER + "\n")

    @classmethod
    def attach(cls, fd: int, level: int = 3) -> "ZstdCsvWriter":
        import zstandard
        w = cls.__new__(cls)
        w._f = os.fdopen(fd, "ab")
        w.path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        w._esc = {}
        w.columns = None
        w.level = level
        w._z = zstandard.ZstdCompressor(level=level, write_checksum=True)
        return w

    def reopen(self) -> "ZstdCsvWriter":
        """Append after the last complete frame (a frame cut short by a killed writer is dropped)."""
        fd = os.open(self.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(os.dup(fd), "rb") as f:
            frames = zstd_frames(f)
        end = frames[-1][1] if frames else 0
        if end != os.lseek(fd, 0, os.SEEK_END):
            os.ftruncate(fd, end)
        os.lseek(fd, 0, os.SEEK_END)
        self._f = os.fdopen(fd, "ab")
        return self

    def _put(self, text: str) -> None:
        self._f.write(self._z.compress(text.encode("utf-8", "backslashreplace")))
        self._f.flush()  # a whole frame reaches the kernel: survives SIGKILL of this process


def zstd_frames(f) -> list[tuple[int, int]]:
    """(start, end) offsets of the complete zstd frames at the start of the binary file ``f``, read
    from the frame and block headers only (nothing is decompressed). Stops at the first frame cut
    short or at anything that is not a zstd frame."""
    out = []
    f.seek(0, os.SEEK_END)
    size = f.tell()
    pos = 0
    while pos + 6 <= size:
        f.seek(pos)
        head = f.read(18)
        if head[:4] != ZSTD_MAGIC:
            break
        fhd = head[4]
        did = (0, 1, 2, 4)[fhd & 3]
        single = (fhd >> 5) & 1
        fcs = (0 if not single else 1, 2, 4, 8)[fhd >> 6]
        p = pos + 5 + (0 if single else 1) + did + fcs
        while True:
            f.seek(p)
            bh = f.read(3)
            if len(bh) < 3:
                return out
            v = bh[0] | (bh[1] << 8) | (bh[2] << 16)
            last, btype, bsize = v & 1, (v >> 1) & 3, v >> 3
            p += 3 + (1 if btype == 1 else bsize)
            if p > size:
                return out
            if last:
                break
        if (fhd >> 2) & 1:  # content checksum
            p += 4
        if p > size:
            break
        out.append((pos, p))
        pos = p
    return out


def _zstd_tail(path: str) -> bytes:
    """The decompressed text of the last complete frames of a ``.csv.zst`` dump: enough of them
    to hold two line ends (the last complete row and the one before it)."""
    import zstandard
    d = zstandard.ZstdDecompressor()
    with open(path, "rb") as f:
        frames = zstd_frames(f)
        tail = b""
        for start, end in reversed(frames):
            f.seek(start)
            tail = d.decompressobj().decompress(f.read(end - start)) + tail
            if tail.count(b"\n") >= 2:
                break
    return tail


class DbWriter:
    suffix = ".db"

    def __init__(self, path: str):
        self.path = path
        create_new(path, binary=True).close()  # claim the name with our permissions
        self.reattach()
        self._db.execute(f"CREATE TABLE {SQL_TABLE} ({SQL_COLUMNS})")
        self._db.execute(f"PRAGMA user_version = {FORMAT_VERSION}")  # the dump format (0: older dumps)
        self._db.commit()

    @classmethod
    def attach(cls, path: str) -> "DbWriter":
        """A writer on a dump another process created (the spool's writer process)."""
        w = cls.__new__(cls)
        w.path = path
        w.reattach()
        return w

    def reattach(self) -> None:
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        marks = ",".join("?" * len(COLUMNS))
        self._insert = f"INSERT INTO {SQL_TABLE} VALUES ({marks})"

    def reopen(self) -> "DbWriter":
        self.reattach()
        return self

    def detach(self) -> None:
        """This process stops writing (the table exists); another process opens the file."""
        self._db.commit()
        self._db.close()
        self._db = None

    def write(self, rows, first, pid, c_syms=None, ids=None) -> None:
        fault_point()
        t = table_rows(rows, first, pid, c_syms)
        if ids is not None:
            t = [(i,) + r[1:] for i, r in zip(ids, t)]
        self._db.executemany(self._insert, t)
        self._db.commit()

    def last_id(self) -> int:
        return self._db.execute(f"SELECT MAX(ID) FROM {SQL_TABLE}").fetchone()[0] or 0

    def close(self) -> None:
        if self._db is not None:
            self._db.commit()
            self._db.close()
            self._db = None
            os.chmod(self.path, FILE_MODE)


def last_id_in(path: str) -> int:
    """ID of the last complete row of a dump file (0 if none or unreadable)."""
    try:
        if path.endswith(".db"):
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                return con.execute(f"SELECT MAX(ID) FROM {SQL_TABLE}").fetchone()[0] or 0
            finally:
                con.close()
        if path.endswith(".zst"):
            text = _zstd_tail(path)
            end = text.rfind(b"\n")
            i = text.rfind(b"\n", 0, end) if end >= 0 else -1
            head = text[i + 1:end].split(b",", 1)[0] if end >= 0 else b""
            return int(head) if head.isdigit() else 0
        with open(path, "rb") as f:
            pos = f.seek(0, os.SEEK_END)
            tail = b""
            while pos > 0:
                n = min(1 << 16, pos)
                pos -= n
                f.seek(pos)
                tail = f.read(n) + tail
                end = tail.rfind(b"\n")  # a last row cut short (no newline) is not written
                i = tail.rfind(b"\n", 0, end) if end >= 0 else -1
                if i >= 0 or (pos == 0 and end >= 0):
                    tail = tail[i + 1:end]
                    break
            else:
                return 0
        head = tail.split(b",", 1)[0]
        return int(head) if head.isdigit() else 0
    except (OSError, ValueError, ImportError, sqlite3.Error):
        return 0
    except Exception:  # a corrupt zstd frame (zstandard.ZstdError)
        return 0


def compress_level(compress: str) -> int | None:
    """The zstd level of a ``--compress`` value (``"zstd:3"`` -> 3), None for a plain dump."""
    kind, _, level = (compress or "none").partition(":")
    return (int(level) if level else 3) if kind == "zstd" else None


def open_writer(data_format: str, path_without_suffix: str, compress: str = "none"):
    """A writer on a new dump file (the session wraps it in io/spool.py's SpoolWriter, whose rows
    are written by a process of its own)."""
    from .files import unique_path
    level = compress_level(compress)
    if data_format != "db" and level is not None:
        return ZstdCsvWriter(unique_path(path_without_suffix + ZstdCsvWriter.suffix), level)
    cls = DbWriter if data_format == "db" else CsvWriter
    return cls(unique_path(path_without_suffix + cls.suffix))
