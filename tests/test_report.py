"""Report, exports, load(): on a real traced training run (examples/mlp.py, with marks),
on the original tool's dumps, and in a real headless Chromium."""
from __future__ import annotations

import base64
import glob
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import threading
import zlib
from contextlib import redirect_stdout

import polars as pl
import pytest

from conftest import EXAMPLES, PEER, dump_of, read, run_cli, run_folders

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
""" % os.path.join(EXAMPLES, "mlp.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One traced training run shared by the tests: (run folder, dump path, frame)."""
    base = tmp_path_factory.mktemp("report")
    script = base / "train.py"
    script.write_text(SCRIPT)
    out = base / "out"
    r = run_cli(["--output", str(out), "--call-stack=python:4", str(script)])
    assert r.returncode == 0, r.stderr
    (folder,) = run_folders(out)
    dump = dump_of(folder)
    return folder, dump, read(dump)


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
    assert "http://" not in text and "https://" not in text, "the page must not reach the network"
    r2 = cli_ok(["report", folder_copy])
    p2 = written(r2, "report")
    assert p2 != p1 and os.path.exists(p1) and open(p1, encoding="utf-8").read() == text


def test_report_data_matches_the_dump(run):
    from msmemscope.report.html import build
    folder, dump, df = run
    data = build(dump, buckets=40)
    (s,) = data["series"]
    mem = mem_rows(df)
    assert s["peak"] == mem["used"].max() == max(s["hi"])
    assert len(s["t"]) <= 40 and sum(s["n"]) == mem.height
    assert s["last"][-1] == mem["used"][-1]
    assert s["total"] is None  # CPU: reserved == allocated, not drawn twice
    steps = df.filter(pl.col("event_type") == "STEP")
    assert [x["step"] for x in data["steps"]] == steps["step"].to_list() and len(data["steps"]) == 3
    assert [m["name"] for m in data["marks"] if m["kind"] == "Mark"] == ["optimizer step"] * 3
    # hover names: the op at each bucket's peak is an op of the dump
    ops = set(df.filter(pl.col("event") == "OP_LAUNCH")["name"].str.replace(r"^torch\._ops\.", "").to_list())
    assert all(s["ops"][i] in ops or s["ops"][i] == "" for i in s["op"])
    assert sum(s["ops"][i].startswith("aten.") for i in s["op"]) > len(s["op"]) // 2
    tables = {t["title"]: t for t in data["tables"]}
    per = tables["Per-step summary"]
    want = mem.group_by("step").agg(peak=pl.col("used").max(), allocs=(pl.col("event") == "MALLOC").sum(),
                                    frees=(pl.col("event") == "FREE").sum()).sort("step")
    assert [(r[0], r[3], r[4], r[5]) for r in per["rows"]] == [tuple(r) for r in want.iter_rows()]
    top = tables["Top ops by bytes allocated"]["rows"]
    mallocs = df.filter(pl.col("event") == "MALLOC")
    assert sum(r[1] for r in top) == mallocs["size"].sum()
    assert top[0][1] == max(r[1] for r in top)


def test_report_shows_analysis_results_and_compare(folder_copy):
    os.makedirs(os.path.join(folder_copy, "analysis"), exist_ok=True)  # leaks.json of the real run is replaced
    with open(os.path.join(folder_copy, "analysis", "leaks.json"), "w") as f:
        json.dump({"device": "cpu", "leaks": [{"addr": "0x10", "size": 4096, "op": "aten.mm.default", "step": 2}]}, f)
    with open(os.path.join(folder_copy, "analysis", "inefficient.json"), "w") as f:
        json.dump([{"allocation_id": 7, "inefficient_type": "early_allocation", "size": 512}], f)
    os.makedirs(os.path.join(folder_copy, "compare"))
    with open(os.path.join(folder_copy, "compare", "memory_compare_1.csv"), "w") as f:
        f.write(",,,Base,Compare\nEvent,Name,Device Id,Allocated Memory(byte),Allocated Memory(byte),Diff Memory(byte)\n"
                "OP_LAUNCH,aten.mm.default,0,100,300,200\nOP_LAUNCH,aten.add.Tensor,0,50,40,-10\n")
    from msmemscope.report.html import build
    data = build(folder_copy, buckets=20)
    titles = [t["title"] for t in data["tables"]]
    leaks = [t for t in data["tables"] if t["title"].startswith("Leaks")]
    assert any(r[:2] == ["0x10", 4096] for t in leaks for r in t["rows"]), leaks
    ineff = [t for t in data["tables"] if t["title"] == "Inefficient blocks"][0]
    assert ineff["rows"] == [[7, "early_allocation", 512]]
    comp = [t for t in data["tables"] if t["title"].startswith("Compare")][0]
    assert comp["rows"][0][1] == "aten.mm.default" and "Compare Allocated Memory(byte)" in comp["columns"], titles


def test_report_stacks_by_owner(run, tmp_path):
    """MALLOC rows with owners: the stacked view's layers add up to the allocated bytes."""
    folder, dump, df = run
    lines = open(dump, encoding="utf-8").read().splitlines(keepends=True)
    out = [lines[0]]
    for ln in lines[1:]:
        if ",MALLOC," in ln:
            owner = "PTA@activation" if "mm.default" in ln else ("PTA@weight" if "empty" in ln else "PTA@ops")
            ln = ln.replace('""owner"":""""', f'""owner"":""{owner}""')
        out.append(ln)
    p = tmp_path / "memscope_dump_owned.csv"
    p.write_text("".join(out))
    from msmemscope.report.html import build
    (s,) = build(str(p), buckets=60)["series"]
    assert s["owners"] is not None
    assert set(s["owners"]["names"]) == {"PTA@weight", "PTA@activation", "PTA@ops"}
    for i, hi in enumerate(s["hi"]):
        assert sum(v[i] for v in s["owners"]["values"]) == hi


