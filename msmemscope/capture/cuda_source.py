"""The live device source: the caching allocator's trace (CUDA, Ascend NPU), drained at every flush.

PyTorch records every allocator action in C++ (about 2 us each) into a ring buffer once
``torch.cuda.memory._record_memory_history`` is on; ``_snapshot()`` returns that buffer and the
segments. At each flush this source reads it, takes the entries it has not seen (``TraceCursor``:
the last time stamp read and how many entries had it), converts them (``cuda_allocator``) and
merges the rows by time into the session's buffer. Stacks are not recorded (``context=None``):
the snapshot then costs about a microsecond per entry.

Reading copies the whole ring buffer, so at every step end the buffer is cleared (re-enabled with
``clear_history``; a second read right after converts what came since the first and compares the
layout with the allocator's, resyncing when the allocator moved in between): a read costs the
entries of one step, not the buffer's size. A step that does not fit: when a read finds more than
half of the buffer new, it grows four-fold at the step end; when it finds entries overwritten
before they were read (``lost``), the layout is set from the snapshot's segments (rows marked
``origin: "resync"``), the loss is counted in config.json (``allocator_trace.lost``) and logged.
A program that recorded its own history before tracing keeps it: then nothing is cleared.

Why this and not a C++ ``attachAllocatorTraceTracker`` callback: see docs/DEVELOPING.md.
"""
from __future__ import annotations

import bisect
import heapq
import logging
import threading
from time import time_ns

from ..events import Event
from .cuda_allocator import AllocatorConverter, TraceCursor
from .source import Source

log = logging.getLogger("msmemscope")
INITIAL_ENTRIES = 1 << 16   # a few MB of C++ entries without stacks
MAX_ENTRIES = 1 << 21
_INF = 1 << 62


def _ts(row):
    return row[3]


def memory_module(kind: str):
    """(torch.<kind>.memory, None) where its allocator records a trace, else (None, why not)."""
    import torch
    mod = getattr(torch, kind, None)
    mem = getattr(mod, "memory", None) if mod is not None else None
    if mem is None:
        return None, f"torch.{kind}.memory is missing"
    for fn in ("_record_memory_history", "_snapshot"):
        if not callable(getattr(mem, fn, None)):
            return None, f"torch.{kind}.memory has no {fn} (this {kind} build cannot trace its allocator)"
    return mem, None


def unsupported_by(opts) -> str | None:
    """Why the options need the dispatch-mode source for device blocks, or None."""
    import sys
    ev = opts.effective_events()
    if "access" in ev:
        return "access events name device blocks through tensor storages (dispatch-mode source)"
    if "traceback" in ev or opts.python_stack or opts.c_stack:
        return "call stacks of device blocks are taken by the dispatch-mode source"
    if opts.watch is not None:
        return "--watch needs the dispatch-mode source"
    if "decompose" in opts.analysis or "msmemscope.integrations" in sys.modules:
        return "owner labels (decompose, framework hooks) need the dispatch-mode source"
    return None


