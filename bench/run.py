"""Overhead of msmemscope against the plain program, and against peers, in one run.

    python bench/run.py [--workloads transformer,mlp] [--configs plain,default,...] [--repeats 5] [--steps 20]

Each (workload, config) runs in a fresh process; the time measured is the
training loop after two warm-up steps. Configurations run in rounds (every
configuration once per round), so that the machine's drift hits them alike. The
table shows each configuration's median, its ratio to the plain run's median,
and the median and spread of the per-round ratios (each run against the plain
run of its own round: the steadier figure where the machine drifts).

``--min-seconds S`` lengthens the loop of a workload whose plain run is shorter
than S (measured once before the rounds): 20 steps of the MLP are 0.1 s, less
than the spread between two runs of the same program.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKLOADS = {
    "mlp": ("examples.mlp", "SGD+momentum MLP 256-512-512-1, batch 64"),
    "transformer": ("examples.transformer", "GPT 4 layers d=256 ctx=128 batch 8, AdamW"),
    "gpt2": ("hf-gpt2", "transformers GPT2 n_layer=2 n_embd=64, AdamW"),
}
CONFIGS = {
    "plain": "the program alone",
    "default": "msmemscope, default events (alloc,free,launch); the native source where it is built",
    "default-eachstep": "msmemscope, default events, a flush at every step boundary (MSMEMSCOPE_STEP_FLUSH_S=0, as before the seventeenth session)",
    "default-dispatch": "msmemscope, default events, the dispatch-mode source (MSMEMSCOPE_SOURCE=python)",
    "default-rows": "msmemscope, default events, every flush's records made into row tuples (MSMEMSCOPE_RECORDS=rows, as before the thirty-fourth session)",
    "events": "msmemscope, default events with no analysis (--analysis=none): the default less the leak rule",
    "access": "msmemscope --analysis=inefficient (adds access events)",
    "access-rows": "msmemscope --analysis=inefficient, every flush's records made into row tuples (MSMEMSCOPE_RECORDS=rows, as before the thirty-fifth session)",
    "stack": "msmemscope --call-stack=python:10",
    "access-dispatch": "--analysis=inefficient on the dispatch-mode source (where it ran before the native access events)",
    "stack-dispatch": "--call-stack=python:10 on the dispatch-mode source (where it ran before the native stacks)",
    "profiler": "torch.profiler(profile_memory=True): the with-block, collection and its stop (what every user pays)",
    "profiler-collect": "torch.profiler(profile_memory=True), collection only: its stop left out of the timing (no user gets this)",
    "profiler+read": "torch.profiler(profile_memory=True) and key_averages() at the end: the cost to see the data",
    "memtracker": "torch.distributed._tools.MemTracker",
    "modules": "msmemscope, default events + module attribution (MSMEMSCOPE_MODULES=1; the native source)",
    "decompose-nomodules": "msmemscope --analysis=decompose without module attribution (MSMEMSCOPE_MODULES=0)",
    "decompose": "msmemscope --analysis=decompose: owners and module attribution, the per-module table",
    "decompose-rows": "msmemscope --analysis=decompose, the labels given to row tuples after the drain (MSMEMSCOPE_LABELS=rows, as before the thirty-seventh session)",
}
TRACED = ("default", "default-rows", "access-rows", "default-eachstep", "events", "default-dispatch", "access", "stack", "modules", "decompose-nomodules", "decompose",
          "decompose-rows", "access-dispatch", "stack-dispatch")

CHILD = textwrap.dedent(r'''
import json, os, sys, time, tempfile
sys.path.insert(0, {root!r})
import torch
torch.manual_seed(0)
torch.set_num_threads(1)
workload, config, steps, out = {workload!r}, {config!r}, {steps}, {out!r}

tmp = tempfile.mkdtemp()
if config in {traced!r}:
    if config.endswith("-dispatch"): os.environ["MSMEMSCOPE_SOURCE"] = "python"
    if config == "modules": os.environ["MSMEMSCOPE_MODULES"] = "1"
    if config == "default-eachstep": os.environ["MSMEMSCOPE_STEP_FLUSH_S"] = "0"
    if config.endswith("-rows"): os.environ["MSMEMSCOPE_RECORDS"] = "rows"
    if config == "decompose-nomodules": os.environ["MSMEMSCOPE_MODULES"] = "0"
    if config == "decompose-rows": os.environ["MSMEMSCOPE_LABELS"] = "rows"
    import msmemscope
    kw = dict(output=tmp, collect_mode="immediate")
    if config == "events": kw["analysis"] = "none"
    if config.startswith("access"): kw["analysis"] = "inefficient"
    if config.startswith("stack"): kw["call_stack"] = "python:10"
    if config.startswith("decompose"): kw["analysis"] = "decompose"
    msmemscope.config(**kw)
from bench.workloads import build
model, step = build(workload)
ctx = None
if config in ("profiler", "profiler-collect", "profiler+read"):
    from torch.profiler import profile, ProfilerActivity
    ctx = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    ctx.__enter__()
elif config == "memtracker":
    from torch.distributed._tools.mem_tracker import MemTracker
    ctx = MemTracker(); ctx.track_external(model); ctx.__enter__()
for _ in range(2):
    step()
    if config == "memtracker": ctx.reset_mod_stats()  # it refuses a second iteration otherwise
import resource
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t0 = time.perf_counter()
c0 = time.process_time()
for _ in range(steps):
    step()
    if config == "memtracker": ctx.reset_mod_stats()
if config in ("profiler", "profiler+read"):
    ctx.__exit__(None, None, None)  # the stop turns the collected records into results: part of its cost
    if config == "profiler+read":
        ctx.key_averages()
    ctx = None
dt = time.perf_counter() - t0
cpu = time.process_time() - c0
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
if ctx is not None:
    ctx.__exit__(None, None, None)
source = None
if config in {traced!r}:
    from msmemscope import capture
    source = capture.current().config["source"]
json.dump({{"seconds": dt, "cpu_seconds": cpu, "faults": faults, "source": source}}, open(out, "w"))
''')


CPU_TIME = False  # --cpu-time: the traced process's CPU time (user+sys), steadier on a loaded machine


def run_one(workload, config, steps, env=None):
    """(seconds of the timed loop, its page faults), from a fresh process."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    code = CHILD.format(root=ROOT, workload=workload, config=config, steps=steps, out=out, traced=TRACED)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{workload}/{config} failed: {r.stderr.strip().splitlines()[-1:]}")
    with open(out) as f:
        res = json.load(f)
    want = {"default": "native", "default-rows": "native", "default-eachstep": "native", "events": "native", "modules": "native", "default-dispatch": "dispatch", "access": "native", "access-rows": "native",
            "stack": "native", "access-dispatch": "dispatch", "stack-dispatch": "dispatch", "decompose": "native",
            "decompose-nomodules": "native", "decompose-rows": "native"}.get(config)
    if want == "native" and res["source"] != "native":
        # the native source is not built for this checkout: the figure would be the other source's
        raise RuntimeError(f"{workload}/{config} ran on the {res['source']} source (make native)")
    return res["cpu_seconds"] if CPU_TIME else res["seconds"], res.get("faults")


