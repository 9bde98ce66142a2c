"""OOM forensics (SPEC §4.7): ``--analysis=oom[:K]``.

When an allocation fails, write OOM_DETAIL rows into the dump — the failed
request (OOM_TRIGGER), the K most recently allocated live blocks
(OOM_RECENT_ALLOC) and the K largest live blocks (OOM_TOP_ALLOC), with owner,
allocating op and Python stack — print them on stderr and in the log, and let
the program's own exception propagate unchanged.

Sources of a failure:
- any traced op that raises: ``Session.op_failed`` calls ``OomSink.op_failed``;
  CPU allocator errors (RuntimeError "DefaultCPUAllocator: can't allocate
  memory: you tried to allocate N bytes"), ``torch.OutOfMemoryError`` on
  CUDA/NPU ("Tried to allocate 2.00 GiB");
- on CUDA, the caching allocator's out-of-memory observer
  (``torch._C._cuda_attach_out_of_memory_observer``), which also gives the
  exact request size and the device's allocated/free bytes; it fires before the
  exception, so the rows carry those numbers.
"""
from __future__ import annotations

import heapq
import logging
import re
import sys
import threading
from time import time_ns

from ..events import Event, Oom

log = logging.getLogger("msmemscope")
MB = 1048576.0
GiB = float(1 << 30)
_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
          "TIB": 1 << 40, "PIB": 1 << 50}
_BYTES_RE = re.compile(r"allocate (\d+) bytes")
_TRIED_RE = re.compile(r"[Tt]ried to allocate ([\d.]+) ?([KMGTP]?i?B)")
_DEV_RE = re.compile(r"\b(?:GPU|NPU|device) (\d+)")
from ..capture.failures import is_allocation_failure  # noqa: E402,F401  (one rule, kept in capture)


def requested_bytes(message: str):
    """The failed request's size from the allocator's message, or None."""
    m = _BYTES_RE.search(message)
    if m:
        return int(m.group(1))
    m = _TRIED_RE.search(message)
    if m:
        unit = _UNITS.get(m.group(2).upper())
        if unit:
            return int(float(m.group(1)) * unit)
    return None


# the allocation function that failed, in the original's terms (halMemAlloc on an NPU)
_ALLOC_FUNC = {"cpu": "c10::alloc_cpu", "cuda": "cudaMalloc", "npu": "halMemAlloc"}


def _short(name):
    if not name:
        return "an unknown op"
    return name[len("torch._ops."):] if name.startswith("torch._ops.") else name


from ..frames import user_line as _user_line  # noqa: E402


class OomSink:
    def __init__(self, session):
        self.k = int(getattr(session.opts, "oom_k", 10) or 10)
        self.events: list = []
        self._observed = None          # what the CUDA observer saw, waiting for the exception
        self._session = session
        self._attach_cuda(session)

    # ------------------------------------------------------------------ CUDA
    def _attach_cuda(self, session):
        import torch
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None or not torch.cuda.is_available():
            return

        def do_attach():
            try:
                attach(self._cuda_observer)
            except Exception as e:  # an old or odd build: the exception path still works
                log.debug("could not attach the CUDA out-of-memory observer: %s", e)
        # the allocator's per-device state exists only after CUDA is initialized
        torch.cuda._lazy_call(do_attach)

    def _cuda_observer(self, device, alloc, device_allocated, device_free):
        """Called by the CUDA caching allocator right before it raises OutOfMemoryError."""
        s = self._session
        src = getattr(s, "device_source", None)
        if src is not None and src.installed:
            try:  # the allocator trace has the layout: its OOM account (rows, report) comes through take()
                src.on_oom()
                s.flush()
                self._observed = True
            except Exception as e:
                log.error("OOM analysis failed in the CUDA observer: %s", e)
            return
        try:
            info = {"device_allocated": int(device_allocated), "device_free": int(device_free),
                    "source": "cuda_oom_observer", **_device_figures(device, int(device_free))}
            op = getattr(s.tls, "op", None)
            self.record(s, op, str(device), int(alloc), "OutOfMemoryError",
                        "CUDA caching allocator: out of memory", info)
            self._observed = True
        except Exception as e:
            log.error("OOM analysis failed in the CUDA observer: %s", e)

    def take(self, session, listed):
        """An OOM account the allocator-trace source built (its rows are already in the dump)."""
        self.events.append(listed)
        _print(report_lines(listed))

    # ------------------------------------------------------------------ sink protocol
    def consume(self, rows, first_id):
        pass

    def step_end(self, session, step):
        pass

    def op_failed(self, session, op_name, exc):
        try:
            if not is_allocation_failure(exc):  # (Session.op_failed calls once a failure)
                return
            if self._observed:          # the CUDA observer already wrote the rows of this failure
                self._observed = None
                return
            msg = str(exc)
            device = self._device_of(session, exc, msg)
            src = getattr(session, "device_source", None)
            if src is not None and src.installed and device != "cpu":
                # no observer ran (NPU): the allocator's trace holds this OOM, with its layout
                before = src.oom_accounts()
                src.on_oom()
                if src.oom_accounts() > before:
                    session.flush()
                    return
            self.record(session, op_name, device, requested_bytes(msg), type(exc).__name__, msg, {})
        except Exception as e:  # never replace the program's exception with ours
            log.error("OOM analysis failed: %s", e)

    def findings(self, session, count_only=False):
        if not self.events:
            return None
        return "oom", None if count_only else {"analysis": "oom", "k": self.k, "events": self.events}, len(self.events)

    def close(self, session):
        from .leaks import write_result
        write_result(session.folder, "oom", {"analysis": "oom", "k": self.k, "events": self.events})

    # ------------------------------------------------------------------ the report
    @staticmethod
    def _device_of(session, exc, msg):
        if "cpu" in msg.lower() and "allocator" in msg.lower():
            return "cpu"
        m = _DEV_RE.search(msg)
        if m:
            return m.group(1)
        if session.kind == "cpu":
            return "cpu"
        return str(session.op_device)

    def record(self, s, op_name, device, size, exc_type, message, extra):
        from ..capture.stacks import python_stack
        live = [b for b in list(s.live.values()) if str(b.device) == str(device)]
        k = self.k
        recent = heapq.nlargest(k, live, key=lambda b: (b.ts, b.alloc_id))  # newest first
        top = heapq.nlargest(k, live, key=lambda b: (b.size, -b.alloc_id))
        first_line = message.strip().splitlines()[0][:500] if message.strip() else ""
        used = sum(v for (d, _p), v in s.used.items() if str(d) == str(device))
        # the original's keys first (func, req_size, flag: its OOMDumpVerifier checks them), then ours
        trig = {"func": _ALLOC_FUNC.get(s.kind if str(device) != "cpu" else "cpu", "alloc"),
                "req_size": size, "flag": 0,
                "size": size, "exception": exc_type, "message": first_line, "device": str(device),
                "step": s.step_no, "used": used, "live_blocks": len(live),
                "live_bytes": sum(b.size for b in live), "k": k, **extra}
        tid = threading.get_ident()
        ts = time_ns()
        name = op_name or "N/A"
        rows = [(Event.OOM_DETAIL, Oom.TRIGGER, name, ts, tid, device, None, trig, python_stack(50), None)]
        listed = {"trigger": {"op": name, **trig}, "recent": [], "top": []}
        for kind, blocks, key in ((Oom.RECENT, recent, "recent"), (Oom.TOP, top, "top")):
            for rank, b in enumerate(blocks, 1):
                a = {"pool": b.pool, "ptr": "0x%016x" % b.addr, "size": b.size, "timestamp": b.ts,
                     "rank": rank, "allocation_id": b.alloc_id, "addr": "0x%016x" % b.addr,
                     "step": b.step, "op": b.op, "owner": b.owner, "python": _user_line(b.stack)}
                rows.append((Event.OOM_DETAIL, kind, b.op or "N/A", ts, tid, b.device, b.addr, a, b.stack, None))
                listed[key].append(a)
        self.events.append(listed)
        if s.active and not s.closed:
            s.buf.extend(rows)
            try:
                s.flush()
            except Exception as e:
                log.error("could not write the OOM rows: %s", e)
        _print(report_lines(listed))


