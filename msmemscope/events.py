"""The one event record of msmemscope and its enums (SPEC §1-2).

Every source appends rows shaped like ``RawRow``; every writer formats them and
every reader gives them back as the same columns.
"""
from __future__ import annotations

import json
from typing import NamedTuple

HEADER = ("ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,"
          "Ptr,Attr,Call Stack(Python),Call Stack(C)")
COLUMNS = tuple(HEADER.split(","))
NA = "N/A"
#: Attr key of a FREE row for a block freed while tracing was stopped (or in a step outside
#: ``--steps``): the block's MALLOC is in the dump, so its FREE is too, flagged, and ``used``
#: stays the running sum of the sizes.
UNTRACED = "untraced"


class Event:
    SYSTEM = "SYSTEM"
    MALLOC = "MALLOC"
    FREE = "FREE"
    ACCESS = "ACCESS"
    OP_LAUNCH = "OP_LAUNCH"
    KERNEL_LAUNCH = "KERNEL_LAUNCH"
    MSTX = "MSTX"
    SNAPSHOT = "SNAPSHOT"
    OOM_DETAIL = "OOM_DETAIL"


class System:
    START_TRACE = "START_TRACE"
    STOP_TRACE = "STOP_TRACE"
    STEP = "STEP"
    PROC_EXIT = "PROC_EXIT"
    STEP_SUMMARY = "STEP_SUMMARY"  # a bounded dump's step kept in summary (io/bounded.py)


class Access:
    READ = "READ"
    WRITE = "WRITE"
    UNKNOWN = "UNKNOWN"


class Op:
    START = "ATEN_START"
    END = "ATEN_END"


class Mstx:
    MARK = "Mark"
    RANGE_START = "Range_start"
    RANGE_END = "Range_end"


class Pool:
    """Memory pools. ``PTA`` is PyTorch's allocator (caching on CUDA/NPU, the CPU allocator on CPU)."""
    PTA = "PTA"
    PTA_WORKSPACE = "PTA_WORKSPACE"
    HOST = "HOST"
    HOST_PINNED = "HOST_PINNED"


class Oom:
    TRIGGER = "OOM_TRIGGER"
    RECENT = "OOM_RECENT_ALLOC"
    TOP = "OOM_TOP_ALLOC"


#: what ``--events`` accepts
EVENT_CHOICES = ("alloc", "free", "launch", "access", "traceback")


class RawRow(NamedTuple):
    """One dump row before it gets its ID and pid: what every source appends to the session's
    buffer and what every sink receives. The hot paths build plain tuples in this field order
    (a NamedTuple costs more to make); read them with the indices below, never with bare numbers.

    ``attr``: a tuple for MALLOC/FREE/ACCESS (field order: ``MALLOC_ATTR``, ``FREE_ATTR``,
    ``ACCESS_ATTR``), else a dict or None; ``attr_dict(event, attr)`` gives a dict.
    ``c_stack``: a raw C traceback until the writer symbolizes it."""
    event: str
    event_type: str
    name: str
    ts: int
    tid: int
    device: str
    ptr: int | None
    attr: object
    py_stack: str | None = None
    c_stack: object = None


#: indices of the raw row fields (``row[ATTR]``)
EVENT, EVENT_TYPE, NAME, TS, TID, DEVICE, PTR, ATTR, PY_STACK, C_STACK = range(10)
#: indices into a MALLOC/FREE attr tuple, and into an ACCESS attr tuple
A_ALLOC_ID, A_ADDR, A_SIZE, A_USED, A_TOTAL, A_OWNER = range(6)
ACCESS_DTYPE, ACCESS_SHAPE, ACCESS_SIZE, ACCESS_ALLOC_ID = range(4)

#: The dump format's version: config.json "format_version", and the db's ``PRAGMA user_version``.
#: Dumps written before it existed have neither; readers take those as version 1 too.
#: 1: the SPEC §1 dump, FREE rows of blocks freed outside the traced window flagged ``untraced``.
#: 2: a MALLOC row's Attr may end with ``"module"`` (the nn.Module the block is attributed to) and
#:    ``"phase"`` (``forward``/``backward``: what was running when it was made); a SYSTEM/OWNER row
#:    may carry ``"module"``. Version-1 dumps read as rows without them.
FORMAT_VERSION = 2


def format_ptr(ptr: int | None) -> str:
    return NA if ptr is None else "0x%016x" % ptr


# Attr of the hot rows travels as a tuple (cheap to build) and is formatted
# with one template at flush: field order of each tuple.
MALLOC_ATTR = ("allocation_id", "addr", "size", "used", "total", "owner")
#: a MALLOC attr tuple with module attribution (capture/modules.py appends the two at flush time)
MALLOC_ATTR_M = MALLOC_ATTR + ("module", "phase")
A_MODULE, A_PHASE = 6, 7
FREE_ATTR = ("allocation_id", "addr", "size", "used", "total")
ACCESS_ATTR = ("dtype", "shape", "size", "allocation_id")
_MALLOC_T = '{"allocation_id":%d,"addr":"0x%016x","size":%d,"used":%d,"total":%d,"owner":%s}'
_FREE_T = '{"allocation_id":%d,"addr":"0x%016x","size":%d,"used":%d,"total":%d}'
_ACCESS_T = '{"dtype":"%s","shape":[%s],"size":%d,"allocation_id":%d}'


