"""Millions of events traced in one run: at every step, record how many rows wait in the
tracer's buffer, the size of the dump on disk and the process's resident memory; record the
size of every batch the tracer writes."""
import json
import os
import sys

import torch
from torch import nn
import msmemscope
from msmemscope import capture

out, steps = sys.argv[1], int(sys.argv[2])
msmemscope.config(output=out, events="alloc,free,launch,access", analysis="none")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(16)])
# one op that reads many blocks: an ACCESS row per piece, so millions of rows come cheaply;
# with enough pieces one step holds more than 65,536 rows (the flush inside a step)
pieces = [torch.full((2,), float(i)) for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 4000)]
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(4, 8)
msmemscope.start()
s = capture.current()
batches = []
real_write = s.writer.write


def write(rows, first, pid, c_syms=None, pieces=None):
    batches.append(len(rows))
    return real_write(rows, first, pid, c_syms, pieces)


s.writer.write = write
page = os.sysconf("SC_PAGE_SIZE")


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page


samples = []
for step in range(1, steps + 1):
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    opt.step()
    for _ in range(4):
        torch.stack(pieces).sum()
    samples.append({"step": step, "rows": s.next_id, "buffered": len(s.buf), "file": os.path.getsize(s.dump_path),
                    "rss": rss(), "live": len(s.live)})
msmemscope.stop()
print(json.dumps({"samples": samples, "batches": batches, "dump": s.dump_path, "rows": s.next_id}))
