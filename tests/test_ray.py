"""Ray jobs: actors traced each into its own named folder, findings saved before Ray ends the
workers, and the cross-rank summary on Ray giving what the process pool gives.

Every Ray node here is local, on loopback, with 2 CPUs and no dashboard, and is shut down by the
test that started it (drivers call ray.shutdown() in a finally; the module's cluster has a
finalizer)."""
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import polars as pl
import pytest

from conftest import (FULL, ROOT, check_invariants, config_of, dump_of, env_for_tests, full, read, run_cli,
                      run_folders)

# read by Ray when it is imported: the nodes started here then use the loopback address
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'msmemscope[ray]')")

PROGS = os.path.join(ROOT, "tests", "progs")
STEPS = full(5, 12)
KEEP_BYTES = 16384 * 4


def _ray_env():
    env = env_for_tests()
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray then uses the loopback address for the node
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("RAY_ADDRESS", None)
    return env


def _left_running(out, wait_s=30.0):
    """Processes still alive that were started with tracing into ``out`` (Ray workers, raylets)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for env_file in glob.glob("/proc/[0-9]*/environ"):
            try:
                with open(env_file, "rb") as f:
                    if str(out).encode() in f.read():
                        alive.append(int(env_file.split("/")[2]))
            except OSError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _actors(out):
    got = {}
    for f in run_folders(out):
        cfg = config_of(f)
        if cfg.get("role") == "ray_actor":
            got[cfg["ray"]["actor_name"]] = (f, cfg)
    return got


def _check_actor_folders(out, pids):
    actors = _actors(out)
    assert sorted(actors) == ["leaky", "steady"], [config_of(f).get("ray") for f in run_folders(out)]
    jobs = {cfg["ray"]["job_id"] for _, cfg in actors.values()}
    assert len(jobs) == 1 and None not in jobs
    for name, (folder, cfg) in actors.items():
        r = cfg["ray"]
        assert cfg["pid"] == pids[name]  # the worker process that ran this actor
        assert os.path.basename(folder).startswith(f"msmemscope_{pids[name]}_")
        assert r["actor_class"] == "Trainer" and r["actor_id"] and r["worker_id"]
        assert r["node_id"] and r["node_ip"] == "127.0.0.1" and cfg["host"] == socket.gethostname()
        assert "Trainer.train" in r["tasks"]
        df = read(dump_of(folder))
        check_invariants(df)
        assert df.filter(pl.col("event_type") == "STEP").height == STEPS
    leaks = {}
    for name, (folder, _) in actors.items():
        files = sorted(os.listdir(os.path.join(folder, "analysis")))
        assert files == ["leaks.json", "peaks.json"], files  # one of each: no leaks_1.json
        with open(os.path.join(folder, "analysis", "leaks.json")) as f:
            leaks[name] = json.load(f)
    # the kept tensor of steps 2..STEPS-1 outlived a full step; the last one has not yet
    kept = [lk for lk in leaks["leaky"]["leaks"] if lk["size"] == KEEP_BYTES]
    assert sorted(lk["step"] for lk in kept) == list(range(2, STEPS))
    assert all("ones" in lk["op"] or "fill" in lk["op"] or "empty" in lk["op"] for lk in kept), kept
    assert leaks["steady"]["leaks"] == []
    return actors


# ---------------------------------------------------------------------------- under the launcher
def test_ray_actors_under_the_launcher(tmp_path):
    out = tmp_path / "out"
    r = run_cli(["-o", str(out), sys.executable, os.path.join(PROGS, "ray_two_actors.py"), str(STEPS)],
                env=_ray_env(), timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    pids = json.loads(r.stdout.strip().splitlines()[-1])
    assert _left_running(out) == []  # the driver's Ray node and its workers are gone
    actors = _check_actor_folders(out, pids)
    job = actors["leaky"][1]["ray"]["job_id"]
    # the driver imported torch too: its own folder, with the same job id
    drivers = [config_of(f) for f in run_folders(out) if config_of(f).get("role") == "ray_driver"]
    assert len(drivers) == 1 and drivers[0]["ray"]["job_id"] == job and drivers[0]["ray"]["actor_id"] is None
    # the task: a folder of its own, named by its task
    [(tf, task)] = [(f, config_of(f)) for f in run_folders(out) if config_of(f).get("role") == "ray_task"]
    assert task["pid"] == pids["probe"] and task["ray"]["job_id"] == job
    assert task["ray"]["tasks"] == ["probe"] and task["ray"]["actor_id"] is None
    tdf = read(dump_of(tf))
    check_invariants(tdf)
    # the Linear's weight and bias, allocated in the task and saved when it returned
    assert {16 * 16 * 4, 16 * 4} <= set(tdf.filter(pl.col("event") == "MALLOC")["size"].to_list())
    # the summary names the actors and finds the leak in the right one, from the saved results
    s_path = tmp_path / "s.json"
    r = run_cli(["summary", str(out), "--json", str(s_path)])
    assert r.returncode == 0, r.stderr
    s = json.loads(s_path.read_text())
    leaky = f"actor leaky (pid {pids['leaky']})"
    assert s["leaking"] == [leaky]
    by = {x["label"]: x for x in s["ranks"]}
    assert by[leaky]["source"] == "analysis" and by[f"actor steady (pid {pids['steady']})"]["source"] == "analysis"
    # the same verdict from the dumps themselves
    from msmemscope.report.summary import build
    d = json.loads(json.dumps(build(str(out), workers=1, show_progress=False, from_dumps=True), default=str))
    assert d["leaking"] == [leaky]
    for x in d["ranks"]:
        y = by[x["label"]]
        assert x["source"] == "dump"
        assert (x["peaks"], x["steps"]) == (y["peaks"], y["steps"])
        assert {k: x["leaks"][k] for k in ("count", "bytes", "steps", "signatures")} == \
               {k: y["leaks"][k] for k in ("count", "bytes", "steps", "signatures")}


# ---------------------------------------------------------------------------- findings saved at step ends
KILLED = """
import os, signal, torch
m = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
kept = []
for i in range({steps}):
    m(torch.randn(8, 32)).sum().backward()
    opt.step(); opt.zero_grad()
    kept.append(torch.ones(4096))
{end}
"""


@pytest.mark.parametrize("source", ["native", "python"])
def test_findings_survive_sigkill(tmp_path, source):
    """A process killed without its exit handlers still leaves what its analyses had found, in the
    final result's format; a normal exit replaces that file (one leaks.json, never a second)."""
    results = {}
    if source == "python" and not FULL:
        pytest.skip("the dispatch-mode source: the long form only (MSMEMSCOPE_TEST_FULL=1)")
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    # findings saved at every step end: killed right after its last step, the program keeps them
    # all (step boundaries that share a flush keep those of the last flush: tests/test_step_flush.py)
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"
    procs = {}
    for how, end in (("killed", "os.kill(os.getpid(), signal.SIGKILL)"), ("normal", "")):
        prog = tmp_path / f"{how}.py"
        prog.write_text(KILLED.format(steps=6, end=end))
        procs[how] = subprocess.Popen([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / how),
                                       sys.executable, str(prog)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)  # both at once: half the wall time
    for how, p in procs.items():
        try:
            _, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == (128 + signal.SIGKILL if how == "killed" else 0), err
    for how in procs:
        out = tmp_path / how
        [folder] = run_folders(out)
        assert sorted(os.listdir(os.path.join(folder, "analysis"))) == ["leaks.json", "peaks.json"]
        check_invariants(read(dump_of(folder)))
        with open(os.path.join(folder, "analysis", "leaks.json")) as f:
            results[how] = json.load(f)
        with open(os.path.join(folder, "analysis", "peaks.json")) as f:
            peaks = json.load(f)
        assert peaks["final"] is (how == "normal")
        df = read(dump_of(folder))
        mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
        if how == "normal":
            assert peaks["peaks"][0]["peak_allocated"] == mem["used"].max()
        else:  # saved at some step end (peaks alone may wait for the save budget): the peak up to it
            cummax = df.select("id", "event", "event_type", pl.col("used").cum_max().forward_fill())
            at_steps = set(cummax.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))["used"])
            assert peaks["peaks"][0]["peak_allocated"] in at_steps, (peaks, sorted(at_steps))
    k, n = results["killed"], results["normal"]
    assert k["analysis"] == "leaks" and k["steps_ended"] == 6
    assert [lk["step"] for lk in k["leaks"] if lk["size"] == 4096 * 4] == [2, 3, 4, 5]
    assert set(k) == set(n)  # the final file's format
    assert [(lk["step"], lk["size"], lk["op"]) for lk in k["leaks"]] == \
           [(lk["step"], lk["size"], lk["op"]) for lk in n["leaks"]]


