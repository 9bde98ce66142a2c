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


class CsvWriter:
    suffix = ".csv"

    def __init__(self, path: str):
        self.path = path
        self._f = create_new(path)
        self._esc: dict = {}  # text -> its CSV field
        self._f.write(HEADER + "\n")
        self._f.flush()

    @classmethod
    def attach(cls, fd: int) -> "CsvWriter":
        """A writer on a dump another process created (the spool's writer process)."""
        w = cls.__new__(cls)
        w._f = os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace", newline="")
        w.path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        w._esc = {}
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

    def write(self, rows, first, pid, c_syms=None) -> None:
        # One f-string per row, specialised for the frequent kinds; op names and
        # stacks repeat, so their CSV text is cached. This loop is the cost of a
        # flush, paid at every step: keep it lean.
        fault_point()
        c_syms = c_syms or {}
        esc = self._esc
        if len(esc) > 200_000:
            esc.clear()
        out = []
        add = out.append
        i = first
        for n, (ev, et, name, ts, tid, dev, ptr, attr, ps, _cs) in enumerate(rows):
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
        self._f.write("".join(out))
        self._f.flush()  # reaches the kernel: survives SIGKILL of this process

    def last_id(self) -> int:
        """ID of the last row in the file (0 if none): what reached it, whatever interrupted a write."""
        self._f.flush()
        return last_id_in(self.path)


    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()


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

    def write(self, rows, first, pid, c_syms=None) -> None:
        fault_point()
        self._db.executemany(self._insert, table_rows(rows, first, pid, c_syms))
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
    except (OSError, ValueError, sqlite3.Error):
        return 0


def open_writer(data_format: str, path_without_suffix: str):
    """A writer on a new dump file (the session wraps it in io/spool.py's SpoolWriter, whose rows
    are written by a process of its own)."""
    cls = DbWriter if data_format == "db" else CsvWriter
    from .files import unique_path
    return cls(unique_path(path_without_suffix + cls.suffix))
