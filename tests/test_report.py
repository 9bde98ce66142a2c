"""Report, exports, load(): on real traced training runs (examples/mlp.py with marks, without
owners or stacks; tests/progs/report_train.py with owners, stacks, analyses and a planted leak;
two rank processes under one root), on the original tool's dumps, and in a real headless
Chromium (one browser per module)."""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from contextlib import redirect_stdout

import polars as pl
import pytest

from conftest import EXAMPLES, PEER, ROOT, check_invariants, dump_of, env_for_tests, full, read, run_cli, run_folders

# a mark whose name holds the template's slot markers, a script end tag and the two JavaScript
# line separators (RELIABILITY.md: the report's data can never touch its template)
HOSTILE = "x/*JS*/y/*DATA*/%TITLE%</script><script>window.pwned=1</script>&amp;\u2028\u2029<!--"
SCRIPT = """
import runpy, sys
import torch
import msmemscope
_step = torch.optim.SGD.step
def step(self, *a, **k):
    msmemscope.mark("optimizer step")
    return _step(self, *a, **k)
torch.optim.SGD.step = step
rid = msmemscope.range_start("training")
sys.argv = ["mlp.py", "--steps", "3"]
runpy.run_path(%r, run_name="__main__")
msmemscope.range_end(rid)
msmemscope.mark(%r)
""" % (os.path.join(EXAMPLES, "mlp.py"), HOSTILE)
TRAIN = os.path.join(ROOT, "tests", "progs", "report_train.py")
LEAK_LINE = "report_train.py:%d" % next(i for i, ln in enumerate(open(TRAIN), 1) if "# LEAK_LINE" in ln)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A traced training run without owners or Python stacks: (run folder, dump path, frame)."""
    base = tmp_path_factory.mktemp("report")
    script = base / "train.py"
    script.write_text(SCRIPT)
    out = base / "out"
    r = run_cli(["--output", str(out), str(script)])
    assert r.returncode == 0, r.stderr
    (folder,) = run_folders(out)
    dump = dump_of(folder)
    df = read(dump)
    check_invariants(df)
    return folder, dump, df


@pytest.fixture(scope="module")
def owned(tmp_path_factory):
    """AdamW training with owners (decompose), Python stacks, leaks and inefficient analyses."""
    out = tmp_path_factory.mktemp("report-owned") / "out"
    r = run_cli(["--output", str(out), "--analysis=leaks,decompose,inefficient", "--call-stack=python:8",
                 TRAIN, "5"])
    assert r.returncode == 0, r.stderr
    (folder,) = run_folders(out)
    dump = dump_of(folder)
    df = read(dump)
    check_invariants(df)
    return folder, dump, df


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Two rank processes of one job under one root (RANK/WORLD_SIZE as torchrun sets them);
    rank 1 runs longer, so its planted leak makes it the outlier."""
    root = tmp_path_factory.mktemp("report-ranks") / "job"
    procs = []
    for rank, steps in ((0, 2), (1, 5)):
        env = env_for_tests()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-m", "msmemscope", "--output", str(root),
                                       "--call-stack=python:6", TRAIN, str(steps)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    folders = sorted(run_folders(root), key=lambda f: json.load(open(os.path.join(f, "config.json")))["rank"])
    assert len(folders) == 2, folders
    for f in folders:
        check_invariants(read(dump_of(f)))
    return str(root), folders


@pytest.fixture
def folder_copy(run, tmp_path):
    dst = tmp_path / os.path.basename(run[0])
    shutil.copytree(run[0], dst)
    return str(dst)


def cli_ok(args):
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    return r


def written(r, kind):
    line = [x for x in r.stderr.splitlines() if x.startswith(f"[msmemscope] {kind}: ")]
    assert line, r.stderr
    return line[-1].split(": ", 1)[1]


def mem_rows(df):
    return df.filter(pl.col("event").is_in(["MALLOC", "FREE"]))


# ------------------------------------------------------------------ HTML report: content
def test_report_is_one_self_contained_file_and_never_overwrites(folder_copy, run):
    r1 = cli_ok(["report", folder_copy])
    p1 = written(r1, "report")
    assert p1 == os.path.join(folder_copy, "msmemscope_report.html")
    text = open(p1, encoding="utf-8").read()
    assert "<script src" not in text and "<link" not in text
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", text), "the page must not reach the network"
    assert "echarts" in text and len(text.encode()) < 5_000_000
    r2 = cli_ok(["report", folder_copy])
    p2 = written(r2, "report")
    assert p2 != p1 and os.path.exists(p1) and open(p1, encoding="utf-8").read() == text


def undelta(xs):
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


def leaf_values(live, j):
    """Bytes of each live-view leaf at moment j (the change-point encoding the page reads)."""
    out = []
    for lf in live["leaves"]:
        v, val = lf["v"], 0
        for k in range(0, len(v), 2):
            if v[k] <= j:
                val = v[k + 1]
        out.append(val)
    return out


def check_series(s, mem):
    """A timeline series against the dump's own rows: every level counts every event once,
    keeps the peak, and its layers add up to the allocated bytes at every point."""
    assert s["peak"] == mem["used"].max() and s["events"] == mem.height
    for lv in s["levels"]:
        hi, lo = undelta(lv["hi"]), undelta(lv["lo"])
        assert sum(lv["n"]) == mem.height and len(hi) <= lv["buckets"]
        assert max(hi) == s["peak"] and min(lo) == mem["used"].min()
        layers = [undelta(x) for x in lv["layers"]]
        assert all(sum(v[i] for v in layers) == hi[i] for i in range(len(hi)))
        t = undelta(lv["t"])
        assert t == sorted(t)
    assert len(s["levels"][0]["hi"]) <= 1200 and len(s["levels"]) >= 2
    # live view: at the peak the leaves hold the peak's bytes, at each step end the bytes in use there
    live = s["live"]
    assert sum(leaf_values(live, live["peak"])) == s["peak"] == live["used"][live["peak"]]
    for j in range(len(live["t"])):
        assert sum(leaf_values(live, j)) == live["used"][j]


