"""A held first optimizer step (Session._release_held_step) while another thread records inside its
flush: at each owner-labeller pass of that flush (which drains the native source) a thread allocates
a block it keeps. Its rows belong after the rows of step 2 held back in the buffer, never between
the STEP 1 row and them. Prints ``FIRED n`` (how often the thread ran inside the release)."""
import sys
import threading

import torch
from torch import nn

import msmemscope
from msmemscope import capture

out, analysis = sys.argv[1], sys.argv[2]
watch = len(sys.argv) > 3 and sys.argv[3] == "watch"  # handed over to the dispatch-mode source first
msmemscope.config(output=out, events="alloc,free,launch", analysis=analysis, collect_mode="immediate")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 4)
msmemscope.start()
early = []
if watch:  # blocks the native source counted, freed after the handover: their FREE rows are merged
    early = [torch.ones(10) + i for i in range(4)]  # by time into the buffer at each drain
    msmemscope.watcher.watch(x, name="x", dump_nums=100)
s = capture.current()
kept, state = [], {"in_release": False, "fired": 0}


def other_thread_records():
    t = threading.Thread(target=lambda: kept.append(torch.ones(3000) * 2))
    t.start()
    t.join()


release = s._release_held_step


def release_watched():
    state["in_release"] = True
    try:
        release()
    finally:
        state["in_release"] = False


s._release_held_step = release_watched
if s.labeler is not None:
    before_flush = s.labeler.before_flush

    def before_flush_with_a_thread():
        if state["in_release"]:
            state["fired"] += 1
            other_thread_records()
        return before_flush()

    s.labeler.before_flush = before_flush_with_a_thread
else:  # no labeller: the thread records at the step-1 flush's sinks instead (after the rows are taken)
    class Sink:
        batch_steps = True

        def consume(self, rows, first):
            if state["in_release"]:
                state["fired"] += 1
                other_thread_records()

        def step_end(self, session, step):
            pass

        def close(self, session):
            pass

    s.add_sink(Sink())
for _ in range(4):
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    keep_step = torch.ones(100)  # rows of the next step, held in the buffer at the release
    if early:
        early.pop()
msmemscope.stop()
print("FIRED", state["fired"])
