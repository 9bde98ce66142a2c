"""Module attribution: which ``nn.Module`` was running, forward or backward, when a block was made.

Global module hooks (``register_module_forward_pre_hook`` / ``register_module_forward_hook``)
and backward hooks on the autograd nodes of each module call's inputs and outputs (multi-grad
hooks where one is a leaf) keep, per thread, the stack of modules running now; each change of
its top is one *mark* ``(ts, state)`` on that thread (``state``: ``(path, phase)`` or None), on
the clock and thread ids of the rows
(``time.time_ns``, ``threading.get_ident``: the native source's records use the same).
Nothing is done per allocation while the program runs: at each flush, ``attribute(buf)`` gives
every MALLOC row in the buffer the state of its thread at its timestamp (a bisect in that
thread's marks) by appending ``module`` and ``phase`` to its Attr tuple (``events.MALLOC_ATTR_M``).
So both sources get the same attribution.

Backward of a module, as PyTorch's ``ModTracker`` detects it: it begins when the gradient of
any of its forward outputs is computed (a multi-grad hook in ``any`` mode on the outputs that
require grad), and ends when the gradients of all its inputs that require grad are (a
multi-grad hook on those inputs); a module whose inputs need no gradient (the first layer, an
embedding of token ids) ends its backward with the backward pass (an autograd engine
callback). The backward hooks run on the thread that runs that part of the graph, so the marks
land on the thread whose rows they attribute.

Names: the path of a module is its root's class name followed by the name
``root.named_modules()`` gives it (``GPT.blocks.3.qkv``), the fully qualified name PyTorch's
``MemTracker`` prints; a root is a module whose forward runs when no forward is running on the
thread. A module met inside a forward that no known root names gets its parent's path and its
class name.
"""
from __future__ import annotations

import bisect
import functools
import os
import sys
import threading
import weakref
from time import time_ns

import torch

from ..events import A_ALLOC_ID, A_OWNER, ATTR, EVENT, EVENT_TYPE, TID, TS, Event
from .eager import eager_or_skipped

FORWARD, BACKWARD = "forward", "backward"
OWNED_CATEGORIES = ("weight", "gradient", "optimizer_state")  # owned_blocks' categories
ENV = "MSMEMSCOPE_MODULES"   # 1: attribute in any run; 0: never (default: with --analysis=decompose)
_BAD = str.maketrans({c: "_" for c in ',"{}\\\n\r\t '})


def wanted(opts) -> bool:
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("1", "on", "yes", "true"):
        return True
    if v in ("0", "off", "no", "false"):
        return False
    return "decompose" in opts.analysis


def note_ran_here(objs, thread_of, obj, me) -> bool:
    """``obj`` (a root module or an optimizer) ran on thread ``me``: into the weak set ``objs`` and
    ``thread_of`` (weak keys) where it is not there yet; whether either changed. At every forward
    and optimizer step: a weak set's ``add`` and a weak dict's assignment make a weak reference
    with a callback each time, so they are asked only where something changed."""
    changed = False
    if obj not in objs:
        objs.add(obj)
        changed = True
    if thread_of.get(obj) != me:
        thread_of[obj] = me
        changed = True
    return changed


def all_ran_here(thread_of, objs, me) -> bool:
    """Whether thread ``me`` ran each of ``objs`` last (or no thread is known for it); a walk plan
    kept for this thread holds only where it does (None among ``objs``: one is gone)."""
    get = thread_of.get
    return all(o is not None and get(o, me) == me for o in objs)


def ran_here(thread_of, objs) -> list:
    return by_thread(thread_of, objs)[0]


def by_thread(thread_of, objs) -> tuple:
    """Of these root modules or optimizers, those this thread ran last, that no thread is known for
    in ``thread_of``, or whose thread has ended: the only ones whose gradients a walk from this
    thread reads. Another live thread's backward sets them without the GIL, and ``p.grad = None``
    releases the GIL while the old gradient is destroyed, so a read from here could meet a tensor
    being freed (two threads training two models crashed so). A thread that ended sets nothing:
    without it, the models of worker threads that had ended by the last flush (the session's end)
    were walked by no thread, and their weights were temporaries "(outside modules)".

    ``by_thread``: (those, the others: run last by another thread still alive). Of the others a walk
    from here reads only the parameters and buffers (``weights_of``): the modules hold them, and no
    thread changes which they are without the GIL. Without that, the models of worker threads
    that outlive every step end and flush of another thread (a serving loop that steps on the
    main thread) were weights to nobody until those threads ended."""
    me = _get_ident()
    get = thread_of.get
    out, others, alive = [], [], None
    for o in objs:
        t = get(o, me)
        if t != me:
            if alive is None:
                # every thread with a Python thread state now. Only the ids are kept: the frames
                # (this one among them) would make a cycle that keeps every thread's locals, their
                # tensors too, until the collector frees them wherever it next runs
                alive = set(sys._current_frames())
            if t in alive:
                others.append(o)
                continue
        out.append(o)
    return out, others


def weights_of(modules):
    """(module, tensor) for each parameter and buffer the modules register themselves (no
    gradient: see ``by_thread``)."""
    for sub in modules:
        for p in list(sub._parameters.values()):
            if p is not None:
                yield sub, p
        for bf in list(sub._buffers.values()):
            if bf is not None:
                yield sub, bf


def all_threads(by_thread: dict) -> dict:
    """One answer from each thread's last walk (``by_thread``: thread id -> dict), this thread's
    winning where two say something of the same block; the only walk itself where there is one."""
    if len(by_thread) == 1:
        return next(iter(by_thread.values()))
    me = _get_ident()
    out = {}
    for tid, w in by_thread.items():
        if tid != me:
            out.update(w)
    out.update(by_thread.get(me, {}))
    return out


