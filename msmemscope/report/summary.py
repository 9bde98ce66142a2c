"""``msmemscope summary <root> [--json out.json]``: one table across the ranks of a job.

Per rank (one dump each, found by ``io.ranks``): peak allocated (max ``used``)
and peak reserved (max ``total``) per device and pool, leaked blocks, inefficient
bytes and the decomposition by owner category; then the imbalance (the rank
whose peak allocated is furthest from the median) and the ranks that leak.

Where an online analysis already wrote its result (``<run>/analysis/leaks.json``,
``inefficient.json``, ``decompose.json``) that result is used; otherwise the
number is computed from the dump (leaks: the step rule of SPEC 4.1, with the
leaks module's offline function where it exists; decomposition:
``analysis.decompose.summarize``; inefficient memory: only from a saved result
or when the dump has ACCESS rows). Peaks always come from the dump itself.

The dumps are analysed in parallel, one process per dump
(``ProcessPoolExecutor`` sized to the CPUs), each reading only the columns it
needs with a lazy polars scan.

Which ranks leak: a rank whose leaks fall in two or more steps (memory that
keeps growing), or whose leaks are not all shared by every other rank. A block
every rank keeps once, in the same step, by the same op with the same size
(DDP rebuilding its gradient buckets at step 2, a cache filled once) is listed
in the table but does not make a rank a leaking one.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

MB = 1048576.0
IMBALANCE_PCT = 5.0  # a peak this far (in %) from the median is called an imbalance


# ------------------------------------------------------------------ per rank (runs in a worker process)
#: what the summary reads of a dump (the reader's column layer); with ACCESS rows, also what the
#: inefficient analysis reads
COLUMNS = ("id", "event", "event_type", "name", "device", "alloc_id", "size", "used", "total", "owner", "attr",
           "step", "tid", "addr", "py_stack")
EVENTS = ("MALLOC", "FREE", "SYSTEM")


def load_columns(path: str):
    """The columns the summary needs (MALLOC/FREE/SYSTEM rows; with ACCESS and op rows in the dump,
    those too, for the inefficient analysis) and the count of rows per event, in one read."""
    import polars as pl
    from ..analysis import inefficient as I
    from ..io.reader import read_dump
    counts: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = read_dump(path, columns=COLUMNS + I.COLUMNS, events=EVENTS + I.EVENTS, counts=counts)
    for w in caught:  # a dump cut short is read, and said so in one line
        print(f"msmemscope: warning: {w.message}", file=sys.stderr)
    if not (counts.get("ACCESS") and counts.get("OP_LAUNCH")):
        df = df.filter(pl.col("event").is_in(list(EVENTS)))
    return df, counts


def peaks_of(df) -> list[dict]:
    """Per (device, pool): peak allocated (max ``used``) and peak reserved (max ``total``)."""
    import polars as pl
    mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
    if not mem.height:
        return []
    g = (mem.group_by("device", "event_type")
         .agg(peak_allocated=pl.col("used").max(), peak_reserved=pl.col("total").max())
         .sort("device", "event_type"))
    return [{"device": d, "pool": p, "peak_allocated": int(a or 0), "peak_reserved": int(r if r is not None else a or 0)}
            for d, p, a, r in g.iter_rows()]


def _offline_leaks(df) -> tuple[list[dict], str]:
    """The leaks module's offline step rule on the dump's columns."""
    import polars as pl
    from ..analysis import leaks as L
    mem = df.filter(pl.col("event").is_in(list(EVENTS)))
    return [{"device": r.get("device"), "pool": r.get("pool"), "op": r.get("op"), "size": int(r.get("size") or 0),
             "step": r.get("step"), "alloc_id": r.get("alloc_id"), "id": r.get("id")}
            for r in L.step_leaks(mem)], "analysis.leaks.step_leaks"


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _leak_summary(leaks: list[dict], source: str) -> dict:
    steps = sorted({lk.get("step") for lk in leaks if lk.get("step") is not None})
    sig = sorted({(str(lk.get("pool")), str(lk.get("op")), int(lk.get("size") or 0), lk.get("step"))
                  for lk in leaks}, key=str)
    return {"count": len(leaks), "bytes": int(sum(int(lk.get("size") or 0) for lk in leaks)),
            "steps": steps, "signatures": [list(s) for s in sig[:10000]], "source": source,
            "largest": sorted(leaks, key=lambda lk: -int(lk.get("size") or 0))[:3]}


def _inefficient(folder, dump, counts, df):
    res = _read_json(os.path.join(folder, "analysis", "inefficient.json"))
    src = "analysis/inefficient.json"
    if res is None:
        stem = os.path.splitext(os.path.basename(dump))[0]
        res = _read_json(os.path.join(os.path.dirname(dump), f"inefficient_{stem}.json"))
        src = f"inefficient_{stem}.json"
    if res is None and counts.get("ACCESS") and counts.get("OP_LAUNCH"):
        from ..analysis import inefficient as I
        ch = I.chunk_from_frame(df)
        tr = I.Tracker(I.DEFAULT_IDLE_THRESHOLD)
        tr.feed(ch)
        del ch
        sel = I.select(tr.finish())
        res = I.summarize(sel, tr.counts, I.DEFAULT_IDLE_THRESHOLD)
        src = "computed from the dump"
    if not isinstance(res, dict) or res.get("note"):
        return None
    return {"bytes": int(res.get("bytes") or 0), "blocks": int(res.get("blocks") or 0),
            "by_type": res.get("by_type"), "source": src}


def _decomposition(folder, df, device):
    res = _read_json(os.path.join(folder, "analysis", "decompose.json"))
    src = "analysis/decompose.json"
    if not (isinstance(res, dict) and res.get("devices")):
        import polars as pl
        owners = df.filter(pl.col("event") == "MALLOC")["owner"]
        labelled = owners.is_not_null() & ~owners.is_in(["", "null", "N/A"])
        if not labelled.any():
            return None
        from ..analysis.decompose import summarize
        res = summarize(df.with_columns(pl.when(pl.col("owner").is_in(["", "null", "N/A"])).then(None)
                                        .otherwise(pl.col("owner")).alias("owner")))
        src = "computed from the dump"
    devs = res.get("devices") or {}
    d = devs.get(str(device)) or (next(iter(devs.values())) if devs else None)
    if not d:
        return None
    return {"categories": {k: int(v.get("peak", 0)) for k, v in (d.get("categories") or {}).items()},
            "owners": {k: int(v.get("peak", 0)) for k, v in (d.get("owners") or {}).items()},
            "source": src}


def analyse_rank(job: dict) -> dict:
    """Everything the summary says about one rank (a worker process runs this)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = {"label": job["label"], "rank": job["config"].get("rank"), "local_rank": job["config"].get("local_rank"),
           "world_size": job["config"].get("world_size"), "host": job["config"].get("host"),
           "pid": job["config"].get("pid"), "role": job["config"].get("role", "rank"),
           "folder": job["folder"], "dump": job["path"]}
    try:
        df, counts = load_columns(job["path"])
        out["events"] = int(sum(counts.values()))
        out["counts"] = counts
        out["steps"] = int(df.filter((df["event"] == "SYSTEM") & (df["event_type"] == "STEP")).height)
        peaks = peaks_of(df)
        out["peaks"] = peaks
        want = str(job["config"].get("device")) if job["config"].get("device") is not None else None
        devs = {p["device"] for p in peaks}
        if want not in devs:
            want = max(peaks, key=lambda p: p["peak_allocated"])["device"] if peaks else None
        out["device"] = want
        mine = [p for p in peaks if p["device"] == want]
        out["peak_allocated"] = max((p["peak_allocated"] for p in mine), default=0)
        out["peak_reserved"] = max((p["peak_reserved"] for p in mine), default=0)
        saved = _read_json(os.path.join(job["folder"], "analysis", "leaks.json"))
        if isinstance(saved, dict) and isinstance(saved.get("leaks"), list):
            out["leaks"] = _leak_summary(saved["leaks"], "analysis/leaks.json")
        else:
            out["leaks"] = _leak_summary(*_offline_leaks(df))
        out["inefficient"] = _inefficient(job["folder"], job["path"], counts, df)
        out["decompose"] = _decomposition(job["folder"], df, want)
    except Exception as e:  # one bad dump must not hide the others
        from ..io.reader import DumpError
        out["error"] = str(e) if isinstance(e, DumpError) else f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time() - c0
    return out


