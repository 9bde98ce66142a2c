"""The ranks of a distributed run: which dump belongs to which rank.

A job traced under the launcher (``msmemscope torchrun …``) leaves one folder per
process, ``msmemscope_<pid>_<ts>_<backend>_rank<R>``, each with a ``config.json``
(``rank``, ``local_rank``, ``world_size``, ``host``) and one dump. The offline
commands accept the root holding such folders (at any depth: one root per node
copied side by side works too), a single run folder, or a dump file.

    for rd in find_rank_dumps(root):     # sorted by rank, then path
        print(rd.label, rd.path)
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from .reader import DumpError, find_dumps

CONFIG = "config.json"


@dataclass
class RankDump:
    path: str                 # the dump file
    folder: str               # the run folder holding config.json (the dump's own folder if none)
    config: dict = field(default_factory=dict)
    label: str = ""
    # a process beside the ranks of a job that is none of them (set by find_rank_dumps): no rank in
    # its config.json while other folders under the root have one, neither a DataLoader worker nor
    # a Ray process (named by their roles); the parent of torch.multiprocessing.spawn (or of
    # mp.Process ranks): it imports torch, starts the ranks and joins no process group
    not_a_rank: bool = False

    @property
    def rank(self):
        return self.config.get("rank")

    @property
    def is_worker(self) -> bool:
        """A DataLoader worker traced with MSMEMSCOPE_TRACE_WORKERS=1 (it carries its rank's RANK)."""
        return self.config.get("role") == "dataloader_worker"

    @property
    def host(self):
        return self.config.get("host")

    @property
    def ray(self) -> dict:
        """The Ray identity of a traced Ray worker or driver (job id, node, actor, tasks), or {}."""
        r = self.config.get("ray")
        return r if isinstance(r, dict) else {}


def ray_name(cfg: dict) -> str | None:
    """``actor leaky (pid 12)``, ``task train_fn (pid 12)``, ``ray driver (pid 12)`` for a Ray
    process's folder; None for any other."""
    r = cfg.get("ray")
    if not isinstance(r, dict):
        return None
    pid = cfg.get("pid", "?")
    role = cfg.get("role")
    if role == "ray_actor" or r.get("actor_id"):
        who = r.get("actor_name") or r.get("actor_class") or (r.get("actor_id") or "?")[:8]
        return f"actor {who} (pid {pid})"
    if role == "ray_task":
        tasks = r.get("tasks") or []
        who = ",".join(tasks[:2]) + ("…" if len(tasks) > 2 else "") if tasks else "?"
        return f"task {who} (pid {pid})"
    return f"ray driver (pid {pid})"


def run_folder_of(dump: str, stop: str | None = None) -> tuple[str, dict]:
    """The nearest folder above ``dump`` holding a config.json (not above ``stop``), and that config."""
    d = os.path.dirname(os.path.abspath(dump))
    stop = os.path.abspath(stop) if stop else None
    while True:
        cfg = os.path.join(d, CONFIG)
        if os.path.isfile(cfg):
            try:
                from .validate import load_json_object
                return d, load_json_object(cfg)  # an object, never nested past 64 levels
            except (OSError, ValueError, DumpError):
                return d, {}
        parent = os.path.dirname(d)
        if parent == d or (stop is not None and d == stop) or (stop is not None and not d.startswith(stop)):
            break
        d = parent
    return os.path.dirname(os.path.abspath(dump)), {}


def find_rank_dumps(root: str) -> list[RankDump]:
    """Every dump under ``root`` with its run folder and config, sorted by rank (unranked last).

    Raises ``DumpError`` when ``root`` does not exist or holds no dump."""
    dumps = find_dumps(root)
    stop = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    out = []
    for p in dumps:
        folder, cfg = run_folder_of(p, stop)
        out.append(RankDump(path=p, folder=folder, config=cfg))
    out.sort(key=lambda r: (r.rank is None, r.rank if isinstance(r.rank, int) else 0, r.is_worker, r.path))
    if any(isinstance(r.rank, int) for r in out):
        for r in out:
            r.not_a_rank = r.rank is None and not r.is_worker and not r.config.get("role") and not r.ray
    _label(out)
    return out


def ranks_of_job(rds: list[RankDump], prog: str = "msmemscope") -> list[RankDump]:
    """The dumps an offline command reports one by one: where the root holds the ranks of a job,
    the processes that are none of them (``not_a_rank``: the parent of torch.multiprocessing.spawn)
    are left out, each named on stderr (give its own folder to read it)."""
    keep = [r for r in rds if not r.not_a_rank]
    if not keep:
        return rds
    for r in rds:
        if r.not_a_rank:
            print(f"[{prog}] left out {r.folder}: not a rank of the job (no rank in its config.json; "
                  f"give its folder to read it)", file=sys.stderr)
    return keep


def _label(rds: list[RankDump]) -> None:
    """``rank R``; where two runs share a rank (two jobs under one root) the host and pid tell them apart;
    a process outside a distributed job is named by its folder."""
    seen: dict = {}
    per_folder: dict = {}
    for r in rds:
        per_folder[r.folder] = per_folder.get(r.folder, 0) + 1
        if not r.is_worker:
            seen[r.rank] = seen.get(r.rank, 0) + 1
    for r in rds:
        if r.is_worker:
            who = f"rank {r.rank}" if r.rank is not None else os.path.basename(os.path.dirname(r.folder))
            r.label = f"{who} worker {r.config.get('worker_id', '?')} (pid {r.config.get('pid', '?')})"
        elif r.rank is None:
            r.label = ray_name(r.config) or os.path.basename(r.folder) + (" (not a rank)" if r.not_a_rank else "")
        elif seen[r.rank] > 1:
            r.label = f"rank {r.rank} ({r.host or '?'} pid {r.config.get('pid', '?')})"
        else:
            r.label = f"rank {r.rank}"
        if r.rank is not None and r.ray and ray_name(r.config):  # a ranked Ray actor: both names
            r.label += f" {ray_name(r.config).split(' (pid')[0]}"
        if per_folder[r.folder] > 1:  # (a count, not a scan: 1,024 ranks made that quadratic)
            r.label += f" {os.path.basename(r.path)}"


def heading(rd: RankDump) -> str:
    """The per-rank heading an offline command prints before that rank's report."""
    cfg = rd.config
    extra = []
    if cfg.get("world_size") is not None:
        extra.append(f"world size {cfg['world_size']}")
    if cfg.get("local_rank") is not None:
        extra.append(f"local rank {cfg['local_rank']}")
    if cfg.get("host"):
        extra.append(f"host {cfg['host']}")
    if rd.ray.get("job_id"):
        extra.append(f"ray job {rd.ray['job_id']}")
    tail = f" ({', '.join(extra)})" if extra else ""
    return f"===== {rd.label}{tail}: {rd.path} ====="


__all__ = ["RankDump", "find_rank_dumps", "run_folder_of", "heading", "ray_name", "DumpError"]
