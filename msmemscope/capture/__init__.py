"""Capture: the sources and the session that owns them."""
from __future__ import annotations

_session = None


def current():
    """The process's session, or None when nothing is being traced."""
    return _session


def create(opts, launched=False):
    global _session
    if _session is None:
        from .session import Session
        _session = Session(opts, launched=launched)
    return _session
