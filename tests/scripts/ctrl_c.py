"""A training loop stopped by Ctrl-C (SIGINT to the whole process group, as a terminal sends it).
argv: ``count``: the program handles SIGINT itself, finishes after the first one, waits a moment
in its own clean-up and exits with the number of SIGINTs it got (1: nobody sent it a second);
``default``: Python's KeyboardInterrupt ends it."""
import signal
import sys
import time

import torch
from torch import nn

got = []
if sys.argv[1] == "count":
    signal.signal(signal.SIGINT, lambda *a: got.append(1))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)
for step in range(1, 100000):
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    print("step", step, flush=True)
    if got:
        deadline = time.monotonic() + 1.0  # the program's own clean-up, where a second one would land
        while time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(len(got))
