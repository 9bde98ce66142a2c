"""fsdp2_ranks.py's job on 2 gloo ranks started by torch.multiprocessing.spawn: the rank and world
size go to init_process_group, nothing is in the environment (no RANK, WORLD_SIZE, LOCAL_RANK).
argv: the TCP port of the rendezvous."""
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp2_ranks import train


def run(rank, port):
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    train()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]),), nprocs=2)
    print("spawned ranks done", flush=True)
