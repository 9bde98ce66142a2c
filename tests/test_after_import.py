"""msmemscope.after_import: a patch that waits for the program's own import (no torch here: real
modules written to a temporary folder and imported by name)."""
from __future__ import annotations

import sys

import pytest

from msmemscope.after_import import AfterImport, after_import


@pytest.fixture
def new_module(tmp_path, monkeypatch):
    """A module name nobody has imported, its file in a folder on sys.path."""
    made = []

    def make(name, body="VALUE = 41\n"):
        (tmp_path / f"{name}.py").write_text(body)
        made.append(name)
        return name
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.meta_path)  # a session of another test in this worker may have its own waiting
    yield make
    for name in made:
        sys.modules.pop(name, None)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AfterImport) or f in before]


def test_runs_after_the_import_with_the_executed_module(new_module):
    name = new_module("msm_after_a")
    seen = []
    finder = after_import(name, lambda m: seen.append(m.VALUE))
    assert finder in sys.meta_path and seen == []
    __import__(name)
    assert seen == [41] and finder not in sys.meta_path
    __import__(name)  # once
    assert seen == [41]


def test_runs_now_when_already_imported(new_module):
    name = new_module("msm_after_b")
    mod = __import__(name)
    seen = []
    assert after_import(name, seen.append) is None
    assert seen == [mod]


def test_cancelled_before_the_import_never_runs(new_module):
    name = new_module("msm_after_c")
    seen = []
    finder = after_import(name, seen.append)
    finder.cancel()
    __import__(name)
    assert seen == [] and finder not in sys.meta_path


def test_a_failing_patch_is_one_line_and_the_import_succeeds(new_module, capsys):
    name = new_module("msm_after_d")

    def boom(_m):
        raise RuntimeError("no such attribute")
    after_import(name, boom, "no labels in process {pid}")
    assert __import__(name).VALUE == 41
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[msmemscope] no labels in process ") and "no such attribute" in err[0]


def test_a_module_that_fails_to_import_runs_nothing_until_it_imports(new_module, tmp_path):
    name = new_module("msm_after_e", "raise ImportError('broken on purpose')\n")
    seen = []
    finder = after_import(name, lambda m: seen.append(m.VALUE))
    with pytest.raises(ImportError, match="broken on purpose"):
        __import__(name)
    assert seen == [] and finder in sys.meta_path
    (tmp_path / f"{name}.py").write_text("VALUE = 7\n")  # the program imports it again, fixed
    import importlib
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    __import__(name)
    assert seen == [7] and finder not in sys.meta_path


def test_two_waits_on_one_module_both_run(new_module):
    # the decompose labeller and the framework hooks may both wait on one FSDP module
    name = new_module("msm_after_f")
    seen = []
    after_import(name, lambda m: seen.append("first"))
    after_import(name, lambda m: seen.append("second"))
    __import__(name)
    assert sorted(seen) == ["first", "second"]
    assert not any(isinstance(f, AfterImport) and f.name == name for f in sys.meta_path)