class AllocatorSource(Source):
    """The session's handle on the allocator trace of one device kind (the session's
    ``device_source``: beside the op source, it reports the blocks of its device)."""

    name = "allocator_trace"
    sees = frozenset({"alloc", "free", "accelerators"})

    def __init__(self, session, kind: str, mem):
        self.s = session
        self.kind = kind
        self.mem = mem
        self.conv: dict = {}            # device index -> AllocatorConverter
        self.cursors: dict = {}         # device index -> TraceCursor
        self.capacity = INITIAL_ENTRIES
        self.grow_to = None
        self.ours = False               # we switched the history on (and switch it off)
        self.installed = False
        self.wanted = False
        self._record = None             # the history API itself, under our wrapper
        self.program_owned = False      # the program called the history API while we traced
        self.lost = 0
        self.window_resyncs = 0         # restarts that found the allocator moved between read and clear
        self.max_new = 0
        self._open: dict = {}           # tid -> [(op, start ts)] open at the last drain
        self._settings = {}
        self._lock = threading.RLock()
        self.oom_k = int(getattr(session.opts, "oom_k", 10) or 10) if "oom" in session.opts.analysis else 0
        self.last_step_end: dict = {}   # device index -> the last "Step End" snapshot's Attr

    # ------------------------------------------------------------------ life cycle
    def _enable(self, clear: bool):
        record = self._record or self.mem._record_memory_history
        try:
            record("all", context=None, stacks="python", max_entries=self.capacity,
                                            clear_history=clear)
        except TypeError:  # a build whose history API has no clear_history (older torch, torch_npu)
            record("all", context=None, stacks="python", max_entries=self.capacity)

    def start(self):
        """Switch the history on once the device's allocator exists (at its lazy init; starting
        it here would create a device context in a process that may never use the device)."""
        if self.installed:
            return
        import torch
        self.wanted = True
        mod = getattr(torch, self.kind)
        initialized = getattr(mod, "is_initialized", None)
        lazy = getattr(mod, "_lazy_call", None)
        if initialized is not None and lazy is not None and not initialized():
            lazy(self._start_now)
        else:
            self._start_now()

    def _start_now(self):
        if not self.wanted or self.installed or not self.s.active:
            return
        try:
            self._install()
        except Exception as e:  # never break the program's device initialization
            log.warning("the %s allocator trace could not start (%s): device blocks come from the "
                        "dispatch-mode source", self.kind, e)
            s = self.s
            s.config["device_source"] = "dispatch"
            s.config["device_source_note"] = f"the allocator trace failed to start: {e}"
            s.device_source = None  # new_block takes the device's storages again

    def _install(self):
        import torch
        try:
            enabled = bool(torch._C._cuda_isHistoryEnabled()) if self.kind == "cuda" else False
        except Exception:
            enabled = False
        if not enabled:
            self._enable(clear=True)
            self.ours = True
            self._watch_program_calls()
        snap = self.mem._snapshot()
        self._settings = snap.get("allocator_settings") or {}
        ts = time_ns()
        rows: list = []
        for idx, trace in enumerate(snap.get("device_traces") or []):
            cur = self.cursors.setdefault(idx, TraceCursor())
            cur.new(trace)  # what was recorded before tracing began is not ours to convert
        for idx, segs in self._by_device(snap).items():
            self._converter(idx).resync(segs, ts, rows, "before_trace")
        self._emit(rows)
        self.s.buf.extend(rows)
        self.installed = True
        log.info("%s allocator trace on (ring buffer of %d entries%s)", self.kind, self.capacity,
                 "" if self.ours else "; the program's own history settings kept")

    def _watch_program_calls(self):
        """The program may record its own history (to dump a snapshot for memory_viz): from its first
        call on the settings are its own, and this source no longer clears or resizes the buffer."""
        orig = self.mem._record_memory_history
        if getattr(orig, "_msmemscope", False):
            return
        self._record = orig
        src = self

        def _record_memory_history(*a, **k):
            if src.ours:
                src.ours = False
                src.program_owned = True
                log.info("the program set the %s allocator history itself: its settings are kept from now on",
                         src.kind)
            return orig(*a, **k)
        _record_memory_history._msmemscope = True
        _record_memory_history.__doc__ = orig.__doc__
        try:
            self.mem._record_memory_history = _record_memory_history
        except Exception:
            pass

    def stop(self):
        self.wanted = False
        if not self.installed:
            return
        try:
            self.drain_into(self.s.buf)
        finally:
            self.installed = False
            if self.ours:
                try:
                    (self._record or self.mem._record_memory_history)(None)
                except Exception as e:
                    log.warning("could not switch the %s allocator history off: %s", self.kind, e)
            self.s.config["allocator_trace"] = self.report()

    def report(self) -> dict:
        counts: dict = {}
        for c in self.conv.values():
            for k, v in c.counts.items():
                counts[k] = counts.get(k, 0) + v
        return {"kind": self.kind, "ring_buffer_entries": self.capacity, "lost": self.lost,
                "window_resyncs": self.window_resyncs, "program_owned_history": self.program_owned,
                "largest_drain": self.max_new, "history_owned": self.ours, **counts}

    # ------------------------------------------------------------------ conversion
    def _by_device(self, snap) -> dict:
        out: dict = {}
        for seg in snap.get("segments") or []:
            out.setdefault(int(seg.get("device", 0)), []).append(seg)
        return out

    def _converter(self, idx: int) -> AllocatorConverter:
        c = self.conv.get(idx)
        if c is None:
            st = self._settings
            c = AllocatorConverter(str(idx), next_id=self._next_id, step=lambda: self.s.step_no,
                                   oom_k=self.oom_k, expandable=bool(st.get("expandable_segments")),
                                   max_split_size=_max_split(st), account=self._account)
            try:
                import torch
                c.device_total = int(getattr(torch, self.kind).mem_get_info(idx)[1])
            except Exception:
                c.device_total = None
            self.conv[idx] = c
        return c

    def _next_id(self) -> int:
        return self.s.new_alloc_id()

    def _account(self, device, pool, delta) -> int:
        # the session's one count of bytes in use per (device, pool): its peaks and the OOM account read it
        with self.s.lock:
            return self.s.account(device, pool, delta)[0]

    def _attributor(self, buf, flushing):
        """Top-level op intervals from the op rows in ``buf`` and the ops still open when the last
        flush took the buffer (kept only when this read's buffer is the one being flushed: a read
        between flushes sees the same rows again next time)."""
        ivs = []
        stacks = {t: list(st) for t, st in self._open.items()}
        for r in buf:
            if r[0] != Event.OP_LAUNCH:
                continue
            st = stacks.get(r[4])
            if r[1] == "ATEN_START":
                if st is None:
                    st = stacks[r[4]] = []
                st.append((r[2], r[3]))
            elif st:
                name, t0 = st.pop()
                if not st:
                    ivs.append((t0, r[3], name, r[4]))
        for tid, st in stacks.items():
            if st:
                ivs.append((st[0][1], _INF, st[0][0], tid))
        if flushing:
            self._open = {t: st for t, st in stacks.items() if st}
        if not ivs:
            return None
        ivs.sort()
        starts = [iv[0] for iv in ivs]

        def attribute(ts):
            i = bisect.bisect_right(starts, ts) - 1
            j = i
            while j >= 0 and i - j < 16:  # the latest-started op that still ran at ts
                t0, t1, name, tid = ivs[j]
                if t0 <= ts <= t1:
                    return name, tid
                j -= 1
            return None
        return attribute

    def _emit(self, rows):
        """Keep the rows the session's event options ask for (the layout is followed regardless)."""
        s = self.s
        if s.emit_alloc and s.emit_free:
            return
        rows[:] = [r for r in rows if (r[0] == Event.MALLOC and s.emit_alloc) or (r[0] == Event.FREE and s.emit_free)
                   or r[0] not in (Event.MALLOC, Event.FREE)]

    def drain_into(self, buf: list, flushing: bool = False):
        """Convert what the allocator did since the last read into rows merged into ``buf``;
        ``flushing``: the session writes ``buf`` out right after (Session._flush)."""
        if not self.installed:
            return
        with self._lock:
            try:
                snap = self.mem._snapshot()
            except Exception as e:
                log.warning("could not read the %s allocator trace: %s", self.kind, e)
                return
            attribute = self._attributor(buf, flushing)
            rows: list = []
            segs_of = self._by_device(snap)
            for idx, trace in enumerate(snap.get("device_traces") or []):
                cur = self.cursors.setdefault(idx, TraceCursor())
                new, lost = cur.new(trace, self.capacity if self.ours else None)
                if not new and not lost:
                    continue
                c = self._converter(idx)
                c.attribute = attribute
                self.max_new = max(self.max_new, len(new))
                if lost:
                    self.lost += 1
                    log.warning("the %s allocator trace of device %d wrapped before it was read (ring buffer "
                                "of %d entries): the layout is set from the allocator's snapshot", self.kind, idx,
                                self.capacity)
                    self.grow_to = min(MAX_ENTRIES, self.capacity * 4)
                    c.resync(segs_of.get(idx, []), time_ns(), rows)
                    # what follows the gap: entries of blocks the resync already counted are skipped
                    c.convert([e for e in new if e.get("action") not in ("alloc", "free_requested",
                                                                          "free_completed", "segment_alloc",
                                                                          "segment_free", "segment_map",
                                                                          "segment_unmap")], rows)
                else:
                    c.convert(new, rows)
                    c.check(segs_of.get(idx, []))
                c.attribute = None
                if len(new) * 2 > self.capacity and self.capacity < MAX_ENTRIES:
                    self.grow_to = min(MAX_ENTRIES, self.capacity * 4)
            self._emit(rows)
            if rows:
                n = len(buf)  # rows another thread appends meanwhile stay after the merged ones
                buf[:n] = list(heapq.merge(buf[:n], rows, key=_ts))
            self._pass_ooms()

    def _pass_ooms(self):
        """OOM accounts found in this drain go to the OOM analysis (its report and oom.json)."""
        for c in self.conv.values():
            while c.ooms_passed < len(c.ooms):
                listed = c.ooms[c.ooms_passed]
                c.ooms_passed += 1
                for sink in self.s.sinks:
                    take = getattr(sink, "take", None)
                    if take is not None:
                        take(self.s, listed)

    def oom_accounts(self) -> int:
        return sum(len(c.ooms) for c in self.conv.values())

    def on_oom(self):
        """The allocator's OOM observer fired (before the exception): its rows now, with the layout."""
        self.drain_into(self.s.buf)

    def at_step_end(self, buf: list, step: int):
        """Drain, then one SNAPSHOT row per device: the device's own used/free beside the reserved bytes."""
        self.drain_into(buf)
        if self.ours and self.installed:
            self._restart(buf)
        import torch
        mod = getattr(torch, self.kind)
        tid = threading.get_ident()
        for idx, c in sorted(self.conv.items()):
            try:
                free, total = mod.mem_get_info(idx)
                reserved = int(mod.memory_reserved(idx))
                allocated = int(mod.memory_allocated(idx))
            except Exception as e:
                log.debug("no device memory figures for %s:%d: %s", self.kind, idx, e)
                continue
            free, total = int(free), int(total)
            outside = max(0, total - free - reserved)
            attr = {"reserved": reserved, "max_reserved": c.step_peak_reserved, "allocated": allocated,
                    "max_allocated": c.step_peak_allocated, "total": total, "free": free,
                    "device_rate": round(100.0 * (total - free) / total, 4) if total else 0.0,
                    "reserved_rate": round(100.0 * reserved / total, 4) if total else 0.0,
                    "step": step, "traced_reserved": c.reserved, "traced_allocated": c.used - c.deferred_pending,
                    "deferred_free": c.deferred_pending, "outside_allocator": outside,
                    "headroom": max(0, total - outside - c.step_peak_reserved)}
            buf.append((Event.SNAPSHOT, Event.SNAPSHOT, "Step End", time_ns(), tid, str(idx), None, attr,
                        None, None))
            self.last_step_end[idx] = attr
            c.device_total = total
            c.new_step()

    def _restart(self, buf):
        """Start the ring buffer afresh (and larger when a read found it too small), so that the
        next read copies only the next step's entries. Entries the allocator made between the last
        read and the clear are gone: a second read right after the clear converts what came since
        and compares the layout with the allocator's; where they differ, the snapshot wins."""
        if self.grow_to and self.grow_to > self.capacity:
            self.capacity = self.grow_to
            log.info("%s allocator trace: ring buffer grown to %d entries", self.kind, self.capacity)
        self.grow_to = None
        try:
            self._enable(clear=True)
            snap = self.mem._snapshot()
        except Exception as e:
            log.warning("could not restart the %s allocator trace: %s", self.kind, e)
            return
        rows: list = []
        segs_of = self._by_device(snap)
        for idx, trace in enumerate(snap.get("device_traces") or []):
            cur = self.cursors[idx] = TraceCursor()
            new, _lost = cur.new(trace)
            if idx not in self.conv and not new:
                continue
            c = self._converter(idx)
            c.convert(new, rows)
            if c.differs(segs_of.get(idx, [])):
                self.window_resyncs += 1
                c.resync(segs_of.get(idx, []), time_ns(), rows)
        self._emit(rows)
        if rows:
            n = len(buf)
            buf[:n] = list(heapq.merge(buf[:n], rows, key=_ts))

    def live_alloc_ids(self) -> set:
        ids: set = set()
        for c in self.conv.values():
            ids |= c.live_alloc_ids()
        return ids


def _max_split(settings) -> int | None:
    v = settings.get("max_split_size")
    try:
        v = int(v)
    except (TypeError, ValueError):
        return None
    return None if v <= 0 or v >= (1 << 62) else v
