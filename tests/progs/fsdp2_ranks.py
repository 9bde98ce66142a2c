"""FSDP2 (fully_shard per layer, then the model) on CPU with gloo, AdamW, a few steps.
Run with torchrun --nproc_per_node=2 (fsdp2_spawn.py runs ``train`` under torch.multiprocessing.spawn)."""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def main():
    dist.init_process_group("gloo")
    train()


def train():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)  # different data per rank; rank 1's batch is 16x larger (an imbalance)
    batch = 32 if rank == 0 else 512
    x, y = torch.randn(batch, 64), torch.randn(batch, 8)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    dist.barrier()
    print("rank", rank, "done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
