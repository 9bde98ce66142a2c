import json
import os

import polars as pl

from conftest import ROOT, dump_of, read, run_cli, run_folders


def test_snapshots_and_oom_snapshot(out_dir):
    r = run_cli(["-o", str(out_dir), os.path.join(ROOT, "tests", "scripts", "snapshots.py")])
    assert r.returncode == 0, r.stderr
    df = read(dump_of(run_folders(out_dir)[0]))
    snaps = df.filter(pl.col("event") == "SNAPSHOT")
    assert snaps["name"].to_list() == ["after x", "work Start", "work End", "OOM_Snapshot"]
    attrs = [json.loads(a) for a in snaps["attr"]]
    for a in attrs:
        assert set(a) == {"reserved", "max_reserved", "allocated", "max_allocated", "total", "free",
                          "device_rate", "reserved_rate"}
        assert a["total"] > a["free"] > 0  # the machine's memory on CPU
        assert a["max_allocated"] >= a["allocated"]
    # allocated follows the pool counter of the dump
    mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
    for sid, a in zip(snaps["id"], attrs):
        before = mem.filter(pl.col("id") < sid)
        assert a["allocated"] == (before["used"][-1] if before.height else 0)
    assert attrs[2]["allocated"] - attrs[1]["allocated"] == (1 << 18) * 4
