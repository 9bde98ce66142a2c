"""Online overhead as instruction counts: the same workloads and configurations as bench/run.py,
each run under valgrind's callgrind with instrumentation switched on only around the timed steps.

Why: on the 2-core machine whole-process times of the same plain program spread 20-60% between
runs (memory layout, the other core, the host), so a change of a few percent cannot be seen in
seconds. Instruction counts are repeatable for the same binary and inputs whatever the load
(the docs of the machine), so this says exactly what a change adds or removes per step, and
where (--top). It does not see cache misses, page faults or the writer process (a child, not
followed): the wall-clock ratio of bench/run.py stays the judge of the issue's targets.

    python bench/instructions.py --workloads gpt2,mlp --configs plain,default,access --steps 4 [--top 20]

Each configuration is one process (~1-2 min: the start-up runs uninstrumented under valgrind);
they run two at a time. The loop's first flush still drains what the two warm-up steps left (the
held first optimizer step): over 4 steps it adds ~0.4-0.7 M instructions a step on GPT-2; use
--steps 12 for steady-state figures (BENCHMARKS.md, thirty-fifth session).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import CHILD, ROOT, TRACED  # noqa: E402  the same workloads and configurations

_ON = '''
import subprocess as _sp
def _callgrind(state):
    _sp.run(["callgrind_control", "-i", state, str(os.getpid())], capture_output=True)
'''


def child_code(workload, config, steps, out):
    code = CHILD.format(root=ROOT, workload=workload, config=config, steps=steps, out=out, traced=TRACED)
    # instrumentation on for the timed loop only (the same loop bench/run.py times)
    code = code.replace("t0 = time.perf_counter()\n", _ON + "_callgrind('on')\nt0 = time.perf_counter()\n", 1)
    code = code.replace("dt = time.perf_counter() - t0\n", "_callgrind('off')\ndt = time.perf_counter() - t0\n", 1)
    return code


def measure(workload, config, steps, keep):
    out = os.path.join(keep, f"{workload}.{config}.json")
    cg = os.path.join(keep, f"{workload}.{config}.callgrind")
    env = dict(os.environ)
    if config.endswith("-dispatch"):
        env["MSMEMSCOPE_SOURCE"] = "python"
    r = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={cg}",
                        sys.executable, "-c", child_code(workload, config, steps, out)],
                       capture_output=True, text=True, env=env)
    m = re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"{workload}/{config}: {r.stderr.strip().splitlines()[-3:]}")
    return int(m.group(1).replace(",", "")), cg


def by_function(cg):
    text = subprocess.run(["callgrind_annotate", "--threshold=100", cg], capture_output=True, text=True).stdout
    counts = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.*)", line)
        if m and "PROGRAM TOTALS" not in m.group(2):
            key = re.sub(r"'\d+", "", m.group(2))  # recursion levels of one function are one function
            counts[key] = counts.get(key, 0) + int(m.group(1).replace(",", ""))
    return counts


def library(fn):
    for tag, name in (("Python-3", "python"), ("libpython", "python"), ("msmemscope_native", "msmemscope C++"),
                      ("libtorch_cpu", "libtorch_cpu"), ("libc.so", "libc"), ("malloc/", "libc"), ("string/", "libc"),
                      ("nptl", "libc"), ("libstdc++", "libstdc++"), ("ld-linux", "ld.so (TLS)")):
        if tag in fn:
            return name
    return "other"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="gpt2,mlp")
    ap.add_argument("--configs", default="plain,default,access")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=0, help="the N functions that add the most, per configuration")
    ap.add_argument("--keep", help="a folder for the callgrind files (default: a temporary one, removed)")
    a = ap.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench/instructions.py: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    keep = a.keep or tempfile.mkdtemp()
    os.makedirs(keep, exist_ok=True)
    workloads, configs = a.workloads.split(","), a.configs.split(",")
    if "plain" not in configs:
        configs.insert(0, "plain")
    jobs = [(w, c) for w in workloads for c in configs]
    with cf.ThreadPoolExecutor(max_workers=2) as ex:
        res = dict(zip(jobs, ex.map(lambda j: measure(j[0], j[1], a.steps, keep), jobs)))
    print("| workload | config | instructions a step | × plain |")
    print("|---|---|---|---|")
    for w in workloads:
        base = res[(w, "plain")][0]
        for c in configs:
            n = res[(w, c)][0]
            print(f"| {w} | {c} | {n / a.steps / 1e6:.1f} M | {n / base:.3f}× |")
    if a.top:
        for w in workloads:
            plain = by_function(res[(w, "plain")][1])
            for c in configs:
                if c == "plain":
                    continue
                got = by_function(res[(w, c)][1])
                added = {k: got.get(k, 0) - plain.get(k, 0) for k in set(got) | set(plain)}
                libs = {}
                for k, v in added.items():
                    libs[library(k)] = libs.get(library(k), 0) + v
                print(f"\n{w} / {c}: added M instructions a step by library: " +
                      ", ".join(f"{k} {v / a.steps / 1e6:+.2f}" for k, v in sorted(libs.items(), key=lambda x: -x[1])))
                for k, v in sorted(added.items(), key=lambda x: -x[1])[:a.top]:
                    print(f"  {v / a.steps / 1e6:+7.3f} M  {k[:140]}")
    if not a.keep:
        shutil.rmtree(keep, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
