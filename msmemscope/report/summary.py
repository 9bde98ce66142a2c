"""``msmemscope summary <root> [--json out.json] [--engine pool|ray] [--from-dumps]``: one table
across the ranks of a job.

Per rank (one dump each, found by ``io.ranks``): peak allocated (max ``used``)
and peak reserved (max ``total``) per device and pool, leaked blocks, inefficient
bytes and the decomposition by owner category; then the imbalance (the rank
whose peak allocated is furthest from the median) and the ranks that leak.

A rank whose online run left its results (``<run>/analysis/peaks.json`` and ``leaks.json``,
written at each step end and at exit; plus ``inefficient.json`` / ``decompose.json`` where the
run recorded ACCESS rows / owner labels) is summarised from those few small files: no dump is
read, so the cost grows with the number of ranks, not of events. Otherwise the rank's dump is
read (leaks: the step rule of SPEC 4.1, with the leaks module's offline function where it
exists; decomposition: ``analysis.decompose.summarize``; inefficient memory: only from a saved
result or when the dump has ACCESS rows). ``--from-dumps`` reads every dump anyway.

Engines: ``pool`` (default) reads the saved results in this process and the dumps in parallel,
one process per dump (``ProcessPoolExecutor`` sized to the CPUs), each reading only the columns
it needs with a lazy polars scan. ``ray`` runs each rank's analysis as a Ray task pinned (hard
``NodeAffinitySchedulingStrategy``) to the node whose host name is the rank's ``config.json``
``host``, so that each node reads only the folders on its own disk; the results are merged here.

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
           "step", "tid", "addr", "py_stack", "origin")
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
        # Attr text is read on SYSTEM rows only (steps, owners, summarised steps): the MALLOC/FREE
        # rows' fields come as columns, and their text would be most of the read
        df = read_dump(path, columns=COLUMNS + I.COLUMNS, events=EVENTS + I.EVENTS, counts=counts,
                       attr_of=("SYSTEM",))
    for w in caught:  # a dump cut short is read, and said so in one line
        print(f"msmemscope: warning: {w.message}", file=sys.stderr)
    if not (counts.get("ACCESS") and counts.get("OP_LAUNCH")):
        df = df.filter(pl.col("event").is_in(list(EVENTS)))
    return df, counts


def peaks_of(df) -> list[dict]:
    """Per (device, pool): peak allocated (max ``used``) and peak reserved (max ``total``); on a
    bounded dump a summarised step's too, from its STEP_SUMMARY row (``io.bounded.peaks``)."""
    import polars as pl
    from ..io.bounded import peaks
    # the columns first: the frame's text columns are not copied by the filter
    mem = (df.select("id", "event", "device", "event_type", "used", "total", "step")
           .filter(pl.col("event").is_in(["MALLOC", "FREE"])))
    return [{"device": p["device"], "pool": p["pool"], "peak_allocated": int(p["peak"] or 0),
             "peak_reserved": int(p["reserved"] if p["reserved"] is not None else p["peak"] or 0)}
            for p in peaks(df, mem)]


def _offline_leaks(df) -> tuple[list[dict], str]:
    """The leaks module's offline step rule on the dump's columns."""
    from ..analysis import leaks as L
    # the ops come from ``name`` (an N/A one stays none: the enclosing op is not looked for)
    return [{"device": r.get("device"), "pool": r.get("pool"), "op": r.get("op"), "size": int(r.get("size") or 0),
             "step": r.get("step"), "alloc_id": r.get("alloc_id"), "id": r.get("id")}
            for r in L.step_leaks(df, enclosing=False)], "analysis.leaks.step_leaks"


def _read_json(path):
    """A JSON object file beside a dump, or None (unreadable, not an object, nested too deep)."""
    from ..io.reader import DumpError
    from ..io.validate import load_json_object
    try:
        return load_json_object(path)
    except DumpError:
        return None


def _leak_summary(leaks: list[dict], source: str) -> dict:
    steps = sorted({lk.get("step") for lk in leaks if lk.get("step") is not None})
    sig = sorted({(str(lk.get("pool")), str(lk.get("op")), int(lk.get("size") or 0), lk.get("step"))
                  for lk in leaks}, key=str)
    return {"count": len(leaks), "bytes": int(sum(int(lk.get("size") or 0) for lk in leaks)),
            "steps": steps, "signatures": [list(s) for s in sig[:10000]], "source": source,
            "largest": sorted(leaks, key=lambda lk: -int(lk.get("size") or 0))[:3]}