# ------------------------------------------------------------------ across ranks
def _pool_env(workers: int):
    """Environment of the worker processes: polars threads shared out among them."""
    per = max(1, (os.cpu_count() or 1) // max(1, workers))
    return {"POLARS_MAX_THREADS": str(per)}


def analyse_all(jobs: list[dict], workers: int | None = None, show_progress: bool = True) -> tuple[list[dict], dict]:
    """Run ``analyse_rank`` over the jobs in a process pool (in this process when one job or one worker)."""
    import resource
    from .progress import progress
    cpus = os.cpu_count() or 1
    workers = max(1, min(workers or cpus, len(jobs))) if jobs else 1
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    results = [None] * len(jobs)
    with progress(f"summary of {len(jobs)} dumps", total=len(jobs)) if show_progress else _Null() as bar:
        if workers == 1:
            for i, j in enumerate(jobs):
                results[i] = analyse_rank(j)
                bar.advance()
        else:
            import concurrent.futures as cf
            import multiprocessing as mp
            env = _pool_env(workers)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # spawned workers inherit it (polars reads it at import)
            try:
                with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
                    futs = {ex.submit(analyse_rank, j): i for i, j in enumerate(jobs)}
                    for fut in cf.as_completed(futs):
                        results[futs[fut]] = fut.result()
                        bar.advance()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime)
    if workers == 1:
        cpu = me1.ru_utime - me0.ru_utime + me1.ru_stime - me0.ru_stime
    timing = {"wall_s": round(wall, 3), "workers": workers, "cpus": cpus, "cpu_s": round(cpu, 3),
              "busy_cores": round(cpu / wall, 2) if wall > 0 else None,
              "task_cpu_s": round(sum(r.get("cpu_seconds", 0) for r in results), 3)}
    return results, timing


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def advance(self, n=1):
        pass


