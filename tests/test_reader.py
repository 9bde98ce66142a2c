"""Readers: ours and the original's dumps, CSV and db, and every kind of bad file."""
import os
import shutil
import warnings

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import PEER, dump_of, mlp_all_events, read, run_folders
from msmemscope.events import HEADER
from msmemscope.io.reader import DumpError, TruncatedDumpWarning, read_dump


@pytest.mark.parametrize("name,mallocs,frees,rows", [("baseline.csv", 23, 16, 121), ("leaks.csv", 25, 15, 130)])
def test_peer_dumps(name, mallocs, frees, rows):
    df = read_dump(os.path.join(PEER, name))
    assert df.height == rows
    assert df.filter(pl.col("event") == "MALLOC").height == mallocs
    assert df.filter(pl.col("event") == "FREE").height == frees
    assert df["id"].is_sorted()  # the original writes rows out of ID order
    m = df.filter(pl.col("event") == "MALLOC")
    assert m["size"].null_count() == 0 and m["alloc_id"].null_count() == 0 and m["addr"].null_count() == 0
    assert set(m["event_type"].unique().to_list()) == {"PTA", "HAL"}
    first = df.filter(pl.col("alloc_id") == 4).sort("id")
    assert first["size"].to_list() == [16778240, 16778240] and first["used"].to_list() == [16780288, 2048]
    assert first["addr"][0] == 0x000012c041400000


@pytest.fixture(scope="module")
def real_dumps(shared_run):
    paths = {}
    for fmt in ("csv", "db"):  # the runs test_capture.py checks (every event kind), not two more
        out, r = mlp_all_events(shared_run, fmt)
        assert r.returncode == 0, r.stderr
        paths[fmt] = dump_of(run_folders(out)[0])
    return paths


def test_csv_and_db_read_alike(real_dumps):
    a, b = read(real_dumps["csv"]), read(real_dumps["db"])
    cols = ["event", "event_type", "name", "device", "size", "used", "step"]
    assert a.select(cols).equals(b.select(cols))


def test_folder_input(real_dumps):
    folder = os.path.dirname(os.path.dirname(os.path.dirname(real_dumps["csv"])))
    assert read_dump(folder).height == read(real_dumps["csv"]).height


def test_truncated_dump_reads_complete_rows(real_dumps, tmp_path):
    data = open(real_dumps["csv"], "rb").read()
    full = read(real_dumps["csv"])
    cut = tmp_path / "cut.csv"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.warns(TruncatedDumpWarning, match="cut short"):
        df = read_dump(str(cut))
    assert 0 < df.height < full.height
    assert df.equals(full.head(df.height))


@pytest.mark.parametrize("content,msg", [
    (b"", "empty file"),
    (b"a,b,c\n1,2,3\n", "not the msmemscope header"),
    (b"\xff\xfe\x00binary\x00\n", "not UTF-8"),
    (HEADER.encode() + b"\n1,MALLOC,PTA,N/A,5,1,1,0,0x1,\"{size:4}\",,\n2,FREE,PTA\n3,SYSTEM,STEP,N/A,5,1,1,0,N/A,,,\n",
     "line 3 has too few fields"),
    (HEADER.encode() + b"\nx,SYSTEM,STEP,N/A,5,1,1,0,N/A,,,\n", "not a number"),
    (HEADER.encode() + b"\n1,MALLOC,PTA,N/A,5,1,1,0,0x1,\"{addr:0x1}\",,\n", "no size in Attr"),
    (HEADER.encode() + b"\n1,SYSTEM,STEP,N/A,5,1,1,0,N/A,,,\n2,SYSTEM,STEP,N/A,\xff\xfe,1,1,0,N/A,,,\n", "line 3 is not UTF-8"),
])
def test_bad_files(tmp_path, content, msg):
    p = tmp_path / "bad.csv"
    p.write_bytes(content)
    with pytest.raises(DumpError, match=msg) as e:
        read_dump(str(p))
    assert str(p) in str(e.value)


