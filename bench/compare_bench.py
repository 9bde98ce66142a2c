"""Step-compare alignment on long sequences (SPEC §4.3; the original gives up after 60 s).

Generates a base step of N ops shaped like training (a vocabulary of op names, a layer
pattern repeated over and over, so many off-diagonals match for long runs), makes the
compare step by applying E random edits (insert / delete / replace), and times

  * encode: names -> integer codes (polars),
  * align:  prefix/suffix strip + Myers O(ND) (msmemscope.analysis.compare.align),

then checks the result: every aligned pair has equal names, every op of both sides
appears once in order, and the edit count is at most what was applied.

With ``--pipeline`` it also builds both steps as dump columns (ATEN_START, a MALLOC in
every other op, ATEN_END: about 2.5 rows per op) and times the whole offline path after
reading: bytes per op by bracket containment (``sequence``), encode, align, and the
aligned table (``_assemble``).

    PYTHONPATH=$PWD python bench/compare_bench.py [--ops 1000000] [--edits 300] [--seed 0] [--pipeline]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def make_pair(n_ops: int, n_edits: int, seed: int = 0, vocab: int = 400, period: int = 97):
    """Two integer-coded sequences: base (periodic with noise) and base with ``n_edits`` edits."""
    rng = np.random.default_rng(seed)
    layer = rng.integers(0, vocab, period)
    base = np.tile(layer, n_ops // period + 1)[:n_ops].copy()
    noise = rng.random(n_ops) < 0.05  # some variety, as real steps have
    base[noise] = rng.integers(0, vocab, int(noise.sum()))
    cmp_ = base.tolist()
    positions = np.sort(rng.choice(n_ops, n_edits, replace=False))[::-1]  # back to front keeps indices valid
    kinds = rng.integers(0, 3, n_edits)
    for pos, kind in zip(positions.tolist(), kinds.tolist()):
        new = int(rng.integers(vocab, vocab + 50))  # a name the base never has
        if kind == 0:
            cmp_.insert(pos, new)
        elif kind == 1:
            del cmp_[pos]
        else:
            cmp_[pos] = new
    return base, np.asarray(cmp_, dtype=np.int64), kinds


def as_dump(codes, names) -> "pl.DataFrame":
    """Dump columns (as ``read_dump`` gives them) for one step running ``codes`` as ops."""
    import polars as pl
    n = len(codes)
    has_malloc = (np.arange(n) % 2) == 0
    per_op = 2 + has_malloc.astype(np.int64)
    first = np.concatenate([[0], np.cumsum(per_op)[:-1]])
    total = int(per_op.sum())
    event = np.full(total, "OP_LAUNCH", dtype=object)
    etype = np.full(total, "ATEN_END", dtype=object)
    etype[first] = "ATEN_START"
    m_rows = first[has_malloc] + 1
    event[m_rows] = "MALLOC"
    etype[m_rows] = "PTA"
    op_of_row = np.repeat(np.arange(n), per_op)
    size = np.where(event == "MALLOC", 512 + codes[op_of_row] * 16, None)
    return pl.DataFrame({
        "id": np.arange(1, total + 1), "event": event.astype(str), "event_type": etype.astype(str),
        "name": np.asarray(names, dtype=object)[codes[op_of_row]].astype(str),
        "tid": np.ones(total, dtype=np.int64), "device": np.full(total, "0"),
        "size": pl.Series(size.tolist(), dtype=pl.Int64), "attr": pl.Series([None] * total, dtype=pl.String),
        "py_stack": pl.Series([None] * total, dtype=pl.String), "step": np.ones(total, dtype=np.int32)})


def check(a, b, ai, bi):
    both = (ai >= 0) & (bi >= 0)
    assert np.array_equal(a[ai[both]], b[bi[both]]), "aligned pair with different names"
    assert np.array_equal(ai[ai >= 0], np.arange(len(a))), "base ops not all present in order"
    assert np.array_equal(bi[bi >= 0], np.arange(len(b))), "compare ops not all present in order"
    return int((~both).sum())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--edits", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipeline", action="store_true", help="also time bytes-per-op and the aligned table")
    args = ap.parse_args(argv)
    from msmemscope.analysis.compare import align, encode

    t0 = time.perf_counter()
    a, b, kinds = make_pair(args.ops, args.edits, args.seed)
    # names as strings, as a dump gives them
    names_a = [f"torch._ops.aten.op{i}.default" for i in range(450)]
    sa = np.asarray(names_a, dtype=object)[a]
    sb = np.asarray(names_a, dtype=object)[b]
    gen = time.perf_counter() - t0

    t0 = time.perf_counter()
    ca, cb = encode(sa.tolist(), sb.tolist())
    enc = time.perf_counter() - t0

    t0 = time.perf_counter()
    ai, bi, minimal = align(ca, cb)
    al = time.perf_counter() - t0

    edits = check(ca, cb, ai, bi)
    applied = int((kinds < 2).sum() + 2 * (kinds == 2).sum())  # a replace is a delete plus an insert
    assert minimal and edits <= applied, (edits, applied)
    print(f"ops {len(a):,} vs {len(b):,}; edits applied {args.edits} "
          f"(script length <= {applied}), found {edits}")
    print(f"generate {gen:.2f} s   encode names {enc:.2f} s   align {al:.2f} s   "
          f"(encode+align {enc + al:.2f} s)")
    if args.pipeline:
        from msmemscope.analysis.compare import _assemble, sequence
        da, db = as_dump(a, names_a), as_dump(b, names_a)
        t0 = time.perf_counter()
        sa_, sb_ = sequence(da, "op", None, "base"), sequence(db, "op", None, "compare")
        seq = time.perf_counter() - t0
        t0 = time.perf_counter()
        ca, cb = encode(sa_["name"], sb_["name"])
        ai, bi, _ = align(ca, cb)
        al2 = time.perf_counter() - t0
        t0 = time.perf_counter()
        table = _assemble(sa_, sb_, ai, bi, "0")
        asm = time.perf_counter() - t0
        assert check(ca, cb, ai, bi) == edits and table.height == len(ai)
        print(f"pipeline over {da.height + db.height:,} dump rows: bytes per op {seq:.2f} s   "
              f"encode+align {al2:.2f} s   table {asm:.2f} s   (total {seq + al2 + asm:.2f} s)")


if __name__ == "__main__":
    main()
