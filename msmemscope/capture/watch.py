"""Memory-block watch (SPEC §4.6): checksum watched blocks around ops, dump
them as the original does, and find the op that corrupts them.

The op tracer (``capture/ops.py``) calls the session's op observer (this engine, set with
``Session.set_op_observer``): ``before`` and ``after`` every op while ``session.watch_active`` is true;
``attach(session)`` replaces those no-ops with this engine's methods and adds
the engine to the session's sinks (``close`` writes ``analysis/watch.json``).

What is watched:
- with ``--watch=start[:outid],end``: output ``outid`` (default 0) of the
  start op, from the start op until the end op;
- a block watched through the Python API (``msmemscope.watcher.watch()``) is
  checked around every op from ``watch()`` until ``remove()`` or ``dump_nums``
  dumps, whatever the ``--watch`` window (the original's example watches a
  block with ``config(watch="start,end")`` naming ops that never run).

Op names for start/end: the dump's ``Name`` (``torch._ops.aten.mm.default``),
the same without ``torch._ops.`` (``aten.mm.default``), the overload packet
(``aten.mm``) or either without the namespace (``mm.default``, ``mm``);
``#N`` picks the N-th call. The start op's N counts calls from the trace start,
the end op's N counts calls after the window opened (the start call excluded).

Corruption: when a block changes across an op whose schema does not declare a
write to it (``alias_info.is_write`` on an argument overlapping the block, or
a fresh output placed over it), that op is reported as a stomp; a change
between two ops (no traced op ran) is reported as an untraced write.
Checksums run on the block's device with every dispatch mode disabled, so the
tracer never sees them and the program's values are untouched.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..io.files import create_new, make_dirs, unique_path
from . import backends, stacks
from .ops import op_info

log = logging.getLogger("msmemscope")

CHUNK = 1 << 22          # words per checksum pass: bounds the temporary device memory
MAX_RECORDS = 10000      # changes kept for watch.json (the rest are counted)
_M64 = (1 << 64) - 1
_PREFIXES = ("torch._ops.", "torch.ops.")


def short_name(name: str) -> str:
    """``torch._ops.aten.mm.default`` -> ``aten.mm.default``."""
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def _mix(a: int, b: int) -> int:
    """Two 64-bit sums -> one well-spread 64-bit value (splitmix64 finalizer)."""
    z = ((a & _M64) * 0x9E3779B97F4A7C15 + (b & _M64)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _compiled_code_ran() -> bool:
    """Whether torch.compile has compiled any graph in this process (Dynamo's own counter; we never
    import torch._dynamo ourselves)."""
    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return bool(utils is not None and utils.counters["stats"].get("unique_graphs", 0))
    except Exception:
        return False


def _other_program_threads() -> bool:
    """Whether a thread of the program other than this one is alive (ours, msmemscope-*, aside)."""
    from .dispatch import tool_thread
    me = threading.current_thread()
    return any(t is not me and not tool_thread(t) for t in threading.enumerate())


def _others_hint(rec, others) -> str:
    """Ops of other threads that ran while the change happened (none declares a write to the
    block): said, as the change may be theirs."""
    if not others:
        return ""
    rec["other_threads"] = list(others)
    return f"; other threads ran ops meanwhile ({', '.join(others[:3])}): the change may be theirs"


def _console(msg: str) -> None:
    from .._console import say
    say(f"[msmemscope] watch: {msg}")


class OpPattern:
    """``aten.mm.default#3``: which op call opens or closes the window."""

    def __init__(self, text: str):
        op, _, n = text.partition("#")
        self.text = text
        self.op = short_name(op.strip())
        self.nth = int(n) if n else 1
        self.seen = 0

    def matches(self, short: str) -> bool:
        names = {short}
        parts = short.split(".")
        if len(parts) >= 3:
            names.add(".".join(parts[:-1]))          # overload packet: aten.mm
        for n in list(names):
            _, dot, rest = n.partition(".")
            if dot:
                names.add(rest)                      # without the namespace: mm.default, mm
        return self.op in names


