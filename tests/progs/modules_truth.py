"""A model trained a few steps with AdamW, plainly (to be traced by msmemscope) or under PyTorch's
MemTracker; prints one JSON line with what the test compares for one step (``--step``, 1-based):

- per module (MemTracker's fully qualified names): its parameters' and buffers' bytes, its
  gradients' bytes after backward and its optimizer state's bytes after ``step()`` (from the
  tensors themselves), and under MemTracker the step's forward / backward peak of each module
  (the ``Peak-Forward`` / ``Peak-Backward`` snapshots' ``Total``).

usage: modules_truth.py transformer|gpt2 plain|memtracker [--steps N] [--step K]"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def build(kind):
    torch.manual_seed(0)
    if kind == "transformer":
        from examples.transformer import GPT
        model = GPT(vocab=512, d=64, heads=2, layers=2, ctx=32)
        data = torch.randint(0, 512, (2, 33))
        x, y = data[:, :-1], data[:, 1:]

        def loss_fn():
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                         bos_token_id=0, eos_token_id=0, use_cache=False)
        model = GPT2LMHeadModel(cfg)
        model.train()
        data = torch.randint(0, 1000, (2, 32))

        def loss_fn():
            return model(input_ids=data, labels=data).loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, data, loss_fn


def fqn_modules(model):
    root = type(model).__name__
    return [(f"{root}.{n}" if n else root, m) for n, m in model.named_modules()]


def nbytes(ts):
    seen, n = set(), 0
    for t in ts:
        st = t.untyped_storage()
        if id(st) not in seen:  # tied weights (GPT-2's wte and lm_head) count once
            seen.add(id(st))
            n += st.nbytes()
    return n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["transformer", "gpt2"])
    p.add_argument("mode", choices=["plain", "memtracker"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step", type=int, default=2)
    a = p.parse_args()
    model, opt, data, loss_fn = build(a.kind)
    mods = fqn_modules(model)
    out = {"modules": {}}
    no_input_grad = set()  # modules whose inputs need no gradient: their backward ends with the pass

    def pre(m, args):
        if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in args):
            no_input_grad.add(id(m))
    handles = [m.register_forward_pre_hook(pre) for _, m in mods]
    mt = None
    if a.mode == "memtracker":
        from torch.distributed._tools.mem_tracker import MemTracker, _ModState
        mt = MemTracker()
        mt.track_external(model, opt, data)
        mt.__enter__()
    for i in range(a.steps):
        if mt is not None:
            mt.reset_mod_stats()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        if i + 1 == a.step:
            grads = {name: nbytes([q.grad for q in m.parameters() if q.grad is not None]) for name, m in mods}
        opt.step()
        if i + 1 == a.step:
            for name, m in mods:
                ps = list(m.parameters())
                ids = {id(q) for q in ps}
                state = [v for q, st in opt.state.items() if id(q) in ids for v in st.values()
                         if isinstance(v, torch.Tensor)]
                rec = {"parameters": nbytes(ps + list(m.buffers())), "gradients": grads[name],
                       "optimizer_state": nbytes(state), "inputs_need_grad": id(m) not in no_input_grad,
                       "has_params": bool(ps)}
                if mt is not None:
                    st = mt.memory_tracking.get(m)
                    if st is not None:
                        def total(state):
                            snaps = st.snapshots.get(state) or []
                            return max((sum(d["Total"] for d in s.values()) for s in snaps), default=None)
                        rec["memtracker"] = {"parameters": st.parameter_mem + st.buffer_mem,
                                             "forward_peak": total(_ModState.PEAK_FW),
                                             "backward_peak": total(_ModState.PEAK_BW)}
                out["modules"][name] = rec
        del loss
    for h in handles:
        h.remove()
    if mt is not None:
        mt.__exit__(None, None, None)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
