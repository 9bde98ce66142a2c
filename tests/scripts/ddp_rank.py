"""Two-rank gloo job on CPU (torchrun)."""
import os

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
dist.destroy_process_group()
print("rank", rank, "done")
