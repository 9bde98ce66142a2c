"""The native source without a build step: built on the first run that can use it (one line says
so), a build that cannot succeed falls back at once and is not tried again, a process that finds
another one building waits a bounded time; and, in the long form, the whole path of a pip user:
a wheel installed into a fresh venv builds the source on its first run and every later run uses it."""
from __future__ import annotations

import fcntl
import glob
import os
import subprocess
import sys

import pytest

from conftest import FULL, ROOT, check_invariants, config_of, dump_of, env_for_tests, read, run_folders

# a training step by hand: a torch.optim optimizer would import torch._dynamo (1.5 CPU s a run),
# which these tests of the build do not need
PROG = """
import torch
from torch import nn
torch.manual_seed(0)
m = nn.Linear(8, 4)
for _ in range(2):
    m.zero_grad()
    m(torch.randn(4, 8)).sum().backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.1 * p.grad
print("done", flush=True)
"""


def _trace(python, tmp_path, name, env, cwd=None):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    out = tmp_path / name
    r = subprocess.run([python, "-m", "msmemscope", "-o", str(out), str(prog)], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done" in r.stdout  # the program ran and printed what it prints
    (folder,) = run_folders(out)
    check_invariants(read(dump_of(folder)))
    return r, config_of(folder)


def _env(tmp_path, **extra):
    env = env_for_tests()
    env.pop("MSMEMSCOPE_NATIVE_BUILD", None)  # the default: build on first use
    env["MSMEMSCOPE_NATIVE_DIR"] = str(tmp_path / "cache")
    env.update(extra)
    return env


def test_a_build_that_cannot_succeed_falls_back_once(tmp_path):
    env = _env(tmp_path, CXX="/bin/false")  # a compiler that fails at once
    r, conf = _trace(sys.executable, tmp_path, "a", env)
    assert r.stderr.count("building the native source once") == 1
    assert "could not be built" in r.stderr
    assert conf["source"] == "dispatch" and conf["native_missing"]
    # what the compiler said, for the user: one file for the native source and one for the leak
    # rule's module, which compiles beside it
    (failed,) = glob.glob(str(tmp_path / "cache" / "msmemscope_native_*" / "build-failed.txt"))
    assert os.path.getsize(failed) > 0
    assert len(glob.glob(str(tmp_path / "cache" / "msmemscope_leakrule_*" / "build-failed.txt"))) == 1
    # the next run does not try again (nor wait for it): it says why in its log and config
    r, conf = _trace(sys.executable, tmp_path, "b", env)
    assert "building the native source" not in r.stderr
    assert conf["source"] == "dispatch" and "failed before" in conf["source_note"]


def test_no_compiler_no_build_no_wait(tmp_path):
    env = _env(tmp_path, CXX="no-such-compiler-here")
    r, conf = _trace(sys.executable, tmp_path, "a", env)
    assert "building the native source" not in r.stderr
    assert conf["source"] == "dispatch" and "no C++ compiler" in conf["source_note"]
    assert not glob.glob(str(tmp_path / "cache" / "*" / "build-failed.txt"))


def test_another_process_building_is_waited_for_a_bounded_time(tmp_path):
    """While another process holds the build lock (a rank that builds), a run waits at most the
    build timeout, then traces with the dispatch-mode source; it never builds a second copy."""
    env = _env(tmp_path, MSMEMSCOPE_NATIVE_BUILD_TIMEOUT="2")
    code = "import sys; sys.path.insert(0, sys.argv[1]); from msmemscope.capture import native; print(native.build_dir())"
    d = subprocess.run([sys.executable, "-c", code, ROOT], env=env, capture_output=True, text=True).stdout.strip()
    os.makedirs(d)
    with open(os.path.join(d, ".build.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r, conf = _trace(sys.executable, tmp_path, "a", env)
    assert r.stderr.count("waiting for another process building the native source") == 1
    assert "building the native source once" not in r.stderr
    assert conf["source"] == "dispatch" and "still building" in conf["source_note"]


@pytest.mark.skipif(not FULL, reason="long form (MSMEMSCOPE_TEST_FULL=1): builds a wheel and the native source")
def test_wheel_in_a_fresh_venv_builds_on_first_run(tmp_path):
    """pip's path: a wheel of this checkout in a fresh venv (torch from the test interpreter's
    site-packages through a .pth file, nothing else shared). Two runs started together build the
    source once between them; both finish; a third run uses the cached build at once."""
    import shutil
    import sysconfig
    src = tmp_path / "src"  # a copy: building leaves build/ and *.egg-info beside the sources
    shutil.copytree(os.path.join(ROOT, "msmemscope"), src / "msmemscope",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = glob.glob(str(wheels / "msmemscope-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the installed wheel first on the path, the test venv's packages (torch, polars) after it
    with open(os.path.join(site, "zz_test_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, whl],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    env = _env(tmp_path)
    env.pop("PYTHONPATH", None)  # the checkout is not on the path: only the wheel
    where = subprocess.run([py, "-c", "import msmemscope; print(msmemscope.__file__)"], env=env,
                           capture_output=True, text=True, cwd=str(tmp_path)).stdout
    assert where.startswith(site), where
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    procs = [subprocess.Popen([py, "-m", "msmemscope", "-o", str(tmp_path / f"r{i}"), str(prog)], env=env,
                              cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    err = "".join(o[1] for o in outs)
    assert err.count("building the native source once") == 1, err
    assert "native source built in" in err
    confs = [config_of(run_folders(tmp_path / f"r{i}")[0]) for i in range(2)]
    assert all(c["source"] == "native" for c in confs), confs
    # the leak rule's C++ module (no torch in it, for the offline replay too) was built with it
    assert glob.glob(str(tmp_path / "cache" / "msmemscope_leakrule_*" / "msmemscope_leakrule_*.so"))
    r = subprocess.run([py, "-m", "msmemscope", "-o", str(tmp_path / "r3"), str(prog)], env=env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "building" not in r.stderr and "waiting" not in r.stderr
    (folder,) = run_folders(tmp_path / "r3")
    assert config_of(folder)["source"] == "native"
    check_invariants(read(dump_of(folder)))
