"""Step boundaries that share a flush (Session._may_wait, STEP_FLUSH_S): with the default events on
the native source, boundaries closer together than STEP_FLUSH_S are flushed together. The dump, the
leak findings and the checkpointed findings must be those of a flush at every boundary
(``MSMEMSCOPE_STEP_FLUSH_S=0``), for a program whose blocks leak, outlive a step by one and are freed
within a later step of the same flush; a boundary whose flush waits reaches the dump when the
program goes quiet, also when it is killed then."""
import json
import os
import signal
import subprocess
import sys

import polars as pl
import pytest

from conftest import check_invariants, dump_of, env_for_tests, full, read, run_folders
from msmemscope.capture import native
from msmemscope.analysis.decompose import EVENTS, MODULE_COLUMNS_READ, module_table, summarize
from msmemscope.io.reader import read_dump

pytestmark = pytest.mark.skipif(native.load_module() is None,
                                reason="the native module is not built (python -m msmemscope.capture.native build)")

# the model, optimizer and lists of both programs below
SETUP = r"""
import json, sys, time, torch, msmemscope
from msmemscope import capture
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
kept, late = [], []
steps = int(sys.argv[1])
"""

PROG = SETUP + r"""
for i in range(steps):
    loss = m(torch.randn(16, 32)).sum()
    loss.backward(); opt.step(); opt.zero_grad()
    kept.append(torch.ones(64 * (i + 1)))     # a site that grows every step: a leak
    late.append(torch.ones(48))                # lives two steps, then freed inside a later step
    if len(late) > 2:
        late.pop(0)
    if i % 7 == 3:
        time.sleep(0.02)                       # some boundaries far enough apart to flush alone
    msmemscope.step()
s = capture.current()
print(json.dumps({"flushes": s._flushes, "steps": steps}))
if sys.argv[2] == "kill":
    time.sleep(float(sys.argv[3]))
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
"""

STABLE = ["id", "event", "event_type", "name", "device", "alloc_id", "size", "used", "owner"]


def run(tmp_path, name, steps, flush_s, end="exit", quiet=0.0, analysis="leaks"):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = str(flush_s)
    env["MSMEMSCOPE_SOURCE"] = "native"
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(out), f"--analysis={analysis}",
                        sys.executable, str(prog), str(steps), end, str(quiet)],
                       env=env, capture_output=True, text=True, timeout=300)
    [folder] = run_folders(out)
    return r, folder


def leaks_of(folder):
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    for k in ("leaks", "retained"):
        for lk in res[k]:
            lk.pop("address", None)
            lk.pop("addr", None)
    return res


def inefficient_of(folder):
    with open(os.path.join(folder, "analysis", "inefficient.json")) as f:
        res = json.load(f)
    res.pop("dump", None)  # the run's own path
    return res


@pytest.mark.parametrize("analysis", full(["leaks,inefficient"], ["leaks", "leaks,inefficient"]))
def test_shared_flushes_give_the_findings_and_dump_of_a_flush_per_step(tmp_path, analysis):
    got = {}
    for name, flush_s in (("shared", 0.5), ("each", 0)):
        r, folder = run(tmp_path, name, 40, flush_s, analysis=analysis)
        assert r.returncode == 0, r.stderr
        counts = json.loads(r.stdout.strip().splitlines()[-1])
        with open(os.path.join(folder, "config.json")) as f:
            assert json.load(f)["source"] == "native"
        df = read(dump_of(folder))
        check_invariants(df)
        got[name] = (counts, df, leaks_of(folder))
        if "inefficient" in analysis:  # the access events' analysis folds the same rows in the same order
            assert df.filter(pl.col("event") == "ACCESS").height > 0
            got[name] += (inefficient_of(folder),)
    (c_shared, df_shared, lk_shared), (c_each, df_each, lk_each) = got["shared"][:3], got["each"][:3]
    if "inefficient" in analysis:
        assert got["shared"][3] == got["each"][3]
        assert got["shared"][3]["blocks"] > 0, got["shared"][3]
    # the boundaries did share flushes, and the other run flushed at each of them
    assert c_each["flushes"] >= 40
    assert c_shared["flushes"] < 20
    assert df_shared.select(STABLE).equals(df_each.select(STABLE))
    assert df_shared.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height == 40
    # the same findings: the leak, the blocks freed inside a later step of a shared flush judged
    # as live at the end of the step they outlived
    assert lk_shared == lk_each
    assert lk_shared["steps_ended"] == 40
    assert lk_shared["sites"], lk_shared
    freed_later = [lk for lk in lk_shared["leaks"] + lk_shared["retained"] if lk.get("freed_at_step")]
    assert freed_later, "the blocks that outlive a step and are freed later are found in both"


