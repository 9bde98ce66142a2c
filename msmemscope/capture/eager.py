"""Our code as torch.compile'd code calls it: always eagerly, never traced by Dynamo.

A compiled function may call our hooks (an optimizer step's) or our API (``msmemscope.step()``,
``mark()``, ``watcher.watch()`` inside a compiled training step). Dynamo would trace into them and
stop at what it cannot trace (the native module, locks, clocks): a graph break there, a warning on
the program's stderr for each, and the callees run eagerly after the break compiled frame by frame.
Called through ``torch._dynamo.disable`` instead, each is one silent break at the call. We never
import torch._dynamo ourselves (~1.3 s a process): the disabled forms are made once the program
has imported it (``after_import``)."""
from __future__ import annotations

import functools
import sys
import weakref


class _Skippable:
    """A function and its ``torch._dynamo.disable`` form (None until torch._dynamo is imported)."""
    __slots__ = ("fn", "skipped", "__weakref__")

    def __init__(self, fn):
        self.fn, self.skipped = fn, None


_to_arm = weakref.WeakSet()  # those waiting for the program's import of torch._dynamo
_arming = None
_api = []                    # the API's, armed at a session's start (arm_api)


def _arm_all(dynamo):
    for box in list(_to_arm):
        box.skipped = dynamo.disable(box.fn)
    _to_arm.clear()


def _arm(box):
    global _arming
    if box.skipped is not None:
        return
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "disable"):
        box.skipped = dynamo.disable(box.fn)
        return
    _to_arm.add(box)
    if _arming is None:
        from ..after_import import after_import
        _arming = after_import("torch._dynamo", _arm_all, "our hooks and API inside compiled code, process {pid}")


def _eager(box):
    fn = box.fn

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        skipped = box.skipped
        # the disabled form wherever Dynamo is loaded: also where a compiled function runs this
        # call eagerly after a break, whose callees Dynamo would otherwise try to compile one by one
        return skipped(*args, **kwargs) if skipped is not None else fn(*args, **kwargs)
    return eager


def eager_or_skipped(hook):
    """A hook (an optimizer step's) that runs eagerly, never traced by Dynamo: a compiled
    optimizer step traces its hooks around the step's own graph, where the break is silent and
    at the step's head or tail (the optimizer breaks there itself)."""
    box = _Skippable(hook)
    _arm(box)
    return _eager(box)


def eager_api(fn):
    """An API function that runs eagerly, never traced by Dynamo, once a session has started
    (``arm_api``; before, it does nothing Dynamo cannot trace: there is no session)."""
    box = _Skippable(fn)
    _api.append(box)
    return _eager(box)


def arm_api():
    for box in _api:
        _arm(box)
