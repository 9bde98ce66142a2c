"""Disk a long run can afford (issue 22, item 6): compressed dumps written online
(``--compress=zstd``) and the bounded dump (``--keep-steps=N``, io/bounded.py), read by every
command; both capture sources; invariants on every dump."""
from __future__ import annotations

import json
import os
import sys

import polars as pl
import pytest

from conftest import (FULL, ROOT, check_invariants, dump_of, env_for_tests, full, read, read_after_stop, run_cli,
                      run_folders)

zstandard = pytest.importorskip("zstandard")
LEAKS = os.path.join(ROOT, "tests", "progs", "leak_cases.py")
KILLED = os.path.join(ROOT, "tests", "scripts", "killed_compressed.py")
SOURCES = ("native", "python")


def _env(source):
    env = env_for_tests()
    env.pop("MSMEMSCOPE_SOURCE", None)
    if source == "python":
        env["MSMEMSCOPE_SOURCE"] = "python"
    return env


def _steps_of(df):
    """step -> (rows, summarised?) of a dump's reader frame."""
    summ = set(df.filter(pl.col("event_type") == "STEP_SUMMARY")["step"].to_list())
    return {s: (n, s in summ) for s, n in df.group_by("step").len().iter_rows()}


def _command(args) -> tuple[int, str]:
    """An offline command run in this process (as ``msmemscope <args>`` runs it): status, stdout."""
    import contextlib
    import importlib
    import io
    import warnings
    from msmemscope.cli import SUBCOMMANDS
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = importlib.import_module(SUBCOMMANDS[args[0]]).main(list(args[1:]))
    assert rc == 0, (args, err.getvalue()[-2000:])
    return rc, buf.getvalue()


def _site_keys(res):
    return sorted((s["op"], s.get("python"), s.get("label"), s["bytes_per_step"], s["first_step"])
                  for s in res["sites"])


def test_compressed_dump_written_online_killed_twice(tmp_path):
    """--compress=zstd: the dump is memscope_dump_*.csv.zst; its writer process is SIGKILLed
    (the traced process appends after the last whole frame), then the program is SIGKILLed: every
    row flushed before the kill is read back, without a cut-short warning, invariants hold."""
    import warnings
    from msmemscope.io.reader import TruncatedDumpWarning, read_dump
    from msmemscope.io.writers import last_id_in
    out = tmp_path / "o"
    env = env_for_tests()
    env["MSMEMSCOPE_STEP_FLUSH_S"] = "0"  # every step flushed at its end: the SIGKILL keeps them all
    r = run_cli(["-o", str(out), "--compress=zstd:5", KILLED, "6"], env=env)
    assert r.returncode == 128 + 9, r.stderr
    assert [l.split()[1] for l in r.stdout.splitlines() if l.startswith("step")] == [str(i) for i in range(1, 7)]
    [folder] = run_folders(out)
    dump = dump_of(folder)
    assert dump.endswith(".csv.zst")
    with open(dump, "rb") as f:
        assert f.read(4) == b"\x28\xb5\x2f\xfd"
    with warnings.catch_warnings():
        warnings.simplefilter("error", TruncatedDumpWarning)
        df = read_dump(dump)
    check_invariants(df)
    steps = [json.loads(a)["step"] for a in df.filter(pl.col("event_type") == "STEP")["attr"].to_list()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert last_id_in(dump) == df["id"].max()
    assert df["id"].to_list() == list(range(1, df.height + 1))  # nothing lost at the writer's death
    assert zstandard.ZstdDecompressor().stream_reader(open(dump, "rb"), read_across_frames=True).read().startswith(
        b"ID,Event,")
    # a kill inside the last frame: the complete rows before it (the frame's data up to the cut
    # that zstd gives back ends inside a row: a warning), never an error
    cut = tmp_path / "cut" / os.path.basename(dump)
    cut.parent.mkdir()
    blob = open(dump, "rb").read()
    cut.write_bytes(blob[:len(blob) - 200])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedDumpWarning)
        part = read_dump(str(cut))
    assert 0 < part.height < df.height and part.drop("step").equals(df.head(part.height).drop("step"))
    # every command reads it
    # its bounded form with the last steps summarised too (a writer that holds few rows): the run
    # summary's peaks, reached inside steps by blocks that the summarised steps drop, are the same
    from msmemscope.io.bounded import rewrite
    from msmemscope.report import summary
    tight = rewrite(dump, str(tmp_path / "memscope_dump_t.csv"), 2, max_held_rows=100)
    td = read(tight)
    check_invariants(td)
    assert td.filter(pl.col("event_type") == "STEP_SUMMARY").height >= 5
    assert summary.peaks_of(summary.load_columns(tight)[0]) == summary.peaks_of(summary.load_columns(dump)[0])
    # the commands read it (the others: the bounded run's test below)
    for args in (["check-leaks", dump], ["export", dump, "--format=perfetto", "-o", str(tmp_path / "t.json")]):
        _command(args)


