"""The caching allocator's trace -> dump rows, on CPU: synthetic TraceEntry sequences (the shape of
torch/cuda/memory.py), recorded traces under tests/data/ when a GPU has made some, a fake allocator
behind the live source, fragmentation on hand-made layouts. Hardware tests skip without CUDA."""
import glob
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import polars as pl
import pytest
import torch

from conftest import FULL, check_invariants, read

from msmemscope.analysis import fragmentation as fr
from msmemscope.analysis.oom import report_lines
from msmemscope.capture import cuda_source
from msmemscope.capture.cuda_allocator import AllocatorConverter, TraceCursor, free_regions, round_size
from msmemscope.io.writers import open_writer

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
S0 = 0x7F0000000000   # a small (2 MiB) segment
L0 = 0x7F1000000000   # a large (20 MiB) segment
V0 = 0x7F2000000000   # an expandable segment's virtual range


class Clock:
    def __init__(self):
        self.t = 1_700_000_000_000_000

    def __call__(self, action, addr=None, size=0, stream=0, **kw):
        self.t += 3
        e = {"action": action, "size": size, "stream": stream, "time_us": self.t, "frames": [], **kw}
        if addr is not None:
            e["addr"] = addr
        return e


def convert(entries, conv=None, **kw):
    conv = conv or AllocatorConverter("0", **kw)
    rows = conv.convert(entries, [])
    return conv, rows


def write_and_read(tmp_path, rows, fmt="csv"):
    w = open_writer(fmt, str(tmp_path / f"memscope_dump_{fmt}"))
    ts = rows[-1][3] + 1 if rows else 1
    # the closing boundary ends the step after the rows' own last one (the dump numbers them in order)
    ended = [r[7]["step"] for r in rows if r[0] == "SYSTEM" and r[1] == "STEP"]
    step = ("SYSTEM", "STEP", "N/A", ts, 1, "0", None, {"step": (ended[-1] + 1) if ended else 1}, None, None)
    w.write(list(rows) + [step], 1, os.getpid(), None)
    w.close()
    return read(w.path)


def mem(rows, ev=None, pool="PTA"):
    return [r for r in rows if r[1] == pool and (ev is None or r[0] == ev)]


# ---------------------------------------------------------------------------- blocks and segments
def test_small_and_large_pool_blocks_get_the_allocators_sizes(tmp_path):
    e = Clock()
    seq = [e("segment_alloc", S0, 2 * MiB), e("alloc", S0, 1000), e("alloc", S0 + 1024, 600),
           # a request that leaves < 512 bytes of the small segment takes the rest of it
           e("alloc", S0 + 2048, 2 * MiB - 2048 - 100),
           e("segment_alloc", L0, 20 * MiB), e("alloc", L0, int(19.5 * MiB)),  # remainder 0.5 MiB: not split
           e("free_requested", L0, int(19.5 * MiB)), e("free_completed", L0, int(19.5 * MiB)),
           e("alloc", L0, 5 * MiB + 1),                                     # remainder ~15 MiB: split
           e("free_requested", S0, 1000), e("free_completed", S0, 1000)]
    conv, rows = convert(seq)
    sizes = [r[7]["size"] for r in mem(rows, "MALLOC")]
    assert sizes == [1024, 1024, 2 * MiB - 2048, 20 * MiB, 5 * MiB + 512]
    assert [r[7]["requested_size"] for r in mem(rows, "MALLOC")][:2] == [1000, 600]
    segs = mem(rows, "MALLOC", "HAL")
    assert [r[7]["size"] for r in segs] == [2 * MiB, 20 * MiB] and all(r[7]["alloc_type"] == "alloc" for r in segs)
    last = rows[-1][7]
    assert last["used"] == 1024 + (2 * MiB - 2048) + 5 * MiB + 512 == conv.used
    assert last["total"] == 22 * MiB == conv.reserved
    assert not any(r[7].get("deferred") for r in mem(rows, "FREE"))   # freed at once
    assert conv.counts["inferred_sizes"] == 0
    df = write_and_read(tmp_path, rows)
    live = check_invariants(df)
    assert sorted(live.values()) == sorted([1024, 2 * MiB - 2048, 5 * MiB + 512, 2 * MiB, 20 * MiB])
    hal = df.filter(pl.col("event_type") == "HAL")
    assert hal["total"].max() == 22 * MiB


def test_record_stream_free_is_written_when_the_allocator_completes_it(tmp_path):
    e = Clock()
    seq = [e("segment_alloc", L0, 20 * MiB, stream=7), e("alloc", L0, 4 * MiB, stream=7),
           e("free_requested", L0, 4 * MiB, stream=7),          # the block was used on another stream
           e("alloc", L0 + 4 * MiB, 2 * MiB, stream=7),          # the allocator goes on meanwhile
           e("free_completed", L0, 4 * MiB, stream=7)]          # the other stream's event completed
    conv, rows = convert(seq)
    m1, m2 = mem(rows, "MALLOC")
    [f] = mem(rows, "FREE")
    assert f[7]["deferred"] is True and f[7]["requested_ts"] == seq[2]["time_us"] * 1000
    assert f[3] == seq[4]["time_us"] * 1000 and f[7]["allocation_id"] == m1[7]["allocation_id"]
    assert m2[7]["used"] == 6 * MiB          # the block still holds its memory until the free completes
    assert m1[7]["stream"] == 7 and f[7]["stream"] == 7
    assert f[7]["used"] == 2 * MiB and conv.deferred_pending == 0
    check_invariants(write_and_read(tmp_path, rows, "db"))


