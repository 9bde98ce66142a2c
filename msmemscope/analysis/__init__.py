"""Analyses. Each consumes the event stream: online as row batches from the
session, offline as the columns a reader returns."""
from __future__ import annotations

import importlib
import logging

log = logging.getLogger("msmemscope")

# analysis name -> module providing ``make_sink(session)`` for the online run
ONLINE = {
    "leaks": "msmemscope.analysis.leaks",
    "oom": "msmemscope.analysis.oom",
    "decompose": "msmemscope.analysis.decompose",
    "inefficient": "msmemscope.analysis.inefficient",
}


def online_sinks(session) -> list:
    sinks = []
    for name in session.opts.analysis:
        mod_name = ONLINE.get(name)
        if mod_name is None:
            continue
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError:
            log.warning("analysis '%s' is not available in this build", name)
            continue
        sinks.append(mod.make_sink(session))
    if getattr(session, "device_source", None) is not None:  # segments are known: fragmentation comes free
        from . import fragmentation
        sinks.append(fragmentation.make_sink(session))
    return sinks
