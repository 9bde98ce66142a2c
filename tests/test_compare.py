"""Step compare (SPEC §4.3, issue 4): real traced runs, the original's dumps, alignment, bad input."""
from __future__ import annotations

import csv
import glob
import os
import sys

import numpy as np
import polars as pl
import pytest

from conftest import PEER, ROOT, dump_of, env_for_tests, run_cli, run_folders

from msmemscope.analysis import compare as C

HEADER_LINES = [",,,Base,Compare",
                "Event,Name,Device Id,Allocated Memory(byte),Allocated Memory(byte),Diff Memory(byte)"]

TRAIN = """\
import os
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
extra = int(os.environ.get("EXTRA_STEP", "0"))
for step in range(1, 5):
    x = torch.randn(32, 8)
    h = model[0](x)
    if step == extra:
        pad = torch.zeros(1000)  # EXTRA LINE: 4000 bytes only in this step
    loss = model[2](model[1](h)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
EXTRA_LINE = TRAIN.splitlines().index(next(l for l in TRAIN.splitlines() if "EXTRA LINE" in l)) + 1


def read_result(path):
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    assert lines[:2] == HEADER_LINES
    rows = list(csv.reader(lines[2:]))
    assert all(len(r) == 6 for r in rows)
    return rows


def result_files(out):
    return sorted(glob.glob(os.path.join(str(out), "compare", "memory_compare_*.csv")))


def compare_cli(out, spec, *extra):
    before = set(result_files(out))
    p = run_cli(["--compare", f"--input={spec}", "-o", str(out), *extra])
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    new = sorted(set(result_files(out)) - before)
    assert len(new) == 1, new
    return p, read_result(new[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three traced runs of one training script: two plain, one with an extra tensor in step 2."""
    d = tmp_path_factory.mktemp("runs")
    script = d / "train.py"
    script.write_text(TRAIN)
    out = {}
    for name, extra in (("a", "0"), ("b", "0"), ("x", "2")):
        root = d / name
        env = env_for_tests()
        env["EXTRA_STEP"] = extra
        p = run_cli(["-q", "--call-stack=python", "--analysis=none", "-o", str(root), str(script)], env=env)
        assert p.returncode == 0, p.stderr
        (folder,) = run_folders(root)
        out[name] = (folder, dump_of(folder))
    out["dir"] = d
    return out


def assert_only_extra(rows, stdout, extra_bytes=4000):
    """Exactly one op differs: present in compare only, allocating ``extra_bytes``; all others align equal."""
    diff = [r for r in rows if r[3] == "N/A" or r[4] == "N/A" or r[5] != "0"]
    assert len(diff) == 1, diff
    ev, name, dev, base, cmp_, d = diff[0]
    assert (ev, dev, base, cmp_, d) == ("OP_LAUNCH", "cpu", "N/A", str(extra_bytes), str(extra_bytes))
    assert name == "torch._ops.aten.zeros.default"
    others = [r for r in rows if r is not diff[0]]
    assert others and all(r[3] == r[4] and r[5] == "0" for r in others)
    assert f"train.py:{EXTRA_LINE}" in stdout
    assert "aten.zeros.default" in stdout


# --- real runs ---------------------------------------------------------------

def test_two_runs_same_steps_no_difference(runs, out_dir):
    p, rows = compare_cli(out_dir, f"{runs['a'][0]},{runs['b'][0]}")
    assert len(rows) > 50
    assert all(r[3] != "N/A" and r[4] != "N/A" and r[3] == r[4] and r[5] == "0" for r in rows)
    assert sum(int(r[3]) for r in rows) > 0  # the ops did allocate: bytes were attributed
    assert "No differences" in p.stdout


def test_extra_tensor_across_dumps(runs, out_dir):
    p, rows = compare_cli(out_dir, f"{runs['a'][1]},{runs['x'][1]}")
    assert_only_extra(rows, p.stdout)


