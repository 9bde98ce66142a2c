"""verl patch points: framework ``verl``, components ``task_runner``, ``actor_rollout``,
``ref``, ``critic``, ``reward`` (the FSDP workers of ``verl/workers/fsdp_workers.py``
and ``TaskRunner`` of ``verl/trainer/main_ppo.py``).

Snapshot: ``"verl@<role>@<method> Start"`` / ``"… End"`` around each method.
Decompose: blocks allocated inside carry ``verl@<role>@<method>``; rollout
inference inside ``generate_sequences`` is further labelled by the ``vllm`` hooks
when vLLM is the rollout engine.

verl runs each role in a Ray actor process: the hooks must be set up in that
process (the ``msmemscope`` launcher with ``--analysis=decompose`` does it by
itself when ``verl.workers.fsdp_workers`` is imported there). The wrappers keep
the attributes ``@register`` put on the methods (``functools.wraps`` copies
``__dict__``), so Ray's dispatch still finds them.

verl cannot be installed here: the names were read from the git tags in ``CHECKED``
and the machinery is tested against stand-in modules.
"""
from __future__ import annotations

from . import Entry, Framework

CHECKED = "verl git tags v0.4.1, v0.5.0, v0.6.0, v0.7.0 and main b178a3c (0.8.0.dev)"
V = ("0.4", "0.9")
W = "verl.workers.fsdp_workers"

ROLES = {
    "task_runner": [("verl.trainer.main_ppo:TaskRunner", "run")],
    "actor_rollout": [(f"{W}:ActorRolloutRefWorker", m) for m in
                      ("init_model", "generate_sequences", "compute_log_prob", "update_actor", "save_checkpoint")],
    "ref": [(f"{W}:ActorRolloutRefWorker", "compute_ref_log_prob")],
    "critic": [(f"{W}:CriticWorker", m) for m in ("init_model", "compute_values", "update_critic", "save_checkpoint")],
    "reward": [(f"{W}:RewardModelWorker", m) for m in ("init_model", "compute_rm_score")],
}

FRAMEWORKS = [Framework("verl", "verl", entries=[
    Entry("verl", role, f"{cls}.{m}", ("verl", role, m), versions=V, checked=CHECKED)
    for role, targets in ROLES.items() for cls, m in targets])]