class Watched:
    """One watched byte range of a storage."""
    __slots__ = ("name", "ref", "offset", "length", "req", "device", "dev_id", "out_id", "source",
                 "dump_nums", "dumps", "last", "last_op", "alloc_id", "addr", "stopped", "changes", "stomps",
                 "reported")

    def __init__(self, name, storage, offset, length, req, out_id, source, dump_nums, alloc_id):
        self.name, self.offset, self.length, self.req = name, offset, length, req
        self.ref = weakref.ref(storage)
        self.device = storage.device
        self.dev_id = backends.device_id(storage.device)
        self.out_id, self.source, self.dump_nums = out_id, source, dump_nums
        self.dumps = 0
        self.last = None         # checksum after the last checked op (None: not continuous)
        self.reported = 0        # changes reported by any thread's op check (before/after a thread's op)
        self.last_op = None
        self.alloc_id = alloc_id
        self.addr = storage.data_ptr() + offset
        self.stopped = None
        self.changes = 0
        self.stomps = 0

    def storage(self):
        """The storage, or None when the block is gone (freed, or shrunk below the range)."""
        st = self.ref()
        if st is None:
            return None
        try:
            if st.nbytes() < self.offset + self.length:
                return None
        except Exception:
            return None
        return st

    def describe(self):
        return {"name": self.name, "source": self.source, "device": self.dev_id, "addr": hex(self.addr),
                "length": self.length, "out_id": self.out_id, "allocation_id": self.alloc_id,
                "dump_nums": self.dump_nums or None, "dumps": self.dumps, "changes": self.changes,
                "stomps": self.stomps, "stopped": self.stopped}


def _byte_view(st, offset, length):
    """A uint8 tensor over ``length`` bytes of ``st`` (call with the dispatch modes disabled)."""
    v = torch.empty(0, dtype=torch.uint8, device=st.device)
    v.set_(st, offset, (length,), (1,))
    return v


def tensor_span(t):
    """(first byte address, byte length) covered by a strided tensor, or None."""
    try:
        n = t.numel()
        if n == 0:
            return None
        extent = sum((s - 1) * abs(d) for s, d in zip(t.shape, t.stride()))
        return t.data_ptr(), (extent + 1) * t.element_size()
    except Exception:
        return None


def _overlaps(t, lo, hi):
    sp = tensor_span(t)
    return sp is not None and sp[0] < hi and lo < sp[0] + sp[1]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif type(x) in (list, tuple):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y
            elif type(y) in (list, tuple):
                yield from _tensors(y)


def _storage_id(t):
    try:
        return id(t.untyped_storage())
    except Exception:
        return None


