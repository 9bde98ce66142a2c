"""Offline analyses on one generated dump, next to the bare read of the same file.

    PYTHONPATH=. python bench/offline.py [--events 10000000] [--out /tmp/offline_bench.csv] [--keep]

The dump (our CSV format, generated with polars by bench/inefficient_bench.py)
is shaped like a traced training loop with 8 steps, a Mark 'step' and a STEP row
ending each. Times: polars.read_csv of the file (strings, the floor), read_dump
(the reader every analysis uses), then each analysis end to end from the path:
leaks (marks A/B/C), step leaks, compare (step 3 vs step 4), inefficient,
decomposition summary. Prints one table with seconds and events per second.
"""
from __future__ import annotations

import argparse
import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import polars as pl  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=10_000_000)
    p.add_argument("--out", default="/tmp/offline_bench.csv")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--reuse", action="store_true")
    a = p.parse_args(argv)
    import inefficient_bench
    from inefficient_bench import timed
    from msmemscope.io.reader import read_dump
    if not (a.reuse and os.path.exists(a.out)):
        if os.path.exists(a.out):
            os.unlink(a.out)
        n, t = timed(lambda: inefficient_bench.generate(a.out, a.events, steps=8))
        print(f"generated {n} events ({os.path.getsize(a.out) / 1e6:.0f} MB) in {t:.1f} s: {a.out}", file=sys.stderr)
    sink = io.StringIO()
    rows = []

    def run(label, fn):
        _, t = timed(fn)
        rows.append((label, t))
        print(f"  {label}: {t:.2f} s", file=sys.stderr)

    n = pl.read_csv(a.out, infer_schema=False, columns=["ID"]).height
    run("polars.read_csv, all columns as strings (the floor)", lambda: pl.read_csv(a.out, infer_schema=False))
    run("read_dump (reader: CSV + Attr fields + steps)", lambda: read_dump(a.out))
    try:
        from msmemscope.analysis.leaks import check_leaks, check_step_leaks
        run("leaks, marks A/B/C (check_leaks)", lambda: check_leaks(a.out, "step", 2, out=sink))
        run("leaks, step rule + fluctuation (check_step_leaks)", lambda: check_step_leaks(a.out, out=sink))
    except ImportError:
        print("  leaks: not in this build", file=sys.stderr)
    from msmemscope.analysis.compare import compare
    import contextlib
    with contextlib.redirect_stdout(sink):
        run("compare step 3 vs step 4", lambda: compare(f"{a.out}:step=3", f"{a.out}:step=4"))
    from msmemscope.analysis.inefficient import check_inefficient
    run("inefficient (check_inefficient)", lambda: check_inefficient(a.out, write=False, quiet=True))
    from msmemscope.analysis.decompose import summarize
    run("decomposition summary (read + summarize)", lambda: summarize(read_dump(a.out)))
    print(f"\n{n} events, {os.path.getsize(a.out) / 1e6:.0f} MB CSV\n")
    print("| offline task | seconds | M events/s |")
    print("|---|---|---|")
    for label, t in rows:
        print(f"| {label} | {t:.2f} | {n / t / 1e6:.2f} |")
    if not a.keep:
        os.unlink(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