def test_deferred_free_pending_across_drains_counts_as_requested():
    e = Clock()
    conv, rows = convert([e("segment_alloc", L0, 20 * MiB), e("alloc", L0, 4 * MiB), e("free_requested", L0, 4 * MiB)])
    assert conv.used == 4 * MiB and conv.deferred_pending == 4 * MiB   # memory_allocated() would say 0
    rows2 = conv.convert([e("free_completed", L0, 4 * MiB)], [])
    assert rows2[0][7]["deferred"] is True and conv.used == 0 == conv.deferred_pending


def test_segment_free_and_empty_cache(tmp_path):
    e = Clock()
    seq = [e("segment_alloc", S0, 2 * MiB), e("alloc", S0, 100), e("free_requested", S0, 100),
           e("free_completed", S0, 100), e("segment_free", S0, 2 * MiB), e("segment_alloc", S0, 2 * MiB),
           e("alloc", S0, 100)]
    conv, rows = convert(seq)
    hal = mem(rows, pool="HAL")
    assert [(r[0], r[7]["used"]) for r in hal] == [("MALLOC", 2 * MiB), ("FREE", 0), ("MALLOC", 2 * MiB)]
    assert hal[0][7]["allocation_id"] == hal[1][7]["allocation_id"] != hal[2][7]["allocation_id"]
    check_invariants(write_and_read(tmp_path, rows))


def test_expandable_segments_map_and_unmap(tmp_path):
    e = Clock()
    seq = [e("segment_map", V0, 4 * MiB), e("alloc", V0, 3 * MiB),
           e("segment_map", V0 + 4 * MiB, 2 * MiB),
           e("alloc", V0 + 3 * MiB, int(2.5 * MiB)),            # spans two mapped ranges
           e("free_requested", V0 + 3 * MiB, int(2.5 * MiB)), e("free_completed", V0 + 3 * MiB, int(2.5 * MiB)),
           e("segment_unmap", V0 + 2 * MiB, 4 * MiB)]           # part of the first range, all of the second
    conv, rows = convert(seq, expandable=True)
    assert [r[7]["size"] for r in mem(rows, "MALLOC")] == [3 * MiB, int(2.5 * MiB)]
    hal = mem(rows, pool="HAL")
    assert all(r[7]["alloc_type"] == "create" for r in hal)
    assert [(r[0], r[7]["size"]) for r in hal] == [("MALLOC", 4 * MiB), ("MALLOC", 2 * MiB), ("FREE", 4 * MiB),
                                                   ("MALLOC", 2 * MiB), ("FREE", 2 * MiB)]
    assert hal[3][7]["remainder_of"] == hal[0][7]["allocation_id"]
    assert conv.reserved == 2 * MiB and rows[-1][7]["total"] == 2 * MiB
    check_invariants(write_and_read(tmp_path, rows))


def test_oom_entry_becomes_the_oom_rows_with_fragmentation():
    e = Clock()
    seq = [e("segment_alloc", L0, 20 * MiB), e("alloc", L0, 6 * MiB), e("alloc", L0 + 6 * MiB, 6 * MiB),
           e("free_requested", L0, 6 * MiB), e("free_completed", L0, 6 * MiB),
           e("oom", size=16 * MiB, device_free=3 * MiB)]
    seq[-1].pop("addr", None)
    conv, rows = convert(seq, oom_k=3, step=lambda: 4)
    conv.device_total = 80 << 30
    oom = [r for r in rows if r[0] == "OOM_DETAIL"]
    assert [r[1] for r in oom] == ["OOM_TRIGGER", "OOM_RECENT_ALLOC", "OOM_TOP_ALLOC"]
    t = oom[0][7]
    for k in ("size", "exception", "message", "device", "step", "used", "live_blocks", "live_bytes", "k"):
        assert k in t
    assert t["size"] == 16 * MiB and t["device_free"] == 3 * MiB and t["step"] == 4
    assert t["reserved"] == 20 * MiB and t["unallocated"] == 14 * MiB and t["largest_free"] == 8 * MiB
    assert t["segments_with_free"] == 1
    assert oom[2][7]["size"] == 6 * MiB and oom[2][7]["allocation_id"] == mem(rows, "MALLOC")[1][7]["allocation_id"]
    text = "\n".join(report_lines(conv.ooms[0]))
    assert "0.01 GiB reserved but unallocated in 1 segment(s); largest free block 0.01 GiB" in text
    # no OOM rows unless the OOM analysis is on, the account is still kept
    conv2, rows2 = convert(seq, oom_k=0)
    assert not [r for r in rows2 if r[0] == "OOM_DETAIL"] and len(conv2.ooms) == 1


