"""Growth of live bytes by allocation site: the leak rule a user can act on.

A *site* is where blocks are allocated: ``(device, pool, op, python line)`` when
Python call stacks are recorded (``--call-stack=python``), else ``(device, pool,
op, label)`` where the label is the nearest user label of the allocation: the
``msmemscope.describe`` labels carried in the block's owner, else the innermost
mstx range open on the thread, else the thread's last mark (or none).

At every step end the site's *live bytes* (the sizes of its blocks not yet
freed) are taken: ``L_0 = 0`` (trace start), ``L_k`` at the k-th step end.

**Rule.** A site is growing when its last step ends form a run ``L_a .. L_n``
(``n`` = the last step end, or ``n - 1`` when the last step end is the one
dropped) that is strictly increasing once at most ONE step end inside it is
dropped (a noisy step: a pause, a dip or a spike), with

- at least 3 rises (4 kept values), so one-time allocations (a cache, the
  optimizer's lazily created state, one warm-up buffer) never qualify: they rise
  once, then stay flat;
- a new high: the last kept value exceeds every value before the run, so a
  rolling window that reached its cap, a site that is cleared and refilled, or a
  batch whose size varies from step to step is not growth;
- when the last step end is the dropped one, the live bytes now still above the
  run's start (a site that was just cleared is not reported).

``bytes_per_step = (L_last - L_rise) / (step ends between them)``, over the kept run
from its first rise's step end ``L_rise`` on: a site's one-time blocks made in the
step of that first rise (the model's weights, made by the same op as the leak before
the first step ends) are no part of the rate (before: a 5,000 B a step leak beside
68 KB of weights was said to grow 15.2 KB a step). ``steps_growing`` = the rises in the
run; ``first_step``/``last_step`` = the step numbers of the first rise and of the last
kept step end.

The state per site is constant-size (the last two values and three run
summaries), so the analysis is bounded by the number of sites, not of steps.
The same class serves the online sink and the offline replay of a dump.
"""
from __future__ import annotations

MIN_RISES = 3
MAX_SITES = 20000     # past this, sites with nothing live are forgotten (a program making endless labels)