@pytest.mark.parametrize("end,analysis", full([("kill", "leaks,decompose")],  # (exit: the shared flushes' tests)
                                              [("kill", "leaks"), ("exit", "leaks"), ("kill", "leaks,decompose")]))
def test_a_waiting_boundary_reaches_the_dump_when_the_program_goes_quiet(tmp_path, end, analysis):
    """Killed (SIGKILL, no exit handler) 3 x STEP_FLUSH_S after its last step, the program's dump
    has every step: the flusher thread wrote the boundaries that waited. With decompose, with the
    owners the step ends kept (the flusher's own thread runs no model, so it walks nothing)."""
    flush_s = 0.2
    r, folder = run(tmp_path, "out", 12, flush_s, end, quiet=3 * flush_s, analysis=analysis)
    if end == "kill":
        assert r.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), r.stderr  # the launcher says 137
        from msmemscope.io import spool
        assert spool.wait_for_writer(dump_of(folder), timeout=60)
    else:
        assert r.returncode == 0, r.stderr
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts["flushes"] < 12  # they waited (the last ones flushed by the thread, after this print)
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps.height == 12
    # the checkpointed findings were saved with the rows: the leak is on disk without an exit
    res = leaks_of(folder)
    assert res["steps_ended"] == 12
    if "decompose" in analysis:  # every block labelled; each step's 4 gradients (zero_grad frees
        # them before msmemscope.step(): labelled at the optimizer's step) with their modules
        m = df.filter(pl.col("event") == "MALLOC")
        assert m["owner"].str.starts_with("PTA@").all(), m["owner"].unique().to_list()
        grads = read_dump(dump_of(folder), columns=("event", "owner", "module"), events=("MALLOC",)).filter(
            pl.col("owner") == "PTA@gradient")
        assert grads.height == 4 * 12, grads.height
        assert set(grads["module"]) == {"Sequential.0", "Sequential.2"}, grads["module"].unique().to_list()


DECOMPOSE = SETUP + r"""
import msmemscope.describe as describe

def flush_inside(grad):                        # a flush inside step 10's backward: this gradient's
    if i == 10:                                # block is made, it is not yet the weight's .grad
        capture.current().flush()
    return grad

m[2].weight.register_hook(flush_inside)
for i in range(steps):
    opt.zero_grad()                            # the last step's gradients: live at its end, freed now
    loss = m(torch.randn(16, 32)).sum()
    loss.backward(); opt.step()
    kept.append(torch.ones(64 * (i + 1)))     # a site that grows every step
    late.append(torch.ones(48))                # lives two steps, then freed inside a later step
    if len(late) > 2:
        late.pop(0)
    if i == 5:
        extra = torch.zeros(100)               # an op's block at the end of step 5 ...
    if i == 8:
        m.register_buffer("extra", extra)      # ... the model's from step 8: its label changes
    if i == 11:
        describe.describer(kept[3], owner="tagged")  # a user label on a block of step 3
    if i == 14:
        m.add_module("head", torch.nn.Linear(8, 4))  # a module made between two forwards, run from the next
    if i == 18 and sys.argv[2] == "watch":
        msmemscope.watcher.watch(kept[0], name="kept0", dump_nums=100)  # the dispatch-mode source from here
    if i % 7 == 3:
        time.sleep(0.02)                       # some boundaries far enough apart to flush alone
    msmemscope.step()
print(json.dumps({"flushes": capture.current()._flushes, "steps": steps}))
"""


