"""Tracing stopped and started by the main thread while another thread trains: its ops are in
flight at each stop. argv[1]: stop/start pairs. The interpreter switches threads as often as it can.
Prints both threads' final losses."""
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
pairs = int(sys.argv[1])


def train(i, n):
    m, opt = models[i]
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
    losses[i] = loss.item().hex()


worker = threading.Thread(target=train, args=(1, 40 * pairs))
worker.start()
for k in range(2 * pairs):
    train(0, 10)
    (msmemscope.stop if k % 2 == 0 else msmemscope.start)()
worker.join()
print("LOSSES", losses[0], losses[1])