@pytest.mark.parametrize("source", SOURCES if FULL else ("native",))
def test_bounded_compressed_run_keeps_the_leak_findings(tmp_path, source):
    """A training loop with a planted leak (leak_cases.py 'hook') and a look-alike cache, run with
    --keep-steps=N --compress=zstd: the dump holds the last N steps and the first step of each
    site that leaves blocks behind in full, one summary row for each other step, invariants hold;
    check-leaks on it finds the same growing sites as the online analysis (which saw every row);
    every command reads it; the summarised steps cost a fraction of a full one."""
    steps, keep = full(24, 200), 4
    out = tmp_path / "o"
    r = run_cli(["-o", str(out), f"--keep-steps={keep}", "--compress=zstd", LEAKS, "hook,cache",
                 str(tmp_path / "truth.json"), str(steps)], env=_env(source))
    assert r.returncode == 0, r.stderr
    [folder] = run_folders(out)
    dump = dump_of(folder)
    assert dump.endswith(".csv.zst")
    df = read(dump)
    check_invariants(df)
    per = _steps_of(df)
    whole = [s for s, (_, summ) in per.items() if not summ]
    summarised = [s for s, (_, summ) in per.items() if summ]
    # the last `keep` ended steps, the rows after the last step end, and at most `keep` flagged steps
    last = max(per)
    assert set(range(last - keep, last + 1)) <= set(whole)
    assert len(whole) <= 2 * keep + 1, sorted(whole)
    assert len(summarised) >= steps - 2 * keep - 1
    big = min(per[s][0] for s in whole if s not in (1, last))
    assert max(per[s][0] for s in summarised) * 4 < big, per
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        online = json.load(f)
    assert [s["op"].split("@")[0].rsplit(".", 2)[-2] for s in online["sites"]] == ["clone"], online["sites"]
    offline = json.loads(_command(["check-leaks", "--json", dump])[1])
    assert _site_keys(offline) == _site_keys(online)
    assert [(k["alloc_id"], k["step"]) for k in offline["leaks"]] == [(k["alloc_id"], k["step"]) for k in online["leaks"]]
    assert offline["fluctuation"] == online["fluctuation"]
    if source == "python" and not FULL:
        return  # the commands read the same kind of dump from either source
    from msmemscope.analysis import compare
    nums = [json.loads(a)["step"] for a in df.filter(pl.col("event_type") == "STEP")["attr"].to_list()]
    res = compare.compare(f"{dump}:step={nums[-2]}", f"{dump}:step={nums[-1]}", output=str(tmp_path / "cmp"))
    assert res.table.height > 20 and os.path.exists(res.path)
    for args in (["summary", folder], ["show", dump], ["decompose", dump], ["check-inefficient", dump],
                 ["report", folder, "-o", str(tmp_path / "r.html")],
                 ["export", dump, "--format=memory-snapshot", "-o", str(tmp_path / "s.pickle")]):
        _command(args)


