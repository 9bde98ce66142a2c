"""A model trained through torch.compile; prints each loss exactly and whether Dynamo compiled
frames, so a traced run can be checked against a plain one."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x, y = torch.randn(8, 16), torch.randn(8, 1)


def loss_fn(x, y):
    return nn.functional.mse_loss(model(x), y)


compiled = torch.compile(loss_fn, backend="eager")
for step in range(3):
    opt.zero_grad(set_to_none=True)
    loss = compiled(x, y)
    loss.backward()
    opt.step()
    print(f"loss {loss.item().hex()}")
from torch._dynamo.utils import counters  # noqa: E402
print("dynamo frames", counters["frames"].get("total", 0))
