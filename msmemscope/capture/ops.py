"""The per-op source: a TorchDispatchMode that sees every aten op (forward and
backward) and, through tensor storages, every memory block the ops produce.

Hot path rules: one tuple appended per row, no formatting, no dict per op,
schema facts cached per operator overload.
"""
from __future__ import annotations

import threading
from time import time_ns

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..events import Access, Event, Op

Tensor = torch.Tensor
_get_ident = threading.get_ident
OP_LAUNCH, ATEN_START, ATEN_END = Event.OP_LAUNCH, Op.START, Op.END
ACCESS, READ, WRITE = Event.ACCESS, Access.READ, Access.WRITE

# func -> (name, written positional indices, written kwarg names, is_view, outputs are inputs)
_INFO: dict = {}
# in-place ops that may give ``self`` a new or resized storage: their outputs are always looked at
_RESTORAGE = ("resize_", "resize_as_", "set_", "_resize_output_", "resize_as_sparse_")


def op_info(func):
    info = _INFO.get(func)
    if info is None:
        schema = func._schema
        writes, kw_writes = set(), set()
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                (kw_writes if a.kwarg_only else writes).add(i)
                kw_writes.add(a.name)
        rets = schema.returns
        is_view = bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets) and not writes
        # a view or a plain in-place op returns tensors whose storages were inputs (already seen):
        # its outputs need no look. ``out=`` variants do (an empty ``out`` gets its memory inside).
        base = schema.name.split("::")[-1]
        in_place = (base.endswith("_") and base not in _RESTORAGE and 0 in writes
                    and all(r.alias_info is not None for r in rets))
        info = _INFO[func] = (f"torch._ops.{func}", frozenset(writes), frozenset(kw_writes), is_view,
                              is_view or in_place)
    return info


class OpTracer(TorchDispatchMode):
    """One instance per traced thread (the dispatch-mode stack is thread local)."""

    @classmethod
    def _should_skip_dynamo(cls):
        # No per-call torch._disable_dynamo wrapper (~1 us an op, a fifth of the cost of an empty
        # mode): Dynamo is kept out of this frame and everything it calls by a flag on the code
        # object instead (keep_dynamo_out).
        return False

    @classmethod
    def ignore_compile_internals(cls):
        # torch.compile keeps compiling with this mode on the stack (it skips every frame under a
        # mode that says False: the program would run eagerly, and under inductor compute other
        # numbers); the mode is off while Dynamo traces and on again while the compiled code runs
        return True

    def __init__(self, session, source):
        super().__init__()
        self.s = session      # flags, buffer, the op observer (watch)
        self.src = source     # the DispatchSource: the block registry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        s = self.s
        if kwargs is None:
            kwargs = {}
        if not s.active:
            return func(*args, **kwargs)
        name, writes, kw_writes, is_view, outs_seen = _INFO.get(func) or op_info(func)
        tls = s.tls
        prev = getattr(tls, "op", None)
        tls.op = name
        tid = _get_ident()
        buf = s.buf
        src = self.src
        launch = s.emit_launch
        stack = s.py_stack() if s.py_depth else None
        tls.stack = stack  # the op's blocks share its stack: taken once per op
        if launch:
            buf.append((OP_LAUNCH, ATEN_START, name, time_ns(), tid, s.op_device, None, None, stack, None))
            src.op_started(tid, name)
        access = s.emit_access and not is_view
        block_of = src.block_of
        live = src.live
        touched = [] if access else None
        # inputs: blocks first seen here existed before the op (made outside dispatch or before tracing)
        if not access:
            # the common case, kept lean: only register what was never seen
            for a in args:
                if isinstance(a, Tensor):
                    try:
                        if live.get(id(a.untyped_storage())) is not None:
                            continue
                    except Exception:  # no plain storage (wrapper subclass, sparse): block_of decides
                        pass
                    block_of(a, name)
                elif type(a) in (list, tuple):
                    for x in a:
                        if isinstance(x, Tensor):
                            block_of(x, name)
            if kwargs:
                for a in kwargs.values():
                    if isinstance(a, Tensor):
                        block_of(a, name)
        else:
            for i, a in enumerate(args):
                if isinstance(a, Tensor):
                    b = block_of(a, name)
                    if b is not None:
                        touched.append((b, a, WRITE if i in writes else READ))
                elif type(a) in (list, tuple):
                    w = WRITE if i in writes else READ
                    for x in a:
                        if isinstance(x, Tensor):
                            b = block_of(x, name)
                            if b is not None:
                                touched.append((b, x, w))
            if kwargs:
                for k, a in kwargs.items():
                    if isinstance(a, Tensor):
                        b = block_of(a, name)
                        if b is not None:
                            touched.append((b, a, WRITE if k in kw_writes else READ))
        if s.watch_active:
            s.op_observer.before(func, name, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            s.op_failed(name, exc)
            if launch and src.op_ended(tid):
                buf.append((OP_LAUNCH, ATEN_END, name, time_ns(), tid, s.op_device, None, None, None, None))
            tls.op = prev
            tls.stack = None
            raise
        new_block = src.new_block
        if outs_seen and not s.watch_active:
            outs = ()
        elif type(out) is Tensor or isinstance(out, Tensor):
            outs = (out,)
        elif type(out) in (tuple, list):
            outs = out
        else:
            outs = ()
        for o in outs:
            if isinstance(o, Tensor):
                try:
                    st = o.untyped_storage()
                except Exception:
                    continue
                b = live.get(id(st))
                if b is None:
                    b = new_block(st, name, False)
                    if b is None and type(o) is not Tensor:  # DTensor: its local tensor
                        b = src.inner_block(o, name, False)
                    if access and b is not None:
                        touched.append((b, o, WRITE))
            elif type(o) in (list, tuple):  # ops returning Tensor[] (split, unbind, foreach)
                for x in o:
                    if isinstance(x, Tensor):
                        try:
                            st = x.untyped_storage()
                        except Exception:
                            continue
                        b = live.get(id(st))
                        if b is None:
                            b = new_block(st, name, False)
                            if b is None and type(x) is not Tensor:
                                b = src.inner_block(x, name, False)
                            if access and b is not None:
                                touched.append((b, x, WRITE))
        if touched:
            src.emit_accesses(name, tid, touched)
        if s.watch_active:
            s.op_observer.after(func, name, args, kwargs, out, touched)
        if launch and src.op_ended(tid):
            buf.append((OP_LAUNCH, ATEN_END, name, time_ns(), tid, s.op_device, None, None, None, None))
        tls.op = prev
        tls.stack = None
        if len(buf) >= s.flush_rows:
            s.flush()
        return out


def keep_dynamo_out(code) -> bool:
    """Tell Dynamo never to compile ``code`` nor any frame it calls. The flag lives in torch's C
    module, so setting it imports nothing. Without it a torch.compile'd function that runs under
    tracing would have Dynamo try to compile the tracer itself (inside __torch_dispatch__ the mode
    is off the stack, so Dynamo's own "a dispatch mode is active" skip does not apply), and our
    flush when the native source calls it from an op inside compiled code (session.py)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
        return True
    except Exception:
        return False


if not keep_dynamo_out(OpTracer.__torch_dispatch__.__code__):
    # a torch without the flag: fall back to the wrapper
    OpTracer._should_skip_dynamo = classmethod(lambda cls: True)
    OpTracer.__torch_dispatch__ = torch._disable_dynamo(OpTracer.__dict__["__torch_dispatch__"], recursive=True)