def test_extra_tensor_across_steps_of_one_dump(runs, out_dir):
    dump = runs["x"][1]
    p, rows = compare_cli(out_dir, f"{dump}:step=3,{dump}:step=2")
    assert_only_extra(rows, p.stdout)
    # the other direction: the op exists in base only; folder form and full-width comma
    p, rows = compare_cli(out_dir, f"{runs['x'][0]}:step=2，step=3")
    diff = [r for r in rows if r[5] != "0" or "N/A" in r]
    assert [(r[1], r[3], r[4], r[5]) for r in diff] == [("torch._ops.aten.zeros.default", "4000", "N/A", "-4000")]


def test_two_steps_same_run_no_difference(runs, out_dir):
    p, rows = compare_cli(out_dir, f"{runs['a'][1]}:step=2,step=3")
    assert rows and all(r[3] == r[4] and r[5] == "0" for r in rows)


def test_api_result(runs, tmp_path):
    res = C.compare(runs["a"][1] + ":step=3", runs["x"][1] + ":step=2")
    assert res.path is None and not os.path.exists(tmp_path / "compare")
    top = res.top()
    assert top.height == 1
    r = top.row(0, named=True)
    assert r["name"] == "torch._ops.aten.zeros.default" and r["base_pos"] is None
    assert r["compare_bytes"] == 4000 and r["diff"] == 4000
    assert res.line_of("compare", r["compare_id"]).startswith(str(runs["dir"] / "train.py") + f":{EXTRA_LINE}")
    # every op of each side appears once, in order
    t = res.table
    assert t["base_pos"].drop_nulls().to_list() == list(range(1, t["base_pos"].drop_nulls().len() + 1))
    assert t["compare_pos"].drop_nulls().to_list() == list(range(1, t["compare_pos"].drop_nulls().len() + 1))
    res2 = C.compare(runs["a"][1], runs["b"][1], output=str(tmp_path))
    assert res2.path and os.path.dirname(res2.path) == str(tmp_path / "compare")
    assert res2.differences.height == 0


def test_never_overwrites(runs, out_dir):
    spec = f"{runs['a'][1]}:step=2,step=3"
    compare_cli(out_dir, spec)
    compare_cli(out_dir, spec)  # same second: a second file, the first untouched
    assert len(result_files(out_dir)) == 2


# --- the original's dumps ----------------------------------------------------

def test_peer_dumps(out_dir):
    base, leaks = os.path.join(PEER, "baseline.csv"), os.path.join(PEER, "leaks.csv")
    p, rows = compare_cli(out_dir, f"{base},{leaks}")
    # worked by hand from the CSVs: leaks.csv runs the same 20 ops per iteration as baseline.csv
    # plus aten.randn (allocates nothing) and aten._to_copy (one PTA MALLOC of 4000256 bytes,
    # IDs 63 and 127) after the optimizer step, twice
    assert len(rows) == 44
    diff = [(i, r[1].replace("torch._ops.", ""), r[3], r[4], r[5]) for i, r in enumerate(rows)
            if r[5] != "0" or "N/A" in r[3:5]]
    assert diff == [(20, "aten.randn.default", "N/A", "0", "0"),
                    (21, "aten._to_copy.default", "N/A", "4000256", "4000256"),
                    (42, "aten.randn.default", "N/A", "0", "0"),
                    (43, "aten._to_copy.default", "N/A", "4000256", "4000256")]
    same = {r[1].replace("torch._ops.", ""): int(r[3]) for r in rows if r[3] != "N/A"}
    # bracket containment per thread; HAL rows left out: mse_loss = 512 + 16778240 (IDs 8, 10),
    # sum = 512 + 1536 (IDs 33, 34, autograd thread), addmm 1536, _foreach_add_ 1024
    assert same["aten.mse_loss.default"] == 16778752
    assert same["aten.sum.dim_IntList"] == 2048
    assert same["aten.addmm.default"] == 1536
    assert same["aten._foreach_add_.List"] == 1024
    assert same["aten.t.default"] == 0
    assert all(r[2] == "0" and r[0] == "OP_LAUNCH" for r in rows)
    assert "4,000,256" in p.stdout
    # reversed: the ops exist in base only, diff negative
    res = C.compare(leaks, base)
    d = res.differences
    assert d["compare_bytes"].null_count() == 4 and sorted(d["diff"].to_list()) == [-4000256, -4000256, 0, 0]


