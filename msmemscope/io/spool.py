"""The dump writer in a process of its own, so that the traced program does not pay for it.

Formatting rows as CSV text (or inserting them into SQLite) is the largest
single cost of a flush. The traced process instead hands each batch of raw
rows to a small writer process through a pipe, serialised with ``marshal``
(~0.2 us a row against ~1.7 us to format it), and goes on with its work; the
writer process runs the same ``CsvWriter``/``DbWriter`` code on another core.

Nothing is lost on a crash: a batch is in the pipe in whole or not at all, and
the writer process, in a session of its own that ignores Ctrl-C, drains the pipe
when the traced process dies (even of SIGKILL) before it exits. While it works it
holds a lock on the dump (``wait_for_writer``), which the launcher waits on
before it reads the results.

``MSMEMSCOPE_WRITER=inline`` writes in the traced process instead (also the
fallback when the writer process cannot start).
"""
from __future__ import annotations

import array
import fcntl
import json
import logging
import marshal
import os
import signal
import select
import subprocess
import sys
import termios
import time

from ..events import as_rows

log = logging.getLogger("msmemscope")

_LEN = 8  # bytes of the frame length; a zero length ends the stream
# A frame whose length has this bit set carries the native source's marshal bytes as they are,
# after its head (``_frame_parts``): sent by the system call from where they lie, not copied into a
# marshalled frame (GPT-2's default events: ~0.5 M instructions a step, BENCHMARKS.md)
_RAW = 1 << (8 * _LEN - 1)
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# -I -S: no site, no user paths, no sitecustomize (the launcher's tracing hook): stdlib only
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from msmemscope.io.spool import serve; serve(sys.argv[2:])")


class WriterFailed(OSError):
    """The writer process could not write the dump (disk full, I/O error): the tool's failure."""


def _spooling_enabled() -> bool:
    return os.environ.get("MSMEMSCOPE_WRITER", "").lower() not in ("inline", "0", "off")


def _plain_rows(rows):
    """Rows that marshal can carry: no C traceback objects (their text travels in c_syms),
    attributes reduced to JSON types (what the writer would print of them anyway)."""
    out = []
    for r in rows:
        attr = r[7]
        if attr is not None and type(attr) is not tuple:
            attr = json.loads(json.dumps(attr, default=str))
        out.append(r[:7] + (attr, r[8], None))
    return out


def _site_of(*modules) -> list:
    """The folders holding these installed packages (not imported here)."""
    import importlib.util
    out = []
    for m in modules:
        try:
            spec = importlib.util.find_spec(m)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            d = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
            if d not in out:
                out.append(d)
    return out


