# Put on PYTHONPATH by the msmemscope launcher: every Python process the traced
# program starts runs this, and starts tracing once it imports torch.
import os as _os
import sys as _sys


def _chain_other_sitecustomize():
    """Run the sitecustomize this one shadows, if the environment has one."""
    import importlib.util
    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


def _install():
    if not _os.environ.get("MSMEMSCOPE_OPTIONS"):
        return
    try:
        import msmemscope._bootstrap.hook as hook
    except ImportError:
        root = _os.environ.get("MSMEMSCOPE_PKG_ROOT")
        if not root:
            return
        _sys.path.append(root)  # appended: this interpreter's own packages win
        import msmemscope._bootstrap.hook as hook
    hook.install()


try:
    _install()
except Exception as _e:  # the program must run even if the tracer cannot
    print(f"[msmemscope] tracing disabled in process {_os.getpid()}: {_e}", file=_sys.stderr)
try:
    _chain_other_sitecustomize()
except Exception:
    pass
