"""The tracer's own memory over a long run, and dump bytes per event.

    python bench/tracer_memory.py [--events 1000000] [--format csv|db] [--events-kind alloc,free,launch]
                                  [--analysis inefficient] [--call-stack python:10] [--immediate]

Traces a small MLP training loop in-process until about ``--events`` rows are
written. Measures the process's resident memory (VmRSS) and the Python heap
(tracemalloc) after 50,000 events and at the end: the growth is what the tracer
keeps per event (it should keep nothing: rows go to disk every step). Prints
the dump's bytes per event and the peak resident memory of the dump writer process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss(pid="self", key="VmRSS:") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--format", default="csv", choices=("csv", "db"))
    p.add_argument("--events-kind", default="alloc,free,launch,access")
    p.add_argument("--analysis", default=None, help="--analysis (default: the default, leaks)")
    p.add_argument("--call-stack", default=None, help="e.g. python:10")
    p.add_argument("--immediate", action="store_true",
                   help="collect_mode='immediate': the session starts at config(), before the model, so that "
                        "access events use the native source (a deferred start() gives them to the dispatch-mode source)")
    a = p.parse_args(argv)
    import torch
    from torch import nn
    import msmemscope
    from msmemscope import capture
    torch.manual_seed(0)
    out = tempfile.mkdtemp()
    kw = {k: v for k, v in (("analysis", a.analysis), ("call_stack", a.call_stack),
                            ("collect_mode", "immediate" if a.immediate else None)) if v}
    msmemscope.config(output=out, events=a.events_kind, data_format=a.format, **kw)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    msmemscope.start()
    s = capture.current()
    tracemalloc.start()
    early = None
    steps = 0
    while s.next_id < a.events:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        steps += 1
        if early is None and s.next_id >= 50_000:
            early = (s.next_id, rss(), tracemalloc.get_traced_memory()[0])
    late = (s.next_id, rss(), tracemalloc.get_traced_memory()[0])
    proc = getattr(s.writer, "_proc", None)  # the dump writer process (io/spool.py), if any
    writer_peak = rss(proc.pid, "VmHWM:") if proc is not None else 0
    msmemscope.stop()
    s.close()  # waits for the writer process: the whole dump is on disk
    size = os.path.getsize(s.dump_path)
    res = {"format": a.format, "source": s.config["source"], "events_kind": a.events_kind, **kw,
           "steps": steps, "events": late[0],
           "rss_growth_mb": (late[1] - early[1]) / 2**20, "heap_growth_mb": (late[2] - early[2]) / 2**20,
           "events_between": late[0] - early[0], "dump_bytes_per_event": size / late[0],
           "writer_process_peak_rss_mb": writer_peak / 2**20}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
