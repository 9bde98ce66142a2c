"""The data behind the report's views, computed from ``read_dump`` columns (polars).

- ``layers``: what each block is (its owner category: weights, gradients, optimizer
  state, activations, temporaries, a user label, a framework component), else the op
  that made it; ``layer_frame`` gives every MALLOC/FREE row its layer and signed size.
- ``timeline``: per (device, pool), memory over time at several zoom levels. Level k
  cuts the run into ``BASE_BUCKETS * FACTOR**k`` time buckets; each bucket keeps the
  min and max of ``used`` and, at its max row, the bytes of every layer (so the stack
  adds up to the allocated bytes there). Levels stop when a bucket holds about one
  event or the point budget is spent: the page never gets every event.
- ``live``: the live blocks at sampled moments (each level-0 bucket's peak row, every
  step end, the peak itself), as one tree leaf per (Python stack, op, layer) with
  its bytes at each moment, change points only.
- ``compare_steps``: per op, bytes allocated in each step.
- ``findings``: the analyses' results as sentences with units, the user's line and
  the moment they belong to.
"""
from __future__ import annotations

import json
import os

import numpy as np
import polars as pl

from ..frames import user_line
from .common import human_bytes, short_op

BASE_BUCKETS = 1200
FACTOR = 4
MAX_LEVELS = 6
POINT_BUDGET = 36_000      # buckets of all levels of all series together
MAX_LAYERS = 10
LIVE_SAMPLES = 240         # moments sampled for the live view (plus steps and the peak)
MAX_STEP_SAMPLES = 200
LIVE_BUDGET = 120_000      # (leaf, moment) change points
MAX_LEAVES = 2500
MAX_FRAMES = 12            # innermost frames kept per stack in the flame graph
COMPARE_OPS = 80
COMPARE_STEPS = 400

CATEGORY_NAMES = {"weight": "weights", "gradient": "gradients", "optimizer_state": "optimizer state",
                  "activation": "activations", "ops": "temporaries"}
CATEGORY_ORDER = ["weights", "gradients", "optimizer state", "activations", "temporaries"]
FRAMEWORKS = {"fsdp", "fsdp2", "ddp", "deepspeed", "megatron", "vllm", "mindspeed", "zero"}
UNACCOUNTED = "(before the trace)"
OTHER_OPS = "(other ops)"


# ---------------------------------------------------------------- layers
def layer_of_owner(owner: str | None) -> str | None:
    """The stacked-chart layer of an owner chain ``<pool>@<category>[@component..][@label..]``:
    a user label first (what the user named it), then a framework component, then the category."""
    if not owner:
        return None
    parts = [p for p in str(owner).split("@") if p]
    if len(parts) < 2:
        return CATEGORY_NAMES.get(parts[0], parts[0]) if parts else None
    cat, rest = parts[1], parts[2:]
    comp, users = [], rest
    if rest and rest[0].lower() in FRAMEWORKS:
        comp, users = rest[:2], rest[2:]
    if users:
        return "label: " + users[-1]
    if comp:
        return " ".join(comp)
    return CATEGORY_NAMES.get(cat, cat)


def final_owners(df: pl.DataFrame) -> pl.DataFrame | None:
    """(device, event_type, alloc_id) -> the block's last owner (MALLOC owner, then SYSTEM/OWNER updates)."""
    if "owner" not in df.columns:
        return None
    df = df.select(c for c in ("id", "event", "event_type", "owner", "alloc_id", "device") if c in df.columns)
    rows = df.filter(pl.col("owner").is_not_null() & (pl.col("owner") != "") & pl.col("alloc_id").is_not_null()
                     & (pl.col("event").is_in(["MALLOC"]) | ((pl.col("event") == "SYSTEM")
                                                            & (pl.col("event_type") == "OWNER"))))
    if not rows.height:
        return None
    upd = rows.filter(pl.col("event") == "SYSTEM").select("id", "alloc_id", "owner")
    only_malloc = not rows.select((pl.col("event") == "SYSTEM").any()).item()
    first = (rows if only_malloc else rows.filter(pl.col("event") == "MALLOC")).select(
        "id", "alloc_id", "device", pool=pl.col("event_type"), owner="owner")
    if upd.height:
        # an update row names the allocation only: it applies to the block of that id on any pool
        mal = df.filter(pl.col("event") == "MALLOC").select("alloc_id", "device", pool=pl.col("event_type"))
        upd = upd.join(mal, on="alloc_id", how="inner").select("id", "alloc_id", "device", "pool", "owner")
        first = pl.concat([first, upd], how="vertical_relaxed")
    if not upd.height and _all_distinct(first["alloc_id"]):
        return first.select("device", "pool", "alloc_id", "owner")  # one owner per block: no grouping
    return (first.sort("id").group_by("device", "pool", "alloc_id").agg(owner=pl.col("owner").last()))


def _all_distinct(ids: pl.Series) -> bool:
    """No value twice (``ids`` has no nulls): a count per id where ids are small numbers."""
    lo, hi = ids.min(), ids.max()
    if lo is not None and lo >= 0 and hi <= 8 * ids.len() + (1 << 20):
        return bool(np.bincount(ids.to_numpy()).max() <= 1)
    return bool(ids.is_unique().all())


