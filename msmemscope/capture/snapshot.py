"""Memory-state snapshots: SNAPSHOT rows with the allocator's counters and the
device's total/free memory (on CPU: the machine's RAM, and our own pool counters)."""
from __future__ import annotations

import functools
import threading
from time import time_ns

import torch

from ..events import ATTR, EVENT, TID, TS, Event
from . import backends
from .failures import is_allocation_failure  # noqa: F401  (the session's import point)

SNAPSHOT_ATTR = ("reserved", "max_reserved", "allocated", "max_allocated", "total", "free",
                 "device_rate", "reserved_rate")


def _devices(kind: str, device_mask) -> list:
    if kind == "cpu":
        return [None]
    n = getattr(torch, kind).device_count()
    if device_mask is None:
        return list(range(n))
    if isinstance(device_mask, int):
        return [i for i in range(n) if device_mask >> i & 1]
    return [int(i) for i in device_mask if 0 <= int(i) < n]


def snapshot_counters(session, kind: str, index) -> dict:
    c = backends.memory_counters(kind, index)
    if kind == "cpu":
        used = session.used.get(("cpu", "PTA"), 0)
        peak = session.peak.get(("cpu", "PTA"), 0)
        c.update(allocated=used, max_allocated=peak, reserved=used, max_reserved=peak)
    total = c["total"] or 0
    c["device_rate"] = round(100.0 * (total - (c["free"] or 0)) / total, 4) if total else 0.0
    c["reserved_rate"] = round(100.0 * (c["reserved"] or 0) / total, 4) if total else 0.0
    return {k: c[k] for k in SNAPSHOT_ATTR}


def take_snapshot(device_mask=None, name: str = "Memory Snapshot") -> list:
    """Write a SNAPSHOT row per device in ``device_mask`` (a bit mask or a list of
    indices; None = every device of the kind the program uses). Returns the rows' attrs."""
    from . import current
    s = current()
    if s is None or not s.active:
        # independent of start()/stop(), as the original documents: the row is written into the
        # run made from the current config() (created here when there is none), at exit at latest
        from .. import _session_for_api
        s = _session_for_api()
        if s.closed:
            return []
        s._install_exit_handlers()
    kind = s.kind
    out = []
    if kind != "cpu":
        backends.synchronize(kind)
    s.sync_sources()  # the native source's rows so far, and its counters
    for idx in _devices(kind, device_mask):
        attr = snapshot_counters(s, kind, idx)
        dev = "cpu" if idx is None else str(idx)
        s.buf.append((Event.SNAPSHOT, Event.SNAPSHOT, str(name), time_ns(), threading.get_ident(), dev, None,
                      attr, s.py_stack() if s.py_depth else None, None))
        out.append({"device": dev, **attr})
    return out


class TakeSnapshot:
    """``with TakeSnapshot("forward"):`` or ``@TakeSnapshot("forward")``: snapshots named
    "<name> Start" and "<name> End" around the block."""

    def __init__(self, name: str = "Memory Snapshot", device_mask=None):
        self.name, self.mask = str(name), device_mask

    def __enter__(self):
        take_snapshot(self.mask, f"{self.name} Start")
        return self

    def __exit__(self, *exc):
        take_snapshot(self.mask, f"{self.name} End")
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            with TakeSnapshot(self.name, self.mask):
                return fn(*a, **k)
        return wrapper


def oom_snapshots(session, buf, failed):
    """Replace a source's failed-allocation markers in ``buf`` by the OOM snapshot the
    dispatch-mode source takes at an allocation failure: the memory counters at the failure,
    with its time."""
    from .source import ALLOC_FAILED
    for i in range(len(buf) - 1, -1, -1):
        if failed <= 0:
            break
        r = buf[i]
        if r[EVENT] is ALLOC_FAILED:
            failed -= 1
            _size, used, peak = r[ATTR]
            attr = snapshot_counters(session, "cpu", None)
            attr.update(allocated=used, max_allocated=peak, reserved=used, max_reserved=peak)
            buf[i] = (Event.SNAPSHOT, Event.SNAPSHOT, "OOM_Snapshot", r[TS], r[TID], "cpu", None, attr, None, None)
