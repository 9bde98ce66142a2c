"""Training with a second Python thread doing torch work and a DataLoader with worker processes."""
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
# persistent workers, forked before the side thread starts: forking while another
# thread is inside torch can deadlock the child (with or without tracing)
loader = DataLoader(data, batch_size=16, num_workers=2, shuffle=False, persistent_workers=True)
batches = iter(loader)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
side = []


def side_work():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        side.append(float((torch.randn(32, 32, generator=g) @ torch.randn(32, 32, generator=g)).sum()))


th = threading.Thread(target=side_work)
th.start()
for epoch in range(2):
    for x, y in (batches if epoch == 0 else loader):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(loss.item().hex())
th.join()
print("side", sum(side).hex())
