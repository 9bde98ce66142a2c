"""A training loop that fails at a chosen step in a chosen way (for the fault tests)."""
import os
import signal
import sys

import torch
from torch import nn

mode, at = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)
for step in range(1, 51):
    if step == at:
        if mode == "exception":
            raise ValueError("planted failure")
        if mode == "exit":
            sys.exit(3)
        if mode == "os_exit":
            os._exit(5)
        if mode in ("sigterm", "sigint", "sigkill"):
            sys.stdout.flush()
            os.kill(os.getpid(), getattr(signal, mode.upper()))
        if mode == "alloc":
            torch.empty(1 << 50)  # the CPU allocator refuses
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    print("step", step, flush=True)