class SpoolWriter:
    """Looks like a writer to the session; started on the first batch (a process that never
    flushes, such as a discarded DataLoader worker, never starts one)."""

    def __init__(self, inner, keep_steps: int = 0):
        self.inner = inner            # the CsvWriter/DbWriter that claimed the file
        self.path = inner.path
        self.suffix = inner.suffix
        self.keep_steps = keep_steps  # a bounded dump (io/bounded.py), written by whoever writes
        self._bounded = None          # the BoundedWriter of rows written in this process
        self._proc = None
        self._fd = None
        self._bell = None             # the doorbell pipe's write end (_send rings it for a frame the pipe cannot hold)
        self._room = 1 << 16          # the data pipe's size (F_GETPIPE_SZ once set)
        self._row_bytes = 0.0         # bytes a row in the last frame
        self._sent = 0                # ID of the last row handed over
        self._whole = False           # the last frame went into the pipe whole
        self.rows_lost_after = None   # the writer process died: rows after this ID may be missing
        self._inline = not _spooling_enabled()  # write here: asked to, or no writer process could run

    # ------------------------------------------------------------------ start
    def _start(self) -> bool:
        inner = self.inner
        pass_fds = ()
        extra = {"keep_steps": self.keep_steps, "level": getattr(inner, "level", None), "path": []}
        if extra["level"] is not None:  # the writer process runs without site-packages (-I -S)
            import zstandard
            extra["path"].append(os.path.dirname(os.path.dirname(os.path.abspath(zstandard.__file__))))
        if self.suffix != ".db":
            from .columns import enabled
            if enabled():  # the columnar companion (io/columns.py) writes with polars, found there
                extra["columns"] = True
                extra["path"].extend(_site_of("polars", "numpy"))
        if self.suffix != ".db":
            inner._f.flush()
            target = str(inner._f.fileno())
            pass_fds = (inner._f.fileno(),)
        else:
            inner.detach()
            target = self.path
        # the lock that says "being written" is taken here and inherited, so there is no moment
        # between this process's death and the writer's start when the dump looks complete
        lock = os.open(self.path, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)
        r, w = os.pipe()
        bell_r, bell_w = os.pipe()
        os.set_blocking(bell_w, False)
        extra["bell"] = bell_r
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, _PKG_ROOT, self.suffix[1:], target, str(lock),
                 json.dumps(extra)],
                stdin=r, stdout=subprocess.PIPE, pass_fds=pass_fds + (lock, bell_r), start_new_session=True,
                close_fds=True)
        except OSError as e:
            os.close(lock)
            os.close(r)
            os.close(w)
            os.close(bell_r)
            os.close(bell_w)
            log.warning("dump writer process did not start (%s): writing in this process", e)
            if self.suffix == ".db":
                inner.reattach()
            return False
        os.close(r)
        os.close(bell_r)
        os.close(lock)  # the writer process's copy keeps it
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: a step's rows fit without blocking
        except OSError:
            pass
        try:
            self._room = fcntl.fcntl(w, getattr(fcntl, "F_GETPIPE_SZ", 1032))
        except OSError:
            pass
        self._fd = w
        self._bell = bell_w
        if self.suffix != ".db":
            inner.detach()  # the writer process has its own copy of the descriptor
        return True

    # ------------------------------------------------------------------ writing
    def write(self, rows, first, pid, c_syms=None, pieces=None) -> None:
        """``pieces``: the same rows as a list of marshal bytes (made by the native source) and
        lists of row tuples, in order (``Session._pieces_of``); the writer process joins them."""
        if not self._inline and self._fd is None and not self._start():
            self._inline = True
        if self._inline or pieces is None:
            rows = as_rows(rows)  # (a flush's PackedRows made into tuples: only the bytes go as they are)
        if self._inline:
            self._here().write(rows, first, pid, c_syms)
            self._sent = first + len(rows) - 1
            return
        try:
            if pieces is not None:
                parts, raw = _frame_parts(first, pid, c_syms, pieces)
            else:
                parts, raw = [marshal.dumps((first, pid, rows, c_syms or None))], False
        except ValueError:  # a C traceback object or an exotic attribute value
            parts, raw = [marshal.dumps((first, pid, _plain_rows(as_rows(rows)), c_syms or None))], False
        size = sum(len(p) for p in parts)
        if rows:
            self._row_bytes = size / len(rows)
        try:
            self._send((size | _RAW if raw else size).to_bytes(_LEN, "little"), *parts)
        except BrokenPipeError:
            # the writer process ended. Killed (the OOM killer, say): never let that reach the
            # program; the rows still in the pipe are lost, the rest is written from here. Ended
            # on a write error of its own (disk full): the tool's failure, raised to the session
            self._take_over()
            self._here().write(as_rows(rows), first, pid, c_syms)
        finally:
            if self._whole:  # in the pipe, whatever interrupted us after: never sent twice
                self._sent = first + len(rows) - 1
        self._sent = first + len(rows) - 1

    def takes_bytes(self) -> bool:
        """Whether the rows go to a writer process (``write``'s pieces are sent as they are), not
        written here (which needs the row tuples)."""
        return not self._inline

    def room_rows(self) -> int | None:
        """Rows (of the last frame's size) that half the pipe holds: a frame that large goes in while
        the writer process still reads the one before. None: no pipe, or no frame yet."""
        if self._inline or self._fd is None or not self._row_bytes:
            return None
        return int(self._room / 2 / self._row_bytes)

    def _here(self):
        """What writes in this process: the dump's writer, or the bounded dump around it."""
        if not self.keep_steps or isinstance(self.inner, _Nowhere):
            return self.inner
        if self._bounded is None or self._bounded.inner is not self.inner:
            from .bounded import BoundedWriter
            self._bounded = BoundedWriter(self.inner, self.keep_steps)
        return self._bounded

    def _send(self, *parts) -> None:
        """One frame, its length then its parts: gathered by the system call (a step's rows are
        megabytes: joining them would copy them once more)."""
        from .files import fault_point
        self._whole = False
        fault_point()
        views = [memoryview(p) for p in parts]
        total = sum(len(v) for v in views)
        if self._bell is not None and total > self._room - _queued(self._fd):
            # the pipe cannot take the frame whole: this write would wait for the writer process's
            # next wake-up (it naps up to NAP_MAX while the pipe is empty; 0.5-1.3 ms a step on the
            # tiny GPT-2 with decompose, whose frames pass the pipe's 1 MB). The doorbell wakes it now
            try:
                os.write(self._bell, b"!")
            except OSError:
                pass  # full (it rings already) or gone (the writer ended: the write below says so)
        def rest(done):  # the parts from byte ``done`` on
            out = []
            for v in views:
                if done >= len(v):
                    done -= len(v)
                    continue
                out.append(v[done:] if done else v)
                done = 0
            return os.writev(self._fd, out)
        done = 0
        try:
            while done < total:
                done += rest(done)
        finally:
            # whatever interrupted the loop (a signal handler's exception), finish the frame: the
            # writer process must never see half of one
            while 0 < done < total:
                try:
                    done += rest(done)
                except BrokenPipeError:
                    break
            self._whole = done == total

    def _close_pipe(self, end: bool = False):
        """Close the data pipe (after the zero length that ends the stream, with ``end``) and the doorbell."""
        if self._bell is not None:
            try:
                os.close(self._bell)
            except OSError:
                pass
            self._bell = None
        if self._fd is not None:
            try:
                if end:
                    os.write(self._fd, bytes(_LEN))
            except OSError:
                pass
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _drop_pipe(self, inner):
        """Write inline from now on, into ``inner``, without the pipe."""
        self._close_pipe()
        self._inline = True
        self.inner = inner

    def _failure(self) -> str | None:
        """What the ended writer process said went wrong, if it ended on an error of its own."""
        out = self._proc.stdout if self._proc is not None else None
        if out is None:
            return None
        try:
            text = out.read().decode("utf-8", "replace").strip()
            out.close()
        except (OSError, ValueError):
            return None
        return text or None

    def _take_over(self):
        self._close_pipe()  # closed first: a writer process still reading sees the end
        rc = self._proc.wait() if self._proc is not None else None
        why = self._failure()
        if why:
            self._drop_pipe(_Nowhere())
            raise WriterFailed(why)
        log.error("the dump writer process ended (status %s): rows after ID %d that it had not written "
                  "are lost; the rest is written by the traced process", rc, self._sent)
        if self.rows_lost_after is None:
            self.rows_lost_after = self._sent
        self._drop_pipe(self.inner.reopen())

    def last_id(self) -> int:
        return self._sent

    # ------------------------------------------------------------------ ending
    def close(self) -> None:
        if self._inline or self._proc is None:
            self._here().close()
            return
        if self._fd is None and self._proc.returncode is not None:
            return  # closed already
        self._close_pipe(end=True)
        rc = self._proc.wait()
        if rc == 0 and self._proc.stdout is not None:
            self._proc.stdout.close()  # its failure channel: nothing to say
        if rc != 0:
            why = self._failure()
            log.error("the dump writer process failed (status %s): %s may be incomplete", rc, self.path)
            if why:
                raise WriterFailed(why)

    def sync(self) -> None:
        """Return when every row handed over is in the file (``stop()``: the program may read the
        dump next). The writer process ends; the next batch starts a new one, which appends."""
        if self._inline or self._proc is None:
            if self._bounded is not None and self._bounded.inner is self.inner:
                self._bounded.flush_held()  # the held steps are on disk when stop() returns
            return
        self.close()
        self._proc = None
        self.inner = self.inner.reopen()

    def abandon(self) -> None:
        """A failure stopped tracing: end the stream without raising; what reached the file stays."""
        try:
            if self._inline or self._proc is None:
                self._here().close()
            else:
                self.close()
        except Exception:
            pass
        self._proc = None
        self._drop_pipe(_Nowhere())

    def forget(self) -> None:
        """In a forked child: let go of the pipe without ending the parent's stream."""
        self._proc = None
        self._drop_pipe(_Nowhere())

    def abort(self) -> None:
        """The run is being discarded: stop the writer process, whatever it has left."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._close_pipe()
        if self._proc is None:
            self.inner.close()


class _Nowhere:
    def write(self, *a, **k):
        pass

    def last_id(self):
        return 0

    def close(self):
        pass


# ---------------------------------------------------------------------- the writer process
#: the writer process's naps while the pipe is empty, shortest and longest (seconds)
NAP, NAP_MAX = 0.0005, 0.004
BEHIND_FRAMES = 4  # frames in a row read with half the pipe still full: the writer process is behind
BUSY_WINDOW_S, BUSY_MAX = 0.25, 0.25  # the writer's share of time writing, before the companion starts


def _queued(fd: int) -> int:
    """Bytes in the pipe not yet read (FIONREAD; 0 where it cannot be asked)."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]


