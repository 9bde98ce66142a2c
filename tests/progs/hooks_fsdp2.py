"""FSDP2 on CPU/gloo with the one-click hooks (decompose and snapshot), no --analysis needed.
Run with torchrun --nproc_per_node=2 under the msmemscope launcher.

Each rank prints one JSON line: the model's full parameter bytes and this rank's local shard bytes."""
import json
import os

import torch
import msmemscope
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def main():
    dist.init_process_group("gloo")
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    names = ("pre_forward", "post_forward", "pre_backward", "post_backward")
    orig = [pg.FSDPParamGroup.__dict__[n] for n in names] + [pg.foreach_all_gather, pg.foreach_reduce]
    msmemscope.init_framework_hooks("pytorch", torch.__version__, "fsdp2", "decompose")
    msmemscope.init_framework_hooks("pytorch", torch.__version__, "fsdp2", "snapshot")
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
    msmemscope.cleanup_framework_hooks()
    now = [pg.FSDPParamGroup.__dict__[n] for n in names] + [pg.foreach_all_gather, pg.foreach_reduce]
    print(json.dumps({"rank": dist.get_rank(), "restored": all(a is b for a, b in zip(orig, now))}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