def last_row_of(keys: pl.Series, query: pl.Series) -> pl.Series:
    """For each value of ``query``, the index in ``keys`` of the last row holding it (null where
    none; a null never matches). Allocation ids are small numbers: a table indexed by id (numpy)
    does it in one pass each way; other ids go through a join."""
    kn = keys.fill_null(-1).to_numpy()
    qn = query.fill_null(-1).to_numpy()
    lo = min(int(kn.min(initial=0)), int(qn.min(initial=0)))
    hi = max(int(kn.max(initial=-1)), int(qn.max(initial=-1)))
    if lo >= -1 and hi <= 8 * (len(kn) + len(qn)) + (1 << 20):
        table = np.full(hi + 2, -1, dtype=np.int64)
        np.maximum.at(table, kn + 1, np.arange(len(kn), dtype=np.int64))  # the last row wins
        table[0] = -1  # null keys
        pos = table[qn + 1]
        return pl.Series(pos).set(pl.Series(pos < 0), None) if (pos < 0).any() else pl.Series(pos)
    k = pl.DataFrame({"k": keys}).with_row_index("i").drop_nulls("k").unique("k", keep="last")
    return (pl.DataFrame({"k": query}).join(k, on="k", how="left", maintain_order="left")["i"]
            .cast(pl.Int64))


def layer_frame(mem: pl.DataFrame, owners: pl.DataFrame | None) -> tuple[pl.DataFrame, list[str], str]:
    """One (device, pool) series' MALLOC/FREE rows (in order) with ``layer`` (index into the
    returned names) and ``signed`` (+size for MALLOC, -size for FREE); ``by`` says what the
    layers are ("owner" or "op")."""
    mem = mem.with_row_index("r")
    mal = mem.select("event", "op", "alloc_id", "size").filter(pl.col("event") == "MALLOC")
    by = "op"
    lab = mal["op"].cast(pl.Categorical).fill_null("(outside any op)")
    if owners is not None:
        dev, pool = mem["device"][0], mem["event_type"][0]
        own = owners.filter((pl.col("device") == dev) & (pl.col("pool") == pool))
        if own.height:
            by = "owner"
            names = {o: layer_of_owner(o) for o in own["owner"].cast(pl.String).unique().to_list()}
            own_lab = (own["owner"].cast(pl.String).replace_strict(names, default=None, return_dtype=pl.String)
                       .cast(pl.Categorical))
            lab = own_lab.gather(last_row_of(own["alloc_id"], mal["alloc_id"])).fill_null("temporaries")
    # every row takes the label and the size of its block's last MALLOC row
    at = last_row_of(mal["alloc_id"], mem["alloc_id"])
    m = mem.with_columns(lab=lab.gather(at).fill_null("temporaries" if by == "owner" else OTHER_OPS)
                         .cast(pl.Categorical), msize=mal["size"].gather(at))
    m = m.with_columns(signed=pl.when(pl.col("event") == "MALLOC").then(pl.col("size"))
                       .otherwise(-pl.coalesce("size", "msize")).fill_null(0)).drop("msize")
    # the layers, largest peak first; the rest of the ops folded into one
    # (grouped on the label's code: a categorical's values cost more to group on)
    peaks = _label_peaks(m["lab"], m["signed"]).sort("p", "lab", descending=[True, False])
    names = peaks["lab"].to_list()
    code_of = dict(zip(names, peaks["code"].to_list()))
    if by == "owner":
        rank = {n: i for i, n in enumerate(names)}
        names = sorted(names, key=lambda n: (CATEGORY_ORDER.index(n) if n in CATEGORY_ORDER else len(CATEGORY_ORDER),
                                             rank[n]))
        keep = names[:MAX_LAYERS]
        other = "(other owners)"
    else:
        keep = [n for n in names if n != OTHER_OPS][:MAX_LAYERS - 1]
        other = OTHER_OPS
    fold = [n for n in names if n not in keep]
    if fold:
        keep.append(other)
    index = {n: i for i, n in enumerate(keep)}
    m = m.with_columns(layer=pl.col("lab").to_physical().replace_strict(
        {code_of[n]: i for n, i in index.items() if n in code_of}, default=index.get(other, 0), return_dtype=pl.Int32))
    # blocks made before the trace (the original's ``used`` counts them): a bottom layer of their own
    acc = m["signed"].cum_sum()
    gap = (m["used"] - acc) if "used" in m.columns else None
    if gap is not None and gap.drop_nulls().len() and int(gap.drop_nulls().abs().max() or 0) > 0:
        keep.append(UNACCOUNTED)
        m = m.with_columns(gap=gap.fill_null(0))
    return m, keep, by


def _label_peaks(lab: pl.Series, signed: pl.Series) -> pl.DataFrame:
    """Per distinct value of ``lab`` (a categorical without nulls): its code, itself, and the
    greatest running sum of ``signed`` over its rows (in row order). numpy: one stable sort by
    label (a radix sort of small integers), one cumulative sum, a maximum per run."""
    code = lab.to_physical()
    dense, n = _dense(code)
    if n >= (1 << 15) or not len(dense):
        return (pl.DataFrame({"code": code, "lab": lab, "s": signed})
                .group_by("code").agg(pl.col("lab").first(), p=pl.col("s").cum_sum().max()))
    order = np.argsort(dense.astype(np.int16), kind="stable")
    ds = dense[order]
    starts = np.flatnonzero(np.r_[True, ds[1:] != ds[:-1]])
    run = np.cumsum(signed.to_numpy()[order])
    before = np.r_[0, run[starts[1:] - 1]]  # the running sum up to each label's first row
    peak = np.maximum.reduceat(run, starts) - before
    firsts = order[starts]
    return pl.DataFrame({"code": code.gather(firsts), "lab": lab.gather(firsts), "p": peak})


