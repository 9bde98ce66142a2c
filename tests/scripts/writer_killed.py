"""Training loop whose dump writer process is killed after step 2 (as the OOM killer might):
the program must go on unchanged and the dump stay readable."""
import os
import signal

import torch
from torch import nn

from msmemscope import capture
from msmemscope.io import spool

KILL_AT = int(os.environ.get("MSMEMSCOPE_TEST_KILL_AT", "1"))  # the loop's step after which it dies
made = [0]  # flushes of packed records (no row tuples) whose tuples had to be made from their bytes
_as_rows = spool.as_rows


def as_rows(rows):
    made[0] += type(rows).__name__ == "PackedRows"
    return _as_rows(rows)


spool.as_rows = as_rows
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x, y = torch.randn(8, 16), torch.randn(8, 1)
for step in range(6):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"loss {loss.item().hex()}", flush=True)
    if step == KILL_AT:
        s = capture.current()
        proc = getattr(s.writer, "_proc", None) if s is not None else None
        if proc is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
if capture.current() is not None:  # (traced: the untraced run's output is the loss lines alone)
    print(f"packed rows made from their bytes: {made[0]}")
