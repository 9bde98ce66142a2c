"""1000 steps traced in-process: the tracer's own memory stays flat, the dump grows on disk as it goes."""
import json
import os
import sys
import tracemalloc

import torch
from torch import nn
import msmemscope
from msmemscope import capture

out = sys.argv[1]
steps = int(sys.argv[2])
msmemscope.config(output=out, events="alloc,free,launch,access")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16), torch.randn(8, 1)
msmemscope.start()
s = capture.current()
tracemalloc.start()
marks = {}
for step in range(1, steps + 1):
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if step in (100, steps):
        marks[step] = {"traced": tracemalloc.get_traced_memory()[0], "rows": s.next_id,
                       "file": os.path.getsize(s.dump_path), "buffered": len(s.buf), "live": len(s.live)}
msmemscope.stop()
print(json.dumps(marks))
