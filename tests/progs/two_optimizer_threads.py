"""Two threads, each training its own model with its own optimizer: every optimizer step of either
ends a step of the session. argv[1]: steps per thread. The interpreter switches threads as often
as it can, so that two step boundaries meet. Prints the threads' final losses."""
import sys
import threading

import torch
from torch import nn

sys.setswitchinterval(1e-6)
steps = int(sys.argv[1])
models = []
for i in range(2):
    torch.manual_seed(i)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    models.append((m, torch.optim.Adam(m.parameters(), lr=1e-2)))
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
losses = [None, None]


def train(i):
    m, opt = models[i]
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
    losses[i] = loss.item().hex()


threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("LOSSES", *losses)
