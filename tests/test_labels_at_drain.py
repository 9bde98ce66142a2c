"""With ``--analysis=decompose`` on the native source, the owner labels and modules are given to the
records as they are drained (session.py ``_drain_labelled``, the native ``label_batch``): the row
tuples and the marshal bytes the writer gets are made once, labelled, and no row is rewritten; a
steady flush makes no row tuple at all (``take_packed`` with the labels: the decomposition folds its
columns, ``Fold.feed_columns``).
What that writes and finds must be what the row passes gave (``MSMEMSCOPE_LABELS=rows``: drained,
then rewritten as tuples), on a program that meets the labels' cases: user labels on a thread and
after a tensor's row was written (OWNER rows), a module built in a stop/start gap (its weights
counted at their first read: dict attrs), activations, gradients and AdamW's state, a flush per
step; or a second thread training its own model meanwhile."""
import glob
import json
import os
import re
import subprocess
import sys

import polars as pl
import pytest

from conftest import check_invariants, dump_of, env_for_tests, full, read, run_folders
from msmemscope.capture import native

pytestmark = pytest.mark.skipif(native.load_module() is None,
                                reason="the native source is not built (python -m msmemscope.capture.native build)")

PROG = r'''
import sys, threading, torch, msmemscope
from torch import nn
from msmemscope import describe
torch.manual_seed(0)
torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def train(net, steps, tag):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        with describe.describer(owner=tag):
            y = net(x)
        y.pow(2).mean().backward()
        opt.step()


if sys.argv[1] == "thread":
    side = threading.Thread(target=train, args=(nn.Sequential(Block(), nn.Linear(16, 2)), 6, "side"))
    side.start()
net = nn.Sequential(Block(), Block(), nn.Linear(16, 1))
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
x = torch.randn(8, 16, requires_grad=True)
extra, kept = None, []
for step in range(6):
    if step == 3 and sys.argv[1] == "main":  # a module built in a gap: counted at a traced op's first read
        msmemscope.stop()
        extra = nn.Linear(16, 16)
        msmemscope.start()
    opt.zero_grad(set_to_none=True)
    with describe.describer(owner="mine"):
        h = net(x)
    loss = h.pow(2).mean() + (extra(x).sum() if extra is not None else 0)
    loss.backward()
    opt.step()
    kept.append(torch.ones(64 * (step + 1)))
    if step in (2, 4):  # (the other steps' flushes have nothing but the records: taken as columns)
        describe.describer(kept[step - 1], owner="late")  # its row written at an earlier flush: an OWNER row
if sys.argv[1] == "thread":
    side.join()
'''


def _labelled_flushes(folder):
    """(flushes taken as columns with no row tuple, flushes whose drain gave the labels)."""
    [log] = glob.glob(os.path.join(folder, "msmemscope_logs", "*.log"))
    with open(log) as f:
        got = re.findall(r"trace stopped \(\d+ flushes so far, (\d+) of them .*?, (\d+) with the labels", f.read())
    return tuple(map(int, got[-1]))


def _run(tmp_path, name, mode, labels):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = "native"
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"  # a flush at every step end
    if labels == "rows":
        env["MSMEMSCOPE_LABELS"] = "rows"
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(out), "--analysis=decompose",
                        sys.executable, str(prog), mode], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    [folder] = run_folders(out)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["source"] == "native"
    df = read(dump_of(folder))
    check_invariants(df)
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        res = json.load(f)
    return folder, df, res


