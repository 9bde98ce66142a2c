"""The prepared GPU check of the CUDA allocator-trace source (issue 20): correctness, traces, timing.

One H200 with torch 2.11 + CUDA 13, no network; under 8 minutes (``--quick``: about 3).
polars is not in that machine's image: it travels as wheels. Once, here, in the repository root
(``/.whl/`` is in .gitignore):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl polars==2.1.0 polars-runtime-32==2.1.0

then the device tool's ``run`` with ``carry: [".whl"]``, ``timeout_s: 560`` and the command

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && python3 bench/gpu_check.py --out $OUT

(rich, numpy, ninja and pytest are in the image). What comes back under $OUT: ``gpu_check.json`` (every
check and figure), ``gpu_check.log`` and ``cuda_traces/*.json``: the allocator traces to commit under
``tests/data/cuda_traces/`` (tests/test_cuda_conversion.py converts them and checks the result against
the allocator's own counters). Copy the printed table into BENCHMARKS.md with the date.

Checks (exit status 1 when one fails):
- a GPT-style training loop with dynamic sequence lengths and a side stream (``record_stream``, so
  frees are deferred) traced by ``python -m msmemscope``: at every step end the traced allocated bytes
  == ``torch.cuda.memory_allocated()``, the traced reserved bytes == ``memory_reserved()``, the traced
  step peak == ``max_memory_allocated()`` (reset at every step start); losses bit-identical to an
  untraced run; the dump's invariants (tests/conftest.py); nothing lost from the ring buffer; no block
  size inferred differently from the allocator's snapshot; fragmentation.json written;
- an inference loop with dynamic batch and sequence lengths, the same checks per request;
- timing: plain / ours / ``_record_memory_history(max_entries=100000)`` / ``torch.profiler(profile_memory
  =True)`` on a GPU-bound GPT and a launch-bound small MLP (median of the timed steps, ratio to plain).

``--dry-run`` runs the children on the CPU (no hardware check): it shows the script itself works.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOG: list = []


def say(*a):
    line = " ".join(str(x) for x in a)
    LOG.append(line)
    print(line, flush=True)


# ---------------------------------------------------------------------------- children
def _gpt(device, layers=4, d=256, heads=4):
    sys.path.insert(0, ROOT)
    from examples.transformer import GPT
    import torch
    torch.manual_seed(0)
    return GPT(vocab=1024, d=d, heads=heads, layers=layers, ctx=256).to(device)


def _step_check(device, fails, label):
    """At a step end in a traced run: the source's figures against the allocator's counters."""
    import torch
    from msmemscope.capture import current
    s = current()
    src = getattr(s, "device_source", None) if s is not None else None
    if src is None or device == "cpu":
        return
    torch.cuda.synchronize()
    a = src.last_step_end.get(torch.cuda.current_device())
    got = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
           "peak": torch.cuda.max_memory_allocated()}
    if a is None:
        fails.append(f"{label}: no Step End snapshot")
    else:
        for ours, theirs in (("traced_allocated", "allocated"), ("traced_reserved", "reserved"),
                             ("max_allocated", "peak")):
            if a[ours] != got[theirs]:
                fails.append(f"{label}: {ours} {a[ours]} != torch {theirs} {got[theirs]}")
    torch.cuda.reset_peak_memory_stats()


def child_train(args):
    import torch
    import torch.nn.functional as F
    dev = args.device
    model = _gpt(dev, layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    side = torch.cuda.Stream() if dev != "cpu" else None
    fails: list = []
    for step in range(args.steps):
        t = int(torch.randint(32, 200, (1,), generator=g))
        data = torch.randint(0, 1024, (8, t + 1), generator=g).to(dev)
        x, y = data[:, :-1], data[:, 1:]
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if side is not None:  # a block used on another stream: its free waits for that stream
            scratch = torch.empty(1 << 20, device=dev)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                scratch.mul_(0.0)
            scratch.record_stream(side)
            del scratch
        opt.step()
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        _step_check(dev, fails, f"train step {step + 1}")
    for f in fails:
        print("CHECK FAIL", f, flush=True)
    return 1 if fails else 0


def child_infer(args):
    import torch
    import msmemscope
    from msmemscope.capture import current
    dev = args.device
    model = _gpt(dev, layers=args.layers).eval()
    g = torch.Generator().manual_seed(2)
    fails: list = []
    with torch.no_grad():
        for req in range(args.steps):
            b = int(torch.randint(1, 16, (1,), generator=g))
            t = int(torch.randint(8, 250, (1,), generator=g))
            idx = torch.randint(0, 1024, (b, t), generator=g).to(dev)
            for _ in range(4):  # a few decoding steps: the sequence grows
                logits = model(idx[:, -250:])
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                idx = torch.cat([idx, nxt], dim=1)
            print(f"request {req} tokens {idx[:, -4:].sum().item()}", flush=True)
            if current() is not None:
                msmemscope.step()
                _step_check(dev, fails, f"infer request {req + 1}")
    for f in fails:
        print("CHECK FAIL", f, flush=True)
    return 1 if fails else 0


def child_record(args):
    """The allocator's own trace of a few training steps (and an OOM), saved for the CPU tests."""
    import torch
    if args.device == "cpu":
        print("record: no CUDA, nothing recorded")
        return 0
    mem = torch.cuda.memory
    torch.cuda.init()
    mem._record_memory_history("all", context=None, stacks="python", max_entries=1 << 20, clear_history=True)
    before = mem._snapshot()["segments"]
    args.steps = 3
    rc = child_train(args)
    if args.oom:
        try:
            torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            print("record: OOM raised as planned")
    torch.cuda.synchronize()
    snap = mem._snapshot()
    rec = {"name": args.name, "torch": torch.__version__, "allocator_settings": snap.get("allocator_settings", {}),
           "segments_before": before, "entries": snap["device_traces"][torch.cuda.current_device()],
           "segments_after": snap["segments"], "memory_allocated": torch.cuda.memory_allocated(),
           "memory_reserved": torch.cuda.memory_reserved()}
    for e in rec["entries"]:
        e.pop("frames", None)
    for s in rec["segments_before"] + rec["segments_after"]:
        for b in s.get("blocks", ()):
            b.pop("frames", None)
    mem._record_memory_history(None)
    os.makedirs(os.path.dirname(args.save), exist_ok=True)
    with open(args.save, "w") as f:
        json.dump(rec, f, default=str)
    print(f"record: {len(rec['entries'])} entries -> {args.save}")
    return rc


