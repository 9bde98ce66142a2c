"""Ranks started by torch.multiprocessing.spawn: the rank and world size are given to
init_process_group, nothing is in the environment (no RANK, WORLD_SIZE, LOCAL_RANK). They are
ranks all the same: config.json says which, the folders end in ``_rank<R>``, FSDP2's owner labels
are those of the same job under torchrun, and the offline commands on the root compare the ranks,
not the spawning parent (a process that never joins the process group)."""
import json
import os
import socket
import sys

import pytest

from conftest import ROOT, check_invariants, config_of, dump_of, env_for_tests, fsdp2_launcher_run, read, \
    run_cli, run_folders

PROGS = os.path.join(ROOT, "tests", "progs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decompose_owners(folder) -> dict:
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        res = json.load(f)
    return {o: v["peak"] for o, v in res["devices"]["cpu"]["owners"].items()}


def _by_rank(out):
    """{rank: (folder, config)} of every run folder under ``out`` (rank None: not a rank)."""
    got = {}
    for f in run_folders(out):
        cfg = config_of(f)
        assert cfg["rank"] not in got, (f, got)
        got[cfg["rank"]] = (f, cfg)
        check_invariants(read(dump_of(f)))  # every dump, the parent's included
    return got


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory):
    """tests/progs/fsdp2_spawn.py under the launcher, with the options (and forced source) of the
    torchrun job of conftest.FSDP2_LAUNCHER, which runs the same training."""
    from conftest import FSDP2_LAUNCHER
    _, source, analysis = FSDP2_LAUNCHER
    out = tmp_path_factory.mktemp("spawn") / "out"
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    r = run_cli([f"--analysis={analysis}", "-q", "-o", str(out), sys.executable,
                 os.path.join(PROGS, "fsdp2_spawn.py"), str(_free_port())], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "spawned ranks done" in r.stdout
    return out


def test_spawned_ranks_are_ranks_of_one_job(spawn_run):
    runs = _by_rank(spawn_run)
    assert sorted(runs, key=str) == [0, 1, None], sorted(runs, key=str)  # two ranks and the parent
    for rank in (0, 1):
        folder, cfg = runs[rank]
        assert cfg["world_size"] == 2
        assert os.path.basename(folder) == f"msmemscope_{cfg['pid']}_{cfg['start_time']}_cpu_rank{rank}"
        assert "role" not in cfg
        # FSDP2's owner labels need the dispatch-mode source: handed over at init_process_group
        assert cfg["source"] == "native, then dispatch", cfg
        assert "FSDP2" in cfg["source_note"]
    folder, cfg = runs[None]  # the parent of mp.spawn: no rank, the original name
    assert cfg["world_size"] is None
    assert os.path.basename(folder) == f"msmemscope_{cfg['pid']}_{cfg['start_time']}_cpu"


def test_spawned_fsdp2_owners_are_those_under_torchrun(spawn_run, shared_run):
    tr_out, r = fsdp2_launcher_run(shared_run)
    assert r.returncode == 0, r.stderr[-3000:]
    spawned, torchrun = _by_rank(spawn_run), _by_rank(tr_out)
    assert sorted(torchrun) == [0, 1]
    for rank in (0, 1):
        want, got = _decompose_owners(torchrun[rank][0]), _decompose_owners(spawned[rank][0])
        assert "PTA@weight@fsdp2@unsharded" in got, got
        assert got == want, (rank, got, want)


def test_offline_commands_on_the_root_compare_the_ranks_only(spawn_run, tmp_path):
    js = tmp_path / "summary.json"
    r = run_cli(["summary", str(spawn_run), "--workers", "1", "--json", str(js)])
    assert r.returncode == 0, r.stderr
    s = json.loads(js.read_text())
    ranks = [x for x in s["ranks"] if x.get("rank") is not None]
    assert [x["label"] for x in ranks] == ["rank 0", "rank 1"]
    assert s["imbalance"]["label"] == "rank 1", s["imbalance"]  # its batch is 16x rank 0's
    assert s["imbalance"]["peak_allocated"] > s["imbalance"]["median"] > 0
    r = run_cli(["decompose", "--by=module", str(spawn_run)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("===== rank ") == 2, r.stdout
    assert "not a rank" in r.stderr  # the parent's folder is named, and left out
    r = run_cli(["decompose", "--json", str(spawn_run)])
    assert r.returncode == 0, r.stderr
    assert [x["rank"] for x in json.loads(r.stdout)["ranks"]] == [0, 1]


def test_python_api_in_spawned_ranks(tmp_path):
    """msmemscope.config/start inside the spawned function, no launcher: DDP, AdamW."""
    out = tmp_path / "out"
    r = __import__("subprocess").run([sys.executable, os.path.join(PROGS, "ddp_spawn_api.py"), str(out),
                                      str(_free_port())], env=env_for_tests(), capture_output=True, text=True,
                                     timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = _by_rank(out)
    assert sorted(runs, key=str) == [0, 1], runs  # the parent imports msmemscope but traces nothing
    for rank, (folder, cfg) in runs.items():
        assert cfg["world_size"] == 2
        assert os.path.basename(folder) == f"msmemscope_{cfg['pid']}_{cfg['start_time']}_cpu_rank{rank}"
        owners = _decompose_owners(folder)
        assert owners.get("PTA@weight", 0) > 0 and owners.get("PTA@optimizer_state", 0) > 0, owners
