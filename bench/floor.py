"""The floor under the native source's default events: what its hooks cost before they record
anything. A probe, not part of msmemscope; bench/run.py stays the judge.

    python bench/floor.py [--workload gpt2|mlp|transformer] [--steps N] [--rounds R]

One process, the workload's steps timed in interleaved rounds (the order reversed every other
round) with the native module (``_native.cpp``) in four states:
``plain`` (nothing installed); ``wrapper`` (the CPU allocator wrapper alone, counting nothing);
``callback`` (the wrapper and the global RecordFunction callback, not recording: the callback
returns at once); ``tracking`` (the callback keeps the top-level op, nothing is emitted).
Prints each state's median µs a step and the median of the rounds' ratios to ``plain``.
Run it with glibc's malloc thresholds fixed (as ``bench/run.py --stable-malloc`` sets them) to
keep page faults out:

    GLIBC_TUNABLES=glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432 \\
        python bench/floor.py --workload gpt2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STATES = ("plain", "wrapper", "callback", "tracking")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("mlp", "gpt2", "transformer"), default="gpt2")
    p.add_argument("--steps", type=int, default=None, help="steps a round (default: 6, the MLP 40)")
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args(argv)
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from msmemscope.capture import native, stacks
    from bench.workloads import build
    m = native.load_module()
    if m is None:
        sys.exit(f"the native module is not there: {native.why_not()}")
    m.reset()
    model, step = build(a.workload)
    steps = a.steps or (40 if a.workload == "mlp" else 6)
    for _ in range(3):
        step()

    def install(record: bool):
        m.install(1 << 40, None, False, 0, stacks._SKIP[0], stacks._SKIP[1])
        m.set_flags(record, False, False, False, False, False, False)

    def enter(state):
        if state == "plain":
            m.uninstall(False)
        elif state == "wrapper":
            install(False)
            m.uninstall(True)  # the callback goes, the allocator wrapper stays
        else:
            install(state == "tracking")

    times = {s: [] for s in STATES}
    for r in range(a.rounds):
        for s in (STATES if r % 2 == 0 else STATES[::-1]):
            enter(s)
            step()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[s].append((time.perf_counter() - t0) / steps)
    enter("plain")
    print(f"{a.workload}, {steps} steps a round, {a.rounds} rounds")
    for s in STATES:
        ratio = statistics.median(x / y for x, y in zip(times[s], times["plain"]))
        print(f"  {s:9s} {statistics.median(times[s]) * 1e6:9.0f} µs a step   {ratio:.3f}× plain")


if __name__ == "__main__":
    main()
