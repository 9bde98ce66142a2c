"""Access events, Python stacks and owner labels from the native source (capture/_native.cpp),
against the dispatch-mode source on the same programs: the same blocks read and written by the
same ops, the same stacks, the same owners; and the analyses that need them (inefficient,
decompose) on the native source."""
from __future__ import annotations

import collections
import json
import os
import textwrap

import polars as pl
import pytest

from conftest import check_invariants, config_of, dump_of, env_for_tests, read, run_cli, run_folders

from msmemscope.capture import native

pytestmark = pytest.mark.skipif(native.load_module() is None, reason=f"native source not built: {native.why_not()}")

# plain aten ops only (no composite op that the dispatch mode sees decomposed): both sources see
# the same top-level ops. In-place, out=, views, lists, a block made outside --steps. Under the
# launcher: a Python-API session keeps access events and owner labels on the dispatch source
# (tensors made before its start() are found only by their storages).
OPS = textwrap.dedent("""
    import torch
    import msmemscope
    torch.manual_seed(0)
    early = torch.ones(128)          # allocated in step 1, outside --steps: not in the dump until read
    keep = []
    for step in range(4):
        a = torch.ones(64, 32)
        b = torch.randn(32, 16)
        c = torch.mm(a, b)  # PLANTED-MM
        c.add_(1.0)
        d = torch.relu(c)
        e = d * c
        v = e.view(-1)
        torch.add(a, 1.0, out=torch.empty(64, 32))
        f = torch.cat([d, e, v.view(64, 16)], 0)
        early.mul_(2)
        keep.append(f.sum(0))
        msmemscope.step()
    print("SUM", float(sum(k.sum() for k in keep)))
""")


def _run_prog(tmp_path, text, source, args=()):
    """The program under the launcher (its allocator wrapper is there before the first tensor)."""
    prog = tmp_path / f"prog_{source}.py"
    prog.write_text(text)
    out = tmp_path / f"out_{source}"
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = source
    r = run_cli([f"--output={out}", *args, str(prog)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    folder, = run_folders(out)
    df = read(dump_of(folder))
    check_invariants(df)
    return r, folder, df


def _accesses(df):
    """Multiset of (op, READ/WRITE, dtype, shape, size, the block's allocating op, its stack's
    innermost frame): what each op touched, named without allocation ids (the sources number
    blocks differently: the native source also counts Python numbers made tensors)."""
    m = df.filter(pl.col("event") == "MALLOC").select("alloc_id", mop="name", mstack="py_stack")
    a = df.filter(pl.col("event") == "ACCESS").join(m, on="alloc_id", how="left")
    assert a["mop"].null_count() == 0, "an ACCESS row of a block without a MALLOC row"
    out = collections.Counter()
    for r in a.iter_rows(named=True):
        attr = json.loads(r["attr"])
        top = (r["mstack"] or "").split(";")[0].replace("prog_native", "P").replace("prog_python", "P")
        out[(r["name"], r["event_type"], attr["dtype"], tuple(attr["shape"]), attr["size"], r["mop"], top)] += 1
    return out


def test_access_rows_and_stacks_match_the_dispatch_source(tmp_path):
    got = {}
    for source in ("native", "python"):
        r, folder, df = _run_prog(tmp_path, OPS, source,
                                  ["--analysis=inefficient", "--call-stack=python:10", "--steps=2,3,4"])
        assert config_of(folder)["source"] == ("native" if source == "native" else "dispatch")
        got[source] = (r.stdout, df, _accesses(df))
    (out_n, df_n, acc_n), (out_p, df_p, acc_p) = got["native"], got["python"]
    assert out_n == out_p                          # the program computes the same
    assert sum(acc_n.values()) >= 50
    assert acc_n == acc_p
    kinds = collections.Counter(k[1] for k in acc_n.elements())
    assert kinds["READ"] > 20 and kinds["WRITE"] > 20
    # in-place and out= arguments are WRITEs of blocks the op did not allocate
    assert any(k[0].endswith("aten.add_.Tensor") and k[1] == "WRITE" and k[5].endswith("aten.mm.default")
               for k in acc_n)
    assert any(k[0].endswith("aten.add.out") and k[1] == "WRITE" and k[5].endswith("aten.empty.memory_format")
               for k in acc_n)
    # the block made before tracing: registered when first read (origin before_op), then written
    for df in (df_n, df_p):
        before = df.filter((pl.col("event") == "MALLOC") & pl.col("attr").str.contains('"origin":"before_op"'))
        assert before["size"].to_list() == [512]
    # stacks: the planted line on the MALLOC and ATEN_START rows of mm, the same text on both
    line = next(i for i, t in enumerate(OPS.splitlines(), 1) if "PLANTED-MM" in t)
    for df in (df_n, df_p):
        mm = df.filter((pl.col("event") == "MALLOC") & (pl.col("name") == "torch._ops.aten.mm.default"))
        assert mm.height == 3   # steps 2-4
        for s in mm["py_stack"].to_list():
            assert s.split(";")[0].endswith(f"prog_{'native' if df is df_n else 'python'}.py:{line}(<module>)"), s
    def stacks(df):
        rows = df.filter(pl.col("py_stack").is_not_null() & (pl.col("py_stack") != ""))
        return collections.Counter((e, n, s.replace("prog_native", "P").replace("prog_python", "P"))
                                   for e, n, s in rows.select("event", "name", "py_stack").iter_rows()
                                   if e == "OP_LAUNCH")
    assert stacks(df_n) == stacks(df_p)
    assert not df_n.filter(pl.col("event").is_in(["FREE", "ACCESS"]) & pl.col("py_stack").is_not_null()
                           & (pl.col("py_stack") != "")).height


DECOMPOSE = textwrap.dedent("""
    import torch
    import msmemscope
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        with msmemscope.describe.describer(owner="batch"):
            x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        msmemscope.step()
    print("LOSS", float(loss))
""")


def _owners(df):
    """The final owner of each block, keyed by (allocating op, size, ordinal): the owner rows
    applied over the MALLOC rows."""
    m = df.filter(pl.col("event") == "MALLOC")
    owner = dict(zip(m["alloc_id"].to_list(), (json.loads(a).get("owner") for a in m["attr"].to_list())))
    up = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "OWNER"))
    for a in up["attr"].to_list():
        a = json.loads(a)
        owner[a["allocation_id"]] = a["owner"]
    return owner, m


