"""A block freed by another thread while a flush runs (after the flush drained the sources, before
the leak rule judged the step ends among its rows) was live at those step ends. The leak rule asked
the tracer which blocks were live *now*: such a block had left the live table, and its FREE row was
not among the flush's rows, so a block that outlived a step was not reported. On the summary of a
DDP job this made one rank look like the only one keeping DDP's rebuilt bucket (a gloo thread
freed it at exit on the others), so that rank was called leaking.

Here the free is made to come exactly then: a sink of the program's, placed before the leak
rule's, drops the block while it consumes the rows of the flush that ends step 3. The online
result must equal the same rule run offline over the written dump."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import check_invariants, dump_of, full, read, run_folders, source_env
from msmemscope.analysis.leaks import replay
from msmemscope.capture import native

PROG = r"""
import json, sys, threading, torch, msmemscope
from msmemscope import capture
from msmemscope.events import ATTR, EVENT, EVENT_TYPE, Event, System
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
held = {}


class FreesDuringTheFlush:
    # drops the held block inside the flush whose rows end step 3: the sources are drained by then
    name = "frees-during-the-flush"
    batch_steps = True
    # "...-packed": the flushes may take the native records with no row tuple (this sink reads the
    # rows made from their bytes): the leak rule then reads columns
    takes_packed = sys.argv[-1].endswith("-packed")

    def consume_packed(self, packed, first_id):
        self.consume(packed.rows(), first_id)

    def consume(self, rows, first_id):
        for r in rows:
            a = r[ATTR]
            if (r[EVENT] == Event.SYSTEM and r[EVENT_TYPE] == System.STEP and isinstance(a, dict)
                    and a.get("step", 0) >= 3 and "block" in held):
                if sys.argv[-1].startswith("thread"):  # freed by another thread while this one flushes
                    t = threading.Thread(target=held.pop, args=("block",))
                    t.start()
                    t.join()
                else:
                    del held["block"]
                print("FREED IN THE FLUSH ENDING STEP", a["step"], flush=True)
                return

    def step_end(self, session, step):
        pass

    def close(self, session):
        pass


traced = capture.current() is not None
if traced:
    capture.current().sinks.insert(0, FreesDuringTheFlush())
losses = []
for i in range(6):
    loss = m(torch.randn(16, 32)).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
    losses.append(round(loss.item(), 6))
    if i == 1:
        held["block"] = torch.ones(3000)  # made in step 2; kept past step 3's end, then freed
    msmemscope.step()
print(json.dumps({"losses": losses}))
"""

_PLAIN: list = []
CASES = [("native", "0", "sink"), ("python", "0.1", "sink"), ("native", "0", "thread-packed")] + full(
    [], [("native", "0.1", "sink"), ("python", "0", "sink"), ("native", "0.1", "thread"), ("python", "0", "thread"),
         ("native", "0.1", "sink-packed"), ("native", "0", "thread")])


def _retained(res):
    return sorted((r["alloc_id"], r["size"], r["step"], r["detected_at_step"]) for r in res["retained"] + res["leaks"])


@pytest.mark.parametrize("source,flush_s,who", CASES)
def test_a_block_freed_during_the_flush_that_judges_its_step_is_still_found(tmp_path, source, flush_s, who):
    if source == "native" and native.load_module() is None:
        pytest.skip("the native module is not built")
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    env = source_env(source, MSMEMSCOPE_STEP_FLUSH_S=flush_s)
    if not _PLAIN:  # the program's own output, untraced (the same for every case)
        plain = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
        assert plain.returncode == 0, plain.stderr[-3000:]
        _PLAIN.append(json.loads(plain.stdout)["losses"])
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(out), "--analysis=leaks",
                        sys.executable, str(prog), who], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(ln)["losses"] for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert losses == _PLAIN
    # with shared flushes the one ending step 3 may be the last (at exit), after the program printed
    assert "FREED IN THE FLUSH ENDING STEP" in r.stdout, r.stdout
    [folder] = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    if who.endswith("-packed") and flush_s == "0":  # a flush a step: the flush ending step 3 is packed
        [log] = glob.glob(os.path.join(folder, "msmemscope_logs", "*.log"))
        with open(log) as f:
            packed = re.findall(r"trace stopped \(\d+ flushes so far, (\d+) of them", f.read())
        assert packed and int(packed[-1]) >= 3, packed
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        online = json.load(f)
    # the held block: 12,000 B made in step 2, live when step 3 ended
    assert [x for x in _retained(online) if x[1] == 12000 and x[2] == 2 and x[3] == 3], online["retained"]
    offline = replay(df).results()
    as_json = {k: [{"alloc_id": b["alloc_id"], "size": b["size"], "step": b["step"],
                    "detected_at_step": b["detected_at_step"]} for b in offline[k]] for k in ("leaks", "retained")}
    assert _retained(online) == _retained(as_json)
