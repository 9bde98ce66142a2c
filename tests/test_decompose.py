"""Memory decomposition (issue 6, SPEC §4.4): real training runs through the CLI.

The identities checked at every step end come from the model itself: weight bytes
are the parameters' plus buffers', gradients the parameters', Adam state twice the
parameters plus one 4-byte step counter per parameter, SGD momentum once the parameters."""
from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from conftest import EXAMPLES, FULL, ROOT, check_invariants, dump_of, full, read, run_cli, run_folders

PROGS = os.path.join(os.path.dirname(__file__), "progs")


def run_decompose(out_dir, *args):
    r = run_cli(["--analysis=decompose", "--output", str(out_dir), *args])
    assert r.returncode == 0, r.stderr[-3000:]
    (folder,) = run_folders(out_dir)
    (js,) = glob.glob(os.path.join(folder, "analysis", "decompose.json"))
    with open(js) as f:
        res = json.load(f)
    df = read(dump_of(folder))
    check_invariants(df)
    return r, res, df


def category(owner):
    return owner.split("@")[1]


def step_ends(res, device="cpu"):
    """step -> {category: bytes} at each step end."""
    out = {}
    for s in res["steps"]:
        if s["device"] == device and s["step"] is not None:
            cats = {}
            for o, n in s["bytes"].items():
                cats[category(o)] = cats.get(category(o), 0) + n
            out[s["step"]] = cats
    return out


def activation_timeline(df):
    """Per step: (peak activation bytes, row index of the peak, row index of the first backward op,
    activation bytes at the step end)."""
    live, act, out = {}, 0, {}
    peak, peak_at, first_bw = 0, None, None
    for i, (ev, et, name, aid, size, owner, step) in enumerate(df.select(
            "event", "event_type", "name", "alloc_id", "size", "owner", "step").iter_rows()):
        if ev == "MALLOC":
            live[aid] = (size, owner)
            if category(owner) == "activation":
                act += size
                if act > peak:
                    peak, peak_at = act, i
        elif ev == "FREE":
            size, owner = live.pop(aid)
            if category(owner) == "activation":
                act -= size
        elif ev == "SYSTEM" and et == "OWNER":
            size, old = live[aid]
            act += size * ((category(owner) == "activation") - (category(old) == "activation"))
            live[aid] = (size, owner)
        elif ev == "OP_LAUNCH" and et == "ATEN_START" and first_bw is None and "backward" in name:
            first_bw = i
        elif ev == "SYSTEM" and et == "STEP":
            out[step] = (peak, peak_at, first_bw, act)
            peak, peak_at, first_bw = 0, None, None
    return out


def check_identities(res, df, weight, grad, opt, nsteps):
    ends = step_ends(res)
    assert sorted(ends) == list(range(1, nsteps + 1))
    for step, cats in ends.items():
        assert cats.get("weight") == weight, (step, cats)
        assert cats.get("gradient") == grad, (step, cats)
        assert cats.get("optimizer_state") == opt, (step, cats)
        assert cats.get("activation", 0) == 0, (step, cats)
    acts = activation_timeline(df)
    for step in range(1, nsteps + 1):
        peak, peak_at, first_bw, at_end = acts[step]
        assert peak > 0, step
        assert first_bw is not None and peak_at < first_bw, (step, peak_at, first_bw)
        assert at_end == 0
    # every MALLOC row is labelled
    owners = df.filter(df["event"] == "MALLOC")["owner"].to_list()
    assert owners and all(o and o.startswith("PTA@") for o in owners), set(owners)
    # the offline summary from the dump is the online one
    from msmemscope.analysis.decompose import summarize
    off = json.loads(json.dumps(summarize(df)))
    assert off["devices"] == res["devices"]
    assert off["steps"] == res["steps"]


