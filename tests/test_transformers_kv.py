"""transformers' KV cache under ``--analysis=decompose`` (the automatic ``Cache.update`` hook):
labelled to the byte, and a compiled ``generate`` left as compiled."""
from __future__ import annotations

import json
import os
import sys

import polars as pl
import pytest

from conftest import check_invariants, dump_of, env_for_tests, read, run_cli, run_folders

PROGS = os.path.join(os.path.dirname(__file__), "progs")


@pytest.mark.parametrize("source,train", [("python", True)] + (  # make test: one (its time)
    [("native", False), ("native", True), ("python", False)] if os.environ.get("MSMEMSCOPE_TEST_FULL") else []))
def test_generate_kv_cache_is_labelled_to_the_byte(tmp_path, source, train):
    """``model.generate`` of a transformers GPT-2 under ``--analysis=decompose`` (the cache hooks
    applied by themselves): every block the cache's ``update`` allocates (DynamicCache grows each
    layer's keys and values by ``torch.cat`` at each token) is ``PTA@ops@transformers@kv_cache``,
    and nothing else is. Its peak is the cache the program holds at the end, measured from the
    cache's own tensors, plus the one tensor the last ``cat`` replaced (it is freed after the new
    one is made). Before, the cache was ``PTA@ops``, the temporaries. With a training step first,
    generation is the run's last, unfinished step (2): the module table of that step is found with
    ``--step=2`` (it was numbered None, and "step None" was printed for a run without boundaries)."""
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    out = tmp_path / "out"
    prog = os.path.join(PROGS, "generate_kv.py")
    r = run_cli(["--analysis=decompose", "--output", str(out), sys.executable, prog, *(["train"] if train else [])],
                env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    truth = json.loads(r.stdout.strip().splitlines()[-1])
    (folder,) = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    kv_label = "PTA@ops@transformers@kv_cache"
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        res = json.load(f)
    kv = res["devices"]["cpu"]["owners"][kv_label]
    per, positions = truth["per_position"], truth["positions"]
    assert kv["peak"] == truth["cache_bytes"] + (positions - 1) * per, (kv, truth)
    assert kv["current"] == truth["cache_bytes"]  # the program still holds the cache it was given
    mallocs = df.filter(pl.col("event") == "MALLOC")
    cache_rows = mallocs.filter(pl.col("owner") == kv_label)
    # one cat per layer's keys and values at each forward (the prompt's, then one per new token)
    assert cache_rows.height == truth["tensors"] * (positions - 16 + 1)
    assert set(cache_rows["name"].to_list()) == {"torch._ops.aten.cat.default"}
    assert set(cache_rows["step"].to_list()) == {2 if train else 1}
    assert mallocs.filter(pl.col("owner").str.contains("kv_cache")).height == cache_rows.height
    if not train:
        assert res["modules"]["cpu"]["step"] == 1
        assert "at the peak of step 1 " in r.stderr
    else:
        off = run_cli(["decompose", "--by=module", "--step=2", "--json", dump_of(folder)])
        assert off.returncode == 0, off.stderr
        table = json.loads(off.stdout)["cpu"]
        assert table["step"] == 2
        # the rows of depth 1 add up to that step's peak (at its start here: the gradients are
        # still held until zero_grad, more than generation adds)
        assert sum(m["total"] for m in table["modules"] if m["depth"] == 1) == table["peak"] > 0
        top = {m["module"]: m for m in table["modules"]}["GPT2LMHeadModel"]
        assert top["at_peak"]["gradients"] > 0 and top["backward_peak"] is None


# make test: the native source (where it raised); the full run adds the dispatch-mode source
@pytest.mark.parametrize("source", ["native", "python"] if os.environ.get("MSMEMSCOPE_TEST_FULL") else ["native"])
def test_generate_compiled_whole_runs_as_compiled_under_the_cache_hooks(tmp_path, source):
    """transformers' documented fast generation: the forward compiled with ``fullgraph=True`` and a
    static cache. The cache hook (``Cache.update``, inside the compiled forward) is the original
    alone where Dynamo traces it: the same tokens, no graph break and the same graphs as the plain
    run. Traced by Dynamo, it raised ``Unsupported`` in the program (native source), and without
    ``fullgraph`` broke the graph at every layer's update (23 breaks, 16 graphs against 0 and 2)."""
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    prog = os.path.join(PROGS, "generate_kv.py")
    out = tmp_path / "out"
    r = run_cli(["--analysis=decompose", "--output", str(out), sys.executable, prog, "compiled"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DYNAMO 0 2" in r.stdout  # no break, the prompt's graph and the one token's (the plain run's)
    if os.environ.get("MSMEMSCOPE_TEST_FULL"):  # (a second compile: the full run only)
        import subprocess
        plain = subprocess.run([sys.executable, prog, "compiled"], env=env, capture_output=True, text=True,
                               timeout=300)
        assert plain.returncode == 0, plain.stderr[-3000:]
        assert r.stdout == plain.stdout
    (folder,) = run_folders(out)
    check_invariants(read(dump_of(folder)))
