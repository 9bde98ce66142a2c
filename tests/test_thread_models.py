"""Models that worker threads run: their owner labels and module rows (--analysis=decompose)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import ROOT, check_invariants, dump_of, full, read, run_cli, run_folders, source_env

PROG = os.path.join(ROOT, "tests", "progs", "threads_inference.py")


@pytest.mark.parametrize("source", full(["python"], ["native", "python"]))  # (make test's time)
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


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))  # (make test's time)
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


WORKER_TRAINS = r"""
import sys, threading, torch, msmemscope
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(32, 64)
out, packed = [], [0]

def pack(t):
    packed[0] += 1
    return t

def train():
    for i in range(4):
        opt.zero_grad()
        if sys.argv[1] == "own-hooks" and i == 0:   # the program's own saved-tensor hooks, around
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):   # its first forward
                loss = m(x).square().mean()
            after = torch._C._autograd._top_saved_tensors_default_hooks(False)
            out.append("hooks after their context: " + ("none" if after is None else "some"))
        else:
            loss = m(x).square().mean()
        loss.backward()
        opt.step()
        out.append(loss.item().hex())

if sys.argv[1] == "main":
    train()
else:                                               # the whole training on a worker thread
    t = threading.Thread(target=train)
    t.start()
    t.join()
print("OUT", out, packed[0], flush=True)
"""


def _decomposed(tmp_path, source, how):
    prog = tmp_path / "worker_trains.py"
    prog.write_text(WORKER_TRAINS)
    out = tmp_path / how
    r = run_cli(["--analysis=decompose", "--output", str(out), sys.executable, str(prog), how], env=source_env(source))
    assert r.returncode == 0, r.stderr[-3000:]
    (folder,) = run_folders(out)
    check_invariants(read(dump_of(folder)))
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        steps = [(s["step"], s["peak"], s["bytes"]) for s in json.load(f)["steps"]]
    return r.stdout.split("OUT", 1)[1].strip(), steps


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))
def test_a_worker_threads_training_is_decomposed_as_the_main_threads(tmp_path, source):
    """The same training on a worker thread and on the main thread: each step's peak and end, by
    category, are the same, activations included (66,560 B: both ReLUs' outputs and the output
    that square() saves). Before: on a worker thread every saved tensor was ``ops`` (autograd's
    saved-tensor hooks are per thread; ours were only on the thread that started tracing). Where
    the program has its own saved-tensor hooks on the thread at its first forward, ours stay off
    there: its hooks see every saved tensor, and are off once its context ends."""
    said_main, main = _decomposed(tmp_path, source, "main")
    said_worker, worker = _decomposed(tmp_path, source, "worker")
    assert said_worker == said_main
    assert worker == main and len(main) == 5
    assert all(peak.get("PTA@activation") == 66560 for n, peak, _ in main if n is not None), main
    import subprocess
    prog = tmp_path / "worker_trains.py"
    plain = subprocess.run([sys.executable, str(prog), "own-hooks"], capture_output=True, text=True, timeout=300)
    said_own, _ = _decomposed(tmp_path, source, "own-hooks")
    assert said_own == plain.stdout.split("OUT", 1)[1].strip() and "hooks after their context: none" in said_own
