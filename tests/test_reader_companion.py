"""The columnar companion of a big CSV dump (``io/reader.py``, ``read_dump_batched``): a hidden
parquet file beside the dump that a later batched read (the HTML report) takes instead of parsing
the text. It must give the very columns the text gives, never be used once the dump (or its run's
config.json, or the reader's code) changed, and never be needed: absent, corrupt or unwritable,
the read stands on the CSV alone."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

import offline_golden as G  # noqa: E402  (tests/ is on sys.path under pytest)
from msmemscope.io import reader as R
from msmemscope.report.common import REPORT_COLUMNS

# real dumps of real runs: ours with owners and stacks, ours with access events, the original's
DUMPS = [d for d in G.dumps() if d.endswith(".csv")]


@pytest.fixture
def big(monkeypatch):
    """Every dump counts as big enough for a companion."""
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES", "0")
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE", raising=False)


def _copy(dump, tmp_path) -> str:
    out = tmp_path / os.path.basename(dump)
    shutil.copyfile(dump, out)
    return str(out)


def _read(path, columns=REPORT_COLUMNS, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return R.read_dump_batched(path, columns=columns, **kw)


def _no_text(monkeypatch):
    """From now on a read that parses the CSV fails the test: the companion must answer."""
    def refuse(*a, **k):
        raise AssertionError("the CSV was parsed although its companion is current")
    monkeypatch.setattr(R, "_read_batched", refuse)


@pytest.mark.parametrize("dump", DUMPS, ids=os.path.basename)
def test_the_companion_gives_the_columns_the_text_gives(big, dump, tmp_path, monkeypatch):
    from msmemscope.report import html as H
    path = _copy(dump, tmp_path)
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE", "0")
    text = _read(path)
    assert not os.path.exists(R.companion_path(path))  # turned off: no file
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE")
    cold = _read(path)
    assert os.path.isfile(R.companion_path(path)) and os.path.basename(R.companion_path(path)).startswith(".")
    _no_text(monkeypatch)
    warm = _read(path)
    for got in (cold, warm):
        assert got.schema == text.schema and got.equals(text)
    # a subset of the columns is served from it too; the rows of some events are filtered from it
    # only through the text (an events= read does not touch the companion)
    sub = _read(path, columns=("size", "op", "owner"))
    assert sub.equals(text.select(sub.columns))
    a = H.build_frame(text, [path], None)
    b = H.build_frame(warm, [path], None)
    a.pop("generated"), b.pop("generated")
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_a_changed_dump_is_read_from_its_text(big, tmp_path, monkeypatch):
    """Same size and the mtime put back: the change of ctime (and of content) still says so;
    rows added (a dump still being written) change the size."""
    path = _copy(DUMPS[0], tmp_path)
    first = _read(path)
    st = os.stat(path)
    with open(path, "rb") as f:
        data = f.read()
    # one MALLOC's size changed, same number of bytes
    at = data.index(b'""size"":', data.index(b"MALLOC")) + len(b'""size"":')
    digit = data[at:at + 1]
    swapped = data[:at] + (b"1" if digit != b"1" else b"2") + data[at + 1:]
    with open(path, "wb") as f:
        f.write(swapped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    second = _read(path)
    assert not second.equals(first)
    assert second.equals(_read_text(path))
    # and the companion now describes the new text: used, and right
    calls = []
    real = R._read_batched
    monkeypatch.setattr(R, "_read_batched", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert _read(path).equals(second) and not calls


def _read_text(path):
    old = os.environ.get("MSMEMSCOPE_COLUMN_CACHE")
    os.environ["MSMEMSCOPE_COLUMN_CACHE"] = "0"
    try:
        return _read(path)
    finally:
        if old is None:
            del os.environ["MSMEMSCOPE_COLUMN_CACHE"]
        else:
            os.environ["MSMEMSCOPE_COLUMN_CACHE"] = old


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "other dump", "other code", "folder"])
def test_a_bad_companion_is_no_companion(big, damage, tmp_path, monkeypatch):
    path = _copy(DUMPS[1], tmp_path)
    want = _read_text(path)
    _read(path)
    cache = R.companion_path(path)
    if damage == "garbage":
        with open(cache, "wb") as f:
            f.write(b"PAR1 not a parquet file at all" * 100)
    elif damage == "truncated":
        with open(cache, "rb") as f:
            data = f.read()
        with open(cache, "wb") as f:
            f.write(data[: len(data) // 2])
    elif damage == "empty":
        open(cache, "wb").close()
    elif damage == "other dump":  # the companion of another dump put in its place
        other = _copy(DUMPS[0], tmp_path)
        _read(other)
        os.replace(R.companion_path(other), cache)
    elif damage == "other code":  # written by another version of the reader
        monkeypatch.setattr(R, "_code_hash", "0" * 32)
    elif damage == "folder":
        os.remove(cache)
        os.mkdir(cache)
    got = _read(path)
    assert got.schema == want.schema and got.equals(want)
    if damage != "folder":  # made again, good this time
        _no_text(monkeypatch)
        assert _read(path).equals(want)


def test_no_companion_where_it_cannot_or_need_not_be(tmp_path, monkeypatch):
    monkeypatch.delenv("MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES", raising=False)
    path = _copy(DUMPS[0], tmp_path)
    want = _read_text(path)
    # a small dump (the default threshold is 64 MiB): read from its text, nothing written
    assert _read(path).equals(want) and not os.path.exists(R.companion_path(path))
    # a folder that cannot be written (root writes anywhere: a path that cannot exist)
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES", "0")
    monkeypatch.setattr(R, "companion_path", lambda p: os.path.join(str(tmp_path), "no-such-dir", "c.parquet"))
    assert _read(path).equals(want)
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left either
    # a dump that is refused leaves no companion, and is refused again in the same words
    monkeypatch.undo()
    monkeypatch.setenv("MSMEMSCOPE_COLUMN_CACHE_MIN_BYTES", "0")
    with open(path, "rb") as f:
        data = f.read()
    bad = tmp_path / "memscope_dump_bad.csv"
    bad.write_bytes(data.replace(b",MALLOC,", b",MAL\x00LOC,", 1))
    for _ in range(2):
        with pytest.raises(R.DumpError, match="NUL"):
            _read(str(bad))
    assert not os.path.exists(R.companion_path(str(bad)))


def test_warnings_of_the_text_are_said_again_from_the_companion(big, tmp_path):
    """A dump cut short by a kill says so on every read, its companion's too."""
    src = _copy(DUMPS[0], tmp_path)
    with open(src, "rb") as f:
        data = f.read()
    path = tmp_path / "memscope_dump_cut.csv"
    path.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 20])  # the last row half written
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            df = R.read_dump_batched(str(path), columns=REPORT_COLUMNS)
        assert [w for w in caught if issubclass(w.category, R.TruncatedDumpWarning)], caught
        assert os.path.isfile(R.companion_path(str(path)))
    assert df.height == _read_text(str(path)).height


def test_the_runs_config_is_part_of_the_key(big, tmp_path):
    """One check (a FREE that no MALLOC made) depends on what the run's config.json says."""
    run = tmp_path / "run"
    dump_dir = run / "rank_0" / "dump"
    dump_dir.mkdir(parents=True)
    path = _copy(DUMPS[0], dump_dir)
    k1 = R._companion_key(path, os.path.getsize(path))
    (run / "config.json").write_text(json.dumps({"options": {"events": "alloc,free"}}))
    k2 = R._companion_key(path, os.path.getsize(path))
    assert k1 != k2 and k1["config"] is None and k2["config"] is not None