def model_sizes(model):
    params = list(model.parameters())
    p = sum(x.numel() * x.element_size() for x in params)
    b = sum(x.numel() * x.element_size() for x in model.buffers())
    return p, b, len(params)


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test decomposes GPT-2 with AdamW and the MLP with SGD to the byte")
def test_transformer_adamw(out_dir):
    sys.path.insert(0, ROOT)
    from examples.transformer import GPT
    p, b, n = model_sizes(GPT(layers=1))
    r, res, df = run_decompose(out_dir, os.path.join(EXAMPLES, "transformer.py"), "--steps", "3", "--layers", "1")
    check_identities(res, df, weight=p + b, grad=p, opt=2 * p + 4 * n, nsteps=3)
    assert "memory decomposition" in r.stderr and "PTA@optimizer_state" in r.stderr
    # per-step view: optimizer state and gradients appear in step 1, nothing of theirs grows later
    grew = {s["step"]: s["grew"] for s in res["steps"]}
    assert grew[1]["PTA@optimizer_state"] == 2 * p + 4 * n and grew[1]["PTA@gradient"] == p
    assert "PTA@optimizer_state" not in grew[2] and "PTA@weight" not in grew[3]
    # peaks: activations are the largest transient owner, and their peak is seen in the step view
    dev = res["devices"]["cpu"]
    assert dev["categories"]["activation"]["peak"] == max(s["peak"].get("PTA@activation", 0) for s in res["steps"])
    assert dev["owners"]["PTA@weight"]["peak"] == p + b


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """The MLP example (SGD with momentum), 3 steps, online decompose: (output root, result, frame);
    checked here and read again offline by test_offline_cli_summary."""
    out = tmp_path_factory.mktemp("mlp_decompose")
    _, res, df = run_decompose(out, os.path.join(EXAMPLES, "mlp.py"), "--steps", "3")
    return out, res, df


def test_mlp_sgd_momentum(mlp_run):
    from torch import nn
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    p, b, n = model_sizes(model)
    _, res, df = mlp_run
    check_identities(res, df, weight=p + b, grad=p, opt=p, nsteps=3)


def test_gpt2_adamw(out_dir):
    pytest.importorskip("transformers")
    r, res, df = run_decompose(out_dir, os.path.join(PROGS, "decompose_gpt2.py"), "3")
    truth = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    p, n = truth["param_numel_bytes"], truth["n_params"]
    assert truth["state_bytes"] == 2 * p + 4 * n
    check_identities(res, df, weight=p + truth["buffer_bytes"], grad=p, opt=2 * p + 4 * n, nsteps=3)


def test_user_labels(out_dir):
    r, res, df = run_decompose(out_dir, os.path.join(PROGS, "decompose_labels.py"))
    refused = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])["refused"]
    assert "at most 3" in refused and "'fourth'" in refused and "\n" not in refused
    m = df.filter(df["event"] == "MALLOC")
    by_size = {}
    for size, owner, name in m.select("size", "owner", "name").iter_rows():
        by_size.setdefault(size, []).append((owner, name))
    # decorated function: torch.ones(1000, 3)
    assert ("PTA@ops@loader", "torch._ops.aten.ones.default") in by_size[12000]
    # with block, explicit __enter__/__exit__ on new instances, nesting outermost first
    assert by_size[8000] == [("PTA@ops@outer", "torch._ops.aten.zeros.default")]
    assert ("PTA@ops@outer@loader", "torch._ops.aten.zeros.default") in by_size[12000]
    assert by_size[16000] == [("PTA@ops@outer", "torch._ops.aten.zeros.default")]
    # labelled after creation, row still buffered: the MALLOC row carries it
    assert by_size[20000] == [("PTA@ops@late", "torch._ops.aten.full.default")]
    # labelled after its row was written: an OWNER row, which the summary follows
    (aid,) = df.filter((df["event"] == "MALLOC") & (df["size"] == 6000))["alloc_id"].to_list()
    upd = df.filter((df["event"] == "SYSTEM") & (df["event_type"] == "OWNER") & (df["alloc_id"] == aid))
    assert upd["owner"].to_list() == ["PTA@ops@late"]
    assert res["devices"]["cpu"]["owners"]["PTA@ops@late"]["peak"] == 26000
    # labels outside the decorated / with scopes are not applied
    assert all("@outer" not in o for o, n in by_size.get(6000, []))


@pytest.mark.parametrize("bad, why", [("@x", "must not start with '@'"), ("x" * 129, "at most 128"),
                                      ("", "must not be empty"), ("a,b", "not allowed")])
