"""The native folds the online analyses use where the native module is built (capture/_native.cpp,
section "analysis folds"): ``Fold`` (blocks and counters of bytes, keyed by what the analysis
makes of a MALLOC row) and ``chunk_columns`` (the inefficient analysis' chunk columns). They
take the session's row tuples as they are and do no Python work per row; the analysis keeps its
rules and gives the fold its keys. Without the module (not built, or ``MSMEMSCOPE_FOLD=python``)
the analyses fold rows in Python, the reference the tests compare the native folds with."""
from __future__ import annotations


ENV = "MSMEMSCOPE_FOLD"  # python: fold in Python even where the native module is built


def native_module():
    """The native module when it has the folds and they are wanted, else None."""
    from ..capture import native
    return native.built_with("Fold")
