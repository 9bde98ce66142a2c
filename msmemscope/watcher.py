"""Watch memory blocks from the program (the original's ``msmemscope.watcher``).

    msmemscope.watcher.watch(tensor, name="w", dump_nums=2)
    msmemscope.watcher.watch(tensor.data_ptr(), length=1000, name="w", dump_nums=2)
    ...
    msmemscope.watcher.remove(tensor)
    msmemscope.watcher.remove(tensor.data_ptr(), length=1000)

Before and after every op (inside the ``--watch`` window when one is given)
each watched block is checksummed (or dumped whole with ``full-content``) into
``<run>/device_<id>/watch_dump/``; a change by an op that does not declare a
write to the block is reported as a stomp (see docs/watch.md).

``dump_nums``: how many ops the block is dumped around (one before and one
after record each); when reached, watching the block stops. Not given or 0:
no limit. Without a trace (the program not run under msmemscope and no
``msmemscope.start()``), the calls warn once and do nothing.
"""
from __future__ import annotations

import logging
import sys

import torch

from .capture.eager import eager_api

__all__ = ["watch", "remove"]

log = logging.getLogger("msmemscope")
_warned = False
_count = 0


def _engine():
    from . import capture
    s = capture.current()
    if s is None or s.closed:
        global _warned
        if not _warned:
            _warned = True
            msg = ("msmemscope.watcher: nothing is traced (run the program under msmemscope or call "
                   "msmemscope.start()); watch()/remove() do nothing")
            log.info(msg)  # said once on stderr below: a warning with no handler set would say it twice
            print(f"[msmemscope] {msg}", file=sys.stderr)
        return None
    from .capture.watch import attach
    return attach(s)


def _check_int(what, v, minimum):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"msmemscope.watcher: {what} must be an integer, not {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"msmemscope.watcher: {what} must be >= {minimum}, not {v}")
    return v


@eager_api  # inside compiled code: called with the real tensor, never traced
def watch(target, *, length=None, name=None, dump_nums=None):
    """Start watching a tensor's memory, or ``length`` bytes at address ``target``."""
    global _count
    if dump_nums is not None:
        _check_int("dump_nums", dump_nums, 0)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"msmemscope.watcher: name must be a string, not {type(name).__name__}")
    if length is not None:
        if isinstance(target, torch.Tensor):
            raise TypeError("msmemscope.watcher.watch: with length=, the first argument is an address "
                            "(an int such as tensor.data_ptr()), not a tensor")
        _check_int("address", target, 1)
        _check_int("length", length, 1)
    elif not isinstance(target, torch.Tensor):
        raise TypeError("msmemscope.watcher.watch: give a tensor, or an address with length=")
    _count += 1
    if name is None:
        name = f"watched{_count}"
    eng = _engine()
    if eng is None:
        return None
    if length is None:
        eng.add_tensor(target, name, dump_nums or 0)
    else:
        eng.add_range(int(target), int(length), name, dump_nums or 0)
    return None


@eager_api
def remove(target, *, length=None):
    """Stop watching a tensor (or the ``length`` bytes at address ``target``)."""
    if length is not None:
        if isinstance(target, torch.Tensor):
            raise TypeError("msmemscope.watcher.remove: with length=, the first argument is an address")
        _check_int("address", target, 1)
        _check_int("length", length, 1)
    elif not isinstance(target, torch.Tensor):
        raise TypeError("msmemscope.watcher.remove: give a tensor, or an address with length=")
    from . import capture
    s = capture.current()
    eng = getattr(s, "watch_engine", None) if s is not None else None
    if eng is None:
        return None
    n = eng.remove_tensor(target) if length is None else eng.remove_range(int(target), int(length))
    if n == 0:
        log.info("watch: remove(): that block was not being watched")
    return None
