"""Signals arriving while the session flushes: a thread sends SIGUSR1 every millisecond to a
program whose buffer is flushed every 64 rows; the handler allocates and keeps tensors (it runs
between bytecodes, often inside a flush; the native source drains every 64 records too). With
``term`` as argv[2], a SIGTERM comes mid-run; with ``opt``, the steps are the optimizer's (no
msmemscope.step(): step 1's boundary is held until the second, through many flushes); with
``compile``, the model is compiled in place (aot_eager), so the flushes the native source asks for
come from ops inside compiled code; argv[3], the analyses (default: leaks).

Prints the losses, how many signals the handler took and the bytes it still holds."""
import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn

import msmemscope
from msmemscope import capture

kept = []
hits = [0]


def on_usr1(signum, frame):
    hits[0] += 1
    if hits[0] % 5 == 0:
        kept.append(torch.empty(3001 + 2 * len(kept), dtype=torch.uint8))  # odd sizes: no float tensor has them


def main():
    out, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    analysis = sys.argv[3] if len(sys.argv) > 3 else None  # e.g. leaks,decompose,inefficient
    # compiled: the handler is kept out of Dynamo. A signal that lands while compiled code runs
    # would have Dynamo compile the handler's frame; under load that crashed the plain program too
    # (inside Dynamo's guard building), which is torch's and not what this program tests
    signal.signal(signal.SIGUSR1, torch._dynamo.disable(on_usr1) if mode == "compile" else on_usr1)
    traced = out != "-"
    if traced:
        # with analyses, tracing starts here (immediate): the native source then follows the
        # ops with owner labels and access events (a deferred start takes the dispatch-mode one)
        msmemscope.config(output=out, **({"analysis": analysis, "collect_mode": "immediate"} if analysis else {}))
        msmemscope.start()
        s = capture.current()
        s.flush_rows = 64
        if s.native is not None:
            s.native.set_drain_at(64)  # the native source's records count against it too
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    if mode == "compile":
        model.compile(backend="aot_eager")
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 32)
    done = threading.Event()

    def sender():
        while not done.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.001)

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if traced and mode != "opt":
            msmemscope.step()
        print(f"loss {step} {loss.item():.6f}", flush=True)
        if mode == "term" and step == 3:
            print("TERM", flush=True)
            threading.Thread(target=lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        time.sleep(0.02)
    done.set()
    t.join()
    if traced:
        msmemscope.stop()
    print("SIGNALS " + json.dumps({"hits": hits[0], "kept": [k.numel() for k in kept]}), flush=True)


if __name__ == "__main__":
    main()
