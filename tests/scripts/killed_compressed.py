"""Training loop traced into a compressed dump (--compress=zstd): the dump writer process is
SIGKILLed after step 3, once it has written what it was sent (the traced process then writes on, appending whole zstd frames after the
last complete one), and the program SIGKILLs itself after step 6. argv: kill_step_of_program."""
import os
import signal
import sys
import time

import torch
from torch import nn

from msmemscope import capture

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)
last = int(sys.argv[1]) if len(sys.argv) > 1 else 6
for step in range(1, 100):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} {loss.item().hex()}", flush=True)
    s = capture.current()
    if step == 3:
        proc = getattr(s.writer, "_proc", None) if s is not None else None
        if proc is not None:
            from msmemscope.io.writers import last_id_in
            s.flush()
            deadline = time.monotonic() + 60
            while last_id_in(s.dump_path) < s.writer.last_id() and time.monotonic() < deadline:
                time.sleep(0.01)  # the pipe is empty: no row dies with the writer
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    if step == last:
        s.flush()  # this step's rows reach the file: what a kill leaves is known
        os.kill(os.getpid(), signal.SIGKILL)
