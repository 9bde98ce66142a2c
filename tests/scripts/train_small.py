"""A small AdamW training that prints each step's loss exactly (float.hex), for the reliability
tests: the program's own stdout and exit status must be the same with and without faults in the
tool. argv: steps [exit_code]."""
import sys

import torch
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)
for step in range(1, steps + 1):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print("step", step, loss.item().hex())
print("done")
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
