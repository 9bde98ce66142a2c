"""With ``--analysis=decompose`` on the native source, the owner labels and modules are given to the
records as they are drained (session.py ``_drain_labelled``, the native ``label_batch``): the row
tuples and the marshal bytes the writer gets are made once, labelled, and no row is rewritten.
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
    if step >= 1:
        describe.describer(kept[step - 1], owner="late")  # its row written at an earlier flush: an OWNER row
if sys.argv[1] == "thread":
    side.join()
'''


def _labelled_flushes(folder):
    [log] = glob.glob(os.path.join(folder, "msmemscope_logs", "*.log"))
    with open(log) as f:
        got = re.findall(r"trace stopped \(\d+ flushes so far, \d+ of them .*?, (\d+) with the labels", f.read())
    return int(got[-1])


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
        n = _labelled_flushes(folder)
        assert (n > 5) if labels == "drain" else (n == 0), n
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