def child_time(args):
    import torch
    dev = args.device
    if args.workload == "gpu":
        model = _gpt(dev, layers=8, d=1024, heads=16)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        data = torch.randint(0, 1024, (16, 257), device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            logits = model(data[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 1024), data[:, 1:].reshape(-1)).backward()
            opt.step()
    else:
        torch.manual_seed(0)
        layers = []
        for _ in range(12):
            layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(8, 64, device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    if args.mode == "history":
        torch.cuda.memory._record_memory_history(max_entries=100000)
    prof = None
    if args.mode == "profiler":
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev != "cpu" else [])
        prof = torch.profiler.profile(activities=acts, profile_memory=True)
    for _ in range(args.warmup):
        step()
    sync()
    if prof is not None:
        prof.__enter__()
    times = []
    t_all = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.__exit__(None, None, None)
    total = time.perf_counter() - t_all
    print("TIME " + json.dumps({"median_step_s": statistics.median(times), "total_s": total}), flush=True)
    return 0


# ---------------------------------------------------------------------------- the parent
def run(cmd, env=None, timeout=300):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, e.get("PYTHONPATH")) if p)
    e.update(env or {})
    r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout, cwd=ROOT)
    return r


def me(*a):
    return [sys.executable, os.path.abspath(__file__), *a]


def traced(out, *a, analysis="leaks,oom"):
    return [sys.executable, "-m", "msmemscope", "-o", out, f"--analysis={analysis}", os.path.abspath(__file__), *a]