def test_report_data_matches_the_dump(run):
    from msmemscope.report.html import build
    folder, dump, df = run
    data = build(dump)
    (s,) = data["series"]
    mem = mem_rows(df)
    check_series(s, mem)
    assert s["by"] == "op" and not s["live"]["has_stacks"]
    assert all(n.startswith("aten.") or n.startswith("(") for n in s["layers"])
    steps = df.filter(pl.col("event_type") == "STEP")
    assert [x["step"] for x in data["steps"]] == steps["step"].to_list() and len(data["steps"]) == 3
    # each step end is a sampled moment, and the live bytes there are the dump's used at that row
    live = s["live"]
    for st, rid in steps.select("step", "id").iter_rows():
        used_then = mem.filter(pl.col("id") < rid)["used"][-1]
        assert live["used"][live["step_end"][str(st)]] == used_then
    assert [m["name"] for m in data["marks"]][:3] == ["optimizer step"] * 3
    assert data["marks"][-1]["name"] == df.filter(pl.col("event_type") == "Mark")["name"][-1]
    assert [r["name"] for r in data["ranges"]] == ["training"]
    tables = {t["title"]: t for t in data["tables"]}
    per = tables["Per-step summary"]
    want = mem.group_by("step").agg(peak=pl.col("used").max(), allocs=(pl.col("event") == "MALLOC").sum(),
                                    frees=(pl.col("event") == "FREE").sum()).sort("step")
    assert [(r[0], r[3], r[4], r[5]) for r in per["rows"]] == [tuple(r) for r in want.iter_rows()]
    top = tables["Top ops by bytes allocated"]["rows"]
    mallocs = df.filter(pl.col("event") == "MALLOC")
    assert sum(r[1] for r in top) == mallocs["size"].sum()
    # compare: per op and step, the bytes each step allocated
    c = data["compare"]
    want = (mallocs.with_columns(op=pl.col("name").str.replace(r"^torch\._ops\.", "").replace("N/A", "(outside any op)"))
            .group_by("step", "op")
            .agg(b=pl.col("size").sum()))
    got = {(st, c["ops"][o]): b for st, o, b, n in c["cells"]}
    assert got == {(st, op): b for st, op, b in want.iter_rows()}


def test_report_of_an_owned_run_with_stacks(owned):
    """Owners: layers are what the memory is; stacks: the live view names the user's lines,
    the leak finding names the planted line."""
    from msmemscope.report.html import build
    folder, dump, df = owned
    data = build(folder)
    (s,) = data["series"]
    check_series(s, mem_rows(df))
    assert s["by"] == "owner"
    assert {"weights", "gradients", "optimizer state", "label: loader"} <= set(s["layers"]), s["layers"]
    assert s["layers"][:3] == ["weights", "gradients", "optimizer state"]
    # weights layer at the peak: the model's parameters (independent truth: their sizes)
    n_params = (128 * 256 + 256) + (256 * 16 + 16)
    peak_layers = dict(zip(s["layers"], s["peak_layers"]))
    assert peak_layers["weights"] == 4 * n_params
    assert peak_layers["optimizer state"] >= 2 * 4 * n_params  # AdamW: two moments (+ step counters)
    live = s["live"]
    assert live["has_stacks"]
    lines = {lf["line"] for lf in live["leaves"] if lf["line"]}
    assert any(LEAK_LINE in ln for ln in lines), lines
    labels = {f[0] for f in live["frames"]}
    assert any(lab.startswith("remember (report_train.py:") for lab in labels), labels
    # what grew from step 4 to 5: the planted 32 KiB, at the planted line
    a, b = leaf_values(live, live["step_end"]["4"]), leaf_values(live, live["step_end"]["5"])
    grew = {}
    for lf, x, y in zip(live["leaves"], a, b):
        if y != x:
            grew[lf["line"]] = grew.get(lf["line"], 0) + y - x
    leak = [v for k, v in grew.items() if k and LEAK_LINE in k]
    assert leak == [32768], grew
    texts = [f["text"] for f in data["findings"]]
    assert texts[0].startswith("Peak: ")
    leak_f = [f for f in data["findings"] if f["kind"] == "leak"]
    assert leak_f and LEAK_LINE in leak_f[0]["text"] and "32.00 KB" in leak_f[0]["text"], texts
    assert leak_f[0]["window"][0] < leak_f[0]["window"][1]
    assert any(f["kind"] == "inefficient" and " MB" in f["text"] or " KB" in f["text"] for f in data["findings"])


