"""Two threads train a model each (its own Adam) while the first optimizer step's boundary is held,
in an order forced by events. argv: output folder, analysis, order, steps.
- ``numbered-main-first``: the main thread steps its optimizer (the hold), the other thread then
  takes 3 optimizer steps, then the main thread calls ``msmemscope.step()``; both go on, the main
  thread numbering every iteration with ``msmemscope.step()``;
- ``numbered-other-first``: the other thread steps first (the hold) and twice more, the main
  thread steps once between, then numbers its steps as above;
- ``optimizer``: no ``msmemscope.step()``; the main thread steps (the hold), the other thread steps,
  the main thread steps again, then the other: every optimizer step of either ends a step, each
  where it happened.
argv[5], if given: the session's bound on its buffer (rows; flushes inside the held step then).
Prints both losses, how many boundaries the program made (``BOUNDARIES n``), and the step ends an
analysis that is told of each (a sink without ``batch_steps``) heard, each with the last STEP row it
had consumed then (``ENDS [(step, last STEP row), ...]``)."""
import sys
import threading

import msmemscope
from two_models import two_models
from msmemscope import capture

out, analysis, order, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
msmemscope.config(output=out, analysis=analysis, collect_mode="immediate")
models, x = two_models()
losses = {}
go = [threading.Event() for _ in range(4)]


def one(i):
    m, opt = models[i]
    opt.zero_grad(set_to_none=True)
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    losses[i] = loss.item().hex()


numbered = order.startswith("numbered")


class Ends:
    """Told of every step end at its flush (no ``batch_steps``)."""
    def __init__(self):
        self.seen, self.ends = [], []

    def consume(self, rows, first_id):
        self.seen += [r[7]["step"] for r in rows if r[0] == "SYSTEM" and r[1] == "STEP"]

    def step_end(self, session, step):
        self.ends.append((step, self.seen[-1] if self.seen else None))

    def close(self, session):
        pass


msmemscope.start()
ends = Ends()
capture.current().add_sink(ends)
if len(sys.argv) > 5:
    s = capture.current()
    s.flush_rows = int(sys.argv[5])
    if s.native is not None:
        s.native.set_drain_at(s.flush_rows)  # the native source's records count against it too


def other():
    if order == "numbered-main-first":
        go[0].wait()
        for _ in range(3):
            one(1)
        go[1].set()
    elif order == "numbered-other-first":
        one(1)
        go[0].set()
        go[1].wait()
        one(1)
        one(1)
        go[2].set()
    else:
        go[0].wait()
        one(1)
        go[1].set()
        go[2].wait()
        one(1)
        go[3].set()
    for _ in range(n):
        one(1)


t = threading.Thread(target=other)
t.start()
made = 0
if order == "numbered-main-first":
    one(0)
    go[0].set()
    go[1].wait()
elif order == "numbered-other-first":
    go[0].wait()
    one(0)
    go[1].set()
    go[2].wait()
else:
    one(0)
    go[0].set()
    go[1].wait()
    one(0)
    go[2].set()
    go[3].wait()
if numbered:
    msmemscope.step()
    made = 1
for _ in range(n):
    one(0)
    if numbered:
        msmemscope.step()
        made += 1
t.join()
msmemscope.stop()
if not numbered:
    made = 4 + 2 * n
print("LOSSES", losses[0], losses[1])
print("BOUNDARIES", made)
print("ENDS", ends.ends)
