"""A progress bar for offline commands, shown only when the work lasts.

    with progress("report", total=4) as p:
        p.stage("reading dump")      # names what runs now, advances by one
        ...

Nothing is drawn for a command that finishes within ``delay`` seconds (default
1), nor when stderr is not a terminal (set ``MSMEMSCOPE_PROGRESS=1`` to force it,
``=0`` to switch it off). The bar goes to stderr: the program's stdout stays clean.
Other analyses reuse it the same way.
"""
from __future__ import annotations

import os
import sys
import threading


def _wanted(stream) -> bool:
    env = os.environ.get("MSMEMSCOPE_PROGRESS")
    if env is not None:
        return env not in ("0", "", "no", "false")
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    def __init__(self, description: str, total: int | None = None, delay: float = 1.0, stream=None):
        self.description = description
        self.total = total
        self.delay = delay
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.current = description
        self._lock = threading.Lock()
        self._bar = None
        self._task = None
        self._timer = None
        self._closed = False

    # context manager -------------------------------------------------
    def __enter__(self):
        if _wanted(self.stream):
            if self.delay <= 0:
                self._start()
            else:
                self._timer = threading.Timer(self.delay, self._start)
                self._timer.daemon = True
                self._timer.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _start(self):
        with self._lock:
            if self._closed or self._bar is not None:
                return
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
            console = Console(file=self.stream, force_terminal=os.environ.get("MSMEMSCOPE_PROGRESS") == "1" or None)
            self._bar = RichProgress(TextColumn("[msmemscope] {task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}" if self.total else ""),
                                     TimeElapsedColumn(), console=console, transient=False)
            self._task = self._bar.add_task(self._label(), total=self.total, completed=self.done)
            self._bar.start()

    def _label(self):
        return f"{self.description}: {self.current}" if self.current != self.description else self.description

    # updates ---------------------------------------------------------
    def stage(self, name: str, advance: int = 1):
        """Say what runs now; the previous stage counts as done."""
        with self._lock:
            if self.current != self.description:
                self.done += advance
            self.current = name
            if self._bar is not None:
                self._bar.update(self._task, description=self._label(), completed=self.done)

    def advance(self, n: int = 1):
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done)

    def close(self):
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._bar is not None:
                if self.total:
                    self._bar.update(self._task, completed=self.total, description=self.description)
                self._bar.stop()
                self._bar = None

    @property
    def shown(self) -> bool:
        return self._bar is not None


def progress(description: str, total: int | None = None, delay: float = 1.0, stream=None) -> Progress:
    return Progress(description, total=total, delay=delay, stream=stream)
