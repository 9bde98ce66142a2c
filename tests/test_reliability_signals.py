"""Issue 21: the tool never hangs, never kills the program, never loses what it recorded when a
signal reaches it at the wrong moment: inside its exit handling (Pool.terminate()'s SIGTERM, a
SIGTERM or SIGINT while the analyses are written), Ctrl-C to the whole process group, and two
launchers on one output root."""
import os
import signal
import subprocess
import sys

import polars as pl
import pytest

from conftest import (ROOT, check_invariants, config_of, dump_of, env_for_tests, full, read, run_cli,
                      run_folders)

SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def _complete_run(folder, analyses=("leaks",)):
    """A run whose exit handling finished: dump with PROC_EXIT, IDs 1..n, invariants, the
    analyses' results, config.json's end_time."""
    df = read(dump_of(folder))
    check_invariants(df)
    assert df["id"].to_list() == list(range(1, df.height + 1)), "rows lost or written twice"
    kinds = df.filter(pl.col("event") == "SYSTEM")["event_type"].to_list()
    assert kinds.count("PROC_EXIT") == 1 and kinds[-1] == "PROC_EXIT"
    for a in analyses:
        assert os.path.isfile(os.path.join(folder, "analysis", f"{a}.json")), a
    assert "end_time" in config_of(folder)
    return df


CLOSE_CASES = [("SIGTERM", "writer-wait"), ("SIGINT", "analysis")]
CLOSE_CASES += full([], [("SIGTERM", "analysis"), ("SIGINT", "writer-wait")])


@pytest.mark.parametrize("sig,moment", CLOSE_CASES)
def test_signal_inside_exit_handling(out_dir, sig, moment):
    """Items 1, 2, 7. Before: SIGTERM inside the wait for the writer process (what
    Pool.terminate() does to a worker) re-entered close() — a hang, or 'Exception ignored in
    atexit callback', no analysis, no end_time; SIGINT there or while the analyses were written:
    a KeyboardInterrupt traceback, leaks.json missing, exit 0. Now the signal waits for the end of
    the exit handling, which completes, and the program dies of it (128+N)."""
    r = run_cli(["-q", "-o", str(out_dir), os.path.join(SCRIPTS, "signal_in_close.py"), sig, moment],
                timeout=120)
    assert r.returncode == 128 + getattr(signal, sig), r.stderr
    assert r.stdout.splitlines()[-1] == "done" and r.stdout.count("step") == 5
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    [folder] = run_folders(out_dir)
    _complete_run(folder)


