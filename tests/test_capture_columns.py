"""The capture-time columnar companion (io/columns.py): the dump writer keeps the rows it writes as
typed columns beside the dump, and every offline read takes them instead of the text while the
manifest says the dump is the file the writer closed. They must give exactly the columns the
text gives (every analysis' projection, the report's batched read), on real training dumps of
both capture sources, plain and zstd, bounded; and be ignored when they no longer describe the
file (edited, cut, appended to, a writer process killed before its close)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import warnings

import polars as pl
import pytest

import offline_golden as G  # noqa: E402  (tests/ is on sys.path under pytest)
from conftest import ROOT, check_invariants, env_for_tests, full, run_cli
from msmemscope.io import column_writer as W
from msmemscope.io import columns as C
from msmemscope.io import reader as R

# (name, environment, options): real training runs, each companion made from its first row
# (make test: the native run, which has owners, module attribution, ACCESS rows and stacks; the
# writer's other shapes and the zstd dump are held by test_rows_of_every_shape_read_alike)
RUNS = [
    ("native_owners_modules", {}, ["--call-stack=python:6", "--analysis=leaks,decompose"]),
] + full([], [
    ("python_access_zstd_bounded", {"MSMEMSCOPE_SOURCE": "python"},
     ["--events=alloc,free,launch,access", "--call-stack=python:4", "--compress=zstd", "--keep-steps=2"]),
    ("native_default", {}, [])])


def _cases():
    from msmemscope.analysis import compare, decompose, inefficient, leaks
    from msmemscope.report import summary
    out = {"every column": dict(columns=R.COLUMNS_OFFERED), "default": {}}
    for mod in (leaks, compare, inefficient, decompose, summary):
        out[mod.__name__.rsplit(".", 1)[-1]] = dict(columns=mod.COLUMNS, events=mod.EVENTS)
    out["decompose by module"] = dict(columns=decompose.MODULE_COLUMNS_READ, events=decompose.EVENTS)
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture_columns")
    script = root / "train.py"
    script.write_text(G.TRAIN)
    got = {}
    for name, extra, opts in RUNS:
        env = env_for_tests()
        # parts of a few hundred rows: the reads below see columns of many chunks, as a big dump's
        env.update(extra, MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES="0", MSMEMSCOPE_COLUMN_PART_ROWS="700")
        env.pop("MSMEMSCOPE_COLUMN_CACHE", None)
        r = run_cli([f"--output={root / name}", *opts, str(script), "6"], env=env)
        assert r.returncode == 0, r.stderr
        found = [p for p in R.find_dumps(str(root / name))]
        assert len(found) == 1, found
        got[name] = found[0]
    return got


def _both(path, monkeypatch, fn):
    """(from the text, from the companion): the companion read may not parse the text."""
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE", "0")
    text = fn()
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE")
    with monkeypatch.context() as m:
        def refuse(*a, **k):
            raise AssertionError("the text was parsed although the companion is current")
        m.setattr(R, "_read_csv", refuse)
        m.setattr(R, "_read_batched", refuse)
        cols = fn()
    return text, cols


def _same(a: pl.DataFrame, b: pl.DataFrame, what: str):
    assert a.schema == b.schema, what
    assert a.equals(b), what + ": " + ", ".join(c for c in a.columns if not a[c].equals(b[c]))
    # the companion's columns come in the chunks of its parts, all alike: one column of other chunks
    # makes polars copy the whole frame at its next operation
    chunks = {c: b[c].chunk_lengths() for c in b.columns}
    assert len({tuple(v) for v in chunks.values()}) <= 1, what + f": chunks differ: {chunks}"


@pytest.mark.parametrize("run", [r[0] for r in RUNS])
def test_the_companion_gives_what_the_text_gives(dumps, run, monkeypatch):
    from msmemscope.report import html as H
    from msmemscope.report.common import REPORT_COLUMNS
    path = dumps[run]
    assert os.path.basename(C.folder_of(path)).startswith(".")
    assert R.capture_parts(path) is not None, "the writer left no current companion"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for what, kw in _cases().items():
            counts_a, counts_b = {}, {}
            text, cols = _both(path, monkeypatch, lambda: R.read_dump(path, counts=counts_a if not counts_a else counts_b, **kw))
            _same(text, cols, what)
            assert counts_a == counts_b and sum(counts_a.values()) > 0
        check_invariants(R.read_dump(path))
        text, cols = _both(path, monkeypatch, lambda: R.read_dump_batched(path, columns=REPORT_COLUMNS))
        _same(text, cols, "the report's batched read")
        a, b = H.build_frame(text, [path], None), H.build_frame(cols, [path], None)
    a.pop("generated"), b.pop("generated")
    assert a == b


def test_a_changed_dump_is_read_from_its_text(dumps, tmp_path, monkeypatch):
    """A copy (another inode), rows appended, the file cut, a byte changed with its mtime put
    back: each is read from its text, and says what the text says."""
    src = dumps["native_owners_modules"]
    base = R.read_dump(src)
    # a copy with its companion: another file, so the text
    d = tmp_path / "copy"
    d.mkdir()
    dst = d / os.path.basename(src)
    shutil.copy2(src, dst)
    shutil.copytree(C.folder_of(src), C.folder_of(str(dst)))
    assert R.capture_parts(str(dst)) is None
    assert R.read_dump(str(dst)).equals(base)
    # the original, changed in place (a copy of the folder first: the module's runs stay intact)
    work = tmp_path / "work"
    shutil.copytree(os.path.dirname(src), work)
    path = str(work / os.path.basename(src))
    shutil.rmtree(C.folder_of(path))
    shutil.copytree(C.folder_of(src), C.folder_of(path))
    meta = C.read_manifest(C.folder_of(path))
    meta["file"] = C.file_key(path)  # as if the writer had closed this very file
    with open(os.path.join(C.folder_of(path), C.MANIFEST), "w") as f:
        import json
        json.dump(meta, f)
    assert R.capture_parts(path) is not None
    assert R.read_dump(path).equals(base)
    # rows appended: the text has one more row
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    last = lines[-1].split(b",", 1)
    extra = str(int(last[0]) + 1).encode() + b"," + last[1]
    with open(path, "ab") as f:
        f.write(extra)
    assert R.capture_parts(path) is None
    assert R.read_dump(path).height == base.height + 1
    # cut back to the original size, then one byte changed and the mtime put back
    with open(path, "r+b") as f:
        f.truncate(sum(len(x) for x in lines))
    st = os.stat(path)
    with open(path, "r+b") as f:
        data = f.read()
        i = data.rindex(b'""size"":') + len(b'""size"":')
        f.seek(i)
        f.write(b"9" if data[i:i + 1] != b"9" else b"8")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert R.capture_parts(path) is None
    changed = R.read_dump(path)
    assert not changed.equals(base)  # the text's value, not the companion's


def test_a_killed_writer_leaves_no_companion_that_is_used(tmp_path):
    """The writer process killed after step 2 (tests/scripts/writer_killed.py): the traced
    process writes the rest itself; the parts the killed writer made were never committed, so
    every read takes the text, which holds every row."""
    env = env_for_tests()
    env.update(MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES="0")
    env.pop("MSMEMSCOPE_COLUMN_CACHE", None)
    out = tmp_path / "out"
    script = tmp_path / "writer_killed.py"
    # killed once its companion holds a part (the writer process reads the pipe on its own time)
    script.write_text(open(os.path.join(ROOT, "tests", "scripts", "writer_killed.py")).read().replace(
        "        if proc is not None:\n",
        "        s.flush()\n"
        "        from msmemscope.io import columns\n"
        "        import time\n"
        "        folder = columns.folder_of(s.writer.path)\n"
        "        for _ in range(600):\n"
        "            if os.path.isdir(folder) and any(n.startswith('part-') for n in os.listdir(folder)):\n"
        "                break\n"
        "            time.sleep(0.05)\n"
        # and until the writer has written every row sent so far: rows still in the pipe when it
        # is killed are lost by design (rows_lost_after), which this test is not about
        "        for _ in range(600):\n"
        "            with open(s.writer.path, 'rb') as f:\n"
        "                f.seek(max(0, os.path.getsize(s.writer.path) - 4096))\n"
        "                tail = f.read().splitlines()\n"
        "            if tail and tail[-1].split(b',')[0] == str(s.writer.last_id()).encode():\n"
        "                break\n"
        "            time.sleep(0.05)\n"
        "        print('parts', sorted(os.listdir(folder)), flush=True)\n"
        "        if proc is not None:\n"))
    env["MSMEMSCOPE_COLUMN_PART_ROWS"] = "1"
    r = run_cli([f"--output={out}", str(script)], env=env)
    assert r.returncode == 0, r.stderr
    assert "parts ['part-000000.parquet'" in r.stdout, r.stdout  # (one part or more: the writer does not wait)
    (path,) = R.find_dumps(str(out))
    assert os.path.isdir(C.folder_of(path))  # the killed writer had started one
    assert R.capture_parts(path) is None
    df = R.read_dump(path)
    check_invariants(df)
    assert (df["event"] == "SYSTEM").sum() >= 5  # the steps after the kill are there


@pytest.mark.skipif(not full(False, True), reason="long form: a traced program killed by SIGKILL")
def test_a_killed_program_leaves_a_companion_of_what_was_written(tmp_path):
    """The traced program killed (SIGKILL): its writer process writes what reached it and closes,
    so the companion describes the file as it is and gives what its text gives."""
    script = tmp_path / "train.py"
    script.write_text(G.TRAIN.replace('print("trained", len(keep))',
                                      'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'))
    env = env_for_tests()
    env.update(MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES="0")
    env.pop("MSMEMSCOPE_COLUMN_CACHE", None)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "msmemscope", f"--output={out}", str(script), "6"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL, 137), p.stderr
    (path,) = R.find_dumps(str(out))
    from msmemscope.io.spool import wait_for_writer
    assert wait_for_writer(path)
    assert R.capture_parts(path) is not None
    os.environ["MSMEMSCOPE_COLUMN_CACHE"] = "0"
    try:
        text = R.read_dump(path)
    finally:
        del os.environ["MSMEMSCOPE_COLUMN_CACHE"]
    assert R.read_dump(path).equals(text)


# ------------------------------------------------------------------ the writer's rows, one by one
def _odd_rows():
    """Raw rows (events.RawRow order) of every shape the writer prints, with the values that take
    its other paths: owners with commas, quotes, non-ASCII, None; names that look like formulas or
    hold line breaks; negative ids; module/phase; ACCESS; dict attrs; no ptr."""
    rows = []
    owners = ["PTA@weight", "", "a,b", 'q"x', "ü-owner", None, "x}y", "tab\tin", "back\\slash"]
    names = ["aten::mm", "=cmd()", "+1", "-x", "@y", "with,comma", 'with"quote', "line\nbreak", "", None, "né"]
    aid = 0
    for i, ow in enumerate(owners):
        for j, nm in enumerate(names):
            aid += 1
            sign = -1 if (i + j) % 7 == 3 else 1
            addr = 0x7F00_0000_0000 + aid * 512
            rows.append(("MALLOC", "PTA", nm, 1000 + aid, 7, "cpu", addr, (sign * aid, addr, 512 * (j + 1), aid * 512, aid * 600, ow),
                         "train.py:3(f);=evil.py:1(<module>)" if j % 3 == 0 else None, None))
            if j % 2:
                rows.append(("MALLOC", "PTA", nm, 1001 + aid, 7, "cpu", addr + 1,
                             (aid + 10_000, addr + 1, 64, 1, 2, ow if isinstance(ow, str) else "o", "Seq.0" if j % 4 else "é", None if j % 3 else "forward"), None, None))
            rows.append(("FREE", "PTA", "N/A", 1002 + aid, 7, "cpu", addr, (sign * aid, addr, 512 * (j + 1), 0, 0), None, None))
            rows.append(("ACCESS", "READ", nm, 1003 + aid, 7, "cpu", addr, ("float32", (2, 3), 24, aid), None, None))
            rows.append(("OP_LAUNCH", "ATEN_START", nm, 1004 + aid, 7, "cpu", None, None, None, None))
            rows.append(("OP_LAUNCH", "ATEN_END", nm, 1005 + aid, 7, "cpu", None, None, None, None))
            rows.append(("MALLOC", "PTA", nm, 1006 + aid, 7, "cpu", addr + 2, {"allocation_id": aid + 20_000, "addr": addr + 2, "size": 8, "used": 8, "total": 8, "origin": "before_op"}, None, None))
            rows.append(("FREE", "PTA", nm, 1007 + aid, 7, "cpu", addr + 2, {"allocation_id": aid + 20_000, "addr": addr + 2, "size": 8, "used": 0, "total": 0}, None, None))
        rows.append(("SYSTEM", "STEP", "N/A", 5000 + i, 7, "cpu", None, {"step": i + 1}, None, None))
        rows.append(("MSTX", "Mark", "step", 5001 + i, 7, "cpu", None, {"message": f"m,{i}"}, None, None))
    return rows


def _write(tmp_path, rows, batches=7, c_syms=None, cls=None):
    from msmemscope.io.writers import CsvWriter
    cls = cls or CsvWriter
    path = str(tmp_path / ("memscope_dump_odd" + cls.suffix))
    w = cls(path)
    w.columns = W.ColumnWriter(path)
    w.columns.least = 0
    step = max(1, len(rows) // batches)
    for lo in range(0, len(rows), step):
        w.write(rows[lo:lo + step], lo + 1, 4242, c_syms if lo == 0 else None)
    w.close()
    return path


@pytest.mark.parametrize("kind", ["csv", "csv.zst"])
def test_rows_of_every_shape_read_alike(tmp_path, monkeypatch, kind):
    from msmemscope.io.writers import CsvWriter, ZstdCsvWriter
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE", raising=False)
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_PART_ROWS", "97")  # columns of many chunks
    rows = _odd_rows()
    path = _write(tmp_path, rows, c_syms={0: "libc.so(f)", 3: "=x,y"}, cls=CsvWriter if kind == "csv" else ZstdCsvWriter)
    assert len(R.capture_parts(path)[0]) >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for what, kw in _cases().items():
            text, cols = _both(path, monkeypatch, lambda: R.read_dump(path, **kw))
            _same(text, cols, what)
            # still in the parts' chunks: no column was remade whole, which would have copied the frame
            assert cols["id"].n_chunks() >= 2, what
    # the stored rows are mostly numbers: the plain MALLOC/FREE rows keep no Attr text
    stored = pl.concat(pl.read_parquet(p) for p in R.capture_parts(path)[0])
    plain = stored.filter(pl.col("event").is_in(["MALLOC", "FREE"]) & pl.col("attr").is_null())
    assert plain.height > 100


@pytest.mark.parametrize("kind", ["csv", "csv.zst"])
def test_frames_written_during_the_catch_up_wait_for_it(tmp_path, monkeypatch, kind):
    """The catch-up (the rows already in the file, read when the dump passes the threshold) runs in
    a thread; the frames the writer gets meanwhile are written to the file at once and join the
    columns after it, in order, each row once: the companion reads as the text does. Here the
    threshold is crossed at the third frame and the catch-up is held until four more have come."""
    import threading
    from msmemscope.io.writers import CsvWriter, ZstdCsvWriter
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE", raising=False)
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_PART_ROWS", "97")
    go, started = threading.Event(), threading.Event()
    real = W.ColumnWriter._catch_up

    def held(self, end):
        started.set()
        assert go.wait(30)
        real(self, end)
    monkeypatch.setattr(W.ColumnWriter, "_catch_up", held)
    rows = _odd_rows()
    cls = CsvWriter if kind == "csv" else ZstdCsvWriter
    path = str(tmp_path / ("memscope_dump_held" + cls.suffix))
    w = cls(path)
    w.columns = W.ColumnWriter(path)
    step = max(1, len(rows) // 9)
    batches = [(lo, rows[lo:lo + step]) for lo in range(0, len(rows), step)]
    for k, (lo, part) in enumerate(batches):
        if k == 0:
            w.columns.least = 1 << 40
        if k == 2:
            w.columns.least = w.columns.seen + 1  # the third frame crosses the threshold
        w.write(part, lo + 1, 4242)
        if k == 2:
            assert started.wait(30) and w.columns.state == "catching"
        if k == 6:
            assert len(w.columns._backlog) == 4 and w.columns.state == "catching"
            go.set()
    w.close()
    assert len(R.capture_parts(path)[0]) >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text, cols = _both(path, monkeypatch, lambda: R.read_dump(path, columns=R.COLUMNS_OFFERED))
    _same(text, cols, "held catch-up")
    assert cols.height == len(rows)


def test_a_row_it_cannot_hold_turns_it_off(tmp_path, monkeypatch):
    """A NUL in a name (which the reader refuses) or a number over 64 bits: no companion, and the
    read says what the text says."""
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE", raising=False)
    rows = _odd_rows()
    bad = rows[:40] + [("MALLOC", "PTA", "a\x00b", 1, 7, "cpu", 16, (999_999, 16, 8, 8, 8, "x"), None, None)] + rows[40:]
    path = _write(tmp_path, bad)
    assert R.capture_parts(path) is None and not os.path.exists(C.folder_of(path))
    with pytest.raises(R.DumpError, match="NUL"):
        R.read_dump(path)
    (tmp_path / "b").mkdir()
    big = rows[:40] + [("MALLOC", "PTA", "x", 1, 7, "cpu", 16, (999_999, 2**64 + 5, 8, 8, 8, "x"), None, None)]
    path = _write(tmp_path / "b", big)
    assert R.capture_parts(path) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert R.read_dump(path)["addr"].null_count() >= 1


def test_turned_off_and_small_dumps_leave_nothing(tmp_path, monkeypatch):
    from msmemscope.io.writers import CsvWriter
    rows = _odd_rows()
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE", "0")
    assert not C.enabled()
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE")
    path = str(tmp_path / "memscope_dump_small.csv")
    w = CsvWriter(path)
    w.columns = W.ColumnWriter(path)  # the default threshold: 64 MiB of text
    w.write(rows, 1, 1)
    w.close()
    assert not os.path.exists(C.folder_of(path)) and R.capture_parts(path) is None


def test_the_checks_tables_agree_with_hashing():
    """validate's table-indexed checks (``_seen_before``, ``_with_malloc_id``) give what hashing and a
    join give, on random allocation ids: dense or sparse, repeated or not, negative, FREE before MALLOC."""
    import random

    from msmemscope.io import validate as V
    rng = random.Random(5)
    for case in range(300):
        n = rng.randrange(0, 60)
        span = rng.choice([n + 1, 3 * n + 5, 10**9])
        lo = rng.choice([0, 0, -3])
        aids = [rng.randrange(lo, span) for _ in range(n)] if case % 3 else rng.sample(range(max(n, 1) * 2), n)
        ids = rng.sample(range(1, 10 * n + 10), n)
        s = pl.Series("alloc_id", aids, dtype=pl.Int64)
        assert V._seen_before(s).to_list() == (~s.is_first_distinct()).to_list()
        mallocs = pl.DataFrame({"id": ids, "alloc_id": aids}, schema={"id": pl.Int64, "alloc_id": pl.Int64})
        m = rng.randrange(0, 40)
        frees = pl.DataFrame({"id": [rng.randrange(1, 10 * n + 10) for _ in range(m)],
                              "alloc_id": [rng.choice(aids) if aids and rng.random() < 0.7 else rng.randrange(lo, span)
                                           for _ in range(m)]}, schema={"id": pl.Int64, "alloc_id": pl.Int64})
        reused = bool(V._seen_before(mallocs["alloc_id"]).any())
        got = V._with_malloc_id(frees, mallocs, reused)
        want = frees.join(mallocs, on="alloc_id", how="left", suffix="_malloc")
        key = ["id", "alloc_id", "id_malloc"]
        assert got.select(key).sort(key, nulls_last=True).equals(want.select(key).sort(key, nulls_last=True))
        if not reused:  # one row per FREE, in their order
            assert got["id"].to_list() == frees["id"].to_list()


def test_stop_and_start_again_carry_the_companion_on(tmp_path, monkeypatch):
    """stop() ends the writer process (its close commits the companion) and the next start() starts
    another, which carries on from that manifest: each read in between, in the program itself, takes
    every row written so far from the companion; at the end it still gives what the text gives."""
    from conftest import read_after_stop
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES", "0")
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE", raising=False)
    seen = read_after_stop(tmp_path / "out")
    for which in ("first", "second"):
        height, written, last = seen[which]
        assert height == written == last, seen
    (path,) = R.find_dumps(str(tmp_path / "out"))
    parts = R.capture_parts(path)
    assert parts is not None and len(parts[0]) >= 2  # the second writer process added its own part
    text, cols = _both(path, monkeypatch, lambda: R.read_dump(path))
    _same(text, cols, "after a stop and a start")
    check_invariants(cols)


def test_a_companion_that_cannot_be_read_is_not_needed(tmp_path, monkeypatch):
    """A part overwritten with junk (the manifest still matching the dump): the text is read."""
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE", raising=False)
    path = _write(tmp_path, _odd_rows())
    parts, _ = R.capture_parts(path)
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = R.read_dump(path)
        monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE")
        with open(parts[-1], "r+b") as f:
            f.write(b"not parquet at all")
        assert R.capture_parts(path) is not None  # the manifest cannot tell
        _same(text, R.read_dump(path), "a part overwritten")
        assert R.read_dump_batched(path).height == text.height


def test_attr_of_keeps_the_text_of_those_events_only(tmp_path, monkeypatch):
    """``read_dump(attr_of=...)``: the Attr text on the rows of those events, null on the others,
    every other column as without it; the same from the companion and from the text."""
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE", raising=False)
    path = _write(tmp_path, _odd_rows())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attr_of in (("SYSTEM",), ("MALLOC", "SYSTEM"), ("FREE",), ()):
            for kw in (dict(columns=R.COLUMNS_OFFERED), dict(columns=("attr", "size", "origin"), events=("MALLOC", "SYSTEM"))):
                whole = R.read_dump(path, **kw)
                text, cols = _both(path, monkeypatch, lambda: R.read_dump(path, attr_of=attr_of, **kw))
                _same(text, cols, f"attr_of={attr_of}")
                keep = whole["event"].is_in(list(attr_of)) if "event" in whole.columns else None
                want = whole.with_columns(attr=pl.when(keep if keep is not None else pl.lit(False)).then(pl.col("attr"))) \
                    if keep is not None else None
                if want is not None:
                    _same(want, cols, f"attr_of={attr_of} against the whole read")


DEEP = """
import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(50)])
opt = torch.optim.Adam(model.parameters(), foreach=False)
x = torch.randn(16, 64)
for i in range(60):
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
print("loss", loss.item())
"""


def test_a_writer_that_falls_behind_drops_the_companion(tmp_path):
    """A program of tiny ops (bench's 'deep' workload: ~600,000 rows a second) with the companion
    on from its first row: the writer process cannot make columns of rows as fast as they come
    (~2 us a row), so the pipe stays full and the program would wait on it (2.6x the plain
    program with the companion, 1.7x without, BENCHMARKS.md). The writer drops the companion and
    writes the text alone: no columns are left, the dump is whole, the program's output is the
    plain run's."""
    script = tmp_path / "deep.py"
    script.write_text(DEEP)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env_for_tests())
    # the columns made slower still (0.5 s a frame): behind on any machine under any load
    env = {**env_for_tests(), "MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES": "0", "MSMEMSCOPE_COLUMN_SLOW_S": "0.5"}
    env.pop("MSMEMSCOPE_COLUMN_CACHE", None)
    out = tmp_path / "out"
    r = run_cli([f"--output={out}", str(script)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]
    (path,) = R.find_dumps(str(out))
    assert R.capture_parts(path) is None and not os.path.exists(C.folder_of(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = R.read_dump(path)
    check_invariants(df)
    assert df.filter(pl.col("event_type") == "STEP").height == 60