def test_oom_account_says_what_lies_outside_the_allocator():
    e = Clock()
    conv = AllocatorConverter("0", oom_k=1)
    conv.device_total = 10 << 30
    conv.convert([e("segment_alloc", L0, 1 << 30), e("alloc", L0, 1 << 30)], [])
    conv.convert([e("oom", size=2 << 30, device_free=1 << 29)], [])
    t = conv.ooms[0]["trigger"]
    assert t["outside_allocator"] == (10 << 30) - (1 << 29) - (1 << 30)
    assert "8.50 GiB in use outside the caching allocator" in "\n".join(report_lines(conv.ooms[0]))


def test_attribution_and_unknown_entries():
    e = Clock()
    seq = [e("segment_alloc", S0, 2 * MiB), e("alloc", S0, 64), e("snapshot", 0, 0),
           e("free_completed", S0 + 4096, 64), e("segment_free", L0, 1), e("future_action", 1, 1)]
    conv = AllocatorConverter("0", attribute=lambda ts: ("aten::mm", 42) if ts >= seq[1]["time_us"] * 1000 else None)
    rows = conv.convert(seq, [])
    [m] = mem(rows, "MALLOC")
    assert m[2] == "aten::mm" and m[4] == 42
    assert conv.counts["unknown_free"] == 1 and conv.counts["unknown_segment"] == 1 and conv.counts["ignored"] == 2


def test_resync_from_snapshot_segments(tmp_path):
    e = Clock()
    conv, rows = convert([e("segment_alloc", S0, 2 * MiB), e("alloc", S0, 100), e("alloc", S0 + 512, 100)])
    snap = [{"device": 0, "address": S0, "total_size": 2 * MiB, "stream": 0,
             "blocks": [{"address": S0, "size": 512, "requested_size": 100, "state": "active_allocated"},
                        {"address": S0 + 512, "size": 512, "requested_size": 100, "state": "inactive"},
                        {"address": S0 + 1024, "size": 1024, "requested_size": 1000, "state": "active_awaiting_free"}]},
            {"device": 0, "address": L0, "total_size": 20 * MiB, "stream": 0,
             "blocks": [{"address": L0, "size": 20 * MiB, "requested_size": 19 * MiB, "state": "active_allocated"}]}]
    assert conv.check(snap) == 0
    conv.resync(snap, e("x")["time_us"] * 1000, rows)
    assert conv.used == 512 + 1024 + 20 * MiB and conv.reserved == 22 * MiB and conv.deferred_pending == 1024
    assert conv.counts["resyncs"] == 1
    fixed = [r for r in rows if r[7].get("origin") == "resync"]
    assert {(r[0], r[1]) for r in fixed} == {("FREE", "PTA"), ("MALLOC", "PTA"), ("MALLOC", "HAL")}
    check_invariants(write_and_read(tmp_path, rows))


def test_size_check_counts_each_wrong_block_once():
    e = Clock()
    conv, rows = convert([e("alloc", L0, 19 * MiB)])   # its segment came before the trace: size inferred
    assert conv.counts["inferred_sizes"] == 1 and rows[0][7]["size"] == 19 * MiB
    snap = [{"device": 0, "address": L0, "total_size": 20 * MiB, "stream": 0,
             "blocks": [{"address": L0, "size": 20 * MiB, "requested_size": 19 * MiB, "state": "active_allocated"}]}]
    assert conv.check(snap) == 1 and conv.check(snap) == 1
    assert conv.counts["size_mismatches"] == 1 and conv.differs(snap)


def test_round_size():
    assert [round_size(n) for n in (1, 511, 512, 513, 4096)] == [512, 512, 512, 1024, 4096]


# ---------------------------------------------------------------------------- the ring buffer cursor
def test_cursor_takes_each_entry_once_with_equal_times():
    c = TraceCursor()
    tr = [{"time_us": t} for t in (1, 2, 2)]
    new, lost = c.new(tr)
    assert new == tr and not lost
    tr2 = tr + [{"time_us": 2, "n": 1}, {"time_us": 3}]
    new, lost = c.new(tr2)
    assert new == tr2[3:] and not lost
    new, lost = c.new(tr2)
    assert new == [] and not lost


def test_cursor_detects_a_wrapped_buffer():
    c = TraceCursor()
    c.new([{"time_us": t} for t in (1, 2, 3)])
    new, lost = c.new([{"time_us": t} for t in (3, 4, 5)], capacity=3)   # 3 is still there: nothing lost
    assert [x["time_us"] for x in new] == [4, 5] and not lost
    new, lost = c.new([{"time_us": t} for t in (7, 8, 9)], capacity=3)   # 6 was overwritten
    assert lost and [x["time_us"] for x in new] == [7, 8, 9] and c.lost == 1


