"""What a capture source is to the session.

A source sees some of what a program does with memory and turns it into raw rows
(``events.RawRow``); the session numbers the rows, keeps the one count of bytes in use
per (device, pool) and hands the rows to the writer and the sinks. Two sources exist:

* ``native.NativeSource`` -- the CPU allocator wrapper and a RecordFunction callback in C++
  (``_native.cpp``); it owns its C++ counters and records;
* ``dispatch.DispatchSource`` -- a ``TorchDispatchMode`` per traced thread (``ops.py``); it
  owns the registry of the blocks it follows (one ``Block`` per tensor storage).

A new source (a CUDA caching-allocator source, say) subclasses ``Source``, says what it
``sees``, and is chosen in ``Session._choose_source`` (see docs/DEVELOPING.md).
"""
from __future__ import annotations


class Source:
    """The interface. Every method is called by the session, with its flags already set."""

    #: short name written to config.json ("source")
    name = "source"
    #: what the source can see: a subset of SEES
    sees: frozenset = frozenset()

    def start(self):
        """Begin recording (the session's flags say what)."""

    def stop(self):
        """Stop recording new things. Ops in flight get their end row now; frees of blocks
        already in the dump are still reported (flagged untraced when outside the window)."""

    def set_flags(self, flags):
        """The session's recording flags changed (``Flags``)."""

    def drain(self, buf: list):
        """Move the rows recorded so far into ``buf``, in the order things happened."""

    def hand_over(self) -> int:
        """Stop seeing ops and new blocks (another source takes them over); keep reporting the
        frees of the blocks counted so far. Returns the last allocation id used."""
        raise NotImplementedError

    def live_alloc_ids(self) -> set:
        """Allocation ids of the blocks this source counted and that are not yet freed."""
        return set()

    def alloc_id_of(self, storage):
        """The allocation id of a live storage this source counted, or None."""
        return None


#: a marker row a source puts in the buffer at an allocation failure, never written: the session
#: replaces it with the OOM snapshot (attr: (size, used, peak) at the failure)
ALLOC_FAILED = "ALLOC_FAILED"

#: what a source may see (``Source.sees``)
SEES = frozenset({
    "alloc", "free", "launch",   # the default events
    "access",                     # ACCESS rows (reads and writes of blocks by ops)
    "stacks",                     # Python / C call stacks on rows
    "storages",                   # tensor storages (owner labels, watch, describe)
    "accelerators",               # devices other than the CPU
    "op_failures",                # an op that raised (OOM analysis)
})


class Flags:
    """What the session records now; one object, recomputed at each change (start, stop, step)."""
    __slots__ = ("recording", "count", "alloc", "free", "free_untraced", "launch", "access")

    def __init__(self, recording=False, count=False, alloc=False, free=False, free_untraced=False,
                 launch=False, access=False):
        self.recording = recording          # tracing is on: ops are followed
        self.count = count                  # new blocks enter the dump (in the traced window)
        self.alloc = alloc                  # their MALLOC rows are written
        self.free = free                    # FREE rows written as traced
        self.free_untraced = free_untraced  # else FREE rows of blocks in the dump, flagged untraced
        self.launch = launch                # OP_LAUNCH rows
        self.access = access                # ACCESS rows
