"""Analyses. Each consumes the event stream: online as row batches from the
session, offline as the columns a reader returns."""
from __future__ import annotations

import importlib
import json
import logging
import os
import time

log = logging.getLogger("msmemscope")

# analysis name -> module providing ``make_sink(session)`` for the online run
ONLINE = {
    "leaks": "msmemscope.analysis.leaks",
    "oom": "msmemscope.analysis.oom",
    "decompose": "msmemscope.analysis.decompose",
    "inefficient": "msmemscope.analysis.inefficient",
}


def online_sinks(session) -> list:
    sinks = []
    for name in session.opts.analysis:
        mod_name = ONLINE.get(name)
        if mod_name is None:
            continue
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError:
            log.warning("analysis '%s' is not available in this build", name)
            continue
        sinks.append(mod.make_sink(session))
    if sinks:
        sinks.append(StepCheckpoint(list(sinks)))
    return sinks


# ------------------------------------------------------------------ results on disk as they are found
# A sink may define ``findings(session) -> (name, result) | None``: its current result, in the format
# its ``close`` writes to ``analysis/<name>.json``. ``StepCheckpoint`` (the last sink) saves those at
# each step end, so that a process ended without its exit handlers (Ray's workers, SIGKILL, the OOM
# killer) still leaves what its analyses had found; ``close`` then replaces them with the final ones.
_OWNED: dict = {}   # (folder, name) -> the result file this process wrote (replaced, never another's)
SAVE_BUDGET = 0.02  # results that are costly to save: at most this share of the run's time
SAVE_CHEAP_S = 0.002  # a save that costs less CPU time than this is made at every step end


def save_result(folder: str, name: str, result, indent=2) -> str:
    """Write ``<folder>/analysis/<name>.json``. A file this process wrote before (a step end's
    findings) is replaced atomically (temp file + rename); any other is kept and a free name
    (``<name>_1.json``) chosen. Returns the path."""
    return _write_text(folder, name, json.dumps(result, indent=indent, default=str))


def _write_text(folder: str, name: str, text: str) -> str:
    from ..io.files import create_new, make_dirs, unique_path
    key = (os.path.abspath(folder), name)
    path = _OWNED.get(key)
    if path is None:
        d = make_dirs(os.path.join(folder, "analysis"))
        path = unique_path(os.path.join(d, f"{name}.json"))
    tmp = f"{path}.{os.getpid()}.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)  # a stale or planted name: removed, never written through
    with create_new(tmp) as f:
        f.write(text)
    os.replace(tmp, path)
    _OWNED[key] = path
    return path


def peaks_result(session, final=False) -> dict:
    """What the cross-rank summary needs besides the analyses' results, from the session's own
    counters (no pass over the rows): peaks per device and pool, events, steps."""
    from ..capture import backends
    peaks = []
    for (dev, pool), peak in sorted(session.peak.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        reserved = None
        if str(dev) != "cpu":
            try:
                reserved = backends.memory_counters(session.kind, int(dev)).get("max_reserved")
            except Exception:
                reserved = None
        peaks.append({"device": str(dev), "pool": pool, "peak_allocated": int(peak),
                      "peak_reserved": int(reserved) if reserved is not None else int(peak)})
    return {"analysis": "peaks", "final": final, "events": int(session.next_id),
            "steps": int(session.step_no - 1), "peaks": peaks,
            "access_rows": bool(session.want_access), "owner_labels": session.labeler is not None}


class StepCheckpoint:
    """The last online sink: at each step end, the other sinks' findings and the peaks go to
    ``analysis/*.json`` when they changed, within ``SAVE_BUDGET`` of the run's time."""

    def __init__(self, sinks):
        from ..capture import backends  # noqa: F401  (imported now, not inside the first save)
        self.sinks = sinks
        self._saved: dict = {}   # name -> the text last written
        self._next_at = 0.0

    def consume(self, rows, first_id):
        pass

    def step_end(self, session, step):
        self.save(session)

    def save(self, session, force=False):
        if not force and time.monotonic() < self._next_at:
            return
        c0 = time.process_time()  # CPU time: a loaded machine's waits do not make saves rarer
        found = [("peaks", peaks_result(session))]
        for s in self.sinks:
            fn = getattr(s, "findings", None)
            if fn is None:
                continue
            try:
                got = fn(session)
            except Exception as e:  # an analysis must never break the traced program
                log.error("analysis %s: findings: %s", type(s).__name__, e)
                continue
            if got is not None:
                found.append(got)
        for name, result in found:
            text = json.dumps(result, indent=2, default=str)
            if self._saved.get(name) == text:
                continue
            try:
                _write_text(session.folder, name, text)
                self._saved[name] = text
            except OSError as e:
                log.error("analysis %s: cannot save findings: %s", name, e)
        cost = time.process_time() - c0
        # small results (the usual case) are saved at every step end; large ones (thousands of
        # leaks) within the budget, so that saving never grows with the square of the run
        self._next_at = 0.0 if cost < SAVE_CHEAP_S else time.monotonic() + min(cost / SAVE_BUDGET, 30.0)

    def close(self, session):
        # the other sinks wrote their final results already (they come first)
        try:
            _write_text(session.folder, "peaks", json.dumps(peaks_result(session, final=True), indent=2))
        except OSError as e:
            log.error("analysis peaks: %s", e)


def checkpoint(session):
    """Save the current findings now (a Ray call returned), whatever the time budget says."""
    with session.flush_lock:  # as at a step end (inside flush): one save at a time
        for s in session.sinks:
            if isinstance(s, StepCheckpoint):
                s.save(session, force=True)