@pytest.mark.parametrize("zstd", [False, True])
def test_number_columns_read_alike_whole_or_in_batches(tmp_path, zstd):
    """IDs, times, pids and tids are read as numbers (the texts only when a value is not one): a
    number with blanks before it reads as that number, a blank field as missing, whether the whole
    file reads as numbers or falls back to its texts, whole or batch by batch; a value that is no
    number is named in the same error by every read."""
    from msmemscope.io import reader
    rows = [b"1,SYSTEM,STEP,N/A, 5,\t7,1,0,N/A,,,", b"2,SYSTEM,STEP,N/A,6,7, 8,0,N/A,,,",
            b"\t3,MALLOC,PTA,N/A,9,7,8,0,0x1,\"{allocation_id:1,addr:0x1,size:4,used:4,total:4}\",,"]
    bad = b"x4,SYSTEM,STEP,N/A,10,7,8,0,N/A,,,"
    for body, error in ((rows, None), (rows + [bad], "row 4 has ID 'x4', not a number"),
                        (rows[:1] + [bad] + rows[1:], "row 2 has ID 'x4', not a number")):
        data = HEADER.encode() + b"\n" + b"\n".join(body) + b"\n"
        p = tmp_path / ("f.csv.zst" if zstd else "f.csv")
        if zstd:
            import zstandard
            data = zstandard.ZstdCompressor().compress(data)
        p.write_bytes(data)
        reads = [lambda: read_dump(str(p))] + ([] if zstd else [lambda: reader.read_dump_batched(str(p), batch_bytes=40)])
        for read_it in reads:
            if error is None:
                df = read_it()
                assert df["id"].to_list() == [1, 2, 3] and df["ts"].to_list() == [5, 6, 9]
                assert df["pid"].to_list() == [7, 7, 7] and df["tid"].to_list() == [1, 8, 8]
            else:
                with pytest.raises(DumpError, match=error):
                    read_it()


