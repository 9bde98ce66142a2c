"""The native folds the online analyses use where the native module is built (capture/_native.cpp,
section "analysis folds"): ``Fold`` (blocks and counters of bytes, keyed by what the analysis
makes of a MALLOC row) and ``chunk_columns`` (the inefficient analysis' chunk columns). They
take the session's row tuples as they are and do no Python work per row; the analysis keeps its
rules and gives the fold its keys. Without the module (not built, or ``MSMEMSCOPE_FOLD=python``)
the analyses fold rows in Python, the reference the tests compare the native folds with."""
from __future__ import annotations

import os

ENV = "MSMEMSCOPE_FOLD"  # python: fold in Python even where the native module is built


def native_module():
    """The native module when it has the folds and they are wanted, else None."""
    if os.environ.get(ENV, "").strip().lower() == "python":
        return None
    try:
        from ..capture import native
        mod = native.load_built()
    except Exception:
        return None
    return mod if mod is not None and hasattr(mod, "Fold") else None
