"""A model trained six iterations (ten with ``gap``) that keeps 5,000 bytes more each iteration (``torch.empty``,
the op that made the model's weights too). argv[1]: ``in_backward``: an Adam per parameter,
stepped from the parameter's post-accumulate-grad hook (PyTorch's "optimizer in backward"
recipe: each gradient freed as soon as it is used); ``after``: one Adam stepped after the
backward. argv[2], optional, a comma-separated list of what else happens:
- ``threads``: two threads train a model each that way, their backwards running at once (a
  barrier inside the forward);
- ``gap``: the main thread stops tracing before its third iteration and starts it again after
  (tracing stops for every thread: the other's iterations then are partly untraced);
- ``watch``: the main thread's model's first weight is watched (msmemscope.watcher.watch) from the
  second iteration on; its optimizer writes it at every iteration.
Prints the losses of each thread (the main thread's as ``loss``, the other's as ``loss2``), then
``ITERATIONS``, the main thread's iterations and how many of them ran while tracing was on."""
import sys
import threading

import torch
from torch import nn

import msmemscope
from msmemscope import capture

in_backward = sys.argv[1] == "in_backward"
extra = sys.argv[2].split(",") if len(sys.argv) > 2 else []
both_inside = threading.Barrier(2) if "threads" in extra else None


class Net(nn.Sequential):
    def forward(self, x):
        if both_inside is not None:
            both_inside.wait(timeout=60)  # the other thread's iteration runs beside this one
        return super().forward(x)


def build(seed):
    torch.manual_seed(seed)
    model = Net(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8))
    if in_backward:
        opts = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

        def step_now(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_now)
        return model, None, torch.randn(16, 64)
    return model, torch.optim.Adam(model.parameters(), foreach=False), torch.randn(16, 64)


traced_run = capture.current() is not None  # run under msmemscope (the plain run takes no gap)
iterations = 10 if "gap" in extra else 6
traced = [0]
out = {0: [], 1: []}
kept = {0: [], 1: []}  # the leak: kept past each thread's loop, as a leak is


def train(k, built):
    model, opt, x = built
    for i in range(iterations):
        gap = k == 0 and "gap" in extra and i == 2 and traced_run
        if gap:
            msmemscope.stop()
        if k == 0 and "watch" in extra and i == 1:
            msmemscope.watcher.watch(model[0].weight, name="first.weight")
        loss = model(x).square().mean()
        loss.backward()
        if not in_backward:
            opt.step()
            opt.zero_grad(set_to_none=True)
        kept[k].append(torch.empty(5000, dtype=torch.uint8))
        if gap:
            msmemscope.start()
        elif k == 0:
            traced[0] += 1
        out[k].append(f"{loss.item():.6f}")


# both built here: torch's random generator is one for all threads
mine, theirs = build(0), (build(1) if "threads" in extra else None)
if "threads" in extra:
    other = threading.Thread(target=train, args=(1, theirs))
    other.start()
train(0, mine)
if "threads" in extra:
    other.join()
for v in out[0]:
    print("loss", v, flush=True)
for v in out[1]:
    print("loss2", v, flush=True)
print("ITERATIONS", iterations, traced[0], flush=True)
