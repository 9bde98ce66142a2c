"""The Python API in a notebook's order: train, stop(), read the dump in the same process,
start() again, train, stop(), read again. Prints the row counts it sees. argv: output folder
[config() keywords as JSON]."""
import json
import sys

import torch
from torch import nn

import msmemscope
from msmemscope import capture
from msmemscope.io.reader import read_dump

msmemscope.config(output=sys.argv[1], **(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 64), torch.randn(32, 1)


def train(steps):
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


msmemscope.start()
s = capture.current()
train(30)
msmemscope.stop()
df = read_dump(s.dump_path)
print("first", df.height, s.next_id, df["id"].max())
msmemscope.start()
train(5)
msmemscope.stop()
df = read_dump(s.dump_path)
print("second", df.height, s.next_id, df["id"].max())
