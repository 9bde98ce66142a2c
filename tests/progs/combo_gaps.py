"""Features meeting in one process: stop/start gaps with frees and allocations in the gap,
a thread started before start() and one after, watch() switched on while another thread is inside
ops, --steps-like step boundaries, an optimizer. Prints what the program holds at the end as
``HELD <alloc_ids-free check data>`` for the test to compare with the dump."""
import json
import sys
import threading
import time

import torch
from torch import nn

import msmemscope

out = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "all"
# e.g. leaks,decompose: owner labels at every flush; tracing then starts here (immediate), before
# the model exists, so that the native source can label it (a deferred start needs the other one)
analysis = sys.argv[3] if len(sys.argv) > 3 else None
msmemscope.config(output=out, events="alloc,free,launch",
                  **({"analysis": analysis, "collect_mode": "immediate"} if analysis else {}))

stop_worker = threading.Event()


def spin():
    # ops on another thread all the time: some are in flight at every stop/start/watch
    w = torch.randn(64, 64)
    while not stop_worker.is_set():
        y = w @ w
        y = torch.relu(y) + 1
        del y
        time.sleep(0.002)  # leave the GIL to the main thread now and then


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 4)
early = threading.Thread(target=spin, daemon=True)
early.start()  # a thread started before start()


def train(n):
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


msmemscope.start()
late = threading.Thread(target=spin, daemon=True)
late.start()  # a thread started after start()
keep = [torch.ones(1000) * 2 for _ in range(4)]
train(2)
msmemscope.stop()
# the gap: frees of blocks the dump has, allocations it never sees
del keep[:2]
gap_new = torch.ones(3000) + 1
train(1)
msmemscope.start()
both = gap_new[:1000] + keep[0]
train(1)
if mode in ("all", "watch"):
    msmemscope.watcher.watch(keep[-1], name="k", dump_nums=2)  # the other threads are inside ops
    train(1)
msmemscope.stop()
del keep[0]
del both
msmemscope.start()
train(1)
msmemscope.step()
stop_worker.set()
early.join()
late.join()
msmemscope.stop()
print("HELD", json.dumps([t.untyped_storage().nbytes() for t in keep]))
