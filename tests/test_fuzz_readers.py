"""Fuzzing the dump readers with hypothesis: whatever the bytes, ``read_dump`` returns a frame or
raises ``DumpError`` (never another exception), the streamed CSV check gives the same answer
whatever its block size, and rows that parse keep the SPEC column types.

Quick in CI (HYPOTHESIS_PROFILE unset). A long campaign: ``HYPOTHESIS_PROFILE=long pytest
tests/test_fuzz_readers.py`` (20,000 examples per test; see RELIABILITY.md)."""
import os
import sqlite3
import warnings

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from msmemscope.events import HEADER
from msmemscope.io import reader
from msmemscope.io.reader import DumpError, read_dump

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

EVENTS = ["MALLOC", "FREE", "ACCESS", "OP_LAUNCH", "SYSTEM", "MSTX", "KERNEL_LAUNCH", "", "malloc"]
TYPES = ["PTA", "HAL", "ATEN_START", "ATEN_END", "STEP", "READ", "Mark", "N/A", ""]
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
# blanks around a number: the typed read and the texts' read (io/reader.py _as_typed) must agree
number = st.one_of(st.integers(-2**70, 2**70).map(str),
                   st.sampled_from(["", "N/A", "0x1f", "1e3", " 7", "-0", "\t7", " ", "\t", " -3", "7 ", " +4", "x"]))
attr_value = st.one_of(number, text, st.sampled_from(['"0x10"', "{", "}", ",", ":"]))
attr = st.one_of(
    st.dictionaries(st.sampled_from(["allocation_id", "addr", "size", "used", "total", "owner", "step", "x"]),
                    attr_value, max_size=6).map(lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"),
    st.dictionaries(st.sampled_from(["allocation_id", "size", "used"]), st.integers(-5, 2**40), max_size=3)
    .map(lambda d: "{" + ",".join(f'"{k}":{v}' for k, v in d.items()) + "}"),
    text)


def quote(v: str) -> str:
    return '"' + v.replace('"', '""') + '"' if any(c in v for c in ',"\n\r') else v


row = st.tuples(number, st.sampled_from(EVENTS), st.sampled_from(TYPES), text, number, number, number,
                st.sampled_from(["0", "cpu", "N/A", "1"]), st.sampled_from(["N/A", "0x0000000000000010", "zz"]),
                attr, text, text)
line = st.one_of(row.map(lambda r: ",".join(quote(x) for x in r)),
                 st.lists(text, max_size=14).map(lambda xs: ",".join(quote(x) for x in xs)),
                 st.binary(max_size=40).map(lambda b: b.decode("utf-8", "replace")))


def _read(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return read_dump(path)
        except DumpError as e:
            assert str(path) in str(e)  # the message names the file
            return None


@given(lines=st.lists(line, max_size=12), ending=st.sampled_from(["\n", "\r\n", ""]), cut=st.integers(0, 40))
def test_structured_csv(tmp_path, lines, ending, cut):
    data = (HEADER + "\n" + "".join(x + ending for x in lines)).encode("utf-8", "surrogatepass")
    data = data[: len(data) - cut] if cut < len(data) else data
    p = tmp_path / "f.csv"
    p.write_bytes(data)
    df = _read(str(p))
    if df is not None:
        assert df["id"].dtype == pl.Int64 and df["id"].null_count() == 0 and df["id"].is_sorted()
        mem = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))
        assert mem["size"].null_count() == 0  # a MALLOC/FREE without a size never gets through


@given(prefix=st.integers(0, 3000), body=st.binary(max_size=300), block=st.integers(1, 64))
def test_streamed_check_independent_of_block_size(tmp_path, monkeypatch, prefix, body, block):
    base = open(os.path.join(os.path.dirname(__file__), "data", "peer-dumps", "baseline.csv"), "rb").read()
    p = tmp_path / "f.csv"
    p.write_bytes(base[:prefix] + body)

    def outcome():
        try:
            return reader.check_csv(str(p))
        except DumpError as e:
            return str(e)
    whole = outcome()
    monkeypatch.setattr(reader, "CHUNK", block)
    assert outcome() == whole
    if isinstance(whole, tuple):
        data = p.read_bytes()
        assert whole == (data.rfind(b"\n") + 1, len(data))


