"""Two worker threads, each with a model of its own, run no-grad forwards; a barrier inside the
forward makes each thread begin its model's forward while the other is inside its own. The models
outlive their threads (kept in a list), so at the session's end no thread that ran them is alive.
argv[1], optional, a comma-separated list:
- ``steps``: the main thread ends steps (msmemscope.step()) while both workers are alive, after
  their forwards, then lets them end;
- ``gap``: it also stops and starts tracing among those steps;
- ``train``: the workers' forwards take gradients, and each ends with a backward (the gradients
  stay in .grad).
Prints {"models": {class name: parameter bytes}, "steps": the steps ended} (the roots' names in
msmemscope's module table)."""
import json
import sys
import threading

import torch
from torch import nn

import msmemscope

mode = sys.argv[1].split(",") if len(sys.argv) > 1 else []
ran = threading.Barrier(3)        # the workers ran their models; the main thread steps meanwhile
finish = threading.Event()

both_inside = threading.Barrier(2)


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, width), nn.Linear(width, 8)

    def forward(self, x):
        h = self.fc1(x)
        both_inside.wait(timeout=60)  # the other thread is inside its forward too
        return self.fc2(torch.relu(h))


class Narrow(Net):
    pass


class Wide(Net):
    pass


kept = []


def work(cls, width):
    torch.manual_seed(width)
    m = cls(width).eval()
    kept.append(m)
    x = torch.randn(4, 32)
    with torch.set_grad_enabled("train" in mode):
        for _ in range(3):
            y = m(x)
    if "train" in mode:
        y.square().mean().backward()
    if "steps" in mode:
        ran.wait(timeout=60)
        finish.wait(timeout=60)


threads = [threading.Thread(target=work, args=a) for a in ((Narrow, 64), (Wide, 128))]
for t in threads:
    t.start()
steps = 0
if "steps" in mode:
    ran.wait(timeout=60)
    for what in ("step", "stop", "start", "step", "step") if "gap" in mode else ("step",) * 3:
        getattr(msmemscope, what)()
        steps += what == "step"
    finish.set()
for t in threads:
    t.join()
print(json.dumps({"models": {type(m).__name__: sum(p.numel() * p.element_size() for p in m.parameters())
                             for m in kept}, "steps": steps}), flush=True)
