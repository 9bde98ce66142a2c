"""A torchrun job under the launcher: one folder per rank, each complete."""
import os
import shutil
import sys

import pytest

from conftest import FULL, ROOT, check_invariants, config_of, dump_of, read, run_cli, run_folders


@pytest.mark.skipif(not FULL, reason="long form: make test checks the same of every rank of the DDP job in "
                    "test_summary.py::test_ddp_four_ranks_one_leaks")
def test_torchrun_two_ranks(out_dir):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch"
    r = run_cli(["-o", str(out_dir), torchrun, "--standalone", "--nproc_per_node=2",
                 os.path.join(ROOT, "tests", "scripts", "ddp_rank.py")], timeout=300)
    assert r.returncode == 0, r.stderr
    folders = run_folders(out_dir)
    assert len(folders) == 2, folders  # the ranks, not torchrun's agent
    cfgs = [config_of(f) for f in folders]
    assert sorted(c["rank"] for c in cfgs) == [0, 1]
    assert all(c["world_size"] == 2 for c in cfgs)
    for f in folders:
        df = read(dump_of(f))
        check_invariants(df)
        assert df.filter(df["event_type"] == "STEP").height == 3
