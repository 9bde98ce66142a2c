"""A Ray job: two actors train a small MLP with Adam; the actor named 'leaky' keeps one 64 KiB
tensor per step; started by this driver, a task ``probe`` runs too. Prints
{"steady": pid, "leaky": pid[, "probe": pid]} as JSON.

    python ray_two_actors.py STEPS                      # starts a local Ray node (ray.init)
    python ray_two_actors.py STEPS ADDRESS OUT ROOT     # joins a running cluster, traced through
                                                        # msmemscope.ray_runtime_env(output=OUT);
                                                        # the actors set RANK 0 and 1 themselves
"""
import json
import sys

import ray  # before torch: the launcher's tracer then knows this driver is a Ray driver
import torch

KEEP = 16384  # float32 elements kept per step by the leaking actor (64 KiB)


@ray.remote(num_cpus=1)
class Trainer:
    def __init__(self, leak, rank=None):
        if rank is not None:  # as verl's workers do: the framework sets the rank in the actor
            import os
            os.environ.update(RANK=str(rank), WORLD_SIZE="2")
        torch.manual_seed(0)
        self.leak = leak
        self.kept = []
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def train(self, steps):
        import os
        for _ in range(steps):
            x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()  # the step boundary
            self.opt.zero_grad(set_to_none=True)
            if self.leak:
                self.kept.append(torch.ones(KEEP))
        return os.getpid()


@ray.remote(num_cpus=0)  # the actors hold both CPUs
def probe(n):
    """A task that imports torch: traced in a task worker of its own."""
    import os
    w = torch.nn.Linear(n, n)
    return os.getpid(), sum(p.numel() for p in w.parameters())


def main():
    steps = int(sys.argv[1])
    if len(sys.argv) > 2:
        import msmemscope
        address, out, root = sys.argv[2:5]
        env = msmemscope.ray_runtime_env(output=out, runtime_env={"env_vars": {"PYTHONPATH": root}})
        ray.init(address=address, runtime_env=env, include_dashboard=False, log_to_driver=False)
    else:
        for attempt in (1, 2):  # Ray waits 30 s at most for its raylet: a loaded machine may need a second go
            try:
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
                break
            except Exception:
                ray.shutdown()
                if attempt == 2:
                    raise
    try:
        ranked = len(sys.argv) > 2
        a = Trainer.options(name="steady").remote(False, 0 if ranked else None)
        b = Trainer.options(name="leaky").remote(True, 1 if ranked else None)
        pids = ray.get([a.train.remote(steps), b.train.remote(steps)], timeout=240)
        out = {"steady": pids[0], "leaky": pids[1]}
        if len(sys.argv) == 2:
            out["probe"] = ray.get(probe.remote(16), timeout=240)[0]
        print(json.dumps(out))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
