"""FSDP2 (fully_shard) on CPU with gloo, AdamW, a few steps. Run with torchrun --nproc_per_node=2.

Each rank prints one JSON line: the model's full parameter bytes and this rank's local shard bytes."""
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)
    y = torch.randn(16, 8)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"rank": dist.get_rank(), "full_bytes": full, "local_bytes": local,
                      "n_params": len(list(model.parameters()))}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
