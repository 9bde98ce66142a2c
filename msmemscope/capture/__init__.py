"""Capture: the sources and the session that owns them."""
from __future__ import annotations

_session = None

#: Hook point: callables ``fn(session)`` run once, at the session's first start(), in order.
#: Capture imports nothing from analysis/, integrations/ or report/: what wants a session (the
#: online analyses, framework hooks) registers here from outside (msmemscope/__init__.py).
on_start: list = []


def current():
    """The process's session, or None when nothing is being traced."""
    return _session


def create(opts, launched=False):
    global _session
    if _session is None:
        from .session import Session
        from .tracebacks import install
        install()  # an uncaught exception prints without our dispatch mode's frames
        _session = Session(opts, launched=launched)
    return _session
