"""What counts as an allocation failure: the session takes the OOM snapshot there, and the OOM
analysis reports it. Kept free of torch imports (offline commands import the analysis)."""
from __future__ import annotations

import sys

_OOM_TEXT = ("can't allocate memory", "out of memory", "failed to allocate", "cannot allocate memory")


def is_allocation_failure(exc) -> bool:
    """An allocator's failure: torch.OutOfMemoryError (CUDA, NPU) or the CPU allocator's RuntimeError."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, (RuntimeError, MemoryError)):
        text = str(exc).lower()
        return isinstance(exc, MemoryError) or any(t in text for t in _OOM_TEXT)
    return False
