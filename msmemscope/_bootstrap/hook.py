"""Start tracing in a launched process as soon as it has imported torch."""
from __future__ import annotations

import importlib.abc
import os
import sys

_SKIP_MAIN = ("torch.distributed.run", "torch.distributed.launch")


def _is_launcher_agent() -> bool:
    """torchrun's own agent imports torch but only spawns ranks: not traced."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in _SKIP_MAIN:
        return True
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return argv0 in ("torchrun",)


def start_from_env():
    from .. import capture
    from ..options import Options
    if _is_launcher_agent():
        return
    opts = Options.from_json(os.environ["MSMEMSCOPE_OPTIONS"])
    from ..capture.backends import drop_missing_device
    drop_missing_device(opts)
    s = capture.create(opts, launched=True)
    if opts.collect_mode == "immediate":
        s.start()


class _TorchWatcher(importlib.abc.MetaPathFinder):
    """Wraps torch's loader so tracing starts right after ``import torch`` completes."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            orig_exec(module)
            try:
                start_from_env()
            except Exception as e:
                print(f"[msmemscope] tracing disabled in process {os.getpid()}: {e}", file=sys.stderr)
        spec.loader.exec_module = exec_module
        return spec


def install():
    if "torch" in sys.modules:
        start_from_env()
    else:
        sys.meta_path.insert(0, _TorchWatcher())
