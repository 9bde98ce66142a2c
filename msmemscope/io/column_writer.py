"""Writes the capture-time columnar companion of a dump (the stored form: io/columns.py).

``ColumnWriter`` runs in the dump writer process: each batch of rows the writer wrote to the CSV
goes to ``add`` as well; ``close`` commits the parts with the file's key. ``write_for`` makes the
companion of a dump written without one. Apart from io/columns.py because it reads the rows
already in a file with the reader's own parse, and the reader reads io/columns.py.
"""
from __future__ import annotations

import json
import os
import time

from .columns import BUILD_ROWS, CATEGORICAL, MANIFEST, PART_ROWS, SCHEMA_NAMES, VERSION, _FIELD_OK, _FORMULA_START, _INTS, code_key, file_key, folder_of, min_bytes, read_manifest, template_attr


try:  # tests only: seconds each batch's columns take more (a writer process that falls behind)
    _SLOW_S = float(os.environ.get("MSMEMSCOPE_COLUMN_SLOW_S") or 0)
except ValueError:
    _SLOW_S = 0.0


class _Unfit(Exception):
    """A row the companion cannot hold exactly: the companion is given up for this dump."""


def _text(v) -> str | None:
    """A text field as the CSV reader gives it back: ``csv_field``'s neutralising, the file's
    ``backslashreplace`` encoding, "" as null."""
    v = "" if v is None else str(v)
    if not v:
        return None
    if "\x00" in v:
        raise _Unfit("NUL")
    if v[0] in _FORMULA_START:
        v = "'" + v
    if not v.isascii():
        v = v.encode("utf-8", "backslashreplace").decode("utf-8")
    return v


def _raw(v) -> str:
    """A field the writer prints as it is (event, event type, device): must need no quoting."""
    v = f"{v}"
    if not v or any(c in v for c in ',"\n\r\x00') or v[0] in _FORMULA_START or not v.isascii():
        raise _Unfit("raw field")
    return v


def _plain(text) -> bool:  # writers._plain: the CSV fast path's test of an owner
    return not text or (text.isprintable() and '"' not in text and "\\" not in text)


def _template_value(v, ascii_only: bool) -> bool:
    """A text the MALLOC/FREE template carries and the reader's template pattern reads back."""
    return (type(v) is str and v.isprintable() and not (_FIELD_OK & set(v))
            and (not ascii_only or v.isascii()))


