"""Two threads train a model each (its own Adam), the interpreter switching threads as often as it
can. argv[1] is what else happens, argv[2] a count:
- ``steps N``: each thread takes N steps (every optimizer step of either ends a step);
- ``steps2 N``: the same, each thread also stepping a second optimizer (of a small model of its own)
  after the first at every iteration: the first, each thread's lead, ends the steps;
- ``gaps N``: the main thread stops and starts tracing N times each while the other trains;
- ``watch N``: N steps each; at its 50th the second thread watches the first model's weight, which
  the first thread's optimizer updates at every step; prints how many steps the first thread had
  taken when the watch was asked for and when it returned.
Prints both threads' final losses last."""
import sys
import threading

import msmemscope
from two_models import two_models

sys.setswitchinterval(1e-6 if sys.argv[1].startswith("steps") else 1e-5)
what, count = sys.argv[1], int(sys.argv[2])
models, x = two_models()
losses = {}
taken, watched = [0, 0], []


def train(i, n, watch_at=None):
    m, opt = models[i]
    aux = aux_opt = None
    if what == "steps2":
        import torch
        aux = torch.nn.Linear(x.shape[-1], 1)
        aux_opt = torch.optim.SGD(aux.parameters(), lr=0.01)
    for k in range(n):
        if k == watch_at:
            asked = taken[0]
            msmemscope.watcher.watch(models[0][0][0].weight, name="first.weight")
            watched.append((asked, taken[0]))
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        if aux is not None:
            aux_opt.zero_grad(set_to_none=True)
            aux(x).square().mean().backward()
            aux_opt.step()
        taken[i] += 1
    losses[i] = loss.item().hex()


if what == "gaps":
    worker = threading.Thread(target=train, args=(1, 40 * count))
    worker.start()
    for k in range(2 * count):
        train(0, 10)
        (msmemscope.stop if k % 2 == 0 else msmemscope.start)()
else:
    worker = threading.Thread(target=train, args=(1, count, 50 if what == "watch" else None))
    worker.start()
    train(0, count)
worker.join()
if watched:
    print("WATCHED", *watched[0])
print("LOSSES", losses[0], losses[1])
