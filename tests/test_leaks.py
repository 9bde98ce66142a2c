"""Leaks and fluctuation (SPEC §4.1, §4.2): real training loops through the CLI, and the offline checks."""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import sys

import polars as pl
import pytest

from conftest import EXAMPLES, FULL, PEER, check_invariants, dump_of, env_for_tests, full, read, run_cli, run_folders

LEAK_SIZE = 1000 * 1000 * 4          # one 1000x1000 float32 tensor
LEAK_LINE = re.compile(r"^Direct Pytorch Caching memory pool leak of ([\d.]+) Mb\(s\) at (0x[0-9a-f]+) in (\S+) "
                       r"at step (\d+)\.(?: Python: (.*))?$")

LEAK_LOOP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
keep = []
for step in range(6):
    opt.zero_grad(set_to_none=True)
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    keep.append(torch.ones(1000, 1000))   # LEAK LINE
    opt.step()
print("trained", len(keep))
"""

MARKED = """
import torch
from torch import nn
import msmemscope
torch.manual_seed(0)
model = nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
keep = []
for step in range(4):
    if step == 1:
        msmemscope.mark("leak-window")                    # A
    opt.zero_grad(set_to_none=True)
    loss = model(torch.randn(16, 32)).relu().sum()
    loss.backward()
    if step == 1:
        keep.append(torch.zeros(777, 333))                # planted: allocated between A and B, never freed
    opt.step()
    if step == 1:
        msmemscope.mark("leak-window")                    # B
    if step == 3:
        msmemscope.mark("leak-window")                    # C