def test_bad_labels_are_refused(bad, why):
    from msmemscope.describe import describer
    with pytest.raises(ValueError) as e:
        describer(owner=bad)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_offline_cli_summary(mlp_run, tmp_path):
    out_dir, res, df = mlp_run
    (folder,) = run_folders(out_dir)
    out = tmp_path / "d.json"
    r = run_cli.__globals__["subprocess"].run(
        [sys.executable, "-c", "import sys; from msmemscope.analysis.decompose import main; "
                               "sys.exit(main(sys.argv[1:]))", dump_of(folder), "-o", str(out)],
        capture_output=True, text=True, env=run_cli.__globals__["env_for_tests"]())
    assert r.returncode == 0, r.stderr
    assert "PTA@weight" in r.stdout
    assert json.loads(out.read_text())["devices"] == res["devices"]
    r = run_cli.__globals__["subprocess"].run(
        [sys.executable, "-c", "import sys; from msmemscope.analysis.decompose import main; "
                               "sys.exit(main(sys.argv[1:]))", str(tmp_path / "missing.csv")],
        capture_output=True, text=True, env=run_cli.__globals__["env_for_tests"]())
    assert r.returncode == 2 and r.stderr.startswith("msmemscope: error:")


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): FSDP2 under the launcher runs in make test "
                    "with decompose (test_combinations), and with the hooks (test_hooks)")
