"""A training loop whose steps are its optimizer steps, or numbered by msmemscope.step() a few ops
after each optimizer step, run under ``python -m msmemscope --analysis=leaks,decompose`` with a
given flush bound (0: the default): with a small one, flushes come while step 1's boundary is held
(Session._flush_around_held). Prints the size of every write and the most rows the buffer held at
a flush and after it. ``early``: the program flushes right after its first optimizer step;
``gap``: it stops and starts tracing after the ops that follow it; ``thread``: another thread
allocates and frees all along (its rows fall in the buffer wherever the flushes and the held
boundary are); the main thread's id is printed as ``main``."""
import json
import sys
import queue
import threading

import torch
from torch import nn

import msmemscope
from msmemscope import capture

numbering, rows, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
early = sys.argv[4:] == ["early"]  # a flush right after the first optimizer step (an analysis's)
gap = sys.argv[4:] == ["gap"]  # tracing stopped and started again in step 1, after its optimizer step
thread = sys.argv[4:] == ["thread"]  # another thread allocating and freeing all along
s = capture.current()  # the launcher's session
if rows:
    s.flush_rows = rows
    if s.native is not None:
        s.native.set_drain_at(rows)  # the native source's records count against it too
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(16, 32)
writes, full, kept = [], [], []
real_write, real_flush = s.writer.write, s.flush


def write(rows, first, pid, c_syms=None, pieces=None):
    writes.append(len(rows))
    return real_write(rows, first, pid, c_syms, pieces)


def flush(*a, **k):
    full.append(len(s.buf))  # the native source's records wait in C++ until the flush drains them
    real_flush(*a, **k)
    kept.append(len(s.buf))


s.writer.write, s.flush = write, flush
keep = []
done, ticks = threading.Event(), queue.SimpleQueue()


def tick(wait=False):
    """One cycle of the other thread; ``wait``: until it is done (once a step, before the optimizer
    step, so that its rows are in every step however the machine schedules it; the other ticks run
    concurrently with the main thread)."""
    ack = threading.Event() if wait else None
    ticks.put(ack)
    if ack is not None:
        ack.wait(30)


def other_thread():
    # a cycle (2 ops, 3 allocations, a free) each time the main thread ticks: concurrent with it,
    # but never so many rows between an optimizer step and msmemscope.step() that the held step
    # is settled for a full buffer (FLUSH_ROWS / 2 rows there)
    own, k = [], 0
    while True:
        ack = ticks.get()
        if done.is_set():
            return
        own.append(torch.ones(300 + k % 7) * 2)
        if len(own) > 3:
            own.pop(0)
        k += 1
        if ack is not None:
            ack.set()


worker = threading.Thread(target=other_thread)
if thread:
    worker.start()
for step in range(5):
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    if thread:
        tick(wait=True)
    opt.step()
    if early and step == 0:
        s.flush()
    for i in range(extra):  # ops after the optimizer step: evaluation, logging
        keep.append(torch.full((8 + step,), float(i)) * 2)
        if thread:
            tick()
    if gap and step == 0:
        msmemscope.stop()
        keep.append(torch.ones(16))  # made in the gap: never in the dump
        msmemscope.start()
    if numbering == "api":
        msmemscope.step()
done.set()
if thread:
    tick()
    worker.join()
print(json.dumps({"main": threading.get_ident(), "writes": writes, "full": max(full or [0]), "kept": max(kept or [0]), "folder": s.folder}))
