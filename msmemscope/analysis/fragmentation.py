"""Fragmentation of a caching allocator's reserved memory, per step and device.

From the dump's rows alone: segments are the ``HAL`` pool's MALLOC/FREE rows (what the caching
allocator got from the driver, written by the allocator-trace source), blocks the ``PTA`` rows.
At each step end, per device:

- ``reserved`` − ``allocated`` = ``unallocated``: bytes the allocator holds but no block uses;
- ``largest_free``: the largest free range inside one segment (a request larger than it needs a
  new segment even when ``unallocated`` would cover it: the OOM that "should not" happen);
- ``pinned``: segments mostly empty (under a quarter in use) that ``empty_cache()`` cannot give
  back because some blocks still live in them, with those blocks.

Online: a sink the session adds whenever the allocator-trace source runs (prints a summary,
writes ``analysis/fragmentation.json``). Offline: ``fragmentation(df)`` over ``read_dump``'s
columns. Both use one ``LayoutTracker``. The OOM account's sentence comes from the same
figures (``capture.cuda_allocator.free_regions``).
"""
from __future__ import annotations

import json
import logging
import re
import sys

from ..capture.cuda_allocator import HAL, free_regions
from ..events import A_ADDR, A_ALLOC_ID, A_SIZE, ATTR, DEVICE, EVENT, EVENT_TYPE, NAME, Event, Pool

log = logging.getLogger("msmemscope")
GiB = float(1 << 30)
MiB = float(1 << 20)
PIN_FRACTION = 0.25
TOP = 5
_KIND = re.compile(r'"?alloc_type"?\s*:\s*"?(\w+)')


def figures(segments, blocks, pin_fraction: float = PIN_FRACTION, top: int = TOP) -> dict:
    """The figures of one layout. ``segments``: (addr, size, kind); ``blocks``: (addr, size, info)
    where info is a dict (allocation_id, op, step) or None."""
    regions = free_regions(segments, [(a, s) for a, s, _i in blocks])
    starts = sorted(r[0] for r in regions)
    import bisect
    inside: dict = {}
    for a, s, info in blocks:
        i = bisect.bisect_right(starts, a) - 1
        if i >= 0:
            inside.setdefault(starts[i], []).append((a, s, info))
    reserved = sum(r[1] for r in regions)
    unallocated = sum(s for _a, _s, gaps in regions for _g, s in gaps)
    largest = max((s for _a, _s, gaps in regions for _g, s in gaps), default=0)
    pinned = []
    for ra, rs, gaps in regions:
        held = inside.get(ra, [])
        used = sum(s for _a, s, _i in held)
        if held and used < pin_fraction * rs:
            pinned.append({"segment": "0x%x" % ra, "size": rs, "allocated": used,
                           "used_fraction": round(used / rs, 4) if rs else 0.0,
                           "blocks": [{"addr": "0x%x" % a, "size": s, **(info or {})}
                                      for a, s, info in sorted(held, key=lambda x: -x[1])[:top]]})
    pinned.sort(key=lambda p: p["allocated"] - p["size"])
    return {"reserved": reserved, "allocated": reserved - unallocated, "unallocated": unallocated,
            "segments": len(regions), "segments_with_free": sum(1 for r in regions if r[2]),
            "largest_free": largest, "pinned_segments": len(pinned),
            "pinned_bytes": sum(p["size"] - p["allocated"] for p in pinned), "pinned": pinned[:top]}


class LayoutTracker:
    """Segments and blocks per device, from MALLOC/FREE rows of the HAL and PTA pools."""

    def __init__(self):
        self.segs: dict = {}    # device -> {alloc_id: (addr, size, kind)}
        self.blocks: dict = {}  # device -> {alloc_id: (addr, size, info)}

    def row(self, event, pool, device, name, step, alloc_id, addr, size, kind=None):
        if pool == HAL:
            d = self.segs.setdefault(device, {})
            if event == "MALLOC":
                d[alloc_id] = (addr, size, kind or "alloc")
            else:
                d.pop(alloc_id, None)
        elif pool == "PTA" and device != "cpu":
            d = self.blocks.setdefault(device, {})
            if event == "MALLOC":
                d[alloc_id] = (addr, size, {"allocation_id": alloc_id, "op": name, "step": step})
            else:
                d.pop(alloc_id, None)

    def figures(self) -> dict:
        """device -> figures, for the devices whose segments are known."""
        return {dev: figures(list(segs.values()), list(self.blocks.get(dev, {}).values()))
                for dev, segs in self.segs.items() if segs}


def _attr_get(attr, key):
    if isinstance(attr, dict):
        return attr.get(key)
    return None


DEVICE_KEYS = ("total", "free", "outside_allocator", "headroom", "max_reserved", "max_allocated")


def _device_part(snap) -> dict:
    """The device's own figures from a "Step End" snapshot: capacity, free, what lies outside the
    allocator, and the headroom (capacity less that, less the step's peak reserved)."""
    return {("device_" + k if k in ("total", "free") else "step_peak_" + k[4:] if k.startswith("max_") else k):
            snap.get(k) for k in DEVICE_KEYS if k in snap}