def test_bounded_form_of_a_dump_keeps_every_kept_row_and_result(tmp_path):
    """The same rows, whole and bounded (io/bounded.rewrite, the code the writer runs): every row
    of a kept step is identical, the leak results (sites, block findings, fluctuation, the step
    rule) are identical, and the step compare of two kept steps is identical."""
    from msmemscope.analysis import compare, leaks
    from msmemscope.io.bounded import rewrite
    out = tmp_path / "o"
    r = run_cli(["-o", str(out), LEAKS, "hook,cat,window", str(tmp_path / "truth.json"), str(full(16, 120))])
    assert r.returncode == 0, r.stderr
    src = dump_of(run_folders(out)[0])
    small = rewrite(src, str(tmp_path / "memscope_dump_b.csv"), 3)
    whole, bounded = read(src), read(small)
    check_invariants(whole)
    check_invariants(bounded)
    per = _steps_of(bounded)
    kept = [s for s, (_, summ) in per.items() if not summ]
    assert len(kept) < len(per) / 3
    pick = lambda d: d.filter(pl.col("step").is_in(kept)).drop("step")
    assert pick(bounded).equals(pick(whole))
    assert os.path.getsize(small) * 2 < os.path.getsize(src)
    # the same bounding through the SQLite writer and the zstd one: the same rows
    db = rewrite(src, str(tmp_path / "memscope_dump_b.db"), 3, data_format="db")
    zst = rewrite(src, str(tmp_path / "memscope_dump_c.csv"), 3, compress="zstd")
    assert zst.endswith(".csv.zst")
    blank = lambda d: d.with_columns(pl.col("attr", "py_stack", "c_stack").fill_null(""))  # the db reads ''
    assert blank(read(db)).equals(blank(bounded)) and read(zst).equals(bounded)
    t1, t2 = leaks.replay(leaks._read(src)), leaks.replay(leaks._read(small))
    assert leaks.result_json(t1) == leaks.result_json(t2)
    assert leaks.step_leaks(whole) == leaks.step_leaks(bounded)
    assert leaks.fluctuation(whole) == leaks.fluctuation(bounded)
    # a writer that may hold only a few hundred rows: steps leave the window early, a step longer
    # than that is written whole as it comes; still a valid dump with the same leak results
    tight = rewrite(src, str(tmp_path / "memscope_dump_t.csv"), 3, max_held_rows=300)
    td = read(tight)
    check_invariants(td)
    assert whole.height > td.height and _steps_of(td) != per  # held fewer steps: other steps summarised
    assert leaks.result_json(leaks.replay(leaks._read(tight))) == leaks.result_json(t1)
    # the run summary's peaks: a summarised step's peak is in its used_range
    from msmemscope.report import summary
    peaks = summary.peaks_of(summary.load_columns(src)[0])
    for d in (small, tight):
        assert summary.peaks_of(summary.load_columns(d)[0]) == peaks
    nums = [json.loads(a)["step"] for a in whole.filter(pl.col("event_type") == "STEP")["attr"].to_list()]
    a, b = nums[-2], nums[-1]  # the last two ended steps: kept whole
    ra = compare.compare(f"{src}:step={a}", f"{src}:step={b}")
    rb = compare.compare(f"{small}:step={a}", f"{small}:step={b}")
    assert ra.table.height > 50 and ra.table.equals(rb.table)


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test reads bounded compressed dumps after stop in the other tests of this file")
def test_bounded_compressed_dump_complete_when_stop_returns(tmp_path):
    """config(keep_steps=3, compress="zstd"), then stop() and read the dump in the same process
    (tests/scripts/read_after_stop.py): the held steps are on disk when stop() returns (the last
    row is the last row written), start() appends after them, the end of the run keeps the last
    steps whole; invariants hold."""
    seen = read_after_stop(tmp_path / "o", {"keep_steps": 3, "compress": "zstd"})
    for which in ("first", "second"):
        height, written, last = seen[which]
        assert last == written and 0 < height < written, (which, seen)  # rows dropped, none missing
    [folder] = run_folders(tmp_path / "o")
    dump = dump_of(folder)
    assert dump.endswith(".csv.zst")
    df = read(dump)
    check_invariants(df)
    per = _steps_of(df)
    assert sum(summ for _, summ in per.values()) >= 25, per  # 30 steps, then 5: most summarised
    kinds = df.filter(pl.col("event") == "SYSTEM")["event_type"].to_list()
    assert kinds.count("START_TRACE") == 2 and kinds.count("STOP_TRACE") == 2


