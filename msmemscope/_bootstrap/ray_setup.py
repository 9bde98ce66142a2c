"""Ray's ``worker_process_setup_hook`` for a job started with ``msmemscope.ray_runtime_env()``:
the Ray counterpart of sitecustomize. It lives in _bootstrap so that integrations/ray.py never
imports the bootstrap that imports it."""
from __future__ import annotations

import importlib
import os
import sys

from ..integrations.ray import _CHAINED, install_call_hook
from . import hook


def worker_setup():
    """Trace this worker once it imports torch, then run the job's own setup hook if it had one."""
    try:
        if os.environ.get("MSMEMSCOPE_OPTIONS"):
            install_call_hook()  # Ray is imported by now
            hook.install()
    except Exception as e:  # the job runs even if the tracer cannot
        print(f"[msmemscope] tracing disabled in Ray worker {os.getpid()}: {e}", file=sys.stderr)
    chained = os.environ.get(_CHAINED)
    if chained:
        mod, _, fn = chained.rpartition(".")
        getattr(importlib.import_module(mod), fn)()
