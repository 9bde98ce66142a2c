"""The screenshots of docs/report.md: each view of a report, taken in headless Chromium.

    python bench/report_screens.py <owned run folder> <rank root> <out dir>

The owned run: e.g. ``msmemscope -o out --analysis=leaks,decompose,inefficient
--call-stack=python:8 tests/progs/report_train.py 6``; the rank root: a job's output root.
"""
from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_report import DevTools, Page, find_chromium  # noqa: E402


def shot(page, selector, path, click_peak=False):
    rect = page.js("(function(){var e=document.querySelector(%r); var r=e.getBoundingClientRect();"
                   "return {x:r.left+window.scrollX, y:r.top+window.scrollY, w:r.width, h:r.height};})()" % selector)
    clip = {"x": rect["x"], "y": rect["y"], "width": rect["w"], "height": min(rect["h"], 1400), "scale": 1}
    png = page.dt.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True},
                       session=page.sid)["data"]
    with open(path, "wb") as f:
        f.write(base64.b64decode(png))
    print(path)


def report(path, out):
    if os.path.exists(out):
        os.remove(out)
    subprocess.run([sys.executable, "-m", "msmemscope", "report", path, "-o", out], check=True,
                   env=dict(os.environ, PYTHONPATH=ROOT))
    return out


def main():
    owned, ranks, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="msmemscope-screens-")
    dt = DevTools(find_chromium(), os.path.join(tmp, "profile"))
    try:
        page = Page(dt, report(owned, os.path.join(tmp, "owned.html")))
        shot(page, "#findings", os.path.join(out, "report-findings.png"))
        shot(page, "#timeline", os.path.join(out, "report-timeline.png"))
        shot(page, "#live", os.path.join(out, "report-live.png"))
        shot(page, "#compare", os.path.join(out, "report-compare.png"))
        page.close()
        page = Page(dt, report(os.path.join(ROOT, "..", "shared", "peer-dumps", "leaks.csv")
                               if os.path.isdir(os.path.join(ROOT, "..", "shared", "peer-dumps"))
                               else os.path.join(ROOT, "tests", "data", "peer-dumps", "leaks.csv"),
                               os.path.join(tmp, "peer.html")))
        shot(page, "#timeline", os.path.join(out, "report-peer-timeline.png"))
        page.close()
        subprocess.run([sys.executable, "-m", "msmemscope", "report", ranks, "-o", os.path.join(tmp, "ranks.html")],
                       check=True, env=dict(os.environ, PYTHONPATH=ROOT))
        page = Page(dt, os.path.join(tmp, "ranks.html"))
        shot(page, "#app", os.path.join(out, "report-ranks.png"))
        page.close()
    finally:
        dt.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
