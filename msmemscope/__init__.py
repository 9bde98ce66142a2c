"""msmemscope: memory analysis for PyTorch programs on every device.

Run a program under ``msmemscope`` or call the API from it::

    import msmemscope
    msmemscope.config(events="alloc,free,launch", analysis="leaks", output="./out")
    msmemscope.start()
    ...           # train
    msmemscope.step()
    msmemscope.stop()
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import options as _options
from .options import OptionError

_config = None


def config(**kwargs):
    """Set options (the SPEC keys, string values as in the original, plus aliases).

    Collection from Python defaults to ``deferred``: nothing is recorded until
    ``start()``; with ``collect_mode="immediate"`` tracing starts now.
    """
    global _config
    from . import capture
    base = _options.Options(collect_mode="deferred")
    if _config is not None:
        base = _config
    opts = _options.build(base, **kwargs)
    s = capture.current()
    if s is not None:
        import logging
        msg = ("config() called while a trace is already set up (by the msmemscope launcher or an earlier "
               "start()); its options stay in force")
        logging.getLogger("msmemscope").warning(msg)
        from ._console import alert_once
        alert_once("config-after-start", f"[msmemscope] {msg}")
        return opts
    if opts.device:
        from .capture.backends import drop_missing_device
        drop_missing_device(opts)
    _config = opts
    if opts.collect_mode == "immediate":
        start()
    return opts


def start():
    """Start (or resume) recording."""
    from . import capture
    opts = _config or _options.Options(collect_mode="deferred")
    try:
        capture.create(opts).start()
    except OSError as e:  # the output cannot be written: the tool's failure, not the program's
        from ._console import alert_once
        alert_once("start", f"[msmemscope] tracing not started: cannot write to {opts.output}: {e.strerror or e}")


def stop():
    """Stop recording; the dump stays open until the process ends, so ``start()`` may resume."""
    from . import capture
    s = capture.current()
    if s is not None:
        s.stop()


def step():
    """End the current step (like ``profiler.step()``); switches off the automatic optimizer-step boundary."""
    from . import capture
    s = capture.current()
    if s is not None:
        s.step("api")


from .capture.marks import RecordFunction, mark, range_end, range_start  # noqa: E402


def _wire_session(session):
    """At a session's first start(): the online analyses as its sinks, and the framework hooks
    (SPEC 4.8: automatic under decompose, or set up before start()). Registered with the capture
    hook point so that capture imports neither."""
    import logging
    import sys
    from .analysis import online_sinks
    for sink in online_sinks(session):
        session.add_sink(sink)
    if "decompose" in session.opts.analysis or "msmemscope.integrations" in sys.modules:
        try:
            from .integrations import on_session_start
            on_session_start(session)
        except Exception as e:
            logging.getLogger("msmemscope").warning("framework hooks: %s", e)


from . import capture as _capture  # noqa: E402

_capture.on_start.append(_wire_session)


def __getattr__(name):
    # Analyses and helpers load on first use so that ``import msmemscope`` in a
    # traced process stays cheap.
    import importlib
    lazy = {
        "check_leaks": ("msmemscope.analysis.leaks", "check_leaks"),
        "check_inefficient": ("msmemscope.analysis.inefficient", "check_inefficient"),
        "analyze": ("msmemscope.analysis.registry", "analyze"),
        "list_analyzers": ("msmemscope.analysis.registry", "list_analyzers"),
        "get_analyzer_config": ("msmemscope.analysis.registry", "get_analyzer_config"),
        "load": ("msmemscope.io.reader", "load"),
        "read_dump": ("msmemscope.io.reader", "read_dump"),
        "take_snapshot": ("msmemscope.capture.snapshot", "take_snapshot"),
        "TakeSnapshot": ("msmemscope.capture.snapshot", "TakeSnapshot"),
        "init_framework_hooks": ("msmemscope.integrations", "init_framework_hooks"),
        "cleanup_framework_hooks": ("msmemscope.integrations", "cleanup_framework_hooks"),
        "ray_runtime_env": ("msmemscope.integrations.ray", "ray_runtime_env"),
        "watcher": ("msmemscope.watcher", None),
        "describe": ("msmemscope.describe", None),
        "mstx": ("msmemscope.mstx", None),
    }
    if name in lazy:
        mod, attr = lazy[name]
        m = importlib.import_module(mod)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'msmemscope' has no attribute '{name}'")
