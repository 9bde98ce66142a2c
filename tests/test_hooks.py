"""One-click framework hooks (issue 8, SPEC §4.8): init_framework_hooks / cleanup_framework_hooks.

Real runs for PyTorch FSDP2 (2 gloo ranks) and a transformers Trainer; vLLM, vllm_ascend
and verl cannot be installed here, so their table entries are exercised on stand-in
modules with the real dotted names and signatures (tests/progs/hooks_standins.py), and
``test_patch_points_exist_in_sources`` checks every entry against the real sources when
MSMEMSCOPE_HOOK_SOURCES names folders holding them (unpacked wheels or checkouts)."""
from __future__ import annotations

import ast
import glob
import json
import os
import shutil
import sys

import polars as pl
import pytest

from conftest import check_invariants, dump_of, env_for_tests, read, run_cli, run_folders

PROGS = os.path.join(os.path.dirname(__file__), "progs")
sys.path.insert(0, PROGS)


def json_lines(text):
    out = []
    for ln in text.replace("}{", "}\n{").splitlines():
        if ln.startswith('{"'):
            out.append(json.loads(ln))
    return out


def snapshots(df):
    return df.filter(pl.col("event") == "SNAPSHOT")["name"].to_list()


# ------------------------------------------------------------------ real runs
def test_fsdp2_two_ranks_hooks(out_dir):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed")
    env = env_for_tests()
    env["PATH"] = os.path.dirname(torchrun) + os.pathsep + env.get("PATH", "")
    # no --analysis: the hooks alone turn the labels on
    r = run_cli(["--output", str(out_dir), "torchrun", "--standalone", "--nproc_per_node=2",
                 os.path.join(PROGS, "hooks_fsdp2.py")], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = json_lines(r.stdout)
    truths = {t["rank"]: t for t in lines if "local_bytes" in t}
    assert sorted(truths) == [0, 1]
    assert [t["restored"] for t in lines if "restored" in t] == [True, True]
    from msmemscope.analysis.decompose import summarize
    folders = run_folders(out_dir)
    assert len(folders) == 2
    for folder in folders:
        rank = json.load(open(os.path.join(folder, "config.json")))["rank"]
        t = truths[rank]
        local, n = t["local_bytes"], t["n_params"]
        assert 2 * local == t["full_bytes"]
        df = read(dump_of(folder))
        check_invariants(df)
        res = json.loads(json.dumps(summarize(df)))
        ends = [s for s in res["steps"] if s["step"] is not None]
        assert [s["step"] for s in ends] == [1, 2, 3]
        for s in ends:
            b = s["bytes"]
            assert b["PTA@weight@fsdp2@sharded"] == local, (rank, b)
            assert b["PTA@gradient@fsdp2@sharded"] == local, (rank, b)
            assert b["PTA@optimizer_state"] == 2 * local + 4 * n, (rank, b)
            assert b.get("PTA@weight@fsdp2@unsharded", 0) == 0
            assert s["peak"]["PTA@weight@fsdp2@unsharded"] > 0 and s["peak"]["PTA@gradient@fsdp2@unsharded"] > 0
            assert s["peak"]["PTA@ops@fsdp2@all_gather"] > 0
            assert any(k.startswith("PTA@activation") for k in s["peak"]), s["peak"]
        owners = res["devices"]["cpu"]["owners"]
        assert owners["PTA@weight@fsdp2@unsharded"]["peak"] >= (128 * 128 + 128) * 4
        # snapshots: every FSDP2 transition has a Start and an End, in pairs, each step
        names = snapshots(df)
        for m in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            starts, ends_ = names.count(f"fsdp2@{m} Start"), names.count(f"fsdp2@{m} End")
            assert starts == ends_ and starts >= 3, (m, starts, ends_)


def run_trainer(out_dir, tmp_path, *flags, auto=False):
    env = env_for_tests()
    if auto:
        env["HOOKS_AUTO"] = "1"
    r = run_cli([*flags, "--output", str(out_dir), os.path.join(PROGS, "hooks_trainer.py"),
                 str(tmp_path / "trainer")], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = [x for x in json_lines(r.stdout) if "steps" in x]
    (folder,) = run_folders(out_dir)
    df = read(dump_of(folder))
    check_invariants(df)
    return res, df, folder


def owners_of(df):
    from msmemscope.analysis.decompose import summarize
    return json.loads(json.dumps(summarize(df)))["devices"]["cpu"]["owners"]


def test_trainer_hooks(out_dir, tmp_path):
    pytest.importorskip("transformers")
    res, df, _ = run_trainer(out_dir, tmp_path)
    assert res["steps"] == 3
    assert res["patched"] == {"training_step": True, "evaluate": True, "_save_checkpoint": True}
    assert res["restored"] is True
    names = snapshots(df)
    assert names.count("transformers@train_step Start") == 3 and names.count("transformers@train_step End") == 3
    assert names.count("transformers@save_checkpoint Start") == 1 and names.count("transformers@save_checkpoint End") == 1
    assert names.count("transformers@evaluate Start") == 1 and names.count("transformers@evaluate End") == 1
    # each training step's snapshots come before that step's boundary
    ev = df.filter(pl.col("event").is_in(["SNAPSHOT", "SYSTEM"]))
    seq = [n if e == "SNAPSHOT" else t for e, t, n in ev.select("event", "event_type", "name").iter_rows()]
    seq = [x for x in seq if x in ("transformers@train_step End", "STEP")]
    assert seq == ["transformers@train_step End", "STEP"] * 3
    owners = owners_of(df)
    assert owners["PTA@activation@transformers@train_step"]["peak"] > 0
    assert owners["PTA@ops@transformers@train_step"]["peak"] > 0
    assert owners["PTA@ops@transformers@evaluate"]["peak"] > 0
    # gradients are made inside training_step: labelled with it; weights exist before it
    assert any(o.startswith("PTA@gradient@transformers@train_step") for o in owners)
    assert "PTA@weight" in owners
    # allocations inside training_step are labelled (the first step's rows between its snapshots)
    ids = df.filter(pl.col("name").is_in(["transformers@train_step Start", "transformers@train_step End"]))["id"]
    inside = df.filter((pl.col("event") == "MALLOC") & (pl.col("id") > ids[0]) & (pl.col("id") < ids[1]))
    assert inside.height > 0
    assert all("@transformers@train_step" in o for o in inside["owner"].to_list())


def test_trainer_automatic_under_decompose(out_dir, tmp_path):
    """--analysis=decompose applies the hooks of frameworks imported after tracing started."""
    pytest.importorskip("transformers")
    res, df, folder = run_trainer(out_dir, tmp_path, "--analysis=decompose", auto=True)
    assert res["patched"] == {"training_step": True, "evaluate": True, "_save_checkpoint": True}
    assert res["restored"] is True
    assert snapshots(df) == []     # automatic hooks are decompose hooks only
    with open(os.path.join(folder, "analysis", "decompose.json")) as f:
        online = json.load(f)["devices"]["cpu"]["owners"]
    assert online["PTA@activation@transformers@train_step"]["peak"] > 0
    assert online["PTA@ops@transformers@evaluate"]["peak"] > 0


def test_standins_vllm_and_verl_run(out_dir):
    import hooks_standins as hs
    r = run_cli(["--output", str(out_dir), os.path.join(PROGS, "hooks_standins.py")])
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json_lines(r.stdout)
    assert res["restored"] is True and res["dispatch_kept"] is True
    df = read(dump_of(run_folders(out_dir)[0]))
    check_invariants(df)
    owners = owners_of(df)
    f4 = 4
    attn = 2 * f4
    for s in hs.ATTN_SHAPE:
        attn *= s
    mamba = sum(a * b for a, b in hs.MAMBA_SHAPES) * f4
    assert owners["PTA@weight@vllm@weights"]["peak"] == res["weight_bytes"]
    assert owners["PTA@ops@vllm@kv_cache@attn"]["peak"] == attn
    assert owners["PTA@ops@vllm@kv_cache@mamba"]["peak"] == mamba
    assert owners["PTA@ops@vllm@cuda_graph"]["peak"] >= hs.GRAPH_POOL * f4
    assert owners["PTA@ops@vllm@activation"]["peak"] > 0
    assert owners["PTA@ops@vllm@profile_run"]["peak"] > 0
    assert owners["PTA@ops@verl@actor_rollout@init_model"]["peak"] == 256 * f4
    assert owners["PTA@ops@verl@critic@init_model"]["peak"] == 128 * f4
    names = snapshots(df)
    for label in ("vllm@load_model", "vllm@profile_run", "vllm@kv_cache", "vllm@cuda_graph"):
        assert names.count(f"{label} Start") == names.count(f"{label} End") == 1, label
    assert names.count("vllm@execute_model Start") == 2
    assert names[names.index("verl@task_runner@run Start") + 1] == "verl@actor_rollout@init_model Start"
    assert names[-1] == "verl@task_runner@run End"
    assert names.count("verl@actor_rollout@generate_sequences Start") == 2
    assert names.count("verl@ref@compute_ref_log_prob End") == 2
    for role, m in (("critic", "update_critic"), ("reward", "compute_rm_score")):
        assert names.count(f"verl@{role}@{m} Start") == 1


# ------------------------------------------------------------------ in process: table, errors, cleanup
STANDIN_ROOTS = ("vllm", "vllm_ascend", "verl")


@pytest.fixture
def hooks():
    import msmemscope.integrations as I
    I.cleanup_framework_hooks()
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in STANDIN_ROOTS}
    yield I
    I.cleanup_framework_hooks()
    for k in [k for k in sys.modules if k.split(".")[0] in STANDIN_ROOTS]:
        del sys.modules[k]
    sys.modules.update(saved)


@pytest.mark.parametrize("args, why", [
    (("tensorflow", "2.0", "x", "decompose"), "unknown framework"),
    (("vllm", "0.11.0", "scheduler", "decompose"), "unknown component"),
    (("vllm", "0.11.0", "worker", "profile"), "hook_type must be one of"),
    (("vllm_ascend", "5.0", "worker", "decompose"), "version 5.0 not supported"),
    (("verl", "0.2.0", "critic", "snapshot"), "version 0.2.0 not supported"),
    (("pytorch", "2.13.0", "fsdp3", "snapshot"), "unknown component"),
])
def test_unsupported_combination_is_one_line_error(hooks, args, why):
    with pytest.raises(ValueError) as e:
        hooks.init_framework_hooks(*args)
    msg = str(e.value)
    assert "\n" not in msg and why in msg
    for f, v, c, h in hooks.supported():
        assert f"{f} {v} {c} [{'|'.join(h)}]" in msg
    assert hooks.applied() == []


def test_vllm_ascend_short_version_and_exact_restore(hooks):
    import hooks_standins as hs
    hs.install_vllm_ascend("0.11.0", layout="worker_v1")
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    from vllm_ascend.worker.worker_v1 import NPUWorker
    before_r, before_w = dict(NPUModelRunner.__dict__), dict(NPUWorker.__dict__)
    done = hooks.init_framework_hooks("vllm_ascend", "11.0", "worker", "decompose")   # the original's "11.0"
    done += hooks.init_framework_hooks("vllm_ascend", "11.0", "worker", "snapshot")
    assert "vllm_ascend.worker.model_runner_v1:NPUModelRunner.initialize_kv_cache_tensors" in done
    assert "vllm_ascend.worker.worker_v1:NPUWorker.execute_model" in done
    assert len(done) == 11
    # inherited methods are patched on the subclass, without touching the base class
    assert "profile_run" in NPUModelRunner.__dict__
    assert NPUModelRunner.profile_run.__wrapped__ is sys.modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner.profile_run
    # the wrappers run without a trace (nothing recorded, results unchanged)
    w = NPUWorker()
    w.load_model()
    w.initialize_from_config(hs.kv_config())
    assert set(w.model_runner.kv_caches_by_layer) == {"layers.0.attn", "layers.1.attn", "layers.2.mixer"}
    hooks.cleanup_framework_hooks()
    assert hooks.applied() == []
    assert dict(NPUModelRunner.__dict__) == before_r and dict(NPUWorker.__dict__) == before_w
    for k, v in before_r.items():
        assert NPUModelRunner.__dict__[k] is v
    for k, v in before_w.items():
        assert NPUWorker.__dict__[k] is v


def test_vllm_ascend_new_layout(hooks):
    import hooks_standins as hs
    hs.install_vllm_ascend("0.13.0", layout="worker")
    done = hooks.init_framework_hooks("vllm_ascend", "0.13.0", "worker", "snapshot")
    assert done and all(t.startswith("vllm_ascend.worker.worker:NPUWorker.") for t in done)


def test_missing_target_is_an_error_and_rolls_back(hooks):
    import hooks_standins as hs
    hs.install_vllm()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker
    del Worker.determine_available_memory     # as if the installed vLLM had renamed it
    before = dict(Worker.__dict__)
    with pytest.raises(ValueError, match="Worker.determine_available_memory does not exist"):
        hooks.init_framework_hooks("vllm", "0.11.0", "worker", "snapshot")
    assert hooks.applied() == [] and dict(Worker.__dict__) == before
    # an optional entry (initialize_kv_cache_tensors, absent in older runners) is skipped
    del GPUModelRunner.initialize_kv_cache_tensors
    done = hooks.init_framework_hooks("vllm", "0.11.0", "worker", "decompose")
    assert len(done) == 5 and not any("initialize_kv_cache_tensors" in t for t in done)


def test_verl_components_and_dispatch_attributes(hooks):
    import hooks_standins as hs
    hs.install_verl("0.6.0")
    import verl.workers.fsdp_workers as fw
    orig = fw.ActorRolloutRefWorker.__dict__["generate_sequences"]
    done = hooks.init_framework_hooks("verl", "0.6.0", "actor_rollout", "snapshot")
    assert sorted(t.rsplit(".", 1)[1] for t in done) == sorted(
        ["init_model", "generate_sequences", "compute_log_prob", "update_actor", "save_checkpoint"])
    g = fw.ActorRolloutRefWorker.__dict__["generate_sequences"]
    assert g is not orig and g._verl_dispatch == "rollout" and g.__wrapped__ is orig
    assert hooks.init_framework_hooks("verl", "0.6.0", "ref", "snapshot") == [
        "verl.workers.fsdp_workers:ActorRolloutRefWorker.compute_ref_log_prob"]
    hooks.cleanup_framework_hooks()
    assert fw.ActorRolloutRefWorker.__dict__["generate_sequences"] is orig


def test_pytorch_and_transformers_restore_identity(hooks):
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    from torch.distributed.fsdp import _flat_param, _runtime_utils
    names = ("pre_forward", "post_forward", "pre_backward", "post_backward")
    orig = [pg.FSDPParamGroup.__dict__[n] for n in names] + [pg.foreach_all_gather, pg.foreach_reduce,
                                                              _flat_param.FlatParamHandle.unshard,
                                                              _runtime_utils._reduce_grad]
    for comp in ("fsdp2", "fsdp1"):
        for h in ("decompose", "snapshot"):
            assert hooks.init_framework_hooks("pytorch", torch.__version__, comp, h)
    assert pg.foreach_reduce is not orig[5] and _runtime_utils._reduce_grad is not orig[7]
    hooks.cleanup_framework_hooks()
    now = [pg.FSDPParamGroup.__dict__[n] for n in names] + [pg.foreach_all_gather, pg.foreach_reduce,
                                                             _flat_param.FlatParamHandle.unshard,
                                                             _runtime_utils._reduce_grad]
    assert all(a is b for a, b in zip(orig, now))
    tr = pytest.importorskip("transformers.trainer")
    acc = pytest.importorskip("accelerate.accelerator")
    o1, o2 = tr.Trainer.__dict__["training_step"], acc.Accelerator.__dict__["backward"]
    hooks.init_framework_hooks("transformers", None, "trainer", "snapshot")
    hooks.init_framework_hooks("accelerate", None, "accelerator", "decompose")
    assert tr.Trainer.__dict__["training_step"] is not o1 and acc.Accelerator.__dict__["backward"] is not o2
    hooks.cleanup_framework_hooks()
    assert tr.Trainer.__dict__["training_step"] is o1 and acc.Accelerator.__dict__["backward"] is o2


def test_import_watcher_patches_modules_imported_later(hooks, tmp_path, monkeypatch):
    """auto_apply (what --analysis=decompose does): an installed but not yet imported framework
    is patched when its module is imported."""
    pkg = tmp_path / "verl"
    (pkg / "workers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "workers" / "__init__.py").write_text("")
    (pkg / "workers" / "fsdp_workers.py").write_text(
        "class ActorRolloutRefWorker:\n"
        "    def init_model(self): return 1\n"
        "    def generate_sequences(self, prompts): return prompts\n"
        "    def compute_log_prob(self, data): return data\n"
        "    def update_actor(self, data): return data\n"
        "    def compute_ref_log_prob(self, data): return data\n"
        "    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None): pass\n")
    (tmp_path / "verl-0.6.0.dist-info").mkdir()
    (tmp_path / "verl-0.6.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: verl\nVersion: 0.6.0\n")
    for k in [k for k in sys.modules if k.split(".")[0] == "verl"]:
        del sys.modules[k]
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks.auto_apply()
    assert "verl.workers.fsdp_workers" not in sys.modules
    from msmemscope.after_import import AfterImport

    def waiting():
        return [f for f in sys.meta_path if isinstance(f, AfterImport) and f.name == "verl.workers.fsdp_workers"]
    assert len(waiting()) == 1  # one finder for the module, whatever number of entries wait on it
    import verl.workers.fsdp_workers as fw
    assert waiting() == []
    g = fw.ActorRolloutRefWorker.__dict__["generate_sequences"]
    assert g._msmemscope_hook == ("verl.workers.fsdp_workers:ActorRolloutRefWorker.generate_sequences", "decompose")
    assert fw.ActorRolloutRefWorker().generate_sequences(7) == 7
    hooks.cleanup_framework_hooks()
    assert not hasattr(fw.ActorRolloutRefWorker.__dict__["generate_sequences"], "_msmemscope")
    # a framework still waiting for its import at cleanup: its finder goes with it
    del sys.modules["verl.workers.fsdp_workers"]
    hooks.auto_apply()
    assert len(waiting()) == 1
    hooks.cleanup_framework_hooks()
    assert waiting() == []


# ------------------------------------------------------------------ the real sources
def _sources():
    roots = [p for p in os.environ.get("MSMEMSCOPE_HOOK_SOURCES", "").split(os.pathsep) if p]
    return roots


def _source_version(path, package):
    """The version of the package whose sources hold ``path`` (an unpacked wheel or a checkout)."""
    import re
    root = path[: path.rfind(os.sep + package + os.sep) + len(package) + 1]
    for cand in ("_version.py", os.path.join("version", "version"), "version.py"):
        f = os.path.join(root, cand)
        if os.path.exists(f):
            m = re.search(r"(\d+\.\d+(?:\.\d+)?)", open(f, encoding="utf-8").read().split("version", 1)[-1]
                          if cand.endswith(".py") else open(f, encoding="utf-8").read())
            if m:
                return m.group(1)
    return None


def _find(roots, module):
    rel = module.replace(".", os.sep)
    for r in roots:
        for cand in (os.path.join(r, rel + ".py"), os.path.join(r, rel, "__init__.py")):
            if os.path.exists(cand):
                return cand
    return None


@pytest.mark.skipif(not _sources(), reason="set MSMEMSCOPE_HOOK_SOURCES to folders holding vllm / vllm_ascend / "
                                           "verl sources (unpacked wheels or checkouts)")
def test_patch_points_exist_in_sources():
    """Every vllm / vllm_ascend / verl entry whose module is in the given sources, and whose
    version range admits the sources' version, names a class that defines the method (or
    inherits it from a class of the same sources). All mismatches are listed at once."""
    from msmemscope.integrations import frameworks, in_range, parse_version
    roots, checked, bad = _sources(), 0, []
    for fw in frameworks().values():
        if fw.name not in ("vllm", "vllm_ascend", "verl"):
            continue
        for e in fw.entries:
            path = _find(roots, e.module)
            if path is None:
                continue
            ver = _source_version(path, e.module.split(".")[0])
            if ver is not None and not in_range(parse_version(ver), e.versions):
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            cls_name, meth = e.path.split(".")
            classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
            if cls_name not in classes:
                if not e.optional:
                    bad.append(f"{e.target} (sources {ver}): no class {cls_name} in {path}")
                continue
            methods = {n.name: n for n in classes[cls_name].body
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if meth not in methods:
                bases = [ast.unparse(b) for b in classes[cls_name].bases]
                if not (e.optional or any("ModelRunner" in b or "Worker" in b for b in bases)):
                    bad.append(f"{e.target} (sources {ver}): {cls_name} has no {meth}")
                continue
            args = [a.arg for a in methods[meth].args.args]
            if args[0] != "self" or (meth in ("initialize_kv_cache", "initialize_kv_cache_tensors",
                                              "initialize_from_config") and args[1] != "kv_cache_config"):
                bad.append(f"{e.target} (sources {ver}): unexpected signature {args}")
                continue
            checked += 1
    assert not bad, "\n".join(bad)
    assert checked > 0, "no module of the table found under MSMEMSCOPE_HOOK_SOURCES"
    print(f"checked {checked} patch points")

