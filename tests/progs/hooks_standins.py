"""Stand-ins for vLLM, vllm_ascend and verl (which cannot be installed here): modules
placed in sys.modules under the real dotted names, with the real classes' method
names and signatures (read from their sources, see docs/integrations.md). Their
bodies only allocate what the real method is about (weights, KV caches, a graph pool).

Run as a program (under the msmemscope launcher): sets up vllm and verl hooks,
runs a worker life cycle and the verl roles, cleans up and prints one JSON line."""
import json
import sys
import types

import torch
from torch import nn

ATTN_SHAPE = (2, 4, 8, 16)          # K and V, blocks, block size, head size: per attention layer
MAMBA_SHAPES = ((4, 32), (4, 64))   # conv and ssm state: per mamba layer
GRAPH_POOL = 1000                   # floats captured by the "CUDA graph"


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, m)
    return m


class FullAttentionSpec:
    pass


class MambaSpec:
    pass


def kv_config():
    g = types.SimpleNamespace
    return g(kv_cache_groups=[g(kv_cache_spec=FullAttentionSpec(), layer_names=["layers.0.attn", "layers.1.attn"]),
                              g(kv_cache_spec=MambaSpec(), layer_names=["layers.2.mixer"])])


def make_runner_class(name, base=object):
    class Runner(base):
        def __init__(self):
            self.model = None
            self.kv_caches = []

        def load_model(self, eep_scale_up: bool = False) -> None:
            self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

        @torch.inference_mode()
        def profile_run(self) -> None:
            self.model(torch.randn(8, 16))

        def initialize_kv_cache(self, kv_cache_config) -> None:
            self.kv_caches_by_layer = self.initialize_kv_cache_tensors(kv_cache_config, [16])

        def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes):
            out = {}
            for g in kv_cache_config.kv_cache_groups:
                for ln in g.layer_names:
                    if isinstance(g.kv_cache_spec, MambaSpec):
                        out[ln] = [torch.zeros(s) for s in MAMBA_SHAPES]
                    else:
                        out[ln] = torch.zeros(ATTN_SHAPE)
            self.kv_caches = list(out.values())
            return out

        def capture_model(self) -> int:
            self.graph_pool = torch.empty(GRAPH_POOL)
            return self.graph_pool.nbytes

        @torch.inference_mode()
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return self.model(torch.randn(scheduler_output, 16)).sum()
    Runner.__name__ = Runner.__qualname__ = name
    return Runner


def make_worker_class(name, runner_cls):
    class Worker:
        def __init__(self):
            self.model_runner = runner_cls()

        def load_model(self) -> None:
            self.model_runner.load_model()

        def determine_available_memory(self) -> int:
            self.model_runner.profile_run()
            return 1 << 20

        def initialize_from_config(self, kv_cache_config) -> None:
            self.model_runner.initialize_kv_cache(kv_cache_config)

        def compile_or_warm_up_model(self) -> None:
            self.model_runner.capture_model()

        def execute_model(self, scheduler_output):
            return self.model_runner.execute_model(scheduler_output)
    Worker.__name__ = Worker.__qualname__ = name
    return Worker


def install_vllm(version="0.11.0"):
    _module("vllm", __version__=version)
    _module("vllm.v1")
    _module("vllm.v1.worker")
    runner = make_runner_class("GPUModelRunner")
    _module("vllm.v1.worker.gpu_model_runner", GPUModelRunner=runner)
    _module("vllm.v1.worker.gpu_worker", Worker=make_worker_class("Worker", runner))


def install_vllm_ascend(version="0.11.0", layout="worker_v1"):
    """``layout``: "worker_v1" (vllm_ascend <= 0.12) or "worker" (0.13+)."""
    install_vllm()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    _module("vllm_ascend", __version__=version)
    _module("vllm_ascend.worker")

    class NPUModelRunner(GPUModelRunner):   # overrides what NPUModelRunner overrides, inherits the rest
        def load_model(self) -> None:
            GPUModelRunner.load_model(self)
    _module("vllm_ascend.worker.model_runner_v1", NPUModelRunner=NPUModelRunner)
    _module(f"vllm_ascend.worker.{layout}", NPUWorker=make_worker_class("NPUWorker", NPUModelRunner))


