"""Steps marked with mstx ranges named 'step start' (optimizer present but explicit steps win)."""
import torch
from torch import nn
import msmemscope

model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    rid = msmemscope.range_start("step start")
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    msmemscope.range_end(rid)