# ---------------------------------------------------------------------------- a cluster the user started
@pytest.fixture(scope="module")
def cluster(request):
    """A local Ray node for this module (this process is its driver), shut down at the end."""
    env = _ray_env()
    saved = {k: os.environ.get(k) for k in ("RAY_USAGE_STATS_ENABLED",)}
    os.environ.update({k: env[k] for k in saved})

    def stop():
        try:
            ray.shutdown()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    request.addfinalizer(stop)
    for attempt in (1, 2):  # Ray waits 30 s at most for its raylet: a loaded machine may need a second go
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": env["PYTHONPATH"], "POLARS_MAX_THREADS": "1"}})
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    return ray.get_runtime_context().gcs_address


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): the launcher test above runs the same "
                    "actors traced, and ray_runtime_env() is checked without a cluster below")
def test_ray_runtime_env_on_a_running_cluster(cluster, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(PROGS, "ray_two_actors.py"), str(STEPS), cluster, str(out), ROOT],
                       env=_ray_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    pids = json.loads(r.stdout.strip().splitlines()[-1])
    assert _left_running(out) == []  # the job's workers ended with it
    actors = _check_actor_folders(out, pids)
    # the actors set RANK themselves (after torch was imported): config.json has it, the summary names both
    assert {n: (c["rank"], c["world_size"]) for n, (_, c) in actors.items()} == {"steady": (0, 2), "leaky": (1, 2)}
    from msmemscope.report.summary import build
    s = build(str(out), workers=1, show_progress=False)
    assert [r["label"] for r in s["ranks"]] == ["rank 0 actor steady", "rank 1 actor leaky"]
    assert s["leaking"] == ["rank 1 actor leaky"]
    assert not [f for f in run_folders(out) if config_of(f).get("role") == "ray_driver"]  # the driver is not traced


