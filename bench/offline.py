"""Offline analyses on one generated dump, next to the bare read of the same file.

    PYTHONPATH=. python bench/offline.py [--events 3000000] [--out /tmp/offline_bench.csv] [--keep] [--reuse]
                                         [--tasks read,leaks,...] [--repeat 1] [--companion]

The dump (our CSV format, generated with polars by bench/inefficient_bench.py)
is shaped like a traced training loop with 8 steps, a Mark 'step' and a STEP row
ending each, and ACCESS rows (so that every analysis has its input). Each task runs in a
fresh process (so its peak memory is its own: ``ru_maxrss`` of that process, less the
interpreter with polars imported) and is timed from the path to the result:
``polars.read_csv`` of the file with every column as a string (the floor), ``read_dump``
(every column the reader offers), leaks (marks A/B/C), step leaks, compare (step 3 vs
step 4), inefficient, the decomposition summary, and the summary command's per-rank work.
Prints one table: seconds and CPU seconds (the steadier figure on a loaded machine), each as × the
bare read, the CPU inside ``read_dump`` apart from the rest (imports and the analysis' own work),
and peak MB, × the bare read's peak.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TASKS = {
    "bare": "polars.read_csv, all columns as strings (the floor)",
    "read": "read_dump (every column: CSV + Attr fields + steps)",
    "leaks": "leaks, marks A/B/C (check_leaks)",
    "step_leaks": "leaks, step rule + fluctuation (check_step_leaks)",
    "compare": "compare step 3 vs step 4",
    "inefficient": "inefficient (check_inefficient)",
    "decompose": "decomposition (decompose.summarize_dump)",
    "summary": "summary, one rank (summary.analyse_rank)",
}


def run_task(task: str, path: str) -> None:
    """In the child: import, note the baseline RSS, run the task, print seconds and peak."""
    import contextlib
    import io
    import resource
    import polars as pl
    sink = io.StringIO()

    def hwm():
        # this process's own high-water mark: ru_maxrss keeps the parent's across exec
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    base = hwm()
    # the time inside read_dump, apart: the rest is the analysis' own work (patched before the
    # analyses import it, so that a module-level import gets the timed one)
    from msmemscope.io import reader as R
    inner = {"cpu": 0.0, "seconds": 0.0}
    plain = R.read_dump

    def timed_read(*args, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return plain(*args, **kw)
        finally:
            inner["seconds"] += time.perf_counter() - t0
            inner["cpu"] += time.process_time() - c0
    R.read_dump = timed_read
    t, c = time.perf_counter(), time.process_time()
    if task == "warm":  # the analyses' modules compiled once, before any timing
        import msmemscope.analysis.compare  # noqa: F401
        import msmemscope.analysis.decompose  # noqa: F401
        import msmemscope.analysis.inefficient  # noqa: F401
        import msmemscope.analysis.leaks  # noqa: F401
        import msmemscope.report.summary  # noqa: F401
    elif task == "bare":
        pl.read_csv(path, infer_schema=False)
    elif task == "read":
        from msmemscope.io.reader import read_dump
        read_dump(path)
    elif task == "leaks":
        from msmemscope.analysis.leaks import check_leaks
        check_leaks(path, "step", 2, out=sink)
    elif task == "step_leaks":
        from msmemscope.analysis.leaks import check_step_leaks
        check_step_leaks(path, out=sink)
    elif task == "compare":
        from msmemscope.analysis.compare import compare
        with contextlib.redirect_stdout(sink):
            compare(f"{path}:step=3", f"{path}:step=4")
    elif task == "inefficient":
        from msmemscope.analysis.inefficient import check_inefficient
        check_inefficient(path, write=False, quiet=True)
    elif task == "decompose":
        from msmemscope.analysis import decompose
        fn = getattr(decompose, "summarize_dump", None)
        if fn is not None:
            fn(path)
        else:
            from msmemscope.io.reader import read_dump
            decompose.summarize(read_dump(path))
    elif task == "summary":
        from msmemscope.report.summary import analyse_rank
        r = analyse_rank({"path": path, "folder": os.path.dirname(path), "config": {}, "label": "rank0"})
        assert "error" not in r, r["error"]
    else:
        raise SystemExit(f"unknown task {task}")
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    peak = hwm()
    del resource
    print(json.dumps({"seconds": dt, "cpu": cpu, "peak_kb": peak, "base_kb": base, "read_cpu": inner["cpu"]}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=3_000_000)
    p.add_argument("--out", default="/tmp/offline_bench.csv")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--repeat", type=int, default=1, help="runs per task (the median is shown)")
    p.add_argument("--companion", action="store_true",
                   help="give the dump its capture-time columnar companion (io/columns.py, made from its "
                        "text once, timed apart) so that the analyses read it, as they read a dump the "
                        "tool wrote; without it they read the text (MSMEMSCOPE_COLUMN_CACHE=0)")
    p.add_argument("--task", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.task:
        run_task(a.task, a.out)
        return 0
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import polars as pl
    if not (a.reuse and os.path.exists(a.out)):
        import inefficient_bench
        if os.path.exists(a.out):
            os.unlink(a.out)
        t = time.perf_counter()
        inefficient_bench.generate(a.out, a.events, steps=8)
        print(f"generated {os.path.getsize(a.out) / 1e6:.0f} MB in {time.perf_counter() - t:.1f} s: {a.out}",
              file=sys.stderr)
    n = pl.read_csv(a.out, infer_schema=False, columns=["ID"]).height
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # bytecode written, as a pip install leaves it: with PYTHONDONTWRITEBYTECODE (set in some
    # shells) every child compiled polars, numpy and our modules again, ~0.2 s inside each task's time
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    import shutil
    from msmemscope.io import column_writer as W
    from msmemscope.io import columns as C
    if a.companion:
        env.pop("MSMEMSCOPE_COLUMN_CACHE", None)
        t, c = time.perf_counter(), time.process_time()
        ok = W.write_for(a.out)
        print(f"companion {'made' if ok else 'NOT made'} in {time.perf_counter() - t:.1f} s "
              f"({time.process_time() - c:.1f} CPU s)", file=sys.stderr)
    else:
        env["MSMEMSCOPE_COLUMN_CACHE"] = "0"
    subprocess.run([sys.executable, os.path.abspath(__file__), "--task", "warm", "--out", a.out], env=env,
                   capture_output=True)
    results = {}
    tasks = [t for t in a.tasks.split(",") if t]
    if "bare" not in tasks:
        tasks.insert(0, "bare")
    for _ in range(a.repeat):
        for task in tasks:  # interleaved: a load spike hits every task alike
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--task", task, "--out", a.out],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"  {task}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.setdefault(task, []).append(r)
            print(f"  {task}: {r['seconds']:.2f} s (CPU {r['cpu']:.2f} s, of which read_dump {r['read_cpu']:.2f} s), "
                  f"peak {r['peak_kb'] / 1024:.0f} MB", file=sys.stderr)

    def med(task, key):
        v = sorted(x[key] for x in results[task])
        return v[len(v) // 2]
    bare_t, bare_c = med("bare", "seconds"), med("bare", "cpu")
    bare_m = med("bare", "peak_kb") - med("bare", "base_kb")
    print(f"\n{n} events, {os.path.getsize(a.out) / 1e6:.0f} MB CSV, median of {a.repeat}\n")
    print("| offline task | seconds | × bare read | CPU s | × bare read's CPU | of which read_dump, × | the rest "
          "(import + own work), × | peak MB over the interpreter | × bare read's |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task in tasks:
        if task not in results:
            continue
        t, cp, m = med(task, "seconds"), med(task, "cpu"), med(task, "peak_kb") - med(task, "base_kb")
        rd = med(task, "read_cpu")
        split = "| — | — " if task == "bare" else f"| {rd / bare_c:.2f}× | {(cp - rd) / bare_c:.2f}× "
        print(f"| {TASKS[task]} | {t:.2f} | {t / bare_t:.2f}× | {cp:.2f} | {cp / bare_c:.2f}× {split}"
              f"| {m / 1024:.0f} | {m / bare_m:.2f}× |")
    if not a.keep:
        os.unlink(a.out)
        shutil.rmtree(C.folder_of(a.out), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
