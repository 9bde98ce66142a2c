"""The native capture source (``_native.cpp``): default events recorded in C++.

Built once per torch/Python/source version into the user's cache and loaded from there
without a compiler: on the first run that can use it (``ensure_built``: one line says so; a
lock makes one process of a multi-rank start build while the others wait a bounded time; a
machine without a C++ compiler or ninja, or a build that failed once, falls back at once), or
ahead of time with ``python -m msmemscope.capture.native build`` (``make`` does it).
``MSMEMSCOPE_NATIVE_BUILD=0`` turns the build on first use off.

It records access events (inputs and outputs of each top-level op, READ/WRITE from the op's
schema) and Python call stacks (interned in C++) when asked; ``--analysis=decompose`` labels its
blocks by data pointer (``owners.NativeLabeler``). When it is not built, or the run needs what
only the dispatch-mode source sees (C call stacks, watch, the OOM analysis's op failures, FSDP2's
storages in a distributed decompose, framework-hook labels without decompose, an accelerator),
the session uses the dispatch-mode source (``ops.py``); ``MSMEMSCOPE_SOURCE=python``
forces that, ``MSMEMSCOPE_SOURCE=native`` makes a run that cannot use it say why.
"""
from __future__ import annotations

import hashlib
import heapq
import importlib.util
import logging
import os
import sys

import torch

from .. import leak_native
from ..events import NA, PACKED_CHUNK, PACKED_LEAK, TS, UNTRACED, Access, Event, Op, PackedRows, Pool, System
from . import stacks
from .source import ALLOC_FAILED, Source

log = logging.getLogger("msmemscope")
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "_native.cpp")
_NAMES = (Event.OP_LAUNCH, Op.START, Op.END, Event.MALLOC, Event.FREE, Pool.PTA, "cpu", NA, ALLOC_FAILED,
          UNTRACED, Event.ACCESS, Access.READ, Access.WRITE, "origin", "before_op", Event.SYSTEM, System.STEP,
          "step")


# the leak rule's C++ source (msmemscope/_leakrule.cpp) is built with this one: a change to it is a
# new key, so the build on first use makes both
LEAK_RULE_SOURCE = os.path.join(os.path.dirname(HERE), "_leakrule.cpp")


def _key() -> str:
    h = hashlib.sha256()
    for path in (SOURCE, LEAK_RULE_SOURCE):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def module_name() -> str:
    return f"msmemscope_native_{_key()}"


def build_dir() -> str:
    return os.path.join(leak_native.cache_root(), module_name())


def _so_path() -> str:
    return os.path.join(build_dir(), module_name() + ".so")   # the name torch's builder gives it


def build(verbose: bool = False) -> str:
    """Compile the source (needs a C++ compiler and ninja); returns the module's path."""
    from torch.utils.cpp_extension import load
    import threading
    d = build_dir()
    os.makedirs(d, exist_ok=True)
    # the leak rule's C++ module (no torch in it: the offline replay loads it too) compiles beside it,
    # on the other core: each is one compiler process, and a fresh machine waits on both
    leak: list = []

    def build_leak_rule():
        try:
            leak.append(leak_native.build())
        except Exception as e:  # said below as one warning line, never a thread's traceback
            leak.append(f"its build failed: {e!r}")
    t = threading.Thread(target=build_leak_rule, name="msmemscope-leakrule-build", daemon=True)
    t.start()
    try:
        mod = load(module_name(), [SOURCE], build_directory=d, extra_cflags=["-O2"], verbose=verbose)
    finally:
        t.join()
    why = leak[0] if leak else None
    if why is not None:
        log.warning("the leak rule's C++ module was not built (%s): its Python loop is used", why)
    return mod.__file__


_module = None
_why_not = None


BUILD_ENV = "MSMEMSCOPE_NATIVE_BUILD"            # "0": no build on first use
BUILD_TIMEOUT_ENV = "MSMEMSCOPE_NATIVE_BUILD_TIMEOUT"  # seconds a build (or a wait for one) may take
DEFAULT_BUILD_TIMEOUT = 600.0
FAILED = "build-failed.txt"  # in the build folder: a build failed for this key; not tried again


def _build_timeout() -> float:
    try:
        return max(1.0, float(os.environ.get(BUILD_TIMEOUT_ENV) or DEFAULT_BUILD_TIMEOUT))
    except ValueError:
        return DEFAULT_BUILD_TIMEOUT


def cannot_build() -> str | None:
    """Why this machine cannot build the source now (checked in milliseconds), or None."""
    import shutil
    if os.environ.get(BUILD_ENV, "").strip().lower() in ("0", "no", "off", "false"):
        return f"{BUILD_ENV}=0"
    cxx = os.environ.get("CXX") or "c++"
    if not shutil.which(cxx.split()[0] if cxx.split() else "c++"):
        return f"no C++ compiler ({cxx}) on PATH"
    if not shutil.which("ninja"):
        try:
            import ninja  # noqa: F401  (the pip package puts its binary on PATH only in its own venv)
        except ImportError:
            return "no ninja on PATH (pip install ninja)"
    failed = os.path.join(build_dir(), FAILED)
    if os.path.exists(failed):
        return f"building it failed before (see {failed}; delete it to try again)"
    return None


