"""Step-compare alignment on long sequences (SPEC §4.3; the original gives up after 60 s).

Generates a base step of N ops shaped like training (a vocabulary of op names, a layer
pattern repeated over and over, so many off-diagonals match for long runs), makes the
compare step by applying E random edits (insert / delete / replace), and times

  * encode: names -> integer codes (polars),
  * align:  prefix/suffix strip + Myers O(ND) (msmemscope.analysis.compare.align),

then checks the result: every aligned pair has equal names, every op of both sides
appears once in order, and the edit count is at most what was applied.

    PYTHONPATH=$PWD python bench/compare_bench.py [--ops 1000000] [--edits 300] [--seed 0]
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


if __name__ == "__main__":
    main()
