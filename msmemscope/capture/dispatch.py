"""The dispatch-mode source: an ``OpTracer`` (ops.py) on every traced thread, and the registry
of the blocks it follows.

It sees what only tensor storages tell: every device, ACCESS rows, call stacks, owner labels,
watch. It owns ``live`` (id(storage) -> ``Block``); a block enters it (and the dump, and the
session's count of bytes in use) when an op first shows its storage inside the traced window,
and leaves it when the storage dies (the ``Block`` is the storage's weak reference) or is
resized (``UntypedStorage.resize_``, FSDP's storage games).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from time import time_ns

import torch

from ..events import NA, UNTRACED, Event, Pool, attr_dict
from . import backends, stacks
from .source import SEES, Source

log = logging.getLogger("msmemscope")

_DTYPES: dict = {}


def _dtype_name(dt) -> str:
    n = _DTYPES.get(dt)
    if n is None:
        n = _DTYPES[dt] = str(dt).replace("torch.", "")
    return n


_KIND: dict = {}  # torch.device -> its type: a dict hit costs half of ``device.type``


def _kind_of(dev) -> str:
    k = _KIND[dev] = dev.type
    return k


class Block(weakref.ref):
    """A live memory block (one tensor storage). The block is itself the weak reference to the
    storage whose callback reports the free: one object per block on the hot path, not three."""
    __slots__ = ("key", "alloc_id", "addr", "size", "device", "pool", "step", "op", "ts", "owner", "stack",
                 "native")

    def __new__(cls, storage, on_free, *_):
        return weakref.ref.__new__(cls, storage, on_free)

    def __init__(self, storage, on_free, key, alloc_id, addr, size, device, pool, step, op, ts):
        super().__init__(storage, on_free)
        self.key, self.alloc_id, self.addr, self.size, self.device, self.pool = key, alloc_id, addr, size, device, pool
        self.step, self.op, self.ts = step, op, ts
        self.owner = None
        self.stack = None
        self.native = False  # counted by the native source, whose FREE row reports it


def tool_thread(thread) -> bool:
    """One of the tool's own threads (named msmemscope-*: the step flusher, the columns' catcher)."""
    return thread.name.startswith("msmemscope")


class DispatchSource(Source):
    name = "dispatch"
    sees = SEES

    def __init__(self, session):
        self.s = session
        self.live: dict[int, Block] = {}  # id(storage) -> Block; the storage object lives as long as the memory
        self.next_alloc = 0               # last allocation id given (shared sequence after a handover)
        self.prev = None                  # the source it took over from (its blocks: their frees are its)
        self.recording = False            # ops on traced threads are followed
        self._modes: dict = {}
        self._gone = self._gone           # one bound method for every block's free callback
        # A storage's free callback can run on the thread that is between account() and the append of
        # its row (the garbage collector, a signal handler): that free waits for the row, else the
        # FREE would land before the MALLOC whose ``used`` already counts it.
        self._in_row = None               # the thread inside a row section
        # the ops whose ATEN_START is written and whose ATEN_END is not yet: thread -> [names]. stop()
        # writes their ATEN_END (a SIGTERM handler that ends the run inside an op, another thread's
        # stop()), so a dump never has an op left open; the op's own end then writes none
        self.in_flight: dict = {}
        self._waiting: list = []          # frees that came during it
        self.freeing: set = set()         # allocation ids of the blocks freed whose FREE row is not made yet
        self._row_depth = 0

    # ------------------------------------------------------------------ Source
    def start(self):
        self.recording = True
        install_resize_patch()
        self._install_threads()
        self._push_mode()
        self._follow_running_threads()

    def _follow_running_threads(self):
        """The threads already running get the op tracer too, each at its next Python call (the
        native module's one-shot call on every other thread, where it is built): a handover by
        watch() on one thread left every other thread's ops and new blocks out of the dump.
        Without the native module they are not followed (README)."""
        from . import native
        try:
            mod = native.load_built()  # never builds: loaded already where the native source ran
        except Exception:
            mod = None
        arm = getattr(mod, "on_other_threads", None) if mod is not None else None
        if arm is None:
            return
        try:
            n = arm(self._push_mode_here)
        except Exception as e:
            log.warning("threads already running are not followed: %r", e)
            return
        if n:
            log.info("the op tracer goes on %d thread(s) already running, at their next Python call", n)

    def _push_mode_here(self):
        # on another thread, at its next Python call (never ours: the writer's and the flusher's
        # threads run no op of the program)
        try:
            if self.recording and not self.s.closed and not tool_thread(threading.current_thread()):
                self._push_mode()
        except Exception:
            pass

    def stop(self):
        self.recording = False
        self._pop_mode()
        self.close_in_flight()

    def op_started(self, tid, name):
        self.in_flight.setdefault(tid, []).append(name)

    def op_ended(self, tid) -> bool:
        """The op's ATEN_END is to be written (False: stop() wrote it). Without a lock: each entry is
        taken by one ``list.pop`` (atomic under the GIL), here or in ``close_in_flight``, so its
        ATEN_END is written once."""
        try:
            self.in_flight[tid].pop()
            return True
        except (KeyError, IndexError):
            return False

    def close_in_flight(self):
        """stop(): an ATEN_END now for each op in flight on any thread. The lists stay: an op another
        thread registers meanwhile (after its ATEN_START row) is ended by that thread itself (the
        lists were cleared after the loop, which lost such an op's ATEN_END for good)."""
        s = self.s
        if not self.in_flight or s.closed:
            return
        from .ops import ATEN_END, OP_LAUNCH
        ts = time_ns()
        for tid, st in list(self.in_flight.items()):
            while True:
                try:
                    name = st.pop()
                except IndexError:
                    break
                s.buf.append((OP_LAUNCH, ATEN_END, name, ts, tid, s.op_device, None, None, None, None))

    def take_over(self, prev, last_alloc_id):
        """Follow ops and new blocks from now on, after ``prev`` (the native source) handed over."""
        self.prev = prev
        self.next_alloc = last_alloc_id

    def live_alloc_ids(self) -> set:
        return {b.alloc_id for b in list(self.live.values())}

    def alloc_id_of(self, st):
        for b in list(self.live.values()):
            if b() is st:
                return b.alloc_id
        return None

    # ------------------------------------------------------------------ modes per thread
    def _push_mode(self):
        tid = threading.get_ident()
        if tid in self._modes:
            return
        from .ops import OpTracer
        m = OpTracer(self.s, self)
        m.__enter__()
        self._modes[tid] = m

    def _pop_mode(self):
        m = self._modes.pop(threading.get_ident(), None)
        if m is not None:
            try:
                m.__exit__(None, None, None)
            except Exception:  # another mode was pushed above ours and not popped
                log.warning("could not pop the tracing mode cleanly")

    def _install_threads(self):
        """Threads started after the first start() run the op tracer too (the mode stack is per
        thread). Threads already running then are not followed: their blocks enter the dump when
        an op on a traced thread first uses them. One patch per process, following the session of
        the moment."""
        if getattr(threading.Thread, "_msmemscope_patched", False):
            return
        orig = threading.Thread._bootstrap_inner

        def _bootstrap_inner(thread_self):
            from . import current
            s = current()
            src = s.dispatch if s is not None else None
            if src is None:
                return orig(thread_self)
            s = src.s
            # every thread started while this source follows the ops (its tracer does nothing
            # while stopped): a thread started in a stop/start gap is traced after the restart
            if s.source is src and not s.closed and os.getpid() == s.pid:
                from .ops import OpTracer
                m = OpTracer(s, src)
                m.__enter__()
            return orig(thread_self)

        threading.Thread._bootstrap_inner = _bootstrap_inner
        threading.Thread._msmemscope_patched = True

    # ------------------------------------------------------------------ blocks
    def block_of(self, t, op_name):
        """The live block behind a tensor, registering it if this is the first sight of it."""
        try:
            st = t.untyped_storage()
        except Exception:  # wrapper subclasses, sparse tensors: no plain storage
            return None
        b = self.live.get(id(st))
        if b is None:
            b = self.new_block(st, op_name, True)
            if b is None and type(t) is not torch.Tensor:
                b = self.inner_block(t, op_name, True)
        return b

    def storage_at(self, addr):
        """(storage, base, size) of the live tensor storage holding ``addr``, or None."""
        cands = [b() for b in list(self.live.values())]
        if self.prev is not None or self.s.native is not None:
            # blocks counted by the native source before the handover have no Block here yet:
            # found through the tensors that hold them
            import gc
            cands += [o.untyped_storage() for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for st in cands:
            if st is None:
                continue
            try:
                base, size = st.data_ptr(), st.nbytes()
            except Exception:
                continue
            if base <= addr < base + size:
                return st, base, size
        return None

    def inner_block(self, t, op_name, seen_as_input):
        """The block behind a wrapper subclass (DTensor: its local tensor), via ``__tensor_flatten__``."""
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return None
        try:
            names, _ = flatten()
        except Exception:
            return None
        for n in names:
            inner = getattr(t, n, None)
            if not isinstance(inner, torch.Tensor):
                continue
            try:
                st = inner.untyped_storage()
            except Exception:
                continue
            b = self.live.get(id(st))
            if b is None:
                b = self.new_block(st, op_name, seen_as_input)
                if b is None and type(inner) is not torch.Tensor:
                    b = self.inner_block(inner, op_name, seen_as_input)
            if b is not None:
                return b
        return None

    def new_block(self, st, op_name, seen_as_input):
        s = self.s
        try:
            size = st.nbytes()
            dev = st.device
            kind = _KIND.get(dev) or _kind_of(dev)
            if size == 0 or kind == "meta":
                return None
            dsrc = s.device_source
            if dsrc is not None and kind == dsrc.kind:
                return None  # the allocator trace reports this device's blocks
            addr = st.data_ptr()
        except Exception:
            return None
        device = "cpu" if kind == "cpu" else backends.device_id(dev)
        pool = Pool.PTA
        key = id(st)
        stack = None
        if s.py_depth:
            stack = getattr(s.tls, "stack", None) or s.py_stack()
        prev = self.prev if kind == "cpu" else None
        with s.lock:
            self._enter_row()
            try:
                return self._new_block_row(s, st, key, addr, size, device, pool, op_name, seen_as_input, stack, prev,
                                           kind, dev)
            finally:
                self._leave_row()

    def _new_block_row(self, s, st, key, addr, size, device, pool, op_name, seen_as_input, stack, prev, kind, dev):
        if prev is not None:  # after a handover from the native source
            hit = prev.counted_block(addr)
            if hit is not None:
                # a block the native source counted (and wrote the MALLOC row of): followed
                # here for labels and watch, its free is reported there
                b = Block(st, self._gone, key, hit[0], addr, size, device, pool, s.step_no, op_name, time_ns())
                b.native = True
                self.live[key] = b
                if s.labeler is not None:
                    s.labeler.on_new(b)
                return b
        # one snapshot of the flags decides both whether the block is counted and whether its MALLOC
        # row is written: another thread's step boundary changes s.emit and s.emit_alloc one after
        # the other, and a block counted between the two got no MALLOC row but a FREE one
        f = s.flags
        if not f.count:
            # outside the traced window (stopped, a step outside --steps): the block is not in
            # the dump, so it is neither counted nor followed; first seen while tracing, it
            # gets its MALLOC (origin before_op) then
            return None
        self.next_alloc += 1
        aid = self.next_alloc
        used, ts = s.account(device, pool, size)
        total = backends.reserved_bytes(kind, dev.index) if kind != "cpu" else used
        b = Block(st, self._gone, key, aid, addr, size, device, pool, s.step_no, op_name, ts)
        b.stack = stack
        self.live[key] = b
        if s.labeler is not None:
            s.labeler.on_new(b)
        if f.alloc:
            attr = (aid, addr, size, used, total, b.owner or "")
            if seen_as_input:
                # allocated outside any traced op (or before tracing): first seen here
                attr = {**attr_dict(Event.MALLOC, attr), "origin": "before_op"}
            s.buf.append((Event.MALLOC, pool, op_name, ts, threading.get_ident(), device, addr, attr,
                          stack, stacks.capture_c() if s.c_depth else None))
        return b

    def freed(self, key):
        """The block behind the storage with this id is gone (resize_(0) keeps the storage object)."""
        b = self.live.get(key)
        if b is not None:
            self._gone(b)

    def _enter_row(self):
        # under s.lock; sections nest when a handler running inside one allocates through the mode
        self._in_row = threading.get_ident()
        self._row_depth += 1

    def _leave_row(self):
        self._row_depth -= 1
        if self._row_depth:
            return
        # frees that came inside the section get their rows now, still inside one (more may come)
        try:
            while self._waiting:
                self._free_row(self._waiting.pop(0))
        finally:
            self._in_row = None  # one arriving after this line waits for the next section or flush

    def drain(self, buf: list):
        """Rows go straight into the session's buffer; only a free left waiting by a section's end
        (it came after the section's last look) is written here."""
        if self._waiting and self._in_row is None:
            with self.s.lock:
                self._enter_row()
                self._leave_row()

    def _gone(self, b):
        # the storage's weakref callback (b is the Block), or freed()
        live = self.live
        if live.get(b.key) is not b:  # already reported (resize_), or a newer block at that id
            return
        s = self.s
        if s.closed or b.native:
            del live[b.key]
            return
        # out of the live blocks, not yet a FREE row in the session's buffer: still live for the
        # leak rule's step ends (Session.live_when_drained) until _free_row
        self.freeing.add(b.alloc_id)
        del live[b.key]
        if self._in_row == threading.get_ident():  # inside this thread's own row section: after it
            self._waiting.append(b)
            return
        with s.lock:
            self._enter_row()
            try:
                self._free_row(b)
            finally:
                self._leave_row()

    def _free_row(self, b):
        try:
            self._free_row_now(b)
        finally:
            self.freeing.discard(b.alloc_id)

    def _free_row_now(self, b):
        s = self.s
        if s.closed:
            return
        used, ts = s.account(b.device, b.pool, -b.size)
        if s.emit_free or s.free_untraced:
            kind = s.kind if b.device != "cpu" else "cpu"
            total = backends.reserved_bytes(kind, int(b.device)) if kind != "cpu" else used
            attr = (b.alloc_id, b.addr, b.size, used, total)
            if not s.emit_free:  # freed outside the traced window: the row says so
                attr = {**attr_dict(Event.FREE, attr), UNTRACED: True}
            s.buf.append((Event.FREE, b.pool, getattr(s.tls, "op", None) or NA, ts,
                          threading.get_ident(), b.device, b.addr, attr, None, None))

    def emit_accesses(self, name, tid, touched):
        seen = {}
        for b, t, kind in touched:
            prev = seen.get(b.alloc_id)
            if prev is None or (kind == "WRITE" and prev[2] != "WRITE"):
                seen[b.alloc_id] = (b, t, kind)
        ts = time_ns()
        buf = self.s.buf
        for b, t, kind in seen.values():
            buf.append((Event.ACCESS, kind, name, ts, tid, b.device, b.addr,
                        (_dtype_name(t.dtype), tuple(t.shape), b.size, b.alloc_id), None, None))


# ---------------------------------------------------------------- storage resize (FSDP2 frees with resize_(0))
_resize_orig = None


def install_resize_patch():
    """``UntypedStorage.resize_`` changes a block's memory without a new storage object: to the
    dispatch source that is a FREE of the old block and a MALLOC of the new size. (The native
    source sees the new memory and the free at the allocator itself.)"""
    global _resize_orig
    if _resize_orig is not None:
        return
    _resize_orig = orig = torch.UntypedStorage.resize_

    @functools.wraps(orig)
    def resize_(self, size):
        from . import current
        s = current()
        src = s.dispatch if s is not None and s.active and not s.native_ops else None
        if src is None:
            return orig(self, size)
        key = id(self)
        b = src.live.get(key)
        out = orig(self, size)
        try:
            if b is not None and b.size == self.nbytes():
                return out
            op = getattr(s.tls, "op", None) or "UntypedStorage.resize_"
            if b is not None:
                src.freed(key)
            if self.nbytes():
                src.new_block(self, op, False)
        except Exception:
            pass
        return out

    torch.UntypedStorage.resize_ = resize_
