"""API calls that cannot do what they ask (for test_api_misuse_said_once): a device this host does
not have, config() after start(), marks that are not text. Each is said once on stderr."""
import sys

import torch

import msmemscope

msmemscope.config(device="cuda:99", output=sys.argv[1], analysis="none")
msmemscope.start()
model = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    msmemscope.config(analysis="leaks")      # too late: said once, not per call
    msmemscope.mark(object())                # not text: said once, not recorded
    msmemscope.mark(f"step {step}")
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    msmemscope.step()
msmemscope.stop()
print("ok")
