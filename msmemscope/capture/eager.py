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
    _bind()
    for box in list(_to_arm):
        box.skipped = dynamo.disable(box.fn)
    _to_arm.clear()


def _arm(box):
    global _arming
    if box.skipped is not None:
        return
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "disable"):
        _bind()
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
        if skipped is None:
            return fn(*args, **kwargs)
        # the disabled form where Dynamo traces this call (is_compiling: a constant to it) or its
        # frame callback is set (a compiled function runs this call eagerly after a break, and
        # Dynamo would try to compile its callees one by one); a plain eager call is the function
        # itself (the disabled form costs ~5 us a call: four hooks at every optimizer step)
        if _is_compiling() or _frame_callback() is not None:
            return skipped(*args, **kwargs)
        return fn(*args, **kwargs)
    return eager


_is_compiling = _frame_callback = None  # bound where a disabled form is made (torch._dynamo is loaded)


def _bind():
    # (not imported at the top: the writer process imports this package without torch)
    global _is_compiling, _frame_callback
    if _is_compiling is None:
        torch = sys.modules["torch"]
        _is_compiling = torch.compiler.is_compiling
        # where torch has no such query: the disabled form always, as before
        _frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: True)


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
