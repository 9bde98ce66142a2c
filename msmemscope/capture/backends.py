"""Per-device-family facts the tracer needs: how a device is named in the dump
and how many bytes its allocator holds in reserve.

CPU has no caching allocator, so its reserved bytes equal the allocated bytes.
CUDA and Ascend NPU expose their caching allocator's counters through
``torch.cuda`` / ``torch.npu``.
"""
from __future__ import annotations

import torch


def device_id(dev: torch.device) -> str:
    """The dump's ``Device Id``: ``cpu`` or the accelerator index."""
    if dev.type == "cpu":
        return "cpu"
    return str(dev.index if dev.index is not None else _current_index(dev.type))


def _current_index(kind: str) -> int:
    mod = getattr(torch, kind, None)
    try:
        return int(mod.current_device())
    except Exception:
        return 0


def reserved_bytes(kind: str, index: int | None) -> int | None:
    """Reserved bytes of the device's caching allocator, or None where there is none (CPU)."""
    if kind == "cpu":
        return None
    mod = getattr(torch, kind, None)
    try:
        return int(mod.memory_reserved(index))
    except Exception:
        return None


def available_accelerator() -> str | None:
    """'cuda' or 'npu' when the program could use one, else None."""
    try:
        if torch.cuda.is_available():
            return "cuda"
    except Exception:
        pass
    npu = getattr(torch, "npu", None)
    try:
        if npu is not None and npu.is_available():
            return "npu"
    except Exception:
        pass
    return None


def missing_device(spec: str | None) -> str | None:
    """Why ``spec`` (``cuda:3``, ``npu``) names no device of this host, or None when it does."""
    if not spec or spec.split(":")[0] == "cpu":
        return None
    kind, _, idx = spec.partition(":")
    mod = getattr(torch, kind, None)
    try:
        count = int(mod.device_count()) if mod is not None and mod.is_available() else 0
    except Exception:
        count = 0
    if count == 0:
        return f"this host has no {kind} device"
    if idx.isdigit() and int(idx) >= count:
        return f"this host has {count} {kind} device{'s' if count > 1 else ''} ({kind}:0 to {kind}:{count - 1})"
    return None


def drop_missing_device(opts) -> None:
    """A device option naming no device here (``config(device="cuda:99")`` on a CPU host) would
    trace an empty run of that kind: said once on stderr, and the program's own devices traced."""
    why = missing_device(opts.device)
    if why:
        from .._console import alert_once
        alert_once("device", f"[msmemscope] device={opts.device!r}: {why}; tracing the devices the program uses")
        opts.device = None


def synchronize(kind: str) -> None:
    mod = getattr(torch, kind, None)
    if kind != "cpu" and mod is not None:
        mod.synchronize()


def memory_counters(kind: str, index: int | None) -> dict:
    """allocated/reserved and their peaks, plus device total/free (CPU: the machine's RAM)."""
    if kind == "cpu":
        total, free = _host_memory()
        return {"allocated": None, "max_allocated": None, "reserved": None,
                "max_reserved": None, "total": total, "free": free}
    mod = getattr(torch, kind)
    free, total = mod.mem_get_info(index)
    return {"allocated": mod.memory_allocated(index), "max_allocated": mod.max_memory_allocated(index),
            "reserved": mod.memory_reserved(index), "max_reserved": mod.max_memory_reserved(index),
            "total": total, "free": free}


def _host_memory():
    total = free = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k == "MemTotal":
                    total = int(v.split()[0]) * 1024
                elif k == "MemAvailable":
                    free = int(v.split()[0]) * 1024
    except OSError:
        pass
    return total, free
