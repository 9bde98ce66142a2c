"""CUDA paths: run only where a GPU is present; CI skips them."""
import os

import polars as pl
import pytest
import torch

from conftest import EXAMPLES, check_invariants, dump_of, read, run_cli, run_folders

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_cuda_training_dump(out_dir):
    r = run_cli(["-o", str(out_dir), "--events=alloc,free,launch,access", os.path.join(EXAMPLES, "transformer.py"),
                 "--steps", "3", "--device", "cuda"])
    assert r.returncode == 0, r.stderr
    [folder] = run_folders(out_dir)
    assert os.path.basename(folder).endswith("_cuda")
    df = read(dump_of(folder))
    check_invariants(df)
    m = df.filter((pl.col("event") == "MALLOC") & (pl.col("device") == "0"))
    assert m.height > 0
    assert (m["total"] >= m["used"]).all()  # reserved by the caching allocator covers what is allocated


def test_cuda_losses_identical(out_dir):
    import subprocess
    import sys
    from conftest import env_for_tests
    path = os.path.join(EXAMPLES, "mlp.py")
    plain = subprocess.run([sys.executable, path, "--device", "cuda"], capture_output=True, text=True,
                           env=env_for_tests()).stdout
    traced = run_cli(["-o", str(out_dir), path, "--device", "cuda"]).stdout
    assert plain and plain == traced
