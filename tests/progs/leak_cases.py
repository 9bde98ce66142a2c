"""A real training loop (MLP + AdamW) with the leaks PyTorch users write and their look-alikes.

usage: leak_cases.py CASES TRUTH_JSON [STEPS]
CASES: comma list of hook, graph, cat, tiny (leaks), cache, warmup, window (look-alikes);
'none' for a clean run; 'infer' for an inference loop with no step and no optimizer.
Each case's allocating line carries a `# SITE:<case>` comment; each case runs inside an mstx range
named after it (its label when no call stack is recorded). The truth (bytes each leak retains per
step, from the sizes of the tensors the program keeps) goes to TRUTH_JSON.
msmemscope.step() is called once after the set-up and at the end of every iteration, so AdamW
creates its state in the first iteration, after the first step boundary.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import msmemscope

cases = set(sys.argv[1].split(","))
truth_path = sys.argv[2]
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 10
B, D, H, C = 32, 64, 256, 10
torch.manual_seed(0)
retained = {c: 0 for c in ("hook", "graph", "cat", "tiny")}   # bytes the program keeps, per leak
params = set()


def nbytes(t):
    return t.untyped_storage().nbytes()


def graph_storages(t):
    """The storages a kept output holds through its autograd graph: itself and every saved tensor."""
    found, seen, todo = {t.untyped_storage().data_ptr(): nbytes(t)}, set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                v = getattr(fn, name)
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in params:
                    found[v.untyped_storage().data_ptr()] = nbytes(v)
        todo.extend(f for f, _ in fn.next_functions)
    return found


if "infer" in cases:
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C)).eval()
    with torch.no_grad():
        for it in range(STEPS):
            out = model(torch.randn(B, D))
    json.dump({"steps": STEPS, "retained_per_step": {}}, open(truth_path, "w"))
    print("inference done", float(out.sum()) != 0.0)
    sys.exit(0)

if "gpt2" in cases:  # a clean run on a tiny GPT-2 (transformers, no weights downloaded)
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128,
                                       bos_token_id=0, eos_token_id=0, use_cache=False)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msmemscope.step()
    for it in range(STEPS):
        ids = torch.randint(0, 1000, (2, 32))
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()  # SITE:adamw_gpt2
        msmemscope.step()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    with open(truth_path, "w") as f:
        json.dump({"steps": STEPS, "retained_per_step": {},
                   "adamw_state_bytes": sum(nbytes(v) for v in state if v.numel() > 1),
                   "param_bytes": sum(nbytes(p) for p in model.parameters()),
                   "n_params": len(list(model.parameters()))}, f)
    print("trained", STEPS, "loss", round(loss.item(), 3))
    sys.exit(0)

model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C))
probe = nn.Linear(D, H)                      # a metrics head, never trained: its outputs carry a graph
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
params = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(probe.parameters())}
acts, side, hist, tiny, warm, window = {}, [], torch.zeros(0, H), [], [], []
graph_held = {}
cache = None


def hook(mod, inp, out):
    with msmemscope.RecordFunction("hook"):
        acts[len(acts)] = out.detach().clone()  # SITE:hook
        retained["hook"] += nbytes(acts[len(acts) - 1])


if "hook" in cases:
    model[0].register_forward_hook(hook)
msmemscope.step()                            # the set-up is a step of its own

for it in range(STEPS):
    x = torch.randn(B, D)  # SITE:data
    y = torch.randint(0, C, (B,))
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()  # SITE:adamw
    if "graph" in cases:
        with msmemscope.RecordFunction("graph"):
            aux = torch.tanh(probe(x))  # SITE:graph
            side.append(aux)
            before = sum(graph_held.values())
            graph_held.update(graph_storages(aux))
            retained["graph"] += sum(graph_held.values()) - before
    if "cat" in cases:
        with msmemscope.RecordFunction("cat"):
            feat = torch.ones(B, H)
            hist = torch.cat([hist, feat])  # SITE:cat
            retained["cat"] = nbytes(hist)
    if "tiny" in cases:
        with msmemscope.RecordFunction("tiny"):
            tiny.append(torch.zeros(6))  # SITE:tiny
            retained["tiny"] += nbytes(tiny[-1])
    if "cache" in cases and it == 2:
        with msmemscope.RecordFunction("cache"):
            cache = torch.empty(1024 * 1024)  # SITE:cache
    if "warmup" in cases and it < 3:
        with msmemscope.RecordFunction("warmup"):
            warm.append(torch.zeros(4096))  # SITE:warmup
    if "window" in cases:
        with msmemscope.RecordFunction("window"):
            window.append(torch.full((B, H), float(it)))  # SITE:window
            if len(window) > 4:
                window.pop(0)
    msmemscope.step()

state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
with open(truth_path, "w") as f:
    json.dump({"steps": STEPS, "retained_per_step": {c: v / STEPS for c, v in retained.items() if v},
               "adamw_state_bytes": sum(nbytes(v) for v in state if v.numel() > 1),
               "param_bytes": sum(nbytes(p) for p in model.parameters()),
               "n_params": len(list(model.parameters()))}, f)
print("trained", STEPS, "loss", round(loss.item(), 3))
