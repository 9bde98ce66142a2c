"""A model trained through torch.compile: ``torch.compile(model)`` (``module``), ``model.compile()``
(``inplace``), ``block.compile()`` of each block (``blocks``), a compiled loss function calling the model (``function``), or an eager model whose
optimizer step is compiled (``optimizer``), with backend argv[1]; ``gap`` (tracing stopped for step 2 of the 4) and ``watch`` (a block watched) after;
``api`` (traced through the Python API with --analysis=decompose into $COMPILED_OUT, started once
the model is compiled).
Prints each loss exactly, what Dynamo made of it (graphs, calls captured, graph breaks) and the
bytes and the number of parameters of each block by the path msmemscope names it with (root class + named_modules()),
so that a traced run can be checked against a plain one."""
import json
import os
import sys

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


backend, how = sys.argv[1], sys.argv[2]
gap = "gap" in sys.argv[3:]  # tracing stopped after step 1 and started again before step 3
watch = "watch" in sys.argv[3:]  # the head's weight watched (msmemscope.watcher.watch) from the start
torch.manual_seed(0)
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 64), torch.randn(32, 8)
if how == "module":
    run = torch.compile(model, backend=backend)
elif how == "inplace":
    model.compile(backend=backend)
    run = model
elif how == "blocks":  # each block compiled in place (as torchtitan compiles a transformer's blocks)
    for b in model.blocks:
        b.compile(backend=backend)
    run = model
elif how == "function":
    run = torch.compile(lambda x: model(x), backend=backend)
else:
    run = model
if "api" in sys.argv[3:]:
    import msmemscope
    msmemscope.config(analysis="decompose", output=os.environ["COMPILED_OUT"])
    msmemscope.start()
if watch:
    from msmemscope import watcher
    watcher.watch(model.head.weight, name="head.weight")
opt_step = torch.compile(opt.step, backend=backend) if how == "optimizer" else opt.step
for step in range(4):
    if gap and step in (1, 2):
        import msmemscope
        (msmemscope.stop if step == 1 else msmemscope.start)()
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(run(x), y)
    loss.backward()
    opt_step()
    print(f"loss {loss.item().hex()}", flush=True)
from torch._dynamo.utils import counters  # noqa: E402
layers = {f"Net.{name}": [sum(p.numel() * p.element_size() for p in m.parameters()), len(list(m.parameters()))]
          for name, m in model.named_modules() if name.count(".") == 1 and name.startswith("blocks")}
print("DYNAMO " + json.dumps({"graphs": counters["stats"].get("unique_graphs", 0),
                              "captured": counters["stats"].get("calls_captured", 0),
                              "breaks": sum(counters["graph_break"].values()),
                              "reasons": sorted({k.strip().splitlines()[0] if "Explanation" not in k
                                                 else k.split("Explanation:", 1)[1].strip().splitlines()[0]
                                                 for k in counters["graph_break"]}),
                              "layers": layers}), flush=True)
