"""DataLoader workers (fork, then spawn) feeding a real training loop while a side thread
allocates; run under the launcher with --steps so that steps outside the window free blocks the
dump has. Prints the losses (the program's output must not change under tracing)."""
import os
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 2))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stop = threading.Event()
    # A fork while the side thread is inside torch.randn copies the default generator's mutex held
    # into the child, whose worker loop then hangs in torch.manual_seed (seen once in CI, with or
    # without tracing). The side thread does its torch work under a gate that each fork takes.
    gate = threading.Lock()
    os.register_at_fork(before=gate.acquire, after_in_parent=gate.release, after_in_child=gate.release)

    def side():
        keep = []
        while not stop.is_set():
            with gate:
                keep.append(torch.randn(128) * 2)
                if len(keep) > 4:
                    keep.pop(0)
            stop.wait(0.005)
    t = threading.Thread(target=side)
    t.start()
    for ctx in ("fork", "spawn"):
        loader = DataLoader(data, batch_size=16, num_workers=1, multiprocessing_context=ctx)
        for i, (x, y) in enumerate(loader):
            if i == 2:
                break
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            print(f"loss {loss.item():.6f}", flush=True)
    stop.set()
    t.join()


if __name__ == "__main__":
    main()
