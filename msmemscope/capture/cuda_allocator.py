"""The caching allocator's own event stream (CUDA; Ascend NPU through torch_npu) as dump rows.

Input: trace entries in the shape ``torch.cuda.memory._snapshot()["device_traces"][d]`` gives
(``TraceEntry`` in torch/cuda/memory.py): dicts with ``action`` (alloc, free_requested,
free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom, snapshot),
``addr`` (``device_free`` instead for oom), ``size``, ``stream``, ``time_us`` and optionally
``frames``. Optionally the snapshot's ``segments`` (each with ``address``, ``total_size``,
``stream``, ``blocks`` of ``address``, ``size``, ``requested_size``, ``state``) to start from
or to re-synchronize with.

Output: raw row tuples (see session.py) for one device (Attr dicts; ``addr`` an int, written as hex):
- pool ``PTA``: one MALLOC per ``alloc``, one FREE per ``free_completed`` (the block is reusable
  only then; a free that waited on ``record_stream`` events carries ``deferred: true`` and the
  time of the request, ``requested_ts``). ``size`` is the allocator's block size, ``used`` the
  bytes in active blocks (allocated, or freed and waiting on another stream), ``total`` the
  reserved bytes; Attr also has ``requested_size`` and ``stream``.
- pool ``HAL`` (the original tool's name for driver allocations under the caching allocator):
  one MALLOC/FREE per segment: ``segment_alloc``/``segment_free`` (``alloc_type: "alloc"``,
  cudaMalloc) and, with expandable segments, ``segment_map``/``segment_unmap``
  (``alloc_type: "create"``, cuMemCreate+cuMemMap). HAL ``used`` == ``total`` == reserved bytes.
  An unmap of part of a mapped range frees the range and allocates the pieces that stay mapped.
- ``oom``: OOM_DETAIL rows (OOM_TRIGGER, OOM_RECENT_ALLOC, OOM_TOP_ALLOC; the keys of
  analysis/oom.py) with the allocator's view: reserved, unallocated, largest free block.

The trace gives requested sizes; the block size (what ``memory_allocated()`` counts) follows from
the allocator's rules applied to the segment layout this converter keeps: the request rounded up
to 512 bytes, and the whole free block when the remainder is too small to split (small pool,
expandable segments: < 512 bytes; large pool: <= 1 MiB). A snapshot's segments check it
(``check(segments)``) and, after a lost stretch of the trace, set it right (``resync``).

Plain Python, no torch import: fed by recorded sequences in tests, by the live source
(``cuda_source.py``) in a run.
"""
from __future__ import annotations

import bisect
import heapq
import threading

from ..events import NA, Event, Oom, Pool

HAL = "HAL"
MIN_BLOCK = 512           # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 1 << 20      # kSmallSize: requests up to it come from the small pool (2 MiB segments)
MB = 1048576.0
GiB = float(1 << 30)


