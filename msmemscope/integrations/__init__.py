"""One-click framework hooks (SPEC §4.8): ``init_framework_hooks`` / ``cleanup_framework_hooks``.

``init_framework_hooks(framework, version, component, hook_type)`` wraps the key
functions of a framework so that, without editing the user's code,

* ``hook_type="decompose"``: blocks allocated inside them carry a component label
  (``PTA@activation@transformers@train_step``, ``PTA@ops@vllm@kv_cache@attn``) and
  some results are labelled after the call (vLLM's weights and KV cache), and
* ``hook_type="snapshot"``: SNAPSHOT rows ``"<label> Start"`` / ``"<label> End"``
  are written around each call.

What is patched comes from a table (``ENTRIES``, one ``Entry`` per patch point,
contributed by one module per framework: ``pytorch``, ``transformers``, ``vllm``,
``verl``); each entry has a version range. ``cleanup_framework_hooks()`` puts
every original object back (the attribute is the original object again, or
deleted when the method was inherited).

With ``--analysis=decompose`` the decompose entries of every supported framework
are applied by themselves: at session start for the modules already imported,
and for the others when they get imported (``msmemscope.after_import``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import re
import sys
import threading
from dataclasses import dataclass, field

from ..after_import import after_import

log = logging.getLogger("msmemscope")

HOOK_TYPES = ("decompose", "snapshot")


@dataclass(frozen=True)
class Entry:
    """One patch point.

    ``target`` is ``"module:Class.method"`` or ``"module:function"``; ``label`` the
    component chain (``("vllm", "kv_cache")``) used as the decompose component and
    as the snapshot name (joined by ``@``); ``hooks`` the hook types it serves;
    ``versions`` a half-open range ``(low, high)`` of the framework's version
    (``None`` = unbounded); ``before`` / ``after`` optional actions
    ``fn(labeler, args, kwargs[, result])`` run for ``decompose`` around the call;
    ``optional`` entries are skipped silently when the target does not exist."""
    framework: str
    component: str
    target: str
    label: tuple
    hooks: tuple = HOOK_TYPES
    versions: tuple = (None, None)
    before: object = None
    after: object = None
    optional: bool = False
    checked: str = ""   # the sources the names were read from

    @property
    def module(self):
        return self.target.split(":", 1)[0]

    @property
    def path(self):
        return self.target.split(":", 1)[1]


@dataclass
class Framework:
    name: str
    dist: str                       # distribution name for the installed version
    alias: object = None            # fn(version string) -> canonical version string
    entries: list = field(default_factory=list)


# ------------------------------------------------------------------ versions
def parse_version(v) -> tuple:
    """``"2.13.0+cpu"`` -> (2, 13, 0); ``"0.11.0rc1"`` -> (0, 11, 0)."""
    if v is None:
        return ()
    out = []
    for part in str(v).strip().lstrip("vV").split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


def in_range(ver: tuple, rng: tuple) -> bool:
    lo, hi = rng
    if lo is not None and ver < parse_version(lo):
        return False
    if hi is not None and ver >= parse_version(hi):
        return False
    return True


def installed_version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except Exception:
        return None


# ------------------------------------------------------------------ the table
_FRAMEWORKS: dict = {}


def frameworks() -> dict:
    if not _FRAMEWORKS:
        from . import pytorch, transformers, verl, vllm
        for mod in (pytorch, transformers, vllm, verl):
            for fw in mod.FRAMEWORKS:
                _FRAMEWORKS[fw.name] = fw
    return _FRAMEWORKS


def _fmt_range(rng) -> str:
    lo, hi = rng
    return f">={lo}" + (f",<{hi}" if hi else "") if lo else (f"<{hi}" if hi else "any")


def supported() -> list:
    """(framework, version range, component, hook types) for every combination."""
    rows = {}
    for fw in frameworks().values():
        for e in fw.entries:
            k = (fw.name, _fmt_range(e.versions), e.component)
            rows.setdefault(k, set()).update(e.hooks)
    return [(f, v, c, tuple(h for h in HOOK_TYPES if h in hs)) for (f, v, c), hs in rows.items()]


def supported_text() -> str:
    return "; ".join(f"{f} {v} {c} [{'|'.join(h)}]" for f, v, c, h in supported())


def _unsupported(framework, version, component, hook_type, why):
    raise ValueError(f"msmemscope: init_framework_hooks({framework!r}, {version!r}, {component!r}, "
                     f"{hook_type!r}): {why}; supported: {supported_text()}")


def select(framework, version, component, hook_type) -> list:
    fws = frameworks()
    if hook_type not in HOOK_TYPES:
        _unsupported(framework, version, component, hook_type, f"hook_type must be one of {', '.join(HOOK_TYPES)}")
    fw = fws.get(str(framework).lower() if framework is not None else None)
    if fw is None:
        _unsupported(framework, version, component, hook_type, "unknown framework")
    if version in (None, ""):
        version = installed_version(fw.dist)
        if version is None:
            _unsupported(framework, version, component, hook_type,
                         f"no version given and {fw.dist} is not installed")
    vs = fw.alias(str(version)) if fw.alias else str(version)
    ver = parse_version(vs)
    if not ver:
        _unsupported(framework, version, component, hook_type, "version not understood")
    comps = {e.component for e in fw.entries}
    if component not in (None, "", "all") and component not in comps:
        _unsupported(framework, version, component, hook_type, "unknown component")
    out = [e for e in fw.entries
           if (component in (None, "", "all") or e.component == component) and hook_type in e.hooks]
    if not out:
        _unsupported(framework, version, component, hook_type, "hook_type not offered for this component")
    out = [e for e in out if in_range(ver, e.versions)]
    if not out:
        _unsupported(framework, version, component, hook_type, f"version {version} not supported")
    return out


# ------------------------------------------------------------------ labeller / snapshots at call time
_own_labeler = None   # a Labeler we installed because the session had none


def labeler(create=True):
    """The session's labeller; one is installed when the session has none (decompose hooks
    without ``--analysis=decompose``: owners are written to the dump, no summary)."""
    global _own_labeler
    from ..capture import current
    s = current()
    if s is None:
        return None
    if s.labeler is None and create and s.active and not s.closed:
        s.use_dispatch_source("owner labels (framework hooks)")  # labels follow storages
        from ..capture.owners import Labeler
        lab = Labeler(s)
        s.labeler = lab
        lab.install()
        _own_labeler = lab
    return s.labeler


def _snapshot(name):
    from ..capture.snapshot import take_snapshot
    try:
        take_snapshot(name=name)
    except Exception as e:  # never break the program
        log.warning("snapshot %s failed: %s", name, e)


def make_wrapper(orig, entry: Entry, hook_type: str):
    """The patched function. Where Dynamo traces it (a patch point inside a compiled forward:
    transformers' ``Cache.update``) it is the original alone: ``torch.compiler.is_compiling()`` is a
    constant to Dynamo, so nothing of ours is traced (our calls broke the graph at every call, and
    a ``fullgraph=True`` compile raised in the program)."""
    import torch  # (the patch points are torch programs' functions)
    is_compiling = torch.compiler.is_compiling
    label = tuple(entry.label)
    name = "@".join(label)
    if hook_type == "snapshot":
        @functools.wraps(orig)
        def wrapper(*a, **k):
            if is_compiling():
                return orig(*a, **k)
            _snapshot(f"{name} Start")
            try:
                return orig(*a, **k)
            finally:
                _snapshot(f"{name} End")
    else:
        from ..capture import owners

        @functools.wraps(orig)
        def wrapper(*a, **k):
            if is_compiling():
                return orig(*a, **k)
            lab = labeler()
            if lab is None or not lab.s.active:
                return orig(*a, **k)
            if entry.before is not None:
                try:
                    entry.before(lab, a, k)
                except Exception as e:
                    log.debug("hook %s before: %s", entry.target, e)
            prev = owners.push_component(label)
            try:
                out = orig(*a, **k)
            finally:
                owners.pop_component(prev)
            if entry.after is not None:
                try:
                    entry.after(lab, a, k, out)
                except Exception as e:
                    log.debug("hook %s after: %s", entry.target, e)
            return out
    wrapper._msmemscope = True
    wrapper._msmemscope_hook = (entry.target, hook_type)
    return wrapper


# ------------------------------------------------------------------ patching
_lock = threading.RLock()
_applied: dict = {}     # (target, hook_type) -> (owner object, attr name, original raw, had_own_attr)
_pending: dict = {}     # module name -> [(entry, hook_type)] waiting for the import
_waiting: dict = {}     # module name -> its after_import finder (one per module not imported yet)


class TargetMissing(Exception):
    pass


def _resolve(entry: Entry, module):
    obj = module
    parts = entry.path.split(".")
    for p in parts[:-1]:
        obj = getattr(obj, p, None)
        if obj is None:
            raise TargetMissing(entry.target)
    name = parts[-1]
    if isinstance(obj, type):
        raw = None
        for klass in obj.__mro__:
            if name in klass.__dict__:
                raw = klass.__dict__[name]
                break
        if raw is None:
            raise TargetMissing(entry.target)
        return obj, name, raw, name in obj.__dict__
    if name not in getattr(obj, "__dict__", {}):
        raise TargetMissing(entry.target)
    return obj, name, obj.__dict__[name], True


def _patch(entry: Entry, hook_type: str, module) -> bool:
    key = (entry.target, hook_type)
    if key in _applied:
        return False
    owner, name, raw, own = _resolve(entry, module)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if kind else raw
    if not callable(func):
        raise TargetMissing(entry.target)
    if hook_type == "decompose" and getattr(func, "_msmemscope", False):
        # already labelled by msmemscope (the decompose labeller's own FSDP2 wrappers)
        return False
    w = make_wrapper(func, entry, hook_type)
    setattr(owner, name, kind(w) if kind else w)
    _applied[key] = (owner, name, raw, own)
    return True


def _unpatch(key):
    owner, name, raw, own = _applied.pop(key)
    if own:
        setattr(owner, name, raw)
    else:
        try:
            delattr(owner, name)
        except AttributeError:
            pass


def _wait_for(modname):
    if modname not in _waiting:
        finder = after_import(modname, functools.partial(_apply_pending, modname),
                              f"framework hooks of {modname} not applied in process {{pid}}")
        if finder is not None:  # None: imported meanwhile, and patched already
            _waiting[modname] = finder


def _stop_waiting():
    for finder in _waiting.values():
        finder.cancel()
    _waiting.clear()


def _apply_pending(modname, module):
    with _lock:
        todo = _pending.pop(modname, ())
        for entry, hook_type in todo:
            try:
                _patch(entry, hook_type, module)
            except TargetMissing:
                if not entry.optional:
                    log.warning("msmemscope: hook target %s not found (version mismatch?)", entry.target)
        _waiting.pop(modname, None)


def _apply(entries, hook_type, strict: bool, import_now: bool):
    """Patch the entries; modules not imported yet are patched when imported."""
    done = []
    with _lock:
        try:
            for e in entries:
                mod = sys.modules.get(e.module)
                if mod is None and import_now:
                    try:
                        mod = importlib.import_module(e.module)
                    except ImportError:
                        mod = None
                if mod is None:
                    lst = _pending.setdefault(e.module, [])
                    if (e, hook_type) not in lst:
                        lst.append((e, hook_type))
                    _wait_for(e.module)
                    continue
                try:
                    if _patch(e, hook_type, mod):
                        done.append((e.target, hook_type))
                except TargetMissing:
                    if e.optional:
                        continue
                    if strict:
                        raise ValueError(f"msmemscope: init_framework_hooks: {e.target} does not exist in the "
                                         f"installed {e.framework} (version mismatch?); checked against "
                                         f"{e.checked or 'the versions in docs/integrations.md'}") from None
                    log.warning("msmemscope: hook target %s not found (version mismatch?)", e.target)
        except Exception:
            for key in reversed(done):
                _unpatch(key)
            raise
    return done


def init_framework_hooks(framework, version=None, component=None, hook_type="decompose"):
    """Patch ``framework``'s key functions (see ``supported()``) for ``hook_type``
    (``"decompose"`` or ``"snapshot"``). ``version`` is the framework's version
    (the original's short forms such as ``"11.0"`` for vllm_ascend 0.11.0 are
    accepted); None = the installed one. Returns the targets patched now (targets
    in modules not imported yet are patched when they are imported)."""
    entries = select(framework, version, component, hook_type)
    done = _apply(entries, hook_type, strict=True, import_now=True)
    if hook_type == "decompose":
        labeler()   # start labelling now when a trace is running
    return [t for t, _ in done]


def cleanup_framework_hooks():
    """Remove every hook put in place by ``init_framework_hooks`` (or automatically):
    each patched attribute is the original object again."""
    global _own_labeler
    with _lock:
        for key in reversed(list(_applied)):
            _unpatch(key)
        _pending.clear()
        _stop_waiting()
        lab, _own_labeler = _own_labeler, None
    if lab is not None:
        from ..capture import current
        s = current()
        lab.remove()
        if s is not None and s.labeler is lab:
            s.flush()        # rows buffered so far get their owners
            s.labeler = None


def applied() -> list:
    """(target, hook_type) of every hook in place."""
    return list(_applied)


def auto_apply(session=None):
    """``--analysis=decompose``: the decompose hooks of every framework whose installed
    version is supported, now for the modules already imported, later for the others."""
    for fw in frameworks().values():
        ver = installed_version(fw.dist)
        if ver is None:
            continue
        v = parse_version(fw.alias(ver) if fw.alias else ver)
        entries = [e for e in fw.entries if "decompose" in e.hooks and in_range(v, e.versions)]
        if entries:
            try:
                _apply(entries, "decompose", strict=False, import_now=False)
            except Exception as e:
                log.warning("msmemscope: automatic %s hooks failed: %s", fw.name, e)


__all__ = ["init_framework_hooks", "cleanup_framework_hooks", "supported", "applied", "Entry"]


def on_session_start(session):
    """Called once by ``Session.start``: automatic decompose hooks, and the labeller for
    decompose hooks set up before tracing started."""
    if "decompose" in session.opts.analysis:
        auto_apply(session)
    if any(h == "decompose" for _, h in _applied) or any(
            h == "decompose" for lst in _pending.values() for _, h in lst):
        labeler()
