"""Call stacks for rows: Python frames taken at once (frames die), C frames
captured raw on the hot path and symbolized in one batch at flush."""
from __future__ import annotations

import os
import sys

import torch

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = (_PKG_DIR, os.path.join("torch", "utils", "_python_dispatch.py"))


_FRAMES: dict = {}   # (code, line) -> "file:line(func)", or None for the tracer's own frames
_getframe = sys._getframe


def _frame_text(code, line):
    fn = code.co_filename
    text = None if fn.startswith(_SKIP[0]) or fn.endswith(_SKIP[1]) else f"{fn}:{line}({code.co_name})"
    _FRAMES[(code, line)] = text
    return text


def python_stack(depth: int) -> str:
    """Innermost frame first, ``file:line(func)`` joined by ``;``; the tracer's own frames left out.
    Frame texts are cached per (code, line): a training loop revisits the same lines every step."""
    out = []
    f = _getframe(1)
    cache = _FRAMES
    while f is not None and len(out) < depth:
        key = (f.f_code, f.f_lineno)
        text = cache[key] if key in cache else _frame_text(*key)
        if text is not None:
            out.append(text)
        f = f.f_back
    return ";".join(out)


from ..frames import user_line  # noqa: E402,F401  (re-exported for the capture side)


def capture_c():
    return torch._C._profiler.gather_traceback(python=False, script=False, cpp=True)


def symbolize_c(raw: list, depth: int) -> list[str]:
    """Symbolize raw C tracebacks in one batch."""
    if not raw:
        return []
    out = []
    for frames in torch._C._profiler.symbolize_tracebacks(raw):
        # drop the capture machinery itself (unwind, gather, pybind glue)
        keep = [fr for fr in frames if not fr["name"].startswith(("torch::unwind", "torch::CapturedTraceback", "pybind11::"))]
        out.append(";".join(f"{fr['name']}({fr['filename']}:{fr['line']})" for fr in keep[:depth]))
    return out
