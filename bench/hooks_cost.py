"""What decompose's autograd hooks cost by themselves, on a plain program: blocks of steps with
nothing, with our C++ saved-tensor pack hook pushed (it does nothing while no session traces), and
with our global module forward hooks (the C functions through ``eager_only``), in a shuffled order
each round; the median time a step of each, × nothing. No session runs: the hooks' own cost in
PyTorch (a saved tensor wrapped into a Python object, the GIL taken twice per saved tensor in
backward; ``Module._call_impl``'s slow path), apart from what the tool records.

    PYTHONPATH=. python bench/hooks_cost.py [--workload mlp|gpt2|transformer] [--rounds 12] [--steps 10]

BENCHMARKS.md, thirty-eighth session: invisible in wall time (within ±3%) on the MLP and GPT-2,
though the pack hook is 1.6 M instructions a GPT-2 step under callgrind."""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args(argv)
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from workloads import build
    from torch.nn.modules import module as nnm
    from msmemscope.capture import native
    from msmemscope.capture.modules import eager_only
    nat = native.built_with("mt_pre")
    if nat is None:
        print("bench/hooks_cost.py: the native module is not built (make native)", file=sys.stderr)
        return 2
    _, step = build(a.workload)
    for _ in range(3):
        step()
    res = {"nothing": [], "pack hook": [], "module hooks": []}
    for _ in range(a.rounds):
        order = list(res)
        random.shuffle(order)
        for state in order:
            handles = []
            if state == "pack hook":
                torch._C._autograd._push_saved_tensors_default_hooks(nat.mt_pack, nat.mt_unpack)
            elif state == "module hooks":
                handles = [nnm.register_module_forward_pre_hook(eager_only(nat.mt_pre)),
                           nnm.register_module_forward_hook(eager_only(nat.mt_post), always_call=True)]
            step()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            res[state].append((time.perf_counter() - t0) / a.steps)
            if state == "pack hook":
                torch._C._autograd._pop_saved_tensors_default_hooks()
            for h in handles:
                h.remove()
    base = statistics.median(res["nothing"])
    print(f"{a.workload}: {a.rounds} rounds of {a.steps} steps per state")
    print("| state | µs a step (median) | × nothing |")
    print("|---|---|---|")
    for k, v in res.items():
        m = statistics.median(v)
        print(f"| {k} | {m * 1e6:,.0f} | {m / base:.3f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
