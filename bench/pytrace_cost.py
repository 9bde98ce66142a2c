"""Cost of the Python trace (capture/pytrace.py): per Python call, and on a small training loop.

    python bench/pytrace_cost.py            # this interpreter (sys.setprofile before 3.12, sys.monitoring after)
    python bench/pytrace_cost.py --no-torch # the per-call part only (runs on an interpreter without torch)

Prints the best of a few repeats of CPU time (process_time: less disturbed by a loaded machine); no thresholds."""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from msmemscope.capture.pytrace import PyTracer  # noqa: E402

N = 200_000
REPEATS = 3


def leaf(x):
    return x + 1


def calls():
    s = 0
    for i in range(N):
        s = leaf(s)
    return s


def best(fn, traced):
    out = []
    for _ in range(REPEATS):
        t = PyTracer(tempfile.mkdtemp()) if traced else None
        if t:
            t.start()
        t0 = time.process_time()
        fn()
        dt = time.process_time() - t0
        if t:
            t.stop()
        out.append(dt)
    return min(out), (t.mode if traced else None)


def main():
    base, _ = best(calls, False)
    tr, mode = best(calls, True)
    print(f"python {sys.version.split()[0]} ({mode}): {N} calls {base * 1e3:.1f} ms plain, {tr * 1e3:.1f} ms traced: "
          f"+{(tr - base) / N * 1e9:.0f} ns per call, {tr / base:.2f}x")
    if "--no-torch" in sys.argv:
        return
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))

    def train():
        for _ in range(50):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    train()
    base, _ = best(train, False)
    tr, mode = best(train, True)
    print(f"MLP training, 50 steps: {base * 1e3:.1f} ms plain, {tr * 1e3:.1f} ms traced ({mode}): {tr / base:.2f}x")


if __name__ == "__main__":
    main()
