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
    if getattr(session, "device_source", None) is not None:  # segments are known: fragmentation comes free
        from . import fragmentation
        sinks.append(fragmentation.make_sink(session))
    if sinks:
        sinks.append(StepCheckpoint(list(sinks)))  # last: saves the others' findings at each step end
    return sinks


# ------------------------------------------------------------------ results on disk as they are found
# A sink may define ``findings(session, count_only=False) -> (name, result, count) | None``: its
# current result, in the format its ``close`` writes to ``analysis/<name>.json``, and how many
# findings it holds (with ``count_only`` the result may be None: only the count is needed). ``StepCheckpoint`` (the last sink) saves those at
# each step end, so that a process ended without its exit handlers (Ray's workers, SIGKILL, the OOM
# killer) still leaves what its analyses had found; ``close`` then replaces them with the final ones.
_OWNED: dict = {}   # (folder, name) -> the result file this process wrote (replaced, never another's)
SAVE_BUDGET = 0.001  # saves of results that only moved (peaks, step counts): this share of the CPU time
# (0.1%: on a small-op workload a save costs ~0.5 ms, so they come every ~0.5 s of CPU; at 1% they
# were 1-2% of the run, the largest per-step cost of the online analyses after the leak rule)
SAVE_NEW_BUDGET = 0.05  # saves of new findings: at once while all saves so far cost under this share


def save_result(folder: str, name: str, result, indent=2) -> str:
    """Write ``<folder>/analysis/<name>.json``. A file this process wrote before (a step end's
    findings) is replaced atomically (temp file + rename); any other is kept and a free name
    (``<name>_1.json``) chosen. Returns the path."""
    return _write_text(folder, name, json.dumps(result, indent=indent, default=str))


def _write_text(folder: str, name: str, text: str) -> str:
    from ..io.files import make_dirs, unique_path, write_new
    key = (os.path.abspath(folder), name)
    path = _OWNED.get(key)
    if path is None:
        d = make_dirs(os.path.join(folder, "analysis"))
        path = unique_path(os.path.join(d, f"{name}.json"))
    tmp = f"{path}.{os.getpid()}.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)  # a stale or planted name: removed, never written through
    with write_new(tmp) as f:
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

    batch_steps = True  # saves what is: once for the step boundaries that share a flush

    def __init__(self, sinks):
        from ..capture import backends  # noqa: F401  (imported now, not inside the first save)
        self.sinks = sinks
        self._saved: dict = {}   # name -> the text last written
        self._counts: dict = {}  # name -> number of findings last written
        self._next_at = 0.0
        self._cost = 0.0
        self._spent = 0.0  # CPU time of every save so far

    takes_packed = True  # reads no row

    def consume(self, rows, first_id):
        pass

    def consume_packed(self, packed, first_id):
        pass

    def step_end(self, session, step):
        self.save(session)

    def save(self, session, force=False):
        """Save what changed. New findings (a sink's count of them moved) are saved at once; results
        that only moved (peaks, steps ended) within ``SAVE_BUDGET`` of the time; and once all saves
        so far cost over ``SAVE_NEW_BUDGET`` of the process's CPU time (thousands of leaks),
        everything waits for the budget, so that saving never grows with the square of the run."""
        now = time.process_time()
        due = force or now >= self._next_at
        if not due and self._spent > SAVE_NEW_BUDGET * now:
            return
        found = []
        new = False
        for s in self.sinks:
            fn = getattr(s, "findings", None)
            if fn is None:
                continue
            try:
                got = fn(session, count_only=not due) if not due else fn(session)
            except Exception as e:  # an analysis must never break the traced program
                log.error("analysis %s: findings: %s", type(s).__name__, e)
                continue
            if got is None:
                continue
            name, result, count = got
            if self._counts.get(name) != count:
                new = True
            found.append((name, result, count))
        if not (due or new):
            return
        c0 = time.process_time()
        found = [(n, r if r is not None else self._full(session, n), c) for n, r, c in found]
        found.append(("peaks", peaks_result(session), None))
        for name, result, count in found:
            text = json.dumps(result, indent=2, default=str)
            if self._saved.get(name) == text:
                continue
            try:
                _write_text(session.folder, name, text)
                self._saved[name] = text
                self._counts[name] = count
            except OSError as e:
                log.error("analysis %s: cannot save findings: %s", name, e)
        # the budget is of this process's CPU time: a loaded machine's waits neither make saves
        # rarer nor more frequent
        self._cost = time.process_time() - c0
        self._spent += self._cost
        self._next_at = time.process_time() + min(self._cost / SAVE_BUDGET, 60.0)

    def _full(self, session, name):
        for s in self.sinks:
            fn = getattr(s, "findings", None)
            if fn is not None:
                got = fn(session)
                if got is not None and got[0] == name:
                    return got[1]
        return None

    def close(self, session):
        # the other sinks wrote their final results already (they come first)
        try:
            _write_text(session.folder, "peaks", json.dumps(peaks_result(session, final=True), indent=2))
        except OSError as e:
            log.error("analysis peaks: %s", e)


def checkpoint(session):
    """Save the current findings now (a Ray call returned), whatever the time budget says."""
    session.flush_waiting()  # the step boundaries whose flush waited: the findings include them
    with session.flush_lock:  # as at a step end (inside flush): one save at a time
        for s in session.sinks:
            if isinstance(s, StepCheckpoint):
                s.save(session, force=True)
