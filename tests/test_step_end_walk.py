"""The native owner labeller's step-end walk (owners.py ``NativeLabeler._walk_all``): where every
root model and optimizer runs on the calling thread, one C++ call (``live_walks``) walks them for
the labels and for module attribution, from a plan kept until a root, an optimizer, the thread
they run on or a module tree changes. Everything it writes must be what the two walks of before
gave (the plan off: ``_collect_native`` and ``ModuleTracker._walk_mine`` prepare and walk each
time), on a program that changes what the plan depends on between steps."""
import json
import os
import subprocess
import sys

import polars as pl
import pytest

from conftest import check_invariants, dump_of, env_for_tests, read, run_folders
from msmemscope.capture import native

pytestmark = pytest.mark.skipif(native.load_module() is None,
                                reason="the native source is not built (python -m msmemscope.capture.native build)")

PROG = r'''
import gc, json, sys, threading, torch, msmemscope
from torch import nn
from msmemscope.capture import owners
torch.manual_seed(0)
torch.set_num_threads(1)
calls = {"fused": 0, "refused": 0, "none": 0, "gone": 0}
way, subclass, watch = sys.argv[1], sys.argv[2] == "subclass", sys.argv[2] == "watch"
if way == "separate":
    owners.NativeLabeler._walk_plan = lambda self: None
else:
    walk_all = owners.NativeLabeler._walk_all
    def counted(self):
        tried = self._walk_plan() is not None
        got = walk_all(self)
        plan = self._plan
        calls["none" if not tried else "gone" if plan is None else "refused" if plan[1] is None else "fused"] += 1
        return got
    owners.NativeLabeler._walk_all = counted


class Tagged(torch.Tensor):
    pass


class Net(nn.Module):
    def __init__(self, emb=None):
        super().__init__()
        self.emb = emb if emb is not None else nn.Embedding(50, 16)
        self.norm = nn.BatchNorm1d(16)   # buffers
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        h = self.emb(ids).mean(1)
        if "extra" in self._modules:      # registered after the first steps
            h = h + self.extra(h)
        return self.head(self.norm(h))


def step(net, opt, ids):
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(net(ids), ids[:, 0]).backward()
    opt.step()


a = Net()
b = Net(emb=a.emb)                        # a second root sharing a's embedding
oa = torch.optim.SGD(a.parameters(), lr=1e-2, momentum=0.9)
ob = torch.optim.Adam(b.parameters(), lr=1e-3)
ids = torch.randint(0, 50, (8, 4))
for k in range(12):
    step(a, oa, ids)
    if k == 2 and subclass:               # a tensor subclass: the C++ walk refuses, the Python one walks
        a.norm.register_buffer("tag", torch.ones(64).as_subclass(Tagged))
    if k == 3:                            # a module registered: the trees change
        a.extra = nn.Linear(16, 16)
        oa.add_param_group({"params": list(a.extra.parameters())})
    if b is not None:
        step(b, ob, ids)
    if k == 6:                            # a root and its optimizer dropped: the plan's references die
        b = ob = None
        gc.collect()
    if k == 7:                            # a stop/start gap: a module registered and a block freed in it
        msmemscope.stop()
        a.gap = nn.Linear(16, 16)
        ids2 = ids.clone(); del ids2
        msmemscope.start()
    if k == 10 and watch:                 # watch(): the native source hands over to the dispatch-mode one
        msmemscope.watcher.watch(a.head.weight, name="head")
    if k == 8:                            # a model trained on another thread, joined at once
        c = Net()
        oc = torch.optim.SGD(c.parameters(), lr=1e-2)
        t = threading.Thread(target=lambda: [step(c, oc, ids) for _ in range(2)])
        t.start()
        t.join()
        del c, oc
print(json.dumps(calls))
'''


def _run(tmp_path, way, model):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = "native"
    out = tmp_path / way
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(out), "--analysis=decompose",
                        sys.executable, str(prog), way, model], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    calls = json.loads(r.stdout.strip().splitlines()[-1])
    [folder] = run_folders(out)
    check_invariants(read(dump_of(folder)))
    from msmemscope.io.reader import read_dump
    df = read_dump(dump_of(folder), columns=("event", "event_type", "name", "size", "owner", "module", "phase"))
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        res = json.load(f)
    with open(os.path.join(folder, "config.json")) as f:
        source = json.load(f)["source"]
    assert source == ("native, then dispatch" if model == "watch" else "native"), source
    return calls, df, res


@pytest.mark.parametrize("model", ["plain", "subclass", "watch"])
def test_one_walk_at_a_step_end_writes_what_the_two_walks_wrote(tmp_path, model):
    """Both ways meet a stop/start gap (a module registered and a block freed in it) and a model
    trained on a side thread; ``watch``: a watch() at the eleventh step hands over to the
    dispatch-mode source. ``subclass``: a buffer of a tensor subclass from the third step on, which
    the C++ walk does not take: the plan is kept as refused until the next change (a module registered), whose plan
    is refused again, and the Python walks write the same as before."""
    fused_calls, fused, res_f = _run(tmp_path, "fused", model)
    sep_calls, sep, res_s = _run(tmp_path, "separate", model)
    # the plan held at most step ends: before the tree changed, after it, after a root died (not
    # where another thread walked: the side thread's steps, a flush of the flusher thread)
    assert fused_calls["none"] >= 2, fused_calls
    if model != "subclass":
        assert fused_calls["fused"] >= 10 and fused_calls["refused"] == 0, fused_calls
    else:
        assert 2 <= fused_calls["fused"] <= 5 and fused_calls["refused"] >= 7, fused_calls
    cols = ["event", "event_type", "name", "size", "owner", "module", "phase"]
    rows = [(d.filter(pl.col("event").is_in(["MALLOC", "FREE"]) | (pl.col("event_type") == "OWNER"))
             .select(cols)) for d in (fused, sep)]
    assert rows[0].height > 500
    assert rows[0].equals(rows[1])
    assert res_f == res_s
    m = fused.filter(pl.col("event") == "MALLOC")
    owners = set(m["owner"])
    assert {"PTA@weight", "PTA@gradient", "PTA@optimizer_state", "PTA@activation"} <= owners, owners
    # module attribution's owning modules came with the labeller's walk, the late module's too
    owned = m.filter(pl.col("owner").is_in(["PTA@gradient", "PTA@optimizer_state"]))
    assert set(owned["module"]) >= {"Net.emb", "Net.norm", "Net.extra"}, set(owned["module"])
