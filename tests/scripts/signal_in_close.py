"""A small AdamW training that ends normally; a signal then reaches it at a named moment of the
tool's exit handling (for tests/test_reliability_signals.py). argv: SIGNAL MOMENT [steps]
    writer-wait  inside the wait for the dump writer process (where Pool.terminate()'s SIGTERM
                 hung a worker: the handler closed again and waited on the same process)
    analysis     while the analyses write their results
The signal is sent from inside the tool's own call, so it lands there every time."""
import os
import signal
import subprocess
import sys

import torch
from torch import nn

import msmemscope.capture

signum = getattr(signal, sys.argv[1])
moment = sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)
for step in range(1, steps + 1):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print("step", step, loss.item().hex(), flush=True)

session = msmemscope.capture.current()
sent = []


def send():
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signum)  # its Python handler runs at the next bytecode, right here


if moment == "writer-wait":
    orig = subprocess.Popen._try_wait

    def _try_wait(self, flags):  # called with the Popen's wait lock held
        if "msmemscope.io.spool" in " ".join(map(str, self.args)) and not session.active:  # in the exit handling
            send()
        return orig(self, flags)
    subprocess.Popen._try_wait = _try_wait
elif moment == "analysis":
    for sink in session.sinks:
        orig_close = sink.close

        def close(s, orig_close=orig_close):
            send()
            return orig_close(s)
        sink.close = close
print("done", flush=True)