_bell: int | None = None  # the writer process's end of the doorbell pipe (None: naps alone)


def _nap(seconds: float, fd: int, watch_data: bool) -> bool:
    """Wait ``seconds`` for data; True when the doorbell rang (a frame larger than the pipe's room
    is being written: the traced process waits on it). ``watch_data``: wake on the data itself too
    (inside a frame, or after the doorbell: the traced process is writing then)."""
    global _bell
    if _bell is None:
        time.sleep(seconds)
        return False
    try:
        ready, _, _ = select.select([_bell, fd] if watch_data else [_bell], [], [], seconds)
        if _bell not in ready:
            return False
        if not os.read(_bell, 4096):
            os.close(_bell)  # the traced process closed its end: naps alone from here
            _bell = None
            return False
        return True
    except (OSError, ValueError):
        _bell = None
        time.sleep(seconds)
        return False


def _read_exact(fd: int, n: int, in_frame: bool = False) -> bytes | None:
    """``n`` bytes of the pipe (None: it ended). The read end is non-blocking and an empty pipe is
    waited on by napping, not in read(): a process asleep in read() is woken by every write, and
    on a virtual machine that wake-up cost the traced process 20-70 us a frame (3% of a 2 ms
    step). A frame written while the writer naps lies in the pipe (whole, as before) until the
    nap ends, at most NAP_MAX later. A frame the pipe cannot hold whole would make the traced
    process wait for that: it rings the doorbell first, which ends the nap, and the rest of that
    frame is waited for on the data itself."""
    chunks, got, nap = [], 0, NAP
    rang = False
    while got < n:
        try:
            b = os.read(fd, min(n - got, 1 << 20))
        except BlockingIOError:
            rang = _nap(nap, fd, rang or in_frame or got > 0) or rang
            nap = NAP if rang else min(nap * 2, NAP_MAX)
            continue
        if not b:
            return None
        nap = NAP
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _frame_parts(first, pid, c_syms, pieces) -> tuple[list, bool]:
    """(the buffers to send, whether the frame is raw) of a frame of pieces: with marshal bytes among
    them (the native source's rows), their lengths in place of them in a marshalled head, the head's
    length before it, and the bytes after it as they are (a frame with ``_RAW``, ``_read_frame``);
    else one marshalled frame."""
    if not any(type(p) is bytes for p in pieces):
        return [marshal.dumps((first, pid, None, c_syms or None, pieces))], False
    head = marshal.dumps((first, pid, None, c_syms or None, [len(p) if type(p) is bytes else p for p in pieces]))
    return [len(head).to_bytes(_LEN, "little"), head, *(p for p in pieces if type(p) is bytes)], True


