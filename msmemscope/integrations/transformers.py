"""Hugging Face patch points: framework ``transformers`` (component ``trainer``) and
framework ``accelerate`` (component ``accelerator``).

Decompose: blocks allocated inside a training step, an evaluation, a checkpoint
save (and accelerate's ``prepare`` / ``backward`` / ``save_state``) carry the
component ``transformers@train_step``, ``transformers@evaluate``,
``transformers@save_checkpoint`` (``accelerate@prepare`` …), after the category:
``PTA@activation@transformers@train_step``, ``PTA@gradient@transformers@train_step``.
Snapshot: ``"transformers@train_step Start"`` / ``"… End"`` around each call.

KV cache (decompose only; component ``kv_cache``): what a cache's ``update`` allocates (the keys
and values ``generate`` and a forward with ``use_cache`` keep, grown by ``torch.cat`` each token in
a ``DynamicCache``, allocated once in a ``StaticCache``) is ``PTA@ops@transformers@kv_cache``. From
4.54 every cache updates through ``Cache.update`` (its layers'); before, each cache class has
its own ``update``.
"""
from __future__ import annotations

from . import Entry, Framework

TF_CHECKED = "transformers 4.46.3 (wheel source) and 5.24.0 (installed, run)"
ACC_CHECKED = "accelerate 0.34.2 (wheel source) and 1.15.0 (installed, run)"
TF = ("4.40", "6")
ACC = ("0.30", "2")


def _tf(method, label):
    return Entry("transformers", "trainer", f"transformers.trainer:Trainer.{method}", ("transformers", label),
                 versions=TF, checked=TF_CHECKED)


def _acc(method, label):
    return Entry("accelerate", "accelerator", f"accelerate.accelerator:Accelerator.{method}", ("accelerate", label),
                 versions=ACC, checked=ACC_CHECKED)


def _cache(cls, versions=TF, optional=False):
    return Entry("transformers", "kv_cache", f"transformers.cache_utils:{cls}.update", ("transformers", "kv_cache"),
                 hooks=("decompose",), versions=versions, optional=optional, checked=TF_CHECKED)


# Cache.update first: a class that inherits it (4.54 and later) then finds our wrapper and is not
# wrapped again
CACHES = [_cache("Cache")] + [_cache(c, ("4.40", "4.54"), optional=True) for c in (
    "DynamicCache", "StaticCache", "SlidingWindowCache", "HybridCache", "OffloadedCache", "QuantizedCache",
    "OffloadedStaticCache", "SinkCache")]

FRAMEWORKS = [
    Framework("transformers", "transformers", entries=[
        _tf("training_step", "train_step"),
        _tf("evaluate", "evaluate"),
        _tf("_save_checkpoint", "save_checkpoint"),
        *CACHES,
    ]),
    Framework("accelerate", "accelerate", entries=[
        _acc("prepare", "prepare"),
        _acc("backward", "backward"),
        _acc("save_state", "save_state"),
    ]),
]
