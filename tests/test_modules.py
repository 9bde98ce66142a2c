"""Memory by nn.Module (issue 25): module attribution in the dump, the per-module table online and
offline, checked against PyTorch's MemTracker and against the model's own tensors.

The truth program (tests/progs/modules_truth.py) runs the same model and steps once under
MemTracker and once plainly under msmemscope. Per module: parameters, gradients and optimizer
state equal the bytes of the module's own tensors; the forward and backward peaks equal
MemTracker's Peak-Forward / Peak-Backward totals within 2%, except where docs/decompose.md says
the definitions differ (a module whose inputs need no gradient; a tied parameter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import FULL, check_invariants, full, dump_of, env_for_tests, read, run_cli, run_folders

PROGS = os.path.join(os.path.dirname(__file__), "progs")
TRUTH = os.path.join(PROGS, "modules_truth.py")


def native_built():
    from msmemscope.capture import native
    return native.load_module() is not None


STEPS = ["--steps", "2", "--step", "2"]


def run_truth(kind, mode, out_dir=None, source="python"):
    env = env_for_tests()
    if mode == "memtracker":
        r = subprocess.run([sys.executable, TRUTH, kind, "memtracker", *STEPS], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1]), None
    # "native+decompose": owners and modules on the native source, as --analysis=decompose runs on CPU
    decompose = source in ("python", "native+decompose")
    source = source.split("+")[0]
    env["MSMEMSCOPE_SOURCE"] = source
    args = ["--analysis=decompose"] if decompose else []
    if not decompose:
        env["MSMEMSCOPE_MODULES"] = "1"  # module attribution without decompose (the owners from modules.py)
    r = run_cli([*args, "--output", str(out_dir), TRUTH, kind, "plain", *STEPS], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (folder,) = run_folders(out_dir)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["source"] == {"python": "dispatch"}.get(source, source), cfg.get("source_note")
    assert cfg["format_version"] == 2
    return json.loads(r.stdout.strip().splitlines()[-1]), folder


def table_of(folder, step):
    from msmemscope.analysis.decompose import EVENTS, MODULE_COLUMNS_READ, module_table
    from msmemscope.io.reader import read_dump
    t = module_table(read_dump(dump_of(folder), columns=MODULE_COLUMNS_READ, events=EVENTS), step)
    return t["cpu"]


def compare(mine, truth, tied=()):
    """Every difference found, as text (empty: all agree)."""
    rows = {r["module"]: r for r in mine["modules"]}
    bad = []
    for name, t in truth["modules"].items():
        r = rows.get(name)
        if r is None:
            if t["has_params"]:
                bad.append(f"{name}: missing")
            continue  # ran without allocating (a dropout in eval-like mode): nothing to say
        if name not in tied:
            for col in ("parameters", "gradients", "optimizer_state"):
                if r["held"][col] != t[col]:
                    bad.append(f"{name}: {col} {r['held'][col]} != {t[col]}")
        m = t.get("memtracker")
        if m is None:
            continue
        if name not in tied and r["held"]["parameters"] != m["parameters"]:
            bad.append(f"{name}: parameters {r['held']['parameters']} != MemTracker {m['parameters']}")
        for k in ("forward_peak", "backward_peak"):
            ours, theirs = r[k], m[k]
            if theirs is None:
                continue
            if ours is None:
                bad.append(f"{name}: no {k}")
            elif k == "backward_peak" and not t["inputs_need_grad"]:
                # its backward window stays open to the end of the pass; ours attributes what is made
                # there to the module running (docs/decompose.md): never more than MemTracker's
                if ours > theirs * 1.02:
                    bad.append(f"{name}: {k} {ours} > MemTracker {theirs}")
            elif abs(ours - theirs) > 0.02 * theirs:
                bad.append(f"{name}: {k} {ours} vs MemTracker {theirs} ({(ours - theirs) / theirs:+.2%})")
    return bad


# make test: the transformer on both sources (one MemTracker run); make test-full adds GPT-2
CASES = [("transformer", "python")]  # make test; the native source and GPT-2 in make test-full
if FULL:
    CASES += [("transformer", "native"), ("transformer", "native+decompose"), ("gpt2", "python"),
              ("gpt2", "native"), ("gpt2", "native+decompose")]
_memtracker = {}


@pytest.mark.parametrize("kind,source", CASES)
def test_per_module_table_against_memtracker(kind, source, tmp_path):
    if kind == "gpt2":
        pytest.importorskip("transformers")
    if source.startswith("native") and not native_built():
        pytest.skip("the native source is not built (make native)")
    if kind not in _memtracker:
        _memtracker[kind] = run_truth(kind, "memtracker")[0]
    mt = _memtracker[kind]
    truth, folder = run_truth(kind, "plain", tmp_path / "out", source)
    df = read(dump_of(folder))
    check_invariants(df)
    # the model's own tensors are the same in both runs (same seed, same program)
    assert {k: v["parameters"] for k, v in truth["modules"].items()} == \
           {k: v["parameters"] for k, v in mt["modules"].items()}
    for name, v in mt["modules"].items():
        truth["modules"][name]["memtracker"] = v.get("memtracker")
    tied = ("GPT2LMHeadModel.lm_head",) if kind == "gpt2" else ()
    mine = table_of(folder, 2)
    assert mine["step"] == 2
    bad = compare(mine, truth, tied)
    assert not bad, "\n".join(bad)
    # a tied weight (GPT-2's wte = lm_head) is attributed once, to the first module that registers it
    if kind == "gpt2":
        rows = {r["module"]: r for r in mine["modules"]}
        assert rows["GPT2LMHeadModel.transformer.wte"]["held"]["parameters"] == \
            truth["modules"]["GPT2LMHeadModel.transformer.wte"]["parameters"]
        assert rows["GPT2LMHeadModel.lm_head"]["held"]["parameters"] == 0
    # rows of the dump carry the module and phase; activations belong to the forward that made them
    mal = df.filter(df["event"] == "MALLOC")
    from msmemscope.io.reader import read_dump
    cols = read_dump(dump_of(folder), columns=("event", "owner", "module", "phase"), events=("MALLOC",))
    assert set(cols["phase"].drop_nulls().unique()) == {"forward", "backward"}
    act = cols.filter(cols["owner"].str.contains("@activation", literal=True))
    if source in ("python", "native+decompose"):  # (the loss, computed outside the model, saves its own: no module)
        inside = act.filter(act["module"].is_not_null())
        assert inside.height > act.height // 2 and (inside["phase"] == "forward").all()
    assert cols["module"].drop_nulls().len() > mal.height // 3
    if source in ("python", "native+decompose"):  # the online table is the offline one (one implementation)
        res = json.load(open(os.path.join(folder, "analysis", "decompose.json")))
        online = res["modules"]["cpu"]
        assert online == table_of(folder, online["step"])


def test_module_hooks_removed_at_stop_and_cli(tmp_path):
    """In one process: the global hooks exist only while tracing; then the offline command on the
    dump: --depth folds, --json parses, bad input is one line; a version-1 dump still reads."""
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import json, torch, msmemscope\n"
        "from torch.nn.modules import module as M\n"
        "from torch import nn\n"
        "def counts():\n"
        "    return [len(M._global_forward_pre_hooks), len(M._global_forward_hooks)]\n"
        "before = counts()\n"
        "m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)\n"
        "x = torch.randn(8, 32, requires_grad=True)\n"
        "msmemscope.config(analysis='decompose', output=%r)\n"
        "msmemscope.start()\n"
        "during = counts()\n"
        "for _ in range(2):\n"
        "    opt.zero_grad()\n"
        "    m(x).square().sum().backward()\n"
        "    opt.step()\n"
        "msmemscope.stop()\n"
        "after = counts()\n"
        "m(x).sum().backward()\n"  # untraced: no hook runs, nothing breaks
        "print(json.dumps([before, during, after]))\n" % str(tmp_path / "out"))
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = "python"
    r = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    before, during, after = json.loads(r.stdout.strip().splitlines()[-1])
    assert after == before and during[0] > before[0] and during[1] > before[1]
    (folder,) = run_folders(tmp_path / "out")
    dump = dump_of(folder)
    check_invariants(read(dump))
    r = run_cli(["decompose", "--by=module", "--depth=2", "--json", dump])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["cpu"]
    names = [x["module"] for x in res["modules"]]
    assert "Sequential.2" in names and "Sequential.2.0" not in names and "Sequential" in names
    totals = [x["total"] for x in res["modules"]]
    assert totals == sorted(totals, reverse=True)
    top = {x["module"]: x for x in res["modules"]}["Sequential"]
    # the parameters: 32*64+64 + 64*64+64 + 64*4+4 floats; SGD momentum the same
    n = (32 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4) * 4
    assert top["held"]["parameters"] == n and top["held"]["gradients"] == n and top["held"]["optimizer_state"] == n
    r = run_cli(["decompose", "--by=module", "--depth=3", dump])
    assert r.returncode == 0 and "Sequential.2.0" in r.stdout and "memory by module" in r.stdout
    for bad, why in ((["--by=layer"], "--by=layer"), (["--depth=0"], "--depth=0"), (["--depth=x"], "whole number"),
                     (["--step=99"], "has steps 1 to ")):  # (it said: no module in step 99)
        r = run_cli(["decompose", "--by=module", *bad, dump])
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "msmemscope: error:" in r.stderr, r.stderr
        assert why in r.stderr, r.stderr
    # --step with the owner table (the whole run): refused in one line, not ignored
    r = run_cli(["decompose", "--step=2", dump])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "works with --by=module" in r.stderr, r.stderr
    # a dump written before module attribution (format 1): reads, has no modules, says so in one line
    old = tmp_path / "old.csv"
    import re
    with open(dump) as f:
        old.write_text(re.sub(r',""module"":""[^"]*""(,""phase"":""[^"]*"")?', "", f.read()))
    df = read(str(old))
    check_invariants(df)
    from msmemscope.io.reader import read_dump
    assert read_dump(str(old), columns=("module",))["module"].null_count() == df.height
    r = run_cli(["decompose", str(old)])
    assert r.returncode == 0 and "PTA@weight" in r.stdout
    r = run_cli(["decompose", "--by=module", str(old)])
    assert r.returncode == 2 and "no MALLOC row carries a module" in r.stderr and r.stderr.count("\n") == 1


def test_node_hooks_mark_as_the_multi_grad_hooks():
    """The module tracker's backward hooks go on the tensors' autograd nodes (one C++ call each)
    instead of torch's register_multi_grad_hook (a hook dict and a handle per tensor, per module
    call), in C++ where built (capture/_native.cpp) and in Python: the marks of both, in order, are
    those the multi-grad hooks give, on modules with several
    inputs and outputs, a shared output, a leaf input that needs a gradient (the multi-grad hook's
    path), a module called twice, and the transformer example."""
    import threading
    import types

    import torch
    from torch import nn

    from msmemscope.capture import modules as M

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y):
            return self.a(x) * self.b(y), self.a(y)   # two inputs, two outputs, self.a called twice

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.two, self.head = nn.Linear(8, 8), Two(), nn.Linear(8, 1)

        def forward(self, x):
            u, v = self.two(self.pre(x), x.relu())
            return self.head(u + v)

    def marks(kind, impl):
        multi_grad = impl == "multi-grad"
        torch.manual_seed(0)
        if kind == "gpt":
            from examples.transformer import GPT
            model, x = GPT(), torch.randint(0, 1024, (2, 16))
        else:
            model, x = Net(), torch.randn(4, 8, requires_grad=(kind == "leaf"))
        saved = M._on_first_grad, M._on_all_grads
        if multi_grad:
            M._on_first_grad = lambda ts, fn: torch.autograd.graph.register_multi_grad_hook(ts, fn, mode="any")
            M._on_all_grads = lambda ts, fn: torch.autograd.graph.register_multi_grad_hook(ts, fn)
        tr = M.ModuleTracker(types.SimpleNamespace(active=True), native=False if impl != "c++" else None).install()
        assert (tr.nat is not None) == (impl == "c++")
        try:
            for _ in range(2):
                model(x).float().mean().backward()
        finally:
            tr.remove()
            M._on_first_grad, M._on_all_grads = saved
        # every mark, in time order (each thread's list is in order already)
        me = threading.get_ident()
        seq = sorted(((t, tid == me, st) for tid, (ts, sts) in tr.marks_now().items() for t, st in zip(ts, sts)),
                     key=lambda m: m[0])
        return [m[1:] for m in seq]

    impls = ("python", "multi-grad") + (("c++",) if M.native_hooks() is not None else ())
    for kind in ("net", "leaf", "gpt"):
        theirs = marks(kind, "multi-grad")
        assert sum(1 for _, st in theirs if st is not None and st[1] == M.BACKWARD) > 4
        for impl in impls:
            assert marks(kind, impl) == theirs, (kind, impl)


def test_leaf_input_hooks_do_not_pile_up():
    """A module called on a tensor the program keeps (a leaf that requires grad, reused every
    iteration) gets a multi-grad hook on it per call: it is removed once it has run, so the leaf's
    hooks stay bounded and every iteration's marks are the first one's (before, iteration k ran
    k hooks on the leaf)."""
    import types

    import torch
    from torch import nn

    from msmemscope.capture import modules as M

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    tr = M.ModuleTracker(types.SimpleNamespace(active=True)).install()
    per_iter, hooks = [], []
    try:
        for _ in range(6):
            n0 = sum(len(v[1]) for v in tr.marks_now().values())
            model(x).sum().backward()
            per_iter.append([st for v in tr.marks_now().values() for st in v[1]][n0:])
            hooks.append(len(x._backward_hooks or {}))
    finally:
        tr.remove()
    assert any(st is not None and st[1] == M.BACKWARD and st[0].endswith(".0") for st in per_iter[0])
    assert all(p == per_iter[0] for p in per_iter[1:])
    assert max(hooks) <= 1, hooks



@pytest.mark.parametrize("native", [True, False])
def test_leaf_hooks_no_pass_reaches_go_at_the_flushes(native):
    """A module called on a parameter, under ``torch.autograd.grad`` over other inputs: no pass
    computes that leaf's gradient, so its hooks never run. They went only at the session's end: one
    more on the parameter at each call (50 after 50 iterations). Now those no pass reached within
    two flushes go; a backward that reaches them ends the module's backward as before."""
    import types

    import torch
    from torch import nn

    from msmemscope.capture import modules as M

    class Latents(nn.Module):
        def __init__(self):
            super().__init__()
            self.latents = nn.Parameter(torch.randn(3, 4))
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return (self.proj(self.latents) * x).sum()

    torch.manual_seed(0)
    m = Latents()
    tr = M.ModuleTracker(types.SimpleNamespace(active=True), native=None if native else False).install()
    hooks = []
    try:
        for _ in range(12):
            torch.autograd.grad(m(torch.randn(3, 4)), list(m.proj.parameters()))
            tr.spec()  # a flush
            hooks.append(len(m.latents._backward_hooks or {}))
        m(torch.randn(3, 4)).backward()   # a pass that reaches the leaf: its module call's backward ends
        marks = [st for v in tr.marks_now().values() for st in v[1]]
    finally:
        tr.remove()
    assert max(hooks) <= 2, hooks
    assert any(st is not None and st[1] == M.BACKWARD and st[0] == "Latents.proj" for st in marks), marks


