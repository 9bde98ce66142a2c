"""The leak rule's row loop in C++ (msmemscope/_leakrule.cpp ``leak_rows``, used by the online sink and
the offline replay where it is built) must leave the tracker exactly as the Python loop does: random
row streams (two pools and the cached segments', two threads, stacks, owner labels, marks and
ranges, dict attrs, frees of blocks from before the trace, stop/start gaps) go through
``StepLeakTracker.consume`` both ways, cut into the same random batches, and every finding, result,
report line and piece of the tracker's state is compared. A real run then checks that the online
sink does use it."""
import json
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import FULL, check_invariants, full
from msmemscope.analysis import leaks

from msmemscope import leak_native

MOD = leak_native.load()
pytestmark = pytest.mark.skipif(MOD is None, reason="the leak rule's C++ module is not built "
                                "(python -m msmemscope.capture.native build)")

OPS = ["torch._ops.aten.mm.default", "torch._ops.aten.add.Tensor", "torch._ops.aten.ones.default"]
STACKS = [None, None, "", "train.py:12(step);model.py:40(forward)", "train.py:13(step);opt.py:7(update)"]
OWNERS = ["", "", "", "PTA@weight@layer1", "PTA@activation@", "PTA@weight", "PTA@activation@a@b"]


def stream(seed, steps, per_step, p_keep, p_gap, p_dict):
    rng = random.Random(seed)
    rows, live, used, aid, truth = [], [], {}, [1000], set()

    def malloc(op, size, pool="PTA", dev="cpu", dict_attr=False):
        aid[0] += rng.choice((1, 1, 1, 7))
        u = used[(dev, pool)] = used.get((dev, pool), 0) + size
        owner = rng.choice(OWNERS)
        attr = ({"allocation_id": aid[0], "addr": aid[0] * 256, "size": size, "used": u, "owner": owner}
                if dict_attr else (aid[0], aid[0] * 256, size, u, u, owner)[:rng.choice((5, 6, 6, 6))])
        rows.append(("MALLOC", pool, op, 0, rng.choice((1, 1, 2)), dev, aid[0] * 256, attr, rng.choice(STACKS), None))
        truth.add(aid[0])
        return (dev, pool, aid[0], size)

    def free(block, silent=False):
        dev, pool, a, size = block
        u = used[(dev, pool)] = used.get((dev, pool), 0) - size
        truth.discard(a)
        if not silent:
            attr = ({"allocation_id": a, "addr": a * 256, "size": size, "used": u, "total": u}
                    if rng.random() < p_dict else (a, a * 256, size, u, u))
            rows.append(("FREE", pool, rng.choice(("N/A", OPS[0])), 0, 1, dev, a * 256, attr, None, None))

    for step in range(1, steps + 1):
        for _ in range(per_step):
            x = rng.random()
            if x < 0.2:
                rows.append(("OP_LAUNCH", rng.choice(("ATEN_START", "ATEN_END")), rng.choice(OPS), 0, 1, "cpu", None,
                             None, None, None))
            elif x < 0.24:
                kind = rng.choice(("Mark", "Range_start", "Range_end"))
                rows.append(("MSTX", kind, rng.choice(("fwd", "bwd", "step start")), 0, rng.choice((1, 2)), "cpu",
                             None, {"range_id": rng.randint(1, 3)}, None, None))
            elif x < 0.26:  # a free of a block from before the trace
                rows.append(("FREE", "PTA", "N/A", 0, 1, "cpu", 0, (rng.randint(1, 999), 0, 64, 0, 0), None, None))
            elif x < 0.28:
                live.append(malloc(rng.choice(OPS), rng.randint(1, 4096), pool="HAL", dev="cuda:0"))
            else:
                b = malloc(rng.choice(OPS), rng.choice((0, rng.randint(1, 1 << 20))),
                           dev=rng.choice(("cpu", "cpu", "cuda:0")), dict_attr=rng.random() < p_dict)
                if rng.random() < p_keep:
                    live.append(b)
                else:
                    free(b)
            if live and rng.random() < 0.3:
                free(live.pop(rng.randrange(len(live))), silent=rng.random() < p_gap)
        rows.append(("SYSTEM", "STEP", "N/A", 0, 1, "cpu", None, {"step": step} if rng.random() < 0.95 else {},
                     None, None))
    return rows, truth