def quantile(xs, q):
    """The q-quantile of xs, linear between the two nearest (xs not empty)."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="mlp,transformer")
    p.add_argument("--configs", default="plain,default,default-dispatch,access,stack,profiler-collect,profiler,profiler+read,memtracker")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--stable-malloc", action="store_true",
                   help="fix glibc malloc's mmap and trim thresholds in every run (GLIBC_TUNABLES), so that "
                        "page faults from its adaptive heuristics do not move the figures")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the loop by the process's CPU time instead of the wall clock (a loaded, shared "
                        "machine; leaves out the writer process's share)")
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="run more steps than --steps where a workload's plain loop would take less than this")
    a = p.parse_args(argv)
    global CPU_TIME
    CPU_TIME = a.cpu_time
    results = {}
    env = None
    if a.stable_malloc:
        env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432")
    configs = a.configs.split(",")
    faults = {}
    steps_of = {}
    for w in a.workloads.split(","):
        steps_of[w] = a.steps
        if a.min_seconds > 0:
            t, _ = run_one(w, "plain", a.steps, env)
            steps_of[w] = max(a.steps, math.ceil(a.steps * a.min_seconds / max(t, 1e-9)))
        for rep in range(a.repeats):  # interleave configs so drift hits all alike
            for c in configs:
                try:
                    t, flt = run_one(w, c, steps_of[w], env)
                except RuntimeError as e:
                    print(f"  skipped: {e}", file=sys.stderr)
                    t = flt = None
                results.setdefault((w, c), []).append(t)
                faults.setdefault((w, c), []).append(flt)
    print(f"| workload | steps | config | median {'CPU ' if CPU_TIME else ''}s | ratio of medians | "
          "median of the rounds' ratios [25%-75%] | page faults a step |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for w in a.workloads.split(","):
        plain = results.get((w, "plain"), [])
        got = [x for x in plain if x is not None]
        base = statistics.median(got) if got else None
        for c in configs:
            xs = results.get((w, c), [])
            ok = [x for x in xs if x is not None]
            if not ok:
                print(f"| {w} | {steps_of[w]} | {c} | failed | | | |")
                continue
            m = statistics.median(ok)
            ratio = m / base if base else float("nan")
            # each run against the plain run of its own round (same position in the lists)
            paired = [x / p for x, p in zip(xs, plain) if x is not None and p]
            pr = statistics.median(paired) if paired else float("nan")
            spread = f"[{quantile(paired, .25):.2f}-{quantile(paired, .75):.2f}]" if paired else ""
            fl = [f for f in faults.get((w, c), []) if f is not None]
            fps = statistics.median(fl) / steps_of[w] if fl else float("nan")
            rows.append({"workload": w, "config": c, "steps": steps_of[w], "median_s": m, "ratio": ratio,
                         "paired_ratio": pr, "paired": paired, "runs": xs, "faults": faults.get((w, c))})
            print(f"| {w} | {steps_of[w]} | {c} | {m:.3f} | {ratio:.2f}x | {pr:.2f}x {spread} | {fps:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
