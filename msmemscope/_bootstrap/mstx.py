"""``import mstx`` in a program run under the msmemscope launcher: the original's mark API
(``mstx.mark(msg, stream)``, ``mstx.range_start(msg, stream) -> id``, ``mstx.range_end(id)``).

Marks and ranges are recorded in the dump (a range named ``step start`` ends a step). Where the
real ``mstx`` package (Ascend) is installed, it is loaded too and every call still reaches it."""
import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_real = None
_spec = _machinery.PathFinder.find_spec("mstx", [p for p in _sys.path if _os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    try:
        _real = _util.module_from_spec(_spec)
        _spec.loader.exec_module(_real)
        globals().update({k: v for k, v in vars(_real).items() if not k.startswith("__")})
    except Exception:
        _real = None

from msmemscope.capture import marks as _marks  # noqa: E402

_ids = {}


def mark(message, stream=None):
    _marks.mark(message)
    if _real is not None:
        return _real.mark(message, stream)
    return None


def range_start(message, stream=None):
    ours = _marks.range_start(message)
    if _real is not None:
        rid = _real.range_start(message, stream)
        _ids[rid] = ours
        return rid
    return ours


def range_end(range_id):
    _marks.range_end(_ids.pop(range_id, range_id))
    if _real is not None:
        return _real.range_end(range_id)
    return None
