"""Per-op cost of tracing, in microseconds: a loop of tiny ops (torch.add on 16
floats, each allocating a block and freeing the previous one), plain, under an
empty TorchDispatchMode, and under msmemscope with parts switched off.

    python bench/per_op.py [default|access]

msmemscope's line is for the source the session chose (printed): the native source where it is
built, the dispatch-mode source with MSMEMSCOPE_SOURCE=python or for access events.
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

torch.set_num_threads(1)
a, b = torch.ones(16), torch.ones(16)
N = 20000


def loop():
    x = a
    for _ in range(N):
        x = torch.add(x, b)
    return x


def per_op():
    loop()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        loop()
        best = min(best, time.perf_counter() - t0)
    return best / N * 1e6


class Empty(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main():
    import msmemscope
    from msmemscope import capture
    base = per_op()
    print(f"the op alone: {base:.2f} us")
    with Empty():
        print(f"empty TorchDispatchMode: +{per_op() - base:.2f} us")
    kw = dict(output=tempfile.mkdtemp())
    if len(sys.argv) > 1 and sys.argv[1] == "access":
        kw["events"] = "alloc,free,launch,access"
    msmemscope.config(**kw)
    msmemscope.start()
    s = capture.current()
    print(f"msmemscope ({s.config['source']} source): +{per_op() - base:.2f} us")

    class Null:
        def write(self, *a):
            pass
    writer, sinks = s.writer, s.sinks
    s.writer, s.sinks = Null(), []
    print(f"  without the writer and the online analyses: +{per_op() - base:.2f} us")
    s.writer, s.sinks = writer, sinks
    msmemscope.stop()


if __name__ == "__main__":
    main()