def ensure_built() -> str | None:
    """Build the source on first use, once per key, if this machine can: returns why it is still not
    there, or None once it is. One process builds under an exclusive lock on the build folder; one
    that finds the lock taken (another rank building) waits for it at most the build timeout, then
    falls back. A failed build leaves ``build-failed.txt`` so later runs do not wait for it again."""
    import fcntl
    import subprocess
    import time
    from .._console import say
    path = _so_path()
    if os.path.exists(path):
        return None
    why = cannot_build()
    if why:
        return why
    d = build_dir()
    try:
        os.makedirs(d, exist_ok=True)
        lock = open(os.path.join(d, ".build.lock"), "a")
    except OSError as e:
        return f"cannot write the build folder {d} ({e.strerror})"
    with lock:
        deadline = time.monotonic() + _build_timeout()
        waited = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if not waited:
                    say(f"[msmemscope] waiting for another process building the native source (at most "
                        f"{_build_timeout():.0f} s; {BUILD_TIMEOUT_ENV} sets it)")
                    waited = True
                if time.monotonic() > deadline:
                    return "another process is still building the native source"
                time.sleep(0.25)
        if os.path.exists(path):
            return None  # the other process built it
        if os.path.exists(os.path.join(d, FAILED)):
            return cannot_build()
        say(f"[msmemscope] building the native source once for torch {torch.__version__} and Python "
            f"{sys.version.split()[0]} (about a minute; cached in {d})")
        root = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MSMEMSCOPE_") or k in (
            "MSMEMSCOPE_NATIVE_DIR",)}
        env.pop("PYTHONPATH", None)  # the launcher's bootstrap would trace the compiler's Python
        code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from msmemscope.capture import native; print(native.build())")
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, "-c", code, root], env=env, capture_output=True, text=True,
                               timeout=max(1.0, deadline - time.monotonic()), stdin=subprocess.DEVNULL)
            ok, detail = r.returncode == 0 and os.path.exists(path), (r.stdout + r.stderr)[-4000:]
        except (OSError, subprocess.TimeoutExpired) as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        if ok:
            say(f"[msmemscope] native source built in {time.monotonic() - t0:.0f} s")
            return None
        try:
            with open(os.path.join(d, FAILED), "w") as f:
                f.write(detail)
        except OSError:
            pass
        say(f"[msmemscope] the native source could not be built (details: {os.path.join(d, FAILED)}); "
            "this run and later ones use the dispatch-mode source")
        return "building it failed"


def load_module():
    """The built module, or None (``why_not()`` says why). Builds it on first use where it can
    (``ensure_built``)."""
    global _module, _why_not
    if _module is not None or _why_not is not None:
        return _module
    path = _so_path()
    if not os.path.exists(path):
        why = ensure_built()
        if why is None and os.path.exists(path):
            return _load(path)
        _why_not = (f"the native source is not built for this torch and Python ({why}; "
                    "python -m msmemscope.capture.native build)")
        return None
    return _load(path)


def load_built():
    """The module where it is built already, else None: never builds (the analysis folds and the
    module attribution use it when it is there; a run on the dispatch-mode source does not wait
    for a build for them)."""
    if _module is not None or _why_not is not None:
        return _module
    path = _so_path()
    return _load(path) if os.path.exists(path) else None