def _grad_tensors(obj, out, depth=0):
    """Tensors that require grad in a module's inputs or outputs (tuples, lists, dicts, a few levels)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif depth < 3:
        if isinstance(obj, (tuple, list)):
            for x in obj:
                _grad_tensors(x, out, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                _grad_tensors(x, out, depth + 1)
    return out


_graph_task_id = torch._C._current_graph_task_id
_get_ident = threading.get_ident
_grad_enabled = torch.is_grad_enabled
_will_run = torch._C._will_engine_execute_node


def eager_only(hook):
    """A global module hook that does nothing where Dynamo traces it (``torch.compile``: the
    calls of submodules inside a compiled forward). Dynamo cannot trace our C++ hooks or the
    native source's calls: each module call there was a graph break, so the program under the
    tool was no longer the compiled one (a 3-block MLP: 7 breaks, 2 of its 9 calls captured),
    and neither was its memory. ``torch.compiler.is_compiling()`` is a constant to Dynamo, so
    this hook leaves nothing in the graph; a compiled region is attributed as a whole to the
    innermost module whose hooks ran outside it."""
    is_compiling = torch.compiler.is_compiling

    def eager_hook(*args):
        if is_compiling():
            return None
        return hook(*args)
    return eager_hook


# torch.compile(module) warns at each call of the compiled module while any global module hook is
# on: ours, which fire for it and its ``_orig_mod`` and name both as the model itself. That warning
# is not the program's to see when it registered no global hook of its own.
_COMPILE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
_hiding = set()  # the holders of our global module hooks that hide it now


def hide_compile_warning(holder, hide: bool) -> None:
    """Hide torch.compile's warning of global module hooks while ``holder``'s are on (``hide``),
    unless the program had global module hooks of its own when the first of ours came."""
    import warnings
    if hide:
        if not _hiding:
            from torch.nn.modules import module as nn_module
            if getattr(nn_module, "_has_any_global_hook", lambda: False)():
                return  # the program's own: the warning is for it
            warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        _hiding.add(holder)
    elif holder in _hiding:
        _hiding.discard(holder)
        if not _hiding:
            warnings.filters[:] = [f for f in warnings.filters
                                   if not (f[0] == "ignore" and getattr(f[1], "pattern", None) == _COMPILE_WARNING)]
            getattr(warnings, "_filters_mutated", lambda: None)()  # the caches of the old filters


# ``model.compile()`` (in place) compiles the module's whole call, the global hooks' calls included:
# ours run there as no-ops (eager_only), so none ran for the model, its activations went to
# "(outside modules)" and the backend's graph was met as a root of its own. While our hooks are on,
# an in-place compiled call is wrapped so that they run eagerly around it, as torch runs them around
# ``torch.compile(model)``'s OptimizedModule.
_around: dict = {}   # holder -> (pre, post): our global hooks, called around an in-place compiled call
_compile_of_torch = None  # nn.Module.compile while ours stands in for it


class EagerAround:
    """A module's in-place compiled call with our global hooks around it, eagerly: torch's own call
    where Dynamo traces it or no hook of ours is on. Holds the module weakly (the module holds it)."""
    __slots__ = ("module", "compiled", "__weakref__")

    def __init__(self, module, compiled):
        self.module, self.compiled = weakref.ref(module), compiled

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or not _around:
            return self.compiled(*args, **kwargs)
        module = self.module()
        hooks = list(_around.values())
        for pre, _ in hooks:
            pre(module, args)
        try:
            out = self.compiled(*args, **kwargs)
        except BaseException:
            for _, post in hooks:  # as torch calls an ``always_call`` hook: no result
                post(module, args, None)
            raise
        for _, post in hooks:
            post(module, args, out)
        return out


def hooks_around_compiled(module) -> None:
    """Run our hooks around ``module``'s call if it was compiled in place (``model.compile()``),
    also where that happened before our hooks were on (a model found from its optimizer)."""
    try:
        call = module.__dict__.get("_compiled_call_impl")
        if call is not None and not isinstance(call, EagerAround):
            module._compiled_call_impl = EagerAround(module, call)
    except Exception:
        pass


def _live_modules() -> list:
    """Every live nn.Module (one walk of the objects the garbage collector tracks; by type: isinstance
    would read __class__, which some objects warn on)."""
    import gc
    module = torch.nn.Module
    return [o for o in gc.get_objects() if issubclass(type(o), module)]


def _wrap_compiled_in_place() -> None:
    """The live modules compiled in place get our wrapper (once, at a Python-API session's first start)."""
    try:
        for m in _live_modules():
            hooks_around_compiled(m)
    except Exception:
        pass


def _compile_in_place(self, *args, **kwargs):
    _compile_of_torch(self, *args, **kwargs)
    hooks_around_compiled(self)


def _wrap_compile(on: bool) -> None:
    """nn.Module.compile gives our wrapper to the calls it compiles from our first hooks to the session's
    end (a model compiled in a stop/start gap is one the hooks meet again after start())."""
    global _compile_of_torch
    nn = torch.nn.Module
    if on and _compile_of_torch is None:
        _compile_of_torch = nn.__dict__.get("compile")
        if _compile_of_torch is not None:
            nn.compile = _compile_in_place
    elif not on and _compile_of_torch is not None:
        if nn.__dict__.get("compile") is _compile_in_place:  # unless the program put its own there since
            nn.compile = _compile_of_torch
        _compile_of_torch = None


def add_global_module_hooks(holder, pre, post) -> list:
    """Our global forward pre- and post-hooks (the post-hook also where the forward raises, where
    torch has ``always_call``), as no-ops where Dynamo traces them (``eager_only``), torch's warning
    of global hooks hidden while they are on; the handles, for ``remove_global_module_hooks``.
    They also run around the calls of modules compiled in place (``EagerAround``)."""
    from torch.nn.modules import module as nn_module
    hide_compile_warning(holder, True)
    _around[holder] = (pre, post)
    _wrap_compile(True)
    pre, post = eager_only(pre), eager_only(post)
    handles = [nn_module.register_module_forward_pre_hook(pre)]
    try:
        handles.append(nn_module.register_module_forward_hook(post, always_call=True))
    except TypeError:
        handles.append(nn_module.register_module_forward_hook(post))
    return handles


def remove_global_module_hooks(holder, handles: list) -> None:
    """Remove ``handles`` (emptied) and ``holder``'s hiding of torch's warning of global hooks."""
    for h in handles:
        h.remove()
    handles.clear()
    hide_compile_warning(holder, False)
    _around.pop(holder, None)  # nn.Module.compile stays ours over a stop/start gap: release_compile


def release_compile() -> None:
    """The session ended: nn.Module.compile is torch's again (the calls wrapped stay torch's alone)."""
    if not _around:
        _wrap_compile(False)


def compiled_original(module):
    """The module ``torch.compile(module)`` wrapped (its ``OptimizedModule``), else None."""
    if type(module).__name__ == "OptimizedModule":
        orig = getattr(module, "_orig_mod", None)
        if isinstance(orig, torch.nn.Module):
            return orig
    return None


def _is_compiled_graph(module) -> bool:
    """An ``torch.fx.GraphModule`` (what a compile backend may run as a module)."""
    fx = getattr(getattr(torch, "fx", None), "GraphModule", None)
    return fx is not None and isinstance(module, fx)


def _without_wrappers(name: str) -> str:
    """A ``named_modules()`` path less the ``_orig_mod`` steps of compiled submodules: the path the
    program's own model gives (``blocks.0._orig_mod.fc1`` is ``blocks.0.fc1``)."""
    if "_orig_mod" not in name:
        return name
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


def _nodes_of(tensors):
    """The distinct autograd nodes that produce these tensors, or None when one is a leaf (no node:
    its gradient is accumulated, a tensor hook is what sees it)."""
    nodes = []
    for t in tensors:
        fn = t.grad_fn
        if fn is None:
            return None
        if fn not in nodes:
            nodes.append(fn)
    return nodes


# The backward hooks of a module call, as torch.autograd.graph.register_multi_grad_hook has them
# (the same moments: a tensor's hook runs when its node is about to run, with its gradient), but
# put on the tensors' nodes directly (Node.register_prehook, one C++ call): the multi-grad hook's
# Tensor.register_hook costs a hook dict and a RemovableHandle per tensor, on every module call.
# A leaf among the tensors (no node) gets tensor hooks (``_leaf_hook``).
# A leaf (a tensor the program keeps: an input that requires grad, a parameter passed in) keeps
# its hooks across iterations: the hooks of one module call are removed once they have run
# (after the backward pass, not from inside it), else every later backward would run all of them.
_fired_leaf_hooks = []
# the leaf hooks of module calls that no pass has reached yet, by age in flushes: a call whose
# leaf's gradient no pass computes (torch.autograd.grad over other inputs) kept its hooks on the
# leaf for good, one more at each call (50 on a parameter after 50 iterations)
_unfired, _unfired_older = [], []
_grad_node_of = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", None)


def _leaf_hook(tensors, fn, mode):
    """``fn()`` once: at the first gradient of any of ``tensors`` (mode "any"), or once the
    gradients of all of them that the pass computes are (mode "all"), in the first backward pass
    that reaches them; tensor hooks, removed after that pass (``_fired_leaf_hooks``).
    Not torch's multi-grad hook in mode "all": it asks ``_will_engine_execute_node`` of a leaf's
    gradient accumulator, which raises inside ``torch.autograd.grad`` (a gradient penalty, an input
    Jacobian, torch.func over a module called on a leaf), and that error reached the program's
    backward. Where that is not known, the module's backward ends with the pass (as where no
    input needs a gradient)."""
    handles, left = [], {}
    done = []
    lock = threading.Lock()  # (nodes of one pass may run on several device threads)

    def finish():
        done.append(True)
        _fired_leaf_hooks.extend(handles)
        try:  # removed after this pass (not from inside it)
            torch.autograd.Variable._execution_engine.queue_callback(_remove_fired_leaf_hooks)
        except Exception:
            pass

    def hook(_grad):
        with lock:
            if done:
                return
            try:
                if mode == "all":
                    gid = _graph_task_id()
                    n = left.get(gid)
                    if n is None:
                        n = sum(map(_will_run, [_grad_node_of(t) for t in tensors]))
                    if n > 1:
                        left[gid] = n - 1
                        return
                finish()
            except Exception:  # which of them this pass computes is not known: the pass's end says
                finish()
                return
        fn()
    if mode == "all" and _grad_node_of is None:
        return  # (no way to name their nodes: they end with the pass)
    for t in tensors:
        handles.append(t.register_hook(hook))
    _unfired.append((done, handles))


def forget_unfired_leaf_hooks(everything=False):
    """At each flush: the leaf hooks that no backward pass reached since the flush before the last
    one are removed (that module call's backward, if one comes, ends with its pass)."""
    global _unfired, _unfired_older
    cur, _unfired = _unfired, []  # (a hook registered meanwhile on another thread goes to one or the other)
    old, _unfired_older = _unfired_older, [e for e in cur if not e[0]]
    if everything:
        old, _unfired_older = old + _unfired_older, []
    for done, handles in old:
        if not done:
            done.append(True)
            for h in handles:
                try:
                    h.remove()
                except Exception:
                    pass


def _remove_fired_leaf_hooks():
    while _fired_leaf_hooks:
        try:
            _fired_leaf_hooks.pop().remove()
        except Exception:
            pass


def _on_first_grad(tensors, fn):
    """``fn()`` when the first gradient of any of ``tensors`` is computed, once per backward pass."""
    nodes = _nodes_of(tensors)
    if nodes is None:
        _leaf_hook(tensors, fn, "any")
        return
    ran = set()

    def hook(_grads):
        gid = _graph_task_id()
        if gid not in ran:
            ran.add(gid)
            fn()
    for n in nodes:
        n.register_prehook(hook)


def _on_all_grads(tensors, fn):
    """``fn()`` once the gradients of all of ``tensors`` that this backward pass computes are."""
    nodes = _nodes_of(tensors)
    if nodes is None:
        _leaf_hook(tensors, fn, "all")
        return
    if len(nodes) == 1:
        nodes[0].register_prehook(lambda _grads: fn())
        return
    left = {}  # backward pass -> nodes still to run

    def hook(_grads):
        gid = _graph_task_id()
        n = left.get(gid)
        if n is None:  # which of the nodes run is known once the pass runs (as the multi-grad hook)
            n = sum(map(_will_run, nodes))
        if n <= 1:
            left.pop(gid, None)
            fn()
        else:
            left[gid] = n - 1
    for n in nodes:
        n.register_prehook(hook)


def native_hooks():
    """The native module when its module hooks are built (``MSMEMSCOPE_FOLD=python``: None, the
    Python hooks below run): ``mt_pre``/``mt_post`` and the node hooks in C++ (capture/_native.cpp
    "module attribution"), this class's Python hooks being their reference."""
    from . import native
    return native.built_with("mt_pre")


class ModuleTracker:
    def __init__(self, session, native=None):
        self.s = session
        # the C++ hooks where built (native=False: the Python ones, the reference)
        self.nat = native_hooks() if native is not False else None
        if self.nat is not None:
            self.nat.mt_reset()
            self.nat.mt_setup(self._namer, self._leaf)
        self.paths = weakref.WeakKeyDictionary()   # module -> path
        self._path_get = self.paths.get
        self.roots = {}                            # root name -> weakref to the root
        self.stacks = {}                           # tid -> [[path, phase], ...] open now, innermost last
        self.marks = {}                            # tid -> ([ts, ...], [state, ...]) since the cut
        self.base = {}                             # tid -> state before its first mark
        self.lock = threading.Lock()
        self._handles = []                         # the global forward hooks, removed at each stop
        self._lasting = []                         # hooks kept over stop/start gaps (install, close)
        self._cut = 0                              # marks older than this are folded into base
        self._callback_queued = False
        self.attributed = 0
        self.optimizers = weakref.WeakSet()
        self._tree, self._tree_roots = None, ()      # owned_blocks' walk of the roots' modules
        self._tree_root_refs: list = []              # the roots of ``_tree``, each once
        # the thread each root module and optimizer was met on (the labeller's forward hook keeps
        # the roots' up to date), and each thread's last owned_blocks: a walk reads only the calling
        # thread's gradients (see NativeLabeler._mine)
        self.thread_of = weakref.WeakKeyDictionary()
        self._owned_by_thread = {}
        # owned_blocks() at the step ends since the last flush, each block from the first step end
        # after it was made (what that step's own flush would have found); the last allocation id
        # such an answer covers
        self.at_step, self._answered_upto = None, {}  # the last id answered, per thread (its roots)
        self._roots_found_for = weakref.WeakSet()     # optimizers whose models were looked for
        self._scanned = False                         # the live modules looked at for in-place compiles
        self._root_looks = 0                          # how many (a program making an optimizer a step)
        # the owner labeller's step-end walk does this thread's walk too where every root and
        # optimizer runs on one thread (``walk_plan``, ``took_walk``): bumped where a root's or an
        # optimizer's thread changes
        self._version = 0
        self._plan = None      # (thread, _version), the tree it was made from, its pairs, weak optimizers
        self._pre_walk = None  # (thread, last allocation id before it, owned_blocks' answer)

    # a step boundary's flush may wait for a later one (Session._may_wait): at_step_end keeps the
    # owning modules as they are at that step's end for the rows the later flush attributes
    batch_steps = True

    # ------------------------------------------------------------ install / remove
    def install(self):
        from torch.nn.modules import module as nn_module
        if self._handles:
            return self
        if not self._lasting:
            # kept over stop/start gaps (close() removes them): torch iterates these two dicts
            # calling each hook, and a removal meanwhile from another thread raised in the
            # program's optimizer.step() or module assignment there
            from torch.optim import optimizer as optim
            self._lasting.append(optim.register_optimizer_step_pre_hook(eager_or_skipped(self._opt)))
            self._lasting.append(nn_module.register_module_module_registration_hook(self._tree_changed))
        self._tree = None  # modules registered while stopped: the tree is read again
        pre, post = (self.nat.mt_pre, self.nat.mt_post) if self.nat is not None else (self._pre, self._post)
        self._handles.extend(add_global_module_hooks(self, pre, post))
        if not getattr(self.s, "launched", True) and not self._scanned:
            # a Python-API session starts after the program made (and maybe compiled) its model
            self._scanned = True
            _wrap_compiled_in_place()
        if self.nat is not None:
            self.nat.mt_set_on(bool(getattr(self.s, "active", True)))
        return self

    def set_active(self, on):
        """The session traces (or stopped, failed, forked): the C++ hooks act only while it does."""
        if self.nat is not None and self._handles:
            self.nat.mt_set_on(bool(on))

    def close(self):
        """The session ended: the hooks kept over stop/start gaps go too."""
        if self._handles:
            self.remove()
        for h in self._lasting:
            h.remove()
        self._lasting.clear()

    def remove(self):
        remove_global_module_hooks(self, self._handles)
        _remove_fired_leaf_hooks()
        if self.nat is not None:
            self.nat.mt_set_on(False)
            self.nat.mt_close_all()  # what is still open is closed now: rows made after stop carry no module
            return
        # what is still open is closed now: rows made after stop carry no module
        with self.lock:
            ts = time_ns()
            for tid, st in self.stacks.items():
                if st:
                    st.clear()
                    self._mark(tid, ts, None)

    # ------------------------------------------------------------ names
    def path_of(self, module):
        p = self.paths.get(module)
        if p is None:
            p = self._name(module)
        return p

    def _name(self, module, parent=None):
        cls = type(module).__name__
        if parent is not None:
            # a module added to a named tree after it was walked (while tracing, or in a stop/start
            # gap): its name in its root's named_modules(), as the modules walked at first sight
            rname = parent.split(".", 1)[0]
            ref = self.roots.get(rname)
            root = ref() if ref is not None else None
            if root is not None and self._name_tree(root, rname):
                p = self.paths.get(module)
                if p is not None:
                    return p
            if _is_compiled_graph(module):
                # the graph a torch.compile backend runs as a module (aot_eager's GraphModule):
                # not the program's, its allocations are the compiled forward's, the parent's
                self.paths[module] = parent
                return parent
            # not in the tree (a module kept outside its parent's registered children)
            p = f"{parent}.{cls}".translate(_BAD)
            self.paths[module] = p
            return p
        if _is_compiled_graph(module):
            # a backend's graph run where no forward of the program runs: a compiled optimizer step
            # or function (aot_eager), not a module of the program; its allocations are nobody's
            # ("(outside modules)"), as under a backend that runs no module (inductor). None: the
            # hooks do nothing for it (C++: a path of -3, kept)
            return None
        orig = compiled_original(module)
        if orig is not None:  # torch.compile(model): named as the model itself, and its tree too
            p = self.paths.get(orig)
            if p is None:
                p = self._name(orig)
            self.paths[module] = p
            return p
        name, n = cls, 1
        while name in self.roots and self.roots[name]() not in (None, module):
            n += 1
            name = f"{cls}#{n}"
        name = name.translate(_BAD)
        self.roots[name] = weakref.ref(module)
        self.thread_of.setdefault(module, _get_ident())
        if not self._name_tree(module, name):
            self.paths[module] = name
        return self.paths.get(module, name)

    def _name_tree(self, root, name) -> bool:
        """Each module of ``root``'s tree not named yet gets its ``named_modules()`` path under
        ``name``; False where the tree cannot be walked."""
        try:
            for sub_name, sub in root.named_modules():
                if sub not in self.paths:
                    sub_name = _without_wrappers(sub_name)
                    self.paths[sub] = f"{name}.{sub_name}".translate(_BAD) if sub_name else name
        except Exception:
            return False
        return True

    # ------------------------------------------------------------ the C++ hooks' calls into Python
    def _namer(self, module, parent):
        """The path of a module the C++ hooks meet for the first time (parent: the innermost forward's)."""
        p = self._path_get(module)
        return p if p is not None else self._name(module, parent)

    def _leaf(self, tensors, path, mode):
        """A leaf among a module call's tensors (no node to hook): ``_leaf_hook``, as the Python
        hooks do, its moment sent to the C++ marks."""
        _leaf_hook(tensors, functools.partial(self.nat.mt_enter if mode == "any" else self.nat.mt_exit, path), mode)

    def marks_now(self):
        """{tid: ([ts, ...], [state, ...])}: the marks kept (since the previous flush), a copy."""
        if self.nat is not None:
            return self.nat.mt_marks()[0]
        with self.lock:
            return {t: (list(a), list(b)) for t, (a, b) in self.marks.items()}

    # ------------------------------------------------------------ marks
    def _mark(self, tid, ts, state):
        m = self.marks.get(tid)
        if m is None:
            m = self.marks[tid] = ([], [])
        m[0].append(ts)
        m[1].append(state)

    def _push(self, path, phase):
        tid = _get_ident()
        with self.lock:
            st = self.stacks.get(tid)
            if st is None:
                st = self.stacks[tid] = []
            state = (path, phase)
            if phase == BACKWARD and st:
                # hooks on one tensor fire in registration order: a parent whose output is its last
                # child's output (GPT and GPT.head) enters after it; it still encloses it
                i = len(st)
                pre = path + "."
                while i and st[i - 1][1] == BACKWARD and st[i - 1][0].startswith(pre):
                    i -= 1
                st.insert(i, state)
                state = st[-1]
            else:
                st.append(state)
            m = self.marks.get(tid)
            if m is None:
                m = self.marks[tid] = ([], [])
            m[0].append(time_ns())
            m[1].append(state)

    def _pop(self, path, phase):
        tid = _get_ident()
        with self.lock:
            st = self.stacks.get(tid)
            if not st:
                return
            top = st[-1]
            if top[0] == path and top[1] == phase:  # the common case: the innermost ends
                st.pop()
            else:
                for i in range(len(st) - 2, -1, -1):
                    if st[i][0] == path and st[i][1] == phase:
                        del st[i]
                        break
                else:
                    return
            m = self.marks.get(tid)
            if m is None:
                m = self.marks[tid] = ([], [])
            m[0].append(time_ns())
            m[1].append(st[-1] if st else None)

    # ------------------------------------------------------------ hooks
    def _opt(self, opt, args, kwargs):
        if note_ran_here(self.optimizers, self.thread_of, opt, _get_ident()):
            self._version += 1
        if opt not in self._roots_found_for and self._root_looks < 8:  # a few walks of gc at most
            self._roots_found_for.add(opt)
            self._root_looks += 1
            try:
                self._find_roots(opt)
            except Exception as e:
                import logging
                logging.getLogger("msmemscope").warning("looking for the models of an optimizer: %r", e)

    def _find_roots(self, opt):
        """The models of an optimizer's parameters that no forward hook showed us (``model.compile()``
        and compiled functions call them inside the compiled code, where the hooks do nothing:
        ``eager_only``): found once, among the live modules, so that their parameters, gradients
        and optimizer state still go to the layers that own them."""
        params = {id(p) for g in opt.param_groups for p in g.get("params", ()) if isinstance(p, torch.Tensor)}
        for _, ref, _ in self._module_tree():
            m = ref()
            if m is not None:
                params.difference_update(id(p) for p in m.parameters(recurse=False))
        if not params:
            return
        mods = _live_modules()
        inner = {id(c) for m in mods for c in m.children()}
        for m in mods:
            if id(m) in inner or compiled_original(m) is not None or self.paths.get(m) is not None:
                continue
            if any(id(p) in params for p in m.parameters()):
                hooks_around_compiled(m)  # compiled in place before our hooks were on
                self._name(m)
                self._tree = None

    def _pre(self, module, args):
        try:
            if not self.s.active:
                return
            p = self._path_get(module)
            if p is None:
                st = self.stacks.get(_get_ident())
                fwd = [e for e in st if e[1] == FORWARD] if st else None
                p = self._name(module, fwd[-1][0] if fwd else None)
                if p is None:  # not the program's module (a root-level compiled graph)
                    return
            in_bw = _graph_task_id() != -1
            # a forward run again inside backward (activation checkpointing) serves the backward
            self._push(p, BACKWARD if in_bw else FORWARD)
            if not in_bw and _grad_enabled():
                ins = _grad_tensors(args, [])
                if ins:  # else it ends with the backward pass (_bw_done)
                    _on_all_grads(ins, self._bw_exit(p))
        except Exception:
            pass

    def _post(self, module, args, out):
        try:
            p = self._path_get(module)
            if p is None:
                return
            in_bw = _graph_task_id() != -1
            self._pop(p, BACKWARD if in_bw else FORWARD)
            if not in_bw and _grad_enabled() and self.s.active:
                outs = _grad_tensors(out, [])
                if outs:
                    _on_first_grad(outs, self._bw_enter(p))
        except Exception:
            pass

    def _bw_enter(self, path):
        def enter(*_):
            try:
                if not self._callback_queued:
                    self._callback_queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._bw_done)
                self._push(path, BACKWARD)
            except Exception:
                pass
        return enter

    def _bw_exit(self, path):
        def done(*_):
            try:
                self._pop(path, BACKWARD)
            except Exception:
                pass
        return done

    def _bw_done(self):
        """The backward pass ended: every module still in backward (no input needed a gradient) ends."""
        self._callback_queued = False
        _remove_fired_leaf_hooks()
        with self.lock:
            ts = time_ns()
            for tid, st in self.stacks.items():
                kept = [e for e in st if e[1] != BACKWARD]
                if len(kept) != len(st):
                    st[:] = kept
                    self._mark(tid, ts, kept[-1] if kept else None)

    # ------------------------------------------------------------ flush time
    def _native_blocks(self):
        """The native source while it holds the blocks (None: none, or the dispatch-mode source's since a handover)."""
        s = self.s
        nat = getattr(s, "native", None)
        return nat if nat is not None and not getattr(getattr(s, "dispatch", None), "live", None) else None

    def _alloc_ids(self, tensors):
        """The allocation id of each tensor's block (None: not traced). The native source answers
        for all of them in one call; the dispatch-mode source's blocks (after a handover) by storage."""
        s = self.s
        nat = self._native_blocks()
        if nat is not None:
            try:
                return [i if i >= 0 else None for i in nat.block_ids(tensors)]
            except Exception:
                pass
        out = []
        for t in tensors:
            try:
                st = t.untyped_storage()
            except Exception:
                out.append(None)
                continue
            out.append(s.alloc_id_of(st))
        return out

    def _module_tree(self):
        """[(path, weak reference)] of every module of the roots (``named_modules()``), walked again
        only when the roots change or a module is registered anywhere (the global module
        registration hook, installed while tracing): a flush reads the modules' parameters, not
        the tree. Weak references: a module the program drops is not kept."""
        roots = tuple(self.roots.items())  # one C call: another thread's first forward may add a root meanwhile
        if self._tree is not None and self._tree_roots == roots:
            return self._tree
        tree = []
        for name, ref in roots:
            root = ref()
            if root is None:
                continue
            for sub_name, sub in root.named_modules():
                tree.append((self.paths.get(sub) or (f"{name}.{sub_name}" if sub_name else name), weakref.ref(sub), ref))
        self._tree, self._tree_roots = tree, roots
        self._tree_root_refs = list({id(ref): ref for _, _, ref in tree}.values())
        return tree

    def _tree_changed(self, *_):
        self._tree = None

    def owned_blocks(self):
        """alloc_id -> (path, category) of the parameters, buffers, gradients and optimizer state of the
        modules seen (by the sources' allocation ids): what a run without owner labels (no
        ``decompose``, e.g. the native source) knows of the blocks' owning modules. The walk is C++
        where it can be (``owning_modules``: the native source's blocks, plain tensors, no FSDP2);
        the loop below is its reference."""
        self._walk_mine()
        return dict(all_threads(self._owned_by_thread))  # the callers add to it

    def root_ran_here(self, module, me):
        """The owner labeller met ``module`` as a root on thread ``me`` (its outermost forward)."""
        if self.thread_of.get(module) != me:
            self.thread_of[module] = me
            self._version += 1

    def walk_plan(self, me):
        """(tree [(path, weak module)], [weak optimizer]) of this thread's walk where it walks every
        root and optimizer (none run last by another thread, none gone) and the C++ walk can take
        it: what the owner labeller's step-end walk hands to
        ``live_walks`` (capture/_native.cpp) for this tracker. None otherwise (this tracker walks)."""
        tree = self._module_tree()
        plan = self._plan
        if plan is not None and plan[0] == (me, self._version) and plan[1] is tree:
            return plan[2], plan[3]
        self._plan = None
        if self._native_blocks() is None or _native_walk() is None:
            return None
        roots = [ref() for ref in self._tree_root_refs]
        opts = list(self.optimizers)
        if not all_ran_here(self.thread_of, roots + opts, me):
            return None
        self._plan = plan = ((me, self._version), tree, [(path, ref) for path, ref, _ in tree],
                             [weakref.ref(o) for o in opts])
        return plan[2], plan[3]

    def took_walk(self, me, mark, owned):
        """The labeller walked for this tracker (``walk_plan``) when ``mark`` was the last
        allocation id: ``owned`` is this thread's owned_blocks while no block is made since."""
        self._pre_walk = (me, mark, owned)

    def _walk_mine(self, now=None) -> dict:
        """owned_blocks of this thread's roots and optimizers, walked now (kept for the others);
        ``now``: the last allocation id, where the caller has it."""
        pre, self._pre_walk = self._pre_walk, None
        if pre is not None and pre[0] == _get_ident():
            nat = self._native_blocks()
            if nat is not None and pre[1] == (now if now is not None else nat.m.last_alloc_id()):
                self._owned_by_thread[pre[0]] = pre[2]
                return pre[2]
        tree = self._module_tree()
        # one lookup per root, not per module
        roots = [r for r in (ref() for ref in self._tree_root_refs) if r is not None]
        mine, others = by_thread(self.thread_of, roots)
        theirs = ()
        if len(mine) == len(roots) == len(self._tree_root_refs):  # one thread runs them all, none gone
            tree = [(path, ref()) for path, ref, _ in tree]
        else:
            mine, others = {id(r) for r in mine}, {id(r) for r in others}
            theirs = [(path, ref()) for path, ref, root in tree if id(root()) in others]
            tree = [(path, ref()) for path, ref, root in tree if id(root()) in mine]
        opts = ran_here(self.thread_of, list(self.optimizers))
        if not (tree or opts or theirs):
            return {}
        got = self._walk_owned(tree, opts) if tree or opts else {}
        if theirs:  # the parameters and buffers of the models other live threads run
            paths = {id(sub): path for path, sub in theirs if sub is not None}
            pairs = list(weights_of(sub for _, sub in theirs if sub is not None))
            got = dict(got)
            for aid, (sub, _) in zip(self._alloc_ids([t for _, t in pairs]), pairs):
                if aid is not None and aid not in got:
                    got[aid] = (paths[id(sub)], "weight")
        self._owned_by_thread[_get_ident()] = got
        return got

    def _answer_new(self, earlier):
        """This thread's walk now, for the blocks made since its previous answer (the others were
        answered then); ``earlier`` (answers of step ends since the last flush) wins over it."""
        nat = self._native_blocks()
        me = _get_ident()
        prev = self._answered_upto.get(me, 0)
        if nat is not None:
            now = nat.m.last_alloc_id()
            if now == prev and me in self._answered_upto:
                # nothing allocated since this thread's last answer (a flush right after the step end
                # that answered): the walk could find no block above it (GPT-2: ~130 us a flush)
                return dict(earlier or {})
            self._answered_upto[me] = now  # before the walk: one made during it is the next's
        got = {k: v for k, v in self._walk_mine(now if nat is not None else None).items() if k > prev}
        if earlier:
            got.update(earlier)
        return got

    def _walk_owned(self, tree, opts):
        walk = _native_walk()
        if walk is not None and self._native_blocks() is not None:
            got = walk.owning_modules(tree, opts, OWNED_CATEGORIES)
            if got is not None:
                return got
        tensors, meta, by_param = [], [], {}
        for path, sub in tree:
            if sub is None:
                continue
            # the module's own parameters and buffers (parameters(recurse=False), buffers(recurse=False))
            for p in sub._parameters.values():
                if p is None:
                    continue
                by_param.setdefault(id(p), path)
                tensors.append(p)
                meta.append((path, "weight"))
                if p.grad is not None:
                    tensors.append(p.grad)
                    meta.append((path, "gradient"))
            for bf in sub._buffers.values():
                if bf is not None:
                    tensors.append(bf)
                    meta.append((path, "weight"))
        for opt in opts:
            for p, st in opt.state.items():
                path = by_param.get(id(p))
                if path is not None and isinstance(st, dict):
                    for v in st.values():
                        if isinstance(v, torch.Tensor):
                            tensors.append(v)
                            meta.append((path, "optimizer_state"))
        out = {}
        for aid, m in zip(self._alloc_ids(tensors), meta):
            if aid is not None and aid not in out:  # the first module that registers a tensor owns it
                out[aid] = m
        return out

    def at_step_end(self, owned_known=False, labeler=None):
        """A step ended and its flush waits: the blocks' owning modules now (a gradient the next
        step frees is attributed as that step's flush would have), and the labeller's OWNER rows
        since the last step end theirs, from the same walk. Nothing where the labeller gives them
        (``owned_known``)."""
        if owned_known or self._native_blocks() is None:
            return
        self.at_step = self._answer_new(self.at_step)  # an earlier answer stays
        rows = labeler.take_owner_rows() if labeler is not None else ()
        if rows:
            self._attribute_owner_rows(rows, {})  # the walk just made answers them

    def attribute(self, buf, owned=None, owner_rows=()):
        """Give each MALLOC row of ``buf`` not yet attributed its thread's module at its time;
        ``owned``: alloc_id -> path of the module owning the block (parameters, gradients,
        optimizer state: capture/owners.py), which wins over the running module. ``owner_rows``:
        the attrs of the OWNER rows made since the last flush, given the module owning their block."""
        return self.finish(buf, self.spec(owned, None if owner_rows else buf), owner_rows)

    def labels_at_drain(self) -> bool:
        """Whether the native source can give the modules as it drains (``spec`` there): the marks
        are C++, and so is the row pass over what waits in the buffer."""
        return self.nat is not None and _native_module() is not None

    def spec(self, owned=None, rows=None):
        """(marks, base, owned, cats) of this flush: each thread's states at their times and before
        them, and the owning module (and category) of the blocks it answers. ``owned`` given (the
        Python owner labeller's): those, no category; else this tracker's walk, unless ``rows`` (the
        rows to attribute, where they are known before) hold no MALLOC row."""
        forget_unfired_leaf_hooks()
        if self.nat is not None:
            marks, base = self.nat.mt_marks()
        else:
            with self.lock:
                marks = {t: (list(a), list(b)) for t, (a, b) in self.marks.items()}
                base = dict(self.base)
        cats = {}
        at_step, self.at_step = self.at_step, None
        if owned is None:  # no owner labels: the owning modules and their categories from here
            # blocks answered at a step end keep that answer; the others are answered now
            try:
                if at_step is not None:  # step ends came since the last flush: this thread's new blocks
                    found = self._answer_new(at_step)
                elif rows is None or any(r[EVENT] == Event.MALLOC for r in rows):
                    found = self.owned_blocks()
                else:
                    found = {}
            except Exception:
                found = dict(at_step or {})
            owned = {k: v[0] for k, v in found.items()}
            cats = {k: v[1] for k, v in found.items()}
        return marks, base, owned, cats

    def attribute_rows(self, buf, spec, start=0) -> int:
        """The row pass of ``attribute`` over ``buf[start:]`` with a flush's ``spec``."""
        if start >= len(buf):
            return 0
        mod = _native_module()
        if mod is not None:
            return mod.attribute(buf, *spec, start)
        return _attribute_py(buf, *spec, start)

    def finish(self, buf, spec, owner_rows=(), start=0, attributed=0):
        """The end of a flush's attribution: the OWNER rows given their blocks' owning modules, the
        rows of ``buf[start:]`` attributed (those before were, ``attributed`` of them given a module
        where the native source drained them), and the marks before this flush folded away."""
        if owner_rows:
            self._attribute_owner_rows(owner_rows, spec[2])
        n = attributed + self.attribute_rows(buf, spec, start)
        self.attributed += n
        self._prune()
        return n

    def _attribute_owner_rows(self, rows, owned):
        """An OWNER row (a block relabelled after its MALLOC row was written: made before a stop/start
        gap, or before the module that owns it was in a tree) carries the module owning the block, so
        that ``decompose --by=module`` moves it there. ``owned`` answers the blocks made since the last
        flush (native source) or all (owner labeller); the others from the threads' last walks (the
        caller's thread walked just before)."""
        every = all_threads(self._owned_by_thread)
        for r in rows:
            aid = r["allocation_id"]
            path = owned.get(aid)
            if path is None:
                hit = every.get(aid)
                path = hit[0] if hit is not None else None
            if path is not None and "module" not in r:
                r["module"] = path

    def _prune(self):
        """Keep the marks since the previous flush (rows of a source drained one flush late still
        find theirs); older ones fold into each thread's base state."""
        cut, self._cut = self._cut, time_ns()
        if self.nat is not None:
            self.nat.mt_prune(cut)
            return
        with self.lock:
            for tid, (ts, st) in list(self.marks.items()):
                k = bisect.bisect_left(ts, cut)
                if k:
                    self.base[tid] = st[k - 1]
                    del ts[:k], st[:k]
                if not ts:
                    del self.marks[tid]


