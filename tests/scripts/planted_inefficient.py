"""Planted inefficient blocks (tests/test_inefficient.py). Distinctive sizes in float32 elements:
early allocation 3001, late deallocation 3002, temporary idleness 3003; each size also has
blocks of the same size that are used promptly (they must not be flagged).
Pass the number of idle ops as argv[1] (default 300)."""
import sys

import torch

IDLE_OPS = int(sys.argv[1]) if len(sys.argv) > 1 else 300
E, L, I = 3001, 3002, 3003


def prompt(n):
    # allocated, used at once by the next op, freed right after its last use
    t = torch.empty(n)
    t.fill_(1.0)
    s = t.sum()
    del t
    return s


# --- early allocation: buffer made, then other tensors freed by several ops, then first used
prompt(E)
others = [torch.ones(64) * i for i in range(4)]
buf = torch.empty(E)
for i in range(4):
    x = others.pop()
    y = x + 1          # op
    del x, y           # frees outside any op
buf.fill_(2.0)
r = buf.sum()
del buf
prompt(E)

# --- late deallocation: kept after its last use while other tensors are allocated
prompt(L)
keep = torch.empty(L)
keep.fill_(3.0)
total = keep.sum()                              # last use
made = [torch.full((32,), float(i)) for i in range(4)]   # allocations while `keep` sits unused
del keep
del made
prompt(L)

# --- temporary idleness: used, left alone for IDLE_OPS ops, used again
prompt(I)
idle = torch.empty(I)
idle.fill_(4.0)
z = torch.zeros(8)
for _ in range(IDLE_OPS):
    z.add_(1.0)        # in place: no allocation, no free
idle.add_(1.0)
del idle
prompt(I)
print("done", float(r), float(total), float(z.sum()))
