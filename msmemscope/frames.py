"""Reading the dump's ``Call Stack(Python)`` text (``file:line(func)`` frames,
innermost first, joined by ``;``). No torch import: offline commands use it."""
from __future__ import annotations

_LIBRARY = ("/torch/", "/site-packages/", "/dist-packages/", "/lib/python")


def user_line(stack: str | None) -> str | None:
    """The innermost frame of the user's own code: outside torch, installed
    packages and the standard library; failing that, outside torch (the user's
    code may itself be an installed package). None when the recorded depth
    holds only torch frames (a deeper ``--call-stack`` reaches the caller)."""
    if not stack or stack == "N/A":
        return None
    frames = stack.split(";")
    for fr in frames:
        if not any(p in fr for p in _LIBRARY):
            return fr
    for fr in frames:
        if "/torch/" not in fr:
            return fr
    return None