def test_missing_paths(tmp_path):
    with pytest.raises(DumpError, match="no such file"):
        read_dump(str(tmp_path / "nope.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="no msmemscope dump"):
        read_dump(str(tmp_path / "empty"))


def test_not_a_database(tmp_path):
    p = tmp_path / "x.db"
    shutil.copy(os.path.join(PEER, "baseline.csv"), p)
    assert read_dump(str(p)).height == 121  # content decides, not the suffix
    p.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    with pytest.raises(DumpError, match="not a readable"):
        read_dump(str(p))


def test_size_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("MSMEMSCOPE_MAX_INPUT_BYTES", "100")
    with pytest.raises(DumpError, match="over the input limit"):
        read_dump(os.path.join(PEER, "baseline.csv"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=400), cut=st.integers(0, 3000))
def test_fuzz_reader_only_raises_dump_error(tmp_path, body, cut):
    base = open(os.path.join(PEER, "baseline.csv"), "rb").read()[:cut]
    p = tmp_path / "f.csv"
    p.write_bytes(base + body)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            read_dump(str(p))
        except DumpError:
            pass


@pytest.fixture(params=["c++", "polars"])
def attr_parser(request, monkeypatch):
    """The reader's Attr fields both ways: the C++ parse of the writer's templates, and polars'."""
    from msmemscope.io import reader as R
    if request.param == "polars":
        monkeypatch.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")
    else:
        monkeypatch.delenv("MSMEMSCOPE_ATTR_FIELDS", raising=False)
        if R._attr_module() is None:
            pytest.skip("the C++ module is not built (make native)")
    return request.param


def test_attr_fast_patterns_agree_with_per_key_reading(attr_parser):
    """The one-pass patterns for our MALLOC/FREE/ACCESS Attr texts give exactly what the per-key
    patterns give, and every other text still goes through the per-key patterns."""
    import random

    from msmemscope.io import reader as R
    from msmemscope.events import format_attr
    rng = random.Random(7)
    texts = ["", None, '{"step":3}', '{"range_id":2}', "{allocation_id:5,addr:0x10,size:64,used:64,total:128}",
             '{"allocation_id":1,"addr":"0x0000000000001000","size":8,"used":8,"total":8,"owner":"a,b"}',
             '{"allocation_id":1,"addr":"0x0000000000001000","size":8,"used":8,"total":8,"owner":"","origin":"before_op"}',
             '{"allocation_id":1,"addr":"0x00000000000010AF","size":8,"used":-8,"total":0}',
             '{"dtype":"float32","shape":[],"size":4,"allocation_id":9}']
    for _ in range(300):
        aid, addr, size = rng.randrange(1, 10**9), rng.randrange(0, 2**48), rng.randrange(1, 2**40)
        used, total = rng.randrange(-2**40, 2**41), rng.randrange(0, 2**41)
        owner = rng.choice(["", "PTA@weight", "PTA@optimizer_state", "x y", "model.layers.0.mlp", "ü-owner"])
        texts.append(format_attr("MALLOC", (aid, addr, size, used, total, owner)))
        texts.append(format_attr("FREE", (aid, addr, size, used, total)))
        shape = tuple(rng.randrange(1, 9) for _ in range(rng.randrange(0, 4)))
        texts.append(format_attr("ACCESS", (rng.choice(["float32", "bfloat16", "int64"]), shape, size, aid)))
    events = ["ACCESS" if t and '"dtype"' in t else "MALLOC" for t in texts]
    df = pl.DataFrame({"attr": texts, "event": events}, schema={"attr": pl.String, "event": pl.String})
    fast = R._attr_columns(df)
    slow = df.with_columns(**R._attr_exprs()).with_columns(
        addr=pl.col("addr").str.strip_prefix("0x").str.to_integer(base=16, strict=False))
    slow = R._unescaped(slow, ("owner", "module", "phase"))  # (JSON's escapes, as the program wrote them)
    for c in R._ATTR_COLUMNS:
        assert fast[c].to_list() == slow[c].to_list(), c
    assert "ü-owner" in fast["owner"].to_list()
    # the fast patterns did the work for the rows our writer prints
    hits = df.select(pl.col("attr").str.extract_groups(R._MEM_ATTR).struct.field("size").is_not_null().sum()
                     + pl.col("attr").str.extract_groups(R._ACCESS_ATTR).struct.field("size").is_not_null().sum())
    assert hits.item() >= 840  # (an owner with a non-ASCII letter is written escaped: per key)


def test_attr_columns_keep_the_frames_chunks(attr_parser):
    """A big CSV parses into hundreds of chunks; an Attr column of one chunk beside them made polars
    copy every column of the frame at its next operation (0.3-0.6 s on 3M rows). With rows that
    only the per-key patterns read among them, every column still comes in the frame's chunks,
    with the values the per-key patterns give."""
    from msmemscope.io import reader as R
    from msmemscope.events import format_attr
    texts = [format_attr("MALLOC", (i + 1, 4096 * i, 64, 64 * i, 128 * i, "PTA@weight" if i % 3 else ""))
             for i in range(600)]
    texts[17] = "{allocation_id:5,addr:0x10,size:64,used:64,total:128}"   # the original's
    texts[401] = '{"allocation_id":9,"addr":"0x0000000000001000","size":8,"used":8,"total":8,"owner":"a,b"}'
    df = pl.DataFrame({"attr": texts, "event": ["MALLOC"] * 600})
    df = pl.concat([df.slice(i, 50) for i in range(0, 600, 50)], rechunk=False)
    out = R._attr_columns(df)
    assert {tuple(out[c].chunk_lengths()) for c in out.columns} == {tuple([50] * 12)}
    slow = df.with_columns(**R._attr_exprs()).with_columns(
        addr=pl.col("addr").str.strip_prefix("0x").str.to_integer(base=16, strict=False))
    for c in R._ATTR_COLUMNS:
        assert out[c].to_list() == slow[c].to_list(), c
    assert out["alloc_id"][17] == 5 and out["alloc_id"][401] == 9


_TEMPLATE_BITS = ['{"allocation_id":', ',"addr":"0x', '","size":', ',"used":', ',"total":', ',"owner":"',
                  ',"module":"', ',"phase":"', '"}', '{"dtype":"', '","shape":[', '],"size":', ',"allocation_id":',
                  "}", '"', ",", "\\", "-", "ü", "0x", "7", "18446744073709551616", "9223372036854775807",
                  "9223372036854775808", "ffffffffffffffff", "7fffffffffffffff", "00", " ", "{", "a,b"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["MALLOC", "FREE", "ACCESS", "SYSTEM"]),
                          st.lists(st.sampled_from(_TEMPLATE_BITS), max_size=14),
                          st.integers(-2**65, 2**66), st.integers(0, 2**64), st.sampled_from(["", "w", "ü-x", "a b"]),
                          st.integers(0, 40), st.sampled_from([(), ("GPT.blocks.0.attn", "forward"), ("ü.m", None)])),
                min_size=1, max_size=40))
