"""The leak rule's row loop and block tables in C++ (``_leakrule.cpp``), for the online sink and
the offline replay alike.

A small CPython extension with no torch in it: the offline commands never import torch, and
this lets them run the same C++ loop as a traced run. Compiled with the C++ compiler and
pybind11's headers (the ``pybind11`` package, else the copy in torch's include folder, found
without importing torch), once per source/Python version, into the cache folder of the native
source (``MSMEMSCOPE_NATIVE_DIR``, else ``~/.cache/msmemscope``). ``build()`` runs with the native
source's build (``python -m msmemscope.capture.native build``, ``make native``, and a traced run's
build on first use); ``load()`` only loads what is there. Not built, or
``MSMEMSCOPE_LEAK_ROWS=python``: the tracker's Python loop and dicts, with the same results.
The reader of text dumps parses the Attr texts our writer prints with it too (``attr_fields``)
and scans a CSV text before reading it (``csv_scan``); ``MSMEMSCOPE_ATTR_FIELDS=polars``:
polars' string expressions and the Python scan, with the same results.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig

log = logging.getLogger("msmemscope")
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "_leakrule.cpp")
FAILED = "build-failed.txt"
_loaded = None  # the module, False once a load found nothing (not asked again in this process)


def _key() -> str:
    with open(SOURCE, "rb") as f:
        h = hashlib.sha256(f.read())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def module_name() -> str:
    return f"msmemscope_leakrule_{_key()}"


def cache_root() -> str:
    """The folder of the built modules, this one's and the native source's."""
    return os.environ.get("MSMEMSCOPE_NATIVE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "msmemscope")


def so_path() -> str:
    return os.path.join(cache_root(), module_name(), module_name() + ".so")


def _pybind11_include() -> str | None:
    try:
        import pybind11
        return pybind11.get_include()
    except ImportError:
        pass
    spec = importlib.util.find_spec("torch")  # the folder only: torch is not imported
    if spec is None or not spec.origin:
        return None
    inc = os.path.join(os.path.dirname(spec.origin), "include")
    return inc if os.path.isfile(os.path.join(inc, "pybind11", "pybind11.h")) else None


def build(timeout: float = 600.0) -> str | None:
    """Compile the module if it is not there; returns why it could not be, or None once it is."""
    path = so_path()
    if os.path.exists(path):
        return None
    folder = os.path.dirname(path)
    if os.path.exists(os.path.join(folder, FAILED)):
        return f"building it failed before (see {os.path.join(folder, FAILED)})"
    cxx = (os.environ.get("CXX") or "c++").split()
    if not cxx or not shutil.which(cxx[0]):
        return "no C++ compiler on PATH"
    inc = _pybind11_include()
    if inc is None:
        return "no pybind11 headers (pip install pybind11)"
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [*cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", f"-DLEAKRULE_NAME={module_name()}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{inc}", SOURCE, "-o", tmp]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the compiler did not finish: {e}"
    if r.returncode != 0:
        with open(os.path.join(folder, FAILED), "w") as f:
            f.write(" ".join(cmd) + "\n" + r.stderr[-20000:])
        return f"the compiler failed (see {os.path.join(folder, FAILED)})"
    os.replace(tmp, path)  # whole or not at all: another process may be loading it
    return None


def load():
    """The built module for the leak rule, or None (nothing is compiled here;
    ``MSMEMSCOPE_LEAK_ROWS=python``: None)."""
    if os.environ.get("MSMEMSCOPE_LEAK_ROWS", "").strip().lower() == "python":
        return None
    return load_module()


def load_module():
    """The built module, whatever uses it (the leak rule, the reader's Attr fields), or None."""
    global _loaded
    if _loaded is None:
        _loaded = False
        path = so_path()
        if os.path.exists(path):
            try:
                spec = importlib.util.spec_from_file_location(module_name(), path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                _loaded = mod
            except Exception as e:  # a broken file: the Python loop
                log.warning("the leak rule's C++ module did not load (%s): the Python loop is used", e)
    return _loaded or None
