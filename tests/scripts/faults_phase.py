"""A 50-step training loop that fails at a chosen step, at a chosen point inside the step
(start, forward, backward, optimizer, or during the tracer's own flush at the step's end)."""
import os
import signal
import sys

import torch
from torch import nn

mode, at, phase = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)
step = 0


def fire(*_):
    if step != at:
        return
    sys.stdout.flush()
    if mode == "exception":
        raise ValueError("planted failure")
    if mode == "exit":
        sys.exit(3)
    if mode == "os_exit":
        os._exit(5)
    if mode in ("sigterm", "sigint", "sigkill"):
        os.kill(os.getpid(), getattr(signal, mode.upper()))
    if mode == "alloc":
        torch.empty(1 << 50)  # the CPU allocator refuses


if phase == "forward":
    model[2].register_forward_pre_hook(lambda m, a: fire())
elif phase == "optimizer":
    opt.register_step_pre_hook(lambda o, a, k: fire())
elif phase == "flush":
    # the fault arrives while the tracer is writing the step's rows (a signal handler runs at
    # the next bytecode: inside the flush, before the rows reach the file)
    from msmemscope import capture
    s = capture.current()
    real_write = s.writer.write

    fired = []

    def write(rows, first, pid, c_syms=None, pieces=None):
        if not fired and any(r[0] == "SYSTEM" and r[1] == "STEP" for r in rows) and step == at:
            fired.append(1)  # once, as a signal arrives once
            fire()
        return real_write(rows, first, pid, c_syms, pieces)
    s.writer.write = write
for step in range(1, 51):
    if phase == "start":
        fire()
    opt.zero_grad(set_to_none=True)
    out = model(x)
    if phase == "backward":
        out.register_hook(lambda g: fire())  # runs inside loss.backward(), in the autograd engine
    nn.functional.mse_loss(out, y).backward()
    opt.step()
    print("step", step, flush=True)
