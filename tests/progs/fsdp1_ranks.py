"""FSDP1 (FullyShardedDataParallel, flat parameters freed and re-grown with storage resize_) on CPU
with gloo, AdamW, a few steps. Run with torchrun --nproc_per_node=2."""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), device_id=torch.device("cpu"),
                 use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    dist.barrier()
    print("rank", rank, "done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