def test_zstd_writer_frames_reopen_and_last_id(tmp_path):
    """ZstdCsvWriter: one frame per write; a file cut inside its last frame has that frame
    dropped by zstd_frames/last_id_in, and reopen() truncates it and appends whole frames after."""
    from msmemscope.io.reader import read_dump
    from msmemscope.io.writers import ZstdCsvWriter, last_id_in, zstd_frames
    row = lambda n: ("MALLOC", "PTA", "aten::empty", 1000 + n, 7, "cpu", 0x1000 + n, (n, 0x1000 + n, 8, 8 * n, 8 * n, ""),
                     None, None)
    free = lambda n: ("FREE", "PTA", "aten::empty", 2000 + n, 7, "cpu", 0x1000 + n, (n, 0x1000 + n, 8, 8 * (n - 1), 8 * n),
                      None, None)
    w = ZstdCsvWriter(str(tmp_path / "memscope_dump_1.csv.zst"), 1)
    w.write([row(1)], 1, 5)
    w.write([row(2)], 2, 5)
    w.close()
    path = w.path
    with open(path, "rb") as f:
        assert len(zstd_frames(f)) == 3  # the header's, then one per write
    assert last_id_in(path) == 2
    blob = open(path, "rb").read()
    open(path, "wb").write(blob[:-5])  # killed inside the last frame
    with open(path, "rb") as f:
        assert len(zstd_frames(f)) == 2
    assert last_id_in(path) == 1
    w.reopen()
    w.write([row(2), free(2)], 2, 5)
    w.close()
    df = read_dump(path)
    assert df["id"].to_list() == [1, 2, 3] and df["event"].to_list() == ["MALLOC", "MALLOC", "FREE"]
    assert last_id_in(path) == 3


CAUGHT_OOM = """
import sys, torch
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
x = torch.randn(16, 32)
for step in range(int(sys.argv[1])):
    opt.zero_grad(set_to_none=True)
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    if step in (6, 9, 12):  # a batch too large, caught, and the run goes on (a batch-size search)
        try:
            h = m[0](x).relu()      # made in the failing step, freed in it: the newest block at the failure
            torch.empty(1 << 50)
        except RuntimeError:
            del h
print("loss", loss.item().hex())
"""


def test_bounded_run_keeps_the_steps_where_allocations_failed(tmp_path):
    """A program that catches an OOM and runs on (three failures), with --keep-steps=2: the first
    two steps with a failure are kept whole (each row as in the dump without the bound), and in the
    third, summarised, every block its OOM rows name still has its MALLOC and FREE rows. (The OOM
    analysis runs on the dispatch-mode source, so one source.)"""
    prog = tmp_path / "caught_oom.py"
    prog.write_text(CAUGHT_OOM)
    dfs = {}
    for how, extra in (("whole", []), ("bounded", ["--keep-steps=2", "--compress=zstd"])):
        r = run_cli(["-q", "-o", str(tmp_path / how), "--analysis=oom:3,leaks", *extra, str(prog), "24"],
                    env=_env("native"))
        assert r.returncode == 0, r.stderr
        [folder] = run_folders(tmp_path / how)
        dfs[how] = df = read(dump_of(folder))
        check_invariants(df)
    whole, bounded = dfs["whole"], dfs["bounded"]
    oom_steps = sorted(whole.filter(pl.col("event_type") == "OOM_TRIGGER")["step"].to_list())
    assert len(oom_steps) == 3 and max(oom_steps) < max(whole["step"].drop_nulls()) - 3, oom_steps
    per = _steps_of(bounded)
    assert [per[s][1] for s in oom_steps] == [False, False, True], per  # whole, whole, summarised
    cols = ["event", "event_type", "name", "size", "alloc_id"]
    for s in oom_steps[:2]:
        assert bounded.filter(pl.col("step") == s).select(cols).equals(whole.filter(pl.col("step") == s).select(cols))
    named = bounded.filter(pl.col("event_type").is_in(["OOM_RECENT_ALLOC", "OOM_TOP_ALLOC"]))
    assert named.height >= 3 * 4, named
    ids = list(set(named["alloc_id"].to_list()))
    for ev in ("MALLOC", "FREE"):  # (a parameter named there is never freed)
        rows = {k: set(df.filter((pl.col("event") == ev) & pl.col("alloc_id").is_in(ids))["alloc_id"].to_list())
                for k, df in dfs.items()}
        assert rows["bounded"] == rows["whole"] and len(rows["whole"]) >= (len(ids) if ev == "MALLOC" else 3), (ev, rows)
    # the summarised step still drops what its OOM rows do not name
    s3 = oom_steps[2]
    assert bounded.filter(pl.col("step") == s3).height < whole.filter(pl.col("step") == s3).height


TEMPS = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(32, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 32)
cache = []
for s in range(int(sys.argv[1])):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    cache.append(torch.zeros(256))       # kept: a row of every summarised step, while ...
    if s < 2:
        cache.append(torch.zeros(256))
