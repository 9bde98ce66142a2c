"""vLLM patch points: framework ``vllm`` (GPU worker, V1 engine) and ``vllm_ascend``
(NPU worker), component ``worker``.

Decompose (model runner methods):

| label | method | what |
|---|---|---|
| ``vllm@weights`` | ``load_model`` | the model's parameters and buffers (also labelled after the call) |
| ``vllm@profile_run`` | ``profile_run`` | the dummy forward that sizes the KV cache |
| ``vllm@kv_cache`` | ``initialize_kv_cache`` | KV-cache set-up |
| ``vllm@kv_cache@attn`` / ``vllm@kv_cache@mamba`` | ``initialize_kv_cache_tensors`` | each layer's cache, by its ``kv_cache_spec`` (a ``Mamba*Spec`` is mamba state) |
| ``vllm@cuda_graph`` | ``capture_model`` | graph capture and its pool |
| ``vllm@activation`` | ``execute_model`` | a forward step's activations and temporaries |

Snapshot (worker methods): ``load_model``, ``determine_available_memory`` (the
profile run), ``initialize_from_config`` (KV-cache allocation),
``compile_or_warm_up_model`` (CUDA-graph capture), ``execute_model``.

vLLM cannot be installed here: the names were read from the sources listed in
``CHECKED`` and the machinery is tested against stand-in modules with the same
dotted names and signatures (tests/test_hooks.py).
"""
from __future__ import annotations

from . import Entry, Framework, parse_version

VLLM_CHECKED = ("vllm/v1/worker/gpu_worker.py (Worker) and gpu_model_runner.py (GPUModelRunner) as used by "
                "vllm_ascend v0.11.0..v0.18.0 and main (which subclass/call GPUModelRunner)")
ASCEND_CHECKED = "vllm-ascend git tags v0.10.0rc1, v0.11.0, v0.12.0rc1, v0.13.0, v0.18.0 and main 182b75e"


def _tensors(x, out):
    import torch
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out)
    return out


def _model_of(runner):
    m = getattr(runner, "model", None)
    if m is None and hasattr(runner, "get_model"):
        try:
            m = runner.get_model()
        except Exception:
            m = None
    return m


def _weights_after(lab, a, k, out):
    from ..capture.owners import WEIGHT
    m = _model_of(a[0])
    if m is None:
        return
    lab.mark(list(m.parameters()) + list(m.buffers()), WEIGHT, ("vllm", "weights"))


def _kv_tensors_after(lab, a, k, out):
    """``initialize_kv_cache_tensors(kv_cache_config, ...) -> {layer_name: tensor(s)}``."""
    from ..capture.owners import OPS
    cfg = a[1] if len(a) > 1 else k.get("kv_cache_config")
    kind_of = {}
    for g in getattr(cfg, "kv_cache_groups", None) or ():
        spec = getattr(g, "kv_cache_spec", None)
        kind = "mamba" if "mamba" in type(spec).__name__.lower() else "attn"
        for name in getattr(g, "layer_names", ()) or ():
            kind_of[name] = kind
    caches = out if isinstance(out, dict) else {}
    if not caches:   # older runners return nothing: the caches are on the runner
        caches = {i: t for i, t in enumerate(getattr(a[0], "kv_caches", None) or ())}
    by_kind = {"attn": [], "mamba": []}
    for name, t in caches.items():
        by_kind[kind_of.get(name, "attn")].extend(_tensors(t, []))
    for kind, ts in by_kind.items():
        if ts:
            lab.mark(ts, OPS, ("vllm", "kv_cache", kind))


RUNNER = (("load_model", ("vllm", "weights"), _weights_after, False),
          ("profile_run", ("vllm", "profile_run"), None, False),
          ("initialize_kv_cache", ("vllm", "kv_cache"), None, False),
          ("initialize_kv_cache_tensors", ("vllm", "kv_cache"), _kv_tensors_after, True),
          ("capture_model", ("vllm", "cuda_graph"), None, False),
          ("execute_model", ("vllm", "activation"), None, False))
WORKER = (("load_model", ("vllm", "load_model")),
          ("determine_available_memory", ("vllm", "profile_run")),
          ("initialize_from_config", ("vllm", "kv_cache")),
          ("compile_or_warm_up_model", ("vllm", "cuda_graph")),
          ("execute_model", ("vllm", "execute_model")))


def _entries(fw, worker_target, runner_target, versions, checked):
    out = [Entry(fw, "worker", f"{runner_target}.{m}", label, ("decompose",), versions, after=after,
                 optional=opt, checked=checked) for m, label, after, opt in RUNNER]
    out += [Entry(fw, "worker", f"{worker_target}.{m}", label, ("snapshot",), versions, checked=checked)
            for m, label in WORKER]
    return out


def ascend_version(v: str) -> str:
    """The original tool names vllm_ascend 0.11.0 "11.0": a leading component of 7 or more is
    the minor version of a 0.x release."""
    p = parse_version(v)
    if p and p[0] >= 7 and not str(v).lstrip("vV").startswith("0"):
        return "0." + str(v).lstrip("vV")
    return v


FRAMEWORKS = [
    Framework("vllm", "vllm", entries=_entries(
        "vllm", "vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
        ("0.8", "1.0"), VLLM_CHECKED)),
    Framework("vllm_ascend", "vllm_ascend", alias=ascend_version, entries=(
        _entries("vllm_ascend", "vllm_ascend.worker.worker_v1:NPUWorker",
                 "vllm_ascend.worker.model_runner_v1:NPUModelRunner", ("0.9", "0.13"), ASCEND_CHECKED)
        + _entries("vllm_ascend", "vllm_ascend.worker.worker:NPUWorker",
                   "vllm_ascend.worker.model_runner_v1:NPUModelRunner", ("0.13", "1.0"), ASCEND_CHECKED))),
]
