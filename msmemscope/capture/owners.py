"""Owner labels for memory blocks (SPEC §4.4): what each block is *for*.

A block's owner is a chain of labels joined by ``@``, from the framework down::

    <pool>@<category>[@<component>...][@<user label>...]

``category`` is one of ``weight``, ``gradient``, ``optimizer_state``,
``activation``, ``ops`` (temporaries and anything else); components name a
framework part (``fsdp2@sharded``, ``fsdp2@all_gather``); user labels come from
``msmemscope.describe.describer`` (outermost first).

Labels come from three sources, strongest first:

1. *Resolution of live objects* at every flush (``Labeler.before_flush``), before
   the buffered rows are written: the parameters, buffers and ``.grad`` of every
   module that ran a forward (global forward pre-hook), the parameters, grads and
   state of every optimizer that stepped (global optimizer hooks), and FSDP2's
   sharded / unsharded parameter storages.
2. *Facts seen while it happens*: tensors FSDP2 hands to its reduce-scatter are
   unsharded gradients; blocks made inside FSDP2's all-gather / reduce-scatter
   are its communication buffers.
3. *Autograd*: a tensor saved for backward (a saved-tensor pack hook) that was
   made by the forward pass (it has a ``grad_fn``, or it was allocated inside a
   module's forward) is an ``activation``. Everything else is ``ops``.

Rows still in the buffer get the final owner written into their MALLOC row;
a block whose MALLOC row was already written and whose owner changes later
gets a ``SYSTEM/OWNER`` row ``{"allocation_id": N, "owner": "..."}``.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch

from ..after_import import after_import
from ..events import A_ALLOC_ID, A_OWNER, ATTR, EVENT, Event, category_of
from . import native
from .modules import OWNED_CATEGORIES, _is_compiled_graph, all_ran_here, all_threads, note_ran_here

#: the module whose all-gather and reduce-scatter the labeller wraps (FSDP2, torch >= 2.4)
FSDP2_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"

WEIGHT, GRADIENT, OPT_STATE, ACTIVATION, OPS = "weight", "gradient", "optimizer_state", "activation", "ops"
_CATEGORY_VALUES = ((WEIGHT, ()), (GRADIENT, ()), (OPT_STATE, ()))  # native live_categories' values
OWNER_ROW = "OWNER"  # SYSTEM event type of an owner update row
MAX_LABELS = 3
MAX_LABEL_LEN = 128
_BAD_CHARS = set(',"{}\\\n\r')

# ---------------------------------------------------------------- user labels (describe)
_tls = threading.local()
_labels_seen: list = []          # distinct user labels used by this process, in order
_labels_lock = threading.Lock()


def check_label(owner, count: bool = True) -> str:
    """Validate a user label; the 4th distinct label of a process is refused. The cap is the
    original's for the decorator and ``with`` forms: a tensor's label (``count=False``) is not counted."""
    if not isinstance(owner, str):
        raise ValueError(f"msmemscope.describe: owner must be a string, not {type(owner).__name__}")
    if not owner:
        raise ValueError("msmemscope.describe: owner must not be empty")
    if len(owner) > MAX_LABEL_LEN:
        raise ValueError(f"msmemscope.describe: owner '{owner[:20]}...' is {len(owner)} characters "
                         f"(at most {MAX_LABEL_LEN})")
    if owner.startswith("@"):
        raise ValueError(f"msmemscope.describe: owner '{owner}' must not start with '@'")
    bad = sorted(set(owner) & _BAD_CHARS)
    if bad:
        raise ValueError(f"msmemscope.describe: owner {owner!r} contains {', '.join(map(repr, bad))} "
                         "(not allowed in an owner label)")
    if not count:
        return owner
    with _labels_lock:
        if owner not in _labels_seen:
            if len(_labels_seen) >= MAX_LABELS:
                raise ValueError(f"msmemscope.describe: at most {MAX_LABELS} distinct owner labels per process; "
                                 f"'{owner}' refused (already used: {', '.join(_labels_seen)})")
            _labels_seen.append(owner)
    return owner


def _stack() -> list:
    st = getattr(_tls, "labels", None)
    if st is None:
        st = _tls.labels = []
    return st


# the native source's labeler, told of each change of this thread's open labels (its new blocks
# carry them as a tag); None while labels are followed through the dispatch-mode source
_on_labels_changed = None


def _labels_changed():
    if _on_labels_changed is not None:
        _on_labels_changed()


def push_label(owner: str) -> None:
    _stack().append(owner)
    _labels_changed()


def pop_label(owner: str) -> bool:
    """Close the innermost open ``owner`` label of this thread (whichever describer opened it)."""
    st = _stack()
    for i in range(len(st) - 1, -1, -1):
        if st[i] == owner:
            del st[i]
            _labels_changed()
            return True
    return False


def current_labels() -> tuple:
    st = getattr(_tls, "labels", None)
    return tuple(dict.fromkeys(st)) if st else ()


def push_component(comp: tuple):
    prev = getattr(_tls, "component", None)
    _tls.component = comp
    _labels_changed()
    return prev


def pop_component(prev):
    _tls.component = prev
    _labels_changed()


# ---------------------------------------------------------------- tensors -> storages
def plain_tensors(t):
    """The plain tensors behind ``t`` (DTensor and other wrapper subclasses unwrapped)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return (t,)
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return (t,)
    try:
        names, _ = flatten()
    except Exception:
        return ()
    out = []
    for n in names:
        inner = getattr(t, n, None)
        if isinstance(inner, torch.Tensor):
            out.extend(plain_tensors(inner))
    return out


def _storage(t):
    try:
        return t.untyped_storage()
    except Exception:
        return None


class Info:
    """What capture learned about one block (kept only for blocks with something to say)."""
    __slots__ = ("users", "comp", "forced", "saved")

    def __init__(self):
        self.users = ()
        self.comp = ()
        self.forced = None   # (category, components) known at capture time
        self.saved = False   # saved for backward by the forward pass


def backward_task() -> int:
    """The backward pass running on this thread (autograd's graph task id), or -1: none."""
    try:
        return torch._C._current_graph_task_id()
    except Exception:
        return -1


def once_at_backward_end(queued: set, task: int, fn) -> bool:
    """``fn()`` once at the end of backward pass ``task`` however often this is asked in it
    (``queued``: the caller's set of tasks waiting). False: it cannot be queued (run it now)."""
    if task in queued:
        return True
    queued.add(task)

    def at_end():
        queued.discard(task)
        fn()
    try:
        torch.autograd.Variable._execution_engine.queue_callback(at_end)
        return True
    except Exception:
        queued.discard(task)
        return False


