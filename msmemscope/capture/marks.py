"""Marks and ranges from every API a training script may already call:
ours, the original's ``mstx`` names, and ``torch.cuda.nvtx``.

The nvtx functions are wrapped so the mark is recorded and the original call
still happens (and still raises where NVTX is missing, as it would untraced).
"""
from __future__ import annotations

import functools
import threading

from .eager import eager_api

_installed = False
_tls = threading.local()


def _session():
    from . import current
    s = current()
    return s if s is not None and s.active else None


def _text(msg, api: str):
    """A mark's message must be text: anything else (an object's repr is not a message) is said
    once on stderr and not recorded."""
    if isinstance(msg, str):
        return msg
    from .._console import alert_once
    alert_once(f"{api}-type", f"[msmemscope] {api}() takes a str message, not {type(msg).__name__}: not recorded")
    return None


@eager_api  # inside compiled code: called, never traced
def mark(msg: str, stream=None) -> None:
    """``stream``: the original's device stream argument (``mstx.mark(msg, stream)``), accepted and
    not used (a mark is a point on the host timeline)."""
    s = _session()
    if s is not None and _text(msg, "mark") is not None:
        s.mark(msg)


@eager_api
def range_start(msg: str, stream=None) -> int:
    s = _session()
    if s is None or _text(msg, "range_start") is None:
        return 0
    return s.range_start(msg)


@eager_api
def range_end(range_id: int) -> None:
    s = _session()
    if s is not None:
        s.range_end(range_id)


class RecordFunction:
    """A named range, as a context manager or a decorator."""

    def __init__(self, name: str):
        self.name = str(name)
        self._ids = []

    def __enter__(self):
        self._ids.append(range_start(self.name))
        return self

    def __exit__(self, *exc):
        if self._ids:
            range_end(self._ids.pop())
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            with RecordFunction(self.name):
                return fn(*a, **k)
        return wrapper


def _push(msg):
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(range_start(msg))


def _pop():
    stack = getattr(_tls, "stack", None)
    if stack:
        range_end(stack.pop())


def install(session) -> None:
    """Wrap torch.cuda.nvtx once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        import torch.cuda.nvtx as nvtx
    except Exception:
        return

    ids = {}

    def wrap(name, before):
        orig = getattr(nvtx, name, None)
        if orig is None:
            return

        @functools.wraps(orig)
        def wrapper(*a, **k):
            ours = before(*a, **k)  # recorded even where this build has no NVTX
            res = orig(*a, **k)     # and its errors propagate exactly as untraced
            if name == "range_start":
                ids[res] = ours
            return res
        setattr(nvtx, name, wrapper)

    wrap("mark", lambda msg, *a, **k: mark(msg))
    wrap("range_push", lambda msg, *a, **k: _push(msg))
    wrap("range_pop", lambda *a, **k: _pop())
    wrap("range_start", lambda msg, *a, **k: range_start(msg))
    wrap("range_end", lambda rid, *a, **k: range_end(ids.pop(rid, rid)))