"""


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))
def test_fluctuation_of_a_bounded_dump_starts_each_step_from_the_true_level(tmp_path, source):
    """The step after a summarised one starts from the pool's level at that step's end, which its
    STEP_SUMMARY row says (``used_end``): its last kept row's ``used`` can count blocks the writer
    dropped, still live at that row (online MinGap 53.9% and offline 60.6% on this program before).
    The online analysis, the offline replay of the bounded dump and of the whole dump, and the
    vectorized fluctuation of both forms agree."""
    from msmemscope.analysis import leaks
    from msmemscope.io.bounded import rewrite
    prog = tmp_path / "prog.py"
    prog.write_text(TEMPS)
    env = _env(source)
    r = run_cli(["-o", str(tmp_path / "b"), "--keep-steps=1", sys.executable, str(prog), "8"], env=env)
    assert r.returncode == 0, r.stderr
    folder, = run_folders(tmp_path / "b")
    bounded = read(dump_of(folder))
    check_invariants(bounded)
    assert bounded.filter(pl.col("event_type") == "STEP_SUMMARY").height >= 3
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        on = json.load(f)
    off, = leaks.analyze(folder)
    assert off["fluctuation"] == on["fluctuation"]
    # the same program's whole dump, bounded after the run by the writer's own code
    r = run_cli(["-o", str(tmp_path / "w"), sys.executable, str(prog), "8"], env=env)
    assert r.returncode == 0, r.stderr
    src = dump_of(run_folders(tmp_path / "w")[0])
    small = rewrite(src, str(tmp_path / "memscope_dump_b.csv"), 1)
    whole, cut = read(src), read(small)
    check_invariants(whole)
    check_invariants(cut)
    t1, t2 = leaks.replay(leaks._read(src)), leaks.replay(leaks._read(small))
    assert leaks.fluct_json(t1.fluctuation()) == leaks.fluct_json(t2.fluctuation())
    assert leaks.fluctuation(whole) == leaks.fluctuation(cut)


def test_a_damaged_frame_loses_only_its_own_rows(tmp_path):
    """A .csv.zst dump damaged inside its second frame (not cut: the frames after it are whole): the
    readers give every frame but that one, with one warning that says so (before: everything after
    the damage was dropped and the dump said cut short; check-inefficient raised ZstdError and
    left a partial annotated copy)."""
    import warnings
    from msmemscope.io.reader import DamagedDumpWarning, read_dump
    from msmemscope.io.writers import ZstdCsvWriter, zstd_frames
    row = lambda n: ("MALLOC", "PTA", "aten::empty", 1000 + n, 7, "cpu", 0x1000 + n,
                     (n, 0x1000 + n, 64, 64 * n, 64 * n, ""), None, None)
    w = ZstdCsvWriter(str(tmp_path / "memscope_dump_1.csv.zst"), 1)
    n = 0
    for _ in range(3):  # three frames of 3,000 rows
        w.write([row(n + i) for i in range(1, 3001)], n + 1, 5)
        n += 3000
    w.close()
    path = w.path
    with open(path, "rb") as f:
        frames = zstd_frames(f)
    assert len(frames) == 4  # the header's, then one per write
    start, end = frames[2]
    blob = bytearray(open(path, "rb").read())
    mid = (start + end) // 2
    blob[mid:mid + 8] = b"\xff" * 8
    open(path, "wb").write(bytes(blob))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = read_dump(path)
    assert [str(c.message) for c in caught if issubclass(c.category, DamagedDumpWarning)], caught
    ids = df["id"].to_list()
    assert ids == list(range(1, 3001)) + list(range(6001, 9001))
    for cmd in (["check-inefficient"], ["check-leaks"], ["export", "--format=perfetto", "-o", str(tmp_path / "t.json")]):
        r = run_cli([*cmd, path])
        assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.stderr[-2000:])
        assert "damaged zstd frame" in r.stderr, (cmd, r.stderr)
    from msmemscope.analysis.inefficient import write_annotated_copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copy = read_dump(write_annotated_copy(path, {5: "early_allocation", 7000: "late_deallocation"}))
    assert copy["id"].to_list() == ids  # the annotated copy: every readable row, annotated
    assert copy.filter(pl.col("attr").str.contains("inefficient_type"))["id"].to_list() == [5, 7000]
