"""The dump's CSV lines made in C++ (``_leakrule.cpp`` ``csv_rows``, used by ``CsvWriter.write`` in
the writer process) are the Python loop's lines (``CsvWriter._lines``, ``MSMEMSCOPE_CSV_ROWS=python``)
to the byte, whatever the rows hold: the rows it takes and those it leaves to the loop alike, and a
real traced run's dumps written both ways are the same file but for the times."""
import json
import os
import subprocess
import sys

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import check_invariants, dump_of, env_for_tests, full, read, run_folders
from msmemscope import leak_native
from msmemscope.io import writers
from msmemscope.io.writers import CsvWriter

MOD = leak_native.load_module()
pytestmark = pytest.mark.skipif(MOD is None or not hasattr(MOD, "csv_rows"),
                                reason="the torch-free C++ module is not built (python -m msmemscope.capture.native build)")


def lines_both_ways(tmp_path, rows, first=1, pid=4242, c_syms=None, ids=None):
    """(text of the C++ path with the loop for what it leaves, text of the Python loop alone),
    each written by a CsvWriter to a file of its own, and how many rows C++ took."""
    texts = []
    for fast in (True, False):
        path = tmp_path / f"d{len(texts)}.csv"
        if path.exists():
            path.unlink()
        w = CsvWriter(str(path))
        saved = writers._csv_fast
        writers._csv_fast = None if fast else False
        try:
            # twice: the second frame finds the names' and stacks' texts cached, as a run's frames do
            w.write(rows, first, pid, c_syms, ids)
            w.write(rows, first + len(rows), pid, c_syms, None if ids is None else [i + ids[-1] for i in ids])
        finally:
            writers._csv_fast = saved
        w.close()
        texts.append(path.read_text(encoding="utf-8", errors="surrogateescape"))
    return texts


SPECIAL_TEXTS = (["", "cpu", "PTA", "ATEN_START", "torch._ops.aten.mm.default", "a,b", 'q"x',
                                  "=cmd", "-1", "line\nbreak", "é", "back\\slash", "tab\there", "\x7f", "s\udcff",
                  "blocks.0.attn", "forward", "weight@model", "PTA@activation@fwd"])
SPECIAL_INTS = [0, -1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, -2 ** 63, -2 ** 63 - 1]
TEXT = st.one_of(st.sampled_from(SPECIAL_TEXTS), st.text(max_size=8))
INT = st.one_of(st.integers(-3, 2 ** 40), st.integers(0, 2 ** 20), st.sampled_from(SPECIAL_INTS))
VALUE = st.one_of(INT, TEXT, st.none(), st.booleans(), st.just(1.5))


def row_strategy():
    """Rows of each kind the fast path takes, with values of every sort in their fields, and rows
    of anything at all."""
    stack = st.one_of(st.none(), st.just(""), TEXT)
    malloc6 = st.tuples(INT, INT, INT, INT, INT, st.one_of(TEXT, st.none()))
    malloc8 = st.tuples(INT, INT, INT, INT, INT, st.one_of(TEXT, st.none()), st.one_of(TEXT, st.none()),
                        st.one_of(TEXT, st.none()))
    free = st.tuples(INT, INT, INT, INT, INT)
    access = st.tuples(st.one_of(TEXT, st.sampled_from(["float32", "int64"])),
                       st.one_of(st.lists(INT, max_size=4).map(tuple), st.lists(INT, max_size=3)), INT, INT)
    anything = st.one_of(malloc6, malloc8, free, access, st.none(), st.just({"step": 3}),
                         st.just({"addr": 16, "x": "y"}), st.tuples(VALUE, VALUE, VALUE, VALUE, VALUE, VALUE))

    def kind(ev, attr, ptr=st.one_of(INT, st.none())):
        return st.tuples(ev, TEXT, TEXT, INT, INT, TEXT, ptr, attr, stack, st.none())
    return st.one_of(kind(st.just("OP_LAUNCH"), st.none()), kind(st.just("MALLOC"), malloc6, INT),
                     kind(st.just("MALLOC"), malloc8, INT), kind(st.just("FREE"), free, INT),
                     kind(st.just("ACCESS"), access),
                     kind(st.one_of(st.sampled_from(["OP_LAUNCH", "MALLOC", "FREE", "ACCESS", "SYSTEM", "MSTX"]), TEXT),
                          anything))


