"""The offline analyses' outputs on a few real dumps, as plain JSON, to hold every analysis to the
results it gave before the column layer (tests/test_offline_columns.py compares).

    PYTHONPATH=$PWD python tests/offline_golden.py make     # trace the dumps into tests/data/offline/
    PYTHONPATH=$PWD python tests/offline_golden.py save     # write golden.json from the current code

The dumps are traced once and kept (their rows, addresses and times are what the golden results
describe); both capture sources, CSV and db, owners, Python stacks, ACCESS rows, marks and steps,
and the original tool's two peer dumps.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(HERE, "data", "offline")

TRAIN = r'''
import sys
import torch
from torch import nn
import msmemscope
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(24, 48), nn.LayerNorm(48), nn.GELU(), nn.Linear(48, 8))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
keep = []
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
for step in range(steps):
    msmemscope.mark("step")
    opt.zero_grad(set_to_none=True)
    x = torch.randn(16, 24)
    loss = model(x).pow(2).mean()
    loss.backward()
    if step % 2 == 1:
        keep.append(torch.ones(64, 64 + step))     # a leak every other step
    opt.step()
    msmemscope.step()
msmemscope.mark("step")
print("trained", len(keep))
'''

# (name, environment, options): each traced into DATA/<name>.<csv|db>
RUNS = [
    ("native_default", {}, []),
    ("native_stacks_owners", {}, ["--call-stack=python:6", "--analysis=leaks,decompose"]),
    ("python_access_db", {"MSMEMSCOPE_SOURCE": "python"},
     ["--events=alloc,free,launch,access", "--analysis=decompose", "--data-format=db"]),
    ("python_access_stacks", {"MSMEMSCOPE_SOURCE": "python"},
     ["--events=alloc,free,launch,access", "--call-stack=python:4"]),
]


def dumps() -> list[str]:
    """The dumps the golden results describe: ours, then the original's."""
    out = [os.path.join(DATA, f) for f in sorted(os.listdir(DATA)) if f.endswith((".csv", ".db"))]
    peer = os.path.join(HERE, "data", "peer-dumps")
    return out + [os.path.join(peer, f) for f in ("baseline.csv", "leaks.csv")]


def make() -> None:
    import glob
    import tempfile
    os.makedirs(DATA, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(TRAIN)
        for name, env_extra, opts in RUNS:
            if os.path.exists(os.path.join(DATA, name + ".csv")) or os.path.exists(os.path.join(DATA, name + ".db")):
                continue
            out = os.path.join(tmp, name)
            env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env_extra)
            r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", out, *opts, script, "5"],
                               env=env, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            (dump,) = glob.glob(os.path.join(out, "msmemscope_*", "device_*", "dump", "memscope_dump_*"))
            shutil.copy(dump, os.path.join(DATA, name + os.path.splitext(dump)[1]))


def _plain(x):
    """JSON-comparable form (tuples as lists, keys as strings, polars frames as row lists)."""
    import polars as pl
    if isinstance(x, pl.DataFrame):
        return {"columns": x.columns, "rows": [_plain(list(r)) for r in x.iter_rows()]}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def outputs(path: str) -> dict:
    """Every offline analysis of one dump: what each returns and prints."""
    import polars as pl
    from msmemscope.analysis import compare as C
    from msmemscope.analysis import decompose as D
    from msmemscope.analysis import inefficient as I
    from msmemscope.analysis import leaks as L
    from msmemscope.io.reader import read_dump
    from msmemscope.report import export as E
    from msmemscope.report import html as H
    from msmemscope.report import summary as S
    res = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = read_dump(path)
        res["read_dump"] = {"columns": df.columns, "dtypes": [str(t) for t in df.dtypes],
                            "rows": [_plain(list(r)) for r in df.iter_rows()]}
        out = io.StringIO()
        try:
            res["check_leaks"] = L.check_leaks(path, "step", 1, out=out)
        except Exception as e:  # noqa: BLE001 - the error is the result
            res["check_leaks"] = f"{type(e).__name__}: {e}"
        res["check_step_leaks"] = L.check_step_leaks(path, out=out)
        res["leaks_text"] = out.getvalue()
        steps = sorted(set(C.step_numbers(df).to_list()))
        pairs = [(f"{path}:step={a}", f"{path}:step={b}") for a, b in zip(steps, steps[1:])][:3]
        if path.endswith("leaks.csv"):
            pairs.append((path.replace("leaks.csv", "baseline.csv"), path))
        for a, b in pairs:
            key = f"compare {os.path.basename(a)} {os.path.basename(b)}"
            try:
                r = C.compare(a, b)
                buf = io.StringIO()
                C.render(r, out=buf)
                res[key] = {"table": _plain(r.table), "minimal": r.minimal, "text": buf.getvalue()}
            except Exception as e:  # noqa: BLE001
                res[key] = f"{type(e).__name__}: {e}"
        ir = I.check_inefficient(path, write=False, quiet=True)
        s = dict(ir.summary)
        s.pop("input", None)
        res["inefficient"] = {"summary": s, "blocks": _plain(ir.blocks)}
        res["decompose"] = D.summarize(df)
        if hasattr(D, "summarize_dump"):
            assert D.summarize_dump(path) == res["decompose"]
        r = S.analyse_rank({"path": path, "folder": os.path.dirname(path), "config": {}, "label": "r"})
        for k in ("seconds", "cpu_seconds", "folder", "dump"):
            r.pop(k, None)
        res["summary"] = r
        snap = E.memory_snapshot(df)
        res["memory_snapshot"] = snap
        res["perfetto"] = list(E.perfetto_events(df))
        data = H.build_frame(df, [path], None)
        data.pop("generated", None)
        for t in data.get("tables") or []:  # rows tied in the table's sort come in any order
            if isinstance(t, dict) and isinstance(t.get("rows"), list):
                t["rows"] = sorted(t["rows"], key=str)
        for sr in data.get("series") or []:  # its frame order follows an unordered group_by (report/views.py)
            if isinstance(sr, dict):
                sr.pop("live", None)
        res["html"] = data
    # paths as seen from the tests folder: the golden file was written from another checkout
    return json.loads(json.dumps(_plain(res), default=str).replace(HERE, "<tests>"))


def save() -> None:
    gold = {}
    for d in dumps():
        gold[os.path.basename(d)] = outputs(d)
    with gzip.open(os.path.join(DATA, "golden.json.gz"), "wt") as f:
        json.dump(gold, f, sort_keys=True)


def load() -> dict:
    with gzip.open(os.path.join(DATA, "golden.json.gz"), "rt") as f:
        return json.load(f)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    {"make": make, "save": save}[sys.argv[1]]()
