"""Python API run with a tiny flush buffer: MALLOC rows are written mid-step, before gradients
and optimizer state are known, so their owners arrive as SYSTEM/OWNER rows."""
import json
import sys

import torch
from torch import nn

import msmemscope
from msmemscope import capture


def main():
    from msmemscope.capture import session as S
    S.FLUSH_ROWS = 40   # before the session exists: the native source's records pass it too
    msmemscope.config(analysis="decompose", output=sys.argv[1])
    msmemscope.start()
    capture.current().flush_rows = 40
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 32)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    msmemscope.stop()
    params = list(model.parameters())
    print(json.dumps({"param_bytes": sum(p.numel() * 4 for p in params), "n_params": len(params)}))


if __name__ == "__main__":
    main()