def formats_alike(row) -> bool:
    """Whether the Python loop writes this row at all (some random values make it raise)."""
    w = CsvWriter.__new__(CsvWriter)
    w._esc = {}
    try:
        w._lines([row], 1, 1, None, None)
        return True
    except (TypeError, ValueError, IndexError, AttributeError, KeyError):
        return False


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.filter_too_much])
@given(rows=st.lists(row_strategy().filter(formats_alike), max_size=12), first=st.integers(1, 10 ** 6),
       use_ids=st.booleans())
def test_cpp_lines_are_the_python_lines(tmp_path, rows, first, use_ids):
    ids = sorted({first + 3 * k for k in range(len(rows))}) if use_ids else None
    fast, slow = lines_both_ways(tmp_path, rows, first=first, ids=ids)
    assert fast == slow


BASE = {
    "OP_LAUNCH": ("OP_LAUNCH", "ATEN_START", "op", 10, 11, "cpu", None, None, "f.py:1(g)", None),
    "MALLOC": ("MALLOC", "PTA", "op", 10, 11, "cpu", 4096, (1, 4096, 64, 128, 128, "PTA@weight"), None, None),
    "MALLOC_M": ("MALLOC", "PTA", "op", 10, 11, "cpu", 4096, (1, 4096, 64, 128, 128, None, "blocks.1", "forward"),
                 None, None),
    "FREE": ("FREE", "PTA", "op", 10, 11, "cpu", 4096, (1, 4096, 64, 0, 0), None, None),
    "ACCESS": ("ACCESS", "READ", "op", 10, 11, "cpu", 4096, ("float32", (2, 3), 64, 1), None, None),
}


def edge_rows():
    """Each kind of row with each special text in each of its text fields, and each special int in
    each of its int fields, one change at a time."""
    rows = []
    for row in BASE.values():
        rows.append(row)
        for f in (1, 2, 5, 8):  # event type, name, device, Python stack
            rows += [row[:f] + (t,) + row[f + 1:] for t in SPECIAL_TEXTS + [None]]
        for f in (3, 4, 6):  # time, thread, address
            rows += [row[:f] + (v,) + row[f + 1:] for v in SPECIAL_INTS + [None, True, 1.0]]
        attr = row[7]
        for k in range(len(attr or ())):
            others = SPECIAL_INTS + SPECIAL_TEXTS + [None, True, (), [1, -2], (1.5,)]
            rows += [row[:7] + (attr[:k] + (v,) + attr[k + 1:],) + row[8:] for v in others]
    return rows


def test_edge_values_in_every_field(tmp_path):
    rows = [r for r in edge_rows() if formats_alike(r)]
    assert len(rows) > 500
    fast, slow = lines_both_ways(tmp_path, rows)
    assert fast == slow