def fmt_bytes(n) -> str:
    """Sizes as a person reads them: 24 B, 32.0 KB, 4.0 MB, 1.25 GB (1 KB = 1024 B)."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1024.0
        if n < 1024 or unit == "GB":
            return f"{sign}{n:.2f} {unit}" if unit == "GB" else f"{sign}{n:.1f} {unit}"
    return f"{sign}{n:.1f} GB"


class Site:
    """One allocation site. Run summaries are tuples ``(kept, start_index, start_bytes,
    max_before_start, first_rise_step, first_rise_index, first_rise_bytes)``."""
    __slots__ = ("device", "pool", "op", "python", "label", "live", "last_aid", "example",
                 "p1", "p2", "runmax", "a1", "a2", "d", "verdict", "hits", "hit_bytes", "blocks", "resting")

    def __init__(self, device, pool, op, python, label, k):
        self.device, self.pool, self.op, self.python, self.label = device, pool, op, python, label
        self.live = 0
        self.last_aid = None
        self.example = None
        # as if the site had 0 live bytes at every step end so far
        self.p1 = 0
        self.p2 = 0 if k >= 1 else None
        self.runmax = 0                      # max of L_0 .. L_k (the values so far)
        self.a1 = (1, k, 0, 0 if k >= 1 else -1, None, None, None)
        self.a2 = (1, k - 1, 0, 0 if k >= 2 else -1, None, None, None) if k >= 1 else None
        self.d = None
        self.verdict = None   # the growth found at the last step end (a dict), or None
        self.hits = 0         # blocks of this site found by the block rule
        self.hit_bytes = 0
        self.blocks = []      # the first MAX_BLOCKS of them (records)
        self.resting = False  # see SiteGrowth.end_step

    def wake(self, k):
        """A resting site's state as if ``end_step`` had run at every step end before ``k`` (its live
        bytes unchanged since it came to rest: each of them only moved the runs' start)."""
        x, m = self.p1, self.runmax
        self.a1, self.a2 = (1, k - 1, x, m, None, None, None), (1, k - 2, x, m, None, None, None)
        self.resting = False

    def end_step(self, k, step, prev_step):
        """Step end number ``k`` (step number ``step``; the previous step end was ``prev_step``)."""
        if self.resting:
            self.wake(k)
        x = self.live
        p1, p2, a1, a2, d1 = self.p1, self.p2, self.a1, self.a2, self.d
        if x > p1:
            a = (a1[0] + 1, *a1[1:4], *(a1[4:] if a1[4] is not None else (step, k, x)))
        else:
            a = (1, k, x, self.runmax, None, None, None)
        d = None
        if a2 is not None and x > p2:  # drop step end k-1
            d = (a2[0] + 1, *a2[1:4], *(a2[4:] if a2[4] is not None else (step, k, x)))
        if d1 is not None and x > p1 and (d is None or d1[0] + 1 > d[0]):  # an earlier one was dropped
            d = (d1[0] + 1, *d1[1:])
        if x > self.runmax:
            self.runmax = x
        self.a2, self.a1, self.d, self.p2, self.p1 = a1, a, d, p1, x
        best = None
        for run, last, last_bytes, last_step in ((a, k, x, step), (d, k, x, step), (a1, k - 1, p1, prev_step)):
            if run is None or run[0] < MIN_RISES + 1 or last_bytes <= run[3]:
                continue
            if last == k - 1 and x <= run[2]:
                continue
            if best is None or run[0] > best[0][0]:
                best = (run, last, last_bytes, last_step)
        if best is None:
            self.verdict = None
            # flat over the last two step ends, nothing dropped: until its live bytes move, every
            # step end gives the same state with the runs' start moved on (``wake`` makes it)
            self.resting = (d is None and x == p1 == p2 and a == (1, k, x, self.runmax, None, None, None)
                            and a1 == (1, k - 1, x, self.runmax, None, None, None))
            return
        run, last, last_bytes, last_step = best
        # from the first rise on (at least 2 rises after it: MIN_RISES)
        rate = (last_bytes - run[6]) / (last - run[5]) if last > run[5] else (last_bytes - run[2]) / (last - run[1])
        self.verdict = {"bytes_per_step": rate, "first_step": run[4],
                        "last_step": last_step, "steps_growing": run[0] - 1}
        if self.last_aid is not None:
            self.example = self.last_aid

    def record(self):
        v = self.verdict
        return {"device": str(self.device), "pool": self.pool,
                "op": self.op if not self.label else f"{self.op}@{self.label}",
                "python": self.python, "bytes_per_step": int(round(v["bytes_per_step"])),
                "live_bytes": int(self.live), "first_step": v["first_step"], "last_step": v["last_step"],
                "steps_growing": v["steps_growing"], "example_alloc_id": self.example}


class SiteGrowth:
    """Live bytes per site, updated per MALLOC/FREE row; the rule applied at each step end."""

    def __init__(self):
        self.sites: dict = {}     # site key -> Site
        self.blocks: dict = {}    # (device, pool, alloc_id) -> (Site, size) for the live blocks
        self.k = 0                # step ends seen
        self.last_step = 0        # the number of the last step end (0: none yet)
        self.n_growing = 0        # sites with a verdict: what growing() lists (counted at step ends)

    def site(self, device, pool, op, python, label):
        key = (device, pool, op, python, label)
        s = self.sites.get(key)
        if s is None:
            if len(self.sites) >= MAX_SITES:
                self._forget_idle()
            s = self.sites[key] = Site(device, pool, op, python, label, self.k)
        return s

    def _forget_idle(self):
        for key in [k for k, s in self.sites.items() if s.live == 0 and s.hits == 0 and s.verdict is None]:
            del self.sites[key]

    def end_step(self, step):
        self.k += 1
        prev, self.last_step = self.last_step, step
        k = self.k
        found = []
        # most sites are at rest at most step ends (the same live bytes two step ends running, no
        # growth): they are passed over until their live bytes move (Site.wake)
        for s in self.sites.values():
            if s.resting and s.live == s.p1:
                continue
            s.end_step(k, step, prev)
            if s.verdict is not None:
                found.append(s)
        self.n_growing = len(found)  # a site passed over is at rest, and a site at rest has no verdict
        blocks = self.blocks
        for s in found:  # the example block must be live now
            if s.example is not None and (s.device, s.pool, s.example) not in blocks:
                s.example = None

    def growing(self) -> list:
        """The growing sites, largest growth first."""
        out = [s for s in self.sites.values() if s.verdict is not None]
        out.sort(key=lambda s: -s.verdict["bytes_per_step"])
        return out
