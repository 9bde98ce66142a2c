"""DataLoader workers (fork, then spawn) feeding a real training loop while a side thread
allocates; run under the launcher with --steps so that steps outside the window free blocks the
dump has. Prints the losses (the program's output must not change under tracing)."""
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

    def side():
        # allocates through the tracer's hooks at any moment, a fork included (the native
        # source's at-fork handlers are what keeps the child from hanging on its lock), but
        # never draws from the default generator: a fork while a thread is inside torch.randn
        # leaves the generator's mutex locked in the child, whose worker hangs in
        # torch.manual_seed, traced or not (a plain run timed out in CI)
        keep = []
        n = 0
        while not stop.is_set():
            n += 1
            keep.append(torch.full((128,), float(n)) * 2)
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