class LayerIndex:
    """Per layer, its rows and its running bytes: the bytes of every layer just after any row
    come from one binary search per layer (numpy), however many rows are asked for."""

    def __init__(self, m: pl.DataFrame, names: list[str]):
        self.names = names
        r = m["r"].to_numpy()
        layer = m["layer"].to_numpy()
        signed = m["signed"].to_numpy()
        self.rows, self.run = [], []
        for i, name in enumerate(names):
            if name == UNACCOUNTED:
                self.rows.append(r)
                self.run.append(m["gap"].to_numpy())
                continue
            sel = layer == i
            self.rows.append(r[sel])
            self.run.append(np.cumsum(signed[sel]))

    def at(self, rows) -> list[list[int]]:
        rows = np.asarray(rows, dtype=np.int64)
        out = []
        for rs, run in zip(self.rows, self.run):
            if not len(rs):
                out.append([0] * len(rows))
                continue
            k = np.searchsorted(rs, rows, side="right") - 1
            out.append(np.where(k >= 0, run[np.maximum(k, 0)], 0).astype(np.int64).tolist())
        return out


def delta(xs):
    """Delta-encode a list of ints (the page decodes with a running sum): small numbers, small JSON."""
    if isinstance(xs, pl.Series):
        xs = xs.fill_null(0).to_numpy()
    elif not isinstance(xs, np.ndarray):
        xs = np.asarray([int(x or 0) for x in xs], dtype=np.int64)
    return np.diff(xs.astype(np.int64, copy=False), prepend=np.int64(0)).tolist()