# pieces of a text with lines past the line limit (1024 at least), NUL bytes and CRLF
piece = st.one_of(st.binary(max_size=60), st.sampled_from([b"\n", b"\r\n", b"\x00", b",\"x\"\n"]),
                  st.integers(1000, 2100).map(lambda n: b"a" * n),
                  st.integers(1022, 1026).map(lambda n: b"\n" + b"a" * n + b"\n"))  # at the limit


@given(prefix=st.integers(0, 3000), pieces=st.lists(piece, max_size=8), end=st.one_of(st.none(), st.integers(0, 9000)),
       zst=st.booleans())
def test_native_scan_says_what_the_streamed_scan_says(tmp_path, monkeypatch, prefix, pieces, end, zst):
    """``check_csv``'s C++ scan (``csv_scan``: mapped, or read in blocks up to ``end``, or over a
    decompressed text) and Python's streamed scan give the same bytes, the same NUL fact and the
    same error, whatever the text (the row estimate aside: the C++ count is exact)."""
    from msmemscope.io import columns as C
    if C.text_module("csv_scan") is None:
        pytest.skip("the C++ module is not built")
    base = open(os.path.join(os.path.dirname(__file__), "data", "peer-dumps", "baseline.csv"), "rb").read()
    data = base[:prefix] + b"".join(pieces)
    p = tmp_path / "f.csv"
    p.write_bytes(data)
    monkeypatch.setenv("MSMEMSCOPE_MAX_LINE_BYTES", "1024")
    monkeypatch.setenv("MSMEMSCOPE_MEMORY_LIMIT", str(1 << 40))

    def outcome():
        facts = {}
        try:
            got = reader.check_csv(str(p), data if zst else None, facts, None if zst else end)
        except DumpError as e:
            return str(e)
        return got, facts
    native = outcome()
    monkeypatch.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")  # the Python scan
    try:
        assert outcome() == native
    finally:
        monkeypatch.delenv("MSMEMSCOPE_ATTR_FIELDS")


@given(rows=st.lists(st.tuples(st.one_of(st.integers(-3, 10**12), st.none(), text), st.sampled_from(EVENTS),
                               st.sampled_from(TYPES), text, st.one_of(st.integers(-2**63, 2**63 - 1), st.none(), text),
                               attr), max_size=8))
def test_sqlite_reader(tmp_path, rows):
    p = tmp_path / "f.db"
    if p.exists():
        p.unlink()
    con = sqlite3.connect(p)
    from msmemscope.io.writers import SQL_COLUMNS
    con.execute(f"CREATE TABLE memscope_dump ({SQL_COLUMNS})")
    con.executemany("INSERT INTO memscope_dump VALUES (?,?,?,?,?,1,1,'0','N/A',?,'','')", rows)
    con.commit()
    con.close()
    df = _read(str(p))
    if df is not None:
        assert df["id"].null_count() == 0


@given(data=st.binary(max_size=600))
def test_any_bytes(tmp_path, data):
    p = tmp_path / "f.csv"
    p.write_bytes(data)
    _read(str(p))
    p.write_bytes(HEADER.encode() + b"\n" + data)
    _read(str(p))


@given(lines=st.lists(line, max_size=12), ending=st.sampled_from(["\n", "\r\n"]), block=st.integers(16, 400))
def test_batched_read_answers_as_the_full_read(tmp_path, lines, ending, block):
    """``read_dump_batched`` in tiny batches: the frame ``read_dump`` gives (text as categoricals,
    no Attr text on MALLOC/FREE/ACCESS rows), or the same refusal."""
    data = (HEADER + "\n" + "".join(x + ending for x in lines)).encode("utf-8", "surrogatepass")
    p = tmp_path / "f.csv"
    p.write_bytes(data)
    results = []
    for read in (read_dump, lambda path: reader.read_dump_batched(path, batch_bytes=block)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                results.append(read(str(p)))
            except DumpError as e:
                results.append(str(e))
    full, got = results
    if isinstance(full, str) or isinstance(got, str):
        assert full == got
        return
    got = got.with_columns(pl.col(c).cast(pl.String) for c, t in got.schema.items() if t == pl.Categorical)
    bulk = pl.col("event").is_in(["MALLOC", "FREE", "ACCESS"])
    assert got.equals(full.with_columns(attr=pl.when(bulk).then(None).otherwise(pl.col("attr"))))