def lines(text, prefix):
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def check_dump(folder, results, label):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import check_invariants
    from msmemscope.io.reader import find_dumps, read_dump
    import polars as pl
    cfg = json.load(open(os.path.join(folder, "config.json")))
    results[f"{label}.device_source"] = cfg.get("device_source")
    results[f"{label}.allocator_trace"] = cfg.get("allocator_trace")
    fails = []
    if cfg.get("device_source") != "allocator_trace" and results["cuda"]:
        fails.append(f"device_source is {cfg.get('device_source')}: {cfg.get('device_source_note')}")
    at = cfg.get("allocator_trace") or {}
    for k in ("lost", "size_mismatches", "resyncs"):
        if at.get(k):
            fails.append(f"allocator_trace.{k} = {at[k]}")
    dumps = find_dumps(folder)
    if len(dumps) != 1:
        fails.append(f"{len(dumps)} dumps in {folder}")
    df = read_dump(dumps[0])
    try:
        check_invariants(df)
    except AssertionError as e:
        fails.append(f"dump invariants: {e}")
    snaps = df.filter((pl.col("event") == "SNAPSHOT") & (pl.col("name") == "Step End"))
    results[f"{label}.step_end_snapshots"] = snaps.height
    results[f"{label}.rows"] = df.height
    results[f"{label}.pta_mallocs"] = df.filter((pl.col("event") == "MALLOC") & (pl.col("event_type") == "PTA")
                                                & (pl.col("device") != "cpu")).height
    dev_pta = df.filter((pl.col("event") == "MALLOC") & (pl.col("event_type") == "PTA") & (pl.col("device") != "cpu"))
    if dev_pta.height:  # attribution by time stamp: how many device blocks found no op around them
        results[f"{label}.pta_unattributed_fraction"] = round(dev_pta.filter(pl.col("name") == "N/A").height
                                                              / dev_pta.height, 4)
    results[f"{label}.hal_segments"] = df.filter((pl.col("event") == "MALLOC") & (pl.col("event_type") == "HAL")).height
    frag = glob.glob(os.path.join(folder, "analysis", "fragmentation*.json"))
    if results["cuda"] and not frag:
        fails.append("no analysis/fragmentation.json")
    elif frag:
        steps = json.load(open(frag[0]))["steps"]
        results[f"{label}.fragmentation_last"] = {k: v for k, v in steps[-1].items() if k != "pinned"} if steps else None
    return fails


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=["train", "infer", "record", "time"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workload", default="gpu")
    p.add_argument("--mode", default="plain")
    p.add_argument("--save")
    p.add_argument("--name", default="train")
    p.add_argument("--oom", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--quick", action="store_true", help="fewer steps (about 3 minutes)")
    p.add_argument("--dry-run", action="store_true", help="no CUDA needed: run the children on the CPU")
    a = p.parse_args(argv)
    if a.child:
        return {"train": child_train, "infer": child_infer, "record": child_record, "time": child_time}[a.child](a)

    import torch
    cuda = torch.cuda.is_available()
    if not cuda and not a.dry_run:
        print(f"gpu_check: error: no CUDA device (torch {torch.__version__}); --dry-run runs the script's "
              "CPU-safe parts", file=sys.stderr)
        return 2
    dev = "cuda" if cuda else "cpu"
    steps = 2 if a.dry_run else (12 if a.quick else 30)
    tsteps = 2 if a.dry_run else (10 if a.quick else 30)
    os.makedirs(a.out, exist_ok=True)
    import tempfile
    work = tempfile.mkdtemp(prefix="gpu_check_runs_")  # dumps stay out of $OUT (8 files come back at most)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__, "cuda": cuda,
                     "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"}
    fails: list = []
    t_start = time.time()
    say(f"gpu_check: {results['device']}, torch {torch.__version__}{' (DRY RUN: no hardware checks)' if not cuda else ''}")

    # 1. training: plain vs traced, per-step counters, dump invariants
    for name, child in (("train", "train"), ("infer", "infer")):
        args = ["--child", child, "--device", dev, "--steps", str(steps)] + (["--layers", "1"] if a.dry_run else [])
        plain = run(me(*args))
        tr = run(traced(os.path.join(work, name), *args))
        key = "step " if child == "train" else "request "
        same = plain.returncode == 0 and lines(plain.stdout, key) == lines(tr.stdout, key) and lines(plain.stdout, key)
        results[f"{name}.outputs_identical"] = bool(same)
        if not same:
            fails.append(f"{name}: traced output differs from the plain run (rc {plain.returncode}/{tr.returncode})\n"
                         + plain.stderr[-1500:] + tr.stderr[-1500:])
        checks = lines(tr.stdout, "CHECK FAIL")
        results[f"{name}.step_checks_failed"] = len(checks)
        fails += [f"{name}: {c}" for c in checks]
        if tr.returncode != 0 and not checks:
            fails.append(f"{name}: traced run exited {tr.returncode}: {tr.stderr[-2000:]}")
        folders = sorted(glob.glob(os.path.join(work, name, "msmemscope_*")))
        if folders:
            try:
                fails += [f"{name}: {f}" for f in check_dump(folders[-1], results, name)]
            except Exception as e:  # a broken dump is a failed check, and the other checks still run
                fails.append(f"{name}: the dump could not be checked: {type(e).__name__}: {e}")
        else:
            fails.append(f"{name}: no run folder")
        say(f"  {name}: outputs identical {bool(same)}, step checks failed {len(checks)}, "
            f"rows {results.get(name + '.rows')}, allocator blocks {results.get(name + '.pta_mallocs')}, "
            f"segments {results.get(name + '.hal_segments')}  [{time.time() - t_start:.0f} s]")

    # 2. recorded traces for the CPU tests
    traces = os.path.join(a.out, "cuda_traces")
    for name, env, extra in (("train_default", {}, ["--oom"]),
                             ("train_expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, [])):
        r = run(me("--child", "record", "--device", dev, "--name", name, "--save",
                   os.path.join(traces, name + ".json"), *extra), env=env)
        say("  " + (r.stdout.strip().splitlines() or ["record: (no output)"])[-1])
        if r.returncode != 0:
            fails.append(f"record {name}: rc {r.returncode}: {r.stderr[-1500:]}")
    from msmemscope.capture.cuda_allocator import AllocatorConverter
    for path in sorted(glob.glob(os.path.join(traces, "*.json"))):
        try:
            rec = json.load(open(path))
        except ValueError as e:
            fails.append(f"{path}: {e}")
            continue
        c = AllocatorConverter("0", expandable=bool(rec["allocator_settings"].get("expandable_segments")),
                               oom_k=5)
        rows: list = []
        c.resync(rec["segments_before"], 1, rows, "before_trace")
        c.convert(rec["entries"], rows)
        ok = (c.used - c.deferred_pending == rec["memory_allocated"] and c.reserved == rec["memory_reserved"]
              and c.check(rec["segments_after"]) == 0)
        results[f"trace.{os.path.basename(path)}"] = {"entries": len(rec["entries"]), "ok": ok, **c.counts}
        if not ok:
            fails.append(f"{path}: converted {c.used - c.deferred_pending}/{c.reserved} vs allocator "
                         f"{rec['memory_allocated']}/{rec['memory_reserved']}, counts {c.counts}")

    # 3. timing
    table = []
    for wl in (("launch",) if a.dry_run else ("gpu", "launch")):
        base = None
        for mode in (("plain", "ours") if a.dry_run else ("plain", "ours", "history", "profiler")):
            args = ["--child", "time", "--device", dev, "--workload", wl, "--mode", mode, "--steps", str(tsteps),
                    "--warmup", "2" if a.dry_run else "5"]
            cmd = traced(os.path.join(work, f"time_{wl}"), *args, analysis="leaks") if mode == "ours" else me(*args)
            if mode == "ours":
                cmd[cmd.index("--mode") + 1] = "plain"
            r = run(cmd, timeout=400)
            tl = lines(r.stdout, "TIME ")
            if r.returncode != 0 or not tl:
                fails.append(f"time {wl}/{mode}: rc {r.returncode}: {r.stderr[-1500:]}")
                continue
            m = json.loads(tl[-1][5:])["median_step_s"]
            base = base or m
            table.append((wl, mode, m, m / base))
            say(f"  time {wl:6s} {mode:8s} {m * 1e3:9.3f} ms/step  {m / base:5.2f}x  [{time.time() - t_start:.0f} s]")
    results["timing"] = [{"workload": w, "mode": mo, "median_step_ms": round(m * 1e3, 4), "ratio": round(x, 3)}
                         for w, mo, m, x in table]
    results["failures"] = fails
    results["seconds"] = round(time.time() - t_start, 1)
    say("")
    say("| workload | plain | msmemscope | _record_memory_history | profiler(profile_memory) |")
    say("|---|---|---|---|---|")
    for wl in ("gpu", "launch"):
        cells = {mo: f"{m * 1e3:.2f} ms ({x:.2f}x)" for w, mo, m, x in table if w == wl}
        say(f"| {wl} | " + " | ".join(cells.get(mo, "-") for mo in ("plain", "ours", "history", "profiler")) + " |")
    for f in fails:
        say("FAIL:", f)
    say(f"gpu_check: {'PASS' if not fails else 'FAIL'} in {results['seconds']} s"
        + ("" if cuda else " (dry run on the CPU: the hardware checks did not run)"))
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(a.out, "gpu_check.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