def _load(path):
    global _module, _why_not
    try:
        spec = importlib.util.spec_from_file_location(module_name(), path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:  # a broken or foreign build: the dispatch-mode source still works
        _why_not = f"the native source at {path} cannot be loaded: {e}"
        return None
    _module = mod
    return mod


def why_not() -> str | None:
    return _why_not


DISTRIBUTED_DECOMPOSE = "owner labels of a distributed run (FSDP2 storages) need the dispatch-mode source"


def process_group() -> tuple:
    """(rank, world size) of torch.distributed's default process group once the program has set it
    up, else (None, None). Never imports torch.distributed (``sys.modules`` only)."""
    td = sys.modules.get("torch.distributed")
    try:
        if td is not None and td.is_available() and td.is_initialized():
            return int(td.get_rank()), int(td.get_world_size())
    except Exception:
        pass
    return None, None


def world_size() -> int | None:
    """The job's world size: ``WORLD_SIZE`` (torchrun), else the process group's (ranks given their
    rank and world size in code: torch.multiprocessing.spawn), else None."""
    v = os.environ.get("WORLD_SIZE")
    if v is not None and v.isdigit():
        return int(v)
    return process_group()[1]


def unsupported_by(opts, kind: str, launched: bool = True) -> str | None:
    """Why a run with these options cannot use the native source, or None when it can.
    ``launched``: under the launcher, the allocator wrapper is in place before the program makes
    its first tensor; a deferred Python-API session starts it at ``start()``, after the model exists."""
    ev = opts.effective_events()
    if kind != "cpu":
        return f"the device is {kind} (the native source wraps the CPU allocator only)"
    from .backends import available_accelerator
    acc = available_accelerator()
    if acc is not None:
        return f"a {acc} device is present (the native source wraps the CPU allocator only)"
    if not launched and opts.collect_mode != "immediate" and ("access" in ev or "decompose" in opts.analysis):
        # the blocks made before a deferred start() (the model) are only found by their storages
        # (immediate: the session starts at config(), before the program's tensors, as under the launcher)
        return "access events and owner labels of a Python-API session need the dispatch-mode source"
    if opts.c_stack:
        return "C call stacks are taken by the dispatch-mode source"
    if opts.watch is not None:
        return "--watch needs the dispatch-mode source"
    if "oom" in opts.analysis:
        return "--analysis=oom hooks op failures through the dispatch-mode source"
    if "decompose" in opts.analysis and (world_size() or 1) > 1:
        # FSDP2's unsharded parameters live only inside a step, in storages it resizes: their
        # labels are caught through the storages. A rank that learns its world size only at
        # init_process_group (torch.multiprocessing.spawn) hands over there (Session.joined_process_group)
        return DISTRIBUTED_DECOMPOSE
    if "msmemscope.integrations" in sys.modules and "decompose" not in opts.analysis:
        return "owner labels of framework hooks need the dispatch-mode source"
    return None


def _ts(row):
    return row[TS]


class NativeSource(Source):
    """The C++ recorder (``_native.cpp``). It owns its state there: the records not yet drained,
    the side table of the blocks it counted, the CPU pool's bytes in use and peak (the session
    reads them through ``counters()`` and moves them through ``account()``)."""
    name = "native"
    sees = frozenset({"alloc", "free", "launch", "access", "stacks"})
    pool = Pool.PTA

    def __init__(self, mod, flush_rows, on_full, access=False, py_depth=0):
        self.m = mod
        self.on_full = on_full     # called from the op exit (with the GIL) when the records reach drain_at
        self.access = access       # ops' inputs and outputs are looked at (access events)
        self.py_depth = py_depth   # Python frames per stack, 0: none
        self.installed = False
        self.installed_as = None   # (access, py_depth) of the installed hooks
        self.handed_over = False
        self.drain_at = flush_rows  # records at which the op exit asks for a flush (set_drain_at)
        mod.reset()  # the recorder is the process's: a new session starts it clean

    def configure(self, access, py_depth):
        """What the run wants (the session's options, again after a reconfigure)."""
        self.access, self.py_depth = bool(access), int(py_depth or 0)
        if self.installed and self.installed_as != (self.access, self.py_depth):
            self.start()

    def start(self):
        self.m.install(self.drain_at, self.on_full, self.access, self.py_depth, stacks._SKIP[0], stacks._SKIP[1])
        self.installed = True
        self.installed_as = (self.access, self.py_depth)

    def stop(self, gap: bool = False):
        """``gap``: tracing may start again (``Session.stop``): the allocator wrapper stays, recording
        nothing, so that the blocks made meanwhile are counted when a traced op first reads them
        after ``start()``."""
        if self.installed:
            self.m.uninstall(gap)  # ops in flight get their OP_END now
            self.installed = False

    def set_drain_at(self, rows: int):
        """The op exit asks for a flush once this many records wait (fewer than the session's bound
        while it keeps rows in its buffer past a flush: a held step 1's)."""
        rows = max(1, int(rows))
        if rows != self.drain_at:
            self.drain_at = rows
            self.m.set_drain_at(rows)

    def set_flags(self, f):
        self.m.set_flags(f.recording, f.count, f.alloc, f.free, f.free_untraced, f.launch, f.access)

    def drain(self, buf: list, pieces: list | None = None) -> int:
        """Append the records as raw rows; returns how many failed-allocation markers
        (``ALLOC_FAILED`` rows: the session makes OOM snapshots of them) are among them. With
        ``pieces`` (a list), the rows are also made as marshal bytes, noted there as
        ``(position in buf, count, first row, last row, bytes)`` (the session's hand-off)."""
        return self._drain(buf, pieces, None)[0]

    def drain_labelled(self, buf: list, pieces: list | None, labels) -> tuple:
        """``drain`` with the MALLOC rows made with their owner labels and modules (``labels``: the
        spec ``Session._drain_labelled`` makes). Returns (failed-allocation markers, rows given a
        module, the last allocation id when the records were taken: every block up to it has its
        MALLOC row drained)."""
        return self._drain(buf, pieces, None if self.handed_over else labels)

    def _drain(self, buf, pieces, labels):
        if self.handed_over:
            # only FREE rows of the blocks counted here (and OP_END of ops closed at the
            # handover): merged by time with the dispatch-mode source's rows (account() gave those
            # their times from the same clock and lock)
            rows: list = []
            _, failed, _ = self.m.drain(rows, _NAMES)
            if rows:
                buf[:] = heapq.merge(buf, rows, key=_ts)
                if pieces is not None:
                    pieces.clear()  # the buffer's rows moved: no piece stands for its rows any more
            return failed, 0, None
        if pieces is None and labels is None:
            return self.m.drain(buf, _NAMES)[1], 0, None
        start = len(buf)
        got = self.m.drain(buf, _NAMES, pieces is not None, labels)
        n, failed, blob = got[:3]
        attributed, last = got[3:] if labels is not None else (0, None)
        if pieces is None:
            return failed, attributed, last
        if blob is not None and n and len(buf) == start + n:
            # these rows as marshal bytes (made in C++ from the same records): the hand-off sends
            # them as they are if the buffer still holds these rows there at the flush. Another
            # thread may have appended to or flushed the buffer around this drain (it holds the
            # GIL, not the flush lock): then no piece, and these rows are marshalled one by one
            try:
                pieces.append((start, n, buf[start], buf[start + n - 1], blob))
            except IndexError:
                pass
        return failed, attributed, last

    def take_packed(self, first: int, buf: list, columns=(PACKED_LEAK,), labels=None):
        """The records as a flush's ``PackedRows`` (no row tuple made; IDs from ``first``) with the
        ``columns`` asked for (PACKED_LEAK, PACKED_CHUNK), or None where they must be drained into
        tuples (``drain``): rows wait in ``buf`` (looked at in the same C++ call as the take:
        another thread's drain cannot come between), no records, one of a kind only ``drain`` makes
        (a failed allocation, an untraced free, a block counted before an op), or after the
        handover. With ``labels`` (``drain_labelled``'s), the MALLOC rows carry their owner labels and
        modules: in the bytes, the leak columns' owners, and ``mods`` (the modules' columns)."""
        if self.handed_over:
            return None
        wants = (1 if PACKED_LEAK in columns else 0) | (2 if PACKED_CHUNK in columns else 0)
        got = self.m.take_packed(first, _NAMES, buf, wants, labels)
        return None if got is None else PackedRows(*got)

    def step_end(self, step: int):
        """Record the end of ``step`` among the records: its SYSTEM/STEP row comes out of a later
        drain where it happened (a step boundary whose flush waits drains nothing)."""
        self.m.step_end(step)

    def counters(self):
        """(bytes in use, peak) of the CPU pool."""
        return self.m.counters()

    def hand_over(self) -> int:
        self.handed_over = True
        self.installed = False
        return self.m.handover()

    def account(self, delta):
        return self.m.account(delta)

    def counted_block(self, addr):
        return self.m.counted_block(addr)

    def live_alloc_ids(self) -> set:
        return self.m.live_alloc_ids()

    def waiting_free_ids(self) -> set:
        """The allocation ids of the FREE records not drained yet (after the handover too)."""
        return self.m.waiting_free_ids()

    def block_ids(self, tensors) -> list:
        """The allocation id of the counted block behind each tensor's storage, or -1 (one C++ call)."""
        return self.m.block_ids(tensors)

    def alloc_id_of(self, st):
        try:
            hit = self.m.counted_block(st.data_ptr())
        except Exception:
            hit = None
        return hit[0] if hit is not None else None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["build"]:
        print("usage: python -m msmemscope.capture.native build", file=sys.stderr)
        return 2
    try:
        path = build(verbose="-v" in argv)
    except Exception as e:
        msg = str(e).strip().splitlines()
        print(f"msmemscope: the native source could not be built ({msg[-1] if msg else type(e).__name__}); "
              "runs will use the dispatch-mode source", file=sys.stderr)
        return 1
    print(f"msmemscope: native source built: {path}")
    lr = leak_native.so_path()
    print(f"msmemscope: the leak rule's C++ module built: {lr}" if os.path.exists(lr) else
          "msmemscope: the leak rule's C++ module was not built: the leak analysis uses its Python loop")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def built_with(name: str):
    """The built native module if it has ``name`` (an analysis fold, ``attribute``) and the native
    folds are wanted (``MSMEMSCOPE_FOLD=python``: the Python ones); None otherwise. Never builds."""
    if os.environ.get("MSMEMSCOPE_FOLD", "").strip().lower() == "python":
        return None
    try:
        mod = load_built()
    except Exception:
        return None
    return mod if mod is not None and hasattr(mod, name) else None