def state(t, found):
    # the counts the step-end checkpoint reads: kept as rows come, they are the sums over the sites
    assert t.hits == sum(s.hits for s in t.growth.sites.values())
    assert t.growth.n_growing == len(t.growth.growing())
    res = leaks.result_json(t)
    sites = {str(k): [s.live, s.last_aid, s.example, s.hits, s.hit_bytes] for k, s in t.growth.sites.items()}
    return json.dumps([found, res, leaks.report_lines(t), leaks.gap_report(t.fluctuation()), sites,
                       sorted(map(str, t.pending.items())), sorted(str((k, v[1])) for k, v in t._blocks.items()),
                       sorted(map(str, t.level.items())), str(t.fluct), str(t.reported), t.step],
                      default=str, sort_keys=True)


def run(rows, batches, live_ids, fast, ids=False):
    """``ids``: the rows' IDs given as a list (the offline replay's way), not as the first one."""
    t = leaks.StepLeakTracker()
    if fast is not None:
        t.use_native(fast)
    t.live_ids = (lambda: live_ids) if live_ids is not None else None
    found, i = [], 0
    for n in batches:
        found.extend(t.consume(rows[i:i + n], 0, list(range(i + 1, i + n + 1))) if ids else
                     t.consume(rows[i:i + n], i + 1))
        i += n
    return state(t, found)


@settings(max_examples=full(40, 400), deadline=None, derandomize=not os.environ.get("MSMEMSCOPE_TEST_FULL"),
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32), steps=st.integers(1, 10), per_step=st.integers(0, 90),
       p_keep=st.sampled_from([0.0, 0.1, 0.5]), p_gap=st.sampled_from([0.0, 0.2]),
       cuts=st.lists(st.integers(1, 400), min_size=1, max_size=6), gaps=st.booleans(),
       p_dict=st.sampled_from([0.0, 0.05]))
def test_native_row_loop_leaves_the_tracker_as_the_python_loop(seed, steps, per_step, p_keep, p_gap, cuts, gaps,
                                                                p_dict):
    rows, truth = stream(seed, steps, per_step, p_keep, p_gap, p_dict)
    batches, left = [], len(rows)
    while left > 0:
        n = min(left, cuts[len(batches) % len(cuts)])
        batches.append(n)
        left -= n
    live = truth if gaps else None
    want = run(rows, batches, live, None)
    assert run(rows, batches, live, MOD) == want
    assert run(rows, batches, live, MOD, ids=True) == want == run(rows, batches, live, None, ids=True)
    assert run(rows, [len(rows)], live, MOD) == run(rows, [len(rows)], live, None)


def replay_frame(rows):
    """The stream as the offline replay's frame (``leaks.replay``'s query): its MALLOC/FREE rows
    with tuple attrs as the reader's columns, its MSTX and STEP rows with their Attr as JSON text."""
    import polars as pl
    keep = [r for r in rows if r[0] in ("MSTX", "SYSTEM") or (r[0] in ("MALLOC", "FREE") and isinstance(r[7], tuple))]
    mem = [r[0] in ("MALLOC", "FREE") for r in keep]
    steps, n = [], 1
    for r in keep:
        steps.append(n)
        n += r[0] == "SYSTEM"

    def field(k):
        return [r[7][k] if m and len(r[7]) > k else None for r, m in zip(keep, mem)]
    return pl.DataFrame({
        "id": list(range(1, len(keep) + 1)), "event": [r[0] for r in keep], "event_type": [r[1] for r in keep],
        "name": [r[2] for r in keep], "tid": [r[4] for r in keep], "device": [r[5] for r in keep],
        "alloc_id": field(0), "addr": field(1), "size": field(2), "used": field(3), "owner": field(5),
        "py_stack": [r[8] if r[0] == "MALLOC" else None for r in keep],
        "attr": [None if m else json.dumps(r[7]) for r, m in zip(keep, mem)], "step": steps},
        schema_overrides={"id": pl.Int64, "tid": pl.Int64, "alloc_id": pl.Int64, "addr": pl.Int64, "size": pl.Int64,
                          "used": pl.Int64, "step": pl.Int64})