class PackedRows:
    """A flush's rows still as the native source's records (``take_packed``): no row tuple made.
    ``blob``: every row as the marshal bytes of a list of ``RawRow`` tuples (what the writer
    process loads). The columns its sinks asked for (``packed_columns``), else None: ``cols``, the
    MALLOC, FREE and STEP rows as the leak rule's column loop takes them (analysis/leaks.py
    ``StepLeakTracker.consume_columns``), with their row IDs, and ``steps``, {index in ``cols``: the
    STEP row's tuple}; ``chunk``, the rows as the inefficient analysis' chunk columns (what its
    ``Columns.of_parts`` reads). A consumer that needs the row tuples asks ``rows()`` (made once, from
    the bytes: the same tuples ``drain`` makes); it iterates as they do. Taken with the owner labels
    and modules (``Session._drain_labelled``): ``mods``, (module codes, phase codes) beside ``cols``
    in its strings, ``attributed`` (rows given a module) and ``last_aid`` (the last allocation id
    when the records were taken); else None, 0, None."""
    __slots__ = ("n", "blob", "cols", "steps", "chunk", "mods", "attributed", "last_aid", "_rows")

    def __init__(self, n, blob, cols, steps, chunk=None, mods=None, attributed=0, last_aid=None):
        self.n, self.blob, self.cols, self.steps, self.chunk, self._rows = n, blob, cols, steps, chunk, None
        self.mods, self.attributed, self.last_aid = mods, attributed, last_aid

    def __len__(self):
        return self.n

    def rows(self) -> list:
        if self._rows is None:
            import marshal
            self._rows = marshal.loads(self.blob)
        return self._rows

    def __iter__(self):  # (a flush cut by a signal writes its rows again: Session._flush, Spool)
        return iter(self.rows())

    def __getitem__(self, i):
        return self.rows()[i]

    def column_rows(self) -> int:
        """How many rows ``cols`` holds (its ID column: int64 bytes)."""
        return len(self.cols[0][0]) // 8

    def free_ids(self) -> set:
        """The allocation ids of the FREE rows (``free_ids`` of the rows), from the leak columns
        (the leak sink, which asks for them, is the one caller)."""
        import numpy as np
        (codes, values), aid = self.cols[1], self.cols[6][0]
        free = next((k for k, v in enumerate(values) if v == Event.FREE), None)
        if free is None or not codes:
            return set()
        codes = np.frombuffer(codes, dtype=np.uint32)
        return set(np.frombuffer(aid, dtype=np.int64)[codes == free].tolist())


# the columns a sink can read from a PackedRows (its ``packed_columns``)
PACKED_LEAK, PACKED_CHUNK = "leak", "chunk"


def as_rows(rows):
    """``rows`` as a list of row tuples (a ``PackedRows`` made into its tuples)."""
    return rows.rows() if type(rows) is PackedRows else rows


def free_ids(rows) -> set:
    """The allocation ids of the FREE rows among raw ``rows`` (attr as a tuple or a dict)."""
    return {(r[ATTR][A_ALLOC_ID] if type(r[ATTR]) is tuple else (r[ATTR] or {}).get("allocation_id"))
            for r in rows if r[EVENT] == Event.FREE}


def format_attr(event: str, attr) -> str:
    if not attr:
        return ""
    if type(attr) is tuple:
        if event == Event.MALLOC:
            text = _MALLOC_T % (attr[:A_OWNER] + (json.dumps(attr[A_OWNER]),))
            if len(attr) > A_MODULE:
                text = text[:-1] + ',"module":%s' % json.dumps(attr[A_MODULE])
                if attr[A_PHASE] is not None:
                    text += ',"phase":%s' % json.dumps(attr[A_PHASE])
                text += "}"
            return text
        if event == Event.FREE:
            return _FREE_T % attr
        if event == Event.ACCESS:
            return _ACCESS_T % (attr[0], ",".join(map(str, attr[1])), attr[2], attr[3])
    if type(attr.get("addr")) is int:  # addresses are hex text in every Attr (the readers parse them so)
        attr = {**attr, "addr": "0x%016x" % attr["addr"]}
    return json.dumps(attr, separators=(",", ":"))


def attr_dict(event: str, attr) -> dict:
    """The Attr of a raw row as a dict, whatever form it travels in."""
    if not attr:
        return {}
    if type(attr) is tuple:
        keys = {Event.MALLOC: MALLOC_ATTR_M, Event.FREE: FREE_ATTR, Event.ACCESS: ACCESS_ATTR}[event]
        d = dict(zip(keys, attr))
        if d.get("phase", 0) is None:
            del d["phase"]
        return d
    return dict(attr)


def category_of(owner) -> str | None:
    """The category of an owner label ("PTA@weight@vllm" -> "weight"; None: it has none)."""
    parts = owner.split("@", 2) if owner else ()
    return parts[1] if len(parts) > 1 else None
