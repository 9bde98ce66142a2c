"""The offline column layer: every analysis gives, on real dumps, exactly what it gave before the
layer existed (tests/data/offline/golden.json.gz, written by tests/offline_golden.py from the code
before the change), and the reader's projections agree with its full read."""
from __future__ import annotations

import os
import warnings

import polars as pl
import pytest

import offline_golden as G  # noqa: E402  (tests/ is on sys.path under pytest)
from conftest import full as long_or_short  # noqa: E402

GOLD = G.load()


@pytest.fixture(scope="module")
def now():
    return {os.path.basename(d): G.outputs(d) for d in G.dumps()}


@pytest.mark.parametrize("dump", sorted(GOLD))
def test_every_analysis_gives_what_it_gave(now, dump):
    old, new = GOLD[dump], now[dump]
    assert sorted(new) == sorted(old)
    for key in sorted(old):
        assert new[key] == old[key], f"{dump}: {key} changed"


def test_fast_attr_path_agrees_with_per_key_on_mutated_texts():
    """The fast patterns take only texts they read exactly as the per-key patterns do: the writer's
    templates with one character changed, dropped or doubled anywhere still read alike."""
    import random

    from msmemscope.events import format_attr
    from msmemscope.io import reader as R
    rng = random.Random(11)
    base = []
    for _ in range(60):
        aid, addr, size = rng.randrange(0, 10**9), rng.randrange(0, 2**48), rng.randrange(0, 2**40)
        used, total = rng.randrange(-2**40, 2**41), rng.randrange(-5, 2**41)
        base.append(format_attr("MALLOC", (aid, addr, size, used, total, rng.choice(["", "PTA@weight", "a b"]))))
        base.append(format_attr("FREE", (aid, addr, size, used, total)))
        shape = tuple(rng.randrange(0, 9) for _ in range(rng.randrange(0, 4)))
        base.append(format_attr("ACCESS", (rng.choice(["float32", "int64"]), shape, size, aid)))
    texts = list(base)
    alphabet = '0123456789-+,:"{}[]\\ xaso_'
    for t in base:
        for _ in range(12):
            i = rng.randrange(len(t))
            op = rng.randrange(3)
            c = rng.choice(alphabet)
            texts.append(t[:i] + c + t[i + 1:] if op == 0 else t[:i] + t[i + 1:] if op == 1 else t[:i] + c + t[i:])
    # the event of each row: mostly the template's own, sometimes another (then it goes per key, alike)
    kinds = ["MALLOC", "FREE", "ACCESS", "SYSTEM"]
    events = [("ACCESS" if '"dtype"' in t else "MALLOC") if rng.random() < 0.8 else rng.choice(kinds) for t in texts]
    df = pl.DataFrame({"attr": texts, "event": events}, schema={"attr": pl.String, "event": pl.String})
    fast = R._attr_columns(df)
    a = pl.col("addr")
    slow = df.with_columns(**R._per_key_exprs()).with_columns(  # hex "0x…"; a bare number is decimal
        addr=pl.when(a.str.starts_with("0x")).then(a.str.strip_prefix("0x").str.to_integer(base=16, strict=False))
        .otherwise(a.str.to_integer(base=10, strict=False)))
    for c in R._ATTR_COLUMNS:
        diff = [(t, a, b) for t, a, b in zip(texts, fast[c].to_list(), slow[c].to_list()) if a != b]
        assert not diff, (c, diff[:3])
    # and the fast path did read the unchanged templates
    took = df.head(len(base)).with_columns(event=pl.lit("x")).select(pl.col("attr").str.extract_groups(R._MEM_ATTR).struct.field("size").is_not_null().sum()
                                     + pl.col("attr").str.extract_groups(R._ACCESS_ATTR).struct.field("size").is_not_null().sum()).item()
    assert took == len(base)


@pytest.mark.parametrize("dump", [d for d in G.dumps()])
def test_projections_agree_with_the_full_read(dump):
    """Any choice of columns and events gives the full read's values on the rows kept."""
    from msmemscope.io.reader import COLUMNS_OFFERED, read_dump
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = read_dump(dump, columns=COLUMNS_OFFERED)
        for cols, events in [(("size", "step"), ("MALLOC", "FREE")), (("op", "name", "tid"), ("MALLOC",)),
                             (("step_number", "alloc_id", "owner"), ("SYSTEM", "MALLOC")),
                             (("origin", "used", "addr"), None), (("py_stack",), ("OP_LAUNCH",))]:
            part = read_dump(dump, columns=cols, events=events)
            want = full if events is None else full.filter(pl.col("event").is_in(list(events)))
            assert part.columns == [c for c in COLUMNS_OFFERED if c in cols or c == "id"]
            assert part.equals(want.select(part.columns)), (cols, events)
    # the enclosing op: an independent walk of the rows, one stack of open ops per thread
    stacks, expect = {}, []
    for ev, et, name, tid in full.select("event", "event_type", "name", "tid").iter_rows():
        st = stacks.setdefault(tid, [])
        if ev == "OP_LAUNCH" and et == "ATEN_START":
            st.append(name)
            expect.append(name)
        elif ev == "OP_LAUNCH" and et == "ATEN_END":
            if st:
                st.pop()
            expect.append(None)
        else:
            expect.append(st[-1] if st else None)
    got = [None if ev == "OP_LAUNCH" and et == "ATEN_END" else op
           for ev, et, op in full.select("event", "event_type", "op").iter_rows()]
    assert got == expect


