"""DDP on 2 gloo ranks started by torch.multiprocessing.spawn, traced by the Python API inside the
spawned function (no launcher, nothing in the environment): config(), then init_process_group,
then start(). argv: the output root, the TCP port of the rendezvous."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import msmemscope


def run(rank, out, port):
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    msmemscope.config(output=out, analysis="leaks,decompose")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msmemscope.start()
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
    msmemscope.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
    print("spawned ranks done", flush=True)