@settings(max_examples=full(40, 400), deadline=None, derandomize=not os.environ.get("MSMEMSCOPE_TEST_FULL"),
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32), steps=st.integers(1, 10), per_step=st.integers(0, 90),
       p_keep=st.sampled_from([0.0, 0.1, 0.5]))
def test_column_loop_leaves_the_tracker_as_the_python_loop(seed, steps, per_step, p_keep):
    """The offline replay's loop over the columns (``leak_columns``: no row tuples, the rows it does
    not take made alone for the Python loop) leaves the tracker as the Python loop over the rows
    does, and as ``leak_rows`` over the row tuples does."""
    rows, _ = stream(seed, steps, per_step, p_keep, 0.0, 0.0)
    q = replay_frame(rows)
    has = set(q.columns)
    got = []
    for way in ("columns", "row tuples", "python"):
        t = leaks.StepLeakTracker()
        if way != "python":
            t.use_native(MOD)  # the row tuples then go through leak_rows
        if way == "columns":
            cols = leaks._native_columns(q, has)
            assert cols is not None
            leaks._replay_columns(t, q, has, q.height, MOD, cols)
        else:
            leaks._replay_rows(t, q, has, q.height)
        got.append(state(t, []))
    assert got[0] == got[2] and got[1] == got[2]


KEYS = st.tuples(st.sampled_from(["cpu", "cuda:0"]), st.sampled_from(["PTA", "HAL"]),
                 st.one_of(st.integers(0, 40), st.none(), st.just(2 ** 70), st.integers(-3, -1)))


@settings(max_examples=full(60, 600), deadline=None, derandomize=not os.environ.get("MSMEMSCOPE_TEST_FULL"))
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "set", "pop", "has", "get", "due"]), KEYS,
                              st.integers(1, 6)), max_size=300),
       churn=st.integers(0, 3000))
def test_block_table_reads_as_a_dict(ops, churn):
    """The native KeyTable (the tracker's live and pending blocks) against a dict driven the same
    way: values, insertion order (a key assigned again keeps its place), keys whose alloc id is not
    a plain int, the suspects taken at a step end (``leaks._take_due``), and the order kept after
    thousands of removed entries are compacted away."""
    t, d = MOD.KeyTable(6), {}
    for i in range(churn):  # removed entries: the table compacts past 1024 of them
        k = ("cpu", "PTA", 10_000 + i)
        t[k] = d[k] = (i % 5, i, 0, 0, "op", None)
        if i % 3:
            assert t.pop(k) == d.pop(k)
    for n, (op, key, step) in enumerate(ops):
        if op == "set":
            t[key] = d[key] = (step, n, key[2], 64, "op", None)
        elif op == "pop":
            assert t.pop(key, "none") == d.pop(key, "none")
        elif op == "has":
            assert (key in t) == (key in d)
        elif op == "get":
            if key in d:
                assert t[key] == d[key]
            else:
                with pytest.raises(KeyError):
                    t[key]
        else:
            assert leaks._take_due(t, step) == leaks._take_due(d, step)
        assert len(t) == len(d) and bool(t) == bool(d)
    assert t.items() == list(d.items()) and list(t) == list(d)
    with pytest.raises(TypeError):
        t[("cpu", "PTA", 1)] = (1, 2)  # not the table's width