# make test: decompose alone with only some steps recorded (the full run has each apart)
@pytest.mark.parametrize("analysis,watch,steps", full(
    [("leaks,decompose", "watch", "")],  # (make test's time)
    [("leaks,decompose", "", ""), ("decompose", "", ""), ("leaks,decompose", "watch", ""),
     ("leaks,decompose", "", "3,9,10,11,20"), ("decompose", "", "3,9,10,11,20")]))
def test_decompose_with_shared_flushes_labels_as_a_flush_per_step(tmp_path, analysis, watch, steps):
    """--analysis=decompose on the native source: boundaries share flushes too, with the owners and
    owning modules kept at each step end (a gradient the next step frees, a block that becomes a
    buffer of the model two steps after it was made, a user label on a block of an earlier step, a
    module made between forwards; with ``watch``, a handover to the dispatch-mode source while
    boundaries wait; with ``steps``, only those steps recorded). The dump's labels, modules and
    OWNER rows and the decomposition (by owner, per step, and by module) are those of a flush at
    every boundary, and those the offline analyses find in the dump."""
    prog = tmp_path / "dec.py"
    prog.write_text(DECOMPOSE)
    got = {}
    for name, flush_s in (("shared", 5), ("each", 0)):
        env = env_for_tests()
        env["MSMEMSCOPE_STEP_FLUSH_S"] = str(flush_s)
        env["MSMEMSCOPE_SOURCE"] = "native"
        r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / name),
                            f"--analysis={analysis}"] + ([f"--steps={steps}"] if steps else []) +
                           [sys.executable, str(prog), "24", watch or "-"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        [folder] = run_folders(tmp_path / name)
        with open(os.path.join(folder, "config.json")) as f:
            assert json.load(f)["source"] == ("native, then dispatch" if watch else "native")
        with open(os.path.join(folder, "analysis", "decompose.json")) as f:
            res = json.load(f)
        full = read(dump_of(folder))
        check_invariants(full)
        # the online decomposition is the offline one of the dump it wrote
        off = json.loads(json.dumps(summarize(full)))
        assert (off["devices"], off["steps"]) == (res["devices"], res["steps"])
        mods = module_table(read_dump(dump_of(folder), columns=MODULE_COLUMNS_READ, events=EVENTS))
        assert json.loads(json.dumps(mods)) == res["modules"]
        df = read_dump(dump_of(folder), columns=STABLE + ["module", "phase"])
        got[name] = (json.loads(r.stdout.strip().splitlines()[-1])["flushes"], df, res)
    (f_shared, df_shared, res_shared), (f_each, df_each, res_each) = got["shared"], got["each"]
    assert f_each >= 24 and f_shared <= (25 - 18 + 3 if watch else 3), (f_shared, f_each)
    cols = STABLE + ["module", "phase"]
    assert df_shared.select(cols).equals(df_each.select(cols))
    assert res_shared == res_each
    m = df_shared.filter(pl.col("event") == "MALLOC")
    grad_modules = set(m.filter(pl.col("owner") == "PTA@gradient")["module"])
    if steps:  # the steps recorded: their gradients made in them, each with its module
        assert grad_modules == {"Sequential.0", "Sequential.2", "Sequential.head"}, grad_modules
        return
    # what the program did is in the dump: the label changes and the modules
    owner_rows = df_shared.filter(pl.col("event_type") == "OWNER")
    assert sorted(owner_rows["owner"].to_list()) == ["PTA@gradient", "PTA@ops@tagged", "PTA@weight"], owner_rows
    assert grad_modules == {"Sequential.0", "Sequential.2", "Sequential.head"}, grad_modules
    assert m.filter((pl.col("owner") == "PTA@weight") & (pl.col("module") == "Sequential.head")).height == 2  # weight, bias
    assert len(res_shared["steps"]) == 24
    # at each step end the gradients are the parameters' size, also after the flush inside step
    # 10's backward (its gradient written as an op's block, an OWNER row before the STEP row)
    grads = {st["step"]: st["bytes"].get("PTA@gradient") for st in res_shared["steps"]}
    assert all(grads[k] == (32 * 64 + 64 + 64 * 8 + 8) * 4 for k in range(1, 15)), grads
    assert grads[24] == (32 * 64 + 64 + 64 * 8 + 8 + 8 * 4 + 4) * 4
    assert res_shared["modules"]["cpu"]["modules"]


def test_killed_right_after_a_waiting_boundary_the_dump_is_whole_up_to_its_last_flush(tmp_path):
    """SIGKILL at once after the last step: the boundaries that waited are lost (at most
    STEP_FLUSH_S of the run), what was flushed before is a valid dump with contiguous IDs, and the
    findings on disk are those of that flush."""
    r, folder = run(tmp_path, "out", 30, 5.0, "kill", quiet=0)
    assert r.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), r.stderr
    from msmemscope.io import spool
    assert spool.wait_for_writer(dump_of(folder), timeout=60)
    df = read(dump_of(folder))
    check_invariants(df)
    assert df["id"].to_list() == list(range(1, df.height + 1))
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height
    assert steps < 30  # a 5 s window: the boundaries after the first flush waited, and were lost
    res = leaks_of(folder) if os.path.exists(os.path.join(folder, "analysis", "leaks.json")) else None
    assert res is None or res["steps_ended"] <= steps