@pytest.mark.parametrize("mode", full(["main"], ["main", "thread"]))
def test_labels_given_at_the_drain_are_the_row_passes_labels(tmp_path, mode):
    """One thread: the rows, the OWNER rows and decompose.json of both ways are equal. Two threads
    (make test-full; the other thread's tests run on this way by default): which model is named
    first, and what the gap of one thread leaves out of the other's, change between runs, so each
    run is held to itself: its dump (the drains' bytes) is what its analysis folded (the tuples)."""
    from msmemscope.analysis.decompose import EVENTS, MODULE_COLUMNS_READ, module_table, summarize
    from msmemscope.io.reader import read_dump
    got = {}
    for labels in ("drain", "rows") if mode == "main" else ("drain",):
        folder, df, res = _run(tmp_path, labels, mode, labels)
        packed, n = _labelled_flushes(folder)
        # the labels given at the drain: the steady flushes taken as columns (no row tuple), the
        # others (OWNER rows to follow, rows waiting) drained into labelled tuples
        assert (n > 5 and 0 < packed < n) if labels == "drain" else (n == 0 and packed == 0), (packed, n)
        # the writer's bytes (the dump) are the tuples the analysis folded: online = offline
        off = json.loads(json.dumps(summarize(df)))
        assert (off["devices"], off["steps"]) == (res["devices"], res["steps"])
        mods = module_table(read_dump(dump_of(folder), columns=MODULE_COLUMNS_READ, events=EVENTS))
        assert json.loads(json.dumps(mods)) == res["modules"]
        got[labels] = (read_dump(dump_of(folder), columns=("event", "event_type", "name", "size", "owner", "module",
                                                           "phase", "attr")), res)
    d, res_d = got["drain"]
    m_d = d.filter(pl.col("event") == "MALLOC")
    owners = set(m_d["owner"])
    assert {"PTA@ops@mine", "PTA@activation@mine", "PTA@weight", "PTA@gradient", "PTA@optimizer_state"} <= owners, owners
    assert {"forward", "backward"} <= set(m_d.filter(pl.col("module").str.ends_with(".0.fc"))["phase"])
    o_d = d.filter(pl.col("event_type") == "OWNER")
    assert "PTA@ops@late" in set(o_d["owner"]), o_d
    if mode == "thread":
        assert "PTA@activation@side" in owners, owners
        return
    r, res_r = got["rows"]
    assert res_d == res_r
    cols = ["name", "size", "owner", "module", "phase"]
    assert m_d.select(cols).equals(r.filter(pl.col("event") == "MALLOC").select(cols))
    assert o_d.select("owner", "module").equals(r.filter(pl.col("event_type") == "OWNER").select("owner", "module"))
    # the gap's module: its weights counted at their first read, dict attrs labelled as tuples are
    before_op = m_d.filter(pl.col("attr").str.contains("before_op"))
    assert before_op.height >= 2 and set(before_op["owner"]) == {"PTA@weight"}, before_op.select("size", "owner")


SHADOW = r'''
import json, sys, torch
import torch.nn.functional as F
torch.manual_seed(0)
import msmemscope
from msmemscope.analysis import decompose as D
from msmemscope.analysis.folds import native_module
from msmemscope.events import PackedRows
MOD = native_module()
STEPS = 5
# per step k: the Python tables fed the row tuples (the reference), and the native folds fed what
# the sink is fed (a packed flush's columns, or the tuples)
ref = [(D.Decomposition(), D.ModuleTable(step=k)) for k in range(1, STEPS + 2)]
col = [(D.FoldedDecomposition(MOD), D.FoldedModuleTable(MOD, step=k)) for k in range(1, STEPS + 2)]
seen = {"packed": 0, "rows": 0}
c0, p0 = D.DecomposeSink.consume, D.DecomposeSink.consume_packed
def consume(self, rows, first_id):
    seen["rows"] += 1
    for dec, mods in ref + col:
        D.feed_steps(rows, dec, mods)
    return c0(self, rows, first_id)
def consume_packed(self, packed, first_id):
    seen["packed"] += packed.mods is not None
    for dec, mods in ref:
        D.feed_steps(PackedRows(packed.n, packed.blob, None, None).rows(), dec, mods)  # the tuples of its bytes
    for dec, mods in col:
        D.feed_packed(packed, dec, mods)
    return p0(self, packed, first_id)
D.DecomposeSink.consume, D.DecomposeSink.consume_packed = consume, consume_packed
from examples.transformer import GPT
msmemscope.config(output=sys.argv[1], analysis="decompose", collect_mode="immediate")
model = GPT(vocab=128, d=64, heads=2, layers=2, ctx=32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 128, (4, 33)); x, y = data[:, :-1], data[:, 1:]
for _ in range(STEPS):
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward(); opt.step()
msmemscope.stop()
out = []
for (rd, rm), (cd, cm) in zip(ref, col):
    for t in (rd, rm, cd, cm):
        if t.rows_since_step if hasattr(t, "rows_since_step") else False:
            t.end_step(None)
    out.append([json.dumps(rd.result()) == json.dumps(cd.result()), json.dumps(rm.result()) == json.dumps(cm.result()),
                bool(rm.result())])
print(json.dumps({"seen": seen, "same": out}))
'''


def test_a_packed_flushs_columns_fold_as_its_rows(tmp_path):
    """The flushes taken with their labels as columns fold (``Fold.feed_columns``) into the
    decomposition and the module table of every step as the row tuples of their bytes fold into
    the Python ones (GPT, AdamW, a flush per step, the module table of each step kept)."""
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"
    r = subprocess.run([sys.executable, "-c", SHADOW, str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["seen"]["packed"] >= 3, got
    assert all(d and m for d, m, _ in got["same"]), got
    assert sum(nonempty for *_, nonempty in got["same"]) >= 5, got  # each step's table has modules
    [folder] = run_folders(tmp_path / "out")
    check_invariants(read(dump_of(folder)))