def typical_rows(n_ops):
    """The rows a traced step is made of, as the sources make them."""
    rows, aid = [], 0
    for k in range(n_ops):
        op = ["torch._ops.aten.mm.default", "torch._ops.aten.add.Tensor", "torch._ops.aten.relu.default"][k % 3]
        stack = None if k % 4 else f"/work/prog.py:{k}(step);/work/model.py:7(forward)"
        rows.append(("OP_LAUNCH", "ATEN_START", op, 10 ** 18 + 4 * k, 140000 + k % 2, "cpu", None, None, stack, None))
        aid += 1
        rows.append(("MALLOC", "PTA", op, 10 ** 18 + 4 * k + 1, 140000, "cpu", 0x7f0000 + 64 * k,
                     (aid, 0x7f0000 + 64 * k, 256, 1024 * k, 1024 * k, "" if k % 5 else "PTA@activation"), stack, None))
        if k % 7 == 0:
            rows.append(("MALLOC", "PTA", op, 10 ** 18 + 4 * k + 1, 140000, "cpu", 0x7f0000 + 64 * k,
                         (aid, 0x7f0000 + 64 * k, 256, 1024 * k, 1024 * k, None, "blocks.0.mlp", "backward"), None,
                         None))
        rows.append(("ACCESS", "WRITE" if k % 2 else "READ", op, 10 ** 18 + 4 * k + 2, 140000, "cpu", 0x7f0000 + 64 * k,
                     ("float32", (8, k), 256, aid), None, None))
        rows.append(("FREE", "PTA", op, 10 ** 18 + 4 * k + 2, 140000, "cpu", 0x7f0000 + 64 * k,
                     (aid, 0x7f0000 + 64 * k, 256, 0, 0), None, None))
        rows.append(("OP_LAUNCH", "ATEN_END", op, 10 ** 18 + 4 * k + 3, 140000, "cpu", None, None, None, None))
        if k % 50 == 49:
            rows.append(("SYSTEM", "STEP", "N/A", 10 ** 18 + 4 * k + 3, 140000, "cpu", None, {"step": k // 50}, None,
                         None))
    return rows


def test_a_steps_rows_are_taken_by_cpp_and_equal(tmp_path, monkeypatch):
    rows = typical_rows(300)
    calls = []
    real = MOD.csv_rows

    def counting(*a):
        got = real(*a)
        calls.append(got[0] - a[1])
        return got
    monkeypatch.setattr(writers, "_csv_fast", counting)
    fast = CsvWriter(str(tmp_path / "fast.csv"))
    fast.write(rows, 1, 7)
    # C++ wrote all but the first sight of each name and stack (the first row has both) and the STEP rows
    assert sum(calls) == len(rows) - (3 + 300 // 4 - 1) - 6
    # a second frame with the same names: their texts are cached, every row but the STEP rows in C++
    calls.clear()
    fast.write(rows, len(rows) + 1, 7)
    assert sum(calls) == len(rows) - 6
    fast.close()
    monkeypatch.setattr(writers, "_csv_fast", False)
    slow = CsvWriter(str(tmp_path / "slow.csv"))
    slow.write(rows, 1, 7)
    slow.write(rows, len(rows) + 1, 7)
    slow.close()
    assert (tmp_path / "fast.csv").read_text() == (tmp_path / "slow.csv").read_text()


def test_c_stacks_and_other_sequences_go_through_the_loop(tmp_path):
    rows = typical_rows(20)
    fast, slow = lines_both_ways(tmp_path, rows, c_syms={1: "libc.so(malloc)", 5: "a,b"})
    assert fast == slow and "libc.so(malloc)" in fast
    fast, slow = lines_both_ways(tmp_path, tuple(rows))
    assert fast == slow


PROG = """
import sys, torch, msmemscope
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(m.parameters(), lr=0.1)
kept = []
for i in range(5):
    with msmemscope.RecordFunction("user range"):
        loss = m(torch.randn(8, 16)).sum()
    loss.backward(); opt.step(); opt.zero_grad()
    kept.append(torch.ones(100 * (i + 1)))
    msmemscope.step()
"""
TIMES = ["ts", "tid", "pid"]


@pytest.mark.parametrize("opts", full([], [["--analysis=leaks"]])
                         + [["--analysis=decompose,inefficient", "--call-stack=python:4"]]
                         + full([], [["--compress=zstd", "--keep-steps=2", "--analysis=inefficient"]]),
                         ids=full([], ["default"]) + ["decompose-access-stacks"] + full([], ["zstd-bounded"]))
def test_traced_dumps_written_both_ways_are_equal(tmp_path, opts):
    """The same program traced with the writer process's lines in C++ and in Python: the same rows,
    every column but the times and ids of the process."""
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    dfs = {}
    for how in ("cpp", "python"):
        env = env_for_tests()
        if how == "python":
            env["MSMEMSCOPE_CSV_ROWS"] = "python"
        r = subprocess.run([sys.executable, "-m", "msmemscope", "-q", "-o", str(tmp_path / how), *opts,
                            sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        [folder] = run_folders(tmp_path / how)
        df = read(dump_of(folder))
        check_invariants(df)
        dfs[how] = df
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        assert cfg.get("tool_failure") is None
    a, b = dfs["cpp"], dfs["python"]
    assert a.height == b.height > 100
    assert set(a["event"].unique()) >= {"OP_LAUNCH", "MALLOC", "FREE"}
    if "--analysis=decompose,inefficient" in opts:
        assert a.filter(pl.col("event") == "ACCESS").height > 0
        assert a.filter(pl.col("attr").str.contains('"module"')).height > 0
    # times and addresses differ between two runs; the rest is the same text
    cols = [c for c in ("id", "event", "event_type", "name", "device", "alloc_id", "size", "used", "owner",
                        "module", "phase") if c in a.columns]
    assert a.select(cols).equals(b.select(cols))


def test_the_writer_process_finds_the_cpp_lines():
    """The dump writer process runs isolated (``-I -S``, io/spool.py): it still loads the module."""
    from msmemscope.io import spool
    code = spool._BOOT.split("; from ")[0] + "; from msmemscope.io import writers; print(writers._csv_rows() is not None)"
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, spool._PKG_ROOT], env=env_for_tests(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
