"""A traced training loop whose flushes take the native source's records as ``PackedRows`` (no row
tuple made, session.py ``_take_packed``) where they can, with what makes a flush drain them into
tuples instead in between: ``msmemscope.mark`` (a Python-side row), a stop/start gap (a FREE of a
block freed outside the window), and optionally a thread that allocates and frees while flushes
run. Every packed flush is checked here:
  * its bytes load as rows whose MALLOC, FREE and STEP rows are, field for field and in order, the
    rows of its columns (IDs from the flush's first), and whose STEP rows are its ``steps``;
  * a second leak sink that gets the row tuples (``consume`` of ``rows()``: the path every flush
    took before) must end with the tracker of the sink that got the columns, state for state.
Prints: packed flushes, drained flushes, rows checked, whether the two trackers agree."""
import json
import marshal
import os
import sys
import threading
import traceback

import numpy as np
import torch

import msmemscope
from msmemscope import capture
from msmemscope.analysis import inefficient, leaks
from msmemscope.analysis.folds import native_module
from msmemscope.events import Event, PackedRows

out, opts = sys.argv[1], json.loads(sys.argv[2])
thread = opts.pop("thread", False)
msmemscope.config(output=out, collect_mode="immediate", **opts)
s = capture.current()
assert s.native is not None, s.config
nat = s.native
counts = {"packed": 0, "drained": 0, "rows": 0, "chunks": 0, "access": 0}
fold = native_module()
COLS = ("id", "event", "event_type", "name", "tid", "device", "alloc_id", "addr", "size", "used", "owner",
        "py_stack")


def col_value(cols, j, i):
    data, values = cols[j]
    if values is None:
        return int(np.frombuffer(data, dtype=np.int64)[i])
    k = int(np.frombuffer(data, dtype=np.uint32)[i])
    return values[k] if k < len(values) else None


def check(p: PackedRows, first):
    rows = marshal.loads(p.blob)
    assert len(rows) == len(p) == p.n
    keep = [(first + i, r) for i, r in enumerate(rows) if r[0] in (Event.MALLOC, Event.FREE, Event.SYSTEM)]
    assert len(keep) == len(p.cols[0][0]) // 8, (len(keep), len(p.cols[0][0]))
    for j, (rid, r) in enumerate(keep):
        got = {c: col_value(p.cols, k, j) for k, c in enumerate(COLS)}
        assert got["id"] == rid and got["event"] == r[0] and got["event_type"] == r[1] and got["name"] == r[2]
        assert got["tid"] == r[4] and got["device"] == r[5]
        if r[0] == Event.SYSTEM:
            assert p.steps[j] == r, (p.steps[j], r)
            continue
        a = r[7]
        assert (got["alloc_id"], got["addr"], got["size"], got["used"]) == (a[0], a[1], a[2], a[3]), (got, r)
        assert got["owner"] == (a[5] if r[0] == Event.MALLOC else None)
        assert got["py_stack"] == (r[8] if r[0] == Event.MALLOC else None)
    assert set(p.steps) == {j for j, (_, r) in enumerate(keep) if r[0] == Event.SYSTEM}
    assert p.free_ids() == {r[7][0] for r in rows if r[0] == Event.FREE}
    counts["rows"] += len(rows)


def check_chunk(p: PackedRows, first):
    """The inefficient analysis' chunk columns made from the records are those ``chunk_columns``
    makes from the tuples of the same rows, byte for byte (codes in the same first-met order)."""
    rows = marshal.loads(p.blob)
    want = fold.chunk_columns(rows, first, inefficient.SKIP_POOLS)
    assert len(p.chunk) == len(want)
    for k in range(8):  # the numbers and the op names' codes (the names are distinct)
        assert p.chunk[k] == want[k], (k, p.chunk[k], want[k])
    assert p.chunk[8] == want[8]
    # stacks: by the tracer's stack id, one text can have two codes; the column they make is the same
    assert inefficient.chunk_from_columns([p.chunk]).equals(inefficient.chunk_from_rows(rows, first))
    counts["chunks"] += 1
    counts["access"] += sum(r[0] == Event.ACCESS for r in rows)


real_take, real_drain = nat.take_packed, nat.drain


def take_packed(first, buf, columns, labels=None):
    p = real_take(first, buf, columns, labels)
    if p is not None:
        try:
            counts["packed"] += 1
            if p.cols is not None:
                check(p, first)
            else:
                counts["rows"] += len(p)
            if p.chunk is not None:
                check_chunk(p, first)
        except BaseException:  # the session would log it and go on: the run fails here instead
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)
    return p


def drain(buf, pieces=None):
    before = len(buf)
    got = real_drain(buf, pieces)
    counts["drained"] += len(buf) > before
    return got


nat.take_packed, nat.drain = take_packed, drain


class RowsSink(leaks.LeakSink):
    """The leak sink as every flush fed it before: the row tuples."""
    takes_packed = True

    def consume_packed(self, packed, first_id):
        self.consume(packed.rows(), first_id)


stop = threading.Event()


def churn():  # allocations and frees on another thread while the main thread flushes
    while not stop.is_set():
        x = torch.ones(64 * 1024)
        torch.add(x, x)  # an output made and freed at once
        del x


model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
kept = []
[sink] = [x for x in s.sinks if type(x) is leaks.LeakSink]
assert sink.takes_packed
shadow = RowsSink(s)  # from the first row on, as the sink (nothing was flushed yet)
s.sinks.insert(s.sinks.index(sink) + 1, shadow)
ineff = [x for x in s.sinks if type(x) is inefficient.InefficientSink]
assert not ineff or ineff[0].takes_packed
worker = threading.Thread(target=churn) if thread else None
for step in range(10):
    if step == 1 and worker is not None:
        worker.start()
    if step in (3, 7):
        msmemscope.mark(f"step {step}")  # a Python-side row: that flush drains
    model(torch.randn(16, 32)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    kept.append(torch.ones(256 * (step + 1)))  # a leak: the site grows every step
    if step == 5:
        msmemscope.stop()
        del kept[0]  # freed outside the window: its FREE row has a dict attr, that flush drains
        msmemscope.start()
stop.set()
if worker is not None:
    worker.join()
s.flush()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_leak_rows_native import state  # noqa: E402  (the trackers compared as that test does)

same = state(sink.t, []) == state(shadow.t, [])
msmemscope.stop()
if ineff:  # the inefficient analysis got chunks made from the records, with access rows among them
    print("chunks", counts["chunks"], "access", counts["access"])
print(counts["packed"], counts["drained"], counts["rows"], same)