class WatchEngine:
    def __init__(self, session):
        self.s = session
        spec = session.opts.watch
        self.spec = spec
        self.full = bool(spec and spec.full_content)
        self.start = OpPattern(spec.start) if spec and spec.start else None
        self.end = OpPattern(spec.end) if spec else None
        self.state = "waiting" if self.start else "open"
        self.window = {"opened": None if self.start else "trace start", "closed": None}
        self.entries: list[Watched] = []
        self.finished: list[Watched] = []
        self.calls: dict = {}
        self._short: dict = {}
        self._match: dict = {}
        self.lock = threading.RLock()
        # each thread's op between before() and after(): (func, short name, call, args, kwargs). A
        # change seen around one thread's op may be another thread's op running meanwhile
        self.running: dict = {}
        self.tls = threading.local()
        self.changes: list = []
        self.stomps: list = []
        self.dropped = 0
        self.warnings: list = []
        self._csv = None
        self.csv_path = None
        self.bins = 0
        self._weights: dict = {}
        self._closed = False
        # one more at every stop(): an op that began before a stop and ends after it (another
        # thread's, in flight) saw the block before the gap; its after() checks and notes nothing
        self.epoch = 0
        session.on_stop(self._forget_last)
        session.set_op_observer(self)  # before()/after() around every op (hands over from the native source)
        self._update_active()

    def _forget_last(self):
        # ops run while not tracing are not checked: the next check starts afresh
        with self.lock:
            self.epoch += 1
            for e in self.entries:
                e.last = None

    # ------------------------------------------------------------------ state
    def _update_active(self):
        self.s.watch_active = (self.state == "waiting" or bool(self.entries)
                               or (self.state == "open" and self.end is not None))

    def _warn(self, msg):
        self.warnings.append(msg)
        log.warning("watch: %s", msg)
        _console(f"warning: {msg}")

    def _stop(self, e, why, warn=False):
        if e in self.entries:
            self.entries.remove(e)
        e.stopped = why
        self.finished.append(e)
        if warn:
            self._warn(f"watched block '{e.name}' {why}; watching it stopped")
        else:
            log.info("watch: stopped watching '%s' (%s)", e.name, why)
        self._update_active()

    def _names(self, name):
        short = self._short.get(name)
        if short is None:
            short = self._short[name] = short_name(name)
        return short

    def _matches(self, pat, short):
        key = (id(pat), short)
        m = self._match.get(key)
        if m is None:
            m = self._match[key] = pat.matches(short)
        return m

    # ------------------------------------------------------------------ checksums and dumps
    def _checksum(self, e, st):
        """A 64-bit checksum of the block computed on its device: the sum and the
        position-weighted sum of its 32-bit words (bytes when unaligned)."""
        with _disable_current_modes(), torch.no_grad():
            v = _byte_view(st, e.offset, e.length)
            if e.length % 4 == 0 and v.data_ptr() % 4 == 0:
                v = v.view(torch.int32)
            n = v.numel()
            dev = v.device
            w = self._weights.get(dev)
            m = min(n, CHUNK)
            if w is None or w.numel() < m:
                w = self._weights[dev] = torch.arange(1, m + 1, dtype=torch.int64, device=dev)
            s1 = s2 = None
            for base in range(0, n, CHUNK):
                c = v[base:base + CHUNK].to(torch.int64)
                a = c.sum()
                b = (c * w[:c.numel()]).sum() + a * base
                s1 = a if s1 is None else s1 + a
                s2 = b if s2 is None else s2 + b
            r1, r2 = torch.stack((s1, s2)).tolist()
        return _mix(r1, r2)

    def _bytes(self, e, st):
        with _disable_current_modes(), torch.no_grad():
            v = _byte_view(st, e.offset, e.length)
            if v.device.type != "cpu":
                v = v.cpu()
            return ctypes.string_at(v.data_ptr(), e.length)

    def _dump_dir(self):
        return make_dirs(os.path.join(self.s.device_folder, "watch_dump"))

    def _dump(self, e, st, short, call, tid, phase, checksum):
        stem = f"{e.dev_id}_{tid}_{short}_{call}-{e.name}_{e.out_id}_{phase}"
        try:
            if self.full:
                safe = "".join(ch if ch.isalnum() or ch in "._-#" else "_" for ch in stem)
                path = unique_path(os.path.join(self._dump_dir(), safe + ".bin"))
                with create_new(path, binary=True) as f:
                    f.write(self._bytes(e, st))
                self.bins += 1
            else:
                if self._csv is None:
                    dev = "cpu" if self.s.op_device == "cpu" else self.s.op_device
                    self.csv_path = unique_path(os.path.join(
                        self._dump_dir(), f"watch_dump_data_check_sum_{dev}_{self.s.timestamp()}.csv"))
                    self._csv = create_new(self.csv_path)
                    self._csv.write("Tensor info,Check data sum\n")
                from ..io.writers import csv_line  # the one CSV writer: quoted, neutralised
                self._csv.write(csv_line([stem, f"0x{checksum:016x}"]))
        except OSError as exc:
            if not getattr(self, "_dump_failed", False):
                self._dump_failed = True
                self._warn(f"cannot write watch dumps: {exc}")

    def _sync(self, entries):
        kinds = {e.device.type for e in entries if e.device.type != "cpu"}
        for k in kinds:
            try:
                backends.synchronize(k)
            except Exception:
                pass

    # ------------------------------------------------------------------ the op hooks
    def before(self, func, name, args, kwargs):
        with self.lock:
            short = self._names(name)
            call = self.calls[name] = self.calls.get(name, 0) + 1
            opener = closer = False
            if self.state == "waiting":
                if self._matches(self.start, short):
                    self.start.seen += 1
                    if self.start.seen == self.start.nth:
                        opener = True
                        self.state = "open"
                        self.window["opened"] = f"{short}#{call}"
                        for e in self.entries:
                            e.last = None        # ops before the window were not checked
            elif self.state == "open" and self.end is not None and self._matches(self.end, short):
                self.end.seen += 1
                closer = self.end.seen == self.end.nth
            entries = self.entries if self.state == "open" else [e for e in self.entries if e.source == "api"]
            tid = threading.get_ident()
            # every op while the watch is on, also one that begins before a block is watched
            self.running[tid] = (func, short, call, args, kwargs)
            if not entries and not opener and not closer:
                self.tls.pending = None
                return
            checked = []
            if entries:
                self._sync(entries)
            for e in list(entries):
                st, cs = self._read(e)
                if st is None:
                    continue
                if e.last is not None and cs != e.last:
                    writes, others = self._other_threads(tid, st, e)
                    if not writes:  # else that op's own after() reports its declared write
                        self._untraced(e, short, call, others)
                        # reported: not again by the next op to begin, nor by the after() of an
                        # op of another thread that began before the change
                        e.reported += 1
                        e.last = cs
                self._dump(e, st, short, call, tid, "before", cs)
                checked.append((e, cs, e.reported))
            self.tls.pending = (name, call, checked, opener, closer, self.epoch)

    def _read(self, e):
        """(storage, checksum) of a watched block, or (None, None) after stopping its watch
        with a warning when the block was freed or cannot be read."""
        st = e.storage()
        if st is None:
            self._stop(e, "was freed", warn=True)
            return None, None
        try:
            return st, self._checksum(e, st)
        except Exception as exc:
            self._stop(e, f"could not be read ({exc})", warn=True)
            return None, None

    def after(self, func, name, args, kwargs, out, touched):
        with self.lock:
            p = getattr(self.tls, "pending", None)
            self.tls.pending = None
            tid = threading.get_ident()
            self.running.pop(tid, None)
            if p is None or p[0] != name:
                return
            _, call, checked, opener, closer, epoch = p
            short = self._names(name)
            tid = threading.get_ident()
            if epoch != self.epoch:
                # tracing stopped while this op ran: what changed since its before() may be the
                # gap's untraced work, and a checksum taken now is no baseline for the next op
                checked = ()
            if checked:
                self._sync([e for e, _, _ in checked])
            for e, b, reported in checked:
                if e not in self.entries:
                    continue
                st, a = self._read(e)
                if st is None:
                    continue
                self._dump(e, st, short, call, tid, "after", a)
                e.dumps += 1
                seen_by_other = e.reported != reported and e.last == a
                e.last = a
                e.last_op = f"{short}#{call}"
                # (a change another thread's op check reported since this op began is that one's)
                if a != b and not seen_by_other:
                    lo = st.data_ptr() + e.offset
                    declared = self._declared(func, args, kwargs, out, lo, lo + e.length)
                    others = ()
                    if not declared:
                        writes, others = self._other_threads(tid, st, e)
                        if writes:
                            # that thread's op writes it: its own after() reports the write (so
                            # this is no report: counted as one, the writer took it for reported)
                            continue
                    e.reported += 1
                    self._changed(e, name, short, call, tid, b, a, declared, others)
                if e.dump_nums and e.dumps >= e.dump_nums:
                    self._stop(e, f"reached dump_nums={e.dump_nums}")
            if opener and self.spec is not None:
                self._watch_start_output(short, call, tid, out)
            if closer:
                self.state = "closed"
                self.window["closed"] = f"{short}#{call}"
                for e in list(self.entries):
                    if e.source == "start op":  # blocks given to watcher.watch() stay until remove()
                        self._stop(e, "end op reached")
                log.info("watch: window closed at %s#%d", short, call)
            self._update_active()

    def _watch_start_output(self, short, call, tid, out):
        outs = list(_tensors(out))
        k = self.spec.out_id or 0
        if k >= len(outs):
            self._warn(f"start op {short}#{call} has {len(outs)} tensor output(s): no output #{k} to watch")
            return
        t = outs[k]
        e = self.add_tensor(t, name=short, out_id=k, source="start op")
        if e is None:
            return
        st = e.storage()
        if st is not None:
            try:
                self._dump(e, st, short, call, tid, "after", self._checksum(e, st))
            except Exception as exc:
                self._warn(f"cannot read the start op's output: {exc}")
            e.last_op = f"{short}#{call}"
        log.info("watch: window opened at %s#%d, watching its output %d (%d bytes)", short, call, k, e.length)

    # ------------------------------------------------------------------ classification
    def _declared(self, func, args, kwargs, out, lo, hi):
        """Does the op's schema declare a write to [lo, hi): a written argument or a fresh output over it?"""
        try:
            writes, kw_writes = op_info(func)[1:3]
        except Exception:
            return False
        for i in writes:
            if i < len(args) and any(_overlaps(t, lo, hi) for t in _tensors(args[i])):
                return True
        for k, v in (kwargs or {}).items():
            if k in kw_writes and any(_overlaps(t, lo, hi) for t in _tensors(v)):
                return True
        inputs = {_storage_id(t) for a in list(args) + list((kwargs or {}).values()) for t in _tensors(a)}
        for t in _tensors(out):
            if _storage_id(t) not in inputs and _overlaps(t, lo, hi):
                return True
        return False

    def _record(self, rec, stomp):
        if len(self.changes) < MAX_RECORDS:
            self.changes.append(rec)
        else:
            self.dropped += 1
        if stomp and len(self.stomps) < MAX_RECORDS:
            self.stomps.append(rec)

    def _where(self):
        stack = stacks.python_stack(50)
        return stacks.user_line(stack), stack

    def _other_threads(self, tid, st, e):
        """(whether an op of another thread, running now, declares a write to the block in its
        schema; the ops of other threads running now, as text)."""
        lo = st.data_ptr() + e.offset
        writes, others = False, []
        for t, (func, short, call, args, kwargs) in list(self.running.items()):
            if t == tid:
                continue
            others.append(f"{short}#{call} on thread {t}")
            writes = writes or self._declared(func, args, kwargs, None, lo, lo + e.length)
        return writes, others

    def _changed(self, e, name, short, call, tid, before, after, declared, others=()):
        e.changes += 1
        rec = {"kind": "write" if declared else "stomp", "watched": e.name, "op": short, "name": name,
               "call": call, "step": self.s.step_no, "tid": tid,
               "before": f"0x{before:016x}", "after": f"0x{after:016x}"}
        if not declared:
            e.stomps += 1
            line, stack = self._where()
            rec["line"] = line
            rec["stack"] = stack
            msg = (f"STOMP: '{e.name}' changed by {short} (call {call}, step {self.s.step_no}), "
                   f"which does not declare a write to it, at {line or 'an unknown line'}")
            msg += _others_hint(rec, others)
            log.error("watch: %s", msg)
            _console(msg)
        self._record(rec, not declared)

    def _untraced(self, e, short, call, others=()):
        e.changes += 1
        e.stomps += 1
        line, stack = self._where()
        rec = {"kind": "untraced", "watched": e.name, "op": None, "after_op": e.last_op,
               "before_op": f"{short}#{call}", "step": self.s.step_no, "tid": threading.get_ident(),
               "line": line, "stack": stack}
        msg = (f"STOMP: '{e.name}' changed outside any traced op, between {e.last_op or 'watch()'} "
               f"and {short}#{call} (step {self.s.step_no}), before {line or 'an unknown line'}")
        msg += _others_hint(rec, others)
        if _compiled_code_ran():
            # an inductor kernel writes its outputs (an optimizer's parameters in place) with no
            # operator call to see: the likeliest writer, and not a corruption
            rec["compiled_code"] = True
            msg += ("; this program runs torch.compile'd code, whose fused kernels write memory "
                    "without a traced op: the write may be theirs")
        log.error("watch: %s", msg)
        _console(msg)
        self._record(rec, True)

    # ------------------------------------------------------------------ what the Python API calls
    def add_tensor(self, t, name, dump_nums=0, out_id=0, source="api"):
        try:
            st = t.untyped_storage()
            st.data_ptr()
        except Exception:
            self._warn(f"cannot watch '{name}': the tensor has no plain storage")
            return None
        if st.device.type == "meta":
            self._warn(f"cannot watch '{name}': a meta tensor has no memory")
            return None
        sp = tensor_span(t)
        if sp is None:
            self._warn(f"cannot watch '{name}': the tensor is empty")
            return None
        addr, length = sp
        return self._add(st, addr - st.data_ptr(), length, ("tensor", id(st), addr, length), name,
                         dump_nums, out_id, source, t)

    def add_range(self, addr, length, name, dump_nums=0):
        found = self.s.storage_at(addr)
        if found is None:
            self._warn(f"cannot watch '{name}': address {hex(addr)} is not inside any live tensor block "
                       f"msmemscope has seen")
            return None
        st, base, size = found
        n = length
        if addr + length > base + size:
            n = base + size - addr
            self._warn(f"'{name}': length {length} runs past the end of its block at {hex(base)} "
                       f"({size} bytes); watching the {n} bytes up to the end")
        return self._add(st, addr - base, n, ("range", addr, length), name, dump_nums, 0, "api", None)

    def _add(self, st, offset, length, req, name, dump_nums, out_id, source, t):
        with self.lock:
            alloc_id = None
            if t is not None and self.s.active:
                b = self.s.block_of(t, "watcher.watch")
                alloc_id = b.alloc_id if b is not None else None
            else:
                alloc_id = self.s.alloc_id_of(st)
            e = Watched(name, st, offset, length, req, out_id, source, dump_nums or 0, alloc_id)
            if self.state == "open" or source in ("start op", "api"):
                try:
                    cs = self._checksum(e, st)
                    # a baseline only while ops are traced: changes before the next op are then untraced
                    # writes. Not where another thread of the program runs: its op in flight now began
                    # before this watch and is not checked, so its write would look untraced (the
                    # first check after this one is the baseline then)
                    e.last = cs if self.s.active and not _other_program_threads() else None
                except Exception as exc:
                    self._warn(f"cannot watch '{name}': {exc}")
                    return None
            self.entries.append(e)
            self._update_active()
            log.info("watch: watching '%s' (%d bytes at %s on %s)", name, length, hex(e.addr), e.dev_id)
            return e

    def remove_tensor(self, t):
        sp = tensor_span(t)
        try:
            st = t.untyped_storage()
        except Exception:
            st = None
        with self.lock:
            hit = [e for e in self.entries if st is not None and e.ref() is st and e.source == "api"
                   and (sp is None or (e.addr < sp[0] + sp[1] and sp[0] < e.addr + e.length))]
            for e in hit:
                self._stop(e, "removed")
            return len(hit)

    def remove_range(self, addr, length):
        with self.lock:
            hit = [e for e in self.entries if e.req == ("range", addr, length)]
            if not hit:
                hit = [e for e in self.entries if e.source == "api" and e.addr < addr + length
                       and addr < e.addr + e.length]
            for e in hit:
                self._stop(e, "removed")
            return len(hit)

    # ------------------------------------------------------------------ sink interface
    def consume(self, rows, first_id):
        pass

    def step_end(self, session, step):
        if self._csv is not None:
            try:
                self._csv.flush()
            except OSError:
                pass

    def report(self) -> dict:
        spec = None
        if self.spec is not None:
            spec = {"start": self.spec.start, "out_id": self.spec.out_id, "end": self.spec.end,
                    "full_content": self.spec.full_content}
        return {
            "spec": spec,
            "window": dict(self.window),
            "dump": ("bin" if self.full else "csv"),
            "checksum_file": os.path.relpath(self.csv_path, self.s.folder) if self.csv_path else None,
            "bin_files": self.bins,
            "watched": [e.describe() for e in self.finished + self.entries],
            "stomps": self.stomps,
            "changes": self.changes,
            "changes_not_listed": self.dropped,
            "warnings": self.warnings,
        }

    def close(self, session):
        with self.lock:
            if self._closed:
                return
            self._closed = True
            api = sum(1 for e in self.finished + self.entries if e.source == "api")
            if self.start is not None and self.state == "waiting":
                what = (f"only the {api} block(s) given to msmemscope.watcher.watch() were watched"
                        if api else "nothing was watched")
                self._warn(f"--watch start op '{self.start.text}' never ran: no op output was watched; {what}")
            elif self.spec is not None and self.state == "open" and self.end is not None:
                log.info("watch: end op '%s' never ran; watched until the end", self.end.text)
            if self.spec is not None and self.start is None and not (self.entries or self.finished):
                self._warn("--watch without a start op watches only blocks given to "
                           "msmemscope.watcher.watch(): none was given")
            if self._csv is not None:
                try:
                    self._csv.close()
                except OSError:
                    pass
            rep = self.report()
            try:
                d = make_dirs(os.path.join(session.folder, "analysis"))
                path = unique_path(os.path.join(d, "watch.json"))
                with create_new(path) as f:
                    json.dump(rep, f, indent=2)
            except OSError as exc:
                log.error("watch: cannot write watch.json: %s", exc)
                path = None
            n = len(rep["watched"])
            writes = sum(1 for c in self.changes if c["kind"] == "write")
            msg = (f"{n} block(s) watched, {writes} change(s) by declared writes, "
                   f"{len(self.stomps)} stomp(s)")
            if path:
                msg += f"; details in {path}"
            log.info("watch: %s", msg)
            _console(msg)


def attach(session) -> WatchEngine:
    """The session's watch engine, created on first use and registered as a sink."""
    eng = session.watch_engine
    if eng is None:
        eng = session.watch_engine = WatchEngine(session)
    session.add_sink(eng)
    return eng