def _read_frame(data, raw: bool) -> tuple:
    """(first, pid, rows, c_syms) of a frame's bytes (``raw``: its length had ``_RAW``)."""
    if not raw:
        frame = marshal.loads(data)
        first, pid, rows, c_syms = frame[:4]
        return first, pid, join_pieces(frame[4]) if len(frame) > 4 else rows, c_syms
    view = memoryview(data)
    n = int.from_bytes(view[:_LEN], "little")
    pos = _LEN + n
    first, pid, _, c_syms, spec = marshal.loads(view[_LEN:pos])
    pieces = []
    for p in spec:
        if type(p) is int:  # the next marshal bytes after the head
            pieces.append(view[pos:pos + p])
            pos += p
        else:
            pieces.append(p)
    if pos != len(data):
        raise ValueError(f"a frame of {len(data)} bytes holds {pos}")
    return first, pid, join_pieces(pieces), c_syms


def join_pieces(pieces) -> list:
    """A frame's rows from its pieces: marshal bytes (the native source's rows) and lists of rows."""
    rows: list = []
    for p in pieces:
        rows.extend(marshal.loads(p) if isinstance(p, (bytes, memoryview)) else p)
    return rows


def serve(argv) -> None:
    """Main of the writer process: frames from stdin into the dump until the stream ends."""
    from . import files
    from .writers import CsvWriter, DbWriter
    files.ROLE = "writer"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is for the program
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    kind, target, _lock = argv[:3]  # the lock descriptor stays open until this process exits
    extra = json.loads(argv[3]) if len(argv) > 3 else {}
    global _bell
    _bell = extra.get("bell")
    if _bell is not None:
        os.set_blocking(_bell, False)
    sys.path.extend(extra.get("path") or ())  # zstandard's folder (the rest of site-packages unused)
    writer = None
    try:
        if kind == "csv":
            writer = CsvWriter.attach(int(target))
        elif kind == "csv.zst":
            from .writers import ZstdCsvWriter
            writer = ZstdCsvWriter.attach(int(target), extra.get("level") or 3)
        else:
            writer = DbWriter.attach(target)
        text_writer = writer
        if extra.get("columns"):
            from .column_writer import ColumnWriter
            writer.columns = ColumnWriter(writer.path)
        try:
            half_pipe = fcntl.fcntl(0, getattr(fcntl, "F_GETPIPE_SZ", 1032)) // 2
        except OSError:
            half_pipe = None
        behind, busy, window = 0, 0.0, time.perf_counter()
        if extra.get("keep_steps"):
            from .bounded import BoundedWriter
            writer = BoundedWriter(writer, extra["keep_steps"])
        os.set_blocking(0, False)  # see _read_exact
        while True:
            head = _read_exact(0, _LEN)
            if head is None:
                break  # the traced process died: what came in whole is written
            n = int.from_bytes(head, "little")
            if n == 0:
                break
            data = _read_exact(0, n & ~_RAW, in_frame=True)
            if data is None:
                break
            t0 = time.perf_counter()
            first, pid, rows, c_syms = _read_frame(data, bool(n & _RAW))
            writer.write(rows, first, pid, c_syms)
            now = time.perf_counter()
            busy += now - t0
            columns = getattr(text_writer, "columns", None)  # (a db dump has none)
            if columns is not None and now - window >= BUSY_WINDOW_S:
                # before the companion starts: a writer busy more than BUSY_MAX of the time with
                # the text alone would fall behind with the columns (~4x the text's work a row)
                # and drop them below, after the catch-up's read of the whole file (wasted)
                if columns.state == "waiting" and busy / (now - window) > BUSY_MAX:
                    columns.drop()
                    text_writer.columns = columns = None
                busy, window = 0.0, now
            if columns is not None and half_pipe is not None:
                # the program's frames queue up: this process is the slower one, and the program
                # waits on a full pipe. The companion's columns are most of its work here (~2 us
                # a row against the CSV's ~0.5), so after BEHIND_FRAMES frames so it is dropped:
                # the dump is read from its text. (The 'deep' bench workload: 2.6x the plain
                # program with the companion on, 1.7x without.)
                behind = behind + 1 if _queued(0) >= half_pipe else 0
                if behind >= BEHIND_FRAMES and columns.drop():
                    text_writer.columns = None
        writer.close()
    except Exception as e:
        # a write refused (disk full, I/O error): no traceback on the program's stderr; the
        # reason goes to the traced process (our stdout), which stops tracing and says it once
        from .errors import why_write_failed
        why = why_write_failed(e)
        try:
            if writer is not None:
                writer.close()
        except Exception:
            pass
        try:
            os.write(1, f"{why} (in the dump writer process)".encode("utf-8", "replace"))
        except OSError:
            pass
        os._exit(3)


def wait_for_writer(path: str, timeout: float = 120.0) -> bool:
    """Wait until no writer process holds ``path`` (the dump is complete). False on timeout."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
    finally:
        os.close(fd)
