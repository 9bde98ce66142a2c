"""The tool's own messages in a traced process: to stderr (the program's stdout
stays the program's), silenced by the launcher's -q (MSMEMSCOPE_QUIET=1)."""
from __future__ import annotations

import os
import sys


def quiet() -> bool:
    return os.environ.get("MSMEMSCOPE_QUIET") == "1"


def say(text: str) -> None:
    if quiet():
        return
    try:
        print(text, file=sys.stderr, flush=True)
    except Exception:  # a closed stderr must not break the program
        pass


def alert(text: str) -> None:
    """A failure of the tool's own: said even under -q (it changes what the run holds)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except Exception:
        pass


_said: set = set()


def alert_once(key: str, text: str) -> None:
    """``alert`` once per process for ``key`` (a misuse in a loop is said once, not per call)."""
    if key in _said:
        return
    _said.add(key)
    alert(text)