def test_attr_fields_in_cpp_are_polars_fields(monkeypatch, rows):
    """The C++ parse of the templates gives what polars' patterns give, on the writer's texts with
    numbers of any size (past 64 bits: null, read per key) and on texts a byte or a piece off the
    template (not matched: read per key)."""
    from msmemscope.io import reader as R
    from msmemscope.events import format_attr
    if R._attr_module() is None:
        pytest.skip("the C++ module is not built (make native)")
    texts, events = [], []
    for ev, bits, n, addr, owner, cut, module in rows:
        if ev == "ACCESS" or (ev == "SYSTEM" and n % 2):  # a SYSTEM row with either template's text
            t = format_attr("ACCESS", ("float32", (2, 3), abs(n), addr))
        else:
            t = format_attr("MALLOC", (abs(n) % 2**70, addr, abs(n), n, -n, owner) + module)
        t = t[:cut] + "".join(bits) + t[cut:] if bits else t
        texts.append(t)
        events.append(ev)
    df = pl.DataFrame({"attr": texts, "event": events}, schema={"attr": pl.String, "event": pl.String})
    monkeypatch.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")
    want = R._attr_columns(df)
    monkeypatch.delenv("MSMEMSCOPE_ATTR_FIELDS")
    got = R._attr_columns(df)
    for c in R._ATTR_COLUMNS:
        assert got[c].to_list() == want[c].to_list(), (c, [t for t, a, b in zip(texts, got[c], want[c]) if a != b][:3])
    # and C++ matched every text the template's pattern matches (those it left would be read per
    # key, with the same values but slower), and no other
    m = R._attr_module()
    for kind, evs, pattern in ((0, ("MALLOC", "FREE"), R._MEM_ATTR), (1, ("ACCESS",), R._ACCESS_ATTR)):
        col = df.select(pl.when(pl.col("event").is_in(evs)).then(pl.col("attr")))[:, 0]
        matched = m.attr_fields(col.__arrow_c_stream__(), kind)[0].tolist()
        expect = col.str.contains(pattern).fill_null(False).to_list()
        assert matched == expect, [t for t, a, b in zip(col, matched, expect) if a != b][:3]
    # the one pass the reader makes: each row's template by its event, no other row parsed
    kinds = np.array([1 if e in ("MALLOC", "FREE") else 2 if e == "ACCESS" else 0 for e in events], np.uint8)
    matched = m.attr_fields(df["attr"].__arrow_c_stream__(), 0, kinds)[0].tolist()
    mem_ok = df["attr"].str.contains(R._MEM_ATTR).fill_null(False).to_list()
    acc_ok = df["attr"].str.contains(R._ACCESS_ATTR).fill_null(False).to_list()
    expect = [(k == 1 and a) or (k == 2 and b) for k, a, b in zip(kinds.tolist(), mem_ok, acc_ok)]
    assert matched == expect


@pytest.mark.parametrize("scan", ["native", "python"])
def test_row_count_of_a_big_file_is_extrapolated(tmp_path, monkeypatch, scan):
    """Python's streamed scan: past COUNT_BYTES it stops counting newlines (a third of the bare
    read's time on 500 MB) and extrapolates the row count for the memory estimate, saying 'about'.
    The C++ scan (``csv_scan``) counts every newline at any size: the count stays exact. A NUL
    anywhere, counted part or not, is found and refused by either."""
    from msmemscope.io import columns as C, reader as R
    if scan == "python":
        monkeypatch.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")  # no C++ module for the reader
    elif C.text_module("csv_scan") is None:
        pytest.skip("the C++ module is not built")
    rows = [f"{i},SYSTEM,STEP,N/A,{i},1,1,0,N/A,\"{{\"\"step\"\":{i}}}\",," for i in range(1, 20001)]
    p = tmp_path / "d.csv"
    p.write_text(HEADER + "\n" + "\n".join(rows) + "\n")
    monkeypatch.setenv("MSMEMSCOPE_MEMORY_LIMIT", "1000")
    with pytest.raises(DumpError, match=r"\(20000 rows"):  # counted: exact
        read_dump(str(p))
    monkeypatch.setattr(R, "CHUNK", 1 << 12)
    monkeypatch.setattr(R, "COUNT_BYTES", 1 << 14)
    if scan == "native":
        with pytest.raises(DumpError, match=r"\(20000 rows"):  # still exact
            read_dump(str(p))
        monkeypatch.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")
    with pytest.raises(DumpError, match=r"\(about \d+ rows") as e:
        read_dump(str(p))
    n = int(e.value.args[0].split("(about ")[1].split(" ")[0])
    assert abs(n - 20000) < 2000, n  # lines here grow by a third from first to last: real rows far less
    monkeypatch.delenv("MSMEMSCOPE_MEMORY_LIMIT")
    assert read_dump(str(p)).height == 20000
    facts = {}
    R.check_csv(str(p), facts=facts)
    assert facts == {"nul": False}
    data = p.read_bytes()
    at = data.rindex(b"N/A")  # in the last row's ptr, far past the counted part
    (tmp_path / "n.csv").write_bytes(data[:at] + b"N\x00A" + data[at + 3:])
    R.check_csv(str(tmp_path / "n.csv"), facts=facts)
    assert facts == {"nul": True}
    with pytest.raises(DumpError, match="NUL"):
        read_dump(str(tmp_path / "n.csv"))


