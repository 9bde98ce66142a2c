"""A training loop that runs until stopped. With an exit code as argument it handles SIGTERM
itself: it finishes the step, "saves", and exits with that code (what a checkpointing job does
when the scheduler preempts it); with ``default`` SIGTERM kills it."""
import signal
import sys

import torch
from torch import nn

stop = []
if sys.argv[1] != "default":
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(4, 8), torch.randn(4, 1)
for step in range(1, 100000):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    print("step", step, flush=True)
    if stop:
        print("saved at", step, flush=True)
        sys.exit(int(sys.argv[1]))
