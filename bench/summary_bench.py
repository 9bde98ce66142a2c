"""Speed of ``msmemscope summary`` over many rank dumps.

    PYTHONPATH=. python bench/summary_bench.py [--ranks 64] [--events 1000000] [--root /tmp/msmemscope_summary_bench]
                                               [--workers N] [--keep] [--reuse] [--results] [--from-dumps]
                                               [--engine pool|ray]

Generates (numpy + polars, vectorized) one run folder per rank, laid out as the
launcher leaves them (``msmemscope_<pid>_<ts>_cuda_rank<R>/config.json`` and
``device_0/dump/memscope_dump_<ts>.csv``), each dump shaped like a traced
training loop in our CSV format: per op ``ATEN_START``, the ``MALLOC`` of its
output, ``ATEN_END``, then the ``FREE`` of the block made 64 ops earlier;
``SYSTEM/STEP`` rows split the run into 8 steps; the first blocks (weights) live
throughout. ``used`` is the running sum, ``total`` a caching allocator's
reserved bytes (the peak so far rounded up to 2 MiB). One rank allocates 1.5x
(the imbalance to find), one keeps one block in 500 (the leak to find).

With ``--results`` each rank also gets the ``analysis/peaks.json`` and ``leaks.json`` its online
analyses would have written (computed from the same arrays): the summary then reads those, not
the dumps (``--from-dumps`` makes it read the dumps anyway, for the comparison).

Then runs the summary (``report.summary.build``) over the root with a process
pool and prints its wall time, the CPU time of the workers, and how many
cores were busy on average (CPU time / wall time) against the CPUs present.
The data stays under ``--root`` (default in /tmp) and is removed unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import polars as pl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

HEADER_COLS = ["ID", "Event", "Event Type", "Name", "Timestamp(ns)", "Process Id", "Thread Id", "Device Id",
               "Ptr", "Attr", "Call Stack(Python)", "Call Stack(C)"]
OPS = ["torch._ops.aten.mm.default", "torch._ops.aten.add.Tensor", "torch._ops.aten.mul.Tensor",
       "torch._ops.aten.relu.default", "torch._ops.aten.empty.memory_format", "torch._ops.aten.addmm.default"]
WINDOW = 64        # a block is freed this many ops after it was made
STEPS = 8
WEIGHTS = 32       # the first blocks: never freed
LEAK_EVERY = 500   # the leaking rank keeps one block in this many (from step 2 on)
RESERVE = 2 << 20  # reserved bytes grow in 2 MiB segments
TS = "20261129120000"


def _hex(col: str, base: int) -> pl.Expr:
    # 16 hex digits; a decimal string is a valid hex number, unique per block
    return pl.concat_str([pl.lit("0x"), (pl.col(col) + base).cast(pl.String).str.zfill(16)])


def dump_frame(events: int, rank: int, pid: int, scale: float = 1.0, leak: bool = False, seed: int = 0,
               results: dict | None = None) -> pl.DataFrame:
    """The 12 dump columns of one rank, about ``events`` rows, in ID order. ``results``, when given,
    receives what the online analyses of such a run write (``analysis/peaks.json``, ``leaks.json``)."""
    rng = np.random.default_rng(seed + rank)
    n = max(events // 4, 4 * WINDOW + STEPS)          # ops; 4 rows each (START, MALLOC, END, FREE)
    unit = (n - 2 * WINDOW) // STEPS                  # ops per step; the run ends inside an unended step
    i = np.arange(n, dtype=np.int64)
    size = (rng.integers(1, 2048, n) * 512 * scale).astype(np.int64) // 512 * 512 + 512
    size[:WEIGHTS] *= 64
    op = rng.integers(0, len(OPS), n)
    step_of = np.minimum(i // unit, STEPS) + 1        # the step each op falls in
    # FREE row at op j frees block j - WINDOW, unless that block is a weight or leaked
    freed = i - WINDOW
    ok = freed >= WEIGHTS
    if leak:
        fb = np.where(ok, freed, 0)
        ok &= ~((fb % LEAK_EVERY == 0) & (step_of[fb] >= 2))
    fidx = freed[ok]
    # rows: (position key, kind) with key = 8*op + slot; STEP rows after the last op of each step
    kinds = {"S": 0, "M": 1, "E": 2, "F": 3}
    pos = np.concatenate([8 * i + 0, 8 * i + 1, 8 * i + 2, 8 * fidx + 8 * WINDOW + 3,
                          8 * (np.arange(1, STEPS + 1) * unit - 1) + 5])
    kind = np.concatenate([np.full(n, 0), np.full(n, 1), np.full(n, 2), np.full(len(fidx), 3),
                           np.full(STEPS, 4)]).astype(np.int8)
    blk = np.concatenate([i, i, i, fidx, np.zeros(STEPS, np.int64)])
    order = np.argsort(pos, kind="stable")
    kind, blk = kind[order], blk[order]
    delta = np.where(kind == kinds["M"], size[blk], np.where(kind == kinds["F"], -size[blk], 0))
    used = np.cumsum(delta)
    total = (np.maximum.accumulate(used) // RESERVE + 1) * RESERVE
    stepno = np.cumsum(kind == 4)
    rows = len(kind)
    ids = np.arange(1, rows + 1, dtype=np.int64)
    if results is not None:
        results.update(_results(kind, blk, used, total, stepno, ids, size, op, rows))
    k = pl.Series(kind)
    owner = np.where(blk < WEIGHTS, '"PTA@weight"', np.where(blk % 3 == 0, '"PTA@ops"', '"PTA@activation"'))
    df = pl.DataFrame({"k": k, "blk": blk, "size": size[blk], "used": used, "total": total,
                       "op": pl.Series(np.array(OPS)[op[blk]]), "owner": pl.Series(owner), "stepno": stepno}
                      ).with_columns(addr=_hex("blk", 0x7F0000000000 // 4096))
    c = pl.col

    def cat(*parts):
        return pl.concat_str([p if isinstance(p, pl.Expr) else pl.lit(p) for p in parts])
    mem_attr = cat('{"allocation_id":', (c("blk") + 1).cast(pl.String), ',"addr":"', c("addr"), '","size":',
                   c("size").cast(pl.String), ',"used":', c("used").cast(pl.String), ',"total":',
                   c("total").cast(pl.String))
    out = df.select(
        ID=pl.Series(ids),
        Event=pl.when(pl.col("k") == 4).then(pl.lit("SYSTEM"))
        .when(pl.col("k") == 1).then(pl.lit("MALLOC")).when(pl.col("k") == 3).then(pl.lit("FREE"))
        .otherwise(pl.lit("OP_LAUNCH")),
        **{"Event Type": pl.when(pl.col("k") == 0).then(pl.lit("ATEN_START"))
           .when(pl.col("k") == 2).then(pl.lit("ATEN_END")).when(pl.col("k") == 4).then(pl.lit("STEP"))
           .otherwise(pl.lit("PTA"))},
        Name=pl.when(pl.col("k").is_in([0, 1, 2])).then("op").otherwise(pl.lit("N/A")),
        **{"Timestamp(ns)": pl.Series(1_800_000_000_000_000_000 + ids * 997),
           "Process Id": pl.lit(pid), "Thread Id": pl.lit(pid), "Device Id": pl.lit("0")},
        Ptr=pl.when(pl.col("k").is_in([1, 3])).then("addr").otherwise(pl.lit("N/A")),
        Attr=pl.when(pl.col("k") == 1).then(cat(mem_attr, ',"owner":', c("owner"), "}"))
        .when(pl.col("k") == 3).then(cat(mem_attr, "}"))
        .when(pl.col("k") == 4).then(cat('{"step":', c("stepno").cast(pl.String), "}")),
        **{"Call Stack(Python)": pl.lit(None, dtype=pl.String), "Call Stack(C)": pl.lit(None, dtype=pl.String)},
    )
    return out


def _results(kind, blk, used, total, stepno, ids, size, op, rows) -> dict:
    """The online results of the rank (the step rule of SPEC 4.1 on the same arrays)."""
    mem = (kind == 1) | (kind == 3)
    peaks = {"analysis": "peaks", "final": True, "events": int(rows), "steps": STEPS,
             "peaks": [{"device": "0", "pool": "PTA", "peak_allocated": int(used[mem].max()),
                        "peak_reserved": int(total[mem].max())}],
             "access_rows": False, "owner_labels": False}
    m, f = kind == 1, kind == 3
    m_blk, m_step, m_id = blk[m], stepno[m] + 1, ids[m]
    freed_step = np.full(int(blk.max()) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    freed_step[blk[f]] = stepno[f] + 1
    bad = (m_step >= 2) & (m_step + 1 <= STEPS) & (freed_step[m_blk] > m_step + 1)
    leaks = []
    for b, st, i in zip(m_blk[bad].tolist(), m_step[bad].tolist(), m_id[bad].tolist()):
        addr = 0x7F0000000000 // 4096 + b  # the decimal digits read as hex, as in the dump
        leaks.append({"device": "0", "pool": "PTA", "address": f"0x{addr:016d}", "size": int(size[b]),
                      "step": int(st), "detected_at_step": int(st) + 1, "op": OPS[op[b]], "alloc_id": b + 1,
                      "id": int(i)})
    res = {"analysis": "leaks", "rule": "blocks allocated in step s >= 2 still live at the end of step s+1",
           "steps_ended": STEPS, "leaks": leaks,
           "summary": [{"device": "0", "count": len(leaks), "bytes": sum(x["size"] for x in leaks)}] if leaks else [],
           "fluctuation": []}
    return {"peaks": peaks, "leaks": res}


def write_rank(root: str, rank: int, world: int, events: int, scale: float = 1.0, leak: bool = False,
               pid: int | None = None, results: bool = False) -> str:
    """One run folder as the launcher leaves it; returns its path. ``results``: also the
    ``analysis/*.json`` its online analyses would have written."""
    pid = pid if pid is not None else 100000 + rank
    folder = os.path.join(root, f"msmemscope_{pid}_{TS}_cuda_rank{rank}")
    dump_dir = os.path.join(folder, "device_0", "dump")
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, f"memscope_dump_{TS}.csv")
    res = {} if results else None
    dump_frame(events, rank, pid, scale, leak, results=res).write_csv(path, null_value="", quote_style="necessary")
    if results:
        os.makedirs(os.path.join(folder, "analysis"), exist_ok=True)
        for name, r in res.items():
            with open(os.path.join(folder, "analysis", f"{name}.json"), "w") as f:
                json.dump(r, f, indent=2)
    cfg = {"tool": "msmemscope", "version": "bench", "pid": pid, "rank": rank, "local_rank": rank % 8,
           "world_size": world, "host": f"node{rank // 8}", "backend": "cuda", "device": "0",
           "dump": os.path.relpath(path, folder), "start_time": TS}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return folder


def _machine_cpu():
    """(busy jiffies, all jiffies, load average) of the whole machine, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v), os.getloadavg()[0]
    except (OSError, ValueError, IndexError):
        return None


def generate(root: str, ranks: int, events: int, big: int, leak: int, results: bool = False) -> float:
    t0 = time.perf_counter()
    for r in range(ranks):
        write_rank(root, r, ranks, events, scale=1.5 if r == big else 1.0, leak=(r == leak), results=results)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--root", default="/tmp/msmemscope_summary_bench")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: the CPUs)")
    p.add_argument("--keep", action="store_true", help="keep the generated dumps")
    p.add_argument("--reuse", action="store_true", help="reuse the dumps already under --root")
    p.add_argument("--results", action="store_true",
                   help="also write each rank's online results (analysis/peaks.json, leaks.json)")
    p.add_argument("--from-dumps", action="store_true", help="summary from the dumps even where results exist")
    p.add_argument("--engine", default="pool", choices=("pool", "ray"))
    a = p.parse_args(argv)
    from msmemscope.report.summary import build, verdict_lines
    big, leak = a.ranks * 3 // 5, a.ranks // 5
    if not (a.reuse and os.path.isdir(a.root)):
        shutil.rmtree(a.root, ignore_errors=True)
        os.makedirs(a.root)
        gen = generate(a.root, a.ranks, a.events, big, leak, a.results)
        print(f"generated {a.ranks} rank dumps of ~{a.events} events in {gen:.1f} s under {a.root}")
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(a.root) for f in fs)
    nrows = None
    try:
        m0 = _machine_cpu()
        s = build(a.root, a.workers, show_progress=False, engine=a.engine, from_dumps=a.from_dumps)
        m1 = _machine_cpu()
        nrows = sum(r.get("events", 0) for r in s["ranks"])
        tm = s["timing"]
        for ln in verdict_lines(s):
            print(ln)
        errors = [r for r in s["ranks"] if "error" in r]
        print(f"summary over {len(s['ranks'])} dumps, {nrows / 1e6:.1f} M events, {nbytes / 1e9:.2f} GB: "
              f"wall {tm['wall_s']:.1f} s, {nrows / tm['wall_s'] / 1e6:.2f} M events/s; "
              f"engine {tm['engine']}, {tm['workers']} workers on {tm['cpus']} CPUs; "
              f"{tm['from_analysis']} ranks from their results, {tm['from_dump']} from their dumps; "
              f"CPU time {tm['cpu_s']:.1f} s -> {tm['busy_cores'] or 0:.2f} cores busy on average "
              f"({100 * (tm['busy_cores'] or 0) / max(1, tm['cpus']):.0f}% of the CPUs)")
        if tm.get("engine") == "ray":
            print(f"ray: {tm['tasks']} tasks; starting or joining the cluster took {tm['ray_start_s']:.1f} s of the wall time")
        if m0 and m1:
            busy = (m1[0] - m0[0]) / max(1e-9, m1[1] - m0[1]) * tm["cpus"]
            print(f"whole machine during the summary (all processes, /proc/stat): {busy:.2f} of {tm['cpus']} "
                  f"cores busy; load average before/after {m0[2]:.1f}/{m1[2]:.1f}")
        ok = (s["imbalance"]["label"] == f"rank {big}" and s["leaking"] == [f"rank {leak}"] and not errors)
        print(f"findings {'correct' if ok else 'WRONG'}: imbalance rank {big}, leaking rank {leak}")
        return 0 if ok else 1
    finally:
        if not a.keep:
            shutil.rmtree(a.root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