# ---------------------------------------------------------------------------- fragmentation
def test_fragmentation_figures_on_hand_made_layouts():
    segs = [(L0, 20 * MiB, "alloc"), (S0, 2 * MiB, "alloc")]
    blocks = [(L0, 1 * MiB, {"allocation_id": 1}), (L0 + 10 * MiB, 2 * MiB, {"allocation_id": 2}),
              (S0, 1 * MiB, None), (S0 + 1 * MiB, 1 * MiB, None)]
    f = fr.figures(segs, blocks)
    assert f["reserved"] == 22 * MiB and f["allocated"] == 5 * MiB and f["unallocated"] == 17 * MiB
    assert f["largest_free"] == 9 * MiB and f["segments_with_free"] == 1 and f["segments"] == 2
    assert f["pinned_segments"] == 1 and f["pinned"][0]["segment"] == "0x%x" % L0
    assert f["pinned"][0]["allocated"] == 3 * MiB and [b["allocation_id"] for b in f["pinned"][0]["blocks"]] == [2, 1]
    assert f["pinned_bytes"] == 17 * MiB
    # expandable: contiguous mapped ranges are one free space
    g = fr.figures([(V0, 2 * MiB, "create"), (V0 + 2 * MiB, 2 * MiB, "create")], [(V0, 512, None)])
    assert g["segments"] == 1 and g["largest_free"] == 4 * MiB - 512
    # a segment with nothing in it is free, not pinned
    h = fr.figures([(L0, 20 * MiB, "alloc")], [])
    assert h["largest_free"] == 20 * MiB and h["pinned_segments"] == 0
    assert free_regions([(S0, 2 * MiB, "alloc")], [(S0 + 512, 512)])[0][2] == [(S0, 512), (S0 + 1024, 2 * MiB - 1024)]


def test_fragmentation_online_and_offline_agree(tmp_path):
    e = Clock()
    seq = [e("segment_alloc", L0, 20 * MiB), e("alloc", L0, 2 * MiB), e("alloc", L0 + 2 * MiB, 2 * MiB),
           e("alloc", L0 + 4 * MiB, 12 * MiB), e("free_requested", L0 + 4 * MiB, 12 * MiB),
           e("free_completed", L0 + 4 * MiB, 12 * MiB), e("free_requested", L0, 2 * MiB),
           e("free_completed", L0, 2 * MiB), e("segment_alloc", S0, 2 * MiB), e("alloc", S0, 4000)]
    conv, rows = convert(seq)

    class S:
        step_no = 1
    sink = fr.FragmentationSink(S())
    sink.consume(rows, 1)
    sink.step_end(S(), 1)
    offline = fr.fragmentation(write_and_read(tmp_path, rows))
    assert len(offline) == 1 and len(sink.steps) == 1
    on, off = sink.steps[0], offline[0]
    for k in ("reserved", "allocated", "unallocated", "largest_free", "segments_with_free", "pinned_segments"):
        assert on[k] == off[k], k
    assert on["unallocated"] == conv.fragmentation()["unallocated"] == 20 * MiB - 4096   # 22 MiB less two blocks
    assert on["largest_free"] == 16 * MiB and on["pinned_segments"] == 2   # 10% and 0.2% used
    text = "\n".join(fr.summary_lines(sink.steps))
    assert "reserved but unallocated" in text and "largest free block 0.02 GiB" in text
    # the export for pytorch.org/memory_viz rebuilds the allocator's own segments from the HAL rows
    from msmemscope.report.export import memory_snapshot
    (tmp_path / "again").mkdir()
    snap = memory_snapshot(write_and_read(tmp_path / "again", rows))
    assert sorted(x["address"] for x in snap["segments"]) == sorted([L0, S0])
    assert not conv.differs(snap["segments"])


