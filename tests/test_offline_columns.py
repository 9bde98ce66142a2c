"""The offline column layer: every analysis gives, on real dumps, exactly what it gave before the
layer existed (tests/data/offline/golden.json.gz, written by tests/offline_golden.py from the code
before the change), and the reader's projections agree with its full read."""
from __future__ import annotations

import os
import warnings

import polars as pl
import pytest

import offline_golden as G  # noqa: E402  (tests/ is on sys.path under pytest)

GOLD = G.load()


@pytest.fixture(scope="module")
def now():
    return {os.path.basename(d): G.outputs(d) for d in G.dumps()}


@pytest.mark.parametrize("dump", sorted(GOLD))
def test_every_analysis_gives_what_it_gave(now, dump):
    old, new = GOLD[dump], now[dump]
    assert sorted(new) == sorted(old)
    for key in sorted(old):
        assert new[key] == old[key], f"{dump}: {key} changed"
