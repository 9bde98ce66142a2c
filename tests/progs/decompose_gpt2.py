"""A tiny GPT-2 (transformers, no weights downloaded) trained a few steps with AdamW.

Prints one JSON line with the true sizes (parameters, buffers, optimizer state) for the test to compare."""
import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.manual_seed(0)
    # use_cache=False as in training: a KV cache returned with the output keeps its tensors past backward
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (2, 32))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    print(json.dumps({
        "param_bytes": sum(p.untyped_storage().nbytes() for p in params),
        "param_numel_bytes": sum(p.numel() * p.element_size() for p in params),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "n_params": len(params),
        "state_bytes": sum(v.numel() * v.element_size() for v in state),
    }))


if __name__ == "__main__":
    main()
