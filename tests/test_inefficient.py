"""Inefficient memory (SPEC §4.5): planted cases traced for real through the CLI, the offline
API and command on CSV and db dumps, ours and the original's, and the definitions on small
hand-made event sequences."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sqlite3

import polars as pl
import pytest

from conftest import PEER, ROOT, check_invariants, dump_of, env_for_tests, full, read, run_cli, run_folders

SCRIPT = os.path.join(ROOT, "tests", "scripts", "planted_inefficient.py")
EARLY, LATE, IDLE = 3001 * 4, 3002 * 4, 3003 * 4       # bytes of the planted blocks
PLANTED = {EARLY: "early_allocation", LATE: "late_deallocation", IDLE: "temporary_idleness"}
IDLE_OPS = 300


def _run(tmp_path_factory, name, *opts):
    out = tmp_path_factory.mktemp(name)
    env = env_for_tests()
    env["MSMEMSCOPE_IDLE_THRESHOLD"] = "100"
    p = run_cli(["--analysis=inefficient", "-o", str(out), *opts, SCRIPT, str(IDLE_OPS)], env=env)
    assert p.returncode == 0, p.stderr
    folders = run_folders(out)
    assert len(folders) == 1
    return folders[0], p


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory):
    return _run(tmp_path_factory, "csv")


@pytest.fixture(scope="module")
def db_run(tmp_path_factory):
    return _run(tmp_path_factory, "db", "--data-format=db", "--call-stack=python:8")


def _types_in_dump(df: pl.DataFrame) -> pl.DataFrame:
    m = df.filter(pl.col("event") == "MALLOC")
    return m.select("id", "alloc_id", "size",
                    t=pl.col("attr").str.extract(r'"inefficient_type":"([^"]*)"', 1))


def _check_planted(types: pl.DataFrame):
    for size, kind in PLANTED.items():
        same = types.filter(pl.col("size") == size)
        assert same.height >= 3, f"size {size}: expected the planted block and prompt ones, got {same.height}"
        flagged = same.filter(pl.col("t").is_not_null())
        assert flagged.height == 1, f"size {size}: {flagged.to_dicts()}"
        assert flagged["t"][0] == kind


def test_online_csv_marks_planted_blocks(csv_run):
    folder, proc = csv_run
    dump = dump_of(folder)
    df = read(dump)
    check_invariants(df)
    assert df["id"].to_list() == list(range(1, df.height + 1))
    _check_planted(_types_in_dump(df))
    assert not glob.glob(os.path.join(os.path.dirname(dump), ".*")), "temporary file left behind"
    with open(os.path.join(folder, "analysis", "inefficient.json")) as f:
        s = json.load(f)
    assert s["idle_threshold"] == 100
    for kind in PLANTED.values():
        assert s["by_type"][kind]["count"] >= 1
    worst = {w["size"]: w for w in s["worst"]}
    for size, kind in PLANTED.items():
        assert worst[size]["types"] == [kind]
        assert "empty" in worst[size]["op"]
    assert "inefficient memory" in proc.stderr and "temporary_idleness: 1 blocks" in proc.stderr


def test_online_db_and_python_line(db_run):
    folder, _ = db_run
    dump = dump_of(folder)
    assert dump.endswith(".db")
    df = read(dump)
    check_invariants(df)
    _check_planted(_types_in_dump(df))
    with open(os.path.join(folder, "analysis", "inefficient.json")) as f:
        s = json.load(f)
    lines = {w["size"]: w["python_line"] for w in s["worst"]}
    for size in PLANTED:
        assert "planted_inefficient.py" in lines[size]


def test_offline_matches_online(csv_run):
    from msmemscope import check_inefficient
    dump = dump_of(csv_run[0])
    online = {(r["id"], r["t"]) for r in _types_in_dump(read(dump)).filter(pl.col("t").is_not_null()).to_dicts()}
    res = check_inefficient(dump, idle_threshold=100, write=False, quiet=True)
    offline = set(zip(res.blocks["mpos"].to_list(), res.blocks["inefficient_type"].to_list()))
    assert offline == online and len(offline) >= 3


def test_chunked_equals_whole(csv_run):
    from msmemscope.analysis.inefficient import Tracker, chunk_from_frame
    ch = chunk_from_frame(read(dump_of(csv_run[0])))
    whole = Tracker(100)
    whole.feed(ch)
    ref = whole.finish().select("mpos", "bits", "max_gap").sort("mpos")
    for n in full((3, 64, 500), (1, 7, 64, 500)):  # chunks of one row each: make test-full
        tr = Tracker(100)
        tr.feed_all(ch, n)  # as the offline analyses feed a dump (in slices)
        assert tr.finish().select("mpos", "bits", "max_gap").sort("mpos").equals(ref), n


@pytest.mark.parametrize("threshold", [100, 3000])
def test_totals_without_texts_are_the_summary_of_the_blocks(csv_run, threshold):
    """The cross-rank summary's way (a Tracker that gathers no op or stack, its blocks unsorted,
    ``totals``) counts what ``summarize`` of the selected blocks counts, type by type, fed in
    slices as a dump is."""
    from msmemscope.analysis.inefficient import Tracker, chunk_from_frame, select, summarize, totals
    df = read(dump_of(csv_run[0]))
    check_invariants(df)
    ch = chunk_from_frame(df)
    tr = Tracker(threshold)
    tr.feed_all(ch, 64)
    want = summarize(select(tr.finish()), tr.counts, threshold)
    bare = Tracker(threshold, texts=False)
    bare.feed_all(ch, 64)
    res = bare.finish(ordered=False)
    assert res["op"].null_count() == res.height and res["stack"].null_count() == res.height
    got = totals(res)
    assert got == {k: want[k] for k in ("by_type", "blocks", "bytes")}
    assert want["blocks"] >= 3 and sum(v["count"] for v in got["by_type"].values()) >= want["blocks"]


def test_idle_threshold_changes_result(csv_run):
    from msmemscope import check_inefficient
    dump = dump_of(csv_run[0])

    def idle_sizes(t):
        b = check_inefficient(dump, idle_threshold=t, write=False, quiet=True).blocks
        return set(b.filter(pl.col("inefficient_type").str.contains("temporary_idleness"))["size"].to_list())
    assert IDLE in idle_sizes(IDLE_OPS - 50)
    assert IDLE not in idle_sizes(IDLE_OPS + 100)
    assert IDLE not in idle_sizes(3000)   # the default


def test_mem_size_and_type_filters(csv_run):
    from msmemscope import analyze
    dump = dump_of(csv_run[0])
    all_ = analyze("inefficient", input_path=dump, idle_threshold=100, write=False, quiet=True).blocks
    assert all_["size"].min() < EARLY
    big = analyze("inefficient", input_path=dump, idle_threshold=100, mem_size=LATE, write=False, quiet=True).blocks
    assert set(big["size"].to_list()) == {LATE, IDLE}
    late = analyze("inefficient", input_path=dump, idle_threshold=100, inefficient_type=["late_deallocation"],
                   write=False, quiet=True).blocks
    assert late.height >= 1 and set(late["inefficient_type"].to_list()) == {"late_deallocation"}
    assert LATE in late["size"].to_list() and EARLY not in late["size"].to_list()


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("run", ["csv_run", "db_run"])
def test_cli_writes_new_files_and_keeps_input(run, request, tmp_path):
    src = dump_of(request.getfixturevalue(run)[0])
    dump = str(tmp_path / os.path.basename(src))
    shutil.copy(src, dump)
    before = _sha(dump)
    args = ["check-inefficient", dump, "--idle-threshold=100", "--type=early_allocation,temporary_idleness",
            "--mem-size=12000"]
    p = run_cli(args)
    assert p.returncode == 0, p.stderr
    assert _sha(dump) == before
    out = str(tmp_path / ("inefficient_" + os.path.basename(dump)))
    assert os.path.exists(out) and os.path.exists(os.path.splitext(out)[0] + ".json")
    types = _types_in_dump(read(out)).filter(pl.col("t").is_not_null())
    assert dict(zip(types["size"].to_list(), types["t"].to_list())) == {
        EARLY: "early_allocation", IDLE: "temporary_idleness"}
    p2 = run_cli(args)
    assert p2.returncode == 0
    stem, ext = os.path.splitext(out)
    assert os.path.exists(stem + "_1" + ext), "a second run must not overwrite the first result"
    assert _sha(out) != _sha(dump)


def test_cli_errors(csv_run, tmp_path):
    dump = dump_of(csv_run[0])
    for args, word in ((["--type=early,late"], "--type"), (["--mem-size=lots"], "--mem-size"),
                       (["--idle-threshold=-1"], "--idle-threshold")):
        p = run_cli(["check-inefficient", dump, *args])
        assert p.returncode == 2 and word in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
    p = run_cli(["check-inefficient", str(tmp_path / "missing.csv")])
    assert p.returncode == 2 and "Traceback" not in p.stderr


@pytest.mark.parametrize("name", ["baseline.csv", "leaks.csv"])
def test_original_dumps_without_access(name, tmp_path):
    dump = str(tmp_path / name)
    shutil.copy(os.path.join(PEER, name), dump)
    p = run_cli(["check-inefficient", dump])
    assert p.returncode == 0, p.stderr
    assert "no ACCESS rows" in p.stderr
    assert os.listdir(tmp_path) == [name]


def test_original_attr_form_annotated(tmp_path):
    """The original's unquoted Attr, unsorted IDs, HAL rows: with ACCESS rows added, it is analysed
    and the copy keeps the original form."""
    src = os.path.join(PEER, "baseline.csv")
    df = pl.read_csv(src, infer_schema=False)
    mal = df.filter((pl.col("Event") == "MALLOC") & (pl.col("Event Type") == "PTA"))
    first = mal.sort(pl.col("ID").cast(pl.Int64)).row(0, named=True)
    aid = first["Attr"].split("allocation_id:")[1].split(",")[0]
    extra = pl.DataFrame([{**{c: "" for c in df.columns}, "ID": "100000", "Event": "ACCESS", "Event Type": "READ",
                           "Name": "x", "Timestamp(ns)": "1", "Process Id": "1", "Thread Id": "1",
                           "Device Id": "0", "Ptr": "N/A", "Attr": "{allocation_id:%s,size:4}" % aid}])
    dump = str(tmp_path / "orig.csv")
    pl.concat([df, extra]).write_csv(dump)
    from msmemscope import check_inefficient
    res = check_inefficient(dump, quiet=True)
    assert res.note is None and res.output
    out = read(res.output)
    assert out.height == df.height + 1
    ann = out.filter(pl.col("attr").str.contains("inefficient_type:", literal=True))
    assert ann.height == res.blocks.height


def test_registry():
    import msmemscope
    assert {"inefficient", "leaks"} <= set(msmemscope.list_analyzers())
    cfg = msmemscope.get_analyzer_config("inefficient")
    assert cfg["parameters"]["idle_threshold"] == 3000 and cfg["parameters"]["mem_size"] == 0
    assert msmemscope.get_analyzer_config("leaks")["parameters"]["start_index"] == 0
    with pytest.raises(ValueError):
        msmemscope.analyze("nope")
    with pytest.raises(TypeError):
        msmemscope.analyze("inefficient", input_path="x", colour="red")
    with pytest.raises(ValueError):
        msmemscope.check_inefficient(os.path.join(PEER, "baseline.csv"), inefficient_type=["early"], write=False)


# ------------------------------------------------------------------ the definitions, event by event
def _judge(events, idle_threshold=3000):
    """events: ("S", name) / ("E",) / ("M", aid) / ("F", aid) / ("A", aid); returns {aid: types}."""
    from msmemscope.analysis.inefficient import K_ACCESS, K_END, K_FREE, K_MALLOC, K_START, Tracker, \
        CHUNK_SCHEMA, type_names
    code = {"S": K_START, "E": K_END, "M": K_MALLOC, "F": K_FREE, "A": K_ACCESS}
    rows = [{"pos": i + 1, "kind": code[e[0]], "name": e[1] if e[0] == "S" else "m",
             "alloc_id": e[1] if e[0] in "MFA" else None, "size": 16, "before": False, "stack": None}
            for i, e in enumerate(events)]
    tr = Tracker(idle_threshold)
    tr.feed(pl.DataFrame(rows, schema=CHUNK_SCHEMA))
    return {r["alloc_id"]: type_names(r["bits"]) for r in tr.finish().to_dicts()}


def op(name, *inner):
    return [("S", name), *inner, ("E",)]


def test_early_definition():
    base = op("make0", ("M", 0), ("A", 0))
    # a free inside the allocating op or inside the first-access op does not count
    assert 1 not in _judge(base + op("alloc", ("M", 1), ("A", 1), ("F", 0)) + op("use", ("A", 1)))
    assert 1 not in _judge(base + op("alloc", ("M", 1), ("A", 1)) + op("use", ("F", 0), ("A", 1)))
    # a free by an op in between, or outside any op, does
    assert _judge(base + op("alloc", ("M", 1), ("A", 1)) + op("other", ("F", 0)) + op("use", ("A", 1)))[1] \
        == ["early_allocation"]
    assert _judge(base + op("alloc", ("M", 1), ("A", 1)) + [("F", 0)] + op("use", ("A", 1)))[1] \
        == ["early_allocation"]
    # never used by another op: no first access, not early
    assert 1 not in _judge(base + op("alloc", ("M", 1), ("A", 1)) + [("F", 0)])


def test_late_definition():
    base = op("make", ("M", 1), ("A", 1)) + op("use", ("A", 1))
    # an allocation in the last-access op or in the freeing op does not count
    assert 1 not in _judge(op("make", ("M", 1), ("A", 1)) + op("use", ("A", 1), ("M", 2)) + op("free", ("F", 1)))
    assert 1 not in _judge(base + op("free", ("M", 2), ("F", 1)))
    # one in an op between, or outside any op before a free outside any op, does
    assert _judge(base + op("other", ("M", 2)) + [("F", 1)])[1] == ["late_deallocation"]
    assert _judge(base + [("M", 2), ("F", 1)])[1] == ["late_deallocation"]
    assert 1 not in _judge(base + [("F", 1), ("M", 2)])
    # never freed: not judged late
    assert 1 not in _judge(base + op("other", ("M", 2)))


def test_idle_definition():
    ev = op("make", ("M", 1), ("A", 1)) + op("use", ("A", 1)) + [e for _ in range(5) for e in op("x")] \
        + op("use2", ("A", 1))
    assert _judge(ev, idle_threshold=4)[1] == ["temporary_idleness"]
    assert 1 not in _judge(ev, idle_threshold=5)        # exactly 5 ops between: not more than 5


def test_column_projection_equals_full_read(csv_run):
    """check_inefficient reads only its columns and rows (the reader's projection); same result as
    over every column of read_dump."""
    from msmemscope.analysis.inefficient import Tracker, chunk_from_frame, read_chunk
    for path in (dump_of(csv_run[0]), os.path.join(PEER, "leaks.csv")):
        fast, full = read_chunk(path), chunk_from_frame(read(path))
        cols = ["pos", "kind", "alloc_id", "before"]
        assert fast.select(cols).equals(full.select(cols))
        results = []
        for ch in (fast, full):
            tr = Tracker(100)
            tr.feed(ch)
            results.append(tr.finish().select("mpos", "bits", "size", "op"))
        assert results[0].equals(results[1])


def test_online_compressed_dump_annotated_in_place(tmp_path_factory):
    """--compress=zstd: the analysis marks the planted blocks in the .csv.zst dump, which stays
    compressed (rewritten beside it and moved over it), and reads back whole."""
    pytest.importorskip("zstandard")
    folder, _ = _run(tmp_path_factory, "zst", "--compress=zstd:1")
    dump = dump_of(folder)
    assert dump.endswith(".csv.zst")
    with open(dump, "rb") as f:
        assert f.read(4) == b"\x28\xb5\x2f\xfd"
    df = read(dump)
    check_invariants(df)
    assert df["id"].to_list() == list(range(1, df.height + 1))
    _check_planted(_types_in_dump(df))
    assert not glob.glob(os.path.join(os.path.dirname(dump), ".*")), "temporary file left behind"


def test_annotate_db_marks_named_rows_and_clears_earlier_marks(db_run, tmp_path):
    """``annotate_db`` in one pass over the table: the MALLOC rows the marks name get their type,
    those an earlier annotation marked and the marks no longer name lose it, every other row (and
    every other column) is as it was; a row ID that is not a MALLOC row's is left alone."""
    import shutil
    from msmemscope.analysis.inefficient import annotate_db
    db = str(tmp_path / "dump.db")
    shutil.copy(dump_of(db_run[0]), db)
    before = read(db)
    mallocs = before.filter(pl.col("event") == "MALLOC")["id"].to_list()
    frees = before.filter(pl.col("event") == "FREE")["id"].to_list()
    already = set(_types_in_dump(before).filter(pl.col("t").is_not_null())["id"].to_list())
    assert len(mallocs) > 50 and already
    first = {rid: "early_allocation" for rid in mallocs[::7]} | {frees[0]: "late_deallocation"}
    assert annotate_db(db, first) == len(set(mallocs[::7]) | already)
    second = {rid: "temporary_idleness" for rid in mallocs[3::11]}
    assert annotate_db(db, second) == len(set(mallocs[3::11]) | set(mallocs[::7]))
    after = read(db)
    got = dict(_types_in_dump(after).select("id", "t").iter_rows())
    assert {k: v for k, v in got.items() if v is not None} == second
    # nothing else moved: the other columns, and the Attr of the rows never marked
    same = [c for c in before.columns if c != "attr"]
    assert after.select(same).equals(before.select(same))
    untouched = set(mallocs) - set(mallocs[::7]) - set(mallocs[3::11]) - already
    a = dict(before.select("id", "attr").iter_rows())
    b = dict(after.select("id", "attr").iter_rows())
    assert all(a[i] == b[i] for i in untouched) and a[frees[0]] == b[frees[0]]
    with sqlite3.connect(db) as con:  # the marks' table was temporary
        assert con.execute("SELECT COUNT(*) FROM sqlite_master WHERE name LIKE 'msmemscope%'").fetchone()[0] == 0


def test_kernel_level_alone_is_named_where_the_ops_are_missing(tmp_path):
    """--level=kernel alone records no ATEN_START rows: the inefficient analysis's note names it
    (before: it blamed a missing --events=launch, which was given)."""
    from conftest import EXAMPLES, check_invariants, dump_of, read, run_cli, run_folders
    r = run_cli(["-o", str(tmp_path / "o"), "--level=kernel", "--analysis=inefficient",
                 os.path.join(EXAMPLES, "mlp.py"), "--steps", "2"])
    assert r.returncode == 0, r.stderr
    [folder] = run_folders(tmp_path / "o")
    check_invariants(read(dump_of(folder)))
    [note] = [ln for ln in (r.stdout + r.stderr).splitlines() if "no ATEN_START rows" in ln]
    assert "--level=kernel" in note, note