def _device_figures(device, device_free) -> dict:
    """Reserved bytes and the device's capacity at a CUDA OOM: what lies outside the allocator."""
    try:
        import torch
        reserved = int(torch.cuda.memory_reserved(int(device)))
        total = int(torch.cuda.mem_get_info(int(device))[1])
    except Exception:
        return {}
    return {"reserved": reserved, "device_total": total, "outside_allocator": max(0, total - device_free - reserved)}


def _gib(n) -> str:
    return f"{(n or 0) / GiB:.2f} GiB"


def device_lines(t) -> list[str]:
    """The allocator's and the device's side of an OOM: fragmentation and memory outside the allocator."""
    lines = []
    if t.get("unallocated") is not None:
        lines.append(f"{_gib(t['unallocated'])} reserved but unallocated in {t.get('segments_with_free', 0)} "
                     f"segment(s); largest free block {_gib(t.get('largest_free'))} "
                     f"(reserved {_gib(t.get('reserved'))}).")
    if t.get("device_total") and t.get("device_free") is not None:
        lines.append(f"Device: {_gib(t['device_free'])} free of {_gib(t['device_total'])}; "
                     f"{_gib(t.get('outside_allocator'))} in use outside the caching allocator "
                     f"(CUDA context, libraries' workspaces, NCCL, other processes).")
    return lines


def report_lines(ev) -> list[str]:
    t = ev["trigger"]
    size = f"{t['size'] / MB:.6f} Mb(s)" if t.get("size") is not None else "an unknown size"
    lines = [f"====== ERROR: Out of memory on device {t['device']}: {_short(t['op'])} failed to allocate {size} "
             f"at step {t['step']} ({t['exception']}) ======",
             f"In use: {t['used'] / MB:.6f} Mb(s) in {t['live_blocks']} live block(s) traced on this device."]
    lines += device_lines(t)
    for key, title in (("recent", "most recently allocated"), ("top", "largest")):
        if not ev[key]:
            continue
        lines.append(f"The {len(ev[key])} {title} live block(s):")
        for a in ev[key]:
            ln = (f"  #{a['rank']} {a['size'] / MB:.6f} Mb(s) at 0x{int(a['addr'], 16):x} allocated by "
                  f"{_short(a['op'])} at step {a['step']}")
            if a.get("owner"):
                ln += f", owner {a['owner']}"
            if a.get("python"):
                ln += f", Python: {a['python']}"
            lines.append(ln)
    return lines


def _print(lines):
    for ln in lines:
        print(ln, file=sys.stderr)
        log.error("%s", ln)
    sys.stderr.flush()


def make_sink(session):
    return OomSink(session)