def _ranks_only(ranks):
    """Analysed ranks, without DataLoader workers (traced only with MSMEMSCOPE_TRACE_WORKERS=1)."""
    return [r for r in ranks if "error" not in r and r.get("role") != "dataloader_worker"]


def imbalance(ranks: list[dict]) -> dict | None:
    """The rank whose peak allocated is furthest from the median of all ranks."""
    ok = _ranks_only(ranks)
    if len(ok) < 2:
        return None
    med = statistics.median(r["peak_allocated"] for r in ok)
    far = max(ok, key=lambda r: (abs(r["peak_allocated"] - med), r["peak_allocated"]))
    delta = far["peak_allocated"] - med
    pct = (100.0 * delta / med) if med else None
    return {"label": far["label"], "rank": far["rank"], "peak_allocated": far["peak_allocated"],
            "median": med, "delta_bytes": delta, "delta_pct": pct,
            "flagged": bool(delta) and (pct is None or abs(pct) >= IMBALANCE_PCT)}


def leaking(ranks: list[dict]) -> list[str]:
    """Labels of the ranks that leak (see the module docstring for the rule)."""
    ok = _ranks_only(ranks)
    shared = None
    for r in ok:
        s = {tuple(x) for x in r["leaks"]["signatures"]}
        shared = s if shared is None else shared & s
    shared = shared if len(ok) > 1 else set()
    out = []
    for r in ok:
        lk = r["leaks"]
        if not lk["count"]:
            continue
        if len(lk["steps"]) > 1 or any(tuple(x) not in shared for x in lk["signatures"]):
            out.append(r["label"])
    return out