COMBO = r"""
import json, os, signal, sys, threading, time, torch, msmemscope
from msmemscope import capture
done = threading.Event()

def side():  # a thread allocating and freeing inside the steps, across the boundaries
    while not done.is_set():
        x = torch.ones(256); y = x * 2; del x, y
        time.sleep(0.0005)

t = threading.Thread(target=side); t.start()
m = torch.nn.Linear(32, 32); opt = torch.optim.SGD(m.parameters(), lr=0.1)
kept = []
for i in range(30):
    m(torch.randn(8, 32)).sum().backward(); opt.step(); opt.zero_grad()
    kept.append(torch.ones(32 * (i + 1)))
    msmemscope.step()
    if i == 14:  # a stop/start gap after boundaries that waited; a block of the dump freed inside it
        msmemscope.stop(); kept.pop(0); time.sleep(0.05); msmemscope.start()
print(json.dumps({"flushes": capture.current()._flushes}), flush=True)
done.set(); t.join()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
os.kill(os.getpid(), signal.SIGTERM)  # the program's own handler ends it: the exit writes the rest
time.sleep(5)
"""


# the short form: each analysis once, the sources taking turns (make test's time)
@pytest.mark.parametrize("source,analysis", full([("native", "leaks"), ("python", "leaks,decompose")],
                                                 [("native", "leaks"), ("python", "leaks"), ("native", "leaks,decompose"),
                                                  ("python", "leaks,decompose")]))
def test_shared_flushes_with_a_thread_a_gap_and_a_signal(tmp_path, source, analysis):
    """Boundaries that wait, met with a side thread allocating across them, a stop/start gap and
    an exit from the program's SIGTERM handler: every step and the gap's untraced FREE are in a
    dump whose invariants hold. The dispatch-mode source keeps a flush per boundary."""
    prog = tmp_path / "combo.py"
    prog.write_text(COMBO)
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0.5"
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / "o"), f"--analysis={analysis}",
                        sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    flushes = json.loads(r.stdout.strip().splitlines()[-1])["flushes"]
    [folder] = run_folders(tmp_path / "o")
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["source"].startswith("native" if source == "native" else "dispatch")
    df = read(dump_of(folder))
    check_invariants(df)
    assert df["id"].to_list() == list(range(1, df.height + 1))
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps.height == 30
    assert df.filter((pl.col("event") == "FREE") & pl.col("attr").str.contains("untraced")).height >= 1
    assert df.filter(pl.col("event") == "MALLOC")["tid"].n_unique() >= 2  # the side thread's blocks
    if source == "native":
        assert flushes < 15  # boundaries waited (the stop flushed once, the gap's start did not)
    else:
        assert flushes >= 30
    assert leaks_of(folder)["steps_ended"] == 30
    if "decompose" in analysis:  # every step, every block labelled; online is the dump's offline
        with open(os.path.join(folder, "analysis", "decompose.json")) as f:
            res = json.load(f)
        off = json.loads(json.dumps(summarize(df)))
        assert (off["devices"], off["steps"]) == (res["devices"], res["steps"])
        assert [st["step"] for st in res["steps"]][:30] == list(range(1, 31))
        owners = df.filter(pl.col("event") == "MALLOC")["owner"]
        assert owners.str.starts_with("PTA@").all(), owners.unique().to_list()
        grads = df.filter((pl.col("event") == "MALLOC") & (pl.col("owner") == "PTA@gradient"))
        assert grads.height >= 30  # the weight's and bias's, each step


