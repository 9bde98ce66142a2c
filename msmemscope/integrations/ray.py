"""Ray: trace the actors and tasks of a Ray job, each worker process into its own folder.

Two ways in:

* Under the launcher (``msmemscope python driver.py``): the driver's ``ray.init()`` starts the
  local Ray node from the traced environment, so every worker Ray starts runs the launcher's
  ``sitecustomize`` and is traced once it imports torch (``_bootstrap/hook.py``).
* On a cluster started with ``ray start``: the workers do not inherit the driver's
  environment; ``ray_runtime_env(...)`` gives the ``runtime_env`` that turns tracing on for a
  job's workers (Ray's ``worker_process_setup_hook`` plus the options as ``env_vars``)::

      ray.init(address="auto", runtime_env=msmemscope.ray_runtime_env(output="/shared/out"))

In a Ray worker, ``attach(session)`` writes who the process is into ``config.json``
(``ray``: job id, node, worker id, actor id/name/class, task names; ``role``: ``ray_actor``,
``ray_task`` or ``ray_driver``) and flushes the trace after every task or actor method that
returns: Ray ends its workers without running Python's exit handlers, so what a worker did is
on disk when each call returns (rows, and the online analyses' current findings).
"""
from __future__ import annotations

import functools
import logging
import os
import sys

log = logging.getLogger("msmemscope")

SETUP_HOOK = "msmemscope._bootstrap.ray_setup.worker_setup"  # a bootstrap, like sitecustomize
_CHAINED = "MSMEMSCOPE_RAY_CHAINED_HOOK"   # the job's own setup hook, called after ours
_MAX_TASK_NAMES = 50