msmemscope.mark("other")
print("done")
"""


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _leak_lines(text):
    return [m for m in (LEAK_LINE.match(ln) for ln in text.splitlines()) if m]


@pytest.fixture(scope="module")
def leak_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("leakrun")
    script = _write(tmp, "leak_loop.py", LEAK_LOOP)
    out = tmp / "out"
    r = run_cli(["-o", str(out), "--call-stack=python:20", script])
    assert r.returncode == 0, r.stderr
    folders = run_folders(out)
    assert len(folders) == 1
    return r, folders[0], script


def test_leak_loop_reports_exactly_the_appended_blocks(leak_run):
    r, folder, script = leak_run
    assert "trained 6" in r.stdout
    df = read(dump_of(folder))
    check_invariants(df)
    ones = df.filter((df["event"] == "MALLOC") & (df["name"] == "torch._ops.aten.ones.default"))
    assert ones.height == 6 and set(ones["size"].to_list()) == {LEAK_SIZE}
    step_of = dict(zip(ones["alloc_id"].to_list(), ones["step"].to_list()))
    assert sorted(step_of.values()) == [1, 2, 3, 4, 5, 6]
    # the rule: allocated in step s >= 2 and still live when step s+1 ends -> steps 2..5 (6 has no later full step)
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    leaks = res["leaks"]
    assert [lk["step"] for lk in leaks] == [2, 3, 4, 5]
    assert [lk["detected_at_step"] for lk in leaks] == [3, 4, 5, 6]
    for lk in leaks:
        assert lk["size"] == LEAK_SIZE
        assert lk["op"] == "torch._ops.aten.ones.default"
        assert step_of[lk["alloc_id"]] == lk["step"]
        assert lk["device"] == "cpu" and lk["pool"] == "PTA"
        assert lk["python"].startswith(f"{script}:12(")
    assert res["summary"] == [{"device": "cpu", "count": 4, "bytes": 4 * LEAK_SIZE}]
    # console: each block exactly once, in the original's shape
    lines = _leak_lines(r.stderr)
    assert len(lines) == 4
    assert [m.group(1) for m in lines] == ["3.814697"] * 4
    assert [int(m.group(4)) for m in lines] == [2, 3, 4, 5]
    assert {m.group(3) for m in lines} == {"aten.ones.default"}
    assert [int(m.group(2), 16) for m in lines] == [lk["addr"] for lk in leaks]
    assert all(m.group(5).startswith(f"{script}:12(") for m in lines)
    assert "====== ERROR: Detected memory leaks on device cpu ======" in r.stderr
    assert "====== SUMMARY: 15.2588 Mb(s) leaked in 4 allocation(s) ======" in r.stderr


def test_leak_report_in_log_and_gap_table(leak_run):
    r, folder, _ = leak_run
    logs = glob.glob(os.path.join(folder, "msmemscope_logs", "*.log"))
    text = open(logs[0]).read()
    assert len(_leak_lines("\n".join(ln.split(" INFO ", 1)[-1] for ln in text.splitlines()))) == 4
    assert "SUMMARY: 15.2588 Mb(s) leaked in 4 allocation(s)" in text
    # fluctuation: steps 2..6 (the ended steps from 2 on); the leaked list grows by 4 MB a step
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        fl = json.load(f)["fluctuation"]
    assert len(fl) == 1 and fl[0]["device"] == "cpu" and fl[0]["pool"] == "PTA"
    steps = fl[0]["steps"]
    assert [s["step"] for s in steps] == [2, 3, 4, 5, 6]
    for s in steps:
        # within step s the pool holds (s-1) leaked blocks at least and s at most
        assert (s["step"] - 1) * LEAK_SIZE <= s["min_used"] < s["max_used"]
        assert s["max_used"] >= s["step"] * LEAK_SIZE
    assert fl[0]["min_gap"]["step"] == 2 and fl[0]["max_gap"]["step"] == 6
    gap = r.stderr[r.stderr.index("Gap Analysis of Device cpu"):].splitlines()
    assert "MinAlloc/MaxAlloc(%)" in gap[1] and "MinAllocMem(MB)" in gap[1] and "StepId" in gap[1]
    ming, maxg = gap[2].split(), gap[3].split()
    assert ming[0] == "MinGap" and ming[3] == "2"
    assert maxg[0] == "MaxGap" and maxg[3] == "6"
    assert float(ming[1]) == pytest.approx(steps[0]["min_used"] / steps[0]["max_used"] * 100, abs=1e-4)


def test_offline_step_rule_matches_online(leak_run):
    from msmemscope.analysis.leaks import fluctuation, step_leaks
    _, folder, _ = leak_run
    df = read(dump_of(folder))
    off = step_leaks(df)
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    on = res["leaks"]
    assert [(x["alloc_id"], x["step"], x["size"], x["op"], x["addr"]) for x in off] == \
           [(x["alloc_id"], x["step"], x["size"], x["op"], x["addr"]) for x in on]
    fl = fluctuation(df)[("cpu", "PTA")]
    assert {s: list(v) for s, v in fl.items()} == \
           {s["step"]: [s["min_used"], s["max_used"]] for s in res["fluctuation"][0]["steps"]}


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test runs clean programs in test_leak_sites.py::test_clean_run_reports_no_leak")
def test_clean_transformer_reports_no_leak(tmp_path):
    out = tmp_path / "out"
    r = run_cli(["-o", str(out), os.path.join(EXAMPLES, "transformer.py"), "--steps", "20", "--layers", "1",
                 "--batch", "2"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("loss") == 20
    folder, = run_folders(out)
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    assert res["steps_ended"] == 20
    assert res["leaks"] == [] and res["sites"] == []
    assert "no leaks found (20 steps checked)" in r.stderr and "leak: " not in r.stderr
    assert "Detected memory leaks" not in r.stderr and not _leak_lines(r.stderr)
    assert [s["step"] for s in res["fluctuation"][0]["steps"]] == list(range(2, 21))
    from msmemscope.analysis.leaks import step_leaks
    df = read(dump_of(folder))
    assert step_leaks(df) == []
    # the default events and nothing else (test_capture.py's default-events case, in make test here)
    check_invariants(df)
    assert set(df["event"].unique().to_list()) == {"SYSTEM", "MALLOC", "FREE", "OP_LAUNCH"}
    assert "torch._ops.aten.native_layer_norm_backward.default" in set(df["name"].to_list())
    assert df.filter((pl.col("event") == "MALLOC") & (pl.col("name") == "torch._ops.aten.mm.default")).height > 0


@pytest.fixture(scope="module", params=full(["csv"], ["csv", "db"]))  # (make test's time)
def marked_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("marked_" + request.param)
    script = _write(tmp, "marked.py", MARKED)
    out = tmp / "out"
    r = run_cli(["-o", str(out), "--data-format", request.param, "--call-stack=python:10", script])
    assert r.returncode == 0, r.stderr
    folder, = run_folders(out)
    return folder, script


def test_check_leaks_finds_planted_leak(marked_run, capsys):
    import msmemscope
    folder, script = marked_run
    dump = dump_of(folder)
    leaks = msmemscope.check_leaks(input_path=dump, mstx_info="leak-window", start_index=0)
    assert len(leaks) == 1
    lk = leaks[0]
    assert lk["size"] == 777 * 333 * 4 and lk["pool"] == "PTA" and lk["device"] == "cpu"
    assert lk["op"] == "torch._ops.aten.zeros.default"
    assert lk["python"].startswith(f"{script}:16(")
    df = read(dump)
    row = df.filter(df["id"] == lk["id"])
    assert row["event"][0] == "MALLOC" and row["alloc_id"][0] == lk["alloc_id"] and row["addr"][0] == lk["addr"]
    marks = df.filter((df["event"] == "MSTX") & (df["name"] == "leak-window"))["id"].to_list()
    assert marks[0] < lk["id"] < marks[1]
    out = capsys.readouterr().out
    assert "====== ERROR: Detected memory leaks on device cpu ======" in out
    assert f"leak of {777 * 333 * 4 / 1048576:.6f} Mb(s) at {lk['address']} in aten.zeros.default" in out
    # a folder works too; start_index moves the window: from the 2nd mark there are only 2 left
    assert [x["id"] for x in msmemscope.check_leaks(folder, "leak-window", 0)] == [lk["id"]]
    from msmemscope.analysis.leaks import MarkError
    with pytest.raises(MarkError, match="found 3 mark"):
        msmemscope.check_leaks(dump, "leak-window", 1)


def test_check_leaks_cli(marked_run):
    folder, _ = marked_run
    r = run_cli(["check-leaks", folder, "--mark=leak-window"])
    assert r.returncode == 0, r.stderr
    assert len(_leak_lines(r.stdout)) == 0  # offline lines name the event ID, not a step
    mb = 777 * 333 * 4 / 1048576
    assert r.stdout.count(f"Direct Pytorch Caching memory pool leak of {mb:.6f} Mb(s)") == 1
    assert f"SUMMARY: {mb:.4f} Mb(s) leaked in 1 allocation(s)" in r.stdout
    r = run_cli(["check-leaks", folder, "--mark", "leak-window", "--start-index", "0", "--json"])
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert len(got) == 1 and got[0]["size"] == 777 * 333 * 4


def _with_marks(src, dst, after_ids, msg):
    """A copy of an original-tool dump with Mark rows placed right after the given IDs (IDs renumbered x10)."""
    with open(src, newline="") as f:
        rows = list(csv.reader(f))
    head, body = rows[0], rows[1:]
    out = []
    for r in body:
        i = int(r[0])
        out.append([str(i * 10)] + r[1:])
        if i in after_ids:
            out.append([str(i * 10 + 5), "MSTX", "Mark", msg, r[4], r[5], r[6], r[7], "N/A", "", "", ""])
    with open(dst, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        w.writerows(out)
    return dst


# what the A/B/C rule finds in the original's dumps, marks after IDs 1 (START_TRACE), 64 and the last row:
# (pool, allocation_id, size, op found as the enclosing aten op on the same thread)
PEER_EXPECTED = {
    "leaks.csv": [("HAL", 3, 18874368, "torch._ops.aten.mse_loss.default"),
                  ("HAL", 5, 2097152, "torch._ops.aten.mse_loss.default"),
                  ("HAL", 9, 2097152, "torch._ops.aten.mm.default"),
                  ("HAL", 12, 2815668, "torch._ops.aten.sum.dim_IntList"),
                  ("PTA", 14, 4000256, "torch._ops.aten._to_copy.default")],
    "baseline.csv": [("HAL", 5, 2097152, "torch._ops.aten.mse_loss.default"),
                     ("HAL", 9, 2097152, "torch._ops.aten.mm.default"),
                     ("HAL", 12, 2815668, "torch._ops.aten.sum.dim_IntList"),
                     ("PTA", 14, 1536, "torch._ops.aten.addmm.default")],
}


@pytest.mark.parametrize("name", sorted(PEER_EXPECTED))
def test_check_leaks_on_original_dumps(name, tmp_path, capsys):
    import msmemscope
    from msmemscope.analysis.leaks import MarkError, leaks_between, step_leaks
    src = os.path.join(PEER, name)
    df = read(src)
    last = int(df["id"].max())
    # the original's dumps have no marks: a clear error, not a crash
    with pytest.raises(MarkError, match="found 0 mark"):
        msmemscope.check_leaks(src, "A", 0)
    marked = _with_marks(src, str(tmp_path / name), {1, 64, last}, "win")
    leaks = msmemscope.check_leaks(marked, "win", 0)
    got = [(x["pool"], x["alloc_id"], x["size"], x["op"]) for x in leaks]
    assert got == PEER_EXPECTED[name]
    assert {x["device"] for x in leaks} == {"0"}
    assert "Direct HAL memory pool leak of 18.000000 Mb(s)" in capsys.readouterr().out or name == "baseline.csv"
    # the same through the function on the unmarked dump, by IDs
    assert [(x["pool"], x["alloc_id"]) for x in leaks_between(df, 1, 65, last + 1)] == [g[:2] for g in got]
    assert step_leaks(df) == []   # no STEP rows in these dumps


def test_check_leaks_bad_input(tmp_path, marked_run):
    folder, _ = marked_run
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["check-leaks", str(tmp_path / "nope.csv"), "--mark=x"], "no such file"),
        (["check-leaks", str(empty), "--mark=x"], "holds no msmemscope dump"),
        (["check-leaks", folder, "--mark=leak-window", "--start-index=1"], "found 3 mark(s)"),
        (["check-leaks", folder, "--mark=never"], "found 0 mark(s)"),
        (["check-leaks", folder, "--mark=x", "--start-index=z"], "not a whole number"),
    ]
    for args, text in cases:
        r = run_cli(args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("msmemscope: error: ") and text in lines[0], (args, r.stderr)
        assert "Traceback" not in r.stderr


STEPS_LOOP = """
import torch, msmemscope
keep = []
for step in range(5):
    x = torch.ones(1000, 1000)          # freed in the next step (rebinding x), maybe while not recorded
    keep.append(torch.ones(10, 10))     # leaks
    msmemscope.step()
