"""An uncaught exception prints as it does without us. Where the dispatch-mode source follows the
ops, an op that raises unwinds through our ``__torch_dispatch__`` and the op call it makes
(torch/_ops.py): two frames the program's traceback did not have. The default hooks (sys and
threading) are wrapped, while they are the default ones, to print the traceback without them.
A program's own hook, or its ``traceback.print_exc()``, is left alone."""
from __future__ import annotations

import os
import sys
import threading
import types

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_OPS = os.sep + os.path.join("torch", "_ops.py")


def without_ours(tb):
    """The traceback ``tb`` less our frames and the torch op calls right below them."""
    kept, below_ours = [], False
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith(_OURS):
            below_ours = True
        elif not (below_ours and name.endswith(_TORCH_OPS)):
            below_ours = False
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for t in reversed(kept):
        out = types.TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


def _clean(value, tb):
    """``tb`` cleaned, and the tracebacks of the exceptions chained to ``value`` (printed too)."""
    seen, e = set(), value
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for c in (e.__cause__, e.__context__):
            if c is not None and c.__traceback__ is not None:
                c.__traceback__ = without_ours(c.__traceback__)
        e = e.__cause__ or e.__context__
    tb = without_ours(tb)
    if value is not None:
        value.__traceback__ = tb  # (the printer shows the exception's own traceback where it has one)
    return tb


def _sys_hook(etype, value, tb):
    try:
        tb = _clean(value, tb)
    except Exception:
        pass
    sys.__excepthook__(etype, value, tb)


def _thread_hook(args):
    try:
        args = threading.ExceptHookArgs([args.exc_type, args.exc_value, _clean(args.exc_value, args.exc_traceback),
                                         args.thread])
    except Exception:
        pass
    threading.__excepthook__(args)


def install():
    """Wrap the default hooks (not a program's own)."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _sys_hook
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _thread_hook