class ColumnWriter:
    """Called by the dump writer (io/writers.py ``CsvWriter.write``/``close``) in the writer process."""

    def __init__(self, path: str):
        self.path = path
        self.folder = folder_of(path)
        self.state = "off"
        self.parts: list = []      # [name, rows] committed or written by this process
        self.frames: list = []     # batches not yet in a part
        self.held = 0
        self.pending: dict = {c: [] for c in SCHEMA_NAMES}  # rows not yet made columns
        self.pending_rows = 0
        self.seen = 0              # bytes of CSV text so far (until the companion starts)
        self.least = min_bytes()
        self._dropping = False     # drop() came while the catch-up's thread ran
        try:  # rows of a part (tests make parts of a few rows)
            self.part_rows = max(1, int(os.environ.get("MSMEMSCOPE_COLUMN_PART_ROWS", PART_ROWS)))
        except ValueError:
            self.part_rows = PART_ROWS
        self._texts: dict = {}
        self._raws: dict = {}
        self._owners: dict = {}
        try:
            key = file_key(path)
        except OSError:
            return
        meta = read_manifest(self.folder)
        if (meta is not None and meta.get("version") == VERSION and meta.get("file") == key
                and meta.get("code") == code_key()):
            # a writer process before this one committed the dump as it is now: carry on from it
            try:
                os.remove(os.path.join(self.folder, MANIFEST))
            except OSError:
                return
            self.parts = [list(p) for p in meta.get("parts", ())]
            self.state = "on"
            return
        self._clear()
        self.seen = key["size"]
        self.state = "waiting"

    # ------------------------------------------------------------------ rows in
    def add(self, rows, first, pid, c_syms=None, ids=None, nbytes=0) -> None:
        if self.state == "off":
            return
        try:
            if self.state == "waiting":
                self.seen += nbytes
                if self.seen < self.least:
                    return
                code_key()  # the code of this process, before anything is stored
                self._start_catch_up()  # these rows are in the file already: read with the rest
                return
            if self.state == "catching":
                # the catch-up reads the file in its thread meanwhile (a second of it at 64 MiB):
                # the frames keep being written, and their rows wait here for it to end
                self._backlog.append((rows, first, pid, c_syms, ids))
                if self._catcher.is_alive():
                    return
                if self._dropping:  # dropped meanwhile (drop): its rows are not made columns
                    self._catcher.join()
                    self._give_up()
                    return
                self._end_catch_up()
                return
            self._add_rows(rows, first, pid, c_syms, ids)
        except Exception:  # _Unfit, a full disk, polars refusing a value: the text stands alone
            self._give_up()

    def _add_rows(self, rows, first, pid, c_syms, ids) -> None:
        if _SLOW_S:
            time.sleep(_SLOW_S)
        import gc
        was = gc.isenabled()
        gc.disable()  # tuples of numbers and texts, no cycles: no collector passes over them
        try:
            self._collect(rows, first, pid, c_syms or {}, ids)
        finally:
            if was:
                gc.enable()
        if self.pending_rows >= BUILD_ROWS:
            self._build()
        if self.held >= self.part_rows:
            self._write_part()

    def _start_catch_up(self) -> None:
        """The rows in the file so far become columns in a thread of this process, not in the
        loop that reads the pipe: done there, the traced program's frames filled the pipe while
        it ran and the program waited (0.65 s once, at 64 MiB of an MLP's dump)."""
        import threading
        end = os.path.getsize(self.path)  # every row written so far is flushed: whole rows end here
        self._backlog, self._caught = [], None
        self.state = "catching"

        def run():
            try:
                self._catch_up(end)
            except BaseException as e:  # noqa: BLE001 - handed to the writer's loop, which gives up
                self._caught = e
        self._catcher = threading.Thread(target=run, name="msmemscope-columns", daemon=True)
        self._catcher.start()

    def _end_catch_up(self) -> None:
        """The catch-up's thread has ended (or is waited for): the rows that came meanwhile."""
        self._catcher.join()
        backlog, self._backlog = self._backlog, []
        if self._caught is not None:
            raise self._caught
        self.state = "on"
        if self.held >= self.part_rows:
            self._write_part()
        for frame in backlog:
            self._add_rows(*frame)

    def close(self) -> None:
        """The dump file is closed: commit the parts with what the file is now."""
        if self.state == "catching":
            try:
                self._end_catch_up()
            except Exception:
                self._give_up()
        if self.state != "on":
            return
        try:
            self._write_part()
            meta = {"version": VERSION, "code": code_key(), "file": file_key(self.path),
                    "rows": sum(n for _, n in self.parts), "parts": self.parts}
            tmp = os.path.join(self.folder, f"{MANIFEST}.{os.getpid()}.tmp")
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640), "w", encoding="utf-8") as f:
                json.dump(meta, f)
            os.replace(tmp, os.path.join(self.folder, MANIFEST))
        except Exception:
            self._give_up()
        self.state = "off"

    # ------------------------------------------------------------------ inside
    def _clear(self) -> None:
        """Removes what an earlier writer left that no longer describes the dump (our files only)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for n in names:
            if n.startswith("part-") or n.startswith(MANIFEST):
                try:
                    os.remove(os.path.join(self.folder, n))
                except OSError:
                    pass
        try:
            os.rmdir(self.folder)
        except OSError:
            pass

    def drop(self) -> bool:
        """Give the companion up because the writer process cannot keep up with the program
        (io/spool.py ``serve``); True once it is off. Not while the catch-up's thread reads the
        file (its end drops it, without making the rows that came meanwhile columns)."""
        if self.state == "catching" and self._catcher.is_alive():
            self._dropping = True
            return False
        self._give_up()
        return True

    def _give_up(self) -> None:
        self.state = "off"
        self.frames, self.parts = [], []
        self._clear()

    def _write_part(self) -> None:
        self._build()
        if not self.frames:
            return
        import polars as pl
        df = pl.concat(self.frames, how="vertical")
        self.frames, self.held = [], 0
        if not self.parts:
            os.makedirs(self.folder, mode=0o750, exist_ok=True)
        name = f"part-{len(self.parts):06d}.parquet"
        df.write_parquet(os.path.join(self.folder, name), compression="lz4", statistics=False)
        os.chmod(os.path.join(self.folder, name), 0o640)  # the dump's own permissions (io/files.py)
        self.parts.append([name, df.height])

    def _catch_up(self, end: int) -> None:
        """The rows in the file's first ``end`` bytes, read by the reader's own parse, as stored
        columns (a plain CSV 32 MB of whole lines at a time, as the reader's batched read cuts it)."""
        import io
        import polars as pl
        from . import reader as R
        os.makedirs(self.folder, mode=0o750, exist_ok=True)
        with open(self.path, "rb") as f:
            zst = f.read(4) == R.ZSTD_MAGIC
        text = R._unzstd(self.path, end) if zst else None  # whole frames: each write is one
        complete, size = R.check_csv(self.path, text, end=None if zst else end)
        if complete != size:
            raise _Unfit("the file ends inside a row")
        if zst:
            self._add_text_rows(R._read_csv(self.path, text))
            return
        del text
        with open(self.path, "rb") as f:
            header = f.readline()
        for block in R._line_batches(self.path, complete, R.BATCH_BYTES):
            raw = R.csv_frame(io.BytesIO(header + block))
            if raw.width != len(R.NAMES) or raw.select(
                    (pl.col("event").is_null() | pl.col("ts").is_null() | pl.col("ptr").is_null()).any()).item():
                raise _Unfit("a row the reader refuses")
            del block
            self._add_text_rows(raw)
            if self.held >= self.part_rows:
                self._write_part()

    def _add_text_rows(self, raw) -> None:
        """Rows as the CSV reader parsed them (text columns; the number columns as numbers where
        the reader's first read took them so) as stored columns."""
        import polars as pl
        from . import reader as R
        from ..events import NA
        if raw.select(pl.any_horizontal(pl.col(c).str.contains("\x00", literal=True).any()
                                        for c in R.NAMES if raw.schema[c] == pl.String)).item():
            raise _Unfit("NUL")
        df = raw.select(id=pl.col("id").cast(pl.Int64), event="event", event_type="event_type", name="name",
                        ts=pl.col("ts").cast(pl.Int64), pid=pl.col("pid").cast(pl.Int64),
                        tid=pl.col("tid").cast(pl.Int64), device="device", ptr_text="ptr", attr="attr",
                        py_stack="py_stack", c_stack="c_stack")
        del raw
        ptr = pl.col("ptr_text")
        df = df.with_columns(ptr=pl.when(ptr != NA).then(ptr.str.strip_prefix("0x").str.to_integer(base=16, strict=False)))
        bad = df.select(((ptr != NA) & (~ptr.str.contains(r"^0x[0-9a-f]{16}$") | pl.col("ptr").is_null())).any()).item()
        if bad:
            raise _Unfit("ptr")
        fields = ("alloc_id", "addr", "size", "used", "total", "owner", "module", "phase")
        df = R._attr_columns(df, fields)
        again = template_attr(df)
        tmpl = df["event"].is_in(["MALLOC", "FREE"]) & (again == df["attr"]).fill_null(False)
        # ACCESS rows keep their text and the fields the reader found in it (alloc_id, size)
        access = (df["event"] == "ACCESS") & df["alloc_id"].is_not_null()
        df = df.with_columns(pl.when(tmpl | access).then(pl.col(c)).alias(c) for c in fields).with_columns(
            attr=pl.when(tmpl).then(None).otherwise(pl.col("attr")))
        self.frames.append(df.select(SCHEMA_NAMES).cast({c: pl.Int64 for c in _INTS})
                           .with_columns(pl.col(c).cast(pl.Categorical) for c in CATEGORICAL))
        self.held += df.height

    @staticmethod
    def _attr_text(e, a, format_attr):
        t = format_attr(e, a)
        if t and not t.isascii():
            t = t.encode("utf-8", "backslashreplace").decode("utf-8")
        if t and "\x00" in t:
            raise _Unfit("NUL")
        return t or None

    def _strings(self, values, rule):
        """A text column: made by polars, then ``rule`` (as the CSV prints and reads it) applied
        to its distinct values only (None and "" are null)."""
        import polars as pl
        s = pl.Series(values, dtype=pl.String, strict=True)
        change = {}
        for v in s.unique().to_list():
            if v is None:
                continue
            t = rule(v) if rule is _text else (rule(v) if v not in self._raws else v)
            if rule is _raw:
                self._raws[v] = t
            if t != v:
                change[v] = t
        return s.replace(change) if change else s

    def _collect(self, rows, first, pid, c_syms, ids):
        """One batch of rows (those ``CsvWriter.write`` just wrote) as Python values per column."""
        from ..events import format_attr
        n = len(rows)
        ev, et, name, ts, tid, dev, ptr, attr, ps, _cs = zip(*rows)
        owners = self._owners
        out = []
        add = out.append
        none8 = (None,) * 8
        # what CsvWriter.write prints for each row, kept as fields (template) or as its Attr text
        for e, a, p in zip(ev, attr, ptr):
            if e == "OP_LAUNCH":
                add((None, None) + none8)
            elif type(a) is tuple and e == "MALLOC" and len(a) == 6:
                ok = owners.get(a[5])
                if ok is None:  # 1: the template; 2: the CSV's fast path, not the template; 0: neither
                    ok = owners[a[5]] = (1 if _template_value(a[5], False) else 2) if _plain(a[5]) else 0
                if ok == 1:
                    add((p, None, a[0], a[1], a[2], a[3], a[4], a[5], None, None))
                elif ok == 2:
                    add((p, f'{{"allocation_id":{a[0]},"addr":"0x{a[1]:016x}","size":{a[2]},"used":{a[3]},'
                            f'"total":{a[4]},"owner":"{a[5]}"}}') + none8)
                else:
                    add((p, self._attr_text(e, a, format_attr)) + none8)
            elif type(a) is tuple and e == "FREE":
                add((p, None, a[0], a[1], a[2], a[3], a[4], None, None, None))
            elif type(a) is tuple and e == "ACCESS":
                # its text kept; the two fields the reader's ACCESS pattern reads, where it reads them
                t = self._attr_text(e, a, format_attr)
                if (type(a[2]) is int and type(a[3]) is int and a[2] >= 0 and a[3] >= 0 and '"' not in f"{a[0]}"
                        and t.startswith('{"dtype":"') and t.count("]") == 1):
                    add((p, t, a[3], None, a[2], None, None, None, None, None))
                else:
                    add((p, t) + none8)
            elif (type(a) is tuple and e == "MALLOC" and len(a) == 8 and _template_value(a[5], True)
                    and _template_value(a[6], True) and (a[7] is None or _template_value(a[7], True))
                    and all(type(x) is int for x in a[:5])):
                add((p, None) + a[:8])
            else:
                add((p, self._attr_text(e, a, format_attr)) + none8)
        cols = list(zip(*out))
        del out
        P = self.pending
        P["id"].extend(range(first, first + n) if ids is None else ids)
        for k, v in (("event", ev), ("event_type", et), ("name", name), ("ts", ts), ("tid", tid),
                     ("device", dev), ("py_stack", ps)):
            P[k].extend(v)
        P["pid"].extend([pid] * n)
        P["c_stack"].extend([c_syms.get(i) for i in range(n)] if c_syms else [None] * n)
        for k, c in zip(("ptr", "attr", "alloc_id", "addr", "size", "used", "total", "owner", "module", "phase"), cols):
            P[k].extend(c)
        self.pending_rows += n

    def _build(self) -> None:
        """The rows gathered so far as one polars frame of the stored columns."""
        if not self.pending_rows:
            return
        import polars as pl
        from ..events import format_attr
        P, n = self.pending, self.pending_rows
        self.pending = {c: [] for c in SCHEMA_NAMES}
        self.pending_rows = 0
        data = {}
        for c in SCHEMA_NAMES:
            if c in ("event", "event_type", "device"):
                data[c] = self._strings(P[c], _raw)
            elif c in ("name", "py_stack", "c_stack"):
                data[c] = self._strings(P[c], _text)
            else:
                data[c] = pl.Series(c, P[c], dtype=pl.Int64 if c in _INTS else pl.String, strict=True)
            P[c] = None
        df = pl.DataFrame(data)
        if (df["ptr"].fill_null(0) < 0).any():
            raise _Unfit("negative ptr")
        # the writer prints any number as it is; the reader's template takes no sign: such rows
        # keep their text (as the writer printed it), read by the reader's other patterns
        odd = df.select(pl.col("alloc_id").is_not_null() & ((pl.col("alloc_id") < 0) | (pl.col("addr") < 0)
                                                             | (pl.col("size") < 0)))[:, 0]
        if odd.any():
            fix = odd.arg_true()
            fixed = []
            for e, a0, a1, a2, a3, a4, ow, mo, ph in df[fix].select(
                    "event", "alloc_id", "addr", "size", "used", "total", "owner", "module", "phase").iter_rows():
                if e == "FREE":
                    t = f'{{"allocation_id":{a0},"addr":"0x{a1:016x}","size":{a2},"used":{a3},"total":{a4}}}'
                elif mo is None:  # a 6-field MALLOC: the CSV's fast path
                    t = (f'{{"allocation_id":{a0},"addr":"0x{a1:016x}","size":{a2},"used":{a3},'
                         f'"total":{a4},"owner":"{ow}"}}')
                else:
                    t = format_attr(e, (a0, a1, a2, a3, a4, ow, mo, ph))
                fixed.append(t)
            df = df.with_columns(df["attr"].scatter(fix, fixed), _odd=odd)
            df = df.with_columns(pl.when(pl.col("_odd")).then(None).otherwise(pl.col(c)).alias(c)
                                 for c in ("alloc_id", "addr", "size", "used", "total", "owner", "module", "phase"))
            df = df.drop("_odd")
        self.frames.append(df.with_columns(pl.col(c).cast(pl.Categorical) for c in CATEGORICAL))
        self.held += n


def write_for(path: str) -> bool:
    """Makes the companion of a dump written without one (an older run, a generated dump), from its
    text, as the writer does for the rows before its threshold. True when the dump has a current
    one afterwards."""
    from .reader import capture_parts
    if capture_parts(path) is not None:
        return True
    w = ColumnWriter(path)
    if w.state == "waiting":
        w.least = 0
        w.add((), 0, 0)
        w.close()
    return capture_parts(path) is not None