@pytest.mark.parametrize("size,used,owner,refused", [
    ("8", "18446744073709551621", "w", True),         # past 64 bits: refused
    ("8", "-9223372036854775809", "ü-w", True),       # below -2**63, beside a letter past ASCII
    ("8", "1700000000000000000", "w", False),         # 19 digits that fit
    ("8", "8", "ü:12345678901234567890", True),      # in the owner's text, as the pattern has it
    ("8", "8", "ü", False),
])
def test_numbers_past_64_bits_in_attr_are_refused(tmp_path, attr_parser, size, used, owner, refused):
    """A MALLOC/FREE Attr number that does not fit in 64 bits cannot be true in our dump: the read
    says so, whichever way the fields were parsed (the C++ parse marks the rows the pattern then
    looks at; a superset, so the same rows are found)."""
    rows = [f'{i},MALLOC,PTA,N/A,{i},1,1,0,0x{4096 * i:016x},'
            f'"{{""allocation_id"":{i},""addr"":""0x{4096 * i:016x}"",""size"":8,""used"":8,""total"":8,""owner"":""w""}}",,'
            for i in range(1, 40)]
    rows[20] = (f'21,MALLOC,PTA,N/A,21,1,1,0,0x{4096 * 21:016x},"{{""allocation_id"":21,""addr"":""0x{4096 * 21:016x}"",'
                f'""size"":{size},""used"":{used},""total"":8,""owner"":""{owner}""}}",,')
    p = tmp_path / "d.csv"
    p.write_text(HEADER + "\n" + "\n".join(rows) + "\n", encoding="utf-8")
    if refused:
        with pytest.raises(DumpError, match="row ID 21 has a number too large for 64 bits"):
            read_dump(str(p))
    else:
        assert read_dump(str(p)).height == 39


def test_attr_fields_parsed_in_threads_are_one_threads(monkeypatch):
    """Over 64K rows the C++ parse splits the column's chunks among threads, each with its own
    codes for owners, modules and phases, merged afterwards. The codes and their texts come out as
    one thread's parse gives them (texts in order of first appearance), and as polars' fields.
    Later chunks bring texts the first share never saw, and reuse its texts in another order."""
    from msmemscope.events import format_attr
    from msmemscope.io import reader as R
    m = R._attr_module()
    if m is None:
        pytest.skip("the C++ module is not built (make native)")
    owners = ["PTA@weight", "", "PTA@gradient", "ü-own", "PTA@optimizer_state", "late-1", "late-2"]
    modules = [("GPT.blocks.0.attn", "forward"), (), ("GPT.head", "backward"), ("ü.m", None), ("late.mod", "forward")]
    parts = []
    for k in range(24):  # 24 chunks of 10K rows: several shares whatever the cores
        n0 = k * 10_000
        own = owners[: 3 + k % 5]
        own = own[k % len(own):] + own[: k % len(own)]
        mods = modules[: 2 + k % 4]
        mods = mods[k % len(mods):] + mods[: k % len(mods)]
        texts = [format_attr("MALLOC", (n0 + i + 1, 4096 * (n0 + i), 64, 64, 128, own[i % len(own)])
                             + mods[i % len(mods)]) for i in range(10_000)]
        parts.append(pl.DataFrame({"attr": texts, "event": ["MALLOC"] * 10_000}))
    df = pl.concat(parts, rechunk=False)
    col = df["attr"]

    def parsed(threads):
        monkeypatch.setenv("POLARS_MAX_THREADS", str(threads))
        r = m.attr_fields(col.__arrow_c_stream__(), 0)
        return [r[k].tolist() for k in range(7)], [[vals[c] if c >= 0 else None for c in codes.tolist()]
                                                   for codes, vals in r[7:]], [list(vals) for _, vals in r[7:]]
    one = parsed(1)
    assert one[1][0][:3] == ["PTA@weight", "", "PTA@gradient"]
    assert one[2][0] == [o for o in owners if o.isascii()]  # in order of first appearance (ü is escaped: per key)
    for threads in (2, 3, 8):
        assert parsed(threads) == one, threads
    monkeypatch.delenv("POLARS_MAX_THREADS")
    got = R._attr_columns(df)
    monkeypatch.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")
    want = R._attr_columns(df)
    for c in R._ATTR_COLUMNS:
        assert got[c].to_list() == want[c].to_list(), c