def _textbook_myers(a, b):
    """Myers' greedy forward pass, one diagonal at a time, and its backtrack: the reference."""
    n, m = len(a), len(b)
    max_d = n + m
    off = max_d + 1
    V = [0] * (2 * max_d + 3)
    trace = []
    for d in range(max_d + 1):
        trace.append(list(V))
        for k in range(-d, d + 1, 2):
            x = V[off + k + 1] if k == -d or (k != d and V[off + k - 1] < V[off + k + 1]) else V[off + k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            V[off + k] = x
            if x >= n and y >= m:
                pairs = []
                for dd in range(d, 0, -1):
                    Vd, k = trace[dd], x - y
                    pk = k + 1 if k == -dd or (k != dd and Vd[off + k - 1] < Vd[off + k + 1]) else k - 1
                    px = Vd[off + pk]
                    py = px - pk
                    mx = px if pk == k + 1 else px + 1
                    while x > mx:
                        x, y = x - 1, y - 1
                        pairs.append((x, y))
                    pairs.append((-1, py) if pk == k + 1 else (px, -1))
                    x, y = px, py
                while x > 0:
                    x, y = x - 1, y - 1
                    pairs.append((x, y))
                return pairs[::-1], d


def test_vectorised_alignment_is_the_textbook_path():
    """The compare's alignment (numpy rounds, galloping snakes, the multiset bound) gives the very
    pairs of the one-diagonal-at-a-time algorithm, and gives up exactly when it needs more edits."""
    import numpy as np

    from msmemscope.analysis.compare import align
    rng = np.random.default_rng(5)
    for trial in range(300):
        n, m = int(rng.integers(0, 60)), int(rng.integers(0, 60))
        vocab = int(rng.integers(1, 6))
        if trial % 3 == 0:  # periodic, as training steps are, with a few edits
            base = np.tile(rng.integers(0, vocab, 7), 12)[:n]
            b = base.copy().tolist()
            for _ in range(int(rng.integers(0, 5))):
                if b:
                    b[int(rng.integers(0, len(b)))] = int(rng.integers(0, vocab + 2))
            a, b = base, np.asarray(b, dtype=np.int64)
        else:
            a, b = rng.integers(0, vocab, n), rng.integers(0, vocab, m)
        n, m = len(a), len(b)
        ref, D = _textbook_myers(a.tolist(), b.tolist())
        ai, bi, minimal = align(a, b)
        assert minimal
        got = list(zip(ai.tolist(), bi.tolist()))
        # the prefix/suffix strip may place equal items differently only where the reference's
        # script is equally short: the edit count is the same and every pair matches names
        assert sum(1 for x, y in got if x < 0 or y < 0) == D
        assert all(a[x] == b[y] for x, y in got if x >= 0 and y >= 0)
        # with a limit below D it gives up (not minimal), at or above it does not (a middle part
        # with one side empty after the common start and end are stripped needs no search)
        al, bl = a.tolist(), b.tolist()
        p = 0
        while p < min(n, m) and al[p] == bl[p]:
            p += 1
        q = 0
        while q < min(n, m) - p and al[n - 1 - q] == bl[m - 1 - q]:
            q += 1
        if D and n - p - q > 0 and m - p - q > 0:
            assert align(a, b, max_edits=D - 1)[2] is False
            assert align(a, b, max_edits=D)[2] is True


@pytest.mark.parametrize("dump", [d for d in G.dumps() if d.endswith(".csv")])
def test_zstd_compressed_dump_reads_as_the_plain_one(dump, tmp_path):
    """A ``.csv.zst`` dump (written in several frames, as a streaming writer would) gives every
    analysis what the plain CSV gives; one cut short in its last frame keeps its complete rows."""
    zstandard = pytest.importorskip("zstandard")
    from msmemscope.io.reader import TruncatedDumpWarning, find_dumps, read_dump
    data = open(dump, "rb").read()
    z = tmp_path / ("memscope_dump_" + os.path.basename(dump) + ".zst")
    c = zstandard.ZstdCompressor(level=3)
    z.write_bytes(b"".join(c.compress(data[i:i + 4000]) for i in range(0, len(data), 4000)))
    assert find_dumps(str(tmp_path)) == [str(z)]
    old, new = GOLD[os.path.basename(dump)], G.outputs(str(z))
    for key in ("read_dump", "check_leaks", "check_step_leaks", "inefficient", "decompose", "summary",
                "memory_snapshot", "perfetto"):
        # results and errors name the file: the same but for its name
        import json
        assert (json.dumps(new[key], sort_keys=True).replace(str(z), "<dump>")
                == json.dumps(old[key], sort_keys=True).replace(dump.replace(G.HERE, "<tests>"), "<dump>")), key
    # cut in the middle of the last frame: the rows before the cut, and a warning
    cut = tmp_path / "cut" / z.name
    cut.parent.mkdir()
    blob = z.read_bytes()
    cut.write_bytes(blob[:len(blob) - 300])
    with pytest.warns(TruncatedDumpWarning):
        part = read_dump(str(cut))
    full = read_dump(dump)
    assert 0 < part.height < full.height
    same = full.filter(pl.col("id").is_in(part["id"].implode()))  # the original's rows are not in ID order
    assert part.drop("step").equals(same.drop("step"))


CSV_DUMPS = [d for d in G.dumps() if d.endswith(".csv")]


@pytest.mark.parametrize("dump", CSV_DUMPS, ids=os.path.basename)
def test_batched_read_is_the_full_read(dump):
    """``read_dump_batched`` in batches of a few KB (hundreds of batches) gives ``read_dump``'s
    columns (text as categoricals, Attr text only off the MALLOC/FREE/ACCESS rows) and the same
    HTML report data."""
    import json
    from msmemscope.io.reader import DEFAULT_COLUMNS, read_dump, read_dump_batched
    from msmemscope.report import html as H
    cols = DEFAULT_COLUMNS + ("op", "step_number")
    # make test: about 40 batches a dump; make test-full: batches of 4 KB (hundreds)
    small = long_or_short(max(4096, os.path.getsize(dump) // 40), 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = read_dump(dump, columns=cols)
        got = read_dump_batched(dump, columns=cols, batch_bytes=small)
        for events in [("MALLOC",), ("SYSTEM", "OP_LAUNCH")]:
            part = read_dump_batched(dump, columns=("size", "step", "op"), events=events, batch_bytes=2 * small)
            want = read_dump(dump, columns=("size", "step", "op"), events=events)
            assert part.with_columns(pl.col("op").cast(pl.String)).equals(want), events
        a = H.build_frame(full, [dump], None)
        from msmemscope.report.common import REPORT_COLUMNS
        b = H.build_frame(read_dump_batched(dump, columns=REPORT_COLUMNS, batch_bytes=small), [dump], None)
    assert got.columns == full.columns and got.height == full.height
    assert all(got.schema[c] == pl.Categorical for c in ("event", "name", "py_stack", "owner"))
    plain = got.with_columns(pl.col(c).cast(pl.String) for c, t in got.schema.items() if t == pl.Categorical)
    bulk = pl.col("event").is_in(["MALLOC", "FREE", "ACCESS"])
    assert plain.equals(full.with_columns(attr=pl.when(bulk).then(None).otherwise(pl.col("attr"))))
    a.pop("generated"), b.pop("generated")
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_batched_read_checks_every_batch(tmp_path):
    """A quoted field with a newline at a batch's edge stays one row; a row that cannot be true in
    a late batch, or an ID repeated across batches, is refused as by ``read_dump``."""
    from msmemscope.io.reader import DumpError, read_dump, read_dump_batched
    from msmemscope.events import HEADER
    rows = []
    for i in range(1, 801):
        if i % 2:
            rows.append(f'{i},MALLOC,PTA,op,{1000 + i},1,1,cpu,N/A,"{{""allocation_id"":{i},""addr"":""0x{i:x}"",'
                        f'""size"":64,""used"":64,""total"":64}}","a.py:1(f)\nb.py:2(g)",')
        else:
            rows.append(f'{i},FREE,PTA,N/A,{1000 + i},1,1,cpu,N/A,"{{""allocation_id"":{i - 1},""addr"":""0x{i - 1:x}"",'
                        f'""size"":64,""used"":0,""total"":0}}",,')
    good = tmp_path / "memscope_dump_good.csv"
    good.write_text(HEADER + "\n" + "\n".join(rows) + "\n")
    for bb in (1000, 4096, 1 << 20):
        got = read_dump_batched(str(good), batch_bytes=bb)
        assert got.height == 800 and got["py_stack"].cast(pl.String).drop_nulls().unique().to_list() == \
            ["a.py:1(f)\nb.py:2(g)"]
    bad_rows = {"nul": rows[:501] + [rows[501].replace(",FREE,", ",FR\x00EE,")] + rows[502:],
                "twice": rows + [rows[3].replace("4,FREE", "4,SYSTEM")],
                "negative": rows[:600] + [rows[600].replace('""size"":64', '""size"":-64')] + rows[601:],
                # the FREE of block 701 written (ID 701) before its MALLOC (ID 702)
                "free first": rows[:700] + [rows[701].replace("702,", "701,", 1),
                                             rows[700].replace("701,", "702,", 1)] + rows[702:]}
    for name, rs in bad_rows.items():
        p = tmp_path / f"memscope_dump_{name.replace(' ', '_')}.csv"
        p.write_text(HEADER + "\n" + "\n".join(rs) + "\n")
        with pytest.raises(DumpError, match="NUL|more than once|negative|before the MALLOC") as want:
            read_dump(str(p))
        with pytest.raises(DumpError) as got:
            read_dump_batched(str(p), batch_bytes=4096)
        assert str(got.value) == str(want.value), name
