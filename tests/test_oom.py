"""OOM forensics (SPEC §4.7): OOM_DETAIL rows when an allocation fails, the program's exception unchanged."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import check_invariants, dump_of, env_for_tests, read, run_cli, run_folders

REQUEST = 4 * (1 << 50)   # torch.empty(1 << 50) of float32

OOM_SCRIPT = """
import torch
big = [torch.ones(2 << 20), torch.ones(1 << 20), torch.ones(3 << 20)]   # 8, 4 and 12 MiB
small = [torch.ones(10) for _ in range(5)]
try:
    torch.empty(1 << 50)
except Exception as e:
    print("caught", type(e).__module__, type(e).__qualname__, str(e))
print("alive", len(big) + len(small))
"""

UNCAUGHT = """
import torch
keep = torch.ones(1 << 20)
torch.empty(1 << 50)
"""

NOT_OOM = """
import torch
a, b = torch.ones(3, 4), torch.ones(5, 6)
try:
    torch.mm(a, b)
except RuntimeError as e:
    print("caught", str(e))
"""


def _script(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _plain(script):
    return subprocess.run([sys.executable, script], capture_output=True, text=True, env=env_for_tests(), timeout=300)


def _oom_rows(folder):
    df = read(dump_of(folder))
    check_invariants(df)
    return df, df.filter(df["event"] == "OOM_DETAIL")


def test_cpu_oom_rows_and_exception_unchanged(tmp_path):
    script = _script(tmp_path, "oom.py", OOM_SCRIPT)
    out = tmp_path / "out"
    r = run_cli(["-o", str(out), "--analysis=oom:3", "--call-stack=python:10", script])
    assert r.returncode == 0, r.stderr
    plain = _plain(script)
    assert plain.returncode == 0
    assert r.stdout == plain.stdout           # same exception type and message as without the tool
    assert "caught builtins RuntimeError" in r.stdout and "alive 8" in r.stdout
    folder, = run_folders(out)
    df, oom = _oom_rows(folder)
    kinds = oom["event_type"].to_list()
    assert kinds.count("OOM_TRIGGER") == 1
    assert 1 <= kinds.count("OOM_RECENT_ALLOC") <= 3 and 1 <= kinds.count("OOM_TOP_ALLOC") <= 3
    trig = oom.filter(oom["event_type"] == "OOM_TRIGGER")
    assert trig["name"][0] == "torch._ops.aten.empty.memory_format"
    assert trig["size"][0] == REQUEST
    assert trig["device"][0] == "cpu"
    assert "oom.py:6(" in trig["py_stack"][0]
    tattr = json.loads(trig["attr"][0])
    assert tattr["exception"] == "RuntimeError" and "can't allocate memory" in tattr["message"]
    assert tattr["live_blocks"] == 8
    # the planted large tensors first, largest first
    mallocs = df.filter(df["event"] == "MALLOC").sort("id")
    big = mallocs.head(3)
    top = oom.filter(oom["event_type"] == "OOM_TOP_ALLOC")
    assert top["size"].to_list() == [12 << 20, 8 << 20, 4 << 20]
    assert top["alloc_id"].to_list() == [big["alloc_id"][2], big["alloc_id"][0], big["alloc_id"][1]]
    assert top["addr"].to_list() == [big["addr"][2], big["addr"][0], big["addr"][1]]
    assert set(top["name"].to_list()) == {"torch._ops.aten.ones.default"}
    assert all("oom.py:3(" in s for s in top["py_stack"].to_list())
    # most recent: the last three small tensors, newest first
    recent = oom.filter(oom["event_type"] == "OOM_RECENT_ALLOC")
    assert recent["alloc_id"].to_list() == mallocs["alloc_id"].to_list()[-1:-4:-1]
    assert recent["size"].to_list() == [40, 40, 40]
    # printed, and summarized in analysis/oom.json
    assert "====== ERROR: Out of memory on device cpu: aten.empty.memory_format failed to allocate" in r.stderr
    assert "The 3 largest live block(s):" in r.stderr and "  #1 12.000000 Mb(s)" in r.stderr
    with open(os.path.join(folder, "analysis", "oom.json")) as f:
        res = json.load(f)
    assert res["k"] == 3 and len(res["events"]) == 1
    assert [a["size"] for a in res["events"][0]["top"]] == [12 << 20, 8 << 20, 4 << 20]


def test_uncaught_oom_propagates(tmp_path):
    script = _script(tmp_path, "uncaught.py", UNCAUGHT)
    out = tmp_path / "out"
    r = run_cli(["-o", str(out), "--analysis=oom", script])
    plain = _plain(script)
    assert r.returncode == plain.returncode == 1
    last = plain.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ") and "can't allocate memory" in last
    assert last in r.stderr.splitlines()
    folder, = run_folders(out)
    _, oom = _oom_rows(folder)
    assert oom["event_type"].to_list() == ["OOM_TRIGGER", "OOM_RECENT_ALLOC", "OOM_TOP_ALLOC"]
    assert oom["size"].to_list() == [REQUEST, 4 << 20, 4 << 20]


def test_other_errors_are_not_oom(tmp_path):
    script = _script(tmp_path, "notoom.py", NOT_OOM)
    out = tmp_path / "out"
    r = run_cli(["-o", str(out), "--analysis=oom:5", script])
    assert r.returncode == 0 and "caught" in r.stdout
    folder, = run_folders(out)
    _, oom = _oom_rows(folder)
    assert oom.height == 0
    assert "Out of memory" not in r.stderr


def test_message_parsing():
    from msmemscope.analysis.oom import is_allocation_failure, requested_bytes
    assert requested_bytes("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4503599627370496 "
                           "bytes. Error code 12") == 4503599627370496
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity") == 2 << 30
    assert requested_bytes("NPU out of memory. Tried to allocate 512.00 MiB (NPU 0; 60.00 GiB total)") == 512 << 20
    assert requested_bytes("something else") is None
    assert is_allocation_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_allocation_failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_allocation_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_allocation_failure(ValueError("out of memory"))


CUDA_SCRIPT = """
import torch
keep = [torch.ones(64 << 20, device="cuda"), torch.ones(16 << 20, device="cuda")]
free, total = torch.cuda.mem_get_info()
try:
    torch.empty(total * 4, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:
    print("caught", type(e).__qualname__)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_oom_observer(tmp_path):
    script = _script(tmp_path, "cuda_oom.py", CUDA_SCRIPT)
    out = tmp_path / "out"
    r = run_cli(["-o", str(out), "--analysis=oom:2", script])
    assert r.returncode == 0, r.stderr
    assert "caught OutOfMemoryError" in r.stdout
    folder, = run_folders(out)
    _, oom = _oom_rows(folder)
    trig = oom.filter(oom["event_type"] == "OOM_TRIGGER")
    assert trig.height == 1
    assert trig["device"][0] == "0"
    assert trig["size"][0] and trig["size"][0] >= 4 * torch.cuda.mem_get_info()[1] // 2
    top = oom.filter(oom["event_type"] == "OOM_TOP_ALLOC")
    assert top["size"].to_list() == [256 << 20, 64 << 20]


RETRIED = """
import sys, torch, msmemscope
from msmemscope import capture
msmemscope.config(output=sys.argv[1], collect_mode="immediate", analysis="oom:2")
s = capture.current()
ids = []
for i in range(5):  # a batch-size search: the same failure caught and tried again
    try:
        torch.empty(1 << 50)
    except RuntimeError as e:
        ids.append(id(e))
again = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.")
s.op_failed("torch._ops.aten.empty.memory_format", again)  # one failure seen at two op levels
s.op_failed("torch._ops.aten.zeros.default", again)
[sink] = [x for x in s.sinks if type(x).__name__ == "OomSink"]
print(len(sink.events), len(set(ids)))
msmemscope.stop()
"""


def test_each_caught_and_retried_failure_is_reported_once(tmp_path):
    """Five allocation failures caught in a loop are five OOM reports (each exception object is
    freed before the next is made at the same address, so an id() alone took them for one), and one
    failure seen at two op levels is one."""
    script = _script(tmp_path, "retried.py", RETRIED)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, script, str(out)], capture_output=True, text=True, env=env_for_tests(),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    events, distinct_ids = map(int, r.stdout.split())
    assert events == 6, r.stdout
    folder, = run_folders(out)
    df, oom = _oom_rows(folder)
    assert oom.filter(oom["event_type"] == "OOM_TRIGGER").height == 6
    assert df.filter(df["name"] == "OOM_Snapshot").height == 6