def test_ray_runtime_env_merges_and_refuses():
    import msmemscope
    env = msmemscope.ray_runtime_env(output="/tmp/x", analysis="leaks,decompose",
                                     runtime_env={"env_vars": {"A": "1"}, "pip": ["x"],
                                                  "worker_process_setup_hook": "mypkg.setup"})
    assert env["pip"] == ["x"] and env["env_vars"]["A"] == "1"
    assert env["worker_process_setup_hook"] == "msmemscope._bootstrap.ray_setup.worker_setup"
    assert env["env_vars"]["MSMEMSCOPE_RAY_CHAINED_HOOK"] == "mypkg.setup"
    opts = json.loads(env["env_vars"]["MSMEMSCOPE_OPTIONS"])
    assert opts["output"] == "/tmp/x" and list(opts["analysis"]) == ["leaks", "decompose"]
    assert opts["collect_mode"] == "immediate"
    with pytest.raises(msmemscope.OptionError):
        msmemscope.ray_runtime_env(analysis="bogus")
    with pytest.raises(ValueError):
        msmemscope.ray_runtime_env(runtime_env={"worker_process_setup_hook": print})


# ---------------------------------------------------------------------------- summary --engine=ray
def _bench():
    import importlib.util
    spec = importlib.util.spec_from_file_location("summary_bench", os.path.join(ROOT, "bench", "summary_bench.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _job_on_this_host(root, n=6):
    """Synthetic ranks on this host: half with their online results, half with the dump only."""
    b = _bench()
    for rank in range(n):
        folder = b.write_rank(str(root), rank, n, 3000, scale=1.5 if rank == 4 else 1.0, leak=(rank == 1),
                              results=rank % 2 == 0)
        cfg = config_of(folder)
        cfg["host"] = socket.gethostname()
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)


def _strip(s):
    return [{k: v for k, v in r.items() if k not in ("seconds", "cpu_seconds")} for r in s["ranks"]]


LONG_CLUSTER = pytest.mark.skipif(not FULL, reason="long form only (make test-full): a second Ray node in make test "
                                  "(the launcher test starts one) costs more than the suite's time allows")


@LONG_CLUSTER
def test_summary_engine_ray_same_as_pool(cluster, tmp_path):
    from msmemscope.report.summary import build
    root = tmp_path / "job"
    _job_on_this_host(root)
    pool = build(str(root), workers=2, show_progress=False)
    on_ray = build(str(root), engine="ray", show_progress=False)
    assert _strip(on_ray) == _strip(pool)
    assert on_ray["leaking"] == pool["leaking"] == ["rank 1"]
    assert on_ray["imbalance"] == pool["imbalance"] and pool["imbalance"]["label"] == "rank 4"
    assert [r["source"] for r in pool["ranks"]] == ["analysis", "dump"] * 3
    tm = on_ray["timing"]
    assert tm["engine"] == "ray" and not tm["started_ray"]
    assert tm["ranks_per_node"] == {ray.get_runtime_context().get_node_id(): 6}  # ranks: on the node holding them
    # the command line, joining the cluster by its address: the same JSON
    r = run_cli(["summary", str(root), "--engine=ray", "--ray-address", cluster, "--json", str(tmp_path / "r.json")],
                env=_ray_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cli = json.loads((tmp_path / "r.json").read_text())
    assert _strip(cli) == json.loads(json.dumps(_strip(pool), default=str))
    assert "as Ray tasks on 1 node(s)" in r.stdout


@LONG_CLUSTER
def test_summary_engine_ray_unknown_host_is_an_error_for_that_rank(cluster, tmp_path):
    """Two nodes' folders copied side by side, one of them on no node of the cluster: that rank
    says which host it needs; the others are summarised."""
    from msmemscope.report.summary import analyse_on_ray
    root = tmp_path / "job"
    _job_on_this_host(root, n=2)
    folders = run_folders(root)
    jobs = []
    for i, f in enumerate(folders):
        cfg = config_of(f)
        jobs.append({"path": dump_of(f), "folder": f, "config": {**cfg, "host": "elsewhere" if i else cfg["host"]},
                     "label": f"rank {i}"})
    if FULL:  # one live node: its folders are all read there, whatever the hosts say
        res, _ = analyse_on_ray(jobs, show_progress=False)
        assert all("error" not in r for r in res)
    from unittest import mock
    from msmemscope.report import summary
    here = ray.get_runtime_context().get_node_id()
    with mock.patch.object(summary, "_ray_node_cpus", return_value={socket.gethostname(): (here, 2),
                                                                    "other": ("f" * 56, 2)}):
        res, _ = analyse_on_ray(jobs, show_progress=False)
    assert "error" not in res[0] and "'elsewhere'" in res[1]["error"]


def test_summary_engine_bad_values(tmp_path):
    r = run_cli(["summary", str(tmp_path), "--engine=spark"])
    assert r.returncode == 2 and r.stderr.startswith("msmemscope: error: --engine") and "Traceback" not in r.stderr
    r = run_cli(["summary", str(tmp_path), "--ray-address", "127.0.0.1:1"])
    assert r.returncode == 2 and "--engine=ray" in r.stderr
