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
from .capture.eager import eager_api
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
    if s is not None and s.launched and not s.closed:
        return _merge_with_launcher(s, kwargs)
    if s is None and _launched():
        # under the launcher before `import torch`: merged when the launcher's trace starts there
        _launcher_pending.update(kwargs)
        return opts
    if s is not None:
        import logging
        msg = ("config() called while a trace is already set up (by an earlier start() or snapshot); "
               "its options stay in force")
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


_launcher_pending: dict = {}


def _launched() -> bool:
    import os
    return bool(os.environ.get("MSMEMSCOPE_OPTIONS"))


_OUTPUT_KEYS = ("output", "data_format", "compress", "keep_steps")  # moved together, or not at all


def _merge_with_launcher(s, kwargs):
    """Under the ``msmemscope`` launcher, as in the original: the script's config() sets every
    option the command line did not; the command line's own stay. Said in one stderr line."""
    import os
    from ._console import say
    global _config
    cli = {k for k in os.environ.get("MSMEMSCOPE_CLI_SET", "").split(",") if k}
    mine = {k: v for k, v in kwargs.items() if _options.canonical(k) not in cli}
    kept = [k for k in kwargs if k not in mine]
    try:
        opts = _options.build(s.opts, **mine)
    except _options.OptionError as e:
        # valid alone (config() checked them) but not with the command line's: those stay, as the
        # program untraced would have run on (never an error raised into it by the launcher's options)
        say(f"[msmemscope] msmemscope.config() in the script: not applied: {e}; the command line's options stay")
        return s.opts
    before, written = s.opts, s.next_id
    late = s.reconfigure(opts) if mine else []
    if s.started_once and (s.opts.analysis, s.opts.oom_k) != (before.analysis, before.oom_k):
        if written == 0:  # nothing analysed yet: the analyses the script asked for, from the start
            s.sinks = [x for x in s.sinks if x is s.watch_engine]
            _wire_session(s)
        else:
            late.append("analysis (rows were already analysed)")
    _config = s.opts
    # what reconfigure kept as it was (the output where the dump had begun, or cannot be written)
    applied = {k: v for k, v in mine.items()
               if not (late and _options.canonical(k) in _OUTPUT_KEYS
                       and getattr(s.opts, _options.canonical(k)) == getattr(before, _options.canonical(k)))}
    parts = []
    if applied:
        parts.append("applied " + ", ".join(f"{k}={v!r}" for k, v in applied.items()))
    if kept:
        parts.append("kept the command line's " + ", ".join(kept))
    if late:
        parts.append("not applied: " + "; ".join(late))
    if parts:
        say("[msmemscope] msmemscope.config() in the script: " + "; ".join(parts))
    return s.opts


def start():
    """Start (or resume) recording."""
    opts = _config or _options.Options(collect_mode="deferred")
    try:
        _session_for_api().start()
    except OSError as e:  # the output cannot be written: the tool's failure, not the program's
        from ._console import alert_once
        alert_once("start", f"[msmemscope] tracing not started: cannot write to {opts.output}: {e.strerror or e}")


def _session_for_api():
    """The process's session, made from the current config() if there is none yet (not started:
    ``take_snapshot()`` and ``tracer.start()`` work without ``start()``, as in the original)."""
    from . import capture
    opts = _config or _options.Options(collect_mode="deferred")
    return capture.create(opts)


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

# inside compiled code (a compiled training step that ends its step): called, never traced
start, stop, step = (eager_api(f) for f in (start, stop, step))


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
        "tracer": ("msmemscope.tracer", None),
        "analyzer": ("msmemscope.analyzer", None),
    }
    if name in lazy:
        mod, attr = lazy[name]
        m = importlib.import_module(mod)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'msmemscope' has no attribute '{name}'")
