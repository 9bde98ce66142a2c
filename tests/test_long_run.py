import json
import os
import subprocess
import sys

from conftest import ROOT, check_invariants, dump_of, env_for_tests, full, read, run_folders

STEPS = full(300, 1000)


def test_thousand_steps_flat_memory(tmp_path):
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "long_run.py"), str(out), str(STEPS)],
                       capture_output=True, text=True, env=env_for_tests(), timeout=600)
    assert r.returncode == 0, r.stderr
    m = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    early, late = m[100], m[STEPS]
    grow = 0.9 * STEPS / 100
    # rows reach the file at every step: nothing piles up in memory
    assert late["rows"] > grow * early["rows"] and late["file"] > grow * early["file"]
    assert late["buffered"] < 50 and early["buffered"] < 50
    assert late["live"] == early["live"]
    # the tracer holds no per-event state: Python heap growth over the steps (~220 events each) stays small
    assert late["traced"] - early["traced"] < 2 << 20, m
    df = read(dump_of(run_folders(out)[0]))
    check_invariants(df)
    assert df.filter(df["event_type"] == "STEP").height == STEPS
