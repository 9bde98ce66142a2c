"""Our saved-tensor hooks (--analysis=decompose labels what autograd saves as ``activation``) meeting
what the program does with autograd: torch.func's transforms, which refuse saved-tensor hooks; the
program's own hooks; gradients of leaves under ``torch.autograd.grad``; a labeller that follows
another. Each program prints under the tool what it prints without it."""
from __future__ import annotations

import sys

import pytest

from conftest import FULL, check_invariants, dump_of, env_for_tests, full, read, run_cli, run_folders



def traced_as_untraced(tmp_path, program, source, cli=False):
    """Run ``program`` untraced, then traced (``cli``: under ``msmemscope --analysis=decompose``;
    else it traces itself into its argv[1]) on ``source``: both exit 0 and print the same. Returns
    (the untraced stdout, the dump's frame, its invariants checked)."""
    import subprocess
    prog = tmp_path / "prog.py"
    prog.write_text(program)
    env = dict(env_for_tests(), MSMEMSCOPE_SOURCE=source)
    plain = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    if cli:
        r = run_cli(["--analysis=decompose", "-q", "-o", str(tmp_path / "o"), str(prog)],
                    env={"MSMEMSCOPE_SOURCE": source})
    else:
        r = subprocess.run([sys.executable, str(prog), str(tmp_path / "o")], env=env, capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == plain.stdout
    (folder,) = run_folders(tmp_path / "o")
    df = read(dump_of(folder))
    check_invariants(df)
    return plain.stdout, df


FUNC_TRANSFORMS = r"""
import sys, torch
from torch import nn
from torch.func import functional_call, grad, vmap
import msmemscope
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 16), torch.randn(8, 1)
if len(sys.argv) > 1:
    msmemscope.config(analysis="decompose", output=sys.argv[1])
    msmemscope.start()


def loss_of(params, xi, yi):
    return ((functional_call(model, params, (xi,)) - yi) ** 2).mean()


for s in range(3):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()   # a plain training step: its saved tensors are activations
    opt.step()
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)   # refuses saved-tensor hooks
    print(s, [round(float(g.norm()), 6) for g in per_sample.values()])
    if len(sys.argv) > 1:
        msmemscope.step()
try:   # the program's own hooks still make torch.func refuse, as without the tool
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        grad(loss_of)(params, x[0], y[0])
except RuntimeError as e:
    print("refused:", "saved tensor hooks" in str(e))
if len(sys.argv) > 1:
    msmemscope.stop()
"""


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))  # (make test's time)
def test_torch_func_transforms_run_under_decompose_and_activations_are_still_labelled(tmp_path, source):
    """torch.func's grad/vjp/jacrev/hessian disable saved-tensor hooks for their region, which raises
    while any is pushed: with ours pushed, the program's ``vmap(grad(f))`` raised under
    --analysis=decompose. Ours step aside there (owners.push_saved_hooks): the program prints what
    it prints untraced, its plain steps' saved tensors are still activations, and its own hooks
    still make torch.func refuse."""
    out, df = traced_as_untraced(tmp_path, FUNC_TRANSFORMS, source)
    assert "refused: True" in out
    mal = df.filter((df["event"] == "MALLOC") & df["owner"].str.contains("@activation", literal=True))
    act = dict(mal.group_by("step").agg(mal["size"].sum()).iter_rows())
    # the first Linear's and Tanh's outputs (8 x 32 floats each) are saved by each plain step, in the
    # steps before the torch.func regions and after them
    assert sorted(act) == [1, 2, 3], act
    assert all(n >= 2 * 8 * 32 * 4 for n in act.values()), act


FUNC_IN_A_THREAD_ACROSS_A_GAP = r"""
import sys, threading, torch, msmemscope
from torch import nn
from torch.func import grad
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(8, 16)
TRACE = len(sys.argv) > 1
if TRACE:
    msmemscope.config(analysis="decompose", output=sys.argv[1])
    msmemscope.start()
out = []


w = nn.Linear(5, 5)


def worker():   # torch.func on another thread while the main one trains and stops/starts tracing
    for _ in range(20):
        w(torch.ones(5)).sum().backward()   # a forward of its own first: our hooks go on this thread
        out.append(round(float(grad(lambda a: a.sin().sum())(torch.ones(5)).sum()), 6))


t = threading.Thread(target=worker)
t.start()
for s in range(6):
    opt.zero_grad()
    m(x).square().mean().backward()
    opt.step()
    if TRACE:
        msmemscope.step()
        if s == 2:
            msmemscope.stop()
        if s == 3:
            msmemscope.start()
t.join()
print(sorted(set(out)), len(out), round(float(m(x).sum()), 5))
if TRACE:
    msmemscope.stop()
"""


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): make test runs torch.func on the main thread")
@pytest.mark.parametrize("source", ["native", "python"])
def test_torch_func_on_a_worker_thread_across_a_stop_start_gap(tmp_path, source):
    """The step-aside is per thread: a worker thread's torch.func regions while the main thread
    trains, steps, stops and starts tracing run as untraced, and the main thread's saved tensors are
    activations in the traced steps."""
    _, df = traced_as_untraced(tmp_path, FUNC_IN_A_THREAD_ACROSS_A_GAP, source)
    mal = df.filter(df["event"] == "MALLOC")
    assert mal.filter(mal["owner"].str.contains("@activation", literal=True)).height > 0