class Labeler:
    def __init__(self, session):
        self.s = session
        self.roots = weakref.WeakSet()       # modules whose forward ran at depth 0
        self.optimizers = weakref.WeakSet()
        self.pending: list = []              # blocks made since the last flush
        self.info: dict = {}                 # alloc_id -> Info
        self.depth = 0
        self.fwd_first_aid = None            # first allocation id of the running outermost forward
        self._thread_depth = {}              # tid -> forwards running on that thread (its roots)
        self.updates = 0
        self.flushed_upto = 0                # MALLOC rows of allocation ids up to this one are written
        self._handles = []
        self._packing = threading.local()    # .on: our saved-tensor hooks are on this thread
        self._patched = []
        self._fsdp2_wait = None              # the finder waiting for the program's import of FSDP2
        self.owned: dict = {}                # alloc_id -> path of the module owning it (module attribution on)
        self._owned_read = True              # module attribution has read ``owned`` since it was made
        self.unattributed: list = []         # attrs of the OWNER rows made since the last flush
        # after a handover from the native source: the label each of its blocks has in the dump
        # (alloc_id -> owner), which the block keeps when the dispatch-mode source first meets it
        # (at most the blocks live at the handover; not pruned: the dispatch source meets them late)
        self.handed_owner: dict = {}
        # the thread that last ran each root module and optimizer: a walk reads only the calling
        # thread's gradients (``_mine``)
        self.thread_of = weakref.WeakKeyDictionary()
        self._walked_by: dict = {}           # alloc_id -> the thread whose walk gave its block a category
        self._walk_after_backward = set()    # backward passes whose end walks once (_opt_post)
        # each root's modules (``modules()``) between walks, as weak references, until a module is
        # registered anywhere: a walk at every step end read the tree again (named_modules makes a
        # path string per module: ~1 us a module, each step, on a model of thousands)
        self._subs: dict = {}                # id(root) -> (weak root, [weak module])
        self._tree_handle = None
        # bumped where the roots, the optimizers, a thread they run on, or a module tree change (the
        # native labeller's walk plan, ``_walk_plan``)
        self._version = 0

    # ------------------------------------------------------------ install / remove
    def install(self):
        from torch.optim import optimizer as optim
        self._module_hooks()
        from .eager import eager_or_skipped  # a compiled optimizer step traces them (see there)
        self._handles.append(optim.register_optimizer_step_pre_hook(eager_or_skipped(self._opt_pre)))
        self._handles.append(optim.register_optimizer_step_post_hook(eager_or_skipped(self._opt_post)))
        self._watch_tree()
        self._pack_on_this_thread()  # this thread's (other threads': at their first outermost forward)
        # FSDP2's wrappers wait for the program's own import of it: importing it here would cost
        # every run ~1.3 s (it pulls in torch._dynamo and sympy)
        self._fsdp2_wait = after_import(FSDP2_PARAM_GROUP, self._patch_fsdp2, "no FSDP2 labels in process {pid}")

    def _saved_hooks(self):
        """(pack, unpack): our saved-tensor hooks."""
        return self._pack, _unpack

    def _module_hooks(self):
        from .modules import add_global_module_hooks
        self._mod_handles = add_global_module_hooks(self, self._fwd_pre, self._fwd_post)

    def pause(self):
        """Tracing stopped: the global module hooks go (every module call of the program pays them)."""
        from .modules import remove_global_module_hooks
        remove_global_module_hooks(self, getattr(self, "_mod_handles", []))
        self._mod_handles = []
        self.depth = 0
        self._thread_depth = {}
        # the module registration hook stays (remove()): torch calls those hooks iterating their
        # dict, and a removal meanwhile from another thread raised in that thread's module assignment

    def resume(self):
        if not getattr(self, "_mod_handles", None):
            self._module_hooks()
        self._watch_tree()

    def _watch_tree(self):
        from torch.nn.modules import module as nn_module
        self._subs = {}  # modules registered while stopped were not seen by the hook
        self._version += 1
        if self._tree_handle is None:
            self._tree_handle = nn_module.register_module_module_registration_hook(self._tree_changed)

    def _tree_changed(self, *_):
        self._subs = {}  # (returns None: a registration hook's value would replace the module)
        self._version += 1

    def _trees(self, roots) -> list:
        """``[list(root.modules()) for root in roots]``, from what the last walk saw where nothing
        was registered since (and none of those modules is gone)."""
        out, subs = [], self._subs
        for r in roots:
            hit = subs.get(id(r))
            if hit is not None and hit[0]() is r:
                mods = [w() for w in hit[1]]
                if None not in mods:
                    out.append(mods)
                    continue
            mods = list(r.modules())
            subs[id(r)] = (weakref.ref(r), [weakref.ref(m) for m in mods])
            out.append(mods)
        return out

    def remove(self):
        self.pause()
        pop_saved_hooks(self._saved_hooks()[1])  # this thread's (other threads' stay, idle: pack checks the session)
        if self._tree_handle is not None:
            self._tree_handle.remove()
            self._tree_handle = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._fsdp2_wait is not None:
            self._fsdp2_wait.cancel()
            self._fsdp2_wait = None
        for mod, name, orig in self._patched:
            setattr(mod, name, orig)
        self._patched.clear()

    # ------------------------------------------------------------ capture-time sources
    def on_new(self, b):
        """Called by ``Session.new_block`` before the MALLOC row is built: the initial owner."""
        users = current_labels()
        comp = getattr(_tls, "component", None)
        if users or comp:
            inf = self.info[b.alloc_id] = Info()
            inf.users = users
            inf.comp = comp or ()
        self.pending.append(b)
        known = self.handed_owner.get(b.alloc_id) if self.handed_owner else None
        b.owner = known if known is not None else self.compose(b, None)

    def _info(self, b):
        inf = self.info.get(b.alloc_id)
        if inf is None:
            inf = self.info[b.alloc_id] = Info()
        return inf

    def _add_root(self, module):
        """A module whose forward runs at depth 0, on this thread."""
        me = threading.get_ident()
        if note_ran_here(self.roots, self.thread_of, module, me):
            self._version += 1
        tracker = getattr(self.s, "modules", None)
        if tracker is not None:
            tracker.root_ran_here(module, me)
        if not getattr(self._packing, "on", False):
            self._pack_on_this_thread()

    def _pack_on_this_thread(self):
        """The saved-tensor hooks are per thread (autograd's thread-local state): pushed at install
        on the thread that started tracing, and on any other at its first outermost forward, so
        that a worker thread's saved tensors are activations too (before: all of them ``ops``).
        Not where the program has its own hooks on the thread now (pushed above them, ours would
        be what their context's exit pops, and theirs would stay on: a start() inside the
        program's ``saved_tensors_hooks`` did that), nor inside a region that disables them
        (torch.func): then tried again at the thread's next outermost forward."""
        if push_saved_hooks(*self._saved_hooks()):
            self._packing.on = True

    def _mine(self, objs):
        from .modules import ran_here
        return ran_here(self.thread_of, objs)

    def _fwd_pre(self, module, args):
        if self.depth == 0:
            if _is_compiled_graph(module):  # a backend's graph run outside any forward: not a forward
                return
            self.fwd_first_aid = self._next_alloc_id()
        self.depth += 1
        # a root on this thread, whatever other threads run (a second thread's model, begun while the
        # first was inside a forward, was never a root: its weights were temporaries)
        td = self._thread_depth
        me = threading.get_ident()
        n = td.get(me, 0)
        td[me] = n + 1
        if n == 0:
            self._add_root(module)

    def _next_alloc_id(self):
        """The allocation id the next block gets (the first of an outermost forward)."""
        return self.s.dispatch.next_alloc + 1

    def _fwd_post(self, module, args, out):
        if self.depth > 0:
            self.depth -= 1
        td = self._thread_depth
        me = threading.get_ident()
        n = td.get(me, 0)
        if n > 1:
            td[me] = n - 1
        elif n:
            del td[me]

    def _opt_pre(self, opt, args, kwargs):
        if note_ran_here(self.optimizers, self.thread_of, opt, threading.get_ident()):
            self._version += 1

    def _opt_post(self, opt, args, kwargs):
        # state made by this step (Adam's moments, step counters) is registered and labelled
        # before the session's own post-hook ends the step
        self._opt_pre(opt, args, kwargs)
        task = backward_task()
        if task != -1:
            # the optimizer in backward (an optimizer per parameter, stepped inside the backward):
            # its gradients now, freed before any walk; one walk at the backward's end, before
            # the step it ends (queued before the session's), not one per parameter (a
            # 100-parameter model: 12x the plain program with a walk each)
            self.mark([p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None], GRADIENT, ())
            if once_at_backward_end(self._walk_after_backward, task, self._walk_now):
                return
        self._walk_now()

    def _walk_now(self):
        _, changed = self.resolve(register=True)
        # a block whose MALLOC row is written already (before a stop/start gap, or by a flush inside
        # the step) gets its OWNER row now, before the step's STEP row; the flush's own walk would
        # find no change left to report
        for b in changed:
            if b.alloc_id <= self.flushed_upto and b.owner:
                self._owner_row(b)

    def _owner_row(self, b):
        self._emit_owner(b.alloc_id, b.owner)

    def _emit_owner(self, aid, owner):
        """An OWNER row for a block whose MALLOC row is written (none where MALLOC rows are not).
        Module attribution (where on) gives it the module owning the block at the step end or flush
        that writes it (``ModuleTracker``). Also while nothing new is recorded (the flush of a
        stop(), the session's end, a step that --steps leaves out): the block's MALLOC row is in the
        dump all the same (only counted blocks are labelled), and a walk at that flush may be the
        first to reach it (the model of a worker thread walked once the thread has ended)."""
        if not self.s.want_alloc:
            return
        self.updates += 1
        row = {"allocation_id": aid, "owner": owner}
        self.s.system(OWNER_ROW, row)
        self.unattributed.append(row)

    def take_owner_rows(self) -> list:
        """The OWNER rows' attrs made since the last call (the flush attributes them)."""
        rows, self.unattributed = self.unattributed, []
        return rows

    def _pack(self, t):
        try:
            s = self.s
            if s.active:
                has_fn = t.grad_fn is not None
                first = self.fwd_first_aid if self.depth > 0 else None
                for p in plain_tensors(t):
                    st = _storage(p)
                    if st is None:
                        continue
                    b = s.live.get(id(st))
                    if b is None:
                        continue
                    # made by the forward pass: an autograd result, or allocated inside the running forward
                    if has_fn or (first is not None and b.alloc_id >= first):
                        inf = self._info(b)
                        if not inf.saved:
                            inf.saved = True
                            # an op's block becomes an activation; a block the walks gave a category
                            # (a weight saved through its transpose view) keeps it
                            if category_of(b.owner) == OPS:
                                b.owner = self.compose(b, None)
        except Exception:
            pass
        return t

    def mark(self, tensors, category, comp):
        """Capture-time fact: these tensors' blocks are ``category`` (e.g. FSDP2's unsharded grads)."""
        s = self.s
        for t in tensors:
            for p in plain_tensors(t):
                st = _storage(p)
                b = s.live.get(id(st)) if st is not None else None
                if b is not None:
                    self._info(b).forced = (category, comp)
                    old, b.owner = b.owner, self.compose(b, None)
                    if b.owner != old and b.alloc_id <= self.flushed_upto:
                        # its MALLOC row is already written: record the new owner
                        self._owner_row(b)

    def add_user_label(self, t, owner):
        s = self.s
        found = False
        for p in plain_tensors(t):
            b = s.block_of(p, "describe") if s.active else s.live.get(id(_storage(p)))
            if b is None:
                continue
            found = True
            inf = self._info(b)
            if owner not in inf.users:
                inf.users = inf.users + (owner,)
            was, b.owner = b.owner, self.compose(b, _walked(b.owner))
            if b.alloc_id <= self.flushed_upto and b.owner != was:
                # its MALLOC row is written: record the new owner now, before any later FREE
                self._owner_row(b)
            # else the MALLOC row is still buffered and gets the owner at the flush
        return found

    # ------------------------------------------------------------ resolution
    def compose(self, b, resolved):
        inf = self.info.get(b.alloc_id)
        if resolved is not None:
            cat, comp = resolved
            if not comp and inf is not None:
                # a framework component known at capture time (hooks: vllm@weights) stays
                comp = inf.forced[1] if inf.forced is not None else inf.comp
        elif inf is not None and inf.forced is not None:
            cat, comp = inf.forced
        else:
            cat = ACTIVATION if inf is not None and inf.saved else OPS
            comp = inf.comp if inf is not None else ()
        parts = [b.pool, cat, *comp]
        if inf is not None and inf.users:
            parts.extend(inf.users)
        return "@".join(parts)

    def _collect(self, register):
        """id(storage) -> (category, components) from the live objects."""
        s = self.s
        out = {}

        def add(t, cat, comp=()):
            if t is None:
                return
            for p in plain_tensors(t):
                st = _storage(p)
                if st is None:
                    continue
                k = id(st)
                if k in out:
                    continue
                out[k] = (cat, comp)
                if register and k not in s.live:
                    s.block_of(p, "optimizer.step")

        from .modules import by_thread, weights_of
        roots, others = by_thread(self.thread_of, list(self.roots))
        walk_live_objects(roots, self._mine(list(self.optimizers)), add, self._trees(roots))
        for _, t in weights_of(m for mods in self._trees(others) for m in mods):
            add(t, WEIGHT)  # other live threads' models: their parameters and buffers only
        return out

    def take_owned(self):
        """``owned`` for module attribution at a flush (None: the native labeller, which leaves it to
        capture/modules.py)."""
        self._owned_read = True
        return self.owned

    def _owning_modules(self, roots, others=()):
        """id(storage) -> path of the module that registers the parameter or buffer (its gradient and
        its optimizer state go with it); only while module attribution is on. ``others``: roots
        other live threads run, whose parameters and buffers only are read (``by_thread``)."""
        tracker = getattr(self.s, "modules", None)
        if tracker is None:
            return {}
        out = {}
        by_param = {}
        # and the models module attribution found from their optimizer (model.compile(), compiled
        # functions: no forward hook of ours runs for them), that this thread ran
        from .modules import _is_compiled_graph, ran_here, weights_of
        seen = {id(m) for m in roots} | {id(m) for m in others}
        found = [m for m in (ref() for ref in list(tracker.roots.values()))
                 if m is not None and id(m) not in seen and not _is_compiled_graph(m)]
        roots = list(roots) + ran_here(tracker.thread_of, found)

        def add(t, path):
            for p in plain_tensors(t):
                st = _storage(p)
                if st is not None:
                    out.setdefault(id(st), path)
        def named(m):  # (path, submodule) of a root's tree
            root = tracker.path_of(m)
            for name, sub in m.named_modules():
                yield tracker.paths.get(sub) or (f"{root}.{name}" if name else root), sub
        for m in roots:
            for path, sub in named(m):
                for p in sub.parameters(recurse=False):
                    by_param.setdefault(id(p), path)
                    add(p, path)
                    if p.grad is not None:
                        add(p.grad, path)
                    sp = getattr(p, "_local_tensor", None)
                    if sp is not None:
                        add(sp, path)
                for bf in sub.buffers(recurse=False):
                    add(bf, path)
                get_state = getattr(sub, "_get_fsdp_state", None)
                if get_state is not None:  # FSDP2: the all-gathered and sharded storages of its parameters
                    try:
                        pg = get_state()._fsdp_param_group
                        for fp in (pg.fsdp_params if pg is not None else ()):
                            mp = tracker.paths.get(fp._module_info.module) or path
                            for t in getattr(fp, "all_gather_outputs", ()) or ():
                                add(t, mp)
                            add(getattr(fp, "_sharded_param_data", None), mp)
                            sp = getattr(fp, "sharded_param", None)
                            if sp is not None:
                                by_param.setdefault(id(sp), mp)
                                add(sp, mp)
                                if sp.grad is not None:
                                    add(sp.grad, mp)
                    except Exception:
                        pass
        for opt in list(self.optimizers):
            for p, st in opt.state.items():
                path = by_param.get(id(p))
                if path is None or not isinstance(st, dict):
                    continue
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        add(v, path)
        for m in others:
            for path, sub in named(m):
                for _, t in weights_of((sub,)):
                    add(t, path)
        return out

    def resolve(self, register=False):
        """Relabel every live block from the live objects; returns the blocks whose owner changed."""
        cats = self._collect(register)
        changed = []
        me, walked = threading.get_ident(), self._walked_by
        for key, b in list(self.s.live.items()):
            c = cats.get(key)
            if c is not None:
                walked[b.alloc_id] = me
            elif walked.get(b.alloc_id, me) != me:
                continue  # another thread's walk gave it a category: its own next walk says
            new = self.compose(b, c)
            if new != b.owner:
                b.owner = new
                changed.append(b)
        return cats, changed

    def before_flush(self):
        """Called by ``Session.flush`` before the buffered rows are numbered and written."""
        s = self.s
        with s.lock:
            pending, self.pending = self.pending, []
            self.flushed_upto = s.dispatch.next_alloc
        try:
            cats, changed = self.resolve()
        except Exception:
            cats, changed = {}, []
        # a copy (one C call, under the GIL): another thread's ops add blocks and storages' weakref
        # callbacks remove them while this runs (iterating the dict itself raised in a thread of
        # the program: two threads each training a model)
        live = dict(s.live)
        try:
            from .modules import by_thread
            mods = self._owning_modules(*by_thread(self.thread_of, list(self.roots)))
        except Exception:
            mods = {}
        found = {b.alloc_id: mods[k] for k, b in live.items() if k in mods} if mods else {}
        # answers no flush has used yet stay: the held step 1's, taken at its hold, before zero_grad
        # freed its gradients (under torch.compile no backward hook of their layer ran to say it)
        self.owned = found if self._owned_read or not self.owned else {**self.owned, **found}
        self._owned_read = False
        for b in pending:  # blocks freed since the last flush: their storage may still exist (resize_)
            st = b()
            if st is None:
                continue  # gone: the owner it had last (a gradient zero_grad freed after the optimizer's step)
            key = id(st)
            if live.get(key) is b:
                continue
            b.owner = self.compose(b, cats.get(key))
        by_aid = {b.alloc_id: b for b in pending}
        in_buf = set()
        buf = s.buf
        for i in range(len(buf)):
            r = buf[i]
            if r[EVENT] != Event.MALLOC:
                continue
            a = r[ATTR]
            if type(a) is tuple:
                b = by_aid.get(a[A_ALLOC_ID])
                if b is not None:
                    in_buf.add(a[A_ALLOC_ID])
                    if a[A_OWNER] != b.owner:
                        buf[i] = r[:ATTR] + (a[:A_OWNER] + (b.owner,) + a[A_OWNER + 1:],) + r[ATTR + 1:]
            elif isinstance(a, dict):
                b = by_aid.get(a.get("allocation_id"))
                if b is not None:
                    in_buf.add(b.alloc_id)
                    if a.get("owner") != b.owner:
                        buf[i] = r[:ATTR] + ({**a, "owner": b.owner},) + r[ATTR + 1:]
        for b in changed:
            if b.alloc_id not in in_buf and b.owner:
                self._owner_row(b)
        # forget what we knew about blocks that are gone
        if self.info or self._walked_by:
            alive = {b.alloc_id for b in live.values()}
            # snapshots (one C call each): other threads' ops add to them meanwhile (on_new)
            self.info = {k: v for k, v in list(self.info.items()) if k in alive}
            self._walked_by = {k: v for k, v in list(self._walked_by.items()) if k in alive}

    # ------------------------------------------------------------ FSDP2
    def _patch_fsdp2(self, pg_mod):
        self._fsdp2_wait = None
        labeler = self

        def wrap(name, comp, grads_arg=None):
            orig = getattr(pg_mod, name, None)
            if orig is None or getattr(orig, "_msmemscope", False):
                return

            @functools.wraps(orig)
            def wrapper(*a, **k):
                if grads_arg is not None and labeler.s.active:
                    grads = a[grads_arg] if len(a) > grads_arg else k.get("unsharded_grads", ())
                    try:
                        labeler.mark(grads, GRADIENT, ("fsdp2", "unsharded"))
                    except Exception:
                        pass
                prev = push_component(comp)
                try:
                    return orig(*a, **k)
                finally:
                    pop_component(prev)
            wrapper._msmemscope = True
            setattr(pg_mod, name, wrapper)
            self._patched.append((pg_mod, name, orig))

        wrap("foreach_all_gather", ("fsdp2", "all_gather"))
        wrap("foreach_reduce", ("fsdp2", "reduce_scatter"), grads_arg=1)