def test_report_stays_small_for_millions_of_events():
    """The page holds a few thousand points per series whatever the dump's length."""
    from msmemscope.report.html import build_frame, render
    n = 2_000_000
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
    html = render(build_frame(df, ["synthetic.csv"], None))
    assert len(html.encode()) < 2_000_000
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


def test_report_renders_in_chromium_with_hover(run, tmp_path, chromium):
    folder, dump, df = run
    page = str(tmp_path / "report.html")
    cli_ok(["report", dump, "-o", page])
    dt = DevTools(chromium, str(tmp_path / "profile"))
    try:
        target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for m in ("Runtime.enable", "Log.enable", "Page.enable", "Network.enable"):
            dt.send(m, session=sid)
        dt.send("Emulation.setDeviceMetricsOverride",
                {"width": 1200, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session=sid)
        dt.send("Page.navigate", {"url": "file://" + page}, session=sid)
        dt.wait_event("Page.loadEventFired")

        def js(expr):
            r = dt.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=sid)
            assert "exceptionDetails" not in r, r
            return r["result"].get("value")

        assert js("document.body.getAttribute('data-ready')") == "1"
        # hover the bucket holding the run's peak: the tooltip names its op and block
        data = js("(function(){var s=msmemscope.data.series[0]; var i=s.hi.indexOf(Math.max.apply(null,s.hi));"
                  "return {i:i, op:s.ops[s.op[i]], blk:s.blk[i], p:msmemscope.pointOf(0,i)};})()")
        assert data["op"].startswith("aten."), data
        dt.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": data["p"]["x"], "y": data["p"]["y"]},
                session=sid)
        tip = js("(function(){var t=document.getElementById('tip'); return {hidden:t.hidden, text:t.textContent};})()")
        assert not tip["hidden"], tip
        assert "op: " + data["op"] in tip["text"] and data["blk"] in tip["text"], (tip, data)
        assert data["op"] in set(df["name"].str.replace(r"^torch\._ops\.", "").to_list())
        # wheel zoom narrows the view
        span0 = js("msmemscope.view.x1 - msmemscope.view.x0")
        dt.send("Input.dispatchMouseEvent", {"type": "mouseWheel", "x": data["p"]["x"], "y": data["p"]["y"],
                                             "deltaX": 0, "deltaY": -300}, session=sid)
        assert js("msmemscope.view.x1 - msmemscope.view.x0") < span0
        js("msmemscope.zoomTo(0, 1e18)")
        dt.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": 5, "y": 5}, session=sid)
        # screenshot of the chart area: drawn, not blank
        rect = js("msmemscope.chartRect(0)")
        clip = {"x": rect["left"], "y": rect["top"], "width": rect["right"] - rect["left"],
                "height": rect["bottom"] - rect["top"], "scale": 1}
        png = base64.b64decode(dt.send("Page.captureScreenshot", {"format": "png", "clip": clip}, session=sid)["data"])
        (tmp_path / "chart.png").write_bytes(png)
        w, h, bpp, rows = decode_png(png)
        inked = blue = 0
        for row in rows:
            for x in range(0, w * bpp, bpp):
                r_, g_, b_ = row[x], row[x + 1], row[x + 2]
                if min(r_, g_, b_) < 235:
                    inked += 1
                if b_ > r_ + 40:
                    blue += 1
        assert inked > 0.05 * w * h, (inked, w, h)
        assert blue > 0.02 * w * h, "the allocated-memory area is drawn"
        errors = [e for e in dt.events if e["method"] == "Runtime.exceptionThrown"
                  or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
                  or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
        assert not errors, errors
        requests = [e["params"]["request"]["url"] for e in dt.events if e["method"] == "Network.requestWillBeSent"]
        assert all(u.startswith(("file:", "data:", "about:")) for u in requests), requests
    finally:
        dt.close()


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


def test_memory_snapshot_read_by_torch_memory_viz(run, tmp_path):
    from torch.cuda import _memory_viz as mv
    folder, dump, df = run
    snaps = {}
    for step in (1, 2, None):
        o = tmp_path / f"snap_{step}.pickle"
        cli_ok(["export", "--format=memory-snapshot", dump, "-o", str(o)] + ([] if step is None else [f"--step={step}"]))
        with open(o, "rb") as f:
            snaps[step] = pickle.load(f)
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
    assert any(f["filename"].endswith("mlp.py") for e in snaps[None]["device_traces"][0] for f in e["frames"])
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
    counters = [e for e in evs if e["ph"] == "C"]
    assert [e["args"]["allocated"] for e in counters] == mem["used"].to_list()
    assert [e["args"]["reserved"] for e in counters] == mem["total"].to_list()
    ops = [e for e in evs if e["ph"] == "X" and e["cat"] == "op"]
    starts = df.filter(pl.col("event_type") == "ATEN_START")
    assert len(ops) == starts.height
    assert sorted(e["name"] for e in ops) == sorted(starts["name"].str.replace(r"^torch\._ops\.", "").to_list())
    steps = [e for e in evs if e["ph"] == "X" and e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == [1, 2, 3]
    marks = [e for e in evs if e["ph"] == "i"]
    assert len(marks) == df.filter(pl.col("event_type") == "Mark").height == 3
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
