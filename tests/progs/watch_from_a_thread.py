"""Two threads train a model each; at its 50th step the second thread watches the first model's
weight (msmemscope.watcher.watch), which the first thread's optimizer updates at every step. The
interpreter switches threads as often as it can. Prints both threads' final losses."""
import sys
import threading

import torch
from torch import nn

import msmemscope

sys.setswitchinterval(1e-5)
models = []
for i in range(2):
    torch.manual_seed(i)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    models.append((m, torch.optim.Adam(m.parameters(), lr=1e-2)))
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
losses = {}
steps = int(sys.argv[1])


def train(i, watch_at=None):
    m, opt = models[i]
    for k in range(steps):
        if k == watch_at:
            msmemscope.watcher.watch(models[0][0][0].weight, name="first.weight")
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
    losses[i] = loss.item().hex()


worker = threading.Thread(target=train, args=(1, 50))
worker.start()
train(0)
worker.join()
print("LOSSES", losses[0], losses[1])
