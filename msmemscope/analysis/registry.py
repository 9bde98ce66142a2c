"""The offline analyses by name: ``analyze(name, **kw)``, ``list_analyzers()``, ``get_analyzer_config(name)``.

Each analyzer is named by the import path of its function, so an analysis module
is only imported when it is used (and one missing from a build says so).
"""
from __future__ import annotations

import copy
import importlib

# name -> (module, function, description, parameters with their defaults)
_ANALYZERS = {
    "inefficient": {
        "module": "msmemscope.analysis.inefficient",
        "function": "check_inefficient",
        "description": "Early allocation, late deallocation and temporary idleness of memory blocks "
                       "(op level; needs ACCESS and ATEN_START rows).",
        "parameters": {
            "input_path": None,
            "mem_size": 0,
            "inefficient_type": ["early_allocation", "late_deallocation", "temporary_idleness"],
            "idle_threshold": 3000,
            "write": True,
            "quiet": False,
        },
        "required": ["input_path"],
    },
    "leaks": {
        "module": "msmemscope.analysis.leaks",
        "function": "check_leaks",
        "description": "Memory leaks of a dump inside the ranges of an mstx mark.",
        "parameters": {"input_path": None, "mstx_info": None, "start_index": 0},
        "required": ["input_path", "mstx_info"],
    },
}


def list_analyzers() -> list[str]:
    """The names ``analyze`` accepts."""
    return sorted(_ANALYZERS)


def _entry(name: str) -> dict:
    try:
        return _ANALYZERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown analyzer {name!r} (available: {', '.join(list_analyzers())})") from None


def get_analyzer_config(name: str) -> dict:
    """Description, parameters with their defaults, required parameters, and the function behind it."""
    e = _entry(name)
    return {"name": name, "function": f"{e['module']}.{e['function']}", "description": e["description"],
            "parameters": copy.deepcopy(e["parameters"]), "required": list(e["required"])}


def analyze(name: str, **kw):
    """Run the offline analyzer ``name`` with its keyword parameters (see ``get_analyzer_config``)."""
    e = _entry(name)
    unknown = sorted(set(kw) - set(e["parameters"]))
    if unknown:
        raise TypeError(f"analyzer {name!r}: unknown parameter {unknown[0]!r} "
                        f"(parameters: {', '.join(e['parameters'])})")
    missing = [p for p in e["required"] if kw.get(p) is None]
    if missing:
        raise TypeError(f"analyzer {name!r}: missing parameter {missing[0]!r}")
    try:
        mod = importlib.import_module(e["module"])
    except ModuleNotFoundError as err:
        if err.name == e["module"]:
            raise ValueError(f"analyzer {name!r} is not available in this build") from None
        raise
    return getattr(mod, e["function"])(**kw)
