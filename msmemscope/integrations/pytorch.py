"""PyTorch FSDP patch points (framework ``pytorch``, components ``fsdp2``, ``fsdp1``).

FSDP2 (``fully_shard``): the labels are those of ``--analysis=decompose``
(docs/decompose.md): the labeller resolves sharded / unsharded parameters and
gradients from the FSDP parameter groups at every flush; the hooks add the
capture-time facts, i.e. the component of blocks made inside FSDP2's all-gather
and reduce-scatter and the unsharded gradients handed to the reduce-scatter
(the same wrappers the labeller installs itself under ``--analysis=decompose``;
a function already wrapped is left alone). Snapshots go around the parameter
group's forward/backward transitions.

FSDP1 (``FullyShardedDataParallel``): the flat parameter's local shard and its
all-gathered (padded unsharded) tensor are labelled ``fsdp1@sharded`` /
``fsdp1@unsharded``, the unsharded gradient handed to the reduce-scatter
``gradient@fsdp1@unsharded``, blocks made inside ``FlatParamHandle.unshard`` and
``_reduce_grad`` get ``fsdp1@all_gather`` / ``fsdp1@reduce_scatter``.
"""
from __future__ import annotations

from . import Entry, Framework

CHECKED = "torch 2.13.0 (installed, run on CPU/gloo)"
NEW = (("2.6", None), "torch.distributed.fsdp._fully_shard")
OLD = (("2.4", "2.6"), "torch.distributed._composable.fsdp")   # FSDP2's home before 2.6


def _mark(lab, tensors, category, comp):
    lab.mark([t for t in tensors if t is not None], category, comp)


def _reduce_before(lab, a, k):
    from ..capture.owners import GRADIENT
    grads = a[1] if len(a) > 1 else k.get("unsharded_grads", ())
    _mark(lab, list(grads or ()), GRADIENT, ("fsdp2", "unsharded"))


def _fsdp1_handle_shards(lab, handle):
    from ..capture.owners import WEIGHT
    fp = getattr(handle, "flat_param", None)
    if fp is None:
        return
    _mark(lab, [getattr(fp, "_local_shard", None)], WEIGHT, ("fsdp1", "sharded"))


def _fsdp1_unshard_after(lab, a, k, out):
    from ..capture.owners import WEIGHT
    handle = a[0]
    _fsdp1_handle_shards(lab, handle)
    fp = handle.flat_param
    padded = getattr(fp, "_full_param_padded", None)
    _mark(lab, [padded], WEIGHT, ("fsdp1", "unsharded"))


def _fsdp1_reduce_before(lab, a, k):
    from ..capture.owners import GRADIENT
    handle = a[1] if len(a) > 1 else k.get("handle")
    _fsdp1_handle_shards(lab, handle)
    _mark(lab, [getattr(handle.flat_param, "grad", None)], GRADIENT, ("fsdp1", "unsharded"))


def _fsdp2_entries():
    out = []
    for versions, pkg in (NEW, OLD):
        checked = CHECKED if pkg == NEW[1] else "torch 2.4/2.5 module layout (not run here)"
        pg = f"{pkg}._fsdp_param_group"
        out += [
            Entry("pytorch", "fsdp2", f"{pg}:foreach_all_gather", ("fsdp2", "all_gather"), ("decompose",),
                  versions, checked=checked),
            Entry("pytorch", "fsdp2", f"{pg}:foreach_reduce", ("fsdp2", "reduce_scatter"), ("decompose",),
                  versions, before=_reduce_before, checked=checked),
        ]
        for m in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            out.append(Entry("pytorch", "fsdp2", f"{pg}:FSDPParamGroup.{m}", ("fsdp2", m), ("snapshot",),
                             versions, checked=checked))
    return out


def _fsdp1_entries():
    v = ("2.1", None)
    fp, ru = "torch.distributed.fsdp._flat_param", "torch.distributed.fsdp._runtime_utils"
    return [
        Entry("pytorch", "fsdp1", f"{fp}:FlatParamHandle.unshard", ("fsdp1", "all_gather"), ("decompose",), v,
              after=_fsdp1_unshard_after, checked=CHECKED),
        Entry("pytorch", "fsdp1", f"{ru}:_reduce_grad", ("fsdp1", "reduce_scatter"), ("decompose",), v,
              before=_fsdp1_reduce_before, checked=CHECKED),
        Entry("pytorch", "fsdp1", "torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel.forward",
              ("fsdp1", "forward"), ("snapshot",), v, checked=CHECKED),
        Entry("pytorch", "fsdp1", f"{fp}:FlatParamHandle.unshard", ("fsdp1", "unshard"), ("snapshot",), v,
              checked=CHECKED),
        Entry("pytorch", "fsdp1", f"{ru}:_reduce_grad", ("fsdp1", "reduce_scatter"), ("snapshot",), v,
              checked=CHECKED),
    ]


FRAMEWORKS = [Framework("pytorch", "torch", entries=_fsdp2_entries() + _fsdp1_entries())]