# ---------------------------------------------------------------------------- the live source, fake allocator
class FakeAllocator:
    """A toy caching allocator with PyTorch's trace, ring buffer and snapshot shapes, written
    independently of the converter: explicit block lists per segment, best fit among free blocks
    of the pool, split by the allocator's rule, merge with free neighbours on free, 2 MiB small
    and 20 MiB large segments."""

    def __init__(self, capacity=64):
        self.trace, self.capacity, self.next = [], capacity, 0
        self.t = time.time_ns() // 1000
        self.segs = []       # [addr, size, small, [[addr, size, req, state], ...]] (blocks in address order)
        self.enabled = False
        self.base = 0x7E0000000000
        self.tick = 0

    def _rec(self, action, addr, size):
        if not self.enabled:
            return
        self.tick += 1
        if self.tick % 2:
            self.t = max(self.t + 1, time.time_ns() // 1000)  # pairs of entries share a time stamp
        e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.t}
        if len(self.trace) < self.capacity:
            self.trace.append(e)
        else:
            self.trace[self.next] = e
            self.next = (self.next + 1) % self.capacity

    def _record_memory_history(self, enabled="all", context=None, stacks="python", max_entries=64, clear_history=False,
                               **kw):
        self.enabled = enabled is not None
        self.capacity = max_entries
        if clear_history:
            self.trace, self.next = [], 0

    def _snapshot(self):
        trace = self.trace[self.next:] + self.trace[:self.next]
        segs = [{"device": 0, "address": a, "total_size": s, "stream": 0,
                 "blocks": [{"address": b[0], "size": b[1], "requested_size": b[2], "state": b[3]} for b in blk]}
                for a, s, _small, blk in self.segs]
        return {"segments": segs, "device_traces": [list(trace)], "allocator_settings": {}}

    def malloc(self, req):
        size = round_size(req)
        small = size <= MiB
        best = None
        for seg in self.segs:
            if seg[2] != small:
                continue
            for k, b in enumerate(seg[3]):
                if b[3] == "inactive" and b[1] >= size and (best is None or b[1] < best[0][3][best[1]][1]):
                    best = (seg, k)
        if best is None:
            total = 2 * MiB if small else (20 * MiB if size < 10 * MiB else (size + 2 * MiB - 1) // (2 * MiB) * 2 * MiB)
            seg = [self.base, total, small, [[self.base, total, 0, "inactive"]]]
            self.base += total + 64 * MiB
            self.segs.append(seg)
            self._rec("segment_alloc", seg[0], total)
            best = (seg, 0)
        seg, k = best
        b = seg[3][k]
        rest = b[1] - size
        if rest >= 512 if small else rest > MiB:
            seg[3].insert(k + 1, [b[0] + size, rest, 0, "inactive"])
            b[1] = size
        b[2], b[3] = req, "active_allocated"
        self._rec("alloc", b[0], req)
        return b[0]

    def free(self, addr):
        for seg in self.segs:
            for k, b in enumerate(seg[3]):
                if b[0] == addr and b[3] == "active_allocated":
                    self._rec("free_requested", addr, b[2])
                    self._rec("free_completed", addr, b[2])
                    b[3] = "inactive"
                    blk = seg[3]
                    if k + 1 < len(blk) and blk[k + 1][3] == "inactive":
                        b[1] += blk.pop(k + 1)[1]
                    if k > 0 and blk[k - 1][3] == "inactive":
                        blk[k - 1][1] += blk.pop(k)[1]
                    return

    def empty_cache(self):
        for seg in list(self.segs):
            if len(seg[3]) == 1 and seg[3][0][3] == "inactive":
                self.segs.remove(seg)
                self._rec("segment_free", seg[0], seg[1])

    def allocated(self):
        return sum(b[1] for seg in self.segs for b in seg[3] if b[3] != "inactive")

    def reserved(self):
        return sum(seg[1] for seg in self.segs)


def test_block_sizes_follow_the_allocator_under_reuse(fakedev, tmp_path):
    """Random sizes, reuse of freed space, splits and merges, empty_cache: the converter's block sizes
    and layout stay the allocator's at every read."""
    import random
    rnd = random.Random(5)
    s = FakeSession()
    src = cuda_source.AllocatorSource(s, "fakedev", fakedev)
    src.capacity = 1 << 14
    src.start()
    live = []
    for i in range(400):
        r = rnd.random()
        if r < 0.55 or not live:
            size = rnd.choice([rnd.randint(1, 4096), rnd.randint(4096, MiB), rnd.randint(MiB, 12 * MiB),
                               rnd.randint(19 * MiB, 21 * MiB)])
            live.append(fakedev.malloc(size))
        else:
            fakedev.free(live.pop(rnd.randrange(len(live))))
        if i % 97 == 96:
            fakedev.empty_cache()
        if i % 50 == 49:
            src.drain_into(s.buf)
            [c] = src.conv.values()
            assert c.used == fakedev.allocated() and c.reserved == fakedev.reserved()
            assert not c.differs(fakedev._snapshot()["segments"])
    src.stop()
    [c] = src.conv.values()
    assert c.counts["size_mismatches"] == 0 and c.counts["inferred_sizes"] == 0 and src.lost == 0
    splits = sum(1 for r in s.buf if r[0] == "MALLOC" and r[1] == "PTA" and r[7]["size"] > round_size(r[7]["requested_size"]))
    assert splits > 0  # some blocks took a whole free block (the remainder too small to split)
    check_invariants(write_and_read(tmp_path, [r for r in s.buf if r[0] in ("MALLOC", "FREE")]))


class FakeSession:
    def __init__(self, analysis=("leaks",)):
        from msmemscope.options import Options
        self.opts = Options(analysis=analysis)
        self.lock = threading.RLock()
        self._next_alloc = 0
        self.step_no = 1
        self.buf = []
        self.sinks = []
        self.config = {}
        self.active = True
        self.emit_alloc = self.emit_free = True
        self.native, self.used, self.peak = None, {}, {}

    from msmemscope.capture.session import Session
    account = Session.account  # the real one count of bytes in use per (device, pool)
    del Session

    def new_alloc_id(self):
        with self.lock:
            self._next_alloc += 1
            return self._next_alloc


@pytest.fixture
def fakedev(monkeypatch):
    fake = FakeAllocator()

    class Mod:
        memory = fake

        @staticmethod
        def mem_get_info(i=None):
            return (80 << 30) - fake.reserved() - (500 << 20), 80 << 30

        @staticmethod
        def memory_reserved(i=None):
            return fake.reserved()

        @staticmethod
        def memory_allocated(i=None):
            return fake.allocated()
    monkeypatch.setattr(torch, "fakedev", Mod, raising=False)
    return fake


def test_live_source_drains_each_entry_once_and_matches_the_allocator(fakedev, tmp_path):
    s = FakeSession()
    pre = fakedev.malloc(3000)            # allocated before tracing: written as origin before_trace
    src = cuda_source.AllocatorSource(s, "fakedev", fakedev)
    src.capacity = 64
    src.start()
    assert src.installed and fakedev.enabled
    out, live = [], [pre]
    for step in range(1, 5):
        fakedev.t += 5
        fakedev.tick = 0  # the op starts before the allocator's next entry
        s.buf.append(("OP_LAUNCH", "ATEN_START", "aten::fake_op", fakedev.t * 1000, 77, "0", None, None,
                      None, None))
        for n in range(6 + step):
            live.append(fakedev.malloc((n + 1) * 300_000))
        for a in live[1:4]:
            fakedev.free(a)
        del live[1:4]
        s.buf.append(("OP_LAUNCH", "ATEN_END", "aten::fake_op", (fakedev.t + 1) * 1000, 77, "0", None, None,
                      None, None))
        src.drain_into(s.buf)
        src.drain_into(s.buf)             # a second read finds nothing new
        src.at_step_end(s.buf, step)
        snap = [r for r in s.buf if r[0] == "SNAPSHOT"][-1][7]
        assert snap["traced_allocated"] == fakedev.allocated() == snap["allocated"]
        assert snap["traced_reserved"] == fakedev.reserved()
        assert snap["outside_allocator"] == 500 << 20 and snap["step"] == step
        out += s.buf
        s.buf = []
        s.step_no += 1
    src.stop()
    out += s.buf
    assert not fakedev.enabled and s.config["allocator_trace"]["lost"] == 0
    mallocs = [r for r in out if r[0] == "MALLOC" and r[1] == "PTA"]
    assert mallocs[0][7]["origin"] == "before_trace"
    assert sum(1 for r in mallocs if r[2] == "aten::fake_op" and r[4] == 77) == len(mallocs) - 1
    rows = [r for r in out if r[0] != "SNAPSHOT" and r[0] != "OP_LAUNCH"]
    df = write_and_read(tmp_path, rows)
    live_ids = check_invariants(df)
    assert sum(v for k, v in live_ids.items()) == fakedev.allocated() + fakedev.reserved()


def test_attribution_of_an_op_open_across_reads_and_flushes(fakedev):
    s = FakeSession()
    src = cuda_source.AllocatorSource(s, "fakedev", fakedev)
    src.start()
    out = []

    def op_row(kind):
        fakedev.t += 5
        fakedev.tick = 0
        return ("OP_LAUNCH", kind, "aten::big_op", fakedev.t * 1000, 9, "0", None, None, None, None)

    s.buf.append(op_row("ATEN_START"))
    fakedev.malloc(1000)
    src.drain_into(s.buf)                  # a read between flushes (a step end, an OOM)
    src.drain_into(s.buf)
    src.drain_into(s.buf, flushing=True)   # the flush takes the buffer with the op still open
    out += s.buf
    s.buf = []
    fakedev.malloc(2000)
    s.buf.append(op_row("ATEN_END"))
    fakedev.t += 5
    fakedev.tick = 0
    fakedev.malloc(3000)                   # after the op: no op around it
    src.drain_into(s.buf, flushing=True)
    out += s.buf
    names = [(r[7]["requested_size"], r[2], r[4]) for r in out if r[0] == "MALLOC" and r[1] == "PTA"]
    assert names == [(1000, "aten::big_op", 9), (2000, "aten::big_op", 9), (3000, "N/A", threading.get_ident())]


def test_live_source_reports_a_wrapped_buffer_and_resyncs(fakedev, tmp_path):
    s = FakeSession()
    src = cuda_source.AllocatorSource(s, "fakedev", fakedev)
    src.capacity = 8
    src.start()
    live = [fakedev.malloc(1000 * (i + 1)) for i in range(20)]   # 20+ entries into a ring of 8
    for a in live[:5]:
        fakedev.free(a)
    src.drain_into(s.buf)
    assert src.lost == 1 and src.grow_to == 32
    src.at_step_end(s.buf, 1)                                 # grows the ring buffer, resyncs
    assert src.capacity == 32 and fakedev.capacity == 32
    [c] = src.conv.values()
    assert c.used == fakedev.allocated() and c.reserved == fakedev.reserved()
    fakedev.malloc(5000)
    src.drain_into(s.buf)
    assert c.used == fakedev.allocated() and src.lost == 1
    src.stop()
    rep = s.config["allocator_trace"]
    assert rep["lost"] == 1 and rep["ring_buffer_entries"] == 32
    check_invariants(write_and_read(tmp_path, [r for r in s.buf if r[0] in ("MALLOC", "FREE")]))


def test_live_source_clears_at_step_end_and_catches_what_the_clear_dropped(fakedev, tmp_path):
    s = FakeSession()
    src = cuda_source.AllocatorSource(s, "fakedev", fakedev)
    src.start()
    keep = [fakedev.malloc(5000), fakedev.malloc(3 * MiB)]
    src.at_step_end(s.buf, 1)
    assert fakedev.trace == [] and src.window_resyncs == 0   # cleared: the next read copies one step
    real = src._record  # the history API under the source's watch on the program's own calls

    def racing(*a, **k):  # another thread allocates between the read and the clear
        keep.append(fakedev.malloc(7000))
        fakedev.free(keep.pop(0))
        real(*a, **k)
    src._record = racing
    fakedev.malloc(100)
    src.at_step_end(s.buf, 2)
    [c] = src.conv.values()
    assert src.window_resyncs == 1 and c.used == fakedev.allocated() and c.reserved == fakedev.reserved()
    src._record = real
    src.stop()
    assert s.config["allocator_trace"]["window_resyncs"] == 1
    check_invariants(write_and_read(tmp_path, [r for r in s.buf if r[0] in ("MALLOC", "FREE")]))


def test_live_source_leaves_the_programs_own_history_alone(fakedev):
    s = FakeSession()
    src = cuda_source.AllocatorSource(s, "fakedev", fakedev)
    src.start()
    fakedev.malloc(5000)
    fakedev._record_memory_history("all", max_entries=1000)   # the program wants its own history
    fakedev.malloc(7000)
    src.at_step_end(s.buf, 1)
    assert len(fakedev.trace) == 3 and fakedev.capacity == 1000   # not cleared, not resized
    [c] = src.conv.values()
    assert c.used == fakedev.allocated()
    src.stop()
    assert fakedev.enabled and s.config["allocator_trace"]["program_owned_history"] is True


def test_live_source_oom_goes_to_the_oom_analysis(fakedev, capsys):
    from msmemscope.analysis.oom import OomSink
    s = FakeSession(analysis=("oom",))
    s.opts.oom_k = 2
    s.flush = lambda: None
    s.live, s.used, s.tls, s.kind, s.op_device, s.closed = {}, {}, threading.local(), "fakedev", "0", False
    sink = OomSink.__new__(OomSink)
    sink.k, sink.events, sink._last_exc, sink._observed, sink._session = 2, [], None, None, s
    s.sinks = [sink]
    src = s.device_source = cuda_source.AllocatorSource(s, "fakedev", fakedev)
    src.start()
    fakedev.malloc(30 * MiB)

    def oom(size):
        fakedev._rec("oom", 0, size)
        fakedev.trace[-1]["device_free"] = fakedev.trace[-1].pop("addr")
    # CUDA: the allocator's observer fires first, the exception reaches the op after it
    oom(90 << 30)
    sink._cuda_observer(0, 90 << 30, 30 * MiB, 0)
    exc1 = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 90.00 GiB. GPU 0")  # kept: ids differ
    sink.op_failed(s, "aten::empty", exc1)
    assert len(sink.events) == 1 and sink.events[0]["trigger"]["size"] == 90 << 30
    assert [r[1] for r in s.buf if r[0] == "OOM_DETAIL"] == ["OOM_TRIGGER", "OOM_RECENT_ALLOC", "OOM_TOP_ALLOC"]
    # NPU: no observer; the op's exception drains the trace, which holds the OOM: one account, the trace's
    oom(1 << 30)
    sink.op_failed(s, "aten::empty", torch.OutOfMemoryError("NPU 0 out of memory. Tried to allocate 1.00 GiB"))
    assert len(sink.events) == 2 and sink.events[1]["trigger"]["source"] == "allocator_trace"
    assert sink.events[1]["trigger"]["live_blocks"] == 1
    assert "reserved but unallocated" in capsys.readouterr().err


def test_leak_rule_leaves_cached_segments_out(tmp_path):
    from msmemscope.analysis.leaks import step_leaks
    e = Clock()
    rows = []
    conv = AllocatorConverter("0", step=lambda: len([r for r in rows if r[1] == "STEP"]) + 1)

    def step(n):
        rows.append(("SYSTEM", "STEP", "N/A", e("x")["time_us"] * 1000, 1, "0", None, {"step": n}, None, None))
    step(1)
    conv.convert([e("segment_alloc", L0, 20 * MiB), e("alloc", L0, 4 * MiB)], rows)   # step 2: both stay
    step(2)
    step(3)
    df = write_and_read(tmp_path, rows)
    check_invariants(df)
    assert [(lk["pool"], lk["size"]) for lk in step_leaks(df)] == [("PTA", 4 * MiB)]


@pytest.mark.parametrize("source", ["auto"] + (["python"] if FULL else []))  # the dispatch source: long form
def test_session_with_the_allocator_source_end_to_end(tmp_path, source):
    """A real Session (CPU training, its own sources) with the allocator-trace source on a fake device:
    the session's wiring (drain at flush, Step End snapshots, OOM, fragmentation sink, config)."""
    out = tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {HERE!r})
        from test_cuda_conversion import FakeAllocator, MiB
        import msmemscope.capture as cap
        from msmemscope.capture import cuda_source
        from msmemscope.capture.session import Session
        from msmemscope.options import Options
        fake = FakeAllocator(capacity=256)

        class Mod:
            memory = fake
            mem_get_info = staticmethod(lambda i=None: ((80 << 30) - fake.reserved() - (1 << 29), 80 << 30))
            memory_reserved = staticmethod(lambda i=None: fake.reserved())
            memory_allocated = staticmethod(lambda i=None: fake.allocated())
        torch.fakedev = Mod
        s = cap._session = Session(Options(output={str(out)!r}, analysis=("leaks", "oom")))
        s.device_source = cuda_source.AllocatorSource(s, "fakedev", fake)
        s.start()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        held, checks = [], []
        for step in range(4):
            loss = model(torch.randn(8, 16)).square().mean()
            held += [fake.malloc((step + 1) * 700_000), fake.malloc(3000)]
            loss.backward()
            fake.free(held.pop(0))
            opt.step()
            opt.zero_grad()
            a = s.device_source.last_step_end.get(0)
            if a is not None:  # the first optimizer step's end is held until the second (the step rule)
                checks.append([a["traced_allocated"], fake.allocated(), a["traced_reserved"], fake.reserved(),
                               s.used.get(("0", "PTA")), s.used.get(("0", "HAL"))])
        peak_seen = s.peak.get(("0", "PTA"))
        fake._rec("oom", 0, 99 << 30)
        fake.trace[-1]["device_free"] = fake.trace[-1].pop("addr")
        s.device_source.on_oom()
        s.close()
        print("CHECKS " + json.dumps(checks))
        print("PEAK " + json.dumps(peak_seen))
    """))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), MSMEMSCOPE_WRITER="inline", MSMEMSCOPE_SOURCE=source)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    checks = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("CHECKS ")][0][7:])
    assert len(checks) >= 3 and all(c[0] == c[1] and c[2] == c[3] for c in checks), checks
    # the session's one count per (device, pool) is the allocator's: blocks (PTA) and segments (HAL)
    assert all(c[4] == c[1] and c[5] == c[3] for c in checks), checks
    peak = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("PEAK ")][0][5:])
    [folder] = glob.glob(str(out / "msmemscope_*"))
    [dump] = glob.glob(os.path.join(folder, "device_*", "dump", "*.csv"))
    df = read(dump)
    check_invariants(df)
    pta = df.filter((pl.col("event") == "MALLOC") & (pl.col("event_type") == "PTA") & (pl.col("device") == "0"))
    assert peak == pta["used"].max()  # the session's peak is the dump's
    assert pta.height == 8 and df.filter(pl.col("event_type") == "HAL").height >= 2
    assert df.filter(pl.col("event") == "MALLOC").filter(pl.col("device") == "cpu").height > 0  # the CPU side too
    snaps = df.filter((pl.col("event") == "SNAPSHOT") & (pl.col("name") == "Step End"))
    assert snaps.height == 4
    assert df.filter(pl.col("event_type") == "OOM_TRIGGER").height == 1
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["allocator_trace"]["lost"] == 0 and cfg["allocator_trace"]["ooms"] == 1
    frag = json.load(open(os.path.join(folder, "analysis", "fragmentation.json")))
    assert [s_["step"] for s_ in frag["steps"]] == [1, 2, 3, 4]
    assert frag["steps"][-1]["reserved"] == checks[-1][3]
    last = frag["steps"][-1]
    assert last["outside_allocator"] == 1 << 29 and last["device_total"] == 80 << 30
    assert last["headroom"] == (80 << 30) - (1 << 29) - last["step_peak_reserved"]
    offline = fr.fragmentation(df)   # the same figures from the dump alone
    keys = ("reserved", "unallocated", "largest_free", "pinned_segments", "headroom", "outside_allocator")
    assert [{k: x[k] for k in keys} for x in offline] == [{k: x[k] for k in keys} for x in frag["steps"]]
    assert "GiB headroom of 80.00 GiB" in r.stderr and "0.50 GiB in use outside the caching allocator" in r.stderr
    oom = json.load(open(os.path.join(folder, "analysis", "oom.json")))
    assert oom["events"][0]["trigger"]["size"] == 99 << 30
    assert "Fragmentation on device 0" in r.stderr and "reserved but unallocated" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None, reason="torch_npu is not installed")
def test_npu_offers_the_allocator_history():
    import torch_npu  # noqa: F401
    mem, why = cuda_source.memory_module("npu")
    assert mem is not None, why


def test_device_source_choice_says_why_not():
    from msmemscope.options import Options
    assert cuda_source.unsupported_by(Options()) is None
    assert "access" in cuda_source.unsupported_by(Options(events=("alloc", "free", "access")))
    mem, why = cuda_source.memory_module("npu")
    if getattr(torch, "npu", None) is None:
        assert mem is None and "torch.npu" in why


# ---------------------------------------------------------------------------- recorded traces, hardware
RECORDED = sorted(glob.glob(os.path.join(HERE, "data", "cuda_traces", "*.json")))


@pytest.mark.skipif(not RECORDED, reason="no recorded GPU allocator traces yet (bench/gpu_check.py writes them)")
@pytest.mark.parametrize("path", RECORDED, ids=os.path.basename)
def test_recorded_gpu_traces_convert_to_valid_dumps(path, tmp_path):
    with open(path) as f:
        rec = json.load(f)
    conv = AllocatorConverter("0", expandable=bool(rec.get("allocator_settings", {}).get("expandable_segments")))
    rows = []
    conv.resync(rec.get("segments_before", []), 1, rows, "before_trace")
    conv.convert(rec["entries"], rows)
    assert conv.used - conv.deferred_pending == rec["memory_allocated"]
    assert conv.reserved == rec["memory_reserved"]
    assert conv.check(rec["segments_after"]) == 0
    check_invariants(write_and_read(tmp_path, rows))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the hardware path runs in bench/gpu_check.py)")
def test_cuda_allocator_source_on_hardware(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(HERE, "..", "bench", "gpu_check.py"), "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