print("ok")
"""


@pytest.mark.parametrize("source,steps", [("native", "2"), ("python", "2,4")]
                         + ([("native", "2,4"), ("python", "2"), ("native", "2,3")] if FULL else []))
def test_unrecorded_free_is_not_a_leak(tmp_path, source, steps):
    """With --steps the FREE of a recorded step's `x` comes in a step that is not recorded: it is in
    the dump all the same (flagged ``untraced``, the block was counted), so `x` is no finding, online
    or offline; each recorded step's kept block is one, found at the next step end whether that step
    is recorded or not, and offline finds exactly what the online analysis found (before, offline
    judged nothing at a step end outside --steps and dropped the later steps' findings)."""
    script = _write(tmp_path, "steps_loop.py", STEPS_LOOP)
    out = tmp_path / "out"
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    r = run_cli(["-o", str(out), f"--steps={steps}", script], env=env)
    assert r.returncode == 0, r.stderr
    folder, = run_folders(out)
    check_invariants(read(dump_of(folder)))
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    recorded = [int(s) for s in steps.split(",")]
    # the truth: steps numbered from 1 by msmemscope.step(); each loop pass keeps 10 x 10 floats
    assert [(lk["step"], lk["detected_at_step"], lk["size"], lk["op"]) for lk in res["leaks"]] == \
        [(s, s + 1, 400, "torch._ops.aten.ones.default") for s in recorded]
    assert len(_leak_lines(r.stderr)) == len(recorded)
    # growth by site needs every step: with --steps it is not judged, and the report says so
    assert res["growth_judged"] is False and res["sites"] == [] and res["retained"] == []
    assert "growth by site not judged" in r.stderr and "no leaks found" not in r.stderr
    from msmemscope.analysis.leaks import analyze
    off, = analyze(folder)
    assert off["growth_judged"] is False and off["steps_ended"] == 5
    for key in ("leaks", "summary", "sites", "retained"):
        assert off[key] == res[key], key


WINDOW_LOOP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(4, 8)
keep = []
for step in range(6):
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()                               # ends the step
    keep.append(torch.full((25, 25), 1.0))   # leaks: 2,500 B a step
print("ok")
"""


@pytest.mark.parametrize("source,analysis", full([("native", "decompose,leaks")],  # (make test's time)
                                                  [(s, a) for s in ("native", "python")
                                                   for a in ("leaks", "decompose,leaks")]))
def test_blocks_first_seen_in_the_window_are_not_leaks_of_its_first_step(tmp_path, source, analysis):
    """With --steps=3,4 the model's parameters, its input and Adam's state were made before the
    window: an op first meets them in step 3 (MALLOC origin before_op: the dispatch-mode source
    always, the native source with access events). That row is not their allocation, so they are
    no block-rule finding of step 3: the window's first step reported every one of them as a leak.
    The blocks the program keeps are found, online and offline (the tracker's replay and the
    vectorized rule)."""
    script = _write(tmp_path, "window_loop.py", WINDOW_LOOP)
    out = tmp_path / "out"
    env = {**os.environ, "MSMEMSCOPE_SOURCE": source}
    r = run_cli(["-o", str(out), "--steps=3,4", f"--analysis={analysis}", script], env=env)
    assert r.returncode == 0, r.stderr
    folder, = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    first = df.filter((pl.col("event") == "MALLOC") & (pl.col("attr").str.contains("before_op")))
    if source == "python" or analysis != "leaks":
        assert first.height >= 5, first  # the weights and biases, x: the case this test is about
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        leaks = json.load(f)["leaks"]
    # online: the blocks kept in steps 3 and 4 (the tracer knows step 4's is live at step 5's end)
    assert [(lk["step"], lk["size"]) for lk in leaks] == [(3, 2500), (4, 2500)], leaks
    assert len(_leak_lines(r.stderr)) == 2
    from msmemscope.analysis import leaks as L
    # offline: the same (step 5 is not recorded, but a FREE of step 4's block there would be in the
    # dump, flagged untraced: its absence shows the block live at step 5's end)
    off, = L.analyze(folder)
    assert off["leaks"] == leaks, off["leaks"]
    vec = L.step_leaks(L._read(dump_of(folder)))
    assert [(lk["step"], lk["size"]) for lk in vec] == [(3, 2500), (4, 2500)], vec


RANGES_LOOP = """
import sys, torch, msmemscope
keep = []
for s in range(6):
    rid = msmemscope.range_start(f"iter{s}")   # opened in step s + 1 ...
    if s == 2 and sys.argv[1:] == ["gap"]:      # a stop/start gap in unrecorded step 3, iter2 open across it
        msmemscope.stop()
        torch.ones(5, 5)
        msmemscope.start()
    msmemscope.step()                           # ... which ends here
    keep.append(torch.ones(10, 10))             # allocated in step s + 2, inside iter{s}
    msmemscope.range_end(rid)
print("ok")
"""


@pytest.mark.parametrize("source,gap", full([("native", ""), ("python", "gap")],  # (make test's time)
                                           [(s, g) for s in ("native", "python") for g in ("", "gap")]))
def test_ranges_of_unrecorded_steps_still_label_the_recorded_ones(tmp_path, source, gap):
    """With --steps, a range opened or closed in a step that is not recorded still counts: its MSTX
    row is written there, so a leak in a recorded step carries the range open when it was
    allocated (before, iter1 stayed open through the unrecorded step 3 and labelled step 4's block).
    With ``gap``, the program stops and starts tracing in unrecorded step 3 while iter2 is open:
    step 4's block still carries iter2."""
    script = _write(tmp_path, "ranges_loop.py", RANGES_LOOP)
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    r = run_cli(["-o", str(tmp_path / "out"), "--steps=2,4", script] + ([gap] if gap else []), env=env)
    assert r.returncode == 0, r.stderr
    folder, = run_folders(tmp_path / "out")
    df = read(dump_of(folder))
    check_invariants(df)
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    # step k's block is allocated inside range iter{k-2}
    assert [(lk["step"], lk.get("label")) for lk in res["leaks"]] == [(2, "iter0"), (4, "iter2")], res["leaks"]
    from msmemscope.analysis.leaks import analyze
    off, = analyze(folder)
    assert off["leaks"] == res["leaks"]


TWO_OPTIMIZERS = """
import sys, torch
from torch import nn
torch.manual_seed(0)
a, b = nn.Linear(16, 4), nn.Linear(4, 2)
mode = sys.argv[1]
if mode == "one":
    opts = [torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)]
else:
    opts = [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)]
x = torch.randn(8, 16)
keep = []
for i in range(10):
    b(a(x)).square().mean().backward()
    if mode == "phases":   # the first optimizer alone, then the second alone
        stepping = opts[:1] if i < 5 else opts[1:]
    else:
        stepping = opts
    for o in stepping:
        o.step()
    for o in opts:
        o.zero_grad()
    keep.append(torch.ones(1024))     # 4 KB an iteration
print("ok")
"""


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))
def test_two_optimizers_stepped_each_iteration_end_one_step(tmp_path, source):
    """Two optimizers stepped one after the other each iteration (a GAN, Muon beside AdamW) end one
    step per iteration, the first one's: the leak of 4 KB an iteration is found as with one optimizer
    (before: two step ends an iteration, live bytes rose at every other one, "no leaks found"). An
    optimizer that takes over from another (a new phase) ends the steps from its second step on."""
    import polars as pl
    script = _write(tmp_path, "two.py", TWO_OPTIMIZERS)
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    got = {}
    # (make test's time: "one" is the baseline; "phases", an optimizer taking over, ~7 CPU s)
    for mode in full(("two",), ("one", "two", "phases")):
        r = run_cli(["-o", str(tmp_path / mode), script, mode], env=env)
        assert r.returncode == 0, r.stderr
        folder, = run_folders(tmp_path / mode)
        df = read(dump_of(folder))
        check_invariants(df)
        with open(os.path.join(folder, "analysis", "leaks.json")) as f:
            res = json.load(f)
        got[mode] = (df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height, res)
    assert got["two"][0] == 10 and got.get("one", got["two"])[0] == 10
    for mode in [m for m in ("one", "two") if m in got]:
        sites = got[mode][1]["sites"]
        assert [(s["op"], s["bytes_per_step"]) for s in sites] == [("torch._ops.aten.ones.default", 4096)], (mode, sites)
    if "phases" in got:
        assert got["phases"][0] == 9  # the second optimizer's first step ends none: its second does
        # (the iteration where the second took over is one step of two iterations: 8 KB)
        sites = got["phases"][1]["sites"]
        assert [s["op"] for s in sites] == ["torch._ops.aten.ones.default"] and 4096 < sites[0]["bytes_per_step"] < 8192
