"""Tracing on and off in one process, block after block: what tracing costs, without the spread
between processes.

    python bench/ab.py [--workload mlp|gpt2|transformer] [--analysis A] [--blocks 40] [--steps N]

Why: two runs of the same plain program in two processes differ by up to ±7% on this machine (the
heap lands differently; BENCHMARKS.md), more than the differences looked for. Here one process
alternates blocks of steps in three states, in turn:
- ``plain``: tracing stopped (``msmemscope.stop()``);
- ``floor``: tracing stopped, and PyTorch's ``RecordFunction`` running with one callback that does
  nothing (FUNCTION scope, no inputs, as the native source installs it): what any tracer of op
  launches built on ``RecordFunction`` pays before it records anything (torch.profiler too);
- ``traced``: tracing started (``msmemscope.start()``), with ``--analysis``;
- with ``--rows``, also ``traced-rows``: tracing started with every flush's native records made into
  row tuples (``MSMEMSCOPE_RECORDS=rows``: the flush path before the thirty-fourth session);
- with ``--hooks``, also ``pack hook`` and ``module hooks``: tracing stopped, with only our C++
  saved-tensor pack hook pushed, or only our global module forward hooks (the C functions through
  ``eager_only``) on; they do nothing while no session traces: PyTorch's own cost of having them
  (a saved tensor wrapped into a Python object and the GIL taken twice per saved tensor in
  backward; ``Module._call_impl``'s slow path), what decompose pays for them (thirty-eighth session);
- with ``--profiler``, also ``profiler``: ``torch.profiler.profile(activities=[CPU],
  profile_memory=True)`` entered before the block and left after it (its collection only: the
  stop, which turns the records into events, is outside the timed block).
The states' order is shuffled in each round, and each block's first step is not timed. Each
block's time a step is one sample; the table gives each state's median and its ratio to
``plain``. Starting and stopping happen between the timed blocks. What this does not show is the
cost of a different heap layout in a traced process (page faults): bench/run.py, a process per
configuration, stays the judge of the issues' targets.

The no-op callback is a small C++ extension built on first use (torch's cpp_extension, cached
under ~/.cache/msmemscope/bench_floor).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_FLOOR_SRC = r'''
#include <torch/extension.h>
#include <ATen/record_function.h>
namespace {
std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction&) { return nullptr; }
void leave(const at::RecordFunction&, at::ObserverContext*) {}
}
int64_t add_floor(bool io) {
  return (int64_t)at::addGlobalCallback(at::RecordFunctionCallback(enter, leave)
      .needsInputs(io).needsOutputs(io).needsIds(false).scopes({at::RecordScope::FUNCTION}));
}
void remove_floor(int64_t h) { at::removeCallback((at::CallbackHandle)h); }
'''


def floor_module():
    from torch.utils.cpp_extension import load_inline
    d = os.path.join(os.path.expanduser("~"), ".cache", "msmemscope", "bench_floor")
    os.makedirs(d, exist_ok=True)
    return load_inline("msmemscope_bench_floor2", cpp_sources=_FLOOR_SRC, functions=["add_floor", "remove_floor"],
                       build_directory=d, verbose=False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="mlp")
    p.add_argument("--analysis", default="leaks", help="the traced state's --analysis (default: leaks, the default)")
    p.add_argument("--blocks", type=int, default=40, help="blocks of each state")
    p.add_argument("--floor-io", action="store_true",
                   help="the floor's callback asks for the ops' inputs and outputs (as the access events' does)")
    p.add_argument("--profiler", action="store_true", help="a fourth state: torch.profiler collecting")
    p.add_argument("--rows", action="store_true", help="a state traced with every flush drained into row tuples")
    p.add_argument("--hooks", action="store_true", help="two states: our saved-tensor pack hook alone, our module hooks alone")
    p.add_argument("--steps", type=int, default=0, help="steps a block (default: ~0.4 s of plain steps)")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    floor = floor_module()
    import msmemscope
    msmemscope.config(output=tempfile.mkdtemp(), collect_mode="immediate", analysis=a.analysis)
    from bench.workloads import build
    step = build(a.workload)[1]
    for _ in range(3):
        step()
    from msmemscope import capture
    if capture.current().config.get("source") != "native":
        print("the native source is not built (make native): this would time the other source", file=sys.stderr)
        return 1
    msmemscope.stop()
    n = a.steps
    if n <= 0:
        t = time.perf_counter()
        step()
        n = max(1, int(0.4 / max(time.perf_counter() - t, 1e-6)))
    times = {"plain": [], "floor": [], "traced": []}
    if a.profiler:
        times["profiler"] = []
        from torch.profiler import ProfilerActivity, profile
    if a.rows:
        times["traced-rows"] = []
    if a.hooks:
        times["pack hook"], times["module hooks"] = [], []
        from torch.nn.modules import module as nn_module
        from msmemscope.capture import native
        from msmemscope.capture.modules import eager_only
        nat = native.built_with("mt_pre")
    from msmemscope.capture import session as S
    packed = S._PACKED
    import random
    rng = random.Random(0)
    order = list(times)
    for _ in range(a.blocks):
        rng.shuffle(order)  # no state always follows the same other one
        for state in order:
            h = floor.add_floor(a.floor_io) if state == "floor" else None
            prof = None
            if state in ("traced", "traced-rows"):
                S._PACKED = packed and state == "traced"
                msmemscope.start()
            elif state == "profiler":
                prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                prof.__enter__()
            elif state == "pack hook":
                torch._C._autograd._push_saved_tensors_default_hooks(nat.mt_pack, nat.mt_unpack)
            elif state == "module hooks":
                hooks = [nn_module.register_module_forward_pre_hook(eager_only(nat.mt_pre)),
                         nn_module.register_module_forward_hook(eager_only(nat.mt_post), always_call=True)]
            step()  # not timed: the first step after a change of state
            t = time.perf_counter()
            for _ in range(n):
                step()
            times[state].append((time.perf_counter() - t) / n)
            if state in ("traced", "traced-rows"):
                msmemscope.stop()
            if prof is not None:
                prof.__exit__(None, None, None)
            if h is not None:
                floor.remove_floor(h)
            if state == "pack hook":
                torch._C._autograd._pop_saved_tensors_default_hooks()
            elif state == "module hooks":
                for hk in hooks:
                    hk.remove()
    base = statistics.median(times["plain"])
    print(f"{a.workload}, --analysis={a.analysis}{' --floor-io' if a.floor_io else ''}: {a.blocks} blocks of {n} steps per state, interleaved")
    print("| state | µs a step (median) | × plain |")
    print("|---|---|---|")
    for state, xs in times.items():
        m = statistics.median(xs)
        print(f"| {state} | {m * 1e6:,.0f} | {m / base:.3f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
