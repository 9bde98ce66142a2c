"""Every batch the native source drains with its marshal bytes (the hand-off's pieces): the bytes
must load as exactly the row tuples it appended (same values, same types, dict attrs in the same
key order). Runs default events, access events, Python stacks, frees outside the traced window
(FREE rows with a dict attr) and blocks made before the window read by a traced op (MALLOC rows
with an origin), then prints how many rows were checked and how many frames went as pieces.
The rows and their attrs come untracked by the garbage collector (nothing in them can be in a
cycle; a tracked row is walked by every collection while it waits in the buffer)."""
import gc
import json
import marshal
import sys

import torch

import msmemscope
from msmemscope import capture
from msmemscope.io import spool

out, opts = sys.argv[1], json.loads(sys.argv[2])
opts.setdefault("analysis", "leaks")
if "leaks" not in opts["analysis"]:
    opts["analysis"] = "leaks," + opts["analysis"]
msmemscope.config(output=out, collect_mode="immediate", **opts)
s = capture.current()
assert s.native is not None, s.config
real = s.native.m
checked = [0, 0]


def norm(x):
    if type(x) is tuple:
        return ("tuple", tuple(norm(v) for v in x))
    if type(x) is dict:
        return ("dict", tuple((k, norm(v)) for k, v in x.items()))
    return (type(x).__name__, x)


class Checked:
    def __getattr__(self, k):
        return getattr(real, k)

    def drain(self, out, names, want_bytes=False, labels=None):
        start = len(out)
        got = real.drain(out, names, want_bytes, labels)
        if want_bytes and got[2] is not None:
            made = out[start:]
            assert len(made) == got[0]
            loaded = marshal.loads(got[2])
            assert [norm(r) for r in loaded] == [norm(r) for r in made]
            checked[0] += len(made)
        tracked = [r for r in out[start:] if gc.is_tracked(r) or gc.is_tracked(r[7])
                   or (type(r[7]) is tuple and any(gc.is_tracked(x) for x in r[7]))]
        assert not tracked, tracked[:3]
        return got


s.native.m = Checked()
real_write = spool.SpoolWriter.write


def write(self, rows, first, pid, c_syms=None, pieces=None):
    if pieces is not None:
        checked[1] += 1
        assert [norm(r) for r in spool.join_pieces(marshal.loads(marshal.dumps(pieces)))] == [norm(r) for r in rows]
    return real_write(self, rows, first, pid, c_syms, pieces)


spool.SpoolWriter.write = write
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
kept = []
for step in range(4):
    msmemscope.mark(f"step {step}")
    model(torch.randn(16, 32)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    kept.append(torch.ones(256 * (step + 1)))
msmemscope.stop()
before = torch.ones(1000)       # made outside the window
del kept[0]                     # freed outside the window: its FREE row is flagged (a dict attr)
msmemscope.start()
y = before * 2                  # with access events, first seen by a traced op: MALLOC with an origin
msmemscope.step()
[sink] = [x for x in s.sinks if type(x).__name__ == "LeakSink"]
print(checked[0], checked[1], sink.t.fast_rows is not None and type(sink.t.pending).__name__ == "KeyTable")