RETRIED_THREADS = """
import sys, threading, torch, msmemscope
from msmemscope import capture
msmemscope.config(output=sys.argv[1], collect_mode="immediate", analysis="oom:2")
s = capture.current()
def fail(n):
    for _ in range(n):
        try:
            torch.empty(1 << 50)
        except RuntimeError:
            pass
t = threading.Thread(target=fail, args=(10,))
t.start(); fail(10); t.join()          # two threads failing at once: 20
msmemscope.stop(); fail(2); msmemscope.start()   # not traced: none
fail(3)                                          # traced again: 3
[sink] = [x for x in s.sinks if type(x).__name__ == "OomSink"]
print(len(sink.events))
msmemscope.stop()
"""


def test_failures_of_two_threads_and_after_a_gap_are_each_reported(tmp_path):
    """Allocation failures caught on two threads at once, then in a stop/start gap (not traced), then
    after it: one report for each traced failure; the dump keeps its invariants."""
    script = _script(tmp_path, "retried_threads.py", RETRIED_THREADS)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, script, str(out)], capture_output=True, text=True, env=env_for_tests(),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) == 23, r.stdout
    folder, = run_folders(out)
    df, oom = _oom_rows(folder)
    assert oom.filter(oom["event_type"] == "OOM_TRIGGER").height == 23
    assert df.filter(df["name"] == "OOM_Snapshot").height == 23
