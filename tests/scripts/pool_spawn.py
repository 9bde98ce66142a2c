"""A spawn/forkserver Pool(2) whose workers import torch (so they are traced), map, then the
pool is terminated: Pool.terminate() sends SIGTERM to workers that may be closing their trace."""
import multiprocessing as mp
import sys

import torch


def work(n):
    t = torch.randn(64, 64)
    return float((t @ t).sum().item() * 0 + n)


if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1] if len(sys.argv) > 1 else "spawn")
    with ctx.Pool(2) as pool:   # __exit__ is terminate()
        print(sum(pool.map(work, range(8))), flush=True)
    print("done", flush=True)