EVERY_ALLOC = r"""
import json, threading, torch, msmemscope
from msmemscope import capture
made = [0]
go = threading.Semaphore(0)

def side():  # blocks of a size nothing else makes, allocated while the main thread ends steps
    for _ in range(200):
        go.acquire()
        for _ in range(4):
            x = torch.empty(777)
            made[0] += 1
            del x

t = threading.Thread(target=side); t.start()
a = torch.ones(16)
for i in range(200):
    a = a + 1               # the step's own work: one op, one block
    go.release()            # 4 blocks of the side thread, made while this thread ends the step
    msmemscope.step()
t.join()
print(json.dumps({"made": made[0], "tid": t.ident}), flush=True)
"""


@pytest.mark.parametrize("flush_s", ["0", "0.1"])
def test_a_thread_allocating_across_step_boundaries_loses_no_block(tmp_path, flush_s):
    """The STEP record goes among the native source's records, under their lock, with no pause of
    the recording: every block a side thread makes while the main thread ends 200 steps is in the
    dump (a pause at each boundary dropped those made inside it), the STEP rows keep the order in
    which things happened (times never go back), and the invariants hold, with a flush at each
    boundary or shared."""
    prog = tmp_path / "every.py"
    prog.write_text(EVERY_ALLOC)
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = "native"
    env["MSMEMSCOPE_STEP_FLUSH_S"] = flush_s
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / "o"), "--analysis=leaks",
                        sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    [folder] = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps.height == 200
    assert steps["attr"].str.extract(r"(\d+)").cast(pl.Int64).to_list() == list(range(1, 201))
    side = df.filter((pl.col("event") == "MALLOC") & (pl.col("size") == 777 * 4))
    assert out["made"] == 800 and side.height == out["made"]
    assert side["tid"].unique().to_list() == [out["tid"]]
    ts = df.filter(pl.col("event").is_in(["MALLOC", "FREE", "OP_LAUNCH", "SYSTEM"])
                   & (pl.col("event_type") != "OWNER"))["ts"]
    assert ts.is_sorted()
    assert leaks_of(folder)["steps_ended"] == 200


WHO_FLUSHES = r"""
import json, threading, time, torch, msmemscope
from msmemscope import capture
s = capture.current()
who = []
flush = s.flush
def noted(*a, **k):
    who.append(threading.current_thread().name)
    return flush(*a, **k)
s.flush = noted
a = torch.ones(16)
for i in range(300):                 # boundaries every ~5 ms: never quiet for STEP_FLUSH_S (0.3 s)
    a = a + 1
    time.sleep(0.005)
    msmemscope.step()
busy = list(who)
time.sleep(1.2)                      # quiet: the last boundaries wait for the flusher thread
print(json.dumps({"busy": busy, "quiet": who[len(busy):], "flushes": s._flushes}), flush=True)
"""