def build(root: str, workers: int | None = None, show_progress: bool = True) -> dict:
    from ..io.ranks import find_rank_dumps
    rds = find_rank_dumps(root)
    jobs = [{"path": r.path, "folder": r.folder, "config": r.config, "label": r.label} for r in rds]
    ranks, timing = analyse_all(jobs, workers, show_progress)
    return {"root": os.path.abspath(root), "ranks": ranks, "imbalance": imbalance(ranks),
            "leaking": leaking(ranks), "timing": timing}


# ------------------------------------------------------------------ output
def _mb(n) -> str:
    return "N/A" if n is None else f"{n / MB:.3f} MB"


def _categories(ranks, top=5) -> list[str]:
    best: dict = {}
    for r in ranks:
        for c, v in ((r.get("decompose") or {}).get("categories") or {}).items():
            best[c] = max(best.get(c, 0), v)
    return [c for c, _ in sorted(best.items(), key=lambda kv: -kv[1])[:top]]


def _num(n) -> str:
    return "N/A" if n is None else f"{n / MB:.3f}"


def tables(s: dict):
    from rich.table import Table
    ranks = s["ranks"]
    cats = _categories(ranks)
    imb = s["imbalance"]
    hosts = len({r.get("host") for r in ranks}) > 1
    t = Table(title=f"msmemscope summary: {len(ranks)} dump(s) under {s['root']} (sizes in MB)",
              title_justify="left")
    cols = [("rank", "left")] + ([("host", "left")] if hosts else []) + [
        ("device", "left"), ("peak alloc", "right"), ("peak reserved", "right"), ("vs median", "right"),
        ("leaked", "right"), ("inefficient", "right")] + [(c, "right") for c in cats]
    for c, j in cols:
        t.add_column(c, justify=j, no_wrap=True)
    blank = [""] * len(cols)
    for r in ranks:
        head = [r["label"]] + ([str(r.get("host") or "")] if hosts else [])
        if "error" in r:
            t.add_row(*head, f"error: {r['error']}", *blank[len(head) + 1:])
            continue
        vs = ""
        if imb and r.get("role") != "dataloader_worker":
            d = r["peak_allocated"] - imb["median"]
            vs = f"{'+' if d >= 0 else '-'}{abs(d) / MB:.3f}" + (
                " !" if r["label"] == imb["label"] and imb["flagged"] else "")
        lk = r["leaks"]
        leak = f"{_num(lk['bytes'])} in {lk['count']}" + (" !" if r["label"] in s["leaking"] else "")
        ineff = r.get("inefficient")
        dec = (r.get("decompose") or {}).get("categories") or {}
        row = head + [f"{r['device']}", _num(r["peak_allocated"]), _num(r["peak_reserved"]), vs, leak,
                      "N/A" if ineff is None else f"{_num(ineff['bytes'])} in {ineff['blocks']}"]
        row += [_num(dec.get(c)) if dec else "N/A" for c in cats]
        t.add_row(*row)
        for p in r["peaks"]:  # the rank's other devices and pools
            if p["device"] == r["device"] and p["peak_allocated"] == r["peak_allocated"]:
                continue
            extra = [""] * len(head) + [f"{p['device']} {p['pool']}", _num(p["peak_allocated"]),
                                        _num(p["peak_reserved"])]
            t.add_row(*extra, *blank[len(extra):])
    return t