def test_native_row_loop_stops_where_python_must_take_over():
    """It returns the index of the first row it does not handle (a new site, a row of another
    kind), changing nothing for that row."""
    t = leaks.StepLeakTracker()
    t.use_native(MOD)
    cur = {}
    state = (t._sites, t._blocks, t.pending, t.level, cur, t._lines, t.labels, t.reported)
    consts = ("OP_LAUNCH", "ACCESS", "MALLOC", "FREE", "HAL", "live", "last_aid", "freed_at_step")
    rows = [("OP_LAUNCH", "ATEN_START", OPS[0], 0, 1, "cpu", None, None, None, None),
            ("MALLOC", "PTA", OPS[0], 0, 1, "cpu", 256, (1, 256, 64, 64, 64, ""), None, None)]
    assert MOD.leak_rows(rows, 0, 1, 1, consts, state) == 1  # the site is new
    assert (len(t._blocks), len(t.pending), t.level) == (0, 0, {})
    t.consume(rows, 1)  # the Python loop makes the site, then the same row again goes in C++
    rows2 = [("MALLOC", "PTA", OPS[0], 0, 1, "cpu", 512, (2, 512, 32, 96, 96, ""), None, None),
             ("FREE", "PTA", "N/A", 0, 1, "cpu", 256, (1, 256, 64, 32, 32), None, None),
             ("MSTX", "Mark", "x", 0, 1, "cpu", None, None, None, None)]
    assert MOD.leak_rows(rows2, 0, 3, 1, consts, state) == 2
    [site] = t._sites.values()
    assert (site.live, site.last_aid, sorted(k[2] for k in t._blocks), t.level[("cpu", "PTA")]) == (32, 2, [2], 32)


@pytest.mark.skipif(not FULL, reason="long form only (make test-full): tests/test_handoff.py checks that the sink "
                    "has the C++ loop in a real run")
@pytest.mark.parametrize("fast", ["native", "python"])
def test_online_sink_uses_the_native_row_loop(tmp_path, fast, monkeypatch):
    """A real run with the native source: the sink's tracker has the C++ loop (unless told
    otherwise), and both ways find the same leak in the same program."""
    import subprocess
    import sys
    from conftest import env_for_tests, run_folders, dump_of, read
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import msmemscope, torch\n"
        f"msmemscope.config(output={str(tmp_path / 'out')!r}, collect_mode='immediate')\n"
        "from msmemscope import capture\n"
        "s = capture.current()\n"
        "[sink] = [x for x in s.sinks if type(x).__name__ == 'LeakSink']\n"
        "print('fast', sink.t.fast_rows is not None, s.config['source'])\n"
        "m = torch.nn.Linear(16, 16); opt = torch.optim.SGD(m.parameters(), lr=0.1); kept = []\n"
        "for i in range(7):\n"
        "    m(torch.randn(4, 16)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "    kept.append(torch.ones(1000 * (i + 1)))\n")
    env = env_for_tests()
    env["MSMEMSCOPE_SOURCE"] = "native"
    if fast == "python":
        env["MSMEMSCOPE_LEAK_ROWS"] = "python"
    r = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"fast {fast == 'native'} native" in r.stdout
    # live at the step ends 1-7: 0, 4,000, 12,000, ... 84,000 B; the rate runs from the first
    # rise's step end on (growth.py): (84,000 - 4,000) / 5 = 16,000 B (13.7 KB before 0524bc2,
    # which counted the first rise: the weights a leaking op made in it)
    assert "leak: +15.6 KB/step over steps 2-7 in aten.ones" in r.stderr, r.stderr
    [folder] = run_folders(tmp_path / "out")
    check_invariants(read(dump_of(folder)))
    with open(os.path.join(folder, "analysis", "leaks.json")) as f:
        res = json.load(f)
    assert [(lk["step"], lk["size"]) for lk in res["leaks"] if lk["size"] >= 4000][:3] == [(2, 4000), (3, 8000), (4, 12000)]
