"""Distributed jobs: every rank traced into its own folder, the cross-rank summary, per-rank offline analyses.

Real torchrun jobs (gloo on CPU) under the launcher; small synthetic rank dumps for the rules."""
import importlib.util
import json
import os
import shutil
import sys

import polars as pl
import pytest

from conftest import ROOT, fsdp2_launcher_run, check_invariants, full, config_of, dump_of, env_for_tests, read, run_cli, run_folders

PROGS = os.path.join(ROOT, "tests", "progs")


def _torchrun_env():
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed")
    env = env_for_tests()
    env["PATH"] = os.path.dirname(torchrun) + os.pathsep + env.get("PATH", "")
    return torchrun, env


def _summary_json(root, tmp, *extra):
    out = os.path.join(str(tmp), "summary.json")
    env = env_for_tests()
    env["COLUMNS"] = "240"  # the table's width: long tmp paths (xdist workers) must not wrap the labels
    r = run_cli(["summary", str(root), "--json", out, *extra], env=env)
    assert r.returncode == 0, r.stderr
    with open(out) as f:
        return json.load(f), r.stdout


def _bench():
    spec = importlib.util.spec_from_file_location("summary_bench", os.path.join(ROOT, "bench", "summary_bench.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


# ---------------------------------------------------------------------------- FSDP2, 2 ranks
@pytest.fixture(scope="module")
def fsdp_run(shared_run):
    # the job test_combinations.py also checks (conftest.FSDP2_LAUNCHER): one run for both files
    out, r = fsdp2_launcher_run(shared_run)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_fsdp2_every_rank_own_folder(fsdp_run):
    folders = run_folders(fsdp_run)
    assert len(folders) == 2, folders  # the two ranks, not torchrun's agent
    cfgs = {config_of(f)["rank"]: (f, config_of(f)) for f in folders}
    assert sorted(cfgs) == [0, 1]
    for rank, (f, cfg) in cfgs.items():
        assert os.path.basename(f).startswith(f"msmemscope_{cfg['pid']}_")
        assert os.path.basename(f).endswith(f"_cpu_rank{rank}")  # the rank is in the name
        assert cfg["local_rank"] == rank and cfg["world_size"] == 2 and cfg["host"]
        assert "role" not in cfg
        df = read(dump_of(f))
        check_invariants(df)  # complete: every FREE has its MALLOC, ops closed, counters consistent
        assert df.filter(pl.col("event_type") == "STEP").height == 3


def test_fsdp2_summary_peaks_match_each_dump(fsdp_run, tmp_path):
    s, text = _summary_json(fsdp_run, tmp_path)
    assert [r["label"] for r in s["ranks"]] == ["rank 0", "rank 1"]
    for r in s["ranks"]:
        assert "error" not in r, r
        df = read(r["dump"])
        mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
        want = {(d, p): (a, t) for d, p, a, t in mem.group_by("device", "event_type")
                .agg(pl.col("used").max(), pl.col("total").max()).iter_rows()}
        got = {(p["device"], p["pool"]): (p["peak_allocated"], p["peak_reserved"]) for p in r["peaks"]}
        assert got == want
        assert r["peak_allocated"] == max(a for a, _ in want.values())
        assert r["peak_allocated"] > 0
        # decomposition and inefficient memory come from the online results of that rank
        assert r["decompose"]["source"] == "analysis/decompose.json"
        assert r["decompose"]["categories"]["weight"] > 0
        assert r["inefficient"]["source"] == "analysis/inefficient.json"
    # rank 1 trains on a 16x larger batch: its activations make it the peak furthest from the median
    p0, p1 = (r["peak_allocated"] for r in s["ranks"])
    assert p1 > p0 + 512 * 128 * 4
    assert s["imbalance"]["label"] == "rank 1"
    assert s["imbalance"]["delta_bytes"] == p1 - (p0 + p1) / 2
    assert s["leaking"] == []
    assert "rank 0" in text and "rank 1" in text and "peak alloc" in text


def test_decompose_and_check_inefficient_per_rank(fsdp_run):
    r = run_cli(["decompose", str(fsdp_run)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("===== rank ") == 2
    assert r.stdout.index("===== rank 0") < r.stdout.index("===== rank 1")
    assert r.stdout.count("memory decomposition") == 2
    r = run_cli(["check-inefficient", str(fsdp_run), "--json"])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [x["rank"] for x in res["ranks"]] == [0, 1]
    for x in res["ranks"]:
        assert x["summary"]["blocks"] > 0 and x["dump"].endswith(".csv")
    assert r.stderr.count("===== rank ") == 2


# ---------------------------------------------------------------------------- DDP, 4 ranks, rank 2 leaks
RANKS = full(3, 4)  # make test: three ranks, the leaking one among two that do not


def test_ddp_four_ranks_one_leaks(out_dir, tmp_path):
    torchrun, env = _torchrun_env()
    r = run_cli(["-q", "-o", str(out_dir), torchrun, "--standalone", f"--nproc_per_node={RANKS}",
                 os.path.join(PROGS, "ddp_leak_rank.py")], env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    folders = run_folders(out_dir)
    assert sorted(config_of(f)["rank"] for f in folders) == list(range(RANKS))
    assert len({os.path.basename(f) for f in folders}) == RANKS
    steps = set()
    for f in folders:  # every rank's dump complete, in its own folder (the ranks, not torchrun's agent)
        assert config_of(f)["world_size"] == RANKS
        df = read(dump_of(f))
        check_invariants(df)
        steps.add(df.filter(pl.col("event_type") == "STEP").height)
    assert len(steps) == 1 and steps.pop() >= 3, steps
    s, text = _summary_json(out_dir, tmp_path)
    assert s["leaking"] == ["rank 2"]
    by = {r["rank"]: r for r in s["ranks"]}
    leak2 = by[2]["leaks"]
    # the tensor appended in steps 2..5 outlived a full step (step 6 is the last boundary)
    assert leak2["count"] >= 4 and leak2["steps"][-1] - leak2["steps"][0] >= 3
    assert leak2["bytes"] >= 4 * 64 * 1024 * 4
    for k in set(range(RANKS)) - {2}:
        assert by[k]["leaks"]["bytes"] < 64 * 1024 * 4
    assert [ln.split(":")[1].strip() for ln in text.splitlines() if ln.startswith("leaking:")] == ["rank 2"]
    # rank 2 holds the kept tensors: its peak is the one furthest from the median
    assert s["imbalance"]["label"] == "rank 2" and s["imbalance"]["flagged"]


# ---------------------------------------------------------------------------- synthetic rank dumps
def _synthetic(root, n_ranks=5, events=4000, big=None, leak=None):
    b = _bench()
    for rank in range(n_ranks):
        b.write_rank(str(root), rank, n_ranks, events, scale=1.5 if rank == big else 1.0, leak=(rank == leak))
    return b


def test_summary_synthetic_imbalance_and_leak(tmp_path):
    root = tmp_path / "job"
    _synthetic(root, n_ranks=5, big=3, leak=1)
    s, _ = _summary_json(root, tmp_path, "--workers", "2")
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2, 3, 4]
    assert s["imbalance"]["label"] == "rank 3" and s["imbalance"]["flagged"]
    assert s["leaking"] == ["rank 1"]
    for r in s["ranks"]:
        df = read(r["dump"])
        assert r["peak_allocated"] == df["used"].max() and r["peak_reserved"] == df["total"].max()
        assert r["peak_reserved"] > r["peak_allocated"]  # reserved is rounded up like a caching allocator
        assert r["leaks"]["source"] in ("analysis.leaks.step_leaks", "step rule on the dump")
    assert s["timing"]["workers"] == 2


def test_summary_same_in_one_process(tmp_path):
    """The pool and the serial path give the same answers."""
    root = tmp_path / "job"
    _synthetic(root, n_ranks=3, big=0, leak=2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _ = _summary_json(root, tmp_path / "a", "--workers", "1")
    b, _ = _summary_json(root, tmp_path / "b", "--workers", "3")
    strip = ("seconds", "cpu_seconds")
    assert [{k: v for k, v in r.items() if k not in strip} for r in a["ranks"]] == \
           [{k: v for k, v in r.items() if k not in strip} for r in b["ranks"]]
    assert a["leaking"] == b["leaking"] == ["rank 2"]


def test_summary_one_bad_dump_among_good(tmp_path):
    root = tmp_path / "job"
    _synthetic(root, n_ranks=3)
    [bad] = [f for f in run_folders(root) if f.endswith("rank1")]
    with open(dump_of(bad), "a") as f:
        f.write("not,a,row\n")  # malformed in the middle -> an error for that rank only
    s, text = _summary_json(root, tmp_path)
    by = {r["rank"]: r for r in s["ranks"]}
    assert "error" in by[1] and "line" in by[1]["error"]
    assert "error" not in by[0] and "error" not in by[2]
    assert "error: rank 1" in text


def test_summary_bad_input(tmp_path):
    r = run_cli(["summary", str(tmp_path / "nothing")])
    assert r.returncode == 2 and r.stderr.startswith("msmemscope: error:") and "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    r = run_cli(["summary", str(tmp_path / "empty")])
    assert r.returncode == 2 and "no msmemscope dump" in r.stderr
    r = run_cli(["summary", str(tmp_path), "--workers", "zero"])
    assert r.returncode == 2 and "--workers" in r.stderr


def test_summary_json_never_overwritten(tmp_path):
    root = tmp_path / "job"
    _synthetic(root, n_ranks=2)
    out = tmp_path / "s.json"
    out.write_text("keep")
    r = run_cli(["summary", str(root), "--json", str(out)])
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "keep"
    assert json.loads((tmp_path / "s_1.json").read_text())["ranks"]


def test_rank_folder_name_and_collision(tmp_path):
    from msmemscope.capture.session import _new_folder, run_folder_name
    assert run_folder_name(42, "20260101000000", "cpu") == "msmemscope_42_20260101000000_cpu"
    assert run_folder_name(42, "20260101000000", "cuda", 7) == "msmemscope_42_20260101000000_cuda_rank7"
    a = _new_folder(str(tmp_path), "msmemscope_1_2_cpu_rank0")
    b = _new_folder(str(tmp_path), "msmemscope_1_2_cpu_rank0")  # same pid and second on another node
    assert a != b and os.path.isdir(a) and os.path.isdir(b) and b.endswith("_rank0_1")


def test_find_rank_dumps_nested_roots_and_workers(tmp_path):
    """Roots copied from two nodes side by side; a DataLoader worker traced on request."""
    from msmemscope.io.ranks import find_rank_dumps
    b = _bench()
    b.write_rank(str(tmp_path / "node0"), 0, 2, 500)
    b.write_rank(str(tmp_path / "node1"), 1, 2, 500)
    w = b.write_rank(str(tmp_path / "node0"), 0, 2, 500, pid=777)
    cfg_path = os.path.join(w, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(role="dataloader_worker", worker_id=0)
    json.dump(cfg, open(cfg_path, "w"))
    rds = find_rank_dumps(str(tmp_path))
    assert [r.label for r in rds] == ["rank 0", "rank 0 worker 0 (pid 777)", "rank 1"]
    s, _ = _summary_json(tmp_path, tmp_path / "node1")
    assert {r["label"] for r in s["ranks"]} == {"rank 0", "rank 0 worker 0 (pid 777)", "rank 1"}
    assert s["imbalance"]["label"] in ("rank 0", "rank 1")  # the worker is not a rank


def test_summary_from_online_results_equals_from_dumps(tmp_path):
    """Ranks that left analysis/peaks.json and leaks.json are summarised from those (no dump read);
    the numbers and the verdicts are those read from their dumps."""
    root = tmp_path / "job"
    b = _bench()
    for rank in range(4):
        b.write_rank(str(root), rank, 4, 3000, scale=1.5 if rank == 2 else 1.0, leak=(rank == 3), results=True)
    from msmemscope.report.summary import build
    saved = build(str(root), workers=1, show_progress=False)
    dumps = build(str(root), workers=1, show_progress=False, from_dumps=True)
    assert [r["source"] for r in saved["ranks"]] == ["analysis"] * 4
    assert [r["source"] for r in dumps["ranks"]] == ["dump"] * 4
    assert saved["timing"]["workers"] == 0  # read in this process: no pool started
    for a, d in zip(saved["ranks"], dumps["ranks"]):
        for k in ("label", "peaks", "peak_allocated", "peak_reserved", "device", "steps", "events"):
            assert a[k] == d[k], k
        for k in ("count", "bytes", "steps", "signatures"):
            assert a["leaks"][k] == d["leaks"][k], k
    assert saved["imbalance"] == dumps["imbalance"] and saved["imbalance"]["label"] == "rank 2"
    assert saved["leaking"] == dumps["leaking"] == ["rank 3"]
    # a rank whose results are damaged is read from its dump, with the same answer
    [f3] = [f for f in run_folders(root) if f.endswith("rank3")]
    with open(os.path.join(f3, "analysis", "leaks.json"), "w") as f:
        f.write("{not json")
    mixed = build(str(root), workers=1, show_progress=False)
    assert [r["source"] for r in mixed["ranks"]] == ["analysis"] * 3 + ["dump"]
    assert mixed["leaking"] == ["rank 3"]
