"""DDP on CPU (gloo), a tiny model, a few steps. One rank (``LEAK_RANK``, default 2) keeps a
new tensor alive every step (appended to a list): a leak on that rank only.
Run with torchrun --nproc_per_node=4."""
import os

import torch
import torch.distributed as dist
from torch import nn

STEPS = int(os.environ.get("STEPS", "6"))
LEAK_RANK = int(os.environ.get("LEAK_RANK", "2"))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        if rank == LEAK_RANK:
            kept.append(torch.ones(64 * 1024))  # 256 KiB that nobody frees
    dist.barrier()
    print("rank", rank, "done", len(kept), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