# ---------------------------------------------------------------- timeline
def timeline(m: pl.DataFrame, names: list[str], t0: int, span: int, budget: int,
             index: LayerIndex | None = None) -> dict:
    """The zoom levels of one series (``m`` from ``layer_frame``); times in µs from ``t0``."""
    levels = []
    n_events = m.height
    nb = BASE_BUCKETS
    index = index or LayerIndex(m, names)
    op_list: list[str] = []
    spent = 0
    # the finest level the budget can reach (spent >= 0), bucketed once over every row; a coarser
    # level's bucket is FACTOR**k of its buckets (b // FACTOR**k, exactly, while no time is
    # clipped), so its figures come from the finest level's, not from the rows again
    finest = 0
    while finest < MAX_LEVELS - 1 and min(n_events, BASE_BUCKETS * FACTOR ** (finest + 1)) <= budget:
        finest += 1
    rel = m.select(lo=(pl.col("ts") - t0).min(), hi=(pl.col("ts") - t0).max()).row(0)
    fine = None
    if rel[0] is not None and rel[0] >= 0 and rel[1] < span and finest > 0:
        nf = BASE_BUCKETS * FACTOR ** finest
        fine = (m.select(b=(pl.col("ts") - t0) * nf // span, used="used", r="r", total="total")
                .group_by("b").agg(lo=pl.col("used").min(), hi=pl.col("used").max(),
                                   r=pl.col("r").get(pl.col("used").arg_max()),
                                   total=pl.col("total").max(), n=pl.len()))
    for level in range(MAX_LEVELS):
        if fine is not None and level <= finest:
            # the first row at the bucket's max: the least r among its finer buckets at that max
            g = (fine.group_by(b=pl.col("b") // FACTOR ** (finest - level))
                 .agg(lo=pl.col("lo").min(), r=pl.col("r").filter(pl.col("hi") == pl.col("hi").max()).min(),
                      hi=pl.col("hi").max(), total=pl.col("total").max(), n=pl.col("n").sum())
                 .sort("b"))
        else:
            b = ((pl.col("ts") - t0) * nb // span).clip(0, nb - 1)
            g = (m.with_columns(b=b).group_by("b")
                 .agg(lo=pl.col("used").min(), hi=pl.col("used").max(),
                      r=pl.col("r").get(pl.col("used").arg_max()),
                      total=pl.col("total").max(), n=pl.len())
                 .sort("b"))
        at = m.select("ts", "op")[g["r"].to_numpy()]
        vals = index.at(g["r"].to_numpy())
        total = g["total"]
        has_total = total.drop_nulls().len() > 0 and bool(((total.fill_null(g["hi"]) - g["hi"]) != 0).any())
        ops = at["op"].fill_null("")
        op_names = sorted(set(ops.unique().to_list()) | set(op_list))
        if op_names != op_list:
            op_list[:] = op_names
        levels.append({
            "buckets": nb, "span_us": round(span / 1000 / nb, 3),
            "t": delta((at["ts"] - t0) // 1000),
            "hi": delta(g["hi"]), "lo": delta(g["lo"]),
            "total": delta(total.fill_null(g["hi"])) if has_total else None,
            "layers": [delta(v) for v in vals],
            "op": ops, "n": g["n"].cast(pl.Int64).to_list(),  # op names -> indexes into "ops" below
        })
        spent += g.height
        # stop when a bucket holds about one event, or the next level would pass the budget
        if g.height >= 0.8 * n_events or spent + min(n_events, nb * FACTOR) > budget:
            break
        nb *= FACTOR
    op_index = {o: i for i, o in enumerate(op_list)}
    for lv in levels:
        lv["op"] = [op_index[o] for o in lv["op"].to_list()]
    return {"levels": levels, "ops": op_list}


# ---------------------------------------------------------------- stacks
def split_stack(stack: str | None) -> list[str]:
    """Frames outermost first, without our own package's frames, at most MAX_FRAMES innermost."""
    if not stack or stack == "N/A":
        return []
    frames = [f.strip() for f in stack.split(";") if f.strip() and "/msmemscope/" not in f]
    frames.reverse()
    return frames[-MAX_FRAMES:]


def frame_label(fr: str) -> str:
    loc, _, func = fr.partition("(")
    func = func[:-1] if func.endswith(")") else func
    path, _, line = loc.rpartition(":")
    return f"{func or '?'} ({os.path.basename(path) or loc}:{line})" if path else fr


# ---------------------------------------------------------------- live at a moment
def live(m: pl.DataFrame, names: list[str], by: str, t0: int, peak_r: int, step_rows: list[tuple[int, int]]) -> dict:
    """The live blocks at sampled moments, as flame-graph leaves.

    Leaves: (Python stack, op, layer) of each block; ``values`` of leaf i are change
    points ``[moment index, bytes live from that moment on, ...]``."""
    mal = m.select(c for c in ("event", "alloc_id", "py_stack", "op", "layer", "module") if c in m.columns) \
        .filter(pl.col("event") == "MALLOC")
    stacks = mal["py_stack"].drop_nulls() if "py_stack" in m.columns else pl.Series([], dtype=pl.String)
    has_stacks = bool(stacks.filter((stacks != "N/A") & (stacks != "")).len())
    # the module each block was made in (format 2 dumps with module attribution): the page can group by it
    has_modules = "module" in mal.columns and bool(mal["module"].drop_nulls().len())
    cols = mal.select(stack=pl.col("py_stack").cast(pl.Categorical) if has_stacks else pl.lit(None, pl.Categorical),
                      op=pl.col("op").cast(pl.Categorical).fill_null("(outside any op)"), layer="layer",
                      module=pl.col("module").cast(pl.Categorical) if has_modules else pl.lit(None, pl.Categorical))
    # leaves in the order their first block was made; each row counts for its block's last MALLOC
    leaf_keys, mal_leaf = _leaves(cols)
    ev = m.select("r", "signed").with_columns(leaf=mal_leaf.gather(last_row_of(mal["alloc_id"], m["alloc_id"])))
    ev = ev.filter(pl.col("leaf").is_not_null())

    # moments: level-0-like bucket peaks, step ends, the peak
    n = m.height
    ts = m["ts"]
    span = max(1, int(ts.max()) - int(ts.min()) + 1)
    tmin = int(ts.min())

    # the peak row of each of LIVE_SAMPLES time buckets, in one pass; a coarser bucketing (k a
    # power-of-two fraction of it) is the finer one's buckets taken in runs of LIVE_SAMPLES // k
    g = (m.select(b=((pl.col("ts") - tmin) * LIVE_SAMPLES // span).clip(0, LIVE_SAMPLES - 1), r="r", used="used")
         .group_by("b").agg(r=pl.col("r").get(pl.col("used").arg_max()), hi=pl.col("used").max()))
    gb, gr, ghi = g["b"].to_numpy(), g["r"].to_numpy(), g["hi"].to_numpy()

    def sample_rows(k):
        cb = gb // (LIVE_SAMPLES // k)
        order = np.lexsort((gr, -ghi, cb))  # per coarse bucket: the highest, the first row of a tie
        first = order[np.r_[True, cb[order][1:] != cb[order][:-1]]]
        rows = set(gr[first].tolist())
        rows.add(peak_r)
        rows.add(n - 1)
        step_sel = step_rows[-MAX_STEP_SAMPLES:]
        rows.update(r for _, r in step_sel if r is not None and r >= 0)
        return sorted(rows)

    k = LIVE_SAMPLES
    n_leaves = leaf_keys.height
    ev_r, ev_leaf = ev["r"].to_numpy(), ev["leaf"].to_numpy().astype(np.int64)
    # Every coarser sampling's moments are some of the finest one's (each coarse bucket's peak is
    # one of its fine buckets' peaks), so the events are summed once per (leaf, finest moment) and
    # each try maps those sums to its own moments: the first of its moments at or after a fine
    # one is the first at or after each of that moment's events.
    fine_rows = np.asarray(sample_rows(k), dtype=np.int64)
    fw = len(fine_rows) + 1
    fine = (pl.DataFrame({"k": ev_leaf * fw + np.searchsorted(fine_rows, ev_r, side="left"),
                          "signed": ev["signed"].to_numpy()})
            .group_by("k").agg(d=pl.col("signed").sum()))
    f_key = fine["k"].to_numpy()
    f_leaf, f_j, f_d = f_key // fw, f_key % fw, fine["d"].to_numpy()
    while True:
        rows = sample_rows(k)
        srows = np.asarray(rows, dtype=np.int64)
        j = np.r_[np.searchsorted(srows, fine_rows, side="left"), len(rows)][f_j]
        inside = j < len(rows)
        # change points this sampling makes: the (leaf, moment) pairs, counted before they are built
        pairs = _distinct(f_leaf[inside] * (len(rows) + 1) + j[inside], n_leaves * (len(rows) + 1))
        if pairs <= LIVE_BUDGET or k <= 30:
            break
        k //= 2
    # one integer key per (leaf, moment): a single-column group_by, sorted by leaf then moment
    width = len(rows) + 1
    cp = (pl.DataFrame({"k": f_leaf[inside] * width + j[inside], "signed": f_d[inside]})
          .group_by("k").agg(d=pl.col("signed").sum()).sort("k")
          .select(leaf=(pl.col("k") // width).cast(ev["leaf"].dtype), j=pl.col("k") % width, d="d")
          .with_columns(v=pl.col("d").cum_sum().over("leaf")))
    # the biggest leaves only; the rest folded into one leaf per layer
    big = cp.group_by("leaf").agg(p=pl.col("v").max()).sort("p", descending=True)
    keep = set(big.head(MAX_LEAVES)["leaf"].to_list())
    leaves = leaf_keys.filter(pl.col("leaf").is_in(list(keep)))
    small = big.height > len(keep)
    frame_ids: dict = {}
    frames: list = []

    def fid(label, full):
        i = frame_ids.get(label)
        if i is None:
            i = frame_ids[label] = len(frames)
            frames.append([label, full])
        return i

    out_leaves, remap = [], {}
    for leaf, stack, op, layer, module in leaves.select("leaf", "stack", "op", "layer", "module").iter_rows():
        path = []
        if has_stacks:
            fr = split_stack(stack)
            path = [fid(frame_label(f), f) for f in fr] if fr else [fid("(no Python stack)", "")]
        elif by == "owner":
            path = [fid(names[layer], "")]
        path.append(fid(short_op(op), ""))
        remap[leaf] = len(out_leaves)
        out_leaves.append({"path": path, "layer": int(layer), "line": user_line(stack) if stack else None,
                           "module": module})
    if small:
        cp_small = cp.filter(~pl.col("leaf").is_in(list(keep))).join(
            leaf_keys.select("leaf", "layer"), on="leaf").group_by("layer", "j").agg(d=pl.col("d").sum()).sort(
            "layer", "j").with_columns(v=pl.col("d").cum_sum().over("layer"))
        for layer in cp_small["layer"].unique().sort().to_list():
            remap[("small", layer)] = len(out_leaves)
            out_leaves.append({"path": [fid(names[layer], ""), fid("(small blocks)", "")], "layer": int(layer),
                               "line": None, "module": None})
    values = [[] for _ in out_leaves]

    def pairs(frame, by):
        # each leaf's (moment, bytes) change points, flattened in moment order
        g = (frame.select(by, p=pl.concat_list(pl.col("j").cast(pl.Int64), pl.col("v").cast(pl.Int64)))
             .group_by(by, maintain_order=True).agg(pl.col("p").list.explode(keep_nulls=False, empty_as_null=False)))
        return zip(g[by].to_list(), g["p"].to_list())
    for leaf, vs in pairs(cp.filter(pl.col("leaf").is_in(list(keep))), "leaf"):
        values[remap[leaf]] = vs
    if small:
        for layer, vs in pairs(cp_small, "layer"):
            values[remap[("small", layer)]] = vs
    for lf, v in zip(out_leaves, values):
        lf["v"] = v
    srow = m.select("ts", "used", "step")[np.asarray(rows, dtype=np.int64)]  # r is the row's index
    return {"has_stacks": has_stacks, "has_modules": has_modules, "by": by, "frames": frames, "leaves": out_leaves,
            "t": ((srow["ts"] - t0) // 1000).to_list(), "used": srow["used"].fill_null(0).to_list(),
            "step": srow["step"].fill_null(0).to_list(),
            "peak": rows.index(peak_r),
            "step_end": {str(s): rows.index(r) for s, r in step_rows[-MAX_STEP_SAMPLES:] if r in set(rows)}}


def _dense(s: pl.Series) -> tuple[np.ndarray, int]:
    """Small integers ``0..n-1`` standing for the values of ``s`` (a categorical's codes or
    integers; null one value of its own), and ``n``."""
    c = (s.to_physical() if s.dtype == pl.Categorical else s).cast(pl.Int64)
    lo = c.min()
    if lo is None:
        return np.zeros(len(c), dtype=np.int64), 1
    c = c.fill_null(lo - 1).to_numpy()
    lo, hi = int(c.min()), int(c.max())
    if hi - lo > 8 * len(c) + (1 << 20):
        uniq, inv = np.unique(c, return_inverse=True)
        return inv.astype(np.int64), len(uniq)
    present = np.zeros(hi - lo + 1, dtype=bool)
    present[c - lo] = True
    lut = np.cumsum(present) - 1
    return lut[c - lo], int(present.sum())


def _leaves(cols: pl.DataFrame) -> tuple[pl.DataFrame, pl.Series]:
    """The distinct rows of ``cols`` in the order of their first row, numbered (``leaf``), and
    each row's number. On one integer key made of the columns' dense codes (a bitmap-sized table
    where the combinations are few), else a hash of the codes."""
    key = list(cols.columns)
    dense = [_dense(cols[c]) for c in key]
    bound = 1
    for _, n in dense:
        bound *= n
    if bound <= (64 << 20):
        k = np.zeros(cols.height, dtype=np.int64)
        for codes, n in dense:
            k = k * n + codes
        first = np.full(bound, cols.height, dtype=np.int64)
        np.minimum.at(first, k, np.arange(cols.height, dtype=np.int64))
        seen = np.flatnonzero(first < cols.height)
        order = seen[np.argsort(first[seen], kind="stable")]
        number = np.full(bound, -1, dtype=np.int64)
        number[order] = np.arange(len(order), dtype=np.int64)
        return (cols[first[order]].with_row_index("leaf"),
                pl.Series("leaf", number[k]).cast(pl.UInt32))
    codes = cols.select(pl.col(c).to_physical() for c in key)
    firsts = codes.with_row_index("i").unique(subset=key, keep="first", maintain_order=True).with_row_index("leaf")
    return (cols[firsts["i"]].with_row_index("leaf"),
            codes.join(firsts.drop("i"), on=key, how="left", nulls_equal=True, maintain_order="left")["leaf"])


def _distinct(keys: np.ndarray, bound: int) -> int:
    """How many distinct values ``keys`` (integers in ``[0, bound)``) holds: a bitmap where it is
    small, else a hash."""
    if bound <= (256 << 20):
        seen = np.zeros(bound, dtype=bool)
        seen[keys] = True
        return int(np.count_nonzero(seen))
    return pl.Series(keys).n_unique()


# ---------------------------------------------------------------- compare two steps
def compare_steps(df: pl.DataFrame) -> dict | None:
    """Per op, the bytes and blocks each step allocated (the page shows two steps side by side)."""
    mal = df.select("event", "step", "op", "size").filter(pl.col("event") == "MALLOC")
    if not mal.height:
        return None
    steps = mal["step"].unique().sort().to_list()
    ended = df.filter((pl.col("event") == "SYSTEM") & (pl.col("event_type") == "STEP")).height
    if ended >= 2:  # the rows after the last STEP row are not a whole step
        steps = [s for s in steps if s <= ended]
    if len(steps) < 2:
        return None
    steps = steps[-COMPARE_STEPS:]
    mal = mal.filter(pl.col("step").is_in(steps)).with_columns(op=pl.col("op").fill_null("(outside any op)"))
    top = mal.group_by("op").agg(b=pl.col("size").sum()).sort("b", "op", descending=[True, False])
    ops = top["op"].head(COMPARE_OPS).to_list()
    if top.height > COMPARE_OPS:
        ops.append(OTHER_OPS)
    idx = {o: i for i, o in enumerate(ops)}
    mal = mal.with_columns(o=pl.col("op").replace_strict(idx, default=len(ops) - 1, return_dtype=pl.Int32))
    g = mal.group_by("step", "o").agg(b=pl.col("size").sum(), n=pl.len()).sort("step", "o")
    return {"ops": [short_op(o) for o in ops], "steps": [int(s) for s in steps],
            "cells": [[int(s), int(o), int(b), int(c)] for s, o, b, c in g.iter_rows()]}


# ---------------------------------------------------------------- findings
def _read_json(path):
    # the one bounded JSON reader (io.validate): nesting, size and type are checked there
    from ..io.validate import load_json_object
    try:
        return load_json_object(path), None
    except Exception as e:  # a finding file we cannot read is shown as such, never a crash
        return None, f"cannot read {os.path.basename(path)}: {e}"


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def pretty_line(line: str | None) -> str | None:
    """``/long/path/train.py:45(func)`` as ``train.py:45 (func)``: what a person looks for."""
    if not line:
        return None
    loc, _, func = str(line).partition("(")
    path, _, ln = loc.rpartition(":")
    if not path:
        return str(line)
    func = func[:-1] if func.endswith(")") else func
    return f"{os.path.basename(path)}:{ln}" + (f" ({func})" if func else "")


def human_time(us) -> str:
    """Microseconds from the start of the run, in a readable unit."""
    us = float(us or 0)
    if abs(us) >= 1e6:
        return f"{us / 1e6:.3f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.3f} ms"
    return f"{us:.0f} µs"


def _where(line, op):
    parts = []
    if line:
        parts.append(f"at {pretty_line(line)}")
    if op:
        parts.append(f"in {short_op(str(op))}")
    return " ".join(parts) or "at an unknown line"


def _steps_range(a, b):
    if a is None and b is None:
        return ""
    if a is None or b is None or a == b:
        return f"in step {a if a is not None else b}"
    return f"over steps {a}\u2013{b}"


def findings(folder: str | None, ctx: dict) -> list[dict]:
    """Sentences for the findings view. ``ctx`` has ``step_t`` (step -> end time µs), ``row_t``
    (row id -> time µs), ``peak`` (the peak finding's facts) and ``series`` (reserved vs allocated)."""
    out = []
    step_t = ctx.get("step_t", {})

    def step_window(a, b):
        a = a if isinstance(a, int) else None
        b = b if isinstance(b, int) else a
        if a is None:
            return None
        t_start = step_t.get(a - 1, 0)
        t_end = step_t.get(b, step_t.get(max(step_t) if step_t else 0, None))
        return [t_start, t_end if t_end is not None else t_start]

    pk = ctx.get("peak")
    if pk:
        out.append(pk)
    for fr in ctx.get("fragmentation", []):
        out.append(fr)
    if not folder:
        return out
    adir = os.path.join(folder, "analysis")
    # leaks: growing sites (issue 19's schema), block findings, retained blocks
    p = os.path.join(adir, "leaks.json")
    if os.path.isfile(p):
        data, err = _read_json(p)
        if err or not isinstance(data, dict):
            out.append({"kind": "problem", "text": err or "leaks.json is not an object", "raw": None})
        else:
            sites = data.get("sites") if isinstance(data.get("sites"), list) else []
            for s in sites:
                if not isinstance(s, dict):
                    continue
                bps, live_b = _num(s.get("bytes_per_step")), _num(s.get("live_bytes"))
                a, b = s.get("first_step"), s.get("last_step")
                line = s.get("python") if isinstance(s.get("python"), str) else None
                text = (f"Leak: {_where(line, s.get('op'))} grows by {human_bytes(bps)} per step "
                        f"{_steps_range(a, b)}"
                        + (f" ({s.get('steps_growing')} steps growing)" if _num(s.get("steps_growing")) else "")
                        + (f"; {human_bytes(live_b)} live now" if live_b is not None else "")
                        + (f" on {s.get('device')} {s.get('pool') or ''}".rstrip() if s.get("device") else "") + ".")
                out.append({"kind": "leak", "severity": 3, "text": text, "line": line,
                            "window": step_window(a, b), "focus_step": b if isinstance(b, int) else None,
                            "raw": s})
            blocks = data.get("leaks") if isinstance(data.get("leaks"), list) else []
            retained = data.get("retained") if isinstance(data.get("retained"), list) else []
            for kind, items in (("leak", blocks), ("retained", retained)):
                items = [x for x in items if isinstance(x, dict)]
                if not items:
                    continue
                if kind == "leak" and sites:
                    # block findings of a growing site: one sentence for all
                    tot = sum(_num(x.get("size")) or 0 for x in items)
                    out.append({"kind": "leak", "severity": 2,
                                "text": f"{len(items)} block(s) of the growing sites above, {human_bytes(tot)} in all, "
                                        f"outlived their step.", "raw": items[:200], "window": None})
                    continue
                if kind == "leak":
                    # one sentence per place: the blocks a line keeps, step after step
                    groups: dict = {}
                    for x in items:
                        line = x.get("python") if isinstance(x.get("python"), str) else None
                        groups.setdefault((line, str(x.get("op") or "")), []).append(x)
                    for (line, op), xs in sorted(groups.items(), key=lambda kv: -sum(_num(x.get("size")) or 0
                                                                                       for x in kv[1]))[:12]:
                        sts = sorted(x.get("step") for x in xs if isinstance(x.get("step"), int))
                        dets = sorted(x.get("detected_at_step") for x in xs if isinstance(x.get("detected_at_step"), int))
                        tot = sum(_num(x.get("size")) or 0 for x in xs)
                        sizes = {_num(x.get("size")) for x in xs}
                        each = f" of {human_bytes(sizes.pop())}" if len(sizes) == 1 else ""
                        text = (f"Leak: {pretty_line(line) or 'an unknown line'}"
                                + (f" ({short_op(op)})" if op else "") + f" kept {len(xs)} block(s){each}, {human_bytes(tot)} in all, "
                                f"allocated {_steps_range(sts[0], sts[-1]) if sts else 'in an unknown step'}; "
                                f"each was still live at the end of the next step.")
                        last = dets[-1] if dets else (sts[-1] if sts else None)
                        out.append({"kind": "leak", "severity": 2, "text": text, "line": line,
                                    "window": step_window(sts[0] if sts else None, last), "focus_step": last,
                                    "raw": xs[:200]})
                    continue
                for x in sorted(items, key=lambda x: -(_num(x.get("size")) or 0))[:12]:
                    line = x.get("python") if isinstance(x.get("python"), str) else None
                    st = x.get("step") if isinstance(x.get("step"), int) else None
                    det = x.get("detected_at_step")
                    if kind == "leak":
                        text = (f"Leak: a block of {human_bytes(_num(x.get('size')))} allocated "
                                f"{_where(line, x.get('op'))} in step {st} was still live at the end of step "
                                f"{det if det is not None else (st + 1 if st else '?')}.")
                    else:
                        text = (f"Retained, not growing: {human_bytes(_num(x.get('size')))} allocated "
                                f"{_where(line, x.get('op'))} in step {st} stays live (allocated once, not a leak).")
                    out.append({"kind": kind, "severity": 2 if kind == "leak" else 1, "text": text, "line": line,
                                "window": step_window(st, det if isinstance(det, int) else st),
                                "focus_step": det if isinstance(det, int) else st, "raw": x})
                if len(items) > 12:
                    out.append({"kind": kind, "severity": 0, "text": f"{len(items) - 12} more {kind} block(s) "
                                f"in the detail.", "raw": items[12:200], "window": None})
            # sites whose blocks outlived a step but that do not grow (caches, lazily made state)
            rsites = data.get("retained_sites") if isinstance(data.get("retained_sites"), list) else []
            for x in [x for x in rsites if isinstance(x, dict)][:12]:
                line = x.get("python") if isinstance(x.get("python"), str) else None
                out.append({"kind": "retained", "severity": 1,
                            "text": f"Retained, not growing: {pretty_line(line) or 'an unknown line'}"
                                    + (f" ({short_op(str(x['op']))})" if x.get("op") else "")
                                    + f" keeps {x.get('count')} block(s), {human_bytes(_num(x.get('bytes')))}, that "
                                      f"outlived their step without growing (allocated once: not a leak).",
                            "line": line, "raw": x})
            if not sites and not blocks:
                n = data.get("steps_ended")
                out.append({"kind": "ok", "severity": 0,
                            "text": "No leak found" + (f" ({n} steps checked)." if isinstance(n, int) else "."),
                            "raw": {k: v for k, v in data.items() if k not in ("fluctuation",)}})
    # inefficient blocks
    p = os.path.join(adir, "inefficient.json")
    if os.path.isfile(p):
        data, err = _read_json(p)
        if err:
            out.append({"kind": "problem", "text": err, "raw": None})
        elif isinstance(data, dict):
            by_type = data.get("by_type") if isinstance(data.get("by_type"), dict) else {}
            kinds = ", ".join(f"{k.replace('_', ' ')}: {v.get('count')} ({human_bytes(v.get('bytes'))})"
                              for k, v in by_type.items() if isinstance(v, dict) and v.get("count"))
            if data.get("blocks"):
                out.append({"kind": "inefficient", "severity": 1,
                            "text": f"Inefficient memory: {data.get('blocks')} block(s), "
                                    f"{human_bytes(data.get('bytes'))} in all" + (f" — {kinds}" if kinds else "") + ".",
                            "raw": {k: v for k, v in data.items() if k != "worst"}, "window": None})
            worst = data.get("worst") if isinstance(data.get("worst"), list) else []
            for w in worst[:5]:
                if not isinstance(w, dict):
                    continue
                types = w.get("types") if isinstance(w.get("types"), list) else []
                line = w.get("python_line") if isinstance(w.get("python_line"), str) else None
                t = ctx.get("row_t", {}).get(w.get("row_id"))
                out.append({"kind": "inefficient", "severity": 1,
                            "text": f"Inefficient: {human_bytes(_num(w.get('size')))} allocated "
                                    f"{_where(line, w.get('op'))} was "
                                    + (" and ".join(x.replace('_', ' ') for x in types) or "inefficient") + ".",
                            "line": line, "at": t, "raw": w})
        elif isinstance(data, list):
            for w in data[:20]:
                if isinstance(w, dict):
                    out.append({"kind": "inefficient", "severity": 1,
                                "text": f"Inefficient: {human_bytes(_num(w.get('size')))} block "
                                        f"#{w.get('allocation_id')} ({w.get('inefficient_type')}).", "raw": w})
    # fragmentation of a caching allocator's reserved memory (analysis/fragmentation.json):
    # per device, the step end with the most reserved-but-unallocated bytes
    p = os.path.join(adir, "fragmentation.json")
    if os.path.isfile(p):
        data, err = _read_json(p)
        steps = data.get("steps") if isinstance(data, dict) and isinstance(data.get("steps"), list) else []
        if err:
            out.append({"kind": "problem", "text": err, "raw": None})
        worst: dict = {}
        for st in steps:
            if isinstance(st, dict) and _num(st.get("unallocated")) is not None:
                d = str(st.get("device"))
                if d not in worst or st["unallocated"] > worst[d]["unallocated"]:
                    worst[d] = st
        for d, st in sorted(worst.items()):
            if not st["unallocated"]:
                continue
            n = st.get("step") if isinstance(st.get("step"), int) else None
            pinned = _num(st.get("pinned_segments"))
            out.append({"kind": "fragmentation", "severity": 2,
                        "text": f"Fragmentation on device {d}" + (f" at the end of step {n}" if n is not None else "")
                                + f": {human_bytes(st['unallocated'])} reserved but unallocated in "
                                  f"{st.get('segments_with_free', 0)} segment(s); largest free block "
                                  f"{human_bytes(_num(st.get('largest_free')))} (reserved "
                                  f"{human_bytes(_num(st.get('reserved')))})"
                                + (f"; {pinned} mostly empty segment(s) pinned by live blocks, "
                                   f"{human_bytes(_num(st.get('pinned_bytes')))} that empty_cache() cannot return"
                                   if pinned else "") + ".",
                        "window": step_window(n, n), "focus_step": n, "raw": st})
    # out of memory
    p = os.path.join(adir, "oom.json")
    if os.path.isfile(p):
        data, err = _read_json(p)
        events = data.get("events") if isinstance(data, dict) and isinstance(data.get("events"), list) else []
        if err:
            out.append({"kind": "problem", "text": err, "raw": None})
        for e in events:
            if not isinstance(e, dict):
                continue
            trig = e.get("trigger") if isinstance(e.get("trigger"), dict) else e
            top = e.get("top") if isinstance(e.get("top"), list) else []
            holders = "; ".join(f"{human_bytes(_num(x.get('size')))} {_where(x.get('python'), x.get('op'))}"
                                for x in top[:3] if isinstance(x, dict))
            st = trig.get("step") if isinstance(trig.get("step"), int) else None
            out.append({"kind": "oom", "severity": 3,
                        "text": f"Out of memory {_where(None, trig.get('op'))}"
                                + (f" in step {st}" if st is not None else "")
                                + f": asked for {human_bytes(_num(trig.get('size')))} with "
                                  f"{human_bytes(_num(trig.get('used') or trig.get('live_bytes')))} in use"
                                + (f" in {trig.get('live_blocks')} live blocks" if trig.get("live_blocks") else "")
                                + (f"; largest holders: {holders}" if holders else "")
                                + (f"; {human_bytes(_num(trig.get('unallocated')))} reserved but unallocated, largest "
                                   f"free block {human_bytes(_num(trig.get('largest_free')))}"
                                   if _num(trig.get("unallocated")) is not None else "") + ".",
                        "window": step_window(st, st), "focus_step": st, "raw": e})
    return out
