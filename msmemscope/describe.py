"""User labels for the memory decomposition (``--analysis=decompose``).

Three forms, as in the original tool::

    import msmemscope.describe as describe

    @describe.describer(owner="train1")      # every block allocated in the call
    def train1(): ...

    with describe.describer(owner="train2"):  # every block allocated in the block
        ...
    describe.describer(owner="train3").__enter__()
    ...
    describe.describer(owner="train3").__exit__()   # any instance closes the label

    describe.describer(t, owner="test4")      # the block behind a tensor

Labels are per thread; nested labels chain outermost first
(``PTA@activation@outer@inner``). A process may use at most 3 distinct labels in
the decorator and ``with`` forms (a tensor's label is not counted);
a label is at most 128 characters and does not start with ``@``. A violation
raises ``ValueError`` with a one-line message.
"""
from __future__ import annotations

import functools

import torch

from .capture import owners

__all__ = ["describer"]


def _labeler():
    from .capture import current
    s = current()
    return None if s is None else s.labeler


class describer:  # noqa: N801 - the original's name
    def __init__(self, tensor=None, owner=None):
        if isinstance(tensor, str) and owner is None:
            tensor, owner = None, tensor
        if owner is None:
            raise ValueError("msmemscope.describe: describer() needs owner=\"label\"")
        # the 3-label cap counts the decorator and ``with`` forms only (as the original's docs say)
        self.owner = owners.check_label(owner, count=tensor is None)
        self.tensor = None
        if tensor is not None:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"msmemscope.describe: describer(tensor, owner=...) takes a torch.Tensor, "
                                 f"not {type(tensor).__name__}")
            lab = _labeler()
            if lab is not None:
                lab.add_user_label(tensor, self.owner)

    def __enter__(self):
        owners.push_label(self.owner)
        return self

    def __exit__(self, *exc):
        owners.pop_label(self.owner)
        return False

    def __call__(self, fn):
        if not callable(fn):
            raise ValueError("msmemscope.describe: describer(owner=...) decorates a function")
        owner = self.owner

        @functools.wraps(fn)
        def wrapper(*a, **k):
            owners.push_label(owner)
            try:
                return fn(*a, **k)
            finally:
                owners.pop_label(owner)
        return wrapper
