"""Where the default events' time goes inside the traced process: a probe, not part of msmemscope.

    python bench/step_costs.py parts [--workload mlp|gpt2] [--steps N] [--analysis A]
    python bench/step_costs.py layers [--workload mlp|gpt2] [--steps N] [--rounds R]

``parts``: the session's step-boundary and flush methods wrapped with a timer, in one traced
process. Prints each one's time a step and its calls a step (flushes run in the flusher thread
too: their time counts wherever they ran).

``layers``: the same loop in fresh processes, one per layer, in interleaved rounds:
``plain``; ``hooks`` (the native source installed and recording, its flags set so that nothing
is recorded, no step work); ``records`` (everything recorded, ``Session.step`` a no-op, so no
drain or flush until the records pass the source's bound); ``full`` (the default events).
Each process prints the median of 5 timed stretches; the table gives each layer's median against
plain's in the same round. The wall clock of the main thread and its CPU time are printed
together (a difference is waiting: for the GIL, while the flusher thread flushes), and the
process's minor page faults a step (the program's tensors landing on fresh pages as the heap
moves: on GPT-2 they swing by several percent of the step with what else the process allocates).

BENCHMARKS.md (eighteenth session) records what these printed. bench/run.py stays the judge.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build(workload):
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    from bench.workloads import build as build_workload
    return build_workload(workload)[1]


def session():
    from msmemscope import capture
    return capture.current()


def parts(a):
    sys.path.insert(0, ROOT)
    import msmemscope
    kw = {"analysis": a.analysis} if a.analysis else {}
    msmemscope.config(output=tempfile.mkdtemp(), collect_mode="immediate", **kw)
    step = build(a.workload)
    for _ in range(2):
        step()
    from msmemscope.capture import native
    from msmemscope.capture import session as S
    s = session()
    tot, cnt = collections.Counter(), collections.Counter()
    rows = [0]

    def wrap(obj, name, key=None):
        orig = getattr(obj, name)
        key = key or name

        def timed(*args, **kw):
            t = time.perf_counter_ns()
            try:
                return orig(*args, **kw)
            finally:
                tot[key] += time.perf_counter_ns() - t
                cnt[key] += 1
        setattr(obj, name, timed)

    for n in ("step", "flush", "sync_sources", "_may_wait", "_pieces_of"):
        wrap(S.Session, n)
    drain = native.NativeSource.drain

    def counted(self, buf, pieces=None):
        n0 = len(buf)
        try:
            return drain(self, buf, pieces)
        finally:
            rows[0] += len(buf) - n0
    native.NativeSource.drain = counted
    wrap(native.NativeSource, "drain", "native drain")
    wrap(native.NativeSource, "take_packed", "native take_packed")
    wrap(s.writer, "write", "writer.write")
    if s.labeler is not None:
        wrap(s.labeler, "before_flush", "labeler.before_flush")
        if hasattr(s.labeler, "at_step_end"):
            wrap(s.labeler, "at_step_end", "labeler.at_step_end")
    if s.modules is not None:
        wrap(s.modules, "attribute", "modules.attribute")
        wrap(s.modules, "at_step_end", "modules.at_step_end")
    for sink in s.sinks:
        wrap(sink, "consume", type(sink).__name__ + ".consume")
        if hasattr(sink, "consume_packed"):
            wrap(sink, "consume_packed", type(sink).__name__ + ".consume_packed")
        wrap(sink, "step_end", type(sink).__name__ + ".step_end")
        if hasattr(sink, "tracker") and hasattr(sink, "_feed"):  # the inefficient analysis' batched fold
            wrap(sink.tracker, "feed", type(sink).__name__ + " tracker.feed")
            from msmemscope.analysis import inefficient
            wrap(inefficient.Columns, "of_parts", "inefficient.Columns.of_parts")
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = time.perf_counter() - t0
    print(f"{a.workload}, {a.steps} steps: {dt / a.steps * 1e6:.0f} µs a step; rows drained a step "
          f"{rows[0] / a.steps:.0f}, {tot['native drain'] / max(rows[0], 1):.0f} ns a row in the drain")
    for k, v in tot.most_common():
        print(f"  {k:32s} {v / a.steps / 1e3:8.1f} µs a step   calls a step {cnt[k] / a.steps:.2f}")
    msmemscope.stop()


LAYER = r'''
import os, sys, time, tempfile, statistics, json
sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
layer, workload, steps = {layer!r}, {workload!r}, {steps}
if layer != "plain":
    import msmemscope
    msmemscope.config(output=tempfile.mkdtemp(), collect_mode="immediate")
from step_costs import build, session
step = build(workload)
for _ in range(2):
    step()
if layer != "plain":
    from msmemscope.capture import session as S
    s = session()
    if layer in ("hooks", "records"):
        S.Session.step = lambda self, *a, **k: None
    if layer == "hooks":
        s._update_flags = lambda *a, **k: None
        s.native.m.set_flags(True, False, False, False, False, False, False)
import resource
walls, cpus, faults = [], [], []
for _ in range(5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step()
    walls.append((time.perf_counter() - t0) / steps); cpus.append((time.thread_time() - c0) / steps)
    faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps)
print("RESULT", json.dumps([statistics.median(walls), statistics.median(cpus), statistics.median(faults)]))
'''


def layers(a):
    names = ("plain", "hooks", "records", "full")
    got = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:
            code = LAYER.format(root=ROOT, here=HERE, layer=n, workload=a.workload, steps=a.steps)
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                sys.exit(f"{n}: no result\n{p.stderr[-2000:]}")
            got[n].append(json.loads(line[0][7:]))
        print(f"round {r + 1}: " + ", ".join(f"{n} {got[n][-1][0] * 1e6:.0f} µs" for n in names), flush=True)
    print("\n| layer | µs a step (median) | × plain, median of the rounds | thread CPU µs a step | page faults a step |")
    print("|---|---|---|---|---|")
    for n in names:
        ratios = [g[0] / p[0] for g, p in zip(got[n], got["plain"])]
        print(f"| {n} | {statistics.median(g[0] for g in got[n]) * 1e6:.0f} | {statistics.median(ratios):.3f}× "
              f"| {statistics.median(g[1] for g in got[n]) * 1e6:.0f} | {statistics.median(g[2] for g in got[n]):.0f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("parts", "layers"))
    p.add_argument("--workload", choices=("mlp", "gpt2", "transformer"), default="mlp")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--analysis", default=None)
    a = p.parse_args()
    if a.steps is None:
        a.steps = {"mlp": 1000, "gpt2": 100, "transformer": 10}[a.workload] if a.what == "parts" else {"mlp": 300, "gpt2": 40, "transformer": 4}[a.workload]
    parts(a) if a.what == "parts" else layers(a)


if __name__ == "__main__":
    main()
