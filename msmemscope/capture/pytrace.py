"""The Python trace (the original's ``events="traceback"`` and ``msmemscope.tracer``).

Every Python function call on every thread, as one row per call in
``<run>/device_<id>/dump/python_trace_<tid>_<timestamp>.csv`` (one file per thread)::

    FuncInfo,StartTime(ns),EndTime(ns),Thread Id,Process Id

``FuncInfo`` is ``file(line): function`` (``line`` the ``def`` line), or
``nn.Module: <class>`` for a module's ``__call__``, as the original writes it.
Times are ``time.time_ns()``, the clock of the dump's ``Timestamp(ns)``;
``Thread Id`` is the dump's. A generator's run between two resumptions is one
row. Calls still open at ``stop()`` end at the stop time.

How: ``sys.monitoring`` (Python 3.12+: every thread at once, the PROFILER tool
id); before 3.12 ``sys.setprofile`` for the calling thread plus
``threading.setprofile`` for threads started later (threads already running
when the trace starts are not traced there). Where the program set a profile
function itself (cProfile, yappi), it keeps it: no trace, one line says so. C
functions (builtins) are not rows. Cost: BENCHMARKS.md ("Python trace").

No torch import here: the module runs on any interpreter.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from time import time_ns

HEADER = ("FuncInfo", "StartTime(ns)", "EndTime(ns)", "Thread Id", "Process Id")
FLUSH_ROWS = 1 << 15   # rows a thread keeps before writing them to its file
_HERE = __file__


class _Thread:
    __slots__ = ("tid", "stack", "rows", "path")

    def __init__(self, tid):
        self.tid = tid
        self.stack: list = []   # (code, start) of the calls open on this thread
        self.rows: list = []    # (code, start, end, module_class)
        self.path = None


class PyTracer:
    """One per process; ``start()``/``stop()`` may alternate."""

    def __init__(self, folder: str):
        self.folder = folder
        self.pid = os.getpid()
        self.tls = threading.local()
        self.threads: list[_Thread] = []
        self.lock = threading.Lock()
        self.active = False
        self.mode = None
        self.files: list[str] = []
        self._names: dict = {}
        self._on = [False]
        self._module_codes = _module_call_codes()   # kept: their ids stay theirs
        self._module_ids = frozenset(id(c) for c in self._module_codes)

    # ------------------------------------------------------------------ per thread
    def _state(self) -> _Thread:
        st = _Thread(threading.get_ident())
        self.tls.st = st
        with self.lock:
            self.threads.append(st)
        return st

    def _hooks(self):
        """(begin(code, frame), end()) as closures over locals: they run on every Python call."""
        tls, new_state, now, mod_ids, on = self.tls, self._state, time_ns, self._module_ids, self._on
        write = self._write

        def begin(code, frame):
            try:
                st = tls.st
            except AttributeError:
                st = new_state()
            cls = None
            if id(code) in mod_ids and frame is not None:
                try:
                    cls = type(frame.f_locals.get("self")).__name__
                except Exception:
                    cls = None
            st.stack.append((code, now(), cls))

        def end():
            t = now()
            try:
                st = tls.st
            except AttributeError:
                return
            if st.stack:  # else a call that began before the trace
                code, start, cls = st.stack.pop()
                rows = st.rows
                rows.append((code, start, t, cls))
                if len(rows) >= FLUSH_ROWS:
                    write(st)

        def profile(frame, event, arg):  # sys.setprofile (before 3.12)
            if event == "call":
                if not on[0]:  # stopped from another thread: this thread stops here
                    sys.setprofile(None)
                    return
                begin(frame.f_code, frame)
            elif event == "return":
                end()

        def mon_start(code, offset):  # sys.monitoring (3.12+)
            begin(code, sys._getframe(1) if id(code) in mod_ids else None)

        def mon_end(code, offset, value):
            end()

        return profile, mon_start, mon_end

    # ------------------------------------------------------------------ sys.monitoring (3.12+)
    def _start_monitoring(self, mon_start, mon_end) -> bool:
        mon = getattr(sys, "monitoring", None)
        if mon is None:
            return False
        tool = mon.PROFILER_ID
        try:
            mon.use_tool_id(tool, "msmemscope")
        except ValueError:  # another profiler holds the id: fall back to sys.setprofile
            return False
        E = mon.events
        for ev in (E.PY_START, E.PY_RESUME, E.PY_THROW):
            mon.register_callback(tool, ev, mon_start)
        for ev in (E.PY_RETURN, E.PY_YIELD, E.PY_UNWIND):
            mon.register_callback(tool, ev, mon_end)
        mon.set_events(tool, E.PY_START | E.PY_RESUME | E.PY_THROW | E.PY_RETURN | E.PY_YIELD | E.PY_UNWIND)
        return True

    def _stop_monitoring(self):
        mon = sys.monitoring
        tool = mon.PROFILER_ID
        mon.set_events(tool, 0)
        E = mon.events
        for ev in (E.PY_START, E.PY_RESUME, E.PY_THROW, E.PY_RETURN, E.PY_YIELD, E.PY_UNWIND):
            mon.register_callback(tool, ev, None)
        mon.free_tool_id(tool)

    # ------------------------------------------------------------------ control
    def start(self):
        if self.active:
            return
        self.active = True
        self._on[0] = True
        profile, mon_start, mon_end = self._hooks()
        if self._start_monitoring(mon_start, mon_end):
            self.mode = "sys.monitoring"
        elif _program_profiles():
            # the program's own profiler (cProfile, yappi, its own hook) holds the profile hook:
            # taking it would silently end that profile, and stop() would clear it for good
            self.mode = "off"
            self.active = False
            self._on[0] = False
            from .._console import alert_once
            alert_once("pytrace-held", "[msmemscope] no Python trace (events=traceback): the program's own profiler "
                       "holds sys.setprofile, and stays the program's")
        else:
            self.mode = "sys.setprofile"
            threading.setprofile(profile)
            sys.setprofile(profile)

    def stop(self):
        if not self.active:
            return
        if self.mode == "sys.monitoring":
            self._stop_monitoring()
        else:
            sys.setprofile(None)
            threading.setprofile(None)
        self.active = False
        self._on[0] = False
        now = time_ns()
        with self.lock:
            threads = list(self.threads)
        for st in threads:
            # calls still open end now; their next return is not paired with a start
            while st.stack:
                code, start, cls = st.stack.pop()
                st.rows.append((code, start, now, cls))
            self._write(st)

    def move(self, folder: str):
        """The run moved (config() under the launcher, before anything was written): files from now
        on go to ``folder``; the calls already written went with the old folder."""
        with self.lock:
            self.folder = folder
            for st in self.threads:
                st.path = None
            self.files = []

    # ------------------------------------------------------------------ files
    def _write(self, st: _Thread):
        n = len(st.rows)
        if not n:
            return
        rows = st.rows[:n]
        del st.rows[:n]
        if st.path is None:
            from ..io.files import create_new, unique_path
            ts = time.strftime("%Y%m%d%H%M%S")
            st.path = unique_path(os.path.join(self.folder, f"python_trace_{st.tid}_{ts}.csv"))
            with create_new(st.path) as f:
                f.write(",".join(HEADER) + "\n")
            self.files.append(st.path)
        names, tail = self._names, f",{st.tid},{self.pid}\n"
        lines = []
        for code, start, end, cls in rows:
            if cls is None:
                ent = names.get(id(code))
                if ent is None or ent[0] is not code:  # (an id is reused only once its code is gone)
                    ent = names[id(code)] = (code, _field(f"{code.co_filename}({code.co_firstlineno}): "
                                                          f"{code.co_name}"), code.co_filename == _HERE)
                if ent[2]:  # the tracer's own start()/stop() frames
                    continue
                info = ent[1]
            else:
                info = _field("nn.Module: " + cls)
            lines.append(f"{info},{start},{end}{tail}")
        try:
            with open(st.path, "a") as f:
                f.write("".join(lines))
        except OSError as e:
            import logging
            logging.getLogger("msmemscope").error("python trace: cannot write %s: %s", st.path, e)


def _field(text: str) -> str:
    """A CSV field (quoted when it holds a comma, a quote or a line break)."""
    if "," in text or '"' in text or "\n" in text or "\r" in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def _module_call_codes() -> frozenset:
    """The code objects of ``nn.Module.__call__`` (its FuncInfo names the module class)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return frozenset()
    codes = set()
    mod = torch.nn.Module
    code = getattr(getattr(mod, "__call__", None), "__code__", None)  # the outermost frame of a module call
    if code is not None:
        codes.add(code)
    return frozenset(codes)


def _program_profiles() -> bool:
    """A profile function the program set (this thread's, or the one threading gives new threads)."""
    get_threads = getattr(threading, "getprofile", None)  # 3.10+
    return sys.getprofile() is not None or (get_threads is not None and get_threads() is not None)


_tracer: PyTracer | None = None


def tracer_for(folder: str) -> PyTracer:
    global _tracer
    if _tracer is None or _tracer.pid != os.getpid() or _tracer.folder != folder:
        if _tracer is not None and _tracer.pid == os.getpid():
            _tracer.stop()
        _tracer = PyTracer(folder)
        import atexit
        atexit.register(_tracer.stop)
    return _tracer


def current() -> PyTracer | None:
    return _tracer