def test_findings_from_leak_sites_hand_made_and_malformed(folder_copy, tmp_path):
    """leaks.json with issue 19's ``sites`` (hand-made), inefficient and oom results, compare CSV;
    then the same files malformed: never a crash, a sentence saying what could not be read."""
    adir = os.path.join(folder_copy, "analysis")
    os.makedirs(adir, exist_ok=True)
    site = {"device": "cpu", "pool": "PTA", "op": "aten.clone.default", "python": "/w/train.py:45(hook)",
            "bytes_per_step": 32768, "live_bytes": 262144, "first_step": 1, "last_step": 3,
            "steps_growing": 3, "example_alloc_id": 7}
    with open(os.path.join(adir, "leaks.json"), "w") as f:
        json.dump({"device": "cpu", "sites": [site, "junk", {"python": 5, "bytes_per_step": "x"}],
                   "leaks": [{"size": 4096, "op": "aten.mm.default", "step": 2}],
                   "retained": [{"size": 4 << 20, "op": "aten.empty.memory_format", "step": 1,
                                 "python": "/w/train.py:12(main)"}],
                   "retained_sites": [{"device": "cpu", "pool": "PTA", "op": "aten.zeros_like.default",
                                       "python": "/w/adamw.py:88(_init_group)", "count": 8, "bytes": 1 << 20}, 3]}, f)
    with open(os.path.join(adir, "oom.json"), "w") as f:
        json.dump({"events": [{"trigger": {"op": "aten.mm.default", "size": 1 << 30, "step": 2, "used": 3 << 30,
                                           "live_blocks": 12},
                               "top": [{"size": 1 << 29, "op": "aten.empty", "python": "/w/m.py:3(f)"}]}]}, f)
    with open(os.path.join(adir, "fragmentation.json"), "w") as f:
        json.dump({"analysis": "fragmentation", "steps": [
            {"step": 1, "device": "0", "reserved": 8 << 20, "allocated": 6 << 20, "unallocated": 2 << 20,
             "segments": 2, "segments_with_free": 1, "largest_free": 2 << 20, "pinned_segments": 0},
            {"step": 2, "device": "0", "reserved": 64 << 20, "allocated": 24 << 20, "unallocated": 40 << 20,
             "segments": 3, "segments_with_free": 3, "largest_free": 20 << 20, "pinned_segments": 1,
             "pinned_bytes": 18 << 20}, "junk"]}, f)
    os.makedirs(os.path.join(folder_copy, "compare"))
    with open(os.path.join(folder_copy, "compare", "memory_compare_1.csv"), "w") as f:
        f.write(",,,Base,Compare\nEvent,Name,Device Id,Allocated Memory(byte),Allocated Memory(byte),Diff Memory(byte)\n"
                "OP_LAUNCH,aten.mm.default,0,100,300,200\nOP_LAUNCH,aten.add.Tensor,0,50,40,-10\n")
    from msmemscope.report.html import build
    data = build(folder_copy)
    by = {}
    for fnd in data["findings"]:
        by.setdefault(fnd["kind"], []).append(fnd)
    site_s = by["leak"][0]
    assert site_s["text"] == ("Leak: at train.py:45 (hook) in aten.clone.default grows by 32.00 KB per step over "
                              "steps 1\u20133 (3 steps growing); 256.00 KB live now on cpu PTA."), site_s["text"]
    assert site_s["raw"] == site and site_s["focus_step"] == 3 and site_s["window"][1] > site_s["window"][0]
    assert any("1 block(s) of the growing sites above, 4.00 KB" in f["text"] for f in by["leak"])
    assert by["retained"][0]["text"].startswith("Retained, not growing: 4.00 MB allocated at train.py:12 (main)")
    assert by["retained"][1]["text"] == ("Retained, not growing: adamw.py:88 (_init_group) (aten.zeros_like.default) "
                                         "keeps 8 block(s), 1.00 MB, that outlived their step without growing "
                                         "(allocated once: not a leak).")
    assert by["oom"][0]["text"] == ("Out of memory in aten.mm.default in step 2: asked for 1.00 GB with 3.00 GB in use "
                                    "in 12 live blocks; largest holders: 512.00 MB at m.py:3 (f) in aten.empty.")
    assert by["fragmentation"][0]["text"] == (
        "Fragmentation on device 0 at the end of step 2: 40.00 MB reserved but unallocated in 3 segment(s); "
        "largest free block 20.00 MB (reserved 64.00 MB); 1 mostly empty segment(s) pinned by live blocks, "
        "18.00 MB that empty_cache() cannot return."), by["fragmentation"]
    assert by["fragmentation"][0]["focus_step"] == 2
    comp = data["compare_tables"][0]
    assert comp["rows"][0][1] == "aten.mm.default" and "Compare Allocated Memory(byte)" in comp["columns"]
    # malformed: a list, then not JSON
    for text in ("[1, 2]", "{not json", json.dumps({"sites": {"a": 1}, "leaks": "x"})):
        with open(os.path.join(adir, "leaks.json"), "w") as f:
            f.write(text)
        found = build(folder_copy)["findings"]
        assert found[0]["kind"] == "peak"
        assert not any(f["kind"] == "leak" for f in found)


def test_report_stacks_by_owner(run, tmp_path):
    """Owners written into a real dump (the original's owner chains): the layers are categories
    and add up to the allocated bytes."""
    folder, dump, df = run
    lines = open(dump, encoding="utf-8").read().splitlines(keepends=True)
    out = [lines[0]]
    for ln in lines[1:]:
        if ",MALLOC," in ln:
            owner = ("PTA@activation" if "mm.default" in ln else
                     "PTA@weight@fsdp2@sharded" if "empty" in ln else "PTA@ops@mylabel")
            ln = re.sub(r'(""total"":\d+)', r'\1,""owner"":""%s""' % owner, ln.replace(',""owner"":""""', ""))
        out.append(ln)
    p = tmp_path / "memscope_dump_owned.csv"
    p.write_text("".join(out))
    from msmemscope.report.html import build
    (s,) = build(str(p))["series"]
    assert s["by"] == "owner"
    assert set(s["layers"]) == {"fsdp2 sharded", "activations", "label: mylabel"}, s["layers"]
    check_series(s, mem_rows(read(str(p))))