_i64 = st.one_of(st.none(), st.integers(0, 2**63 - 1), st.sampled_from([0, 1, 255, 4096, 2**63 - 1]))
_txt = st.one_of(st.none(), st.sampled_from(["", "PTA@weight", "GPT.blocks.0.attn", "forward", "ü-x", "a,b"]))


@pytest.mark.parametrize("gap", [1, 9, 100, 5000])
def test_texts_made_in_cpp_with_nulls_far_apart(gap):
    """Nulls far apart in a text column made in C++ (the validity grows to each null's row, whatever
    the gap: growing it once per null wrote past its end): the same texts as numpy's and polars'
    ways, for the addresses and for the MALLOC/FREE rows' Attr texts."""
    from msmemscope.io import columns as C
    if C.text_module() is None:
        pytest.skip("the C++ module is not built (make native)")
    vals = list(range(1, 3 * gap + 20))
    for i in (2, 2 + gap, 3 + 3 * gap):
        if i < len(vals):
            vals[i] = None
    s = pl.Series("addr", vals, dtype=pl.Int64)
    # the MALLOC/FREE rows' Attr texts too (null on the rows without their fields)
    df = pl.DataFrame({"alloc_id": s, "addr": s, "size": s, "used": s, "total": s},
                      schema={c: pl.Int64 for c in ("alloc_id", "addr", "size", "used", "total")}).with_columns(
        owner=pl.lit(None, pl.String), module=pl.lit(None, pl.String), phase=pl.lit(None, pl.String))
    got = (C.hex16(s, "0x").to_list(), C.template_attr(df).to_list())
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")
        want = (C.hex16(s, "0x").to_list(), C.template_attr(df).to_list())
    assert got == want and got[0].count(None) == got[1].count(None) == vals.count(None)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_i64, _i64, _i64, st.one_of(st.none(), st.integers(-2**63, 2**63 - 1),
                                                   st.sampled_from([-1, -2, -4096, -2**63])), _i64,
                          _txt, _txt, _txt), max_size=30),
       st.sampled_from([("", None), ("0x", None), ("0x", "N/A")]), st.integers(0, 3))
def test_texts_made_in_cpp_are_polars_texts(rows, hexform, cuts):
    """The addresses as 0x%016x and the MALLOC/FREE rows' Attr template, made in C++ (one Arrow
    array handed to polars), are the texts numpy's and polars' ways make, nulls included, on
    frames of several chunks; a negative address is refused the same way by both."""
    from msmemscope.io import columns as C
    if C.text_module() is None:
        pytest.skip("the C++ module is not built (make native)")
    cols = ("alloc_id", "addr", "size", "used", "total", "owner", "module", "phase")
    df = pl.DataFrame([dict(zip(cols, r)) for r in rows],
                      schema={**{c: pl.Int64 for c in cols[:5]}, **{c: pl.String for c in cols[5:]}})
    if cuts and df.height > cuts:  # the reader's frames come in chunks
        df = pl.concat([df.slice(0, cuts), df.slice(cuts)], rechunk=False)

    def both(fn):
        out = []
        for way in ("c++", "polars"):
            with pytest.MonkeyPatch.context() as m:
                if way == "polars":
                    m.setenv("MSMEMSCOPE_ATTR_FIELDS", "polars")
                try:
                    got = fn()
                    out.append((got.name, got.dtype, got.to_list()))
                except pl.exceptions.PolarsError as e:
                    out.append(type(e).__name__)
        return out
    prefix, null = hexform
    a, b = both(lambda: C.hex16(df["addr"], prefix, null))
    assert a == b
    a, b = both(lambda: C.template_attr(df))
    assert a == b
    a, b = both(lambda: C.hex16(df["used"], "0x", "N/A"))  # negative values: refused by both
    assert a == b
