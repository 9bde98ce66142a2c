"""Hugging Face generate on a GPT-2 built from a config (no download): the KV cache it keeps.
argv[1]: ``train`` first takes one training step with AdamW (its step is a step boundary), so
that generation runs in step 2; ``compiled``: the model's forward compiled whole
(``fullgraph=True``, the eager backend: Dynamo only) with a static cache, as transformers documents for fast
generation. Prints the tokens and, as JSON, the cache's bytes (from its tensors), positions, and
bytes per position of one tensor, and for ``compiled`` Dynamo's graph breaks and graphs."""
import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256)
model = GPT2LMHeadModel(cfg)
ids = torch.randint(1, 1000, (4, 16), generator=torch.Generator().manual_seed(1))
if sys.argv[1:] == ["train"]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
model.eval()
compiled = sys.argv[1:] == ["compiled"]
extra = {}
if compiled:
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    extra = {"cache_implementation": "static"}
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         **extra)
cache = out.past_key_values
layers = getattr(cache, "layers", None)
tensors = ([t for layer in layers for t in (layer.keys, layer.values)] if layers is not None
           else list(cache.key_cache) + list(cache.value_cache))
print("TOKENS", out.sequences[:, -4:].tolist())
if compiled:
    from torch._dynamo.utils import counters
    print("DYNAMO", sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
print(json.dumps({"cache_bytes": sum(t.nbytes for t in tensors), "tensors": len(tensors),
                  "positions": tensors[0].shape[-2], "per_position": tensors[0].nbytes // tensors[0].shape[-2]}))
