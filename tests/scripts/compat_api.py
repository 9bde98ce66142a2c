"""The original's API calls that its examples do not show, in one program (tests/test_compat.py):
take_snapshot() before start(), msmemscope.tracer.start()/stop() on two threads, mstx marks with
the stream argument, a training loop, and an allocation failure for the OOM rows
(oom_utils.OOMDumpVerifier checks them). Run directly (API) or under the launcher."""
import sys
import threading

import torch
import msmemscope

out = sys.argv[1]
msmemscope.config(analysis="oom", output_path=out, format="csv")
msmemscope.take_snapshot(name="before start")   # independent of start(), as documented


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x)


def train_steps(model, opt, steps):
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 64)), torch.randn(8, 64))
        opt.zero_grad()
        loss.backward()
        opt.step()


def side_work():
    return sorted(str(i) for i in range(50))


msmemscope.tracer.start()
msmemscope.start()
msmemscope.mstx.mark("compat mark", None)
rid = msmemscope.mstx.range_start("compat range", None)
model = TinyModel()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
keep = [torch.ones(1 << 18), torch.ones(1 << 16), torch.ones(1 << 17)]   # 1 MiB, 256 KiB, 512 KiB
t = threading.Thread(target=side_work)
t.start()
train_steps(model, opt, 3)
t.join()
msmemscope.mstx.range_end(rid)
try:
    torch.empty(1 << 50)
except RuntimeError as e:
    print("caught", type(e).__name__)
msmemscope.stop()
msmemscope.tracer.stop()
print("done", len(keep))
