"""The peak of a bounded dump (``--keep-steps``, docs/long-runs.md): a summarised step's peak lies
in rows the writer dropped, and its STEP_SUMMARY row says it (``used_range``, ``total_max``). The
run's exit summary, ``show`` (peak and per-step table), the HTML report's Peak finding and
``decompose --by=module``'s choice of step take it, as the full dump and the online results do.
And the marks' leak check (``check-leaks --mark``) does not say "no leaks" for marks in
summarised steps, whose rows it cannot see."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import warnings

import polars as pl
import pytest

from conftest import check_invariants, dump_of, env_for_tests, read, run_folders

MB = 1048576
BIG = 4 * MB      # the temporary made and freed inside one step: the run's peak
STEPS, PEAK_STEP = 8, 3

TRAIN = f"""
import torch, msmemscope
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for i in range({STEPS}):
    if i + 1 == {PEAK_STEP}:
        tmp = torch.empty({BIG} // 4)  # float32: {BIG} bytes, freed before the step ends
        tmp.fill_(1.0)
        total = float(tmp.sum())       # nothing made meanwhile outlives the step
        del tmp
    loss = model(torch.randn(32, 64)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    msmemscope.step()
print("ok")
"""

MARKS = """
import torch, msmemscope
# per step: marks A, B, C ("M"); a block made between A and B is freed after C, in the same step
for i in range(8):
    msmemscope.mark("M")
    t = torch.ones(1000)
    msmemscope.mark("M")
    u = torch.ones(10)
    msmemscope.mark("M")
    del t
    msmemscope.step()
print("ok")
"""


def _launch(tmp_path, text, ways):
    """``text`` run under the launcher once per way (name -> extra options), side by side:
    {name: (run folder, the launcher's stdout + stderr, its dump read and checked)}."""
    prog = tmp_path / "prog.py"
    prog.write_text(text)
    env = env_for_tests()
    procs = {name: subprocess.Popen([sys.executable, "-m", "msmemscope", "-o", str(tmp_path / name), *args,
                                     sys.executable, str(prog)], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name, args in ways.items()}
    got = {}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        [folder] = run_folders(tmp_path / name)
        df = read(dump_of(folder))
        check_invariants(df)
        got[name] = (folder, out, df)
    return got


def _command(args) -> tuple[int, str, str]:
    """An offline command run in this process (as ``msmemscope <args>``): status, stdout, stderr."""
    import importlib
    from msmemscope.cli import SUBCOMMANDS
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = importlib.import_module(SUBCOMMANDS[args[0]]).main(list(args[1:]))
    return rc, buf.getvalue(), err.getvalue()


def _said_peak(text) -> str:
    m = re.search(r"Peak allocated: device cpu pool PTA: ([0-9.]+) MB", text)
    assert m, text[-2000:]
    return m.group(1)


def _show_steps(text) -> dict:
    """show's per-step table: step -> peak (MB text) of cpu PTA."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if len(cells) == 6 and cells[0].rstrip("*").isdigit() and cells[1] == "cpu" and cells[2] == "PTA":
            out[int(cells[0].rstrip("*"))] = cells[3].split()[0]
    return out


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peaks")
    return _launch(tmp, TRAIN, {"full": ["--analysis=leaks,decompose"],
                                "bounded": ["--analysis=leaks,decompose", "--keep-steps=2"]})


def _truth(train_runs):
    """The full dump's peak of cpu PTA and its step, checked against what the program allocates."""
    _, _, full = train_runs["full"]
    mem = full.filter(pl.col("event").is_in(["MALLOC", "FREE"]) & (pl.col("event_type") == "PTA"))
    peak = int(mem["used"].max())
    step = int(mem.filter(pl.col("used") == peak)["step"].min())
    assert BIG <= peak < BIG + MB and step == PEAK_STEP  # the temporary on top of a small model
    return peak, step


def test_bounded_dump_summarises_the_peak_step(train_runs):
    """The setting of the tests below: the peak's step is summarised in the bounded dump, and its
    kept rows do not show the peak (the temporary's rows were dropped)."""
    peak, step = _truth(train_runs)
    _, _, b = train_runs["bounded"]
    assert step in set(b.filter(pl.col("event_type") == "STEP_SUMMARY")["step"].to_list())
    assert b.filter(pl.col("event").is_in(["MALLOC", "FREE"]))["used"].max() < BIG


def test_exit_summary_and_show_give_the_full_dumps_peak(train_runs):
    peak, step = _truth(train_runs)
    want = f"{peak / MB:.3f}"
    for name in ("full", "bounded"):
        folder, out, _ = train_runs[name]
        with open(os.path.join(folder, "analysis", "peaks.json")) as f:
            online = json.load(f)["peaks"]
        assert [p["peak_allocated"] for p in online if p["pool"] == "PTA"] == [peak]
        assert _said_peak(out) == want, (name, out[-1500:])             # the exit summary
        # what the ops allocated counts the kept rows only: said so where steps were summarised
        assert ("The ops that allocated most (in the rows kept:" in out) == (name == "bounded"), out[-1500:]
        rc, shown, err = _command(["show", folder])
        assert rc == 0, err
        assert _said_peak(shown) == want, name
        per = _show_steps(shown)
        assert per[step] == want, (name, per)                          # the per-step table
        assert max(per, key=lambda s: (float(per[s]), -s)) == step


def test_report_peak_finding_is_the_full_dumps(train_runs):
    from msmemscope.report import html
    peak, step = _truth(train_runs)
    got = {}
    for name in ("full", "bounded"):
        folder, _, _ = train_runs[name]
        page = html.build(folder)
        [pk] = [f for f in page["findings"] if f["kind"] == "peak"]
        assert pk["raw"]["peak_bytes"] == peak, (name, pk["text"])
        assert f"(step {step}" in pk["text"], pk["text"]
        s = page["series"][page["main"]]
        assert s["peak"] == peak and s["peak_step"] == step
        got[name] = pk["text"]
    assert "summarised" in got["bounded"] and "summarised" not in got["full"]


def test_decompose_by_module_picks_the_step_of_the_peak(train_runs):
    peak, step = _truth(train_runs)
    for name in ("full", "bounded"):
        folder, _, _ = train_runs[name]
        with open(os.path.join(folder, "analysis", "decompose.json")) as f:
            online = json.load(f)["modules"]["cpu"]
        assert (online["step"], online["peak"]) == (step, peak), name
        rc, out, err = _command(["decompose", "--by=module", "--json", folder])
        assert rc == 0, err
        t = json.loads(out)["cpu"]
        assert (t["step"], t["peak"]) == (step, peak), name
        assert bool(t.get("summarised")) == (name == "bounded")


def test_marks_leak_check_in_summarised_steps_cannot_tell(tmp_path):
    """Marks in summarised steps: the full dump reports the block made between A and B and freed
    after C; the bounded one cannot see it (its rows were dropped) and must not say "no leaks"."""
    from msmemscope.analysis.leaks import MarkError, check_leaks
    runs = _launch(tmp_path, MARKS, {"full": ["-q"], "bounded": ["-q", "--keep-steps=1"]})
    full, bounded = runs["full"][0], runs["bounded"][0]
    rc, out, err = _command(["check-leaks", "--mark=M", "--start-index=3", full])
    assert rc == 0 and "0.0038 Mb(s) leaked in 1 allocation(s)" in out, out + err
    rc, out, err = _command(["check-leaks", "--mark=M", "--start-index=3", bounded])
    assert rc == 2 and "No memory leaks detected" not in out, out + err
    [line] = err.strip().splitlines()
    assert "summarised" in line and "step 2" in line and "kept whole: 8-9" in line, line
    with pytest.raises(MarkError, match="summarised"):
        check_leaks(bounded, "M", 3, out=io.StringIO())
    # marks in a step kept whole: the same finding on both dumps
    for folder in (full, bounded):
        rc, out, err = _command(["check-leaks", "--mark=M", "--start-index=21", folder])
        assert rc == 0 and "0.0038 Mb(s) leaked in 1 allocation(s)" in out, out + err