def _saved_leaks(res: dict) -> dict:
    """The step rule's blocks from a saved leaks.json: the leaks of growing sites and the blocks
    retained elsewhere (both are what the rule finds on the dump); the lists keep a bounded number
    of blocks per site, so count and bytes come from the per-site totals where the file has them."""
    blocks = list(res.get("leaks") or []) + [x for x in (res.get("retained") or []) if isinstance(x, dict)]
    blocks.sort(key=lambda lk: (lk.get("id") is None, lk.get("id") or 0))
    out = _leak_summary(blocks, "analysis/leaks.json")
    totals = [x for x in (res.get("summary") or []) + (res.get("retained_sites") or []) if isinstance(x, dict)]
    if "retained_sites" in res and totals:
        out["count"] = max(out["count"], int(sum(int(x.get("count") or 0) for x in totals)))
        out["bytes"] = max(out["bytes"], int(sum(int(x.get("bytes") or 0) for x in totals)))
    return out


def _inefficient(folder, dump, counts, df=None):
    res = _read_json(os.path.join(folder, "analysis", "inefficient.json"))
    src = "analysis/inefficient.json"
    if res is None:
        stem = os.path.splitext(os.path.basename(dump))[0]
        res = _read_json(os.path.join(os.path.dirname(dump), f"inefficient_{stem}.json"))
        src = f"inefficient_{stem}.json"
    if res is None and df is not None and counts.get("ACCESS") and counts.get("OP_LAUNCH"):
        from ..analysis import inefficient as I
        # the totals only: no op or stack gathered, no worst blocks named or sorted
        ch = I.chunk_from_frame(df)
        tr = I.Tracker(I.DEFAULT_IDLE_THRESHOLD, texts=False)
        tr.feed_all(ch)
        del ch
        res = I.totals(tr.finish(ordered=False))
        src = "computed from the dump"
    if not isinstance(res, dict) or res.get("note"):
        return None
    return {"bytes": int(res.get("bytes") or 0), "blocks": int(res.get("blocks") or 0),
            "by_type": res.get("by_type"), "source": src}


def _decomposition(folder, df, device):
    res = _read_json(os.path.join(folder, "analysis", "decompose.json"))
    src = "analysis/decompose.json"
    if not (isinstance(res, dict) and res.get("devices")):
        if df is None:  # from the saved results: no owner labels were recorded
            return None
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


def saved_results(folder: str):
    """The rank's online results (``analysis/peaks.json``, ``leaks.json``, and ``inefficient.json``
    / ``decompose.json`` where the run could have produced them), when they hold everything the
    summary says about the rank; else None (the dump is read)."""
    a = os.path.join(folder, "analysis")
    peaks = _read_json(os.path.join(a, "peaks.json"))
    leaks = _read_json(os.path.join(a, "leaks.json"))
    if not (isinstance(peaks, dict) and isinstance(peaks.get("peaks"), list)
            and isinstance(leaks, dict) and isinstance(leaks.get("leaks"), list)):
        return None
    if peaks.get("access_rows") and not os.path.isfile(os.path.join(a, "inefficient.json")):
        return None  # ACCESS rows recorded but not judged online: the dump can tell
    if peaks.get("owner_labels") and not os.path.isfile(os.path.join(a, "decompose.json")):
        return None
    return peaks, leaks


def _main_device(out, peaks, config):
    want = str(config.get("device")) if config.get("device") is not None else None
    devs = {p["device"] for p in peaks}
    if want not in devs:
        want = max(peaks, key=lambda p: p["peak_allocated"])["device"] if peaks else None
    out["device"] = want
    mine = [p for p in peaks if p["device"] == want]
    out["peak_allocated"] = max((p["peak_allocated"] for p in mine), default=0)
    out["peak_reserved"] = max((p["peak_reserved"] for p in mine), default=0)
    return want