def in_ray_worker() -> bool:
    """This process is a worker Ray started (its ``default_worker.py``), not a driver."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.basename(argv0) == "default_worker.py" and "ray" in argv0


# ------------------------------------------------------------------ a cluster the user started
def ray_runtime_env(runtime_env: dict | None = None, **options) -> dict:
    """A Ray ``runtime_env`` that traces the job's workers with these options (the keys of
    ``msmemscope.config``; ``output`` should be a path every node can write, or each node's
    local disk). ``runtime_env``: the job's own runtime_env, merged (its ``env_vars`` kept;
    its ``worker_process_setup_hook``, if a module path, still runs after ours).

    msmemscope must be importable on the workers (installed in the cluster's environment).
    """
    from .. import options as O
    base = O.Options(collect_mode="immediate")
    opts = O.build(base, **options)
    opts.output = os.path.abspath(opts.output)
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars["MSMEMSCOPE_OPTIONS"] = opts.to_json()
    theirs = env.get("worker_process_setup_hook")
    if theirs is not None and theirs != SETUP_HOOK:
        if not isinstance(theirs, str):
            raise ValueError("ray_runtime_env: the job's worker_process_setup_hook must be a module path "
                             "('pkg.mod.func') to run beside msmemscope's")
        env_vars[_CHAINED] = theirs
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env


# ------------------------------------------------------------------ who this process is
def identity() -> dict | None:
    """The Ray identity of this process, or None when it is not part of a Ray job (yet)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        ctx = ray.get_runtime_context()
        out = {"job_id": ctx.get_job_id(), "node_id": ctx.get_node_id(), "worker_id": ctx.get_worker_id()}
        try:
            import ray.util
            out["node_ip"] = ray.util.get_node_ip_address()
        except Exception:
            out["node_ip"] = None
        out["driver"] = not in_ray_worker()
        actor = ctx.get_actor_id()
        out["actor_id"] = actor
        out["actor_name"] = ctx.get_actor_name() if actor else None
        task = ctx.get_task_name() if not out["driver"] else None
        fn = ctx.get_task_function_name() if not out["driver"] else None
        out["task_name"] = task
        out["actor_class"] = _class_of(fn) if actor else None
        try:
            out["namespace"] = ctx.namespace
        except Exception:
            out["namespace"] = None
        return out
    except Exception as e:
        log.debug("ray identity: %s", e)
        return None


def _class_of(function_name):
    """``__main__.Trainer.__init__`` -> ``Trainer``."""
    if not function_name:
        return None
    parts = function_name.split(".")
    return parts[-2] if len(parts) >= 2 else None


def _role(ident: dict) -> str:
    if ident.get("driver"):
        return "ray_driver"
    return "ray_actor" if ident.get("actor_id") else "ray_task"


def _rank_now():
    """The rank a framework set after the worker started (verl sets RANK in the actor)."""
    v = os.environ.get("RANK")
    if v is not None and v.lstrip("-").isdigit():
        return int(v)
    td = sys.modules.get("torch.distributed")
    try:
        if td is not None and td.is_available() and td.is_initialized():
            return int(td.get_rank())
    except Exception:
        pass
    return None


def describe(session) -> bool:
    """Put this process's Ray identity (and rank, once set) into ``config.json``. True if it changed."""
    ident = identity()
    if ident is None:
        return False
    cfg = session.config
    old = cfg.get("ray") or {}
    tasks = list(old.get("tasks") or [])
    if ident.get("task_name") and ident["task_name"] not in tasks and len(tasks) < _MAX_TASK_NAMES:
        tasks.append(ident["task_name"])
    role = _role(ident)
    del ident["driver"]
    del ident["task_name"]  # the current one changes with every call: the distinct names are kept
    ident["tasks"] = tasks
    for k in ("actor_name", "actor_class", "actor_id"):  # known from the actor's creation on
        if ident.get(k) is None and old.get(k) is not None:
            ident[k] = old[k]
    changed = ident != old
    if cfg.get("role") != role:
        cfg["role"] = role
        changed = True
    if cfg.get("rank") is None:
        r = _rank_now()
        if r is not None:
            cfg["rank"] = r
            ws = os.environ.get("WORLD_SIZE")
            if ws and ws.isdigit():
                cfg["world_size"] = int(ws)
            changed = True
    if changed:
        cfg["ray"] = ident
        try:
            session._write_config()
        except OSError as e:
            log.warning("config.json: %s", e)
    return changed


# ------------------------------------------------------------------ after every call
def _after_call():
    """A task or actor method returned: what the worker did so far goes to disk now."""
    from .. import capture
    session = capture.current()
    if session is None or session.closed or not session.started_once or session.pid != os.getpid():
        return
    try:
        describe(session)
        session.flush()
        from ..analysis import checkpoint
        checkpoint(session)
    except Exception as e:  # never let the tracer fail the task
        log.warning("ray: saving after a call failed: %s", e)


def install_call_hook() -> bool:
    """Wrap each function Ray runs in this worker (task bodies and actor methods, ``__init__``
    included) so that the trace is saved when it returns. Ray keeps one ``FunctionExecutionInfo``
    per function; the wrapped one is cached in its place. Installed when Ray's function manager
    is imported (``_bootstrap/hook.py``), before the first task: the first call's function is
    loaded (and torch imported, and the session created) inside that lookup."""
    try:
        from ray._private import function_manager as fm
    except Exception as e:
        log.warning("ray: cannot save after each call (%s); saved at step ends only", e)
        return False
    cls = fm.FunctionActorManager
    if getattr(cls.get_execution_info, "_msmemscope", False):
        return True
    orig = cls.get_execution_info

    @functools.wraps(orig)
    def get_execution_info(self, job_id, function_descriptor):
        info = orig(self, job_id, function_descriptor)
        fn = getattr(info, "function", None)
        if fn is None or getattr(fn, "_msmemscope", False) or not hasattr(info, "_replace"):
            return info
        import inspect
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            return info  # saved at step ends and by the next plain call

        @functools.wraps(fn)
        def run(*a, **k):
            try:
                return fn(*a, **k)
            finally:
                _after_call()
        run._msmemscope = True
        new = info._replace(function=run)
        try:
            cache = self._function_execution_info
            key = function_descriptor.function_id
            if cache.get(key) is info:
                cache[key] = new
        except Exception:
            pass
        return new
    get_execution_info._msmemscope = True
    cls.get_execution_info = get_execution_info
    return True


def attach(session):
    """Called once the launched process's session exists, when it runs under Ray."""
    describe(session)
    if in_ray_worker():
        install_call_hook()
    else:  # a driver: its identity once ray.init() has run
        _wrap_init(session)


def _wrap_init(session):
    ray = sys.modules.get("ray")
    init = getattr(ray, "init", None)
    if init is None or getattr(init, "_msmemscope", False):
        return

    @functools.wraps(init)
    def wrapped(*a, **k):
        out = init(*a, **k)
        try:
            describe(session)
        except Exception as e:
            log.warning("ray: %s", e)
        return out
    wrapped._msmemscope = True
    ray.init = wrapped


def prepare_worker_env():
    """Before a Ray worker's session is created: write its dump in-process. Ray ends workers
    with ``_exit`` and kills their child processes, which would take the spooling writer process
    and the rows still in its pipe with it; rows written in-process are in the kernel when each
    flush returns."""
    os.environ.setdefault("MSMEMSCOPE_WRITER", "inline")


__all__ = ["ray_runtime_env", "identity", "attach", "in_ray_worker", "describe"]