# long form only: it never hung on this machine (0 of 3 runs; 8 of 9 on the issue's), and three
# torch imports cost make test ~6 s; test_signal_inside_exit_handling[SIGTERM-writer-wait] puts the
# same SIGTERM at the same moment every time and is the one that reproduces the hang
@pytest.mark.parametrize("ctx", full([], ["spawn", "forkserver"] * 3))
def test_pool_terminate_never_hangs(out_dir, ctx):
    """Item 1 as a user meets it: a spawn/forkserver Pool(2) whose workers import torch, map,
    then terminate() (the with-block's exit). Every process exits; each traced folder is whole."""
    r = run_cli(["-q", "-o", str(out_dir), os.path.join(SCRIPTS, "pool_spawn.py"), ctx], timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["28.0", "done"]
    folders = run_folders(out_dir)
    assert folders
    whole = 0
    for f in folders:
        try:
            df = read(dump_of(f))
        except Exception as e:
            # a process that terminate() killed while its trace was being set up (forkserver: ~1
            # run in 6) leaves its header and config and nothing recorded: the readers say so in
            # one line (and `summary` lists it as that rank's error), never a torn dump
            assert "nothing was recorded" in str(e), e
            assert config_of(f)["pid"]
            continue
        check_invariants(df)
        assert df["id"].to_list() == list(range(1, df.height + 1))
        whole += 1
    assert whole >= 1  # the workers that ran the map wrote whole dumps


def _launcher_group(args):
    """The launcher in a process group of its own (as a terminal's foreground job)."""
    return subprocess.Popen([sys.executable, "-m", "msmemscope", *args], env=env_for_tests(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ctrl_c(p, after="step 3"):
    try:
        for line in p.stdout:
            if after in line:
                break
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return out, err


def test_ctrl_c_to_the_process_group_reaches_the_program_once(out_dir):
    """Item 6. Before: the launcher forwarded the SIGINT the program had already got from the
    terminal; the second one landed in the program's clean-up (here: it counts them and exits
    with the count, 2) or in the tool's atexit close (rows written twice, no PROC_EXIT)."""
    p = _launcher_group(["-q", "-o", str(out_dir), os.path.join(SCRIPTS, "ctrl_c.py"), "count"])
    out, err = _ctrl_c(p)
    assert p.returncode == 1, err  # exactly one SIGINT reached the program
    [folder] = run_folders(out_dir)
    _complete_run(folder)


@pytest.mark.skipif(not full(False, True), reason="long form (MSMEMSCOPE_TEST_FULL=1): the counting test above reproduces item 6")
def test_ctrl_c_keyboard_interrupt_keeps_everything(out_dir):
    """Item 6 with Python's own KeyboardInterrupt: status 130, the dump whole, the analysis there."""
    p = _launcher_group(["-q", "-o", str(out_dir), os.path.join(SCRIPTS, "ctrl_c.py"), "default"])
    out, err = _ctrl_c(p)
    assert p.returncode == 128 + signal.SIGINT, err
    assert "Exception ignored" not in err
    [folder] = run_folders(out_dir)
    df = read(dump_of(folder))
    # the op in flight when Ctrl-C came may lack its ATEN_END: checked without it
    assert df["id"].to_list() == list(range(1, df.height + 1))
    mallocs = df.filter(pl.col("event") == "MALLOC")["alloc_id"]
    assert mallocs.n_unique() == mallocs.len(), "allocation ids reused"
    assert df.filter(pl.col("event") == "SYSTEM")["event_type"][-1] == "PROC_EXIT"
    assert os.path.isfile(os.path.join(folder, "analysis", "leaks.json"))


def test_two_launchers_on_one_output_root(out_dir):
    """Item 8. Before: each launcher reported every folder that appeared under -o while it ran
    (the other's too), waited on the other's writer lock, and called a run still starting
    '0 events'. Now each reports the folders its own processes made (config.json's launch_id)."""
    env = env_for_tests()
    script = os.path.join(SCRIPTS, "train_small.py")
    procs = [subprocess.Popen([sys.executable, "-m", "msmemscope", "-o", str(out_dir), script, str(n)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (6, 3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    folders = run_folders(out_dir)
    assert len(folders) == 2
    ids = {config_of(f)["launch_id"] for f in folders}
    assert len(ids) == 2 and None not in ids
    for (out, err), n in zip(outs, (6, 3)):
        reported = [ln for ln in err.splitlines() if ln.startswith("[msmemscope] ") and "msmemscope_" in ln]
        assert len(reported) == 1, err  # its own folder, and only it
        [mine] = [d for d in folders if os.path.basename(d) in reported[0]]
        assert config_of(mine)["argv"][-1] == str(n)
        assert " 0 events" not in err


def test_api_misuse_said_once(tmp_path):
    """Item 16. Before: config(device="cuda:99") on a CPU host wrote an empty 'cuda' run;
    config() after start() only warned in the log file; mark(object()) recorded its repr. Now each
    is one line on stderr, once; the run traces the program's own (CPU) memory."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 99:
        pytest.skip("this host has a cuda:99")
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "api_misuse.py"), str(out)], capture_output=True,
                       text=True, env=env_for_tests(), timeout=300)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    err = r.stderr.splitlines()
    assert sum("device='cuda:99'" in ln for ln in err) == 1, r.stderr
    assert sum("config() called while a trace is already set up" in ln for ln in err) == 1, r.stderr
    assert sum("mark() takes a str" in ln for ln in err) == 1, r.stderr
    [folder] = run_folders(out)
    assert folder.endswith("_cpu")
    df = read(dump_of(folder))
    check_invariants(df)
    marks = df.filter(pl.col("event") == "MSTX")["name"].to_list()
    assert marks == ["step 0", "step 1", "step 2"]
    assert df.filter(pl.col("event") == "MALLOC").height > 0