def run_prog(tmp_path, name, text, out, impl="c++"):
    """Run a traced program (``sys.argv[1]``: the output folder) quietly, the module hooks in C++ or
    (``impl="python"``) the Python reference; returns its stdout."""
    prog = tmp_path / name
    prog.write_text(text)
    env = env_for_tests()
    env["MSMEMSCOPE_QUIET"] = "1"
    if impl == "python":
        env["MSMEMSCOPE_FOLD"] = "python"
    r = subprocess.run([sys.executable, str(prog), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


MIX = r'''
import sys, torch, msmemscope
from torch import nn
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = Block(), Block(), nn.Linear(16, 1)

    def forward(self, x, ckpt):
        h = self.a(x)
        # activation checkpointing: b's forward runs again inside the backward pass
        h = checkpoint(self.b, h, use_reentrant=False) if ckpt else self.b(h)
        return self.head(self.a(h))  # a is called twice


msmemscope.config(output=sys.argv[1], analysis="decompose", collect_mode="immediate")
net = Net()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
x = torch.randn(8, 16, requires_grad=True)  # a leaf input that needs a gradient: the multi-grad hook
for step in range(4):
    if step == 2:  # a stop/start gap, and blocks freed inside it
        msmemscope.stop()
        y = net(x, False).sum(); y.backward(); del y
        msmemscope.start()
    opt.zero_grad(set_to_none=True)
    net(x, step % 2 == 1).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        net(x, False)
    msmemscope.step()
msmemscope.stop()
'''


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test holds the C++ walks to the Python walks in test_cpp_walks_of_the_live_objects_are_the_python_walks; the C++ hooks run in every module test")
@pytest.mark.skipif(not native_built(), reason="the native source is not built (make native)")
def test_cpp_module_hooks_attribute_as_the_python_hooks(tmp_path):
    """The module hooks, the backward node hooks and the saved-tensor pack hook in C++ (the default
    where built) give every MALLOC row the owner, module and phase that the Python hooks
    (MSMEMSCOPE_FOLD=python) give, and the same decomposition, on a program that meets them all:
    activation checkpointing (a forward inside the backward pass), a leaf input that needs a
    gradient, a module called twice, a forward under no_grad and a stop/start gap."""
    got = {}
    for impl in ("c++", "python"):
        out = tmp_path / impl
        run_prog(tmp_path, "mix.py", MIX, out, impl)
        (folder,) = run_folders(out)
        df = read(dump_of(folder))
        check_invariants(df)
        from msmemscope.io.reader import read_dump
        cols = read_dump(dump_of(folder), columns=("event", "name", "owner", "module", "phase"), events=("MALLOC",))
        res = json.load(open(os.path.join(folder, "analysis", "decompose.json")))
        got[impl] = (cols.select("name", "owner", "module", "phase").rows(), res)
    rows, res = got["c++"]
    assert rows == got["python"][0]
    assert res == got["python"][1]
    # what the case is about happened: recomputed forwards in backward, both phases, activations
    recomputed = {m for _, _, m, ph in rows if ph == "backward" and m and m.startswith("Net.b.")}
    assert recomputed, "no allocation of the checkpointed block attributed to its backward"
    assert {ph for *_, ph in rows} >= {"forward", "backward", None}
    assert any(o.endswith("@activation") and m and m.startswith("Net.a") for _, o, m, _ in rows)


WALK = r'''
import json, sys, torch, msmemscope
from torch import nn
from msmemscope import capture
from msmemscope.capture import modules as M
torch.manual_seed(0)
msmemscope.config(output=sys.argv[1], analysis="decompose", collect_mode="immediate")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 10)
        self.head.weight = self.emb.weight  # tied: one storage, two modules

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


net = Net()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
ids = torch.randint(0, 10, (16,))
out = {}
for step in range(3):
    opt.zero_grad(set_to_none=step != 1)
    net(ids).sum().backward()
    if step == 2:  # gradients live, optimizer state from the earlier steps
        s = capture.current()
        lab, tr = s.labeler, s.modules
        walk = lab._walk
        got = lab._collect_native()
        lab._walk = None
        want = lab._collect_native()
        lab._walk = walk
        owned = tr.owned_blocks()
        real, M._native_walk = M._native_walk, lambda: None
        owned_py = tr.owned_blocks()
        M._native_walk = real
        out = {"cats": [got == want, len(got), sorted({v[0] for v in got.values()})],
               "owned": [owned == owned_py, len(owned), sorted({v[1] for v in owned.values()})],
               "trees": walk is not None}
        # a wrapper subclass among the tensors: the C++ walk hands over to the Python one
        class Tagged(torch.Tensor):
            pass
        t = torch.ones(4).as_subclass(Tagged)
        out["subclass"] = walk.live_categories([[nn.Module()]], [], ((1,), (2,), (3,))) == {} and \
            walk.live_categories([[]], [], ((1,), (2,), (3,))) == {}
        holder = nn.Module()
        holder.register_buffer("t", t)
        out["subclass_none"] = walk.live_categories([[holder]], [], ((1,), (2,), (3,))) is None
    opt.step()
msmemscope.stop()
print("WALK", json.dumps(out))
'''


@pytest.mark.skipif(not native_built(), reason="the native source is not built (make native)")
def test_cpp_walks_of_the_live_objects_are_the_python_walks(tmp_path):
    """The walks of the live objects at each flush (the owner labeller's categories, module
    attribution's owning modules) in C++ find, per allocation id, what the Python walks find: a
    tied weight, a bias-less layer, buffers, gradients and AdamW's state; a wrapper subclass
    among the tensors hands the walk back to Python (None)."""
    got = json.loads(run_prog(tmp_path, "walk.py", WALK, tmp_path / "out").split("WALK ", 1)[1])
    assert got["trees"]
    same, n, kinds = got["cats"]
    assert same and n >= 8 and kinds == ["gradient", "optimizer_state", "weight"], got
    same, n, kinds = got["owned"]
    assert same and n >= 8 and kinds == ["gradient", "optimizer_state", "weight"], got
    assert got["subclass"] and got["subclass_none"]
    (folder,) = run_folders(tmp_path / "out")
    check_invariants(read(dump_of(folder)))


THREADS = r'''
import sys, threading, torch, msmemscope
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
msmemscope.config(output=sys.argv[1], analysis="decompose", collect_mode="immediate")


class Left(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Right(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.d = nn.Linear(16, 48), nn.Linear(48, 1)

    def forward(self, x):
        return self.d(torch.tanh(self.c(x)))


def train(model, x, n, tids, name):
    tids[name] = threading.get_ident()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()


tids = {}
left, right = Left(), Right()
ts = [threading.Thread(target=train, args=(left, torch.randn(64, 32), 30, tids, "Left")),
      threading.Thread(target=train, args=(right, torch.randn(64, 16), 30, tids, "Right"))]
for t in ts:
    t.start()
for _ in range(5):  # flushes while both threads are in forwards and backwards
    msmemscope.step()
for t in ts:
    t.join()
msmemscope.stop()
print("TIDS", tids["Left"], tids["Right"])
'''


@pytest.mark.parametrize("impl", full(["c++"], ["c++", "python"]))  # (make test's time)
def test_two_threads_training_two_models_keep_their_own_modules(tmp_path, impl):
    """Two threads train two models at once under decompose: every MALLOC row a thread makes is
    attributed to its own model's modules (never the other's), forward and backward, with the C++
    hooks and with the Python ones."""
    if impl == "c++" and not native_built():
        pytest.skip("the native source is not built (make native)")
    stdout = run_prog(tmp_path, "threads.py", THREADS, tmp_path / "out", impl)
    left, right = (int(x) for x in stdout.split("TIDS ", 1)[1].split())
    (folder,) = run_folders(tmp_path / "out")
    check_invariants(read(dump_of(folder)))
    from msmemscope.io.reader import read_dump
    cols = read_dump(dump_of(folder), columns=("event", "tid", "owner", "module", "phase"), events=("MALLOC",))
    seen = {}
    for tid, owner, module, phase in cols.select("tid", "owner", "module", "phase").iter_rows():
        if module is None or tid not in (left, right):
            continue
        root = module.split(".", 1)[0]
        want = "Left" if tid == left else "Right"
        assert root == want, (tid, owner, module, phase)
        seen.setdefault(want, set()).add(phase)
    # forward and backward; no phase only for a block the module owns made outside its forward
    # and backward (optimizer state, a gradient), attributed by its parameter: which of those a
    # walk of its own thread (the only one that reads its gradients) sees depends on the timing
    for name in ("Left", "Right"):
        assert {"forward", "backward"} <= seen[name] <= {"forward", "backward", None}, seen


COMPILED = os.path.join(PROGS, "compiled_modules.py")


def _compiled_run(args, env, cli=None):
    cmd = [sys.executable, COMPILED, *args] if cli is None else None
    r = (subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600) if cli is None
         else run_cli([*cli, sys.executable, COMPILED, *args], env=env))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [ln for ln in r.stdout.splitlines() if ln.startswith("loss")]
    return r, losses, json.loads(r.stdout.split("DYNAMO ", 1)[1].splitlines()[0])


@pytest.mark.parametrize("how,backend,source", [(h, b, s) for h in ("module", "inplace", "blocks", "function", "optimizer")
                                                for b in (["aot_eager", "inductor"] if FULL else ["aot_eager"])
                                                for s in ("native", "python")
                                                if FULL or (h, s) == ("optimizer", "python")])  # make test's time
def test_a_compiled_model_stays_compiled_and_its_layers_own_their_memory(tmp_path, how, backend, source):
    """torch.compile with --analysis=decompose (native source). Our global module hooks run inside
    the compiled code only as no-ops (eager_only): Dynamo made a graph break of each module call
    before (7 on this model, 2 of 9 calls captured), so the traced program was no longer the
    compiled one. Now the graphs, captured calls and graph breaks are the plain run's, the losses
    too, torch's warning of global module hooks is not shown, the compiled model is named as the
    model (no OptimizedModule, no _orig_mod), and each block's parameters, gradients and optimizer
    state go to it at step 1's peak, also where no hook of its ran (model.compile(), a compiled
    function: the model is found from its optimizer). Step 1's gradients are the owning layer's
    though zero_grad frees them before step 1 is written (the held first step). ``optimizer``: a
    compiled optimizer step traces the optimizer hooks of ours (step boundary, owner labels,
    modules): they run through torch._dynamo.disable (a silent skip), so the step's graph is the
    plain run's and no "cannot trace" warning or break of ours comes (3 before, and the walks
    compiled frame by frame). The dispatch-mode source (``python``): its dispatch mode lets Dynamo
    compile (it skipped every frame under it before: 0 graphs), the labeller finds the models of
    model.compile() and compiled functions as module attribution does, and keeps step 1's owning
    modules from its hold (its gradients went to the model as a whole before)."""
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    _, plain_losses, plain = _compiled_run([backend, how], env)
    out = tmp_path / "out"
    r, losses, traced = _compiled_run([backend, how], env, cli=["--analysis=decompose", "--output", str(out)])
    assert losses == plain_losses and len(losses) == 4
    for k in ("graphs", "captured"):
        assert traced[k] == plain[k], (k, traced, plain)
    assert plain["captured"] > 0
    if how == "optimizer":  # its own graph as plain; our hooks around it skipped (a silent break), never traced
        assert all(r.startswith("Skip calling function") for r in set(traced["reasons"]) - set(plain["reasons"])), traced
    else:
        assert traced["breaks"] == plain["breaks"] == 0, (traced, plain)
    assert "global hooks on modules" not in r.stderr and "does not know how to trace" not in r.stderr, r.stderr[-2000:]
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        mods = json.load(f)["modules"]["cpu"]
    # the table is at the step of the highest peak, the first of equal ones (the dump's own ``used``):
    # step 1 for the compiled models, where its gradients were freed before it was written (held);
    # a compiled optimizer step peaks a few KB higher from step 2 (inductor; aot_eager on the
    # dispatch-mode source)
    import polars as pl
    peaks = (df.filter(pl.col("event").is_in(["MALLOC", "FREE"]) & (pl.col("event_type") == "PTA"))
             .group_by("step").agg(pl.col("used").max()).sort("step").rows())
    top = max(u for _, u in peaks)
    assert mods["step"] == next(st for st, u in peaks if u == top) and mods["peak"] == top, (mods["step"], peaks)
    assert mods["step"] == 1 or how == "optimizer", mods["step"]
    by = {m["module"]: m for m in mods["modules"]}
    assert not any("_orig_mod" in p or "OptimizedModule" in p for p in by), sorted(by)
    # the model owns what its compiled call makes: our hooks run eagerly around torch.compile(model)'s
    # OptimizedModule, and around model.compile()'s call (EagerAround; before, no hook of ours ran for
    # it: no activation, forward or backward peak of the model's, and aot_eager's graph a root of its
    # own). A graph aot_eager runs outside any forward (the compiled optimizer step, the compiled
    # function) is no module of the program: it was a root "<lambda>" with the step's temporaries
    assert {p.split(".")[0] for p in by} <= {"Net", "(outside modules)"}, sorted(by)
    if how != "function":
        net = by["Net"]
        assert net["held"]["activations"] > 0 and net["forward_peak"] and net["backward_peak"], net
        assert by.get("(outside modules)", {"held": {}})["held"].get("activations", 0) == 0, by["(outside modules)"]
    if how in ("blocks", "optimizer"):  # each block runs its own hooks: its activations are its own
        acts = [by[f"Net.blocks.{i}"]["held"]["activations"] for i in (0, 1)]
        assert acts[0] == acts[1] > 0 and by["Net.blocks"]["held"]["activations"] == sum(acts), acts
        assert all(by[f"Net.blocks.{i}"]["forward_peak"] for i in (0, 1))
    for path, (nbytes, count) in plain["layers"].items():  # Adam: two moments, a float step counter each
        at = by[path]["at_peak"]
        grads = nbytes if mods["step"] == 1 else at["gradients"]  # step 2's peak comes inside backward
        assert (at["parameters"], at["gradients"], at["optimizer_state"]) == (nbytes, grads, 2 * nbytes + 4 * count), \
            (path, at)
        assert 0 < at["gradients"] <= nbytes, (path, at)


def test_a_model_compiled_in_place_before_a_python_api_start_is_attributed_as_torch_compile_model(tmp_path):
    """model.compile() before msmemscope.start() (Python API, decompose): the session's first start
    finds the live modules compiled in place and runs our hooks around their calls, so the module
    table is the one of the same program with torch.compile(model), module for module and byte for
    byte (the full run; make test checks the model's own activations and peaks); before, no hook of
    ours ran for the model (its activations, its forward and backward peaks were nobody's) and
    aot_eager's graph was a root of its own."""
    tables = {}
    for how in full(["inplace"], ["inplace", "module"]):
        env = env_for_tests()
        env["COMPILED_OUT"] = str(tmp_path / how)
        r = subprocess.run([sys.executable, COMPILED, "aot_eager", how, "api"], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        (folder,) = run_folders(tmp_path / how)
        check_invariants(read(dump_of(folder)))
        with open(os.path.join(folder, "analysis", "decompose.json")) as f:
            tables[how] = json.load(f)["modules"]["cpu"]
    if FULL:
        assert tables["inplace"] == tables["module"]
    by = {m["module"]: m for m in tables["inplace"]["modules"]}
    net = by["Net"]
    assert net["held"]["activations"] > 0 and net["forward_peak"] and net["backward_peak"], net
    assert not any(p.split(".")[0] == "GraphModule" for p in by) and by["(outside modules)"]["held"]["activations"] == 0


def test_an_in_place_compiled_call_runs_our_hooks_eagerly_only_while_they_are_on():
    """nn.Module.compile is ours while our global hooks are on: the call it compiles gets our hooks
    around it, eagerly (inside, Dynamo sees them as no-ops), the post-hook also where the call raises;
    once our hooks are removed a wrapped call is torch's alone, and at the session's end torch's
    compile is back."""
    from torch import nn

    from msmemscope.capture import modules as M
    M.release_compile()  # an in-process tracker of an earlier test that no session's end released
    torch_compile = nn.Module.__dict__["compile"]
    assert torch_compile.__module__ == "torch.nn.modules.module"
    calls = []
    handles = M.add_global_module_hooks("test", lambda m, a: calls.append(("pre", type(m).__name__)),
                                        lambda m, a, o: calls.append(("post", type(m).__name__, o is None)))
    try:
        assert nn.Module.__dict__["compile"] is not torch_compile
        torch.manual_seed(0)
        lin, x = nn.Linear(4, 3), torch.randn(2, 4)
        want = lin(x)
        calls.clear()
        lin.compile(backend="eager")
        assert isinstance(lin._compiled_call_impl, M.EagerAround)
        assert torch.equal(lin(x), want)
        assert calls == [("pre", "Linear"), ("post", "Linear", False)], calls
        calls.clear()
        with pytest.raises(RuntimeError):
            lin(torch.randn(2, 5))  # the wrong width: the compiled call raises
        assert calls == [("pre", "Linear"), ("post", "Linear", True)], calls
        M.remove_global_module_hooks("test", handles)
        # a stop/start gap keeps it: a model compiled in the gap gets our hooks once they are on again
        assert nn.Module.__dict__["compile"] is not torch_compile
        later = nn.Linear(4, 2)
        later.compile(backend="eager")
        calls.clear()
        later(x)
        assert calls == []
        handles = M.add_global_module_hooks("test", lambda m, a: calls.append(("pre", type(m).__name__)),
                                            lambda m, a, o: calls.append(("post", type(m).__name__, o is None)))
        later(x)
        assert calls == [("pre", "Linear"), ("post", "Linear", False)], calls
    finally:
        M.remove_global_module_hooks("test", handles)
        M.release_compile()  # the session's end
    assert nn.Module.__dict__["compile"] is torch_compile
    calls.clear()
    assert torch.equal(lin(x), want) and calls == []


def test_the_compile_warning_is_hidden_only_while_our_hooks_are_on_and_the_program_has_none():
    """torch.compile(module) warns at each call while any global module hook is on. Ours hide it
    from the first holder's hooks to the last one's removal; a program that had global module
    hooks of its own when ours came keeps the warning (it is about its hooks too)."""
    import warnings

    from torch.nn.modules import module as nn_module

    from msmemscope.capture import modules as M

    def ours():
        return [f for f in warnings.filters if getattr(f[1], "pattern", None) == M._COMPILE_WARNING]
    before = list(warnings.filters)
    M.hide_compile_warning("tracker", True)
    M.hide_compile_warning("labeller", True)
    assert len(ours()) == 1
    M.hide_compile_warning("tracker", False)
    assert len(ours()) == 1  # the labeller's hooks are still on
    M.hide_compile_warning("labeller", False)
    assert ours() == [] and warnings.filters == before
    h = nn_module.register_module_forward_pre_hook(lambda *a: None)
    try:
        M.hide_compile_warning("tracker", True)
        assert ours() == []
    finally:
        h.remove()
        M.hide_compile_warning("tracker", False)
    assert warnings.filters == before


# make test: the gap and watch together (each alone in the full run)
@pytest.mark.parametrize("source,extra", full([("native", ["gap", "watch"])],
                                              [("native", ["gap"]), ("native", ["watch"]), ("python", ["gap"]),
                                               ("native", ["gap", "watch"]), ("python", ["watch"])]))
def test_a_compiled_model_over_a_stop_start_gap_on_either_source(tmp_path, source, extra):
    """torch.compile(model) with --analysis=decompose and tracing stopped after step 1 and started
    again before step 3 (our global hooks removed and registered again), on both capture sources:
    the losses are the plain run's, no warning of ours, the dump keeps its invariants and each
    block owns its parameters, gradients and optimizer state. Native source: no graph break, and
    the plain run's graph twice, for the traced steps and for the gap's (Dynamo guards on the
    global hooks, which the gap takes away); with our hooks traced, only the gap's is compiled.
    The dispatch-mode source (and ``watch``, which hands over to it) does the same: its dispatch
    mode tells Dynamo to compile under it (``ignore_compile_internals``). Before, Dynamo skipped
    every frame while it was on: the program ran eagerly (0 graphs), and under inductor its losses
    changed. Without the gap, under watch: the plain run's graph once."""
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    _, plain_losses, plain = _compiled_run(["aot_eager", "module"], env)
    out = tmp_path / "out"
    r, losses, traced = _compiled_run(["aot_eager", "module", *extra], env,
                                      cli=["--analysis=decompose", "--output", str(out)])
    assert losses == plain_losses and len(losses) == 4
    assert "global hooks on modules" not in r.stderr and "does not know how to trace" not in r.stderr, r.stderr[-2000:]
    # one graph for the traced steps (our hooks on) and one for the gap's (none): each the plain one
    times = 2 if "gap" in extra else 1
    assert traced["breaks"] == 0 and traced["graphs"] == plain["graphs"] + times - 1, (traced, plain)
    assert traced["captured"] == times * plain["captured"], (traced, plain)
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    import polars as pl
    if "gap" in extra:
        assert df.filter(pl.col("event_type").is_in(["STOP_TRACE", "START_TRACE"])).height >= 3  # the gap is in the dump
    if "watch" in extra:  # the watched weight changed at each traced optimizer step, by its declared write
        with open(os.path.join(folder, "analysis", "watch.json")) as f:
            (w,) = json.load(f)["watched"]
        # (stopped for the second of the 4 iterations only: tracing starts again before the third)
        assert w["name"] == "head.weight" and w["stomps"] == 0 and w["changes"] == 4 - (1 if "gap" in extra else 0), w
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        mods = json.load(f)["modules"]["cpu"]
    by = {m["module"]: m for m in mods["modules"]}
    assert not any("_orig_mod" in p or "OptimizedModule" in p for p in by), sorted(by)
    for path, (nbytes, count) in plain["layers"].items():
        at = by[path]["at_peak"]
        assert (at["parameters"], at["gradients"], at["optimizer_state"]) == (nbytes, nbytes, 2 * nbytes + 4 * count), \
            (path, at)
    # the offline table of the dump is the online one (the parameters' layers come in OWNER rows
    # after step 1's peak where the handover to watch wrote their MALLOC rows before any forward)
    off = run_cli(["decompose", "--by=module", "--depth=9", "--json", dump_of(folder)])
    assert off.returncode == 0, off.stderr
    offline = {m["module"]: m["at_peak"] for m in json.loads(off.stdout)["cpu"]["modules"]}
    assert offline == {m["module"]: m["at_peak"] for m in mods["modules"]}
