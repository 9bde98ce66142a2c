"""``msmemscope.tracer.start()`` / ``stop()``: the original's Python trace API.

Every Python call between the two, on every thread, goes to
``python_trace_<tid>_<timestamp>.csv`` next to the run's dump (see
``msmemscope/capture/pytrace.py``). Independent of ``msmemscope.start()``: without
a trace the run folder is made from the current ``msmemscope.config()``.
``events="traceback"`` does the same between ``start()`` and ``stop()``.
"""
from __future__ import annotations

import os

__all__ = ["start", "stop"]


def start():
    from . import capture, _session_for_api
    from .capture import pytrace
    s = capture.current() or _session_for_api()
    pytrace.tracer_for(os.path.dirname(s.dump_path)).start()


def stop():
    from .capture import pytrace
    t = pytrace.current()
    if t is not None:
        t.stop()