def register(dispatch_mode=None):
    """verl's @register puts an attribute on the method that Ray's worker group reads."""
    def deco(fn):
        fn._verl_dispatch = dispatch_mode
        return fn
    return deco


def install_verl(version="0.6.0"):
    _module("verl", __version__=version)
    _module("verl.workers")
    _module("verl.trainer")

    class ActorRolloutRefWorker:
        def __init__(self, config=None, role="actor_rollout"):
            self.config, self.role = config, role

        @register("ONE_TO_ALL")
        def init_model(self):
            self.w = torch.zeros(256)

        @register("actor")
        def update_actor(self, data):
            return torch.ones(64) * data

        @register("rollout")
        def generate_sequences(self, prompts):
            return torch.ones(32) * prompts

        @register("actor")
        def compute_log_prob(self, data):
            return torch.zeros(16) + data

        @register("actor")
        def compute_ref_log_prob(self, data):
            return torch.zeros(16) + data

        @register("ONE_TO_ALL")
        def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
            return None

    class CriticWorker:
        def __init__(self, config=None):
            self.config = config

        @register("ONE_TO_ALL")
        def init_model(self):
            self.v = torch.zeros(128)

        @register("critic")
        def compute_values(self, data):
            return torch.zeros(8) + data

        @register("critic")
        def update_critic(self, data):
            return torch.zeros(8) + data

        @register("ONE_TO_ALL")
        def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
            return None

    class RewardModelWorker:
        def __init__(self, config=None):
            self.config = config

        @register("ONE_TO_ALL")
        def init_model(self):
            self.r = torch.zeros(64)

        @register("reward")
        def compute_rm_score(self, data):
            return torch.zeros(4) + data

    class TaskRunner:
        def run(self, config):
            a = ActorRolloutRefWorker()
            a.init_model()
            for _ in range(2):
                a.generate_sequences(1.0)
                a.compute_log_prob(1.0)
                a.compute_ref_log_prob(1.0)
                a.update_actor(1.0)
            c = CriticWorker()
            c.init_model()
            c.compute_values(1.0)
            c.update_critic(1.0)
            r = RewardModelWorker()
            r.init_model()
            r.compute_rm_score(1.0)

    _module("verl.workers.fsdp_workers", ActorRolloutRefWorker=ActorRolloutRefWorker, CriticWorker=CriticWorker,
            RewardModelWorker=RewardModelWorker)
    _module("verl.trainer.main_ppo", TaskRunner=TaskRunner)


def main():
    import msmemscope
    install_vllm()
    install_verl()
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from verl.trainer.main_ppo import TaskRunner
    import verl.workers.fsdp_workers as fw
    orig = {**{("W", k): v for k, v in Worker.__dict__.items()}, **{("R", k): v for k, v in GPUModelRunner.__dict__.items()},
            **{("A", k): v for k, v in fw.ActorRolloutRefWorker.__dict__.items()}}
    for hook in ("decompose", "snapshot"):
        msmemscope.init_framework_hooks("vllm", "0.11.0", "worker", hook)
        msmemscope.init_framework_hooks("verl", "0.6.0", "all", hook)
    dispatch_kept = fw.ActorRolloutRefWorker.generate_sequences._verl_dispatch == "rollout"
    w = Worker()
    w.load_model()
    w.determine_available_memory()
    w.initialize_from_config(kv_config())
    w.compile_or_warm_up_model()
    for n in (2, 3):
        w.execute_model(n)
    TaskRunner().run(None)
    msmemscope.cleanup_framework_hooks()
    now = {**{("W", k): v for k, v in Worker.__dict__.items()}, **{("R", k): v for k, v in GPUModelRunner.__dict__.items()},
           **{("A", k): v for k, v in fw.ActorRolloutRefWorker.__dict__.items()}}
    params = sum(p.numel() * p.element_size() for p in w.model_runner.model.parameters())
    print(json.dumps({"restored": now.keys() == orig.keys() and all(now[k] is orig[k] for k in orig),
                      "dispatch_kept": dispatch_kept, "weight_bytes": params}), flush=True)


if __name__ == "__main__":
    main()