# --- synthetic dumps: nesting, threads, kernels --------------------------------

CSV_HEADER = ("ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,"
              "Call Stack(Python),Call Stack(C)")


def write_dump(path, rows, device="0"):
    """rows: (event, event_type, name, tid, size or None)."""
    lines = [CSV_HEADER]
    for i, (ev, et, name, tid, size) in enumerate(rows, 1):
        attr = "" if size is None else f'"{{""allocation_id"":{i},""addr"":""0x{i:016x}"",""size"":{size}}}"'
        lines.append(f"{i},{ev},{et},{name},{1000 + i},1,{tid},{device},N/A,{attr},,")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_nested_ops_and_threads(tmp_path):
    S, E, M = ("OP_LAUNCH", "ATEN_START"), ("OP_LAUNCH", "ATEN_END"), ("MALLOC", "PTA")
    rows = [(*S, "outer", 1, None), (*M, "x", 1, 10), (*S, "inner", 1, None), (*M, "x", 1, 100),
            (*S, "other", 2, None), (*M, "x", 2, 7),  # another thread, interleaved by ID
            (*E, "inner", 1, None), (*M, "x", 1, 1000), (*E, "other", 2, None), (*E, "outer", 1, None),
            (*M, "x", 1, 5),  # outside any op
            (*S, "last", 1, None), ("MALLOC", "HAL", "N/A", 1, 4096),  # HAL: not counted
            (*M, "N/A", 1, 3), (*E, "last", 1, None)]
    seq = C.sequence(C._read(write_dump(tmp_path / "n.csv", rows))[0], "op", None, "n")
    assert seq.select("name", "bytes").rows() == [("outer", 1010), ("inner", 100), ("other", 7), ("last", 3)]


def test_kernel_level(tmp_path, out_dir):
    K, M = ("KERNEL_LAUNCH", "KERNEL_LAUNCH"), ("MALLOC", "PTA")
    base = [(*M, "N/A", 1, 64), (*K, "k_add", 1, None), (*K, "k_mul", 1, None), (*M, "N/A", 1, 32),
            (*K, "k_sum", 1, None)]
    cmp_ = [(*M, "N/A", 1, 64), (*K, "k_add", 1, None), (*M, "N/A", 1, 512), (*K, "k_fill", 1, None),
            (*K, "k_mul", 1, None), (*M, "N/A", 1, 48), (*K, "k_sum", 1, None)]
    a, b = write_dump(tmp_path / "a.csv", base), write_dump(tmp_path / "b.csv", cmp_)
    p, rows = compare_cli(out_dir, f"{a},{b}", "--level=kernel")
    assert rows == [["KERNEL_LAUNCH", "k_add", "0", "64", "64", "0"],
                    ["KERNEL_LAUNCH", "k_fill", "0", "N/A", "512", "512"],
                    ["KERNEL_LAUNCH", "k_mul", "0", "0", "0", "0"],
                    ["KERNEL_LAUNCH", "k_sum", "0", "32", "48", "16"]]


# --- alignment -----------------------------------------------------------------

def edit_distance(a, b):
    """Insert/delete distance by the textbook O(nm) table."""
    n, m = len(a), len(b)
    D = np.zeros((n + 1, m + 1), dtype=np.int64)
    D[:, 0] = np.arange(n + 1)
    D[0, :] = np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            D[i, j] = D[i - 1, j - 1] if a[i - 1] == b[j - 1] else 1 + min(D[i - 1, j], D[i, j - 1])
    return int(D[n, m])


def check_alignment(a, b, ai, bi):
    a, b = np.asarray(a), np.asarray(b)
    both = (ai >= 0) & (bi >= 0)
    assert not ((ai < 0) & (bi < 0)).any()
    assert np.array_equal(a[ai[both]], b[bi[both]])
    assert np.array_equal(ai[ai >= 0], np.arange(len(a)))
    assert np.array_equal(bi[bi >= 0], np.arange(len(b)))
    return int((~both).sum())