class FragmentationSink:
    def __init__(self, session):
        self.t = LayoutTracker()
        self.steps: list = []
        self.session = session
        self.device: dict = {}   # device -> the figures of its last "Step End" snapshot

    def consume(self, rows, first_id):
        s = self.session
        for r in rows:
            ev = r[EVENT]
            if ev == Event.SNAPSHOT and r[NAME] == "Step End" and isinstance(r[ATTR], dict):
                self.device[str(r[DEVICE])] = _device_part(r[ATTR])
                continue
            if ev != Event.MALLOC and ev != Event.FREE:
                continue
            pool = r[EVENT_TYPE]
            if pool != HAL and (pool != Pool.PTA or r[DEVICE] == "cpu"):
                continue
            a = r[ATTR]
            if isinstance(a, tuple):
                aid, addr, size = a[A_ALLOC_ID], a[A_ADDR], a[A_SIZE]
            else:
                aid, addr, size = a.get("allocation_id"), a.get("addr"), a.get("size")
                addr = int(addr, 16) if isinstance(addr, str) else addr
            self.t.row(ev, pool, r[DEVICE], r[NAME], s.step_no, aid, addr, size, _attr_get(a, "alloc_type"))

    def step_end(self, session, step):
        for dev, f in sorted(self.t.figures().items()):
            self.steps.append({"step": step, "device": str(dev), **f, **self.device.get(str(dev), {})})

    def close(self, session):
        from .leaks import write_result
        result = {"analysis": "fragmentation", "pin_fraction": PIN_FRACTION, "steps": self.steps}
        write_result(session.folder, "fragmentation", result)
        for line in summary_lines(self.steps):
            print(line, file=sys.stderr)
            log.info("%s", line)


def summary_lines(steps) -> list[str]:
    """Per device: the step with the most reserved-but-unallocated bytes, and the last step."""
    lines = []
    by_dev: dict = {}
    for s in steps:
        by_dev.setdefault(s["device"], []).append(s)
    for dev, ss in sorted(by_dev.items()):
        worst = max(ss, key=lambda s: (s["unallocated"], s["step"]))
        for label, s in (("most unallocated", worst), ("last step", ss[-1])):
            pct = 100.0 * s["unallocated"] / s["reserved"] if s["reserved"] else 0.0
            line = (f"[msmemscope] Fragmentation on device {dev}, step {s['step']} ({label}): "
                    f"{s['unallocated'] / GiB:.2f} GiB reserved but unallocated ({pct:.1f}% of "
                    f"{s['reserved'] / GiB:.2f} GiB) in {s['segments_with_free']} segment(s); largest free block "
                    f"{s['largest_free'] / GiB:.2f} GiB")
            if s["pinned_segments"]:
                p = s["pinned"][0]
                b = p["blocks"][0] if p["blocks"] else {}
                line += (f"; {s['pinned_segments']} mostly empty segment(s) ({s['pinned_bytes'] / MiB:.1f} MiB "
                         f"idle) kept by live blocks, e.g. {p['size'] / MiB:.1f} MiB segment {p['segment']} "
                         f"{100 * p['used_fraction']:.0f}% used, held by allocation {b.get('allocation_id')} "
                         f"({b.get('op')}, step {b.get('step')})")
            lines.append(line)
            if worst is ss[-1]:
                break
        with_dev = [s for s in ss if s.get("headroom") is not None]
        if with_dev:
            low = min(with_dev, key=lambda s: (s["headroom"], -s["step"]))
            lines.append(f"[msmemscope] Device {dev} memory, step {low['step']} (least headroom): "
                         f"{low['headroom'] / GiB:.2f} GiB headroom of {low.get('device_total', 0) / GiB:.2f} GiB at the "
                         f"step's reserved peak ({low.get('step_peak_reserved', 0) / GiB:.2f} GiB); "
                         f"{low.get('outside_allocator', 0) / GiB:.2f} GiB in use outside the caching allocator "
                         f"(CUDA context, libraries, NCCL, other processes)")
    return lines


def fragmentation(df) -> list[dict]:
    """The figures at every step end of a dump (``read_dump``'s columns), per device."""
    import polars as pl
    rows = (df.filter(pl.col("event").is_in(["MALLOC", "FREE", "SYSTEM", "SNAPSHOT"]))
            .select("event", "event_type", "device", "name", "step", "alloc_id", "addr", "size", "attr"))
    t = LayoutTracker()
    out = []
    device: dict = {}
    for ev, et, dev, name, step, aid, addr, size, attr in rows.iter_rows():
        if ev == "SNAPSHOT":
            if name == "Step End" and attr:
                try:
                    device[str(dev)] = _device_part(json.loads(attr))
                except ValueError:
                    pass
            continue
        if ev == "SYSTEM":
            if et == "STEP":
                for d, f in sorted(t.figures().items()):
                    out.append({"step": int(step), "device": str(d), **f, **device.get(str(d), {})})
            continue
        kind = None
        if et == HAL and attr:
            m = _KIND.search(attr)
            kind = m.group(1) if m else None
        t.row(ev, et, dev, name, step, aid, addr, size, kind)
    return out


def make_sink(session):
    return FragmentationSink(session)


def main(argv=None) -> int:  # pragma: no cover - a thin offline entry point
    import argparse
    from ..io.reader import DumpError, read_dump
    p = argparse.ArgumentParser(prog="python -m msmemscope.analysis.fragmentation")
    p.add_argument("dump")
    a = p.parse_args(argv)
    try:
        steps = fragmentation(read_dump(a.dump))
    except DumpError as e:
        print(f"msmemscope: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(steps, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