def _walked(owner):
    """The category a walk of the live objects gave a block labelled ``owner`` (weight, gradient,
    optimizer state), as ``compose``'s ``resolved``; None for any other. A user label added to a
    parameter keeps its category until the next walk says otherwise: composed without it, it was
    ``ops`` until then, and its OWNER rows flipped ops/weight at every step."""
    cat = category_of(owner)
    return (cat, ()) if cat in (WEIGHT, GRADIENT, OPT_STATE) else None


def walk_live_objects(roots, optimizers, add, trees=None):
    """``add(tensor, category, components)`` for every tensor the live objects say what it is:
    FSDP2's sharded / unsharded parameter storages first, then the parameters, buffers and grads
    of the modules that ran a forward, the parameters, grads and state of the optimizers that
    stepped. The first category given to a storage stays (a tensor given twice keeps its first)."""
    # one walk of each root's tree (it runs at every flush: ``parameters()``, ``buffers()`` and a
    # second ``parameters()`` for the grads would each walk it again)
    if trees is None:  # (``Labeler._trees``: the same lists, kept between walks)
        trees = [list(m.modules()) for m in roots]
    for mods in trees:  # FSDP2 first: its storages carry the sharded/unsharded component
        for sub in mods:
            get_state = getattr(sub, "_get_fsdp_state", None)
            if get_state is None:
                continue
            try:
                pg = get_state()._fsdp_param_group
                fps = pg.fsdp_params if pg is not None else ()
            except Exception:
                continue
            for fp in fps:
                for t in getattr(fp, "all_gather_outputs", ()) or ():
                    add(t, WEIGHT, ("fsdp2", "unsharded"))
                add(getattr(fp, "_sharded_param_data", None), WEIGHT, ("fsdp2", "sharded"))
                sp = getattr(fp, "sharded_param", None)
                if sp is not None:
                    add(sp, WEIGHT, ("fsdp2", "sharded"))
                    add(sp.grad, GRADIENT, ("fsdp2", "sharded"))
    for mods in trees:
        params = [p for sub in mods for p in sub._parameters.values() if p is not None]
        for p in params:
            add(p, WEIGHT)
        for sub in mods:
            for bf in sub._buffers.values():
                add(bf, WEIGHT)
        for p in params:
            add(p.grad, GRADIENT)
    for opt in list(optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                add(p, WEIGHT)
                add(p.grad, GRADIENT)
        for st in opt.state.values():
            if isinstance(st, dict):
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        add(v, OPT_STATE)


def _unpack(t):
    return t


# ---------------------------------------------------------------- our saved-tensor hooks step aside
# torch.func's transforms (grad, vjp, jacrev, hessian) refuse saved-tensor hooks: they disable them
# for their region (torch._C._autograd._saved_tensors_hooks_disable, which raises while any hook is
# on the thread's stack), so with ours pushed the program's torch.func.grad raised under
# --analysis=decompose. Ours step aside for such a region: popped at its disable, pushed again at
# the enable that ends it. What the region saves is not labelled ``activation``.
_our_unpacks: list = []        # the unpack hook of each pair of ours (pack hooks may be bound methods)
_aside = threading.local()     # .hooks: ours, popped by the disable of the region this thread is in
_torch_disable = _torch_enable = None


def push_saved_hooks(pack, unpack) -> bool:
    """Push our saved-tensor hooks on this thread where no hook is on it, or in place of ours (a
    labeller that follows another, the hand-over to the dispatch-mode source or a second
    framework-hooks install, stacked a second pair, and a torch.func region then raised, ours
    stepping aside only once). Never above the program's own hooks (ours would be what their
    context pops, and theirs would stay on), nor where the program disabled them. Whether pushed."""
    global _torch_disable, _torch_enable
    ag = torch._C._autograd
    try:
        if _ours_on_top() is not None:
            ag._pop_saved_tensors_default_hooks()
        elif ag._top_saved_tensors_default_hooks(False) is not None:
            return False
        ag._push_saved_tensors_default_hooks(pack, unpack)
    except Exception:  # disabled here now (a torch.func region)
        return False
    if not any(u is unpack for u in _our_unpacks):
        _our_unpacks.append(unpack)
    if _torch_disable is None and hasattr(ag, "_saved_tensors_hooks_disable"):
        _torch_disable, _torch_enable = ag._saved_tensors_hooks_disable, ag._saved_tensors_hooks_enable
        ag._saved_tensors_hooks_disable, ag._saved_tensors_hooks_enable = _disable_aside, _enable_back
    return True


def pop_saved_hooks(unpack) -> None:
    """Pop the hooks of ours with this unpack hook where they are on top of this thread's stack
    (or stepped aside: then they are not pushed back)."""
    aside = getattr(_aside, "hooks", None)
    if aside is not None and aside[1] is unpack:
        _aside.hooks = None
        return
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is not None and top[1] is unpack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
    except Exception:
        pass


def _ours_on_top():
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except Exception:
        return None
    if top is not None and any(top[1] is u for u in _our_unpacks):
        return top
    return None


def _disable_aside(*args, **kwargs):
    # torch's signature: (error_message, fail_if_non_empty=True), by position or by name
    fail = args[1] if len(args) > 1 else kwargs.get("fail_if_non_empty", True)
    if fail and getattr(_aside, "hooks", None) is None:
        top = _ours_on_top()
        if top is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            _aside.hooks = top
    return _torch_disable(*args, **kwargs)


def _enable_back(*args, **kwargs):
    out = _torch_enable(*args, **kwargs)
    hooks = getattr(_aside, "hooks", None)
    if hooks is not None:
        _aside.hooks = None
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
        except Exception:
            pass
    return out


def labeler_for(session):
    """The labeler of the source that follows the ops: the dispatch-mode source's blocks, or the
    native source's (by data pointer)."""
    return NativeLabeler(session) if session.native_ops else Labeler(session)


class _NB:
    """A native source's block as the labeler sees it (the C++ side table holds the rest)."""
    __slots__ = ("alloc_id", "pool")

    def __init__(self, alloc_id, pool):
        self.alloc_id, self.pool = alloc_id, pool


class NativeLabeler(Labeler):
    """Owner labels for the native source: the same rules and the same resolution from live
    objects, with blocks found by their storage's data pointer in the C++ side table (allocation
    ids) instead of the dispatch-mode source's registry. The user labels and framework
    components open on a thread reach the C++ allocator as a tag (``set_owner_tag``), so the
    allocation need not call Python; the tagged blocks are read at each flush."""

    # a step boundary's flush may wait for a later one (Session._may_wait): at_step_end keeps the
    # owners as they are at that step's end for the rows the later flush writes
    batch_steps = True
    # its before_flush can give the labels to the native source's drain (Session._drain_labelled)
    labels_at_drain = True

    def __init__(self, session):
        super().__init__(session)
        self.nat = session.native
        self.owner = {}        # alloc_id -> owner last written (or to be written) for a live block
        self.at_step = {}      # alloc_id -> owner given at a step end to a block whose MALLOC row waits
        self.tags = {}         # (users, component) -> tag
        self.tag_info = [None]
        # owning modules (module attribution): None lets capture/modules.py find them by data
        # pointer itself (ModuleTracker.owned_blocks through session.alloc_id_of)
        self.owned = None
        self._plain = {}       # (pool, resolved) -> owner of a block without Info (compose's answer)
        # the row loop of before_flush in C++ where built (MSMEMSCOPE_FOLD=python: this loop)
        self._relabel_rows = getattr(native.built_with("relabel_mallocs"), "relabel_mallocs", None)
        self._label_live_c = getattr(native.built_with("label_live"), "label_live", None)  # (_label_live's loop)
        self._walk = native.built_with("live_categories")  # the walk of the live objects in C++
        # with module attribution's C++ hooks (capture/modules.py), those hooks also keep the
        # forwards' depth and first allocation id for this labeller, and the saved-tensor pack hook
        # is C++: no Python per module call or saved tensor (None: this class's Python hooks)
        from . import modules
        self._cpp = modules.native_hooks() if modules.wanted(session.opts) else None
        self._cats_by_thread = {}  # each thread's last walk (``_mine``)
        self._walked = None  # the last step end's (thread, last allocation id before it, categories, live ids)
        self._plan = None    # ((thread, _version), [[weak module] per root], [weak optimizer]): _walk_plan

    def install(self):
        global _on_labels_changed
        super().install()
        if self._cpp is not None:
            self._cpp.mt_labeller(self._add_root, self._pack)
        _on_labels_changed = self._labels_changed
        self._labels_changed()

    def _module_hooks(self):
        if self._cpp is None:
            super()._module_hooks()
        else:
            self._mod_handles = []

    def _saved_hooks(self):
        return super()._saved_hooks() if self._cpp is None else (self._cpp.mt_pack, self._cpp.mt_unpack)

    def _forward(self):
        """(depth of the forwards running, first allocation id of the outermost one)."""
        if self._cpp is None:
            return self.depth, self.fwd_first_aid
        return self._cpp.mt_forward()

    def _take_saved(self):
        """The blocks the C++ pack hook saw saved for backward since the last call."""
        if self._cpp is None:
            return
        saved = self._cpp.mt_take_saved()
        if saved:
            self._walked = None  # labels may change: the step end's walk is no answer now
        for aid in saved:
            self._info_aid(aid).saved = True

    def remove(self):
        global _on_labels_changed
        if _on_labels_changed == self._labels_changed:
            _on_labels_changed = None
        try:
            self.nat.m.set_owner_tag(0)
        except Exception:
            pass
        if self._cpp is not None:
            self._cpp.mt_labeller(None, None)
        super().remove()

    def handed_over(self):
        """The session went over to the dispatch-mode source (watch): the rows so far are labelled
        here, then a ``Labeler`` over the dispatch source's blocks carries on with what was learnt
        (modules, optimizers, per-block facts by allocation id). Returns it."""
        try:
            self.before_flush()
        except Exception:
            pass
        self.remove()
        lab = Labeler(self.s)
        lab.roots, lab.optimizers, lab.info, lab.thread_of = self.roots, self.optimizers, self.info, self.thread_of
        lab.depth, lab.fwd_first_aid = self._forward()
        lab.updates, lab.flushed_upto = self.updates, self.flushed_upto
        lab.handed_owner = dict(self.owner)
        lab.install()
        return lab

    def _labels_changed(self):
        key = (current_labels(), getattr(_tls, "component", None) or ())
        tag = 0
        if key[0] or key[1]:
            tag = self.tags.get(key)
            if tag is None:
                tag = self.tags[key] = len(self.tag_info)
                self.tag_info.append(key)
        self.nat.m.set_owner_tag(tag)

    def _aid_of(self, t):
        st = _storage(t)
        if st is None:
            return None
        try:
            hit = self.nat.counted_block(st.data_ptr())
        except Exception:
            return None
        return hit[0] if hit is not None else None

    def _info_aid(self, aid):
        inf = self.info.get(aid)
        if inf is None:
            inf = self.info[aid] = Info()
        return inf

    def _next_alloc_id(self):
        return self.nat.m.last_alloc_id() + 1

    def _opt_post(self, opt, args, kwargs):
        self._opt_pre(opt, args, kwargs)  # resolved at the step end or flush (the native source counted its state)
        if backward_task() != -1:
            # the optimizer in backward (stepped from a post-accumulate-grad hook): its gradients
            # are freed before any step end or flush walks them, so they are said to be
            # gradients here, once each (before: temporaries at the backward's peak)
            self.mark([p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None], GRADIENT, ())

    def _pack(self, t):
        try:
            if self.s.active:
                has_fn = t.grad_fn is not None
                depth, first = self._forward()
                first = first if depth > 0 else None
                for aid in self.nat.m.block_ids(plain_tensors(t)):
                    if aid >= 0 and (has_fn or (first is not None and aid >= first)):
                        self._info_aid(aid).saved = True
        except Exception:
            pass
        return t

    def _relabel(self, aid, pool, resolved=None):
        """The block's owner now; an OWNER row when its MALLOC row is already written. ``resolved``:
        the category the last walk gave it, where it keeps that (``_walked``)."""
        new = self.compose(_NB(aid, pool), resolved)
        if self.owner.get(aid) != new:
            self.owner[aid] = new
            # its MALLOC row is written, or waits with the label a step end gave it
            if aid <= self.flushed_upto or aid in self.at_step:
                self._owner_rows([aid])

    def mark(self, tensors, category, comp):
        self._take_saved()
        for t in tensors:
            for p in plain_tensors(t):
                aid = self._aid_of(p)
                if aid is not None:
                    self._info_aid(aid).forced = (category, comp)
                    self._relabel(aid, self.nat.pool)

    def add_user_label(self, t, owner):
        self._take_saved()
        found = False
        for p in plain_tensors(t):
            aid = self._aid_of(p)
            if aid is None:
                continue
            found = True
            inf = self._info_aid(aid)
            if owner not in inf.users:
                inf.users = inf.users + (owner,)
            self._relabel(aid, self.nat.pool, _walked(self.at_step.get(aid) or self.owner.get(aid)))
        return found

    def _collect_native(self):
        """alloc_id -> (category, components) from the live objects (``Labeler._collect``'s walk); the
        tensors' blocks are looked up in one C++ call, and where it can the walk itself is C++
        (``live_categories``: plain tensors, no FSDP2; this walk is its reference)."""
        from .modules import by_thread, weights_of
        (roots, others), opts = by_thread(self.thread_of, list(self.roots)), self._mine(list(self.optimizers))
        if roots or opts:
            self._cats_by_thread[threading.get_ident()] = self._walk_live(roots, opts)
        got = all_threads(self._cats_by_thread)
        if others:  # other live threads' models: their parameters and buffers, below their own walks
            tensors = [p for _, t in weights_of(m for mods in self._trees(others) for m in mods)
                       for p in plain_tensors(t)]
            theirs = {aid: (WEIGHT, ()) for aid in self.nat.block_ids(tensors) if aid >= 0}
            got = {**theirs, **got}
        return got

    def _walk_plan(self):
        """This thread's walk, kept while nothing it depends on changes (``_version``): each root's
        modules and the optimizers, as weak references, where this thread runs every one of them
        (then ``_collect_native``'s preparation, by thread, is this); None otherwise, and
        ``(key, None, None)`` where the C++ walk could not take it."""
        me = threading.get_ident()
        plan = self._plan
        if plan is not None and plan[0] == (me, self._version):
            return plan
        self._plan = None
        if self._walk is None:
            return None
        roots, opts = list(self.roots), list(self.optimizers)
        if not (roots or opts) or not all_ran_here(self.thread_of, roots + opts, me):
            return None
        self._trees(roots)  # each root's modules, as weak references, in _subs
        self._plan = plan = ((me, self._version), [self._subs[id(r)][1] for r in roots],
                             [weakref.ref(o) for o in opts])
        return plan

    def _walk_all(self):
        """(categories, live ids) now: ``_collect_native``'s answer and the live blocks. Where the
        walk plan holds, one C++ call (``live_walks``) that also does module attribution's walk for
        this step end or flush (``ModuleTracker.walk_plan``: handed to it by ``took_walk``)."""
        plan = self._walk_plan()
        if plan is not None and plan[1] is not None:
            me = plan[0][0]
            tracker = getattr(self.s, "modules", None)
            tplan = tracker.walk_plan(me) if tracker is not None else None
            mark = self.nat.m.last_alloc_id()
            try:
                got = self._walk.live_walks(plan[1], plan[2], _CATEGORY_VALUES,
                                            tplan[0] if tplan is not None else None,
                                            tplan[1] if tplan is not None else [], OWNED_CATEGORIES)
            except Exception:
                got = None
            if got is not None and got[0] is not None:
                cats, owned, live = got
                self._cats_by_thread[me] = cats
                if tplan is not None and owned is not None:
                    tracker.took_walk(me, mark, owned)
                return all_threads(self._cats_by_thread), live
            # a module or optimizer gone: prepared again at the next walk; a walk C++ cannot take
            # (FSDP2, tensor subclasses): this thread's walks are Python's until the plan changes
            self._plan = None if got is None else (plan[0], None, None)
        try:
            cats = self._collect_native()
        except Exception:
            cats = {}
        return cats, self.nat.live_alloc_ids()

    def _walk_live(self, roots, opts):
        if self._walk is not None:
            got = self._walk.live_categories(self._trees(roots), opts, _CATEGORY_VALUES)
            if got is not None:
                return got
        tensors, meta = [], []

        def add(t, cat, comp=()):
            if t is None:
                return
            for p in plain_tensors(t):
                tensors.append(p)
                meta.append((cat, comp))

        walk_live_objects(roots, opts, add, self._trees(roots))
        out = {}
        for aid, cc in zip(self.nat.block_ids(tensors), meta):
            if aid >= 0 and aid not in out:  # the first category given stays
                out[aid] = cc
        return out

    def _owner_of(self, aid, pool, resolved):
        """``compose`` of a block; a block we know nothing particular of (most) from a cache."""
        if aid in self.info:
            return self.compose(_NB(aid, pool), resolved)
        key = (pool, resolved)
        o = self._plain.get(key)
        if o is None:
            o = self._plain[key] = self.compose(_NB(aid, pool), resolved)
        return o

    def _take_facts(self):
        """The tags (user labels, components) and the saved-for-backward marks the C++ side
        gathered since the last call, into ``info``."""
        tagged = self.nat.m.take_tagged()
        if tagged:
            self._walked = None  # labels may change: the step end's walk is no answer now
        for aid, tag in tagged:
            users, comp = self.tag_info[tag]
            inf = self._info_aid(aid)
            inf.users, inf.comp = users, comp
        self._take_saved()

    def _label_live(self, prev_upto, at_step_end=False):
        """The owner of every live block now, from the live objects. Returns (categories, live ids,
        the blocks whose label changed after their MALLOC row got one: written at an earlier flush,
        ids up to ``prev_upto``, or given at a step end since, ``at_step``)."""
        cats, live = self._walk_all()
        pool = self.nat.pool
        owner, at_step = self.owner, self.at_step
        owner_of = self._owner_of
        get_cat = cats.get
        changed, rest = [], live
        if self._label_live_c is not None:
            # the blocks nothing particular is known of in C++; the others below
            changed, rest = self._label_live_c(live, owner, at_step, self.info, cats, self._plain, pool,
                                               prev_upto, at_step_end)
        for aid in rest:
            new = owner_of(aid, pool, get_cat(aid))
            if owner.get(aid) != new:
                owner[aid] = new
                if aid <= prev_upto or aid in at_step:
                    changed.append(aid)
                elif at_step_end:
                    at_step[aid] = new  # the label its MALLOC row gets at the flush
        return cats, live, changed

    def _owner_rows(self, aids):
        for aid in aids:
            self._emit_owner(aid, self.owner[aid])

    def at_step_end(self):
        """A step ended and its flush waits: label the live blocks as they are now, as that step's
        flush would have (the rows keep these labels when the blocks are gone by the flush), with
        an OWNER row now for a block whose label changed after its MALLOC row got one."""
        mark = self.nat.m.last_alloc_id()  # before the walk: a block made during it is not in it
        self._take_facts()
        cats, live, changed = self._label_live(self.flushed_upto, at_step_end=True)
        self._owner_rows(changed)
        self._walked = (threading.get_ident(), mark, cats, live)

    def before_flush(self, drain=None):
        """Label the MALLOC rows of this flush. ``drain`` (the session's labelled drain, where it can):
        called as ``drain(owners, in_buf, relabel_waiting)`` after the walk, it makes the native
        source's rows with these labels (``owners``: the spec of the native ``label_batch``) and
        calls ``relabel_waiting()`` first, this loop over the rows already in the buffer; it returns
        the last allocation id when the records were taken. Without it the records are drained
        into tuples first and every MALLOC row of the buffer is relabelled here."""
        s = self.s
        nat = self.nat
        # the last id before the walk: every block up to it has its MALLOC row in the buffer after
        # the drain (one made after the drain waits for the next flush, where it is labelled as new)
        upto = nat.m.last_alloc_id()
        if drain is None:
            s.sync_sources()   # the native MALLOC rows into the buffer, to be labelled there
        self._take_facts()
        prev_upto, self.flushed_upto = self.flushed_upto, upto
        walked, self._walked = self._walked, None
        if walked is not None and walked[0] == threading.get_ident() and walked[1] == upto:
            # this thread's step end labelled every live block just now and nothing was allocated or
            # learnt since (a flush right after its step end): the same walk would change nothing
            cats, live, changed = walked[2], walked[3], []
        else:
            cats, live, changed = self._label_live(prev_upto)
        pool = nat.pool
        owner_of = self._owner_of
        get_cat = cats.get
        # a block labelled at a step end since the last flush: its MALLOC row (in the buffer) gets
        # that label; a later change is an OWNER row after it
        at_step, self.at_step = self.at_step, {}
        owner = {**self.owner, **at_step} if at_step else self.owner
        in_buf = set()
        plain = owner_of(-1, pool, None)  # a block freed since its MALLOC that nothing is known of (no Info has id -1)
        if drain is None:
            self._relabel_waiting(owner, cats, plain, in_buf, prev_upto)
        else:
            # settled: no OWNER row follows this drain (no label changed after its MALLOC row got one),
            # so which ids it labels is not wanted (in_buf None)
            last = drain((owner, self.info, cats, plain, prev_upto, lambda aid: owner_of(aid, pool, get_cat(aid))),
                         in_buf if changed else None,
                         lambda: self._relabel_waiting(owner, cats, plain, in_buf, prev_upto), not changed)
            if last is not None and last > upto:
                # blocks made after the walk whose MALLOC rows this drain took: written now, so a
                # later change of their label is an OWNER row
                self.flushed_upto = last
        now = self.owner
        self._owner_rows([aid for aid in changed if aid not in in_buf or at_step.get(aid, now[aid]) != now[aid]])
        # forget what we knew about blocks that are gone (blocks made after the walk are kept)
        if len(now) > len(live):
            self.owner = {k: v for k, v in list(now.items()) if k in live}
        if self.info:
            # a snapshot: the program's threads add to it meanwhile (user labels, the Python pack hook)
            self.info = {k: v for k, v in list(self.info.items()) if k in live or k > upto}

    def _relabel_waiting(self, owner, cats, plain, in_buf, prev_upto):
        """The owner label of each MALLOC row in the buffer (``owner``, else ``owner_of``'s answer);
        each id labelled goes into ``in_buf``."""
        buf = self.s.buf
        if not buf:
            return
        pool = self.nat.pool
        owner_of = self._owner_of
        get_cat = cats.get
        malloc = Event.MALLOC
        if self._relabel_rows is not None:
            # the loop below in C++ for the rows it can take (tuple attrs, blocks whose label is
            # known); it hands back the others, which take this loop
            rows = self._relabel_rows(buf, owner, self.info, cats, plain,
                                      in_buf, prev_upto, (malloc, EVENT, ATTR, A_ALLOC_ID, A_OWNER))
        else:
            rows = range(len(buf))
        for i in rows:
            r = buf[i]
            if r[EVENT] != malloc:
                continue
            a = r[ATTR]
            aid = a[A_ALLOC_ID] if type(a) is tuple else a.get("allocation_id") if isinstance(a, dict) else None
            if aid is None:
                continue
            new = owner.get(aid)
            if new is None:
                if aid <= prev_upto:  # labelled at an earlier flush (a held step's rows), freed since
                    continue
                new = owner_of(aid, pool, get_cat(aid))  # freed since it was made
            in_buf.add(aid)
            if type(a) is tuple:
                if a[A_OWNER] != new:
                    buf[i] = r[:ATTR] + (a[:A_OWNER] + (new,) + a[A_OWNER + 1:],) + r[ATTR + 1:]
            elif a.get("owner") != new:
                buf[i] = r[:ATTR] + ({**a, "owner": new},) + r[ATTR + 1:]