def verdict_lines(s: dict) -> list[str]:
    lines = []
    imb = s["imbalance"]
    if imb:
        pct = f"{imb['delta_pct']:+.1f}%" if imb["delta_pct"] is not None else "n/a"
        what = "imbalance" if imb["flagged"] else f"balanced (all within {IMBALANCE_PCT:g}% of the median)"
        lines.append(f"{what}: furthest from the median is {imb['label']}, peak {_mb(imb['peak_allocated'])}, "
                     f"{'+' if imb['delta_bytes'] >= 0 else '-'}{abs(imb['delta_bytes']) / MB:.3f} MB ({pct}) "
                     f"from the median peak {_mb(imb['median'])}")
    by = {r["label"]: r for r in s["ranks"]}
    if s["leaking"]:
        for lab in s["leaking"]:
            lk = by[lab]["leaks"]
            steps = lk["steps"]
            st = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            top = ", ".join(f"{str(x.get('op') or 'N/A').replace('torch._ops.', '')} {_mb(x.get('size'))} "
                            f"(step {x.get('step')})" for x in lk["largest"])
            lines.append(f"leaking: {lab}: {lk['count']} block(s), {_mb(lk['bytes'])} in {st}; largest: {top}")
    else:
        lines.append("leaking: no rank")
    common = [r["label"] for r in s["ranks"] if "error" not in r and r["leaks"]["count"]
              and r["label"] not in s["leaking"]]
    if common:
        lines.append(f"kept once by every rank, in the same step, by the same op (not counted as a leak): "
                     f"{', '.join(common)}")
    bad = [r for r in s["ranks"] if "error" in r]
    for r in bad:
        lines.append(f"error: {r['label']}: {r['error']}")
    tm = s["timing"]
    lines.append(f"analysed {len(s['ranks'])} dump(s) in {tm['wall_s']:.2f} s with {tm['workers']} worker "
                 f"process(es) on {tm['cpus']} CPU(s) (CPU time {tm['cpu_s']:.2f} s)")
    return lines


def print_summary(s: dict, out=None):
    from rich.console import Console
    import shutil
    out = out or sys.stdout
    console = Console(file=out, width=max(120, min(220, shutil.get_terminal_size((160, 40)).columns)),
                      highlight=False)
    console.print(tables(s))
    for ln in verdict_lines(s):
        console.print(ln, markup=False, soft_wrap=True)
    out.flush()


def main(argv) -> int:
    """``msmemscope summary <root> [--json out.json] [--workers N]``"""
    from ..cli import UsageError, _Parser, error_exit
    from ..io.reader import DumpError
    p = _Parser(prog="msmemscope summary", allow_abbrev=False,
                description="One table across the ranks of a distributed run: peaks, leaks, "
                            "inefficient memory, decomposition, imbalance.")
    p.add_argument("root", help="the output root of the job (holding one msmemscope_* folder per rank), "
                                "a run folder or a dump")
    p.add_argument("--json", dest="json_out", help="also write the summary as JSON to this file "
                                                   "(never overwritten: a free name is chosen)")
    p.add_argument("--workers", help="worker processes (default: the number of CPUs)")
    try:
        ns = p.parse_args(argv)
        workers = None
        if ns.workers is not None:
            if not ns.workers.isdigit() or int(ns.workers) < 1:
                raise UsageError(f"--workers: '{ns.workers}' is not a positive whole number")
            workers = int(ns.workers)
    except UsageError as e:
        return error_exit(str(e))
    try:
        s = build(ns.root, workers)
    except DumpError as e:
        return error_exit(str(e))
    if len(s["ranks"]) == 1 and "error" in s["ranks"][0]:
        # one dump that cannot be read: the same one error line as every other command
        return error_exit(str(s["ranks"][0]["error"]))
    print_summary(s)
    if ns.json_out:
        from ..io.files import create_new, unique_path
        path = unique_path(ns.json_out)
        try:
            with create_new(path) as f:
                json.dump(s, f, indent=1, default=str)
        except OSError as e:
            return error_exit(f"--json: cannot write {path}: {e.strerror}")
        print(f"[msmemscope] summary written to {path}", file=sys.stderr)
    return 1 if all("error" in r for r in s["ranks"]) else 0