def round_size(size: int) -> int:
    """The caching allocator's default rounding (no roundup_power2_divisions configured)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


class _Seg:
    __slots__ = ("addr", "size", "alloc_id", "kind", "stream")

    def __init__(self, addr, size, alloc_id, kind, stream):
        self.addr, self.size, self.alloc_id, self.kind, self.stream = addr, size, alloc_id, kind, stream


class _Blk:
    __slots__ = ("alloc_id", "addr", "size", "requested", "stream", "ts", "op", "tid", "step", "free_req", "inferred")

    def __init__(self, alloc_id, addr, size, requested, stream, ts, op, tid, step, inferred):
        self.alloc_id, self.addr, self.size, self.requested, self.stream = alloc_id, addr, size, requested, stream
        self.ts, self.op, self.tid, self.step = ts, op, tid, step
        self.free_req = None   # (ts, index of the free_requested entry) once a free was asked for
        self.inferred = inferred


def free_regions(segments, blocks):
    """Free byte ranges of a layout. ``segments``: (addr, size, kind) with kind "create" for mapped
    ranges of an expandable segment (contiguous ones form one region); ``blocks``: (addr, size) of
    the active blocks. Returns [(region_addr, region_size, [(free_addr, free_size), ...])]."""
    regions = []
    for addr, size, kind in sorted(segments):
        if regions and kind == "create" and regions[-1][2] == "create" and regions[-1][0] + regions[-1][1] == addr:
            regions[-1][1] += size
        else:
            regions.append([addr, size, kind])
    starts = [r[0] for r in regions]
    used: dict = {}
    for a, s in blocks:
        i = bisect.bisect_right(starts, a) - 1
        if i >= 0 and a < regions[i][0] + regions[i][1]:
            used.setdefault(i, []).append((a, s))
    out = []
    for i, (ra, rs, _k) in enumerate(regions):
        gaps, pos = [], ra
        for a, s in sorted(used.get(i, ())):
            if a > pos:
                gaps.append((pos, a - pos))
            pos = max(pos, a + s)
        if pos < ra + rs:
            gaps.append((pos, ra + rs - pos))
        out.append((ra, rs, gaps))
    return out


class AllocatorConverter:
    """Allocator trace entries of one device -> raw rows, keeping the segment layout.

    ``next_id()`` gives allocation ids (shared with the session's other sources); ``attribute(ts)``
    gives ``(op_name, tid)`` for an event time (the top-level op running then), or None;
    ``step()`` the current step number; ``oom_k``: OOM rows list that many blocks (0: no OOM rows).
    ``account(device, pool, delta)`` applies a change of bytes in use and returns the count after it:
    the session's one count per (device, pool) in a traced run; a count of its own when alone.
    """

    def __init__(self, device: str, next_id=None, attribute=None, step=None, oom_k: int = 10,
                 expandable: bool = False, max_split_size: int | None = None, account=None):
        self.device = str(device)
        if next_id is None:
            counter = iter(range(1, 1 << 62))
            next_id = counter.__next__
        self.next_id = next_id
        self.attribute = attribute
        self.step = step or (lambda: 1)
        self.oom_k = oom_k
        self.expandable = expandable
        self.max_split = max_split_size
        self.segs: dict = {}        # addr -> _Seg
        self.seg_starts: list = []
        self.blocks: dict = {}      # addr -> _Blk (allocated, or freed and waiting on a stream)
        self.blk_starts: list = []
        self.used = 0               # bytes in active blocks
        self.reserved = 0
        self.peak = 0
        self.deferred_pending = 0   # bytes freed by the program but not yet reusable (record_stream)
        self.counts = {"unknown_free": 0, "unknown_segment": 0, "inferred_sizes": 0, "ignored": 0,
                       "size_mismatches": 0, "resyncs": 0, "ooms": 0}
        self.ooms: list = []        # the OOM accounts (dicts as analysis/oom.py lists them)
        self._tid = threading.get_ident()
        self._n = 0                 # entries converted so far
        self._batch = 0             # convert() calls so far
        self._last_ts = 0
        self._mismatched: set = set()
        self.ooms_passed = 0        # OOM accounts handed to the OOM analysis
        self.device_total = None    # the device's capacity, when the live source knows it
        self.step_peak_allocated = 0
        self.step_peak_reserved = 0
        self._account = account or self._own_count
        self._own: dict = {}

    def _own_count(self, device, pool, delta):
        v = self._own[pool] = self._own.get(pool, 0) + delta
        return v

    # ------------------------------------------------------------------ layout
    def _seg_at(self, addr):
        i = bisect.bisect_right(self.seg_starts, addr) - 1
        if i < 0:
            return None, i
        s = self.segs[self.seg_starts[i]]
        return (s, i) if addr < s.addr + s.size else (None, i)

    def _region_end(self, seg, i):
        end = seg.addr + seg.size
        if seg.kind == "create":  # mapped ranges of one expandable segment are one free space
            j = i + 1
            while j < len(self.seg_starts):
                n = self.segs[self.seg_starts[j]]
                if n.kind != "create" or n.addr != end:
                    break
                end = n.addr + n.size
                j += 1
        return end

    def block_size(self, addr: int, requested: int):
        """(block size, inferred-without-layout) for an allocation at ``addr``."""
        rounded = round_size(requested)
        seg, i = self._seg_at(addr)
        if seg is None:
            return rounded, True
        end = self._region_end(seg, i)
        j = bisect.bisect_right(self.blk_starts, addr)
        if j < len(self.blk_starts) and self.blk_starts[j] < end:
            end = self.blk_starts[j]
        avail = end - addr
        if avail < rounded:  # the layout does not hold the block: our view is off, keep the rounding
            return rounded, True
        remaining = avail - rounded
        if rounded <= SMALL_SIZE or self.expandable or seg.kind == "create":
            split = remaining >= MIN_BLOCK
        else:
            split = (self.max_split is None or rounded < self.max_split) and remaining > SMALL_SIZE
        return (rounded if split else avail), False

    def layout(self):
        """(segments, blocks) as ``free_regions`` takes them."""
        return ([(s.addr, s.size, s.kind) for s in self.segs.values()],
                [(b.addr, b.size) for b in self.blocks.values()])

    def fragmentation(self) -> dict:
        """Reserved but unallocated bytes, in how many segments, and the largest free block."""
        regions = free_regions(*self.layout())
        gaps = [g for _a, _s, gs in regions for g in gs]
        return {"reserved": self.reserved, "allocated": self.used,
                "unallocated": sum(s for _a, s in gaps),
                "segments": len(regions), "segments_with_free": sum(1 for _a, _s, gs in regions if gs),
                "largest_free": max((s for _a, s in gaps), default=0)}

    # ------------------------------------------------------------------ rows
    def _who(self, ts):
        if self.attribute is not None:
            hit = self.attribute(ts)
            if hit is not None:
                return hit
        return NA, self._tid

    def _malloc(self, out, b, extra=None):
        attr = {"allocation_id": b.alloc_id, "addr": b.addr, "size": b.size, "used": self.used,
                "total": self.reserved, "owner": "", "requested_size": b.requested, "stream": b.stream}
        if extra:
            attr.update(extra)
        out.append((Event.MALLOC, Pool.PTA, b.op, b.ts, b.tid, self.device, b.addr, attr, None, None))

    def _free(self, out, b, ts, extra=None):
        name, tid = self._who(ts)
        attr = {"allocation_id": b.alloc_id, "addr": b.addr, "size": b.size, "used": self.used,
                "total": self.reserved, "stream": b.stream}
        if extra:
            attr.update(extra)
        out.append((Event.FREE, Pool.PTA, name, ts, tid, self.device, b.addr, attr, None, None))

    def _seg_row(self, out, ev, s, ts, extra=None):
        attr = {"allocation_id": s.alloc_id, "addr": s.addr, "size": s.size, "used": self.reserved,
                "total": self.reserved, "alloc_type": s.kind, "stream": s.stream}
        if extra:
            attr.update(extra)
        name, tid = self._who(ts)
        out.append((ev, HAL, name, ts, tid, self.device, s.addr, attr, None, None))

    def _add_seg(self, out, addr, size, kind, stream, ts, extra=None):
        s = _Seg(addr, size, self.next_id(), kind, stream)
        self.segs[addr] = s
        bisect.insort(self.seg_starts, addr)
        self.reserved = self._account(self.device, HAL, size)
        if self.reserved > self.step_peak_reserved:
            self.step_peak_reserved = self.reserved
        self._seg_row(out, Event.MALLOC, s, ts, extra)
        return s

    def _drop_seg(self, out, s, ts, extra=None):
        del self.segs[s.addr]
        self.seg_starts.pop(bisect.bisect_left(self.seg_starts, s.addr))
        self.reserved = self._account(self.device, HAL, -s.size)
        self._seg_row(out, Event.FREE, s, ts, extra)

    def _add_block(self, out, addr, size, requested, stream, ts, name, tid, inferred, extra=None):
        b = _Blk(self.next_id(), addr, size, requested, stream, ts, name, tid, self.step(), inferred)
        if addr in self.blocks:  # the trace lost its free: the old block is gone
            self._drop_block(out, self.blocks[addr], ts, {"lost_free": True})
        self.blocks[addr] = b
        bisect.insort(self.blk_starts, addr)
        self.used = self._account(self.device, Pool.PTA, size)
        if self.used > self.peak:
            self.peak = self.used
        if self.used - self.deferred_pending > self.step_peak_allocated:
            self.step_peak_allocated = self.used - self.deferred_pending
        self._malloc(out, b, extra)
        return b

    def _drop_block(self, out, b, ts, extra=None):
        del self.blocks[b.addr]
        self.blk_starts.pop(bisect.bisect_left(self.blk_starts, b.addr))
        self.used = self._account(self.device, Pool.PTA, -b.size)
        if b.free_req is not None:
            self.deferred_pending -= b.size
        self._free(out, b, ts, extra)

    # ------------------------------------------------------------------ entries
    def convert(self, entries, out: list) -> list:
        """Append the rows of ``entries`` (in trace order) to ``out``; returns ``out``."""
        self._batch += 1
        for e in entries:
            self._n += 1
            i = self._n  # entries counted over every batch: a free completed right after its request
            act = e.get("action")
            # rows of one device keep the trace's order: times (whole microseconds) never go back,
            # also after a resync stamped with the reading's nanosecond time
            ts = int(e.get("time_us") or 0) * 1000
            if ts < self._last_ts:
                ts = self._last_ts
            self._last_ts = ts
            if act == "alloc":
                addr, req = int(e["addr"]), int(e["size"])
                size, inferred = self.block_size(addr, req)
                if inferred:
                    self.counts["inferred_sizes"] += 1
                name, tid = self._who(ts)
                self._add_block(out, addr, size, req, e.get("stream", 0), ts, name, tid, inferred)
            elif act == "free_requested":
                b = self.blocks.get(int(e["addr"]))
                if b is None:
                    self.counts["unknown_free"] += 1
                elif b.free_req is None:
                    b.free_req = (ts, i, self._batch)
                    self.deferred_pending += b.size
            elif act == "free_completed":
                b = self.blocks.get(int(e["addr"]))
                if b is None:
                    self.counts["unknown_free"] += 1
                    continue
                extra = None
                # the allocator writes an immediate free's two entries under one lock hold: adjacent,
                # and in one read; anything else waited on record_stream events
                if b.free_req is None or b.free_req[1] != i - 1 or b.free_req[2] != self._batch:
                    extra = {"deferred": True}
                    if b.free_req is not None:
                        extra["requested_ts"] = b.free_req[0]
                self._drop_block(out, b, ts, extra)
            elif act == "segment_alloc":
                self._add_seg(out, int(e["addr"]), int(e["size"]), "alloc", e.get("stream", 0), ts)
            elif act == "segment_map":
                self._add_seg(out, int(e["addr"]), int(e["size"]), "create", e.get("stream", 0), ts)
            elif act == "segment_free":
                s = self.segs.get(int(e["addr"]))
                if s is None:
                    self.counts["unknown_segment"] += 1
                    continue
                for b in [b for b in self.blocks.values() if s.addr <= b.addr < s.addr + s.size]:
                    self._drop_block(out, b, ts, {"lost_free": True})  # never happens on a whole trace
                self._drop_seg(out, s, ts)
            elif act == "segment_unmap":
                self._unmap(out, int(e["addr"]), int(e["size"]), ts)
            elif act == "oom":
                self._oom(out, e, ts)
            else:  # snapshot markers, actions of a newer torch
                self.counts["ignored"] += 1
        return out

    def _unmap(self, out, addr, size, ts):
        end = addr + size
        hit = [s for s in self.segs.values() if s.addr < end and addr < s.addr + s.size]
        if not hit:
            self.counts["unknown_segment"] += 1
            return
        for s in sorted(hit, key=lambda s: s.addr):
            self._drop_seg(out, s, ts)
            if s.addr < addr:
                self._add_seg(out, s.addr, addr - s.addr, s.kind, s.stream, ts, {"remainder_of": s.alloc_id})
            if end < s.addr + s.size:
                self._add_seg(out, end, s.addr + s.size - end, s.kind, s.stream, ts, {"remainder_of": s.alloc_id})

    def _oom(self, out, e, ts):
        self.counts["ooms"] += 1
        name, tid = self._who(ts)
        frag = self.fragmentation()
        device_free = e.get("device_free")
        k = self.oom_k
        live = list(self.blocks.values())
        trig = {"size": int(e.get("size") or 0), "exception": "OutOfMemoryError",
                "message": "caching allocator: out of memory", "device": self.device, "step": self.step(),
                "used": self.used, "live_blocks": len(live), "live_bytes": sum(b.size for b in live), "k": k,
                "source": "allocator_trace", "stream": e.get("stream", 0),
                "device_free": None if device_free is None else int(device_free),
                "reserved": frag["reserved"], "unallocated": frag["unallocated"],
                "segments_with_free": frag["segments_with_free"], "largest_free": frag["largest_free"]}
        if self.device_total and device_free is not None:
            trig["device_total"] = int(self.device_total)
            trig["outside_allocator"] = max(0, int(self.device_total) - int(device_free) - frag["reserved"])
        listed = {"trigger": {"op": name, **trig}, "recent": [], "top": []}
        rows = [(Event.OOM_DETAIL, Oom.TRIGGER, name, ts, tid, self.device, None, trig, None, None)]
        if k:
            for kind, blocks, key in ((Oom.RECENT, heapq.nlargest(k, live, key=lambda b: b.alloc_id), "recent"),
                                      (Oom.TOP, heapq.nlargest(k, live, key=lambda b: (b.size, -b.alloc_id)), "top")):
                for rank, b in enumerate(blocks, 1):
                    a = {"rank": rank, "allocation_id": b.alloc_id, "addr": "0x%016x" % b.addr, "size": b.size,
                         "step": b.step, "op": b.op, "owner": "", "python": None, "stream": b.stream}
                    rows.append((Event.OOM_DETAIL, kind, b.op or NA, ts, b.tid, self.device, b.addr, a, None, None))
                    listed[key].append(a)
        self.ooms.append(listed)
        if k:
            out.extend(rows)

    # ------------------------------------------------------------------ snapshot segments
    @staticmethod
    def _snap_layout(segments):
        segs, blocks = {}, {}
        for s in segments:
            kind = "create" if s.get("is_expandable") else "alloc"
            segs[int(s["address"])] = (int(s["total_size"]), kind, s.get("stream", 0))
            for b in s.get("blocks", ()):
                if b.get("state") in ("active_allocated", "active_awaiting_free"):
                    blocks[int(b["address"])] = (int(b["size"]), int(b.get("requested_size") or b["size"]),
                                                 b.get("state"), s.get("stream", 0))
        return segs, blocks

    def check(self, segments) -> int:
        """Compare the active blocks with a snapshot's: count (and return) the sizes that differ."""
        _segs, blocks = self._snap_layout(segments)
        bad = [b.alloc_id for a, b in self.blocks.items() if a in blocks and blocks[a][0] != b.size]
        new = set(bad) - self._mismatched
        self._mismatched |= new
        self.counts["size_mismatches"] += len(new)   # each block once, however often it is read
        return len(bad)

    def differs(self, segments) -> bool:
        """Whether the active blocks differ from a snapshot's (address and size)."""
        segs, blocks = self._snap_layout(segments)
        if len(blocks) != len(self.blocks):
            return True
        if not any(k == "create" for _s, k, _t in segs.values()) and sum(v[0] for v in segs.values()) != self.reserved:
            return True
        return any(blocks.get(a, (None,))[0] != b.size for a, b in self.blocks.items())

    def resync(self, segments, ts: int, out: list, why: str = "resync") -> list:
        """Make the layout the snapshot's: rows free what is gone and allocate what is new (marked
        ``origin``). At the start of tracing this writes what was allocated before it."""
        segs, blocks = self._snap_layout(segments)
        ts = max(ts, self._last_ts)
        self._last_ts = ts
        if self.segs or self.blocks:
            self.counts["resyncs"] += 1
        flag = {"origin": why}
        for a, b in list(self.blocks.items()):
            snap = blocks.get(a)
            if snap is None or snap[0] != b.size:
                self._drop_block(out, b, ts, flag)
        expandable = any(k == "create" for _s, k, _t in segs.values())
        if expandable:  # mapped pieces are not in the snapshot one by one: compare whole segments
            for s in list(self.segs.values()):
                self._drop_seg(out, s, ts, flag)
        for a, s in list(self.segs.items()):
            snap = segs.get(a)
            if snap is None or snap[0] != s.size:
                self._drop_seg(out, s, ts, flag)
        for a, (size, kind, stream) in sorted(segs.items()):
            if a not in self.segs:
                self._add_seg(out, a, size, kind, stream, ts, flag)
        for a, (size, req, state, stream) in sorted(blocks.items()):
            if a not in self.blocks:
                b = self._add_block(out, a, size, req, stream, ts, NA, self._tid, False, flag)
                if state == "active_awaiting_free":
                    b.free_req = (ts, -2, -1)
                    self.deferred_pending += size
        return out

    def new_step(self):
        """Peaks are per step (what max_memory_allocated() gives after a reset at each step start)."""
        self.step_peak_allocated = self.used - self.deferred_pending
        self.step_peak_reserved = self.reserved

    def live_alloc_ids(self) -> set:
        return {b.alloc_id for b in self.blocks.values()}


class TraceCursor:
    """Which entries of a ring-buffer trace are new since the last read, and whether some were
    lost (the buffer wrapped past the last entry read). Entries are in time order; several can
    share a ``time_us``, so the cursor keeps the last time and how many entries had it."""

    def __init__(self):
        self.last = None      # (time_us, entries seen with that time)
        self.lost = 0         # reads that found entries overwritten before they were read

    def new(self, trace: list, capacity: int | None = None) -> tuple[list, bool]:
        """(new entries, lost) for the trace as read now; ``capacity``: the ring buffer's size when
        known (a buffer read first after a clear can only tell a loss by being full)."""
        if not trace:
            return [], False
        if self.last is None:  # everything since the buffer was cleared: whole unless it filled up
            start = 0
            lost = capacity is not None and len(trace) >= capacity
        else:
            t0, seen = self.last
            times = [int(e.get("time_us") or 0) for e in trace]
            lo = bisect.bisect_left(times, t0)
            hi = bisect.bisect_right(times, t0)
            at = hi - lo
            if lo == 0 and (times[0] > t0 or at < seen):
                lost = True     # the oldest entry left is newer than the last one read (or was cleared)
                start = 0 if times[0] > t0 else hi
            else:
                lost = False
                start = lo + min(seen, at) if at else lo
        new = trace[start:]
        if new:
            t_last = int(new[-1].get("time_us") or 0)
            count = 0
            for e in reversed(trace):
                if int(e.get("time_us") or 0) != t_last:
                    break
                count += 1
            self.last = (t_last, count)
        if lost:
            self.lost += 1
        return new, lost
