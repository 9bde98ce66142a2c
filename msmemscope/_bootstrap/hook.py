"""Start tracing in a launched process as soon as it has imported torch."""
from __future__ import annotations

import os
import sys

from ..after_import import after_import

_SKIP_MAIN = ("torch.distributed.run", "torch.distributed.launch")


def _is_launcher_agent() -> bool:
    """torchrun's own agent imports torch but only spawns ranks: not traced."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in _SKIP_MAIN:
        return True
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return argv0 in ("torchrun",)


def start_from_env(_module=None):
    from .. import capture
    from ..options import Options
    if _is_launcher_agent():
        return
    opts = Options.from_json(os.environ["MSMEMSCOPE_OPTIONS"])
    from ..capture.backends import drop_missing_device
    drop_missing_device(opts)
    ray_worker = _in_ray_worker()
    if ray_worker:
        from ..integrations.ray import prepare_worker_env
        prepare_worker_env()
    s = capture.create(opts, launched=True)
    api = sys.modules.get("msmemscope")
    if getattr(api, "_launcher_pending", None):  # msmemscope.config() ran before `import torch`
        api._merge_with_launcher(s, dict(api._launcher_pending))
        api._launcher_pending.clear()
    if s.opts.collect_mode == "immediate":
        s.start()
    if ray_worker or "ray" in sys.modules:
        # after start(): importing msmemscope.integrations before it would turn on its framework hooks
        try:
            from ..integrations.ray import attach
            attach(s)
        except Exception as e:
            print(f"[msmemscope] Ray worker {os.getpid()}: no Ray details in config.json: {e}", file=sys.stderr)


def _in_ray_worker() -> bool:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.basename(argv0) == "default_worker.py" and "ray" in argv0


def _ray_call_hook(_module=None):
    from ..integrations.ray import install_call_hook
    install_call_hook()


def install():
    if _in_ray_worker():
        # each task and actor method saves the trace when it returns (Ray ends workers with _exit):
        # hooked before the first task, whose loading is what imports torch
        after_import("ray._private.function_manager", _ray_call_hook)
    # tracing starts right after `import torch` completes
    after_import("torch", start_from_env, "tracing disabled in process {pid}")