LEAF_GRADS = r"""
import os, torch
from torch import nn
from torch.func import jacrev, vjp
torch.manual_seed(0)
D = nn.Linear(4, 1)
x_hat = torch.randn(2, 4, requires_grad=True)                 # a gradient penalty: a leaf input
g, = torch.autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)
penalty = ((g.norm(dim=1) - 1) ** 2).mean()
penalty.backward()
print(round(float(penalty.detach()), 6), round(float(D.weight.grad.sum()), 6))


class Latents(nn.Module):                                     # a submodule called on a parameter
    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(3, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return (self.proj(self.latents) * x).sum()


m = Latents()
for _ in range(3):
    gs = torch.autograd.grad(m(torch.randn(3, 4)), list(m.parameters()))
    print([round(float(t.sum()), 4) for t in gs])
lin = nn.Linear(4, 2)
x = torch.randn(4)
print(round(float(jacrev(lin)(x).sum()), 6), round(float(vjp(lin, x)[1](torch.ones(2))[0].sum()), 6))
if os.environ.get("MSMEMSCOPE_OPTIONS"):     # traced: the hand-over to the dispatch-mode source (watch)
    import msmemscope.watcher as W
    W.watch(x_hat, name="x_hat", dump_nums=1)
print(round(float(jacrev(lin)(x).sum()), 6))
"""


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))
def test_gradients_of_leaves_and_torch_func_after_a_handover_run_as_without_the_tool(tmp_path, source):
    """Found by fuzzing feature combinations under --analysis=decompose:
    - a module called on a leaf that requires grad (a gradient penalty's input, a parameter, an
      input Jacobian) under ``torch.autograd.grad``: module attribution's multi-grad hook asked
      ``_will_engine_execute_node`` of the leaf's accumulator, which raises there, and the error
      reached the program;
    - after watch() hands the native session over to the dispatch-mode source, a second pair of
      our saved-tensor hooks was stacked on the first and torch.func raised again.
    The program prints what it prints untraced; the dump keeps its invariants."""
    _, df = traced_as_untraced(tmp_path, LEAF_GRADS, source, cli=True)
    # the backward of the modules called on leaves is still attributed where the pass reaches them
    mal = df.filter(df["event"] == "MALLOC")
    assert mal.filter(mal["attr"].str.contains('"phase":"backward"', literal=True)).height > 0


OWN_HOOKS_AT_START = r"""
import sys, torch, msmemscope
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.func import grad
TRACE = len(sys.argv) > 1
torch.manual_seed(0)
packs = [0]


def pack(t):
    packs[0] += 1
    return t


m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
x = torch.randn(2, 4)
if TRACE:
    msmemscope.config(analysis="decompose", output=sys.argv[1])
with saved_tensors_hooks(pack, lambda t: t):
    if TRACE:
        msmemscope.start()                    # inside the program's own hooks
    m(x).sum().backward()
    print("inside", packs[0] > 0)
n = packs[0]
m(x).sum().backward()                         # the program's hooks are gone here
print("after", packs[0] == n)
for _ in range(2):                            # a second framework-hooks install, and its cleanup
    msmemscope.init_framework_hooks("pytorch", component="fsdp1", hook_type="decompose")
    msmemscope.cleanup_framework_hooks()
torch._C._autograd._saved_tensors_hooks_disable(error_message="no hooks here")   # by name
print(torch._C._autograd._saved_tensors_hooks_get_disabled_error_message())
torch._C._autograd._saved_tensors_hooks_enable()
print(round(float(grad(lambda a: a.sin().sum())(torch.ones(3)).sum()), 6))
m(x).sum().backward()                         # ours are on again: its saved tensors are activations
if TRACE:
    msmemscope.step()
    msmemscope.stop()
"""


@pytest.mark.parametrize("source", full(["native"], ["native", "python"]))
def test_a_start_inside_the_programs_saved_tensor_hooks_leaves_them_the_programs(tmp_path, source):
    """Found by fuzzing: start() inside the program's own ``saved_tensors_hooks`` pushed ours above
    theirs, so their pack hook was never called and their context's exit popped ours, leaving theirs
    on for good (torch.func then raised); repeated framework-hooks installs stacked our hooks; the
    step-aside wrapper took torch's ``error_message`` keyword under another name. Ours now wait for
    the thread's next outermost forward outside the program's hooks."""
    out, df = traced_as_untraced(tmp_path, OWN_HOOKS_AT_START, source)
    assert "inside True" in out and "after True" in out
    mal = df.filter(df["event"] == "MALLOC")
    assert mal.filter(mal["owner"].str.contains("@activation", literal=True)).height > 0