def _native_walk():
    """The native module's ``owning_modules`` where built (``MSMEMSCOPE_FOLD=python``: None)."""
    from . import native
    return native.built_with("owning_modules")


def _native_module():
    """The native module's ``attribute`` where it is built (``MSMEMSCOPE_FOLD=python``: the Python one)."""
    from . import native
    return native.built_with("attribute")


def _attribute_py(buf, marks, base, owned, cats, start=0):
    """``ModuleTracker.attribute``'s work on the rows ``buf[start:]`` in Python: the reference of the
    native ``attribute`` (capture/_native.cpp), used where it is not built."""
    malloc = Event.MALLOC
    n = 0
    get_own, get_marks, get_base, right = owned.get, marks.get, base.get, bisect.bisect_right
    for i in range(start, len(buf)):
        r = buf[i]
        if r[EVENT] != malloc:
            continue
        a = r[ATTR]
        if type(a) is tuple:
            if len(a) != 6:
                continue
            aid = a[A_ALLOC_ID]
        elif isinstance(a, dict) and "module" not in a:
            aid = a.get("allocation_id")
        else:
            continue
        tid = r[TID]
        m = get_marks(tid)
        if m is None:
            state = get_base(tid)
        else:
            j = right(m[0], r[TS]) - 1
            state = m[1][j] if j >= 0 else get_base(tid)
        own = get_own(aid)
        if state is None and own is None:
            continue
        if own is not None:
            mod = own
            phase = state[1] if state is not None else None
        else:
            mod, phase = state
        if type(a) is tuple:
            if own is not None and not a[A_OWNER] and aid in cats:
                a = a[:A_OWNER] + (f"{r[EVENT_TYPE]}@{cats[aid]}",)
            buf[i] = r[:ATTR] + (a + (mod, phase),) + r[ATTR + 1:]
        else:
            extra = {"module": mod} if phase is None else {"module": mod, "phase": phase}
            buf[i] = r[:ATTR] + ({**a, **extra},) + r[ATTR + 1:]
        n += 1
    return n