def test_fsdp2_two_ranks(out_dir):
    import shutil
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed")
    env = run_cli.__globals__["env_for_tests"]()
    env["PATH"] = os.path.dirname(torchrun) + os.pathsep + env.get("PATH", "")
    r = run_cli(["--analysis=decompose", "--output", str(out_dir), "torchrun", "--standalone",
                 "--nproc_per_node=2", os.path.join(PROGS, "decompose_fsdp2.py")], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    truths = {t["rank"]: t for t in (json.loads(ln) for ln in
                                     r.stdout.replace("}{", "}\n{").splitlines() if ln.startswith("{"))}
    folders = run_folders(out_dir)
    assert len(folders) == 2 and sorted(truths) == [0, 1]
    from msmemscope.analysis.decompose import summarize
    for folder in folders:
        rank = json.load(open(os.path.join(folder, "config.json")))["rank"]
        t = truths[rank]
        local, n = t["local_bytes"], t["n_params"]
        assert 2 * local == t["full_bytes"]  # the layers shard evenly: no padding
        with open(os.path.join(folder, "analysis", "decompose.json")) as f:
            res = json.load(f)
        df = read(dump_of(folder))
        check_invariants(df)  # resize_(0) / resize_(n) of unsharded parameters are FREE / MALLOC
        assert df.filter(df["name"] == "UntypedStorage.resize_").height > 0
        ends = [s for s in res["steps"] if s["step"] is not None]
        assert [s["step"] for s in ends] == [1, 2, 3]
        for s in ends:
            b = s["bytes"]
            assert b["PTA@weight@fsdp2@sharded"] == local, (rank, b)
            assert b["PTA@gradient@fsdp2@sharded"] == local, (rank, b)
            assert b["PTA@optimizer_state"] == 2 * local + 4 * n, (rank, b)
            # unsharded (all-gathered) parameters and gradients exist only inside the step
            assert b.get("PTA@weight@fsdp2@unsharded", 0) == 0 and b.get("PTA@gradient@fsdp2@unsharded", 0) == 0
            assert s["peak"]["PTA@weight@fsdp2@unsharded"] > 0 and s["peak"]["PTA@gradient@fsdp2@unsharded"] > 0
            assert s["peak"]["PTA@ops@fsdp2@all_gather"] > 0
        owners = res["devices"]["cpu"]["owners"]
        # an all-gathered layer holds the whole layer: the biggest Linear (128x128 + 128 floats)
        assert owners["PTA@weight@fsdp2@unsharded"]["peak"] >= (128 * 128 + 128) * 4
        assert json.loads(json.dumps(summarize(df)))["devices"] == res["devices"]
        # module attribution through FSDP2 (issue 25): every Linear's forward and backward are seen,
        # its sharded and all-gathered parameters are its own, and the optimizer state adds up
        table = {r["module"]: r for r in res["modules"]["cpu"]["modules"]}
        assert "FSDPSequential" in table  # fully_shard makes the class FSDP<name> (MemTracker names it so too)
        for i, full_layer in ((0, (64 * 128 + 128) * 4), (2, (128 * 128 + 128) * 4), (4, (128 * 8 + 8) * 4)):
            r = table[f"FSDPSequential.{i}"]
            assert r["forward_peak"] and r["backward_peak"], r
            assert r["held"]["parameters"] >= full_layer, r  # the all-gathered layer, while unsharded
        assert table["FSDPSequential"]["held"]["optimizer_state"] == 2 * local + 4 * n, table["FSDPSequential"]
        mal = df.filter(df["event"] == "MALLOC")
        assert mal.filter(mal["attr"].str.contains('"phase":"backward"', literal=True)).height > 0


def test_owner_rows_after_mid_step_flush(out_dir):
    import subprocess
    env = run_cli.__globals__["env_for_tests"]()
    r = subprocess.run([sys.executable, os.path.join(PROGS, "decompose_small_flush.py"), str(out_dir)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    truth = json.loads(r.stdout.strip().splitlines()[-1])
    (folder,) = run_folders(out_dir)
    df = read(dump_of(folder))
    check_invariants(df)
    assert df.filter(df["event_type"] == "OWNER").height > 0
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        res = json.load(f)
    p, n = truth["param_bytes"], truth["n_params"]
    ends = step_ends(res)
    assert sorted(ends) == [1, 2, 3]
    for cats in ends.values():
        assert (cats["weight"], cats["gradient"], cats["optimizer_state"]) == (p, p, 2 * p + 4 * n)
    from msmemscope.analysis.decompose import summarize
    assert json.loads(json.dumps(summarize(df)))["steps"] == res["steps"]


DROP_AND_SWAP = r"""
import gc, sys, weakref, torch, msmemscope
from torch import nn
if sys.argv[2] == "flush":
    from msmemscope.capture import session
    session.FLUSH_ROWS = 25            # flushes inside every step: MALLOC rows written before the step ends
msmemscope.config(output=sys.argv[1], collect_mode="immediate", analysis="leaks,decompose")
torch.manual_seed(0)
x = torch.randn(16, 32)

def fit(m, steps):
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        m(x).sum().backward()
        opt.step()
    return opt

a = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = fit(a, 4)
wa, wo = weakref.ref(a), weakref.ref(opt)
del a, opt
gc.collect()
print("FREED", wa() is None and wo() is None)
b = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
opt = fit(b, 3)
del opt
if sys.argv[2] == "made-in-gap":
    msmemscope.stop()                  # its blocks made while stopped: counted when first met after start()
bn = nn.BatchNorm1d(8)
if sys.argv[2] == "gap":
    msmemscope.stop()                  # registered while stopped: no hook sees it, start() walks anew
b.append(bn)                           # a module registered mid-run: its buffers are weights now
if sys.argv[2] in ("gap", "made-in-gap"):
    msmemscope.start()
opt = fit(b, 3)
msmemscope.stop()
"""


# the short form: each gap once, the sources taking turns (make test's time)
@pytest.mark.parametrize("source,gap", full([("native", "made-in-gap"), ("python", "flush")],  # (make test's time)
                                            [(s, g) for s in ("native", "python") for g in ("", "gap", "made-in-gap", "flush")]))
def test_the_walks_keep_no_model_and_see_an_appended_module(tmp_path, source, gap):
    """The owner labels' walks keep each model's module tree between step ends (weak references,
    walked again when a module is registered anywhere). A model and optimizer the program drops
    are freed while tracing goes on (the tracer holds neither). A module appended mid-run is
    walked from the next step end: its buffers (reached only through the module tree, not the
    optimizer) are weights, also when it is registered while tracing is stopped (``gap``: no hook
    then; ``start()`` walks the trees anew), also when it was made then (``made-in-gap``: the native
    source's allocator wrapper stays through the gap, so its blocks are counted when a traced op
    first reads them, as the dispatch-mode source does), and when flushes inside each step
    (``flush``) wrote the
    MALLOC rows before the labels were known (OWNER rows then). Each step end's weights, gradients
    and optimizer state are the models' parameters and buffers, to the byte, and so are the
    appended module's in the per-module table, under its ``named_modules()`` name."""
    import subprocess
    prog = tmp_path / "prog.py"
    prog.write_text(DROP_AND_SWAP)
    env = dict(os.environ, MSMEMSCOPE_SOURCE=source)
    r = subprocess.run([sys.executable, str(prog), str(tmp_path / "o"), gap or "-"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FREED True" in r.stdout, r.stdout
    (folder,) = run_folders(tmp_path / "o")
    check_invariants(read(dump_of(folder)))
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        ends = step_ends(json.load(f))
    first_b = (32 * 16 + 16 + 16 * 8 + 8) * 4
    bn = 2 * 8 * 4                      # BatchNorm1d(8): weight and bias; running mean and var the same
    assert ends[4]["weight"] == (32 * 64 + 64 + 64 * 8 + 8) * 4
    for k in (5, 6, 7):
        assert (ends[k]["weight"], ends[k]["gradient"], ends[k]["optimizer_state"]) == (first_b,) * 3, (k, ends[k])
    for k in (8, 9, 10):  # + num_batches_tracked, an int64
        assert (ends[k]["weight"], ends[k]["gradient"], ends[k]["optimizer_state"]) == \
            (first_b + 2 * bn + 8, first_b + bn, first_b + bn), (k, ends[k])
    # per module: the appended BatchNorm under the name named_modules() gives it, its parameters
    # and buffers there (made before a gap: their OWNER rows carry the module), not outside modules
    from msmemscope.analysis.decompose import EVENTS, MODULE_COLUMNS_READ, module_table
    from msmemscope.io.reader import read_dump
    for k in (8, 9, 10):
        rows = {r["module"]: r for r in module_table(read_dump(dump_of(folder), columns=MODULE_COLUMNS_READ,
                                                               events=EVENTS), k)["cpu"]["modules"]}
        assert not any(name.endswith("BatchNorm1d") for name in rows), sorted(rows)
        held = rows["Sequential.3"]["held"]
        assert (held["parameters"], held["gradients"], held["optimizer_state"]) == (2 * bn + 8, bn, bn), (k, held)
        assert rows["(outside modules)"]["held"]["parameters"] == 0, (k, rows["(outside modules)"])
        assert sum(r["held"]["parameters"] for r in rows.values() if r["depth"] == 2) == first_b + 2 * bn + 8


@pytest.mark.parametrize("source", full(["python"], ["native", "python"]))  # (make test's time)
def test_owner_rows_kept_for_module_attribution_do_not_pile_up_without_it(tmp_path, source):
    """The labeller keeps each OWNER row's attr until module attribution gives it a module; with
    module attribution off (MSMEMSCOPE_MODULES=0) the flushes still let go of them: a run whose
    every step writes OWNER rows (flushes inside each step) holds at most a step's worth."""
    import subprocess
    prog = tmp_path / "prog.py"
    prog.write_text(DROP_AND_SWAP.replace("msmemscope.stop()\n", "") + r"""
from msmemscope import capture
s = capture.current()
for _ in range(20):
    fit(b, 1)
print("HELD", len(s.labeler.unattributed), "UPDATES", s.labeler.updates, "MODULES", s.modules is not None)
msmemscope.stop()
""")
    env = dict(os.environ, MSMEMSCOPE_SOURCE=source, MSMEMSCOPE_MODULES="0")
    r = subprocess.run([sys.executable, str(prog), str(tmp_path / "o"), "flush"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    held, updates, modules = r.stdout.split("HELD", 1)[1].split()[0::2]
    assert modules == "False"
    assert int(updates) > 40, r.stdout  # OWNER rows every step
    assert int(held) <= 10, r.stdout
    (folder,) = run_folders(tmp_path / "o")
    check_invariants(read(dump_of(folder)))


FIRST_SIGHT = """
import sys, torch
from torch import nn
import msmemscope
from msmemscope.describe import describer
torch.manual_seed(0)
model = nn.Linear(32, 8)                 # made before tracing: first seen by the forward's ops
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 32)
msmemscope.config(analysis="decompose", output=sys.argv[1])
msmemscope.start()
for s in range(3):
    opt.zero_grad()
    with describer(owner="fwd"):
        out = model(x)                   # its output is allocated under the label
    out.square().mean().backward()
    opt.step()
    msmemscope.step()
msmemscope.stop()
print(out.shape[0] * out.shape[1] * 4)
"""


@pytest.mark.parametrize("source", full(["python"], ["native", "python"]))  # (make test's time)
def test_a_label_tags_the_blocks_first_seen_under_it(tmp_path, source):
    """The original's docs tag "every memory allocation event in the block" (its decompose example
    makes the model and batch before start() and trains under one describer): blocks made before
    start() and first met as an op's input inside a ``describer`` block get their MALLOC row there
    (origin before_op), and that row carries the label, as the forward's own output does; the
    category stays theirs (weight, ops)."""
    import polars as pl
    prog = tmp_path / "prog.py"
    prog.write_text(FIRST_SIGHT)
    env = dict(os.environ, MSMEMSCOPE_SOURCE=source)
    r = __import__("subprocess").run([sys.executable, str(prog), str(tmp_path / "out")], env=env,
                                     capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out_bytes = int(r.stdout.split()[-1])
    folder, = run_folders(tmp_path / "out")
    df = read(dump_of(folder))
    check_invariants(df)
    m = df.filter(pl.col("event") == "MALLOC")
    seen = m.filter(pl.col("attr").str.contains("before_op"))
    # the weight (32x8), the bias (8) and x (16x32): first seen inside the labelled forward
    assert sorted(seen["size"].to_list()) == [32, 8 * 32 * 4, 16 * 32 * 4], seen.select("size", "owner")
    assert set(seen.filter(pl.col("size") != 16 * 32 * 4)["owner"].to_list()) == {"PTA@weight@fwd"}
    assert seen.filter(pl.col("size") == 16 * 32 * 4)["owner"].to_list() == ["PTA@ops@fwd"]
    labelled = m.filter(pl.col("owner").str.contains("@fwd"))
    assert out_bytes in labelled["size"].to_list()
    # what the backward and the optimizer allocate, outside the block, is not labelled
    assert m.filter(~pl.col("owner").str.contains("@fwd")).height > 0



UNICODE = """
import torch
from torch import nn
from msmemscope import describe
torch.manual_seed(0)
net = nn.Sequential()
net.add_module("模块", nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(4, 8)
for step in range(3):
    opt.zero_grad()
    with describe.describer(owner="标签"):
        y = net(x)
    y.sum().backward()
    opt.step()
"""


@pytest.mark.parametrize("fmt", full(["csv"], ["csv", "db"]))
def test_labels_and_module_names_beyond_ascii_read_back_as_written(tmp_path, fmt):
    """A user label and a module name beyond ASCII: Attr's JSON writes them as escapes; the offline
    decomposition, module table and leaks read them back as the program wrote them, as the online
    analyses saw them (they read '\\\\u6807\\\\u7b7e', a second owner beside the online one)."""
    from msmemscope.analysis import leaks as L
    from msmemscope.analysis.decompose import EVENTS, MODULE_COLUMNS_READ, module_table, summarize
    from msmemscope.io.reader import read_dump
    prog = tmp_path / "uni.py"
    prog.write_text(UNICODE, encoding="utf-8")
    out = tmp_path / "out"
    r = run_cli([f"--data-format={fmt}", "--analysis=leaks,decompose", "-o", str(out), sys.executable, str(prog)])
    assert r.returncode == 0, r.stderr[-3000:]
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    with open(os.path.join(folder, "analysis", "decompose.json"), encoding="utf-8") as f:
        res = json.load(f)
    assert "PTA@ops@标签" in res["devices"]["cpu"]["owners"], res["devices"]
    off = json.loads(json.dumps(summarize(df)))
    assert (off["devices"], off["steps"]) == (res["devices"], res["steps"])
    mods = json.loads(json.dumps(module_table(read_dump(dump_of(folder), columns=MODULE_COLUMNS_READ, events=EVENTS))))
    assert mods == res["modules"] and any(m["module"] == "Sequential.模块" for m in mods["cpu"]["modules"]), mods
    assert "PTA@ops@标签" in set(df["owner"].cast(str))
    with open(os.path.join(folder, "analysis", "leaks.json"), encoding="utf-8") as f:
        online = json.load(f)
    (offline,) = L.analyze(folder)
    assert offline["summary"] == online["summary"]



@pytest.mark.parametrize("source", ["native", "python"])
def test_a_user_label_on_a_parameter_keeps_its_category(tmp_path, source):
    """``describer(param, owner=...)`` after each optimizer step: the weight stays
    ``PTA@weight@late``, with one OWNER row (before: each call composed it without its category,
    ``ops``, so the OWNER rows flipped ops/weight every step and the decomposition showed a
    phantom ``PTA@ops@late`` moving back and forth)."""
    import polars as pl
    from conftest import source_env
    prog = tmp_path / "p.py"
    prog.write_text("import torch, msmemscope\nimport msmemscope.describe as describe\n"
                    "m = torch.nn.Linear(32, 32); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                    "for s in range(4):\n"
                    "    m(torch.randn(4, 32)).sum().backward(); opt.step(); opt.zero_grad()\n"
                    "    describe.describer(m.weight, owner='late')\n"
                    "print('ok')\n")
    import subprocess
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / "o"), "--analysis=decompose",
                        sys.executable, str(prog)], env=source_env(source), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    [folder] = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    owners = df.filter(pl.col("event_type") == "OWNER")["attr"].to_list()
    assert len(owners) == 1 and '"owner":"PTA@weight@late"' in owners[0].replace(" ", ""), owners
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        res = json.dumps(json.load(f))
    assert "PTA@ops@late" not in res and "PTA@weight@late" in res
