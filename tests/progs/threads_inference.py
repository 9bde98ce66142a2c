"""Two worker threads, each with a model of its own, run no-grad forwards; a barrier inside the
forward makes each thread begin its model's forward while the other is inside its own. The models
outlive their threads (kept in a list), so at the session's end no thread that ran them is alive.
Prints {"models": {class name: parameter bytes}} (the roots' names in msmemscope's module table)."""
import json
import threading

import torch
from torch import nn

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
    with torch.no_grad():
        for _ in range(3):
            m(x)


threads = [threading.Thread(target=work, args=a) for a in ((Narrow, 64), (Wide, 128))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"models": {type(m).__name__: sum(p.numel() * p.element_size() for p in m.parameters())
                             for m in kept}}), flush=True)