def test_while_boundaries_come_the_program_thread_flushes_and_the_flusher_only_when_quiet(tmp_path):
    """Boundaries closer than STEP_FLUSH_S: the program's own thread flushes at the first one past
    the time (no flush passes the GIL to the flusher thread while steps run); once the program
    goes quiet, the flusher thread flushes what waits. Every step is in the dump either way."""
    prog = tmp_path / "who.py"
    prog.write_text(WHO_FLUSHES)
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = "native"
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0.3"  # a machine's hiccup would have to last that long
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / "o"), "--analysis=leaks",
                        sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["busy"]) >= 3, out                       # the loop runs ~1.5 s: a flush every ~0.3 s
    assert set(out["busy"]) == {"MainThread"}, out
    assert out["quiet"] and set(out["quiet"]) == {"msmemscope-step-flush"}, out
    [folder] = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP"))
    assert steps["attr"].str.extract(r"(\d+)").cast(pl.Int64).to_list() == list(range(1, 301))


BIG_STEPS = r"""
import json, sys, torch, msmemscope
from msmemscope import capture
per_step = int(sys.argv[1])
kept = []
for i in range(12):
    xs = [torch.ones(4) for _ in range(per_step)]  # per_step blocks made and freed in the step
    kept.append(torch.ones(8 * (i + 1)))
    del xs
    msmemscope.step()
s = capture.current()
print(json.dumps({"flushes": s._flushes, "room": s.writer.room_rows(), "per_step": s._rows_per_step}))
"""


@pytest.mark.parametrize("per_step", [20, 3000])
def test_a_step_flush_waits_only_while_its_frame_fits_the_pipe(tmp_path, per_step):
    """Boundaries share a flush only while the frame after the next step still fits in half the pipe
    to the writer process (``SpoolWriter.room_rows``): a frame larger than the pipe made the program
    wait for the writer process to read it. A program of ~6,000 rows a step (~400 KB) flushes at
    every boundary or so, one of ~40 rows a step shares one flush for all, with STEP_FLUSH_S
    far longer than the run; both dumps whole, every step's rows before its STEP row."""
    prog = tmp_path / "big.py"
    prog.write_text(BIG_STEPS)
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "30"
    env["MSMEMSCOPE_SOURCE"] = "native"
    r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / "o"), "--analysis=leaks",
                        sys.executable, str(prog), str(per_step)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    [folder] = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    steps = df.filter(pl.col("event_type") == "STEP")
    assert steps.height == 12
    mallocs = df.filter((pl.col("event") == "MALLOC") & (pl.col("size") == 16)).height
    assert mallocs == 12 * per_step
    if per_step > 1000:
        assert got["room"] is not None and got["per_step"] * 2 > got["room"], got  # two steps do not fit
        assert got["flushes"] >= 11, got
    else:
        assert got["room"] is not None and got["per_step"] * 12 < got["room"], got
        assert got["flushes"] <= 3, got


def test_the_writer_process_doorbell():
    """The writer process's nap ends when the doorbell rings (a frame larger than the pipe's room is
    coming), and a doorbell whose other end closed is let go of, not waited on again (it would be
    ready forever: a busy loop)."""
    from msmemscope.io import spool
    data_r, data_w = os.pipe()
    bell_r, bell_w = os.pipe()
    os.set_blocking(data_r, False)
    saved = spool._bell
    try:
        spool._bell = bell_r
        os.write(bell_w, b"!")
        assert spool._nap(30.0, data_r, False) is True       # rang: returns at once, not after 30 s
        assert spool._nap(0.01, data_r, False) is False       # nothing rang
        os.write(data_w, b"x" * 10)
        assert spool._read_exact(data_r, 10) == b"x" * 10
        os.write(data_w, b"abc")
        os.close(data_w)
        assert spool._read_exact(data_r, 3) == b"abc"
        assert spool._read_exact(data_r, 1) is None           # the stream ended
        os.close(bell_w)
        assert spool._nap(0.01, data_r, False) is False
        assert spool._bell is None                            # let go of, naps alone from here
    finally:
        spool._bell = saved
        for fd in (data_r, bell_r, bell_w):
            try:
                os.close(fd)
            except OSError:
                pass
