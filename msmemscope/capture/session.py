"""The session: coordinates the sources (capture/source.py) and owns what they share.

It owns the ids (rows numbered at each flush), the one count of bytes in use per
(device, pool) (``account``), the recording flags, steps, flush, the writer, the sinks and
exit handling. The sources own their own state: the native source (native.py) its C++
records and counters, the dispatch-mode source (dispatch.py) its block registry. Rows from
the sources and from the API (marks, steps, snapshots) go to ``buf``; at every step boundary,
when the buffer is full, and at exit, ``flush`` numbers them and hands them to the writer and
to the sinks. The buffer is the only per-run memory that grows, and it is emptied at each flush.

Capture is a leaf: the online analyses, framework hooks and anything else that wants to know
about a session register through the hook points in ``capture/__init__.py`` (``on_start``),
``Session.add_sink``, ``Session.set_op_observer`` and ``Session.on_stop``.

Raw row tuple: ``events.RawRow`` (event, event_type, name, ts, tid, device, ptr, attr, py_stack, c_stack)
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from time import time_ns

import torch

from .. import __version__
from ..events import C_STACK, FORMAT_VERSION, Event, Mstx, System, NA, free_ids
from ..io.errors import why_write_failed
from ..io.files import cannot_write_under, create_new, make_dirs, unique_path
from ..io.spool import SpoolWriter
from ..io.writers import open_writer
from ..options import Options
from . import backends, stacks
from .dispatch import DispatchSource
from .ops import keep_dynamo_out
from .owners import backward_task, once_at_backward_end
from .source import Flags

log = logging.getLogger("msmemscope")



class _LogFile(logging.StreamHandler):
    """The run's log: a new file with our permissions (0o640), never opened through a planted
    symlink (``logging.FileHandler`` appends to whatever is at the path)."""

    def __init__(self, path: str):
        super().__init__(create_new(path))

    def close(self):
        self.acquire()
        try:
            if self.stream is not None and not self.stream.closed:
                self.stream.close()
        finally:
            self.release()
        super().close()

    def handleError(self, record):
        pass  # a log line that cannot be written (disk full) is dropped, never a traceback


FLUSH_ROWS = 1 << 16  # bound on the buffer between step boundaries
# Step boundaries closer together than this share one flush where every analysis allows it
# (``batch_steps``): the flush's own calls (writer, analyses, checkpoint) a 2 ms step are ~35 us of
# its ~160 us of step-end work (BENCHMARKS.md, seventeenth session). A boundary whose flush waits is
# flushed by the next boundary past this time, or by a thread of ours when the program goes quiet.
# MSMEMSCOPE_STEP_FLUSH_S=0: a flush at every boundary.
STEP_FLUSH_S = 0.1


def _step_flush_ns() -> int:
    try:
        return max(0, int(float(os.environ.get("MSMEMSCOPE_STEP_FLUSH_S", STEP_FLUSH_S)) * 1e9))
    except ValueError:
        return int(STEP_FLUSH_S * 1e9)
# the native source's rows go to the writer process as the marshal bytes it makes in C++
# (MSMEMSCOPE_HANDOFF=marshal: every row marshalled here, as before)
_PIECES = os.environ.get("MSMEMSCOPE_HANDOFF", "").strip().lower() != "marshal"
# a steady loop's flush takes the native source's records with no row tuple made (``_take_packed``;
# MSMEMSCOPE_RECORDS=rows: every flush drains them into row tuples, as before)
_PACKED = _PIECES and os.environ.get("MSMEMSCOPE_RECORDS", "").strip().lower() != "rows"
# owner labels and modules given to the native source's rows as they are drained, whose bytes then go
# to the writer as they are (``_drain_labelled``; MSMEMSCOPE_LABELS=rows: drained, then rewritten)
_LABELS_AT_DRAIN = _PIECES and os.environ.get("MSMEMSCOPE_LABELS", "").strip().lower() != "rows"


def _why(exc) -> str:
    """A failure in a few words: 'No space left on device (/out/x.csv)'."""
    if isinstance(exc, OSError) or type(exc).__module__ == "sqlite3":
        return why_write_failed(exc)
    return str(exc) or type(exc).__name__


class _HeldStep:
    """The first optimizer step's boundary while it is held (``Session.step``): its place in the
    buffer and the flush count then, its time and thread, and its rows once a flush put them into
    the buffer (``Session._flush_around_held``). ``later``: the rows ending each optimizer step that
    came on a thread which had not stepped twice yet (another thread's optimizer, while this one
    waits for its second), put at the end of the buffer when they came, numbered when the hold is
    settled; ``steps``: the optimizer steps of each thread since the hold."""
    __slots__ = ("idx", "flushes", "ts", "tid", "cut", "later", "steps")

    def __init__(self, idx, flushes, ts, tid):
        self.idx, self.flushes, self.ts, self.tid, self.cut = idx, flushes, ts, tid, None
        self.later: list = []
        self.steps = {tid: 1}


def _release_compile():
    """nn.Module.compile back to torch's where module attribution or owner labels wrapped it."""
    mods = sys.modules.get("msmemscope.capture.modules")
    if mods is not None:
        try:
            mods.release_compile()
        except Exception:
            pass


def _timestamp() -> str:
    return time.strftime("%Y%m%d%H%M%S")


def dist_env() -> dict:
    """The process's place in a distributed job: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (torchrun
    and the like), else, for the rank and world size, torch.distributed's default process group
    once the program set it up (ranks given them in code: torch.multiprocessing.spawn)."""
    env = os.environ
    def num(k):
        v = env.get(k)
        return int(v) if v is not None and v.lstrip("-").isdigit() else None
    out = {"rank": num("RANK"), "local_rank": num("LOCAL_RANK"), "world_size": num("WORLD_SIZE"),
           "host": socket.gethostname()}
    if out["rank"] is None:
        from .native import process_group
        rank, world = process_group()
        if rank is not None:
            out["rank"] = rank
            if out["world_size"] is None:
                out["world_size"] = world
    return out


_PG_FOLLOWED = False


def follow_process_group():
    """Once per process: torch.distributed's ``init_process_group`` tells the session, when it
    returns, the rank and world size a program gave it in code (``Session.joined_process_group``).
    Installed when the program imports torch.distributed (``after_import``; never imported here:
    it costs ~45 ms). The modules that hold the function under its name are patched:
    ``torch.distributed``, ``distributed_c10d``, and ``device_mesh`` (``init_device_mesh``)."""
    global _PG_FOLLOWED
    if _PG_FOLLOWED:
        return
    _PG_FOLLOWED = True
    from ..after_import import after_import
    after_import("torch.distributed", _wrap_init_process_group,
                 failed="process {pid}: init_process_group is not followed (ranks named only by RANK)")


def _wrap_init_process_group(td):
    orig = getattr(td, "init_process_group", None)
    if orig is None or getattr(orig, "_msmemscope", False):
        return

    @functools.wraps(orig)
    def init_process_group(*a, **k):
        out = orig(*a, **k)
        try:
            from . import current
            s = current()
            if s is not None and s.pid == os.getpid():
                s.joined_process_group()
        except Exception as e:  # the tool's failure: never raised in the program's init_process_group
            log.warning("rank from init_process_group: %s", _why(e))
        return out
    init_process_group._msmemscope = True
    for name in ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.device_mesh"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "init_process_group", None) is orig:
            mod.init_process_group = init_process_group


def run_folder_name(pid: int, ts: str, kind: str, rank=None) -> str:
    """``msmemscope_<pid>_<ts>_<backend>`` (the original's name), plus ``_rank<R>`` in a distributed
    job (RANK set) so that the ranks of a job never share a name, on one node or many."""
    name = f"msmemscope_{pid}_{ts}_{kind}"
    return name if rank is None else f"{name}_rank{rank}"


def _new_folder(root: str, name: str) -> str:
    """Create the run folder; never share one with another process (same pid and second on
    another node of a shared filesystem): an existing name gets ``_1``, ``_2``… appended."""
    base, n = os.path.join(root, name), 0
    while True:
        path = base if n == 0 else f"{base}_{n}"
        try:
            os.mkdir(path, 0o750)
            return path
        except FileExistsError:
            n += 1


