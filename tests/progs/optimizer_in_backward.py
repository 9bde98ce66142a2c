"""A model trained six iterations that keeps 5,000 bytes more each iteration (``torch.empty``,
the op that made the model's weights too). argv[1]: ``in_backward``: an Adam per parameter,
stepped from the parameter's post-accumulate-grad hook (PyTorch's "optimizer in backward"
recipe: each gradient freed as soon as it is used); ``after``: one Adam stepped after the
backward. Prints the losses."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8))
in_backward = sys.argv[1] == "in_backward"
if in_backward:
    opts = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def step_now(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
else:
    opt = torch.optim.Adam(model.parameters(), foreach=False)
x = torch.randn(16, 64)
kept = []
for i in range(6):
    loss = model(x).square().mean()
    loss.backward()
    if not in_backward:
        opt.step()
        opt.zero_grad(set_to_none=True)
    kept.append(torch.empty(5000, dtype=torch.uint8))
    print("loss", f"{loss.item():.6f}", flush=True)
