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

# verl 0.9 moved the workers to engine_workers.py (rollout runs behind a server, the
# critic is a TrainingWorker) and the task runner to TaskRunnerV1 (the legacy one
# lives on in main_ppo_v0, optional). Read from the verl 0.9.1 wheel.
CHECKED_09 = "verl 0.9.1 wheel (verl/trainer/main_ppo.py, main_ppo_v0.py, workers/engine_workers.py)"
V09 = ("0.9", None)
E = "verl.workers.engine_workers"
ROLES_09 = {
    "task_runner": [("verl.trainer.main_ppo:TaskRunnerV1", "run", False),
                    ("verl.trainer.main_ppo_v0:TaskRunner", "run", True)],
    "actor_rollout": [(f"{E}:ActorRolloutRefWorker", m, False) for m in
                      ("init_model", "compute_log_prob", "update_actor", "save_checkpoint")],
    "ref": [(f"{E}:ActorRolloutRefWorker", "compute_ref_log_prob", False)],
    "critic": [(f"{E}:TrainingWorker", m, False) for m in ("train_batch", "infer_batch", "save_checkpoint")],
}

FRAMEWORKS = [Framework("verl", "verl", entries=[
    Entry("verl", role, f"{cls}.{m}", ("verl", role, m), versions=V, checked=CHECKED)
    for role, targets in ROLES.items() for cls, m in targets] + [
    Entry("verl", role, f"{cls}.{m}", ("verl", role, m), versions=V09, optional=opt, checked=CHECKED_09)
    for role, targets in ROLES_09.items() for cls, m, opt in targets])]