def test_alignment_is_minimal_on_small_random_cases():
    rng = np.random.default_rng(7)
    for _ in range(300):
        n, m = rng.integers(0, 25, 2)
        k = int(rng.integers(1, 5))
        a, b = rng.integers(0, k, n).tolist(), rng.integers(0, k, m).tolist()
        ai, bi, minimal = C.align(a, b)
        assert minimal
        assert check_alignment(a, b, ai, bi) == edit_distance(a, b), (a, b)


def test_alignment_100k_ops_with_edits():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from compare_bench import make_pair
    finally:
        sys.path.pop(0)
    a, b, kinds = make_pair(100_000, 200, seed=3)
    ai, bi, minimal = C.align(a, b)
    applied = int((kinds < 2).sum() + 2 * (kinds == 2).sum())
    assert minimal
    found = check_alignment(a, b, ai, bi)
    assert 0 < found <= applied
    # the inserted/replaced names (codes >= 400) are never aligned with anything
    assert (b[bi[(ai >= 0) & (bi >= 0)]] < 400).all()


def test_alignment_gives_up_honestly():
    a = np.arange(0, 2000)
    b = np.arange(5000, 7000)
    ai, bi, minimal = C.align(a, b, max_edits=100)
    assert not minimal
    assert check_alignment(a, b, ai, bi) == 4000


# --- bad input -------------------------------------------------------------------

def assert_usage_error(p, *words):
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msmemscope: error: "), p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("case", ["missing", "not_a_dump", "unknown_step", "bad_step", "one_side", "three_sides",
                                  "devices", "kernel_on_cpu"])
def test_bad_input(case, runs, tmp_path, out_dir):
    good = runs["a"][1]
    peer = os.path.join(PEER, "baseline.csv")
    text = tmp_path / "notes.csv"
    text.write_text("hello,world\n")
    spec, extra, words = {
        "missing": (f"{good},{tmp_path}/nope.csv", [], ["nope.csv", "no such file"]),
        "not_a_dump": (f"{good},{text}", [], ["notes.csv", "header"]),
        "unknown_step": (f"{good}:step=99,step=2", [], ["no step 99"]),
        "bad_step": (f"{good}:step=two,step=2", [], ["step=two"]),
        "one_side": (good, [], ["expected two"]),
        "three_sides": (f"{good},{good},{good}", [], ["3 side(s)"]),
        "devices": (f"{good},{peer}", [], ["devices differ", "cpu", "0"]),
        "kernel_on_cpu": (f"{good},{good}", ["--level=kernel"], ["KERNEL_LAUNCH", "CPU"]),
    }[case]
    p = run_cli(["--compare", f"--input={spec}", "-o", str(out_dir), *extra])
    assert_usage_error(p, *words)
    assert not result_files(out_dir)


def test_sources_that_differ_and_steps_not_recorded_are_said(runs, out_dir):
    """Two runs of one program recorded by different capture sources: compared, with one warning
    that their ops are named differently (before: differences the program did not make, unsaid). A
    step outside --steps: said so (before: 'trace with the launch event')."""
    from conftest import check_invariants, read
    d = runs["dir"]
    env = env_for_tests()
    env["EXTRA_STEP"] = "0"
    env["MSMEMSCOPE_SOURCE"] = "python"
    p = run_cli(["-q", "--call-stack=python", "--analysis=none", "--steps=2,3", "-o", str(d / "py"),
                 str(d / "train.py")], env=env)
    assert p.returncode == 0, p.stderr
    (py,) = run_folders(d / "py")
    check_invariants(read(dump_of(py)))
    r = run_cli(["--compare", f"--input={runs['a'][0]},{py}", "-o", str(out_dir)])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "different capture sources (native, dispatch)" in r.stderr, r.stderr
    r = run_cli(["--compare", f"--input={runs['a'][0]},{runs['b'][0]}", "-o", str(out_dir)])
    assert r.returncode == 0 and "capture sources" not in r.stderr, r.stderr
    r = run_cli(["--compare", f"--input={dump_of(runs['a'][0])}:step=1,{dump_of(py)}:step=1", "-o", str(out_dir)])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "step 1 has no" in lines[-1] and "--steps" in lines[-1], r.stderr