def analyse_rank(job: dict) -> dict:
    """Everything the summary says about one rank (a worker process or a Ray task runs this):
    from its online results where they suffice (cost: a few small JSON files), else its dump."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = {"label": job["label"], "rank": job["config"].get("rank"), "local_rank": job["config"].get("local_rank"),
           "world_size": job["config"].get("world_size"), "host": job["config"].get("host"),
           "pid": job["config"].get("pid"), "role": job["config"].get("role", "rank"),
           "folder": job["folder"], "dump": job["path"]}
    try:
        saved = saved_results(job["folder"]) if job.get("use_saved", True) else None
        if saved is None and job.get("saved_only"):
            return None
        if saved is not None:
            peaks_res, leaks_res = saved
            out["source"] = "analysis"
            out["events"] = int(peaks_res.get("events") or 0)
            out["counts"] = None
            out["steps"] = int(peaks_res.get("steps") or 0)
            peaks = [{"device": str(p.get("device")), "pool": p.get("pool"),
                      "peak_allocated": int(p.get("peak_allocated") or 0),
                      "peak_reserved": int(p.get("peak_reserved") or p.get("peak_allocated") or 0)}
                     for p in peaks_res["peaks"]]
            out["peaks"] = peaks
            want = _main_device(out, peaks, job["config"])
            out["leaks"] = _saved_leaks(leaks_res)
            out["inefficient"] = _inefficient(job["folder"], job["path"], {})
            out["decompose"] = _decomposition(job["folder"], None, want)
        else:
            out["source"] = "dump"
            df, counts = load_columns(job["path"])
            out["events"] = int(sum(counts.values()))
            out["counts"] = counts
            out["steps"] = int(df.filter((df["event"] == "SYSTEM") & (df["event_type"] == "STEP")).height)
            peaks = peaks_of(df)
            out["peaks"] = peaks
            want = _main_device(out, peaks, job["config"])
            leaks_res = _read_json(os.path.join(job["folder"], "analysis", "leaks.json")) if job.get(
                "use_saved", True) else None
            if isinstance(leaks_res, dict) and isinstance(leaks_res.get("leaks"), list):
                out["leaks"] = _saved_leaks(leaks_res)
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
        # ranks whose online results suffice: read here (a few small files each; a worker process
        # would cost more to start than they cost to read)
        todo = []
        for i, j in enumerate(jobs):
            r = analyse_rank({**j, "saved_only": True}) if j.get("use_saved", True) else None
            if r is None:
                todo.append(i)
            else:
                results[i] = r
                bar.advance()
        workers = max(1, min(workers, len(todo))) if todo else 0
        jobs_left = [(i, jobs[i]) for i in todo]
        if workers <= 1:
            for i, j in jobs_left:
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
                    futs = {ex.submit(analyse_rank, j): i for i, j in jobs_left}
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
    cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
           + me1.ru_utime - me0.ru_utime + me1.ru_stime - me0.ru_stime)
    timing = {"wall_s": round(wall, 3), "workers": workers, "cpus": cpus, "cpu_s": round(cpu, 3),
              "busy_cores": round(cpu / wall, 2) if wall > 0 else None,
              "task_cpu_s": round(sum(r.get("cpu_seconds", 0) for r in results), 3)}
    return results, timing


RAY_IDLE_S = 600.0  # no Ray task of the summary finished for this long: the rest are reported as errors


def ray_nodes() -> dict:
    """host name -> node id of the live nodes of the connected Ray cluster."""
    return {h: n for h, (n, _) in _ray_node_cpus().items()}


def _ray_node_cpus() -> dict:
    import ray
    out = {}
    for n in ray.nodes():
        if n.get("Alive") or n.get("alive"):
            out.setdefault(n.get("NodeManagerHostname"),
                           (n.get("NodeID"), int((n.get("Resources") or {}).get("CPU", 1) or 1)))
    return out


RAY_TASKS_PER_CPU = 4   # ranks of a node are grouped into about this many tasks per CPU of the node
RAY_MAX_RANKS_PER_TASK = 64


def _ray_task(jobs):
    """The analyses of some ranks held by one node, as one Ray task: their results and the node."""
    import ray
    return [analyse_rank(j) for j in jobs], ray.get_runtime_context().get_node_id()


def _chunks(idx: list, cpus: int) -> list:
    """Ranks of one node in groups: a Ray task costs milliseconds, a rank with saved results less."""
    if not idx:
        return []
    per = max(1, min(RAY_MAX_RANKS_PER_TASK, -(-len(idx) // max(1, RAY_TASKS_PER_CPU * cpus))))
    return [idx[i:i + per] for i in range(0, len(idx), per)]


def analyse_on_ray(jobs: list[dict], address: str | None = None, show_progress: bool = True):
    """Run ``analyse_rank`` as one Ray task per rank on the node whose ``config.json`` host
    holds that rank's folder (a hard node affinity); results come back to this process, which
    merges them. Connects to ``address`` (or ``RAY_ADDRESS``, or the cluster this process already
    joined); with none, starts a local Ray instance for the run and stops it after."""
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        raise SummaryError("--engine=ray needs Ray: pip install 'msmemscope[ray]'") from None
    from .progress import progress
    t0 = time.perf_counter()
    started = False
    if not ray.is_initialized():
        addr = address or os.environ.get("RAY_ADDRESS") or None
        # a local instance: Ray gives its raylet 30 s to come up, which a loaded machine may miss once
        for attempt in (1, 2) if addr is None else (2,):
            try:
                ray.init(address=addr, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                         configure_logging=False)
                break
            except Exception as e:
                ray.shutdown()
                if attempt == 2:
                    raise SummaryError(f"--engine=ray: cannot start or join a Ray cluster"
                                       f"{f' at {addr}' if addr else ''}: "
                                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        started = True
    ray_start = time.perf_counter() - t0
    try:
        node_cpus = _ray_node_cpus()
        nodes = {h: n for h, (n, _) in node_cpus.items()}
        cpus_of = {n: c for n, c in node_cpus.values()}
        here = ray.get_runtime_context().get_node_id()
        task = ray.remote(num_cpus=1, max_retries=0)(_ray_task)
        results: list = [None] * len(jobs)
        by_node: dict = {}
        for i, j in enumerate(jobs):
            host = j["config"].get("host")
            node = nodes.get(host)
            if node is None and len(nodes) == 1:
                node = next(iter(nodes.values()))  # one node: it holds every folder it can read
            if node is None:
                results[i] = _failed(j, f"no live node of the Ray cluster has host {host!r} "
                                        f"(nodes: {', '.join(sorted(str(h) for h in nodes))})")
                continue
            by_node.setdefault(node, []).append(i)
        refs = {}
        placed: dict = {}  # node id -> ranks analysed there
        for node, idx in by_node.items():
            strat = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            for chunk in _chunks(idx, cpus_of.get(node, 1)):
                refs[task.options(scheduling_strategy=strat).remote([jobs[i] for i in chunk])] = chunk
        with progress(f"summary of {len(jobs)} dumps on Ray", total=len(jobs)) if show_progress else _Null() as bar:
            bar.advance(len(jobs) - sum(len(c) for c in refs.values()))
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=RAY_IDLE_S, fetch_local=True)
                if not done:
                    for ref in pending:
                        ray.cancel(ref, force=True)
                        for i in refs[ref]:
                            results[i] = _failed(jobs[i], f"its Ray task did not finish in {RAY_IDLE_S:g} s")
                    break
                for ref in done:
                    try:
                        res, node = ray.get(ref)
                    except Exception as e:  # the task's worker died (out of memory, node lost)
                        for i in refs[ref]:
                            results[i] = _failed(jobs[i], f"its Ray task failed: "
                                                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
                        continue
                    for i, r in zip(refs[ref], res):
                        results[i] = r
                    placed[node] = placed.get(node, 0) + len(res)
                    bar.advance(len(res))
        cpus = int(ray.cluster_resources().get("CPU", 0))
        used_nodes = sorted({r.get("host") for r in results if r and "error" not in r}, key=str)
    finally:
        if started:
            ray.shutdown()
    wall = time.perf_counter() - t0
    task_cpu = sum(r.get("cpu_seconds", 0) for r in results)
    timing = {"engine": "ray", "wall_s": round(wall, 3), "workers": cpus, "cpus": cpus, "nodes": len(nodes),
              "hosts": used_nodes, "local_node": here, "ranks_per_node": placed, "tasks": len(refs), "cpu_s": round(task_cpu, 3),
              "busy_cores": round(task_cpu / wall, 2) if wall > 0 else None, "task_cpu_s": round(task_cpu, 3),
              "started_ray": started, "ray_start_s": round(ray_start, 3)}
    return results, timing


class SummaryError(Exception):
    pass


def _failed(job, why) -> dict:
    return {"label": job["label"], "rank": job["config"].get("rank"), "host": job["config"].get("host"),
            "role": job["config"].get("role", "rank"), "folder": job["folder"], "dump": job["path"], "error": why}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def advance(self, n=1):
        pass


NOT_A_RANK = "not_a_rank"  # the role given to io.ranks.RankDump.not_a_rank's folders
_NOT_COMPARED = ("dataloader_worker", NOT_A_RANK)


def _ranks_only(ranks):
    """Analysed ranks, without DataLoader workers (traced only with MSMEMSCOPE_TRACE_WORKERS=1) and
    the processes beside the ranks that are none of them (the parent of mp.spawn)."""
    return [r for r in ranks if "error" not in r and r.get("role") not in _NOT_COMPARED]


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


def build(root: str, workers: int | None = None, show_progress: bool = True, engine: str = "pool",
          from_dumps: bool = False, ray_address: str | None = None) -> dict:
    """The summary of the job under ``root``. ``engine``: ``pool`` (processes on this machine) or
    ``ray`` (one Ray task per rank on the node that holds it); ``from_dumps``: re-read every dump
    even where the run's online results would do."""
    from ..io.ranks import find_rank_dumps
    rds = find_rank_dumps(root)
    # a process beside the ranks that is none of them (the parent of mp.spawn): listed, not compared
    jobs = [{"path": r.path, "folder": r.folder, "label": r.label, "use_saved": not from_dumps,
             "config": dict(r.config, role=NOT_A_RANK) if r.not_a_rank else r.config} for r in rds]
    if engine == "ray":
        ranks, timing = analyse_on_ray(jobs, ray_address, show_progress)
    else:
        ranks, timing = analyse_all(jobs, workers, show_progress)
    timing.setdefault("engine", "pool")
    timing["from_analysis"] = sum(1 for r in ranks if r.get("source") == "analysis")
    timing["from_dump"] = sum(1 for r in ranks if r.get("source") == "dump")
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
        if imb and r.get("role") not in _NOT_COMPARED:
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
    common = [r["label"] for r in _ranks_only(s["ranks"]) if r["leaks"]["count"] and r["label"] not in s["leaking"]]
    if common:
        lines.append(f"kept once by every rank, in the same step, by the same op (not counted as a leak): "
                     f"{', '.join(common)}")
    bad = [r for r in s["ranks"] if "error" in r]
    for r in bad:
        lines.append(f"error: {r['label']}: {r['error']}")
    tm = s["timing"]
    how = (f"as Ray tasks on {tm.get('nodes')} node(s), {tm['cpus']} CPU(s)" if tm.get("engine") == "ray"
           else f"with {tm['workers']} worker process(es) on {tm['cpus']} CPU(s)")
    src = ""
    if tm.get("from_analysis") is not None:
        src = f"; {tm['from_analysis']} from the run's online results, {tm['from_dump']} from the dump"
    lines.append(f"analysed {len(s['ranks'])} dump(s) in {tm['wall_s']:.2f} s {how} "
                 f"(CPU time {tm['cpu_s']:.2f} s{src})")
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
    """``msmemscope summary <root> [--json out.json] [--workers N] [--engine pool|ray] [--from-dumps]``"""
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
    p.add_argument("--engine", default="pool", help="pool (default: processes on this machine) or ray "
                   "(one Ray task per rank, on the node that holds its folder; pip install 'msmemscope[ray]')")
    p.add_argument("--ray-address", help="with --engine=ray: the cluster to join (default: RAY_ADDRESS, "
                                         "else a local Ray instance started for the summary)")
    p.add_argument("--from-dumps", action="store_true",
                   help="re-read every dump (peaks, steps, leaks from the events) even where the run's "
                        "online results (analysis/*.json) would do")
    try:
        ns = p.parse_args(argv)
        if ns.engine not in ("pool", "ray"):
            raise UsageError(f"--engine: '{ns.engine}' is not one of pool, ray")
        if ns.ray_address and ns.engine != "ray":
            raise UsageError("--ray-address needs --engine=ray")
        workers = None
        if ns.workers is not None:
            if not ns.workers.isdigit() or int(ns.workers) < 1:
                raise UsageError(f"--workers: '{ns.workers}' is not a positive whole number")
            workers = int(ns.workers)
    except UsageError as e:
        return error_exit(str(e))
    try:
        s = build(ns.root, workers, engine=ns.engine, from_dumps=ns.from_dumps, ray_address=ns.ray_address)
    except (DumpError, SummaryError) as e:
        return error_exit(str(e))
    if len(s["ranks"]) == 1 and "error" in s["ranks"][0]:
        # one dump that cannot be read: the same one error line as every other command
        return error_exit(str(s["ranks"][0]["error"]))
    print_summary(s)
    if ns.json_out:
        from ..io.files import unique_path, write_new
        path = unique_path(ns.json_out)
        try:
            with write_new(path) as f:
                json.dump(s, f, indent=1, default=str)
        except OSError as e:
            return error_exit(f"--json: cannot write {path}: {e.strerror}")
        print(f"[msmemscope] summary written to {path}", file=sys.stderr)
    return 1 if all("error" in r for r in s["ranks"]) else 0