def test_report_stays_small_for_millions_of_events():
    """The page holds a bounded number of points whatever the dump's length (the 10M-event
    figures are bench/report_bench.py's, in BENCHMARKS.md)."""
    from msmemscope.report import views
    from msmemscope.report.html import build_frame, render
    n = full(600_000, 4_000_000)
    size = pl.int_range(0, n, eager=True) % 97 * 64 + 64
    ev = pl.Series(["MALLOC", "FREE"]).gather(pl.int_range(0, n, eager=True) % 2)
    signed = pl.when(ev == "MALLOC").then(size).otherwise(-size.shift(1, fill_value=0))
    df = pl.DataFrame({"id": pl.int_range(1, n + 1, eager=True), "event": ev, "event_type": "PTA",
                       "name": "torch._ops.aten.add.Tensor", "ts": pl.int_range(0, n, eager=True) * 1000,
                       "pid": 1, "tid": 1, "device": "0", "ptr": "N/A", "attr": "", "py_stack": None,
                       "c_stack": None, "alloc_id": pl.int_range(0, n, eager=True) // 2,
                       "addr": pl.int_range(0, n, eager=True) // 2 * 4096, "size": size,
                       "owner": None, "step": pl.int_range(0, n, eager=True) // 200_000 + 1})
    df = df.with_columns(size=pl.when(pl.col("event") == "FREE").then(pl.col("size").shift(1)).otherwise(pl.col("size")))
    df = df.with_columns(used=pl.when(pl.col("event") == "MALLOC").then(pl.col("size")).otherwise(-pl.col("size")).cum_sum(),
                         total=pl.lit(1 << 30))
    del signed
    data = build_frame(df, ["synthetic.csv"], None)
    (s,) = data["series"]
    assert sum(len(lv["hi"]) for lv in s["levels"]) <= views.POINT_BUDGET
    assert sum(sum(lv["n"]) == n for lv in s["levels"]) == len(s["levels"]) >= 2
    assert len(s["live"]["t"]) <= views.LIVE_SAMPLES + views.MAX_STEP_SAMPLES + 2
    html = render(data)
    assert len(html.encode()) < 5_000_000
    assert "aten.add.Tensor" in html


# ------------------------------------------------------------------ HTML report: in Chromium
def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


class DevTools:
    """A minimal Chrome DevTools Protocol client over --remote-debugging-pipe (fds 3 and 4)."""

    def __init__(self, exe, profile):
        self._to_r, self._to_w = os.pipe()
        self._from_r, self._from_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1200,900", "about:blank"]
        cmd = " ".join(["exec", *map(_sh, [exe, *flags]), f"3<&{self._to_r}", f"4>&{self._from_w}"])
        self.proc = subprocess.Popen(["bash", "-c", cmd], pass_fds=(self._to_r, self._from_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(self._to_r)
        os.close(self._from_w)
        self.events, self.replies, self._id = [], {}, 0
        self._cv = threading.Condition()
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self):
        buf = b""
        while True:
            chunk = os.read(self._from_r, 1 << 16)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                m = json.loads(msg)
                with self._cv:
                    if "id" in m:
                        self.replies[m["id"]] = m
                    else:
                        self.events.append(m)
                    self._cv.notify_all()
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def send(self, method, params=None, session=None, wait=60):
        self._id += 1
        i = self._id
        msg = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        with self._cv:
            assert self._cv.wait_for(lambda: i in self.replies or getattr(self, "closed", False), wait), method
        rep = self.replies.pop(i)
        assert "error" not in rep, (method, rep["error"])
        return rep["result"]

    def wait_event(self, method, wait=60):
        with self._cv:
            ok = self._cv.wait_for(lambda: any(e["method"] == method for e in self.events), wait)
        assert ok, f"no {method}"

    def close(self):
        try:
            self.send("Browser.close", wait=10)
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_w)


def _sh(s):
    return "'" + s.replace("'", "'\\''") + "'"


def decode_png(data):
    """RGB(A) rows of an 8-bit PNG (what Chromium writes), as bytes per row."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert depth == 8 and ctype in (2, 6)
    bpp = 3 if ctype == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


@pytest.fixture(scope="module")
def chromium():
    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium not found (make browser installs it: apt-get install -y chromium)")
    return exe


class Page:
    """One tab of the shared browser on a report file."""

    def __init__(self, dt, path, hash_=""):
        self.dt = dt
        self.target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.sid = dt.send("Target.attachToTarget", {"targetId": self.target, "flatten": True})["sessionId"]
        self.first_event = len(dt.events)
        for m in ("Runtime.enable", "Log.enable", "Page.enable", "Network.enable"):
            dt.send(m, session=self.sid)
        dt.send("Emulation.setDeviceMetricsOverride",
                {"width": 1300, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session=self.sid)
        dt.send("Page.navigate", {"url": "file://" + path + hash_}, session=self.sid)
        self.wait(lambda: self.js("document.readyState") == "complete"
                  and self.js("!!(document.body && document.body.getAttribute('data-ready') === '1')"))

    def wait(self, cond, tries=400):
        import time
        for _ in range(tries):
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError("the page did not get ready: " + json.dumps(self.errors())[:2000])

    def js(self, expr):
        r = self.dt.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=self.sid)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def mouse(self, kind, x, y, **kw):
        self.dt.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, **kw}, session=self.sid)

    def click(self, x, y):
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y, button="left", clickCount=1)
        self.mouse("mouseReleased", x, y, button="left", clickCount=1)

    def shot(self, selector, save=None):
        """Pixels of one element (scrolled into view)."""
        rect = self.js("(function(){var e=document.querySelector(%s); e.scrollIntoView(); var r=e.getBoundingClientRect();"
                       "return {x:r.left+window.scrollX, y:r.top+window.scrollY, w:r.width, h:r.height};})()" % json.dumps(selector))
        clip = {"x": rect["x"], "y": rect["y"], "width": rect["w"], "height": rect["h"], "scale": 1}
        png = base64.b64decode(self.dt.send("Page.captureScreenshot", {"format": "png", "clip": clip,
                                                                       "captureBeyondViewport": True},
                                            session=self.sid)["data"])
        if save:
            with open(save, "wb") as f:
                f.write(png)
        return decode_png(png)

    def pixels(self, selector, colours=()):
        """What the chart's canvas holds, counted in the page (pure-Python PNG decoding is slow):
        the inked fraction (any pixel darker than near-white) and the pixels near each colour."""
        return self.js("""(function(){
          var c = document.querySelector(%s + ' canvas'), g = c.getContext('2d');
          var d = g.getImageData(0, 0, c.width, c.height).data, cols = %s, n = [], ink = 0;
          for (var k = 0; k < cols.length; k++) { n.push(0); }
          for (var i = 0; i < d.length; i += 4) {
            var a = d[i + 3] / 255, r = d[i] * a + 255 * (1 - a), gg = d[i + 1] * a + 255 * (1 - a), b = d[i + 2] * a + 255 * (1 - a);
            if (Math.min(r, gg, b) < 235) { ink++; }
            for (k = 0; k < cols.length; k++) {
              if (Math.abs(r - cols[k][0]) <= 12 && Math.abs(gg - cols[k][1]) <= 12 && Math.abs(b - cols[k][2]) <= 12) { n[k]++; }
            }
          }
          return {ink: ink / (d.length / 4), counts: n};
        })()""" % (json.dumps(selector), json.dumps([list(c) for c in colours])))

    def errors(self):
        evs = self.dt.events[self.first_event:]
        return [e for e in evs if e.get("sessionId", self.sid) == self.sid and (
            e["method"] == "Runtime.exceptionThrown"
            or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert", "warning"))
            or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning")
                # what the test's own pixel reads (getImageData) make Chromium say
                and not e["params"]["entry"]["text"].startswith("Canvas2D: Multiple readback")))]

    def requests(self):
        return [e["params"]["request"]["url"] for e in self.dt.events[self.first_event:]
                if e["method"] == "Network.requestWillBeSent" and e.get("sessionId") == self.sid]

    def close(self):
        errors, requests = self.errors(), self.requests()
        self.dt.send("Target.closeTarget", {"targetId": self.target})
        assert not errors, [e["params"].get("exceptionDetails", {}).get("exception", {}).get("description")
                            or json.dumps(e)[:1500] for e in errors]
        assert all(u.startswith(("file:", "data:", "about:", "blob:")) for u in requests), requests


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory):
    dt = DevTools(chromium, str(tmp_path_factory.mktemp("chromium-profile")))
    yield dt
    dt.close()


WEIGHTS, GRADIENTS, OPT_STATE = (0x4e, 0x79, 0xa7), (0xf2, 0x8e, 0x2b), (0x59, 0xa1, 0x4f)


def report_of(path, tmp_path, name="report.html"):
    page = str(tmp_path / name)
    cli_ok(["report", path, "-o", page])
    return page


def test_chromium_owned_run_stacked_live_click_findings(owned, tmp_path, browser):
    folder, dump, df = owned
    page = Page(browser, report_of(folder, tmp_path))
    try:
        for view in ("timeline", "live", "findings", "compare"):
            assert page.js("!!document.getElementById(%r)" % view), view
        # stacked series: one area per layer (drawn top layer first) plus the bucket-min line
        names = page.js("msmemscope.timelines[0].chart.getOption().series.map(function(s){return s.name;})")
        layers = page.js("msmemscope.data.series[0].layers")
        assert names[:len(layers)] == layers[::-1] and "bucket min" in names
        px = page.pixels("#timeline .timeline-chart", [WEIGHTS, GRADIENTS, OPT_STATE])
        w, c, o = px["counts"]
        # each layer is drawn in its colour; the gradients' and the optimizer state's areas are
        # as wide as the time they live, which the machine's load changes (132 px seen under a full suite)
        assert w > 500 and c > 50 and o > 50, px
        # the live view opens at the peak: its flame graph is drawn, its total is the peak
        m = page.js("msmemscope.moment")
        peak = page.js("msmemscope.data.series[0].peak")
        assert m["index"] == page.js("msmemscope.data.series[0].live.peak") and m["total"] == peak
        assert m["nodes"] > 10
        px = page.pixels("#live-flame", [WEIGHTS, GRADIENTS, OPT_STATE])
        w, c, o = px["counts"]
        assert px["ink"] > 0.15 and w > 100 and o > 100, px
        assert "at the peak" in page.js("document.getElementById('live-title').textContent")
        table = page.js("document.getElementById('live-table').textContent")
        assert LEAK_LINE in table and "optimizer state" in table, table
        # click an early moment on the timeline (in step 2): the live view follows
        page.js("msmemscope.zoomTo(0, 0, 1e15)")
        live = page.js("msmemscope.data.series[0].live")
        target = next(j for j in range(len(live["t"])) if live["step"][j] == 2 and live["used"][j] != peak)
        pos = page.js("(function(){var tl=msmemscope.timelines[0]; document.getElementById('timeline').scrollIntoView();"
                      "var p=tl.chart.convertToPixel({gridIndex:0},[%f, 0]); var r=tl.chart.getDom().getBoundingClientRect();"
                      "return {x:r.left+p[0], y:r.top+p[1]-20};})()" % (live["t"][target] / 1000))
        page.click(pos["x"], pos["y"])
        m2 = page.js("msmemscope.moment")
        assert m2["index"] != m["index"], (m, m2)
        assert abs(live["t"][m2["index"]] - live["t"][target]) < abs(live["t"][target] - live["t"][m["index"]])
        assert m2["total"] == live["used"][m2["index"]]
        assert "selected moment" in page.js("document.getElementById('live-title').textContent")
        # the leak sentence names the planted line; its link zooms the timeline onto it
        leak = page.js("Array.prototype.map.call(document.querySelectorAll('#findings li[data-kind=leak] .text'),"
                       "function(e){return e.textContent;})")
        assert leak and LEAK_LINE in leak[0], leak
        span0 = page.js("msmemscope.timelines[0].view[1] - msmemscope.timelines[0].view[0]")
        page.js("document.querySelector('#findings li[data-kind=leak] a.go').click()")
        span1 = page.js("msmemscope.timelines[0].view[1] - msmemscope.timelines[0].view[0]")
        assert span1 < span0
        assert "report_train.py" in page.js("document.querySelector('#findings li[data-kind=leak] details pre').textContent")
        # zooming in picks a finer level, still drawn from a bounded number of points
        t_peak = live["t"][live["peak"]]
        page.js("msmemscope.zoomTo(0, %d, %d)" % (t_peak - 2000, t_peak + 2000))
        assert page.js("msmemscope.timelines[0].level") > 0
        assert page.js("msmemscope.timelines[0].shown") <= 2502
        # what grew: opens on the step pair that grew most; the planted line is in its table
        assert LEAK_LINE in page.js("document.getElementById('grew-table').textContent")
        assert page.pixels("#grew-flame")["ink"] > 0.1
        # compare: per op, differences first
        rows = page.js("Array.prototype.map.call(document.querySelectorAll('#compare-table tbody tr'),"
                       "function(r){return r.textContent;})")
        assert rows and page.pixels("#compare-chart")["ink"] > 0.03
    finally:
        page.close()


def test_report_live_view_groups_by_module(owned, run):
    """The owned run traces with decompose, so its MALLOC rows carry their module: the live view's
    leaves say which, and at the peak the bytes per module are those of the dump's live blocks."""
    from msmemscope.io.reader import read_dump
    from msmemscope.report.html import build
    folder, dump, df = owned
    data = build(folder)
    (s,) = data["series"]
    live = s["live"]
    assert live["has_modules"]
    got = {}
    for lf, v in zip(live["leaves"], leaf_values(live, live["peak"])):
        got[lf["module"]] = got.get(lf["module"], 0) + v
    got = {k: v for k, v in got.items() if v}
    # independent: the blocks live at the peak row, by the module their MALLOC row names
    cols = read_dump(dump, columns=("event", "alloc_id", "size", "used", "module"), events=("MALLOC", "FREE"))
    peak_i = int(cols["used"].arg_max())
    live_blocks = {}
    for ev, aid, size, mod in cols.head(peak_i + 1).select("event", "alloc_id", "size", "module").iter_rows():
        if ev == "MALLOC":
            live_blocks[aid] = (mod, size)
        else:
            live_blocks.pop(aid, None)
    want = {}
    for mod, size in live_blocks.values():
        want[mod] = want.get(mod, 0) + size
    assert sum(got.values()) == sum(want.values()) == s["peak"]
    assert {"Sequential.0", "Sequential.2"} <= set(want)
    for mod in want:  # leaves folded into '(small blocks)' carry no module: compare the large ones
        if want[mod] > 0.05 * s["peak"]:
            assert got.get(mod) == want[mod], (mod, got, want)
    # a run without module attribution (no decompose): nothing to group by
    assert not build(run[1])["series"][0]["live"]["has_modules"]


def test_chromium_live_view_grouped_by_module(owned, tmp_path, browser):
    folder, dump, df = owned
    page = Page(browser, report_of(folder, tmp_path))
    try:
        assert page.js("!!document.getElementById('live-group')")
        m = page.js("msmemscope.moment")
        names0 = page.js("msmemscope.live.tree.nodes.map(function(n){return n.name;})")
        assert "Sequential" not in names0
        page.js("var g=document.getElementById('live-group'); g.value='module'; g.dispatchEvent(new Event('change'))")
        m2 = page.js("msmemscope.moment")
        assert m2["index"] == m["index"] and m2["total"] == m["total"]  # the same moment, grouped otherwise
        nodes = page.js("msmemscope.live.tree.nodes.map(function(n){return [n.name, n.full, n.bytes, n.value[0]];})")
        by_full = {full: (name, b, depth) for name, full, b, depth in nodes}
        assert by_full["Sequential"][2] == 1 and by_full["Sequential.0"][0] == "0" and by_full["Sequential.0"][2] == 2
        assert by_full["Sequential"][1] >= by_full["Sequential.0"][1] + by_full["Sequential.2"][1]
        px = page.pixels("#live-flame", [WEIGHTS, GRADIENTS, OPT_STATE])
        assert px["ink"] > 0.15, px
        page.js("var g=document.getElementById('live-group'); g.value='stack'; g.dispatchEvent(new Event('change'))")
        assert page.js("msmemscope.live.tree.nodes.map(function(n){return n.name;})") == names0
    finally:
        page.close()


def test_chromium_run_without_owners_or_stacks_and_hostile_names(run, tmp_path, browser):
    folder, dump, df = run
    path = report_of(dump, tmp_path)
    text = open(path, encoding="utf-8").read()
    assert "window.pwned=1</script>" not in text and "\u2028" not in text
    page = Page(browser, path, "#live")
    try:
        assert page.js("window.pwned === undefined")
        # the hostile mark name arrives intact, as data
        assert page.js("msmemscope.data.marks[msmemscope.data.marks.length-1].name") == HOSTILE
        assert page.js("document.title").startswith("msmemscope report")
        layers = page.js("msmemscope.data.series[0].layers")
        assert any(x.startswith("aten.") for x in layers)
        assert page.pixels("#timeline .timeline-chart")["ink"] > 0.1
        assert page.pixels("#live-flame")["ink"] > 0.1
        table = page.js("document.getElementById('live-table').textContent")
        assert "(no Python line)" in table and "aten." in table
        # hovering the bucket of the peak: the tooltip names its time, bytes and op
        tip = page.js("(function(){var tl=msmemscope.timelines[0], lv=tl.s.levels[tl.level], i=lv.HI.indexOf(tl.s.peak);"
                      "tl.chart.dispatchAction({type:'showTip', seriesIndex:0, dataIndex:i - tl.slice.i0});"
                      "return {text: tl.chart.getDom().textContent, op: tl.s.ops[lv.op[i]]};})()")
        assert "allocated" in tip["text"] and ("op at the bucket peak: " + tip["op"]) in tip["text"], tip
        assert page.js("msmemscope.moment.total") == page.js("msmemscope.data.series[0].peak")
    finally:
        page.close()


def test_chromium_peer_dump(tmp_path, browser):
    page = Page(browser, report_of(os.path.join(PEER, "leaks.csv"), tmp_path))
    try:
        pools = page.js("msmemscope.data.series.map(function(s){return s.pool;})")
        assert sorted(pools) == ["HAL", "PTA"]
        assert page.js("msmemscope.data.series[msmemscope.data.main].pool") == "PTA"
        for i in range(2):
            assert page.pixels(".timeline-chart[data-series='%d']" % i)["ink"] > 0.05
        assert page.pixels("#live-flame")["ink"] > 0.1
        kinds = page.js("Array.prototype.map.call(document.querySelectorAll('#findings li'), function(e){return e.dataset.kind;})")
        assert "peak" in kinds and "fragmentation" in kinds
    finally:
        page.close()


def test_chromium_rank_root(ranks, tmp_path, browser):
    root, folders = ranks
    r = cli_ok(["report", root])
    path = written(r, "report")
    assert path == os.path.join(root, "msmemscope_report.html")
    page = Page(browser, path, "#ranks")
    try:
        rows = page.js("Array.prototype.map.call(document.querySelectorAll('#ranks-table tbody tr'),"
                       "function(r){return {text:r.textContent, outlier:r.className};})")
        assert len(rows) == 2 and rows[0]["text"].startswith("rank 0") and rows[1]["text"].startswith("rank 1")
        assert rows[1]["outlier"] == "outlier"
        assert "Outlier: rank 1" in page.js("document.getElementById('outlier').textContent")
        assert LEAK_LINE in rows[1]["text"]
        peaks = [read(dump_of(f))["used"].max() for f in folders]
        assert page.js("msmemscope.data.ranks.map(function(r){return r.peak;})") == peaks
        assert page.pixels("#ranks-chart")["ink"] > 0.03 and page.pixels("#ranks-timeline")["ink"] > 0.03
        # x in steps: every rank's points run from 0 to (its steps + 1), the step ends land on integers
        prog = page.js("msmemscope.data.ranks.map(function(r){return [r.progress[0], r.progress[r.progress.length-1]];})")
        assert all(0 <= a <= b <= r_steps + 1 for (a, b), r_steps in zip(prog, (2, 5))), prog
        assert page.js("document.getElementById('ranks-axis').value") == "step"
        page.js("var s=document.getElementById('ranks-axis'); s.value='time'; s.dispatchEvent(new Event('change'))")
        assert page.pixels("#ranks-timeline")["ink"] > 0.03
        links = page.js("Array.prototype.map.call(document.querySelectorAll('a.rank-link'), function(a){return a.href;})")
        assert [u[len("file://"):] for u in links] == [os.path.join(f, "msmemscope_report.html") for f in folders]
    finally:
        page.close()
    rank_page = Page(browser, links[1][len("file://"):], "#findings")
    try:
        assert LEAK_LINE in rank_page.js("document.getElementById('findings').textContent")
    finally:
        rank_page.close()


# ------------------------------------------------------------------ memory snapshot
def _replay(trace):
    live, peak = 0, 0
    for e in trace:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        peak = max(peak, live)
    return live, peak


@pytest.mark.parametrize("which", ["run", "owned"])
def test_memory_snapshot_read_by_torch_memory_viz(which, request, tmp_path):
    """torch's own memory_viz code on our export: segsum, trace, compare and its HTML plots."""
    from torch.cuda import _memory_viz as mv
    folder, dump, df = request.getfixturevalue(which)
    from msmemscope.report.export import _cut, memory_snapshot
    snaps = {}
    o = tmp_path / "snap.pickle"
    cli_ok(["export", "--format=memory-snapshot", dump, "-o", str(o), "--step=1"])  # the command, once
    with open(o, "rb") as f:
        snaps[1] = pickle.load(f)
    assert snaps[1] == memory_snapshot(_cut(read(dump), 1))
    for step in (2, None):  # the same function in process: no interpreter start per cut
        snaps[step] = pickle.loads(pickle.dumps(memory_snapshot(_cut(read(dump), step)), protocol=4))
    mem = mem_rows(df)
    for step, snap in snaps.items():
        part = mem if step is None else mem.filter(pl.col("step") <= step)
        (trace,) = snap["device_traces"]
        live, peak = _replay(trace)
        assert live == part["used"][-1] and peak == part["used"].max()
        summary = mv.segsum(snap)
        assert f"total_allocated: {mv.Bytes(live)!r}\n" in summary, summary
        text = mv.trace(snap)
        assert text.startswith("Device 0") and f"{len(trace)} entries" in text
        n_m = part.filter(pl.col("event") == "MALLOC").height
        n_f = part.filter(pl.col("event") == "FREE").height
        assert len(trace) == n_m + 2 * n_f
        assert sum(s["allocated_size"] for s in snap["segments"]) == live
    assert sum(s["allocated_size"] for s in snaps[1]["segments"]) > 0
    assert any(f["name"].startswith("aten.") for e in snaps[None]["device_traces"][0] for f in e["frames"])
    if which == "owned":  # recorded with --call-stack=python
        files = {f["filename"] for e in snaps[None]["device_traces"][0] for f in e["frames"]}
        assert any(x.endswith("report_train.py") for x in files), files
    for plot in (mv.trace_plot, mv.segment_plot):
        page = plot(snaps[None])
        assert "<html" in page.lower() or "<!doctype" in page.lower() or len(page) > 1000
    # compare the memory left at the end of step 1 and step 2
    buf = io.StringIO()
    with redirect_stdout(buf):
        diff = mv.compare(snaps[1]["segments"], snaps[2]["segments"], format_flamegraph=lambda s: s)
    delta = 0
    for line in diff.splitlines():
        stack, _, n = line.rpartition(" ")
        if ";active_allocated;" in stack:
            delta += int(n) if stack.startswith("only_after") else -int(n)
    assert delta == mem.filter(pl.col("step") <= 2)["used"][-1] - mem.filter(pl.col("step") <= 1)["used"][-1]


def test_memory_snapshot_of_the_original_tools_dump(tmp_path):
    """HAL blocks become segments; the PTA blocks live at the end sit inside them."""
    from torch.cuda import _memory_viz as mv
    src = os.path.join(PEER, "leaks.csv")
    o = tmp_path / "peer.pickle"
    cli_ok(["export", "--format", "memory-snapshot", src, "-o", str(o)])
    with open(o, "rb") as f:
        snap = pickle.load(f)
    df = read(src)
    pta = df.filter(pl.col("event").is_in(["MALLOC", "FREE"]) & (pl.col("event_type") == "PTA"))
    live, peak = _replay(snap["device_traces"][0])
    assert live == pta["used"][-1] and peak == pta["used"].max()
    summary = mv.segsum(snap)
    assert f"total_allocated: {mv.Bytes(live)!r}\n" in summary
    assert any(e["action"] == "segment_alloc" for e in snap["device_traces"][0])
    mv.trace(snap)


# ------------------------------------------------------------------ perfetto
def test_perfetto_trace_matches_the_dump(run, tmp_path):
    folder, dump, df = run
    o = tmp_path / "trace.json"
    cli_ok(["export", "--format=perfetto", folder, "-o", str(o)])
    with open(o) as f:
        doc = json.load(f)
    evs = doc["traceEvents"]
    need = {"X": ("name", "ts", "dur", "pid", "tid"), "C": ("name", "ts", "pid", "args"),
            "i": ("name", "ts", "pid", "tid"), "M": ("name", "pid", "args")}
    for e in evs:
        assert e["ph"] in need, e
        for k in need[e["ph"]]:
            assert k in e, (k, e)
        if e["ph"] in ("X", "C", "i"):
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
        if e["ph"] == "i":
            assert e.get("s", "t") in ("g", "p", "t")
    mem = mem_rows(df)
    counters = [e for e in evs if e["ph"] == "C" and e["cat"] == "memory"]
    assert [e["args"]["allocated"] for e in counters] == mem["used"].to_list()
    assert [e["args"]["reserved"] for e in counters] == mem["total"].to_list()
    # thread ids: small integers (Perfetto's importer takes a tid above 2**32 for a pid), one per thread
    tids = df["tid"].drop_nulls().unique().to_list()
    named = {e["tid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all(0 <= e.get("tid", 0) <= len(tids) for e in evs)
    assert sorted(v for k, v in named.items() if k) == sorted(f"thread {t}" for t in tids)
    # one counter per op (no owners in this run): its last value is what that op's blocks hold at the end
    by_op = [e for e in evs if e["ph"] == "C" and e["cat"] == "memory by op"]
    assert by_op and sum({e["name"]: e["args"]["bytes"] for e in by_op}.values()) == mem["used"][-1]
    ops = [e for e in evs if e["ph"] == "X" and e["cat"] == "op"]
    starts = df.filter(pl.col("event_type") == "ATEN_START")
    assert len(ops) == starts.height
    assert sorted(e["name"] for e in ops) == sorted(starts["name"].str.replace(r"^torch\._ops\.", "").to_list())
    steps = [e for e in evs if e["ph"] == "X" and e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == [1, 2, 3]
    marks = [e for e in evs if e["ph"] == "i"]
    assert len(marks) == df.filter(pl.col("event_type") == "Mark").height == 4  # 3 steps + the hostile name
    assert marks[-1]["name"] == HOSTILE
    ranges = [e for e in evs if e["ph"] == "X" and e["cat"] == "range"]
    assert [e["name"] for e in ranges] == ["training"]
    # nesting: every op slice lies inside the training range
    r = ranges[0]
    assert all(r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"] + 1e-3 for e in ops)


# ------------------------------------------------------------------ load()
@pytest.mark.parametrize("which", ["ours", "baseline.csv", "leaks.csv"])
def test_load_expands_attr(run, which):
    import pandas as pd
    import msmemscope
    path = run[1] if which == "ours" else os.path.join(PEER, which)
    df = msmemscope.load(path)
    assert isinstance(df, pd.DataFrame)
    for col in ("allocation_id", "addr", "size", "used", "total", "event", "name", "ts"):
        assert col in df.columns, col
    mallocs = df[df["event"] == "MALLOC"]
    assert len(mallocs) and mallocs["size"].notna().all()
    assert pd.api.types.is_numeric_dtype(df["allocation_id"]) and (mallocs["allocation_id"] >= 0).all()
    assert (mallocs["size"].astype("int64") > 0).all()
    if which == "ours":
        ranges = df[df["event"] == "MSTX"]
        assert "range_id" in df.columns and ranges[ranges["event_type"] != "Mark"]["range_id"].notna().all()
        assert "step" in df.columns and df["step"].max() == 4


# ------------------------------------------------------------------ bad input, console, progress
@pytest.mark.parametrize("args", [
    ["report", "/no/such/folder"],
    ["report", "{notdump}"],
    ["report", "{dump}", "-o", "/no/such/dir/r.html"],
    ["export", "--format=perfetto", "/no/such/dump.csv"],
    ["export", "--format=svg", "{dump}"],
    ["export", "--format=memory-snapshot", "{dump}", "-o", "/no/such/dir/s.pickle"],
    ["export", "--format=memory-snapshot", "{dump}", "--step=99"],
    ["export", "{dump}"],
])
def test_bad_input_is_one_line_exit_2(run, tmp_path, args):
    notdump = tmp_path / "notes.csv"
    notdump.write_text("hello,world\n1,2\n")
    args = [a.format(dump=run[1], notdump=notdump) for a in args]
    r = run_cli(args)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msmemscope: error: "), r.stderr
    assert "Traceback" not in r.stderr


def test_show_prints_rich_tables(run):
    r = cli_ok(["show", run[1]])
    assert "Peak allocated" in r.stdout
    assert "aten." in r.stdout and ("┃" in r.stdout or "|" in r.stdout or "─" in r.stdout)


def test_progress_bar_shows_only_when_asked(monkeypatch):
    from msmemscope.report.progress import progress
    buf = io.StringIO()
    monkeypatch.setenv("MSMEMSCOPE_PROGRESS", "1")
    with progress("demo", total=2, delay=0, stream=buf) as p:
        assert p.shown
        p.stage("first")
        p.stage("second")
    assert "demo" in buf.getvalue()
    monkeypatch.delenv("MSMEMSCOPE_PROGRESS")
    buf2 = io.StringIO()  # not a terminal: nothing drawn
    with progress("demo", total=2, delay=0, stream=buf2) as p:
        p.stage("first")
        assert not p.shown
    assert buf2.getvalue() == ""


def test_perfetto_counters_per_owner_category(owned, tmp_path):
    folder, dump, df = owned
    o = tmp_path / "trace.json"
    cli_ok(["export", "--format=perfetto", dump, "-o", str(o)])
    evs = json.load(open(o))["traceEvents"]
    cats = [e for e in evs if e["ph"] == "C" and e["cat"] == "memory by owner"]
    last = {}
    for e in cats:
        last[e["name"]] = e["args"]["bytes"]
    names = {n.split(" device ")[0] for n in last}
    assert {"owner weights", "owner gradients", "owner optimizer state"} <= names, names
    mem = mem_rows(df)
    assert sum(last.values()) == mem["used"][-1]
    # at every sample, the categories add up to the pool's allocated bytes at that row
    running, alloc = {}, [e["args"]["allocated"] for e in evs if e["ph"] == "C" and e["cat"] == "memory"]
    sums = []
    for e in cats:
        running[e["name"]] = e["args"]["bytes"]
        sums.append(sum(running.values()))
    assert sums == alloc
    assert all(e["tid"] <= 8 for e in evs if "tid" in e)


def page_data(path):
    """The data a report page embeds (its JSON element), as the page's script reads it."""
    text = open(path, encoding="utf-8").read()
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S)
    return json.loads(m.group(1))


def test_rank_root_with_an_unreadable_rank(ranks, tmp_path):
    """One rank's dump broken: the root page still lists both, the broken one with its error."""
    root, folders = ranks
    copy = tmp_path / "job"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("*.html"))
    broken = dump_of(os.path.join(copy, os.path.basename(folders[0])))
    with open(broken, "w") as f:
        f.write("hello,world\n1,2\n")
    r = cli_ok(["report", str(copy)])
    data = page_data(written(r, "report"))
    assert [x["label"] for x in data["ranks"]] == ["rank 0", "rank 1"]
    assert data["ranks"][0]["href"] is None and "error" in data["ranks"][0]
    assert data["ranks"][1]["peak"] == read(dump_of(folders[1]))["used"].max()
    assert data["outlier"] is None  # one readable rank: no median to stand out from