class Session:
    timestamp = staticmethod(_timestamp)

    def __init__(self, opts: Options, launched: bool = False):
        self.opts = opts
        self.launched = launched
        self._set_wants()
        self.pid = os.getpid()
        self.buf: list = []
        # the native source's rows in ``buf`` already made as marshal bytes: (position, count,
        # first row, last row, bytes); the hand-off sends those bytes instead of marshalling the
        # rows again (``_pieces_of``). Emptied at each flush and wherever ``buf`` is rearranged.
        self.pieces: list = []
        self.flush_rows = FLUSH_ROWS
        self.lock = threading.RLock()        # MALLOC/FREE rows and pool counters change together
        self.flush_lock = threading.RLock()
        self._step_failure_said = False
        self._flushing = None                # thread id of the flush in progress
        self._pending_signal = None          # SIGTERM that arrived during that flush
        self._failure_seen = None            # (id, args) of the allocation failure last handled
        self._closing = False                # close() in progress: signals wait for its end
        self._deferred: list = []            # signals that arrived during close()
        self.failure = None                  # why tracing stopped on a failure of the tool's own
        self.tls = threading.local()
        self.used: dict = {}                 # (device, pool) -> allocated bytes
        self.peak: dict = {}
        self._next_range = 0
        self.ranges: dict = {}
        self.step_no = 1
        self.explicit_steps = False
        self._held_step = None               # the first optimizer step's boundary, until the program shows whether it numbers steps itself
        self._optimizer_steps = False        # settled: the optimizer steps are the steps
        self._backward_steps = set()         # backward passes whose end ends a step (_optimizer_stepped)
        # each thread's lead optimizer (weakly) and the others stepped since it last stepped (_leads)
        self._lead_opt: dict = {}
        self._flushes = 0
        self._packed_flushes = 0  # of them, flushes of native records with no row tuple made (_take_packed)
        self._labelled_flushes = 0  # of them, flushes whose drain gave the labels (_drain_labelled)
        self._step_flush_ns = _step_flush_ns()
        self._last_flush_ns = 0
        self._last_wait_ns = 0               # when the last boundary whose flush waits ended its step
        self._ended_unflushed = None         # the last step ended whose flush waits (STEP_FLUSH_S)
        self._steps_waiting = 0              # step boundaries whose flush waits now
        self._rows_per_step = 0.0            # rows a step, from the flushes that ended steps
        self._flusher = None                 # the thread that flushes it once the program goes quiet
        self._exit_installed = False
        self.active = False
        self.started_once = False
        self.closed = False
        self.next_id = 0
        self.sinks: list = []
        self.watch_active = False            # the op observer is called around every dispatch-mode op
        self.op_observer = None              # its before/after (the watch engine): set_op_observer
        self.watch_engine = None             # capture.watch.WatchEngine once --watch or watcher.watch() is used
        self._stop_hooks: list = []          # called at each stop(): on_stop
        # torch hooks kept from the first start() to close(), inert while stopped: removing one
        # from torch's global dicts while another thread's optimizer.step() iterates them raised
        # "OrderedDict mutated during iteration" in that thread
        self._lasting_hooks: list = []
        self._lock_owner = None
        self.labeler = None                  # owner labelling (analysis 'decompose'), see capture/owners.py
        self.modules = None                  # module attribution (capture/modules.py), from the first start()
        self.kind = self._primary_kind()
        self.op_device = "cpu" if self.kind == "cpu" else backends.device_id(torch.device(opts.device or self.kind))
        self.flags = Flags()
        # the sources: the dispatch-mode one always exists (the fallback, and the successor of a
        # handover); the native one where the run allows it and it is built
        self.dispatch = DispatchSource(self)
        self.native = self._choose_source()  # NativeSource, or None
        self.native_ops = self.native is not None  # the native source records ops and new blocks
        self.source = self.native if self.native_ops else self.dispatch  # the one following ops now
        # the dispatch source's registry, read by owner labels, watch and the OOM analysis
        self.live = self.dispatch.live
        self.block_of = self.dispatch.block_of
        self.new_block = self.dispatch.new_block
        self.inner_block = self.dispatch.inner_block
        self.storage_at = self.dispatch.storage_at
        self._freed = self.dispatch.freed
        self.device_source = self._choose_device_source()  # the allocator trace of cuda/npu, or None
        self._update_flags()
        self._rank_learnt = False            # the rank came from init_process_group, after the folder was made
        self._open_output()
        follow_process_group()

    def _set_wants(self):
        opts = self.opts
        ev = opts.effective_events()
        self.want_alloc = "alloc" in ev
        self.want_free = "free" in ev
        self.want_launch = "launch" in ev and "op" in opts.level
        self.want_access = "access" in ev
        self.py_depth = opts.python_stack if ("traceback" in ev or opts.python_stack) else 0
        self.c_depth = opts.c_stack

    def reconfigure(self, opts) -> list:
        """A script's ``msmemscope.config()`` under the launcher, merged with the command line's
        options (cli wins where it set one): in force from now on. The output folder and format
        move only while nothing has been written; returns what could not be applied. (The online
        analyses are rebuilt by the caller, outside capture: ``msmemscope._merge_with_launcher``.)"""
        import dataclasses
        old, late = self.opts, []
        moved = ((opts.output, opts.data_format, opts.compress, opts.keep_steps)
                 != (old.output, old.data_format, old.compress, old.keep_steps))
        keep_output = None
        if moved and (self.next_id > 0 or self.closed):
            keep_output = f"output_path/format/compress/keep_steps (the dump had already begun in {self.folder})"
        elif moved and opts.output != old.output:
            why = cannot_write_under(opts.output)
            if why:  # tried before the dump begun here is given up: the run keeps it
                keep_output = f"output_path {opts.output!r} (cannot write there: {why}; the dump stays in {self.folder})"
        if keep_output:
            late.append(keep_output)
            opts = dataclasses.replace(opts, output=old.output, data_format=old.data_format,
                                       compress=old.compress, keep_steps=old.keep_steps)
            moved = False
        self.opts = opts
        self._set_wants()
        if moved:
            import shutil
            from . import pytrace
            self.writer.abort()
            log.removeHandler(self._log_handler)
            self._log_handler.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            self._open_output()
            t = pytrace.current()
            if t is not None:
                t.move(os.path.dirname(self.dump_path))
        if self.active and ("traceback" in opts.events) != ("traceback" in old.events):
            from . import pytrace
            if "traceback" in opts.events:
                pytrace.tracer_for(os.path.dirname(self.dump_path)).start()
            elif pytrace.current() is not None:
                pytrace.current().stop()
        if self.started_once and opts.watch is not None and self.watch_engine is None:
            from .watch import attach
            attach(self)
        from . import modules
        if self.active and self.modules is None and modules.wanted(opts):  # config(analysis='decompose') late
            self.modules = modules.ModuleTracker(self).install()
        if self.native_ops:
            from . import native
            why = native.unsupported_by(opts, self.kind, self.launched)
            if why:
                self.use_dispatch_source(why)
            else:
                self.native.configure(self.want_access, self.py_depth)
        if getattr(self, "device_source", None) is not None:
            from . import cuda_source
            why = cuda_source.unsupported_by(opts)
            if why:  # the allocator trace was chosen when tracing began; it cannot hand over
                late.append(f"{self.kind} memory stays with the allocator trace ({why}: give those options "
                            f"on the command line)")
        self.config["options"] = json.loads(opts.to_json())
        try:
            self._write_config()
        except OSError:
            pass
        self._update_flags()
        if opts.collect_mode != old.collect_mode:
            if opts.collect_mode == "deferred" and self.active:
                self.stop()   # recording waits for the script's msmemscope.start()
            elif opts.collect_mode == "immediate" and not self.active:
                self.start()
        return late

    def _choose_source(self):
        """The native source (default events recorded in C++) where the run allows it and it is
        built; else the dispatch-mode source. ``MSMEMSCOPE_SOURCE=python|native`` chooses."""
        want = os.environ.get("MSMEMSCOPE_SOURCE", "auto").strip().lower()
        self.source_note = None
        self.native_missing = False  # the run could have used it, but it is not built or broken
        if want == "python":
            return None
        from . import native
        why = native.unsupported_by(self.opts, self.kind, self.launched)
        mod = None if why else native.load_module()
        if mod is None:
            self.native_missing = why is None
            why = why or native.why_not()
            self.source_note = why
            if want == "native":
                from .._console import say
                say(f"[msmemscope] MSMEMSCOPE_SOURCE=native: using the dispatch-mode source: {why}")
            return None
        return native.NativeSource(mod, self.flush_rows, self._source_full, self.want_access, self.py_depth)

    def _choose_device_source(self):
        """The one place that picks the device-memory source: on CUDA and Ascend NPU, the caching
        allocator's own trace (capture/cuda_source.py) where the build offers it and the options
        allow it; else device blocks stay with the dispatch-mode source (tensor storages).
        ``MSMEMSCOPE_SOURCE=python`` keeps the dispatch mode for everything."""
        self.device_source_note = None
        if self.kind not in ("cuda", "npu"):
            return None
        if os.environ.get("MSMEMSCOPE_SOURCE", "auto").strip().lower() == "python":
            self.device_source_note = "MSMEMSCOPE_SOURCE=python"
            return None
        from . import cuda_source
        why = cuda_source.unsupported_by(self.opts)
        mem = None
        if why is None:
            mem, why = cuda_source.memory_module(self.kind)
        if mem is None:
            self.device_source_note = why
            return None
        return cuda_source.AllocatorSource(self, self.kind, mem)

    # ------------------------------------------------------------------ output
    def _primary_kind(self) -> str:
        if self.opts.device:
            return self.opts.device.split(":")[0]
        return backends.available_accelerator() or "cpu"

    def _open_output(self):
        ts = _timestamp()
        root = make_dirs(self.opts.output)
        self.folder = _new_folder(root, run_folder_name(self.pid, ts, self.kind, dist_env()["rank"]))
        dev_dir = "device_cpu" if self.op_device == "cpu" else f"device_{self.op_device}"
        self.device_folder = make_dirs(os.path.join(self.folder, dev_dir))
        dump_dir = make_dirs(os.path.join(self.device_folder, "dump"))
        # the rows are written by a process of its own (io/spool.py; MSMEMSCOPE_WRITER=inline keeps them here)
        self.writer = SpoolWriter(open_writer(self.opts.data_format, os.path.join(dump_dir, f"memscope_dump_{ts}"),
                                              self.opts.compress), keep_steps=self.opts.keep_steps)
        self.dump_path = self.writer.path
        log_dir = make_dirs(os.path.join(self.folder, "msmemscope_logs"))
        self.log_path = unique_path(os.path.join(log_dir, f"msmemscope_{ts}.log"))
        self._log_handler = _LogFile(self.log_path)
        self._log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(self._log_handler)
        log.setLevel(getattr(logging, self.opts.log_level.upper(), logging.INFO))
        self.config = {
            "tool": "msmemscope", "version": __version__, "pid": self.pid, **dist_env(),
            "argv": list(sys.argv), "torch": torch.__version__, "backend": self.kind,
            "device": self.op_device, "dump": os.path.relpath(self.dump_path, self.folder),
            "start_time": ts, "options": json.loads(self.opts.to_json()),
            "format_version": FORMAT_VERSION,
            "source": "native" if self.native is not None else "dispatch",
            "source_note": self.source_note,   # why not native, when it is not
            "native_missing": self.native_missing,
            "launch_id": os.environ.get("MSMEMSCOPE_LAUNCH_ID"),  # which launcher run made it
            # device blocks: "allocator_trace" (the caching allocator's own events) or "dispatch"
            "device_source": None if self.kind == "cpu" else
            ("allocator_trace" if self.device_source is not None else "dispatch"),
            "device_source_note": self.device_source_note,
        }
        self._write_config()
        runs = os.environ.get("MSMEMSCOPE_RUNS")
        if runs and self.launched:
            try:  # tells the launcher where this run is, wherever config() put it
                with open(runs, "ab") as f:  # bytes: a folder name need not be UTF-8
                    f.write(os.fsencode(self.folder) + b"\n")
            except OSError:
                pass
        log.info("tracing process %d into %s (%s source%s)", self.pid, self.folder, self.config["source"],
                 f"; not native: {self.source_note}" if self.source_note else "")
        if self.kind != "cpu":
            log.info("%s memory from the %s%s", self.kind, "caching allocator's trace" if self.device_source
                     else "dispatch-mode source (tensor storages)",
                     f" ({self.device_source_note})" if self.device_source_note else "")

    def _write_config(self):
        path = os.path.join(self.folder, "config.json")
        tmp = path + ".tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)  # a stale or planted name: removed, never written through
        with create_new(tmp) as f:
            json.dump(self.config, f, indent=2)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ flags
    def _update_flags(self, pause: bool = False):
        steps = self.opts.steps
        held = self._held_step is not None  # the rows may belong to step 2 (as numbered now) or still to 1
        self.emit = self.active and not pause and (not steps or self.step_no in steps or (held and 1 in steps))
        self.emit_launch = self.emit and self.want_launch
        self.emit_access = self.emit and self.want_access
        self.emit_alloc = self.emit and self.want_alloc
        self.emit_free = self.emit and self.want_free
        # a block whose MALLOC is in the dump gets its FREE there even when freed outside the
        # traced window (flagged ``untraced``): ``used`` stays the running sum of the sizes
        self.free_untraced = self.want_free and not self.closed
        on = not self.closed
        f = self.flags = Flags(self.active and on, self.emit and on, self.emit_alloc and on, self.emit_free and on,
                               self.free_untraced, self.emit_launch and on, self.emit_access and on)
        if self.native is not None:
            self.native.set_flags(f)
        if self.modules is not None:
            self.modules.set_active(self.active and on)

    # ------------------------------------------------------------------ accounting
    def account(self, device, pool, delta):
        """The one count of bytes in use per (device, pool): apply ``delta``, return (bytes in use
        after it, its time). Called under ``self.lock``. The CPU pool's count lives in the native
        source when there is one (its frees happen in C++, without the GIL)."""
        pk = (device, pool)
        if self.native is not None and device == "cpu":
            used, ts = self.native.account(delta)
        else:
            used, ts = self.used.get(pk, 0) + delta, time_ns()
        self.used[pk] = used
        if used > self.peak.get(pk, 0):
            self.peak[pk] = used
        return used, ts

    def sync_sources(self, labels=None):
        """Move the native source's records into ``buf`` and take its counters: called before a
        Python-side row is appended, so that rows keep the order in which things happened. With
        ``labels`` (``_drain_labelled``) the MALLOC rows are made with their owner labels and
        modules; returns (rows given a module, the last allocation id drained) then."""
        self.dispatch.drain(self.buf)
        nat = self.native
        got = (0, None)
        if nat is not None:
            if labels is not None:
                failed, *got = nat.drain_labelled(self.buf, self.pieces if _PIECES else None, labels)
            else:
                # rows nothing rewrites before the flush (owner labels and modules rewrite MALLOC rows)
                plain = self.native_ops and self.labeler is None and self.modules is None and _PIECES
                failed = nat.drain(self.buf, self.pieces if plain else None)
            if failed:
                from .snapshot import oom_snapshots
                oom_snapshots(self, self.buf, failed)
            self._native_counters(nat)
        return got

    def _native_counters(self, nat):
        used, peak = nat.counters()
        pk = ("cpu", nat.pool)
        self.used[pk] = used
        if peak > self.peak.get(pk, 0):
            self.peak[pk] = peak

    def new_alloc_id(self) -> int:
        """The next allocation id: one sequence for every source of the run."""
        with self.lock:
            self.dispatch.next_alloc += 1
            return self.dispatch.next_alloc

    def _source_full(self):
        # a source's records passed FLUSH_ROWS (from the native op exit)
        if self.active and not self.closed:
            self.flush()

    def live_alloc_ids(self) -> set:
        """Allocation ids of the blocks allocated while tracing and not yet freed."""
        ids = self.dispatch.live_alloc_ids()
        if self.native is not None:
            ids |= self.native.live_alloc_ids()
        if self.device_source is not None:
            ids |= self.device_source.live_alloc_ids()
        return ids

    def live_when_drained(self) -> set:
        """Allocation ids of the blocks live when the rows being flushed were drained: those live
        now, and those freed since then, whose FREE rows wait in a source or in ``buf``. A block
        another thread frees during a flush leaves the live table before its FREE row reaches any
        flushed row: the leak rule must still see it live at the step ends of this flush."""
        ids = self.live_alloc_ids()  # first: a block freed after this is among the rows below
        ids |= self.dispatch.freeing.copy()  # freed by the dispatch mode, its row being made
        if self.native is not None:
            # the native records' FREEs, read where they wait: drained here, they would make the
            # next flush drain too (take_packed takes records only when no row waits in buf)
            ids |= self.native.waiting_free_ids()
        self.dispatch.drain(self.buf)
        ids.update(free_ids(self.buf))
        return ids

    def alloc_id_of(self, st):
        """The allocation id of a live storage's block, or None when tracing never saw it."""
        aid = self.dispatch.alloc_id_of(st)
        if aid is None and self.native is not None:
            aid = self.native.alloc_id_of(st)
        return aid

    # ------------------------------------------------------------------ hook points
    def add_sink(self, sink):
        """A sink (online analysis, watch engine): consume(rows, first_id) at each flush,
        step_end(session, step), close(session), optionally op_failed(session, name, exc)."""
        if sink not in self.sinks:
            self.sinks.append(sink)

    def set_op_observer(self, observer):
        """An object called around every op of the dispatch-mode source while ``watch_active``:
        ``before(func, name, args, kwargs)``, ``after(func, name, args, kwargs, out, touched)``.
        Ops are only seen there, so the session hands over to it (from the native source)."""
        self.op_observer = observer
        self.use_dispatch_source("watch")

    def on_stop(self, fn):
        """``fn()`` is called at each stop(), before the STOP_TRACE row."""
        self._stop_hooks.append(fn)

    def use_dispatch_source(self, why: str):
        """Go over from the native source to the dispatch-mode source for the rest of the run:
        watch and owner labels follow tensor storages, which only the dispatch mode sees. The
        blocks the native source counted keep being reported by it when freed; both sources
        share one bytes-in-use counter and one allocation-id sequence."""
        if not self.native_ops:
            return
        # the rows so far are written with what the native side knows of them (owner labels,
        # owning modules: the blocks' own, kept at step ends for the boundaries that wait)
        self.flush()
        with self.lock:
            self.sync_sources()
            self.dispatch.take_over(self.native, self.native.hand_over())
            self.native_ops = False
            self.source = self.dispatch
            if self.labeler is not None and hasattr(self.labeler, "handed_over"):
                self.labeler = self.labeler.handed_over()  # owner labels follow the storages now
        self.config["source"] = "native, then dispatch"
        try:
            self._write_config()
        except OSError:
            pass
        log.info("using the dispatch-mode source from now on: %s", why)
        if self.active:
            self.dispatch.start()

    def joined_process_group(self):
        """torch.distributed's default process group exists now (``init_process_group`` returned,
        or a step ended or tracing started after it did): a process that its environment did not
        name a rank (torch.multiprocessing.spawn, mp.Process: the rank and world size given in
        code) is one from now on, as under torchrun. ``config.json`` gets its rank and world size;
        the run folder gets its ``_rank<R>`` name when the session closes (``_name_rank_folder``:
        the writer process writes into it by path until then); and where the native source
        cannot label a distributed run's blocks (FSDP2, ``--analysis=decompose``) the dispatch-mode
        source takes over here, as the torchrun rank's session chose at its start. Before the
        model is sharded (``fully_shard`` needs the process group) the labels are those of the
        torchrun rank's run."""
        if self.closed or self.pid != os.getpid() or self.config.get("rank") is not None:
            return
        env = dist_env()
        if env["rank"] is None:
            return
        self._rank_learnt = True
        self.config["rank"] = env["rank"]
        self.config["world_size"] = env["world_size"]
        if self.config.get("local_rank") is None:
            self.config["local_rank"] = env["local_rank"]
        log.info("rank %s of %s (from init_process_group)", env["rank"], env["world_size"])
        if self.native_ops:
            from . import native
            why = native.unsupported_by(self.opts, self.kind, self.launched)
            if why:
                self.config["source_note"] = why
                self.use_dispatch_source(why)  # writes config.json
                return
        try:
            self._write_config()
        except OSError as e:
            log.warning("config.json: %s", e)

    def _rank_unknown(self) -> bool:
        """No rank yet, and torch.distributed's process group is set up (cheap: no import, two calls)."""
        if self._rank_learnt or self.config.get("rank") is not None or self.closed:
            return False
        from .native import process_group
        return process_group()[0] is not None

    def _name_rank_folder(self):
        """At the session's end: a rank learnt after the run folder was made (``_rank_learnt``)
        renames it ``…_rank<R>``, as a torchrun rank's is named from the start, once nothing writes
        into it any more (the writer process has ended, the analyses have written). The name is
        reserved first (an exclusive mkdir; the rename then replaces that empty folder), so no
        other process's folder is ever taken; on any failure the folder keeps its name (the rank
        is in config.json either way)."""
        rank = self.config.get("rank")
        if not self._rank_learnt or rank is None:
            return
        root, name = os.path.split(self.folder)
        if name.startswith(f"msmemscope_{self.pid}_") and "_rank" in name:
            return
        base = os.path.join(root, run_folder_name(self.pid, self.config.get("start_time") or _timestamp(),
                                                  self.kind, rank))
        n = 0
        while True:
            dst = base if n == 0 else f"{base}_{n}"
            try:
                os.mkdir(dst, 0o750)
                break
            except FileExistsError:
                n += 1
            except OSError:
                return
        try:
            os.rename(self.folder, dst)
        except OSError:
            try:
                os.rmdir(dst)
            except OSError:
                pass
            return
        old, self.folder = self.folder, dst
        for attr in ("device_folder", "dump_path", "log_path"):
            p = getattr(self, attr, None)
            if isinstance(p, str) and p.startswith(old + os.sep):
                setattr(self, attr, dst + p[len(old):])
        runs = os.environ.get("MSMEMSCOPE_RUNS")
        if runs and self.launched:
            try:  # the launcher lists the folders that still exist: the new name too
                with open(runs, "ab") as f:
                    f.write(os.fsencode(dst) + b"\n")
            except OSError:
                pass

    def py_stack(self):
        return stacks.python_stack(self.py_depth)

    # ------------------------------------------------------------------ blocks
    # ------------------------------------------------------------------ rows from the API
    def system(self, kind, attr=None):
        self.sync_sources()
        self.buf.append((Event.SYSTEM, kind, NA, time_ns(), threading.get_ident(), self.op_device, None,
                         attr, None, None))

    def mstx(self, kind, msg, attr=None):
        # also in a step outside --steps: the ranges and marks there label what the recorded steps
        # allocate next (a range closed in an unrecorded step stayed open for the leak sites)
        if self.emit or (self.active and self.opts.steps and not self.closed):
            self.sync_sources()
            self.buf.append((Event.MSTX, kind, msg, time_ns(), threading.get_ident(), self.op_device, None,
                             attr, self.py_stack() if self.py_depth else None, None))

    def mark(self, msg):
        self.mstx(Mstx.MARK, msg)

    def range_start(self, msg):
        with self.lock:
            self._next_range += 1
            rid = self._next_range
        self.ranges[rid] = msg
        if msg == "step start":
            self.explicit_steps = True  # the ranges mark the steps, not the optimizer
        self.mstx(Mstx.RANGE_START, msg, {"range_id": rid})
        return rid

    def range_end(self, rid):
        msg = self.ranges.pop(rid, None)
        self.mstx(Mstx.RANGE_END, msg if msg is not None else NA, {"range_id": rid})
        if msg == "step start":
            self.step("range")

    def step(self, source="api"):
        """End the current step. Explicit steps (API, 'step start' ranges) switch off the optimizer hook.

        A program that numbers its steps (``msmemscope.step()``, 'step start' ranges) owns the
        numbering from its first iteration: the first optimizer step's boundary is held until the
        program shows which it does: a ``msmemscope.step()`` drops it, a second optimizer step
        (or stop) puts it in the dump where it happened.

        Under the flush lock: two threads that each step an optimizer end steps one after the other
        (two STEP rows of one number, and none of the next, when they met here)."""
        if self._rank_unknown():  # (see start())
            try:
                self.joined_process_group()
            except Exception as e:
                log.warning("rank from the process group: %s", e)
        with self.flush_lock:
            try:
                self._step(source)
            except Exception as e:  # the tool's failure: never raised in the program's optimizer step or step()
                self._step_failed(e)

    def _optimizer_stepped(self, *_):
        """The optimizer hook's step boundary. An optimizer step inside a backward pass (the
        optimizer in backward: an optimizer per parameter, stepped from its post-accumulate-grad
        hook) ends no step of its own: the end of that backward does, once. Before: each of those
        optimizers ended a step (36 steps for 6 iterations of a 6-parameter model), and a leak of
        an iteration was growth of no step."""
        if not self.active:  # stopped: the hook stays registered (see _lasting_hooks)
            return
        task = backward_task()  # -1 also on a torch that cannot say: each optimizer step ends a step
        if task == -1 or not once_at_backward_end(self._backward_steps, task, lambda: self.step("optimizer")):
            if self.explicit_steps or self._leads(_[0] if _ else None):
                self.step("optimizer")

    def _leads(self, opt) -> bool:
        """Whether this optimizer step ends a step: with several optimizers stepped one after the
        other on a thread (a GAN's two, Muon beside AdamW), only the steps of the first one seen to
        step there do, so that a step is an iteration. Each optimizer's step ended one before: live
        bytes rose at every other step end and a leak of 4 KB an iteration was no growth. Another
        optimizer that steps twice while the lead does not has taken over (a new phase of training)."""
        if opt is None:
            return True
        tid = threading.get_ident()
        lead, others = self._lead_opt.get(tid, (lambda: None, None))
        if lead() is opt:
            others.clear()
            return True
        if lead() is not None and id(opt) not in others:
            others.add(id(opt))
            return False
        try:
            self._lead_opt[tid] = (weakref.ref(opt), set())
        except TypeError:  # not weakly referable: every step of it ends one
            return True
        return True

    def _step_failed(self, exc):
        log.error("a step boundary failed: %s", _why(exc), exc_info=True)
        if not self._step_failure_said:
            self._step_failure_said = True
            from .._console import alert
            alert(f"[msmemscope] a step boundary failed in process {self.pid} ({_why(exc)}); the program runs "
                  f"on, tracing goes on (details in the log)")

    def _step(self, source):
        if source == "optimizer":
            if self.explicit_steps or not self.active:
                if self.active and self.native_ops and self.device_source is None:
                    # the gradients as the optimizer used them: a program that frees them
                    # (zero_grad) before it ends the step itself leaves none for its step end
                    self._keep_step_facts()
                return
            if self.step_no == 1 and self._held_step is None and not self._optimizer_steps:
                # (under the flush lock, step(): the buffer's length and the flush count, taken together)
                self._facts_at_hold()
                self._held_step = _HeldStep(len(self.buf), self._flushes, time_ns(), threading.get_ident())
                self.step_no = 2  # tentatively: what live reports (watch, OOM) say until it is settled
                self._update_flags()
                return
            held = self._held_step
            if held is not None:
                tid = threading.get_ident()
                held.steps[tid] = held.steps.get(tid, 0) + 1
                if min(held.steps.values()) < 2:
                    # a thread that stepped once (the first step of another thread's optimizer, or the
                    # holder's second while such a thread has not come back): still open, since the
                    # program may yet number its steps (a thread that trains beside the one calling
                    # msmemscope.step()). Its boundary is kept at its place, numbered when settled
                    self._hold_later(held, tid)
                    return
            self._release_held_step()
            self._optimizer_steps = True
        else:
            self.explicit_steps = True
            if self._held_step is not None:  # the program numbers its steps: still step 1
                held, self._held_step = self._held_step, None
                cut = {id(r) for rows in [held.cut or ()] + [rows for _, rows in held.later] for r in rows}
                if cut:  # their rows wait in the buffer: gone
                    self.buf[:] = [r for r in self.buf if id(r) not in cut]
                    self.pieces.clear()
                    self._bound_drain()
                self.step_no = 1
                self._update_flags()
        if not self.active:
            return
        ended = self.step_no
        # owners and owning modules as they are at this step's end, before its STEP row, for the
        # flush that writes its rows (now or shared with later boundaries: native source only): a
        # block whose label changed since its MALLOC row got one (a gradient not yet p.grad at a
        # flush inside the step) has its OWNER row in this step
        kept = self.native_ops and self.device_source is None and self._keep_step_facts()
        if self.native_ops and self.device_source is None and self.op_device == "cpu" and not self.opts.steps:
            # the STEP record goes among the native source's records, under their lock: a clean
            # cut between the rows of the two steps, on every thread, with nothing drained here;
            # no pause, as every step records alike (with --steps the flags change: the cut below)
            self.native.step_end(ended)
            self.step_no += 1
        else:
            self._device_step_end(ended)
            # the STEP row is a clean cut: nothing is recorded from before it is written until the
            # next step's flags are set, so no row of another thread lands in the wrong step
            self._update_flags(pause=True)
            self.system(System.STEP, {"step": ended})
            self.step_no += 1
            self._update_flags()
        now = time_ns()
        if kept and self._may_wait() and now - self._last_flush_ns < self._step_flush_ns:
            self._ended_unflushed = ended  # its rows and STEP row wait (buffer, native records), in order
            self._last_wait_ns = now
            self._steps_waiting += 1
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_waiting, name="msmemscope-step-flush",
                                                 daemon=True)
                self._flusher.start()
        else:
            self.flush(step_end=ended)

    def _may_wait(self) -> bool:
        """Whether this step boundary's flush may wait for the next: events on the native source,
        and only analyses whose step_end holds for every step ended before it (``batch_steps``:
        the leak rule judges the STEP rows in its rows, the decomposition ends each step at its
        STEP row, the checkpoint saves what is), with owner labels and module attribution that
        keep what they know at each step end (``_keep_step_facts``)."""
        return (self._step_flush_ns > 0 and self.native_ops and self.device_source is None
                and self._keeps_step_facts() and self.op_observer is None
                and self._held_step is None and len(self.buf) < self.flush_rows
                and self._frame_fits()
                and "traceback" not in self.opts.events  # the Python trace would follow our thread too
                and all(getattr(s, "batch_steps", False) for s in self.sinks))

    def _frame_fits(self) -> bool:
        """Whether the flush after the next step still fits in what the writer takes without making
        the program wait (``room_rows``: half the pipe to the writer process). A frame the pipe
        cannot hold waits for the writer process to read it, and that one may be busy writing the
        frame before (tiny GPT-2 with decompose: 4-5 steps a frame, ~1 MB, 0.3-1 ms a step waiting)."""
        room = getattr(self.writer, "room_rows", None)
        rows = room() if room is not None else None
        return rows is None or (self._steps_waiting + 2) * self._rows_per_step <= rows

    def _keeps_step_facts(self) -> bool:
        """Whether the owner labels and module attribution (where on) keep what they know at each
        step end (``batch_steps``; the dispatch source's labeller does not)."""
        return (getattr(self.labeler, "batch_steps", self.labeler is None)
                and getattr(self.modules, "batch_steps", self.modules is None))

    def _keep_step_facts(self) -> bool:
        """The owners and owning modules of the live blocks as they are at this step's end, kept for
        the flush that writes the step's rows, now or later (False: they could not be, so the step
        is flushed now). Under the flush lock: the flusher thread's flush reads and clears them."""
        if not self._keeps_step_facts():
            return False
        if self.labeler is None and self.modules is None:
            return True
        try:  # (under the flush lock, step())
            if self.labeler is not None:
                self.labeler.at_step_end()
            if self.modules is not None:
                self._modules_at_step_end()
            return True
        except Exception as e:
            log.warning("owner labels at a step end: %s; flushed now", _why(e))
            return False

    def _modules_at_step_end(self):
        """The owning modules of the live blocks as they are now (ModuleTracker.at_step_end)."""
        self.modules.at_step_end(owned_known=getattr(self.labeler, "owned", None) is not None, labeler=self.labeler)

    def _flush_waiting(self):
        """The flusher thread: a step boundary that waits is in the dump within STEP_FLUSH_S or
        so, also when the program goes quiet (or is killed) after it. It flushes only once no
        boundary came for STEP_FLUSH_S: while they come, the program's own thread flushes at the
        first one past the time, so the flush does not pass the GIL between threads (on the tiny
        GPT-2 the main thread waited ~0.9 ms a step for it, BENCHMARKS.md eighteenth session)."""
        pid, nap = self.pid, self._step_flush_ns / 1e9
        while not self.closed and os.getpid() == pid:
            time.sleep(nap)
            if time_ns() - self._last_wait_ns >= self._step_flush_ns:
                try:
                    self.flush_waiting()
                except Exception as e:  # never a traceback from our thread
                    log.error("flushing a step boundary: %s", _why(e))

    def flush_waiting(self):
        """Flush now if a step boundary's flush waits (nothing otherwise): the flusher thread, and
        analysis.checkpoint before it saves."""
        if self._ended_unflushed is not None:
            self.flush()

    def _device_step_end(self, ended, into=None):
        # the device's own figures at a step end (a held step 1: taken when it is settled), as
        # rows appended to ``into`` (the buffer unless given)
        if self.device_source is not None:
            self.device_source.at_step_end(self.buf if into is None else into, ended)

    def _facts_at_hold(self):
        """The source's rows in the buffer, and the owners and owning modules of the live blocks as
        they are at a held boundary (not at its release: by then zero_grad has freed the step's
        gradients, which then kept only the module running when they were made; under
        torch.compile the compiled module as a whole, not their layer). Under the flush lock."""
        self.sync_sources()
        if self.labeler is not None:
            self.labeler.before_flush()
        if self.modules is not None:
            try:
                self._modules_at_step_end()
            except Exception as e:
                log.warning("owning modules at a held step end: %s", _why(e))

    def _hold_later(self, held, tid):
        """An optimizer step while step 1's boundary is held, on a thread that has not stepped twice:
        its rows (the device's figures, its STEP row) go to the end of the buffer now, numbered as
        they stay if the optimizer steps turn out to be the steps; a ``msmemscope.step()`` takes
        them out with step 1's."""
        self._facts_at_hold()
        ended = self.step_no
        rows = self._boundary_rows(ended, time_ns(), tid)
        self.buf.extend(rows)
        held.later.append((ended, rows))
        self.step_no += 1
        self._update_flags()

    def _flush_held_later(self, held, flush):
        """After step 1's rows: each later held boundary's rows flushed (``flush``) through its STEP
        row, so that every analysis is told of each step's end where it was."""
        for ended, rows in held.later:
            if any(r is rows[-1] for r in self.buf):
                flush(step_end=ended, drain=False, through=rows[-1])

    def _release_held_step(self):
        """The program's steps are its optimizer steps: step 1 ended at the first one."""
        if self._held_step is None:
            return
        # under the flush lock, so that no flush of another thread (a source past FLUSH_ROWS, the
        # flusher) comes between the count taken at the hold and the flush of step 1's rows
        with self.flush_lock:
            held, self._held_step = self._held_step, None
            if held is None:
                return
            self._optimizer_steps = True
            self.sync_sources()
            cut = self._place_held_cut(held)
            if cut is None or not any(r is cut[-1] for r in self.buf):
                # a flush wrote past its place: the boundary is written now, before the later ones
                cut = self._held_cut(held)
                first = held.later[0][1][0] if held.later else None
                at = next((i for i, r in enumerate(self.buf) if r is first), len(self.buf))
                self.buf[at:at] = cut
                self.pieces.clear()
            # step 1's rows and its boundary are flushed alone, so that the analyses see the end
            # of step 1 where it was; the rows since then stay in the buffer, and so do the rows
            # a drain inside this flush adds after them (the owner labeller's). (With --steps=1
            # those rows stay in the dump, labelled step 2: dropping them could leave a later
            # FREE without its MALLOC.) Up to the STEP row itself, not a count: a drain that
            # merges by time (a device source, the native source after a handover) may put
            # rows before it
            self.flush(step_end=1, drain=False, through=cut[-1])
            self._flush_held_later(held, self.flush)
        self._update_flags()

    def _place_held_cut(self, held):
        """The rows that end a held step 1, in the buffer where the boundary happened (put there
        once); None where a flush since the hold wrote past that place."""
        if held.cut is None:
            if held.flushes != self._flushes or held.idx > len(self.buf):
                return None
            held.cut = self._held_cut(held)
            self.buf[held.idx:held.idx] = held.cut
            self.pieces.clear()  # their positions moved: these rows are marshalled at the flush
        return held.cut

    def _held_cut(self, held):
        """The rows that end a held step 1."""
        return self._boundary_rows(1, held.ts, held.tid)

    def _boundary_rows(self, step, ts, tid):
        """The rows that end ``step`` where its boundary is held: the device's figures, then its STEP row."""
        rows: list = []
        self._device_step_end(step, into=rows)
        rows.append((Event.SYSTEM, System.STEP, NA, ts, tid, self.op_device, None, {"step": step}, None, None))
        return rows

    def _flush_around_held(self, drain):
        """A flush while step 1's boundary is held (the buffer passed FLUSH_ROWS: a first step of
        more rows than that, or an analysis's flush: OOM). The boundary's rows go into the buffer
        where it happened and only the rows before them are written: whether it stays (optimizer
        steps) or goes (the program numbers its steps) is still open. When no row is left before
        it and the buffer is full (FLUSH_ROWS rows of the program since its first optimizer step
        and no ``msmemscope.step()``), its steps are taken to be its optimizer steps, so that the
        buffer stays bounded (a ``msmemscope.step()`` later then ends step 2)."""
        held = self._held_step
        if drain:  # the source's records in the buffer: its length below is the rows waiting
            self.sync_sources()
        cut = self._place_held_cut(held)
        if cut is None:  # a flush wrote past its place: the release writes it at the end
            self._flush(None, drain)
            return
        if self.buf and self.buf[0] is cut[0]:
            if len(self.buf) < self.flush_rows // 2:  # nothing to write before it, and room left
                return
            log.warning("step 1 ends at the first optimizer step: %d rows went by after it and no "
                        "msmemscope.step() came", len(self.buf) - len(cut))
            self._held_step = None
            self._optimizer_steps = True
            self._flush(step_end=1, drain=drain, through=cut[-1])
            self._flush_held_later(held, self._flush)
            self._flush(None, drain=False)
            self._update_flags()
        else:
            self._flush(None, drain, before=cut[0])

    def _bound_drain(self):
        """Rows kept in the buffer past a flush count against the native source's next drain."""
        if self.native is not None:
            self.native.set_drain_at(self.flush_rows - len(self.buf))

    def op_failed(self, name, exc):
        from .snapshot import is_allocation_failure, take_snapshot
        if is_allocation_failure(exc):
            # a failure passes every op level it unwinds through (a composite op, the op inside it):
            # handled at the first. Known by its id and its args tuple, which is held: an id alone
            # is the next failure's once this exception is freed (a program that catches an OOM and
            # tries again), and holding the exception would keep its frames' tensors alive
            args = exc.args
            seen = self._failure_seen
            if args and seen is not None and seen[0] == id(exc) and seen[1] is args:
                return
            self._failure_seen = (id(exc), args)
            take_snapshot(name="OOM_Snapshot")  # the state at the failure, whatever analyses are on
        for s in self.sinks:
            fn = getattr(s, "op_failed", None)
            if fn is not None:
                fn(self, name, exc)

    # ------------------------------------------------------------------ flushing
    def flush(self, step_end=None, drain=True, through=None):
        """Write the buffered rows (up to the row ``through`` only: a held step 1's) and tell the sinks."""
        with self.flush_lock:
            if self._flushing == threading.get_ident():  # a signal handler inside this thread's flush
                return
            self._flushing = threading.get_ident()
            try:
                if through is None and self._held_step is not None:
                    self._flush_around_held(drain)
                else:
                    self._flush(step_end, drain, through)
                self._bound_drain()
            finally:
                self._flushing = None
            if self._pending_signal is not None:
                signum, self._pending_signal = self._pending_signal, None
                self._on_sigterm(signum, None)

    def _flush(self, step_end=None, drain=True, through=None, before=None):
        # a step boundary whose flush waited is flushed now: the analyses' step_end holds for it
        # and every one before (batch_steps), so the last boundary is the one they are told of
        waited, self._ended_unflushed = self._ended_unflushed, None
        steps, self._steps_waiting = self._steps_waiting + (step_end is not None), 0
        if step_end is None:
            step_end = waited
        if self.closed or self.failure is not None:
            self.buf.clear()
            self.pieces.clear()
            return
        # a steady loop's flush: the native source's records go to the writer as its bytes and to the
        # sinks as columns, with no row tuple made (PackedRows); any other flush drains them into tuples
        packed, labelled = None, False
        if drain and through is None and before is None:
            if self._labels_at_drain():  # (the labels given as the records are taken, packed or drained)
                packed, labelled = self._drain_labelled(packed_ok=True), True
            else:
                packed = self._take_packed()
        if packed is not None:
            rows, n, pieces = packed, len(packed), [packed.blob]
            self._packed_flushes += 1
        else:
            rows, n, pieces = self._flushed_rows(drain, through, before, labelled)
        self._flushes += 1
        if steps and n:
            # the frame's rows a step (the last flush's most: a step's rows vary little in a loop)
            self._rows_per_step = n / steps
        first = self.next_id + 1
        self.next_id += n
        if rows:
            try:
                c_syms = self._symbolize(rows) if self.c_depth else None
                self.writer.write(rows, first, self.pid, c_syms, pieces)
            except Exception as e:  # the disk is full, the folder went away: the tool's failure
                self._tool_failed("cannot write the dump", e)
                return
            except BaseException:
                # interrupted inside the write (KeyboardInterrupt, or SystemExit raised by the
                # program's own signal handler): the rows are out of the buffer, so write them
                # now unless they reached the file, then let the exception go on
                try:
                    if self.writer.last_id() < first:
                        self.writer.write(rows, first, self.pid, None)
                except Exception:
                    pass
                raise
        for s in list(self.sinks):
            try:
                if rows:
                    if packed is not None:
                        s.consume_packed(rows, first)
                    else:
                        s.consume(rows, first)
                if step_end is not None:
                    s.step_end(self, step_end)
            except Exception as e:  # an analysis's failure never reaches the program
                self._sink_failed(s, e)
        self._last_flush_ns = time_ns()

    def _flushed_rows(self, drain, through, before, labelled=False):
        """The rows this flush writes, taken out of ``buf`` (all, or up to the row ``through``, or
        those before the row ``before``), with the owner labels and modules given (``labelled``:
        given already, by ``_drain_labelled``); and their pieces for the hand-off (``_pieces_of``)."""
        if not labelled:
            if drain and self._labels_at_drain():
                self._drain_labelled()
            else:
                self._label_drained(drain)
        n = len(self.buf)
        if through is not None:
            n = next((i + 1 for i, r in enumerate(self.buf) if r is through), n)
        elif before is not None:
            n = next((i for i, r in enumerate(self.buf) if r is before), n)
        rows = self.buf[:n]
        del self.buf[:n]
        return rows, n, self._pieces_of(rows)

    def _label_drained(self, drain):
        """Labels given after the drain: the records drained into tuples (``drain``), then the owner
        labeller's and module attribution's row passes rewrite the MALLOC rows of ``buf``. (Drained
        before the labels are given, not after: a MALLOC another thread records between the
        labeller's pass and a later drain would be written without its owner label.)"""
        if drain:
            self.sync_sources()
        if self.labeler is not None:
            try:
                self.labeler.before_flush()
            except Exception as e:  # the rows are written with the labels they have
                log.warning("owner labels at a flush failed: %s", _why(e), exc_info=True)
        if self.device_source is not None:
            self.device_source.drain_into(self.buf, flushing=True)
        lab = self.labeler
        owner_rows = lab.take_owner_rows() if lab is not None else ()  # taken with module attribution off too
        if self.modules is not None:
            try:  # the module each MALLOC row was made in, from the marks (nothing per allocation before)
                self.modules.attribute(self.buf, lab.take_owned() if lab is not None else None, owner_rows)
            except Exception as e:
                log.warning("module attribution failed: %r", e)

    def _labels_at_drain(self) -> bool:
        """Whether the owner labels and modules go to the native source's rows as it drains them
        (``_drain_labelled``): it follows the ops, the native labeller (or none) and the C++ module
        marks (or none) give them, and no device source drains beside it."""
        lab, mods = self.labeler, self.modules
        return (_LABELS_AT_DRAIN and self.native is not None and self.native_ops and self.device_source is None
                and (lab is not None or mods is not None)
                and (lab is None or getattr(lab, "labels_at_drain", False)) and (mods is None or mods.labels_at_drain()))

    def _drain_labelled(self, packed_ok=False):
        """A flush's drain with the labels given in C++ as the rows are made (no row rewritten, and
        the drain's marshal bytes go to the writer as they are): the labeller walks, then the module
        tracker answers, the rows already waiting in the buffer are relabelled as tuples, and the
        native source drains with both; the OWNER rows the labeller then writes (and the rows their
        own drain brings) get their modules as tuples. With ``packed_ok``, where no row waits and no
        OWNER row is to follow (``settled``), the records are taken with their labels as a
        ``PackedRows`` (no row tuple: ``_take_packed``), which is returned; else None (the rows are
        in ``buf``)."""
        lab, mods = self.labeler, self.modules
        if self.buf:
            self.pieces.clear()  # rows waiting may be rewritten: no piece stands for them
        done, took = [], []

        def drain(owners, in_buf, relabel_waiting=None, settled=False):
            spec = None
            if mods is not None:
                try:
                    spec = mods.spec()
                except Exception as e:
                    log.warning("module attribution failed: %r", e)
            if relabel_waiting is not None:
                relabel_waiting()
            if spec is not None and self.buf:
                mods.attribute_rows(self.buf, spec)
            labels = (owners, spec, in_buf)
            self._labelled_flushes += owners is not None or spec is not None
            if packed_ok and settled and not self.buf and (mods is None or spec is not None):
                packed = self._take_packed(labels)
                if packed is not None:
                    took.append(packed)
                    done.append((spec, len(self.buf), packed.attributed))
                    return packed.last_aid
            # (a failure here leaves the records in the source: drained below without labels)
            attributed, last = self.sync_sources(labels)
            done.append((spec, len(self.buf), attributed))
            return last

        if lab is not None:
            try:
                lab.before_flush(drain)
            except Exception as e:  # the rows are written with the labels they have
                log.warning("owner labels at a flush failed: %s", _why(e), exc_info=True)
        if not done:  # no labeller, or it failed before its drain
            try:
                drain(None, None, settled=lab is None)
            except Exception as e:
                log.warning("module attribution failed: %r", e)
                self.sync_sources()
        owner_rows = lab.take_owner_rows() if lab is not None else ()
        if mods is not None:
            spec, end, attributed = done[-1] if done else (None, 0, 0)
            try:
                if spec is None:
                    self.pieces.clear()  # the rows are rewritten
                    mods.attribute(self.buf, None, owner_rows)
                else:
                    mods.finish(self.buf, spec, owner_rows, end, attributed)
            except Exception as e:
                log.warning("module attribution failed: %r", e)
        return took[0] if took else None

    def _take_packed(self, labels=None):
        """The native source's records as ``PackedRows`` where nothing else is to be flushed and
        nothing rewrites or needs the row tuples: no row waits in ``buf`` (a Python-side row, a drain
        before it), no owner labels or modules (they rewrite MALLOC rows), no device source, no held
        step, no C stacks, a writer process that takes the bytes and sinks that take columns
        (``takes_packed``), each with the columns it reads (``packed_columns``). None: the flush
        drains as ever. With ``labels`` (``_drain_labelled``'s), owner labels and modules are on:
        the records are taken with them."""
        nat = self.native
        if (not _PACKED or nat is None or not self.native_ops
                or (labels is None and (self.labeler is not None or self.modules is not None))
                or self.device_source is not None or self.c_depth
                or self._held_step is not None or not getattr(self.writer, "takes_bytes", bool)()
                or not all(getattr(s, "takes_packed", False) for s in self.sinks)):
            return None
        columns = set()
        for s in self.sinks:
            columns.update(getattr(s, "packed_columns", ()))
        self.dispatch.drain(self.buf)
        packed = nat.take_packed(self.next_id + 1, self.buf, columns, labels)  # None where rows wait in buf
        if packed is not None:
            self.pieces.clear()  # (none can stand for rows of an empty buffer)
            self._native_counters(nat)
        return packed

    def _pieces_of(self, rows):
        """The flushed rows for the hand-off as pieces: the native source's marshal bytes where
        ``rows`` holds, at the noted positions, the very rows they were made with, and lists of the
        other rows between them; None (marshal every row) when any piece does not hold."""
        noted, self.pieces = self.pieces, []
        if not noted:
            return None
        out, pos, n = [], 0, len(rows)
        for start, k, head, tail, blob in noted:
            if start < pos or start + k > n or rows[start] is not head or rows[start + k - 1] is not tail:
                return None
            if start > pos:
                out.append(rows[pos:start])
            out.append(blob)
            pos = start + k
        if pos < n:
            out.append(rows[pos:])
        return out

    def _sink_failed(self, sink, exc):
        if sink in self.sinks:
            self.sinks.remove(sink)
        name = getattr(sink, "name", None) or type(sink).__name__
        log.error("analysis %s failed: %r; its result is not written", name, exc)
        from .._console import alert
        alert(f"[msmemscope] analysis {name} failed ({exc!r}); its result is not written")

    def _tool_failed(self, what, exc):
        """A failure of the tool's own (a write refused: disk full, folder unwritable, I/O error):
        tracing stops, it is said once on stderr and in config.json, what was written stays
        readable, and nothing reaches the program, which runs on."""
        if self.failure is not None:
            return
        reason = f"{what}: {_why(exc)}"
        self.failure = reason
        self.buf.clear()
        self.pieces.clear()
        try:
            self.dispatch.stop()
            if self.native is not None:
                self.native.stop()
            if self.device_source is not None:
                self.device_source.stop()
        except Exception:
            pass
        self.active = False  # the lasting hooks stay, inert (close() removes them)
        self._update_flags()
        try:
            self.writer.abandon()
        except Exception:
            pass
        from ..io.writers import last_id_in
        last = last_id_in(self.dump_path)
        self.config["tool_failure"] = reason
        self.config["rows_kept"] = last
        try:
            self._write_config()
        except Exception:
            pass
        log.error("tracing stopped: %s", reason)
        from .._console import alert
        alert(f"[msmemscope] tracing stopped in process {self.pid}: {reason}. The program runs on; "
              f"{self.dump_path} keeps the rows written before (up to ID {last}).")

    def _symbolize(self, rows):
        raw = [(i, r[C_STACK]) for i, r in enumerate(rows) if r[C_STACK] is not None]
        return dict(zip((i for i, _ in raw), stacks.symbolize_c([x for _, x in raw], self.c_depth)))

    # ------------------------------------------------------------------ life cycle
    def start(self):
        if self.active or self.closed:
            return
        if self._rank_unknown():  # init_process_group imported under another name before we followed it
            try:
                self.joined_process_group()
            except Exception as e:
                log.warning("rank from the process group: %s", _why(e))
        from . import marks
        self.active = True
        self._update_flags()
        self.system(System.START_TRACE)
        if not self.started_once:
            self.started_once = True
            from .eager import arm_api
            arm_api()  # msmemscope.step() and the rest, called from compiled code: eagerly
            from . import on_start
            for fn in list(on_start):  # sinks, framework hooks: registered from outside capture/
                try:
                    fn(self)
                except Exception as e:
                    log.warning("%s: %s", getattr(fn, "__qualname__", fn), e)
            if self.opts.watch is not None or self.watch_engine is not None:
                from .watch import attach
                attach(self)
            marks.install(self)
            if "kernel" in self.opts.level:
                why = ("a CPU runs no device kernels" if self.kind == "cpu"
                       else "kernel launches are not captured yet; op level only")
                log.warning("--level=kernel: no KERNEL_LAUNCH rows will be written (%s)", why)
                from .._console import say
                say(f"[msmemscope] --level=kernel: no KERNEL_LAUNCH rows will be written ({why})")
            self._install_exit_handlers()
            self._skip_dataloader_workers()
        if self.device_source is not None:
            self.device_source.start()
        from . import modules
        if modules.wanted(self.opts):
            if self.modules is None:
                self.modules = modules.ModuleTracker(self)
            self.modules.install()  # global module hooks, removed at stop()
        if self.labeler is not None:
            self.labeler.resume()
        self.source.start()  # its flags were set by _update_flags() above
        if not self._lasting_hooks:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            from .eager import eager_or_skipped
            self._lasting_hooks.append(register_optimizer_step_post_hook(eager_or_skipped(self._optimizer_stepped)))
        if "traceback" in self.opts.events:  # the original's Python trace (capture/pytrace.py)
            from . import pytrace
            pytrace.tracer_for(os.path.dirname(self.dump_path)).start()
        log.info("trace started")

    def stop(self, sync: bool = True):
        if not self.active:
            return
        self._release_held_step()
        if "traceback" in self.opts.events:
            from . import pytrace
            t = pytrace.current()
            if t is not None:
                t.stop()
        self.dispatch.stop()
        if self.device_source is not None:
            self.device_source.stop()
        for fn in self._stop_hooks:
            fn()
        if self.modules is not None:
            self.modules.remove()
        if self.labeler is not None:
            self.labeler.pause()
        # nothing new is recorded from here; frees of the blocks in the dump are, flagged
        self.active = False
        self._update_flags()
        if self.native is not None:
            self.native.stop(gap=not self._closing)  # ops in flight get their OP_END now
        self.system(System.STOP_TRACE)
        try:
            self.flush()
        except Exception as e:  # (a failure of ours never reaches the program's stop())
            self._tool_failed("cannot write the dump", e)
        if sync and not self.closed and self.failure is None:
            try:
                self.writer.sync()  # the dump is complete on disk when stop() returns: the program may read it
            except Exception as e:
                self._tool_failed("cannot finish the dump", e)
        log.info("trace stopped (%d flushes so far, %d of them of native records with no row tuple made, "
                 "%d with the labels given at the drain)", self._flushes, self._packed_flushes, self._labelled_flushes)

    def close(self, exit_code=None):
        """Process exit: stop, write PROC_EXIT, final flush, let the analyses report.

        Runs once: a signal that arrives meanwhile (Pool.terminate()'s SIGTERM, a second Ctrl-C)
        waits for its end and is then delivered as it would have been (``_redeliver``); a
        failure to write stops tracing (``_tool_failed``) and never reaches the program."""
        if self.closed or self._closing or os.getpid() != self.pid:
            return
        self._closing = True
        saved = self._defer_signals()
        try:
            if self.failure is None:
                try:
                    self.stop(sync=False)  # the writer is closed below, after the last rows
                    self.system(System.PROC_EXIT, None if exit_code is None else {"exit_code": exit_code})
                    self.flush()
                    if self.failure is None:
                        self.writer.close()  # the whole dump on disk before an analysis reads or annotates it
                except Exception as e:
                    self._tool_failed("cannot finish the dump", e)
            if self.failure is None:
                for s in self.sinks:
                    try:
                        s.close(self)
                    except Exception as e:  # an analysis must never hide the dump
                        log.error("analysis %s failed: %s", type(s).__name__, e)
        finally:
            self.closed = True
            self.active = False
            self._update_flags()  # the native source records nothing more (frees included)
            _release_compile()
            self._remove_lasting_hooks()
            try:
                self.writer.close()
            except Exception as e:
                log.error("closing the dump: %s", _why(e))
            self.config["end_time"] = _timestamp()
            self.config["events_written"] = self.next_id
            lost = getattr(self.writer, "rows_lost_after", None)
            if lost is not None:  # the writer process was killed: the readers must not expect every row
                self.config["rows_lost_after"] = lost
            try:
                self._write_config()
            except Exception:
                pass
            log.removeHandler(self._log_handler)
            self._log_handler.close()
            try:
                self._name_rank_folder()
            except Exception:
                pass
            self._closing = False
            self._redeliver(saved)

    def _remove_lasting_hooks(self):
        """At close: the torch hooks kept over stop/start gaps go (a daemon thread still in an
        optimizer step now could see its hook dict change; no other time is safer)."""
        hooks, self._lasting_hooks = self._lasting_hooks, []
        for h in hooks:
            try:
                h.remove()
            except Exception:
                pass
        if self.modules is not None:
            try:
                self.modules.close()
            except Exception as e:
                log.error("removing the module hooks: %s", _why(e))

    def _defer_signals(self):
        """While close() runs (main thread only), SIGINT and SIGTERM are noted, not acted on: a
        KeyboardInterrupt inside it would lose the analyses or write rows twice, and a SIGTERM
        handler that closes again would wait on the writer process it is already waiting on."""
        saved = {}
        if threading.current_thread() is not threading.main_thread():
            return saved
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                old = signal.getsignal(signum)
                if old in (signal.SIG_IGN, None):
                    continue
                if signum == signal.SIGTERM and old not in (signal.SIG_DFL, self._on_sigterm):
                    continue  # the program's own SIGTERM handler stays the program's
                saved[signum] = old
                signal.signal(signum, lambda n, f: self._deferred.append(n))
            except (ValueError, OSError):
                pass
        return saved

    def _redeliver(self, saved):
        for signum, old in saved.items():
            try:
                signal.signal(signum, old)
            except (ValueError, OSError):
                pass
        pending, self._deferred = self._deferred, []
        for signum in dict.fromkeys(pending):
            old = saved.get(signum, signal.SIG_DFL)
            if old is signal.default_int_handler or old in (signal.SIG_DFL, self._on_sigterm):
                # the program would have died of it: it does now, its output flushed first
                for f in (sys.stdout, sys.stderr):
                    try:
                        f.flush()
                    except Exception:
                        pass
                signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _install_exit_handlers(self):
        if self._exit_installed:
            return
        self._exit_installed = True
        atexit.register(self.close)
        os.register_at_fork(after_in_child=self._after_fork_child)
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread
            pass
        real_exit = os._exit

        def _exit(code):
            try:
                self.close(exit_code=code)
            except Exception:
                pass
            real_exit(code)
        os._exit = _exit

    def _skip_dataloader_workers(self):
        """DataLoader workers are not traced unless MSMEMSCOPE_TRACE_WORKERS is set.

        Forked workers are cut off at fork; spawned ones start a session of their
        own at ``import torch``, which is discarded when the worker loop begins. With
        MSMEMSCOPE_TRACE_WORKERS=1 a spawned worker keeps its session, and its config.json says
        ``"role": "dataloader_worker"`` (with ``worker_id``) so that it is not taken for a rank."""
        trace = os.environ.get("MSMEMSCOPE_TRACE_WORKERS") not in (None, "", "0")
        try:
            import torch.utils.data._utils.worker as worker
        except Exception:
            return
        if getattr(worker._worker_loop, "_msmemscope", False):
            return
        orig = worker._worker_loop
        session = self

        @functools.wraps(orig)
        def _worker_loop(*a, **k):
            if session.pid == os.getpid() and not session.closed:
                if not trace:
                    session.discard()
                else:
                    try:
                        session.config["role"] = "dataloader_worker"
                        session.config["worker_id"] = k.get("worker_id", a[10] if len(a) > 10 else None)
                        session._write_config()
                    except Exception:
                        pass
            return orig(*a, **k)
        _worker_loop._msmemscope = True
        worker._worker_loop = _worker_loop

    def discard(self):
        """Stop tracing this process and remove what it wrote."""
        import shutil
        self.dispatch.stop()
        if self.native is not None:
            self.native.stop()
        self.active = False
        self.closed = True
        self._update_flags()
        _release_compile()
        self.buf = []
        self.pieces = []
        self.writer.abort()
        log.removeHandler(self._log_handler)
        self._log_handler.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _on_sigterm(self, signum, frame):
        if self._closing:  # close() runs in another thread: it delivers the signal at its end
            self._deferred.append(signum)
            return
        if self._flushing == threading.get_ident():
            # arrived while this thread writes a batch: finish that batch first (flush ends by
            # calling us again), so no row taken from the buffer is lost and IDs stay contiguous
            self._pending_signal = signum
            return
        try:
            self.close(exit_code=128 + signum)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _after_fork_child(self):
        # A forked child (DataLoader worker) is not traced: it must not write into the parent's dump.
        # A lock of ours that another thread of the parent held at the fork stays held in the child
        # for good: a child calling msmemscope.step() (or an optimizer hook there) hung on it
        for lock in self._locks():
            try:
                lock._at_fork_reinit()
            except Exception:
                pass
        self.active = False
        self.closed = True
        self.buf = []
        self.pieces = []
        self._update_flags()
        self.writer.forget()  # the parent's writer process is the parent's

    def _locks(self):
        """Every Python lock of the session and its parts (the native source's are C++: pthread_atfork)."""
        yield self.lock
        yield self.flush_lock
        for part, name in ((self.watch_engine, "lock"), (self.modules, "lock"), (self.device_source, "_lock")):
            lock = getattr(part, name, None)  # (None for a part not made)
            if lock is not None:
                yield lock
        owners = sys.modules.get("msmemscope.capture.owners")
        if owners is not None:
            yield owners._labels_lock
        pytrace = sys.modules.get("msmemscope.capture.pytrace")
        tracer = pytrace.current() if pytrace is not None else None
        if tracer is not None:
            yield tracer.lock


# The ways into the session from inside the program's code: a compiled function (torch.compile)
# can be running when the native source's op exit asks for a flush, a signal arrives or a hook
# ends a step. Dynamo would try to compile our frames there (warnings on the program's stderr,
# compile time, graphs of our code); these and all they call run as plain Python instead.
for _fn in (Session._source_full, Session.flush, Session.step, Session._optimizer_stepped, Session.stop, Session.close,
            Session._on_sigterm):
    keep_dynamo_out(_fn.__code__)
del _fn
