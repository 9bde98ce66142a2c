"""Training with a second Python thread doing torch work and a DataLoader with worker processes,
the workers started (forked) before the thread, so that no fork happens while the other thread
holds a lock (a fork during torch work in another thread can hang the worker, traced or not)."""
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=16, num_workers=2, shuffle=False, persistent_workers=True)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
side = []


def side_work():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        side.append(float((torch.randn(32, 32, generator=g) @ torch.randn(32, 32, generator=g)).sum()))


batches = iter(loader)  # forks the workers now, before the thread starts
th = threading.Thread(target=side_work)
th.start()
for epoch in range(2):
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(loss.item().hex())
    batches = iter(loader)  # persistent workers: no new fork
th.join()
print("side", sum(side).hex())
