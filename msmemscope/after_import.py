"""Run something right after a module is imported, without importing it ourselves.

Importing a heavy module only to patch it would make every run pay for it (FSDP2's
``_fsdp_param_group`` pulls in ``torch._dynamo`` and sympy: ~1.3 s a process); the patch waits for
the program's own import instead. A leaf: the standard library only.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after the module ``name`` has been executed (its loader is
    wrapped), once; an import that fails leaves it waiting for the next; a failure of ``then`` is
    one stderr line starting with ``failed``, never the import's. ``cancel()`` takes the finder
    back if the module has not been imported yet."""

    def __init__(self, name, then, failed="process {pid}"):
        self.name, self.then, self.failed = name, then, failed

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        self.cancel()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            try:
                orig_exec(module)
            except BaseException:
                sys.meta_path.insert(0, self)  # the import failed: a later one runs ``then``
                raise
            self._run(module)
        spec.loader.exec_module = exec_module
        return spec

    def _run(self, module):
        try:
            self.then(module)
        except Exception as e:
            print(f"[msmemscope] {self.failed.format(pid=os.getpid())}: {e}", file=sys.stderr)

    def cancel(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def after_import(name, then, failed="process {pid}"):
    """``then(module)`` now if ``name`` is imported already, else right after its import; returns
    the waiting finder (``cancel()`` it when the patch is no longer wanted), or None."""
    finder = AfterImport(name, then, failed)
    module = sys.modules.get(name)
    if module is not None:
        finder._run(module)
        return None
    sys.meta_path.insert(0, finder)
    return finder
