"""The one event record of msmemscope and its enums (SPEC §1-2).

Every source appends rows shaped like ``Row``; every writer formats them and
every reader gives them back as the same columns.
"""
from __future__ import annotations

import json
from typing import NamedTuple

HEADER = ("ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,"
          "Ptr,Attr,Call Stack(Python),Call Stack(C)")
COLUMNS = tuple(HEADER.split(","))
NA = "N/A"


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


class Row(NamedTuple):
    """One dump row before it gets its ID. ``attr`` is a dict (or None)."""
    event: str
    event_type: str
    name: str
    ts: int
    pid: int
    tid: int
    device: str
    ptr: int | None
    attr: dict | None
    py_stack: str | None = None
    c_stack: object = None  # a raw C traceback until the writer symbolizes it


def format_ptr(ptr: int | None) -> str:
    return NA if ptr is None else "0x%016x" % ptr


# Attr of the hot rows travels as a tuple (cheap to build) and is formatted
# with one template at flush: field order of each tuple.
MALLOC_ATTR = ("allocation_id", "addr", "size", "used", "total", "owner")
FREE_ATTR = ("allocation_id", "addr", "size", "used", "total")
ACCESS_ATTR = ("dtype", "shape", "size", "allocation_id")
_MALLOC_T = '{"allocation_id":%d,"addr":"0x%016x","size":%d,"used":%d,"total":%d,"owner":%s}'
_FREE_T = '{"allocation_id":%d,"addr":"0x%016x","size":%d,"used":%d,"total":%d}'
_ACCESS_T = '{"dtype":"%s","shape":[%s],"size":%d,"allocation_id":%d}'


def format_attr(event: str, attr) -> str:
    if not attr:
        return ""
    if type(attr) is tuple:
        if event == "MALLOC":
            return _MALLOC_T % (attr[:5] + (json.dumps(attr[5]),))
        if event == "FREE":
            return _FREE_T % attr
        if event == "ACCESS":
            return _ACCESS_T % (attr[0], ",".join(map(str, attr[1])), attr[2], attr[3])
    if type(attr.get("addr")) is int:  # addresses are hex text in every Attr (the readers parse them so)
        attr = {**attr, "addr": "0x%016x" % attr["addr"]}
    return json.dumps(attr, separators=(",", ":"))


def attr_dict(event: str, attr) -> dict:
    """The Attr of a raw row as a dict, whatever form it travels in."""
    if not attr:
        return {}
    if type(attr) is tuple:
        keys = {"MALLOC": MALLOC_ATTR, "FREE": FREE_ATTR, "ACCESS": ACCESS_ATTR}[event]
        return dict(zip(keys, attr))
    return dict(attr)
