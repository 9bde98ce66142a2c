"""Models that worker threads run: their owner labels and module rows (--analysis=decompose)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import ROOT, check_invariants, dump_of, read, run_cli, run_folders, source_env

PROG = os.path.join(ROOT, "tests", "progs", "threads_inference.py")


@pytest.mark.parametrize("source", ["native", "python"])
def test_models_of_worker_threads_own_their_weights(tmp_path, source):
    """Two worker threads each run a model of their own, each beginning its forward while the other
    is inside one, and end before the session does; the models outlive them. Each model's weights
    are weights in the decomposition and its parameters in the module table, to the byte of the
    program's own parameters. Before: the second thread's model was never the labeller's root (one
    count of forwards for all threads: a forward began while another thread's ran was no root),
    and a walk read only the models its own thread ran last, so the models of threads that had
    ended were walked by nobody: 0 B of weights, 31,552 B of temporaries "(outside modules)"."""
    out = tmp_path / "out"
    r = run_cli(["--analysis=decompose", "--output", str(out), sys.executable, PROG], env=source_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    models = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])["models"]
    (folder,) = run_folders(out)
    check_invariants(read(dump_of(folder)))
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        d = json.load(f)
    last = d["steps"][-1]["bytes"]
    assert last.get("PTA@weight") == sum(models.values()), last
    by = {m["module"]: m for m in d["modules"]["cpu"]["modules"]}
    for name, nbytes in models.items():
        assert by[name]["held"]["parameters"] == nbytes, (name, by[name])
    assert by.get("(outside modules)", {"held": {}})["held"].get("parameters", 0) == 0


@pytest.mark.parametrize("source", ["native", "python"])
def test_models_of_live_worker_threads_are_weights_at_the_main_threads_steps(tmp_path, source):
    """The main thread ends steps, with a stop/start gap among them, while two worker threads that
    trained (forward and backward, the gradients kept) are alive; then they end. At each step their
    models' parameters are weights, each in its own module's row, and at the end their gradients
    are gradients. Before: at the steps every byte was a temporary (a walk from the main thread
    read no model another live thread ran), and the gradients stayed temporaries in the end too:
    the labels learnt at the session's last flush (the threads had ended) were no OWNER rows, as
    nothing new was recorded any more."""
    out = tmp_path / "out"
    r = run_cli(["--analysis=decompose", "--output", str(out), sys.executable, PROG, "steps,gap,train"],
                env=source_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    said = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    params = sum(said["models"].values())
    (folder,) = run_folders(out)
    check_invariants(read(dump_of(folder)))
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        d = json.load(f)
    steps = {s["step"]: s["bytes"] for s in d["steps"] if s.get("step") is not None}
    assert sorted(steps) == list(range(1, said["steps"] + 1)), sorted(steps)
    for n, got in steps.items():
        assert got.get("PTA@weight") == params, (n, got)
    end = d["steps"][-1]["bytes"]
    assert end.get("PTA@weight") == params and end.get("PTA@gradient") == params, end
    by = {m["module"]: m for m in d["modules"]["cpu"]["modules"]}
    for name, nbytes in said["models"].items():
        assert by[name]["held"]["parameters"] == nbytes, (name, by[name])