def test_owner_labels_match_the_dispatch_source(tmp_path):
    res = {}
    for source in ("native", "python"):
        r, folder, df = _run_prog(tmp_path, DECOMPOSE, source, ["--analysis=decompose"])
        assert config_of(folder)["source"] == ("native" if source == "native" else "dispatch")
        owner, m = _owners(df)
        with open(os.path.join(folder, "analysis", "decompose.json")) as f:
            dec = json.load(f)
        res[source] = (r.stdout, owner, m, dec)
    (out_n, own_n, m_n, dec_n), (out_p, own_p, m_p, dec_p) = res["native"], res["python"]
    assert out_n == out_p
    # every category and user label the dispatch source finds, the native one finds, with the
    # same bytes per owner for the weights, gradients and optimizer state (they do not depend on
    # which temporaries a source sees)
    cats_n = collections.Counter(o.split("@")[1] for o in own_n.values())
    cats_p = collections.Counter(o.split("@")[1] for o in own_p.values())
    assert set(cats_p) <= set(cats_n), (cats_n, cats_p)
    for cat in ("weight", "gradient", "optimizer_state"):
        assert cats_n[cat] == cats_p[cat] > 0, (cat, cats_n, cats_p)

    def bytes_by(owner, m, cat):
        return sorted(s for a, s in zip(m["alloc_id"].to_list(), m["size"].to_list()) if owner[a].split("@")[1] == cat)
    for cat in ("weight", "gradient", "optimizer_state"):
        assert bytes_by(own_n, m_n, cat) == bytes_by(own_p, m_p, cat), cat
    assert any(o.endswith("@batch") for o in own_n.values())
    assert "PTA@activation" in set(own_n.values()) and "PTA@activation" in set(own_p.values())
    assert dec_n["steps"] and dec_p["steps"]
