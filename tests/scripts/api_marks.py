"""Uses the Python API in deferred mode: config, start/stop, marks, ranges, RecordFunction, nvtx, step()."""
import sys
import threading

import torch
import msmemscope
from msmemscope import mstx

out = sys.argv[1]
msmemscope.config(events="alloc,free,launch,access", output=out, call_stack="python:5")
a = torch.ones(1000)               # before start(): not recorded
msmemscope.start()
msmemscope.mark("A")
rid = msmemscope.range_start("phase")
b = a * 2                          # a first seen here as an input
msmemscope.range_end(rid)
with msmemscope.RecordFunction("rf"):
    c = b + 1


@msmemscope.RecordFunction("decorated")
def f(t):
    return t.sum()


f(c)
mstx.mark("B")
try:
    torch.cuda.nvtx.mark("nv")
except Exception:
    pass


def worker():
    torch.ones(77) * 3


t = threading.Thread(target=worker)
t.start()
t.join()
for i in range(3):
    d = c * i
    msmemscope.step()
msmemscope.stop()
e = torch.zeros(4242)              # after stop(): not recorded
print("done")
