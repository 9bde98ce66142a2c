"""The ``msmemscope`` command: a thin layer over the same API users call.

    msmemscope [options] [--] <program> [args…]     trace a program
    msmemscope --compare --input=a,b [--level=…]    offline step compare
    msmemscope <subcommand> …                       offline analyses and reports
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from . import __version__
from . import options as O

PROG = "msmemscope"
# offline subcommands -> module with ``main(argv) -> int``
SUBCOMMANDS = {
    "check-leaks": "msmemscope.analysis.leaks",
    "check-inefficient": "msmemscope.analysis.inefficient",
    "report": "msmemscope.report.html",
    "export": "msmemscope.report.export",
    "summary": "msmemscope.report.summary",
    "show": "msmemscope.report.console",
    "decompose": "msmemscope.analysis.decompose",
}


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, nothing run
        raise UsageError(message)


def error_exit(msg: str, code: int = 2) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False, add_help=False,
                usage="msmemscope [options] [--] <program> [args...]\n"
                      "       msmemscope --compare --input=<a>,<b> [--level=op|kernel]\n"
                      "       msmemscope {" + ",".join(SUBCOMMANDS) + "} ...",
                description="Memory analysis for PyTorch programs (CPU, CUDA, Ascend NPU).")
    a = p.add_argument
    a("-h", "--help", action="store_true", help="show this help and exit")
    a("-V", "--version", action="store_true", help="print the version and exit")
    a("--load-api-env", "--unload-api-env", dest="api_env", action="store_true",
      help="the original's environment setup for its API: not needed here (says so and exits)")
    a("--events", help="alloc,free,launch,access,traceback (default alloc,free,launch)")
    a("--level", help="op (default), kernel; both allowed")
    a("--call-stack", help="python[:N],c[:N] (N in 0-1000, default 50)")
    a("--analysis", help="leaks (default), decompose, inefficient, oom[:K], none; several allowed")
    a("--steps", help="record only these steps (at most 5 numbers)")
    a("--collect-mode", help="immediate (default) or deferred (only between msmemscope.start() and stop())")
    a("--device", help="cpu, cuda[:i], npu[:i] (default: what the program uses)")
    a("--watch", help="[start[:outid]],end[,full-content]")
    a("--compare", action="store_true", help="compare two dumps or two steps (with --input)")
    a("-i", "--input-path", "--input", dest="input",
      help="for --compare: <a>,<b>; a dump, an output folder, or dump.csv:step=N")
    a("-o", "--output-path", "--output", dest="output", help="output root (default ./memscopeDumpResults)")
    a("--data-format", "--format", dest="data_format", help="csv (default) or db")
    a("--compress", help="the CSV dump: none (default, plain .csv) or zstd[:LEVEL] (.csv.zst, LEVEL 1-19, default 3)")
    a("--keep-steps", help="bounded dump: every row of the last N steps and of the steps that first show a "
                           "block left behind; the rest keep their blocks that outlive the step and a summary row")
    a("--log-level", help="debug, info, warning (warn), error")
    a("-v", "--verbose", "--debug", dest="verbose", action="store_true", help="more messages (log level debug)")
    a("-q", "--quiet", action="store_true", help="no console summary from the tool")
    a("program", nargs=argparse.REMAINDER, help="the program to trace and its arguments")
    return p


# options with a value that are taken even after the program, as the original's parser does (``--name=value``)
LATE_OPTIONS = ("events", "level", "call-stack", "analysis", "steps", "collect-mode", "device", "watch",
                "output-path", "output", "data-format", "format", "log-level")


def split_late_options(program: list[str]) -> tuple[list[str], list[str]]:
    """(our options, the program's argv) from what follows the program's name.

    ``msmemscope train.py --steps=3`` traces train.py with --steps=3, as the original does. The
    scan stops at a ``--``: removed where it ended options of ours taken before it, else the
    program's own (``train.py a -- b`` gets ``a -- b``, as without us: it was dropped before);
    ``msmemscope [options] -- <program> [args]`` hands every argument to the program untouched."""
    taken, rest = [], [program[0]]
    for i, arg in enumerate(program[1:], 1):
        if arg == "--":
            rest.extend(program[i + 1:] if taken else program[i:])
            break
        name, eq, _ = arg.partition("=")
        if eq and name.startswith("--") and name[2:] in LATE_OPTIONS:
            taken.append(arg)
        else:
            rest.append(arg)
    return taken, rest


def parse_options(ns) -> O.Options:
    kw = {k: getattr(ns, k) for k in ("events", "level", "call_stack", "analysis", "steps", "collect_mode",
                                      "device", "watch", "output", "data_format", "log_level", "compress",
                                      "keep_steps")}
    if ns.verbose:
        kw["log_level"] = "debug"
    opts = O.build(None, **kw)
    if opts.output == O.DEFAULT_OUTPUT:
        opts.output = os.path.abspath(O.DEFAULT_OUTPUT)
    return opts


def _one_line_warnings():
    """Offline commands: a warning (e.g. a dump cut short) is one line on stderr, not Python's two."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{PROG}: warning: {message}", file=sys.stderr)
    warnings.showwarning = show


def _paths_print_as_they_are():
    """A path that is not UTF-8 (held by Python as surrogates) is printed as its bytes, as ls
    does, not a UnicodeEncodeError (stderr already uses backslashreplace)."""
    try:
        sys.stdout.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError, OSError):
        pass


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _paths_print_as_they_are()
    if argv and (argv[0] in SUBCOMMANDS or "--compare" in argv or any(a.startswith(("--input", "-i")) for a in argv)):
        _one_line_warnings()
    if argv and argv[0] in SUBCOMMANDS:
        import importlib
        try:
            return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("msmemscope"):
                return error_exit(f"'{argv[0]}' is not available in this build")
            raise
    parser = build_parser()
    argv = _module_program_after_dashes(parser, argv)
    try:
        ns = parser.parse_args(argv)
        late = []
        if ns.program and ns.program[0] != "--":
            late, rest = split_late_options(ns.program)
            if late or rest != ns.program:
                ns = parser.parse_args(argv[:len(argv) - len(ns.program)] + late + ["--"] + rest)
        opts = parse_options(ns)
    except UsageError as e:
        return error_exit(str(e))
    except O.OptionError as e:
        return error_exit(str(e))
    if ns.help:
        parser.print_help()
        return 0
    if ns.version:
        print(f"{PROG} {__version__}")
        return 0
    if ns.api_env:
        print(f"[{PROG}] --load-api-env/--unload-api-env: nothing to set; the Python API (import msmemscope) "
              f"needs no LD_PRELOAD or LD_LIBRARY_PATH here", file=sys.stderr)
        return 0
    program = ns.program
    if program and program[0] == "--":
        program = program[1:]
    if ns.compare or ns.input:
        if program:
            return error_exit("--compare takes no program; give the dumps with --input=<a>,<b>")
        if not (ns.compare and ns.input):
            return error_exit("--compare and --input must be used together: --compare --input=<a>,<b>")
        try:
            from .analysis import compare
        except ModuleNotFoundError:
            return error_exit("--compare is not available in this build")
        return compare.main_from_cli(ns.input, opts)
    if not program:
        return error_exit("no program given (usage: msmemscope [options] [--] <program> [args...])")
    if late:
        print(f"[{PROG}] taken as msmemscope options (they came after the program): {' '.join(late)}; "
              f"to give them to the program instead: msmemscope [options] -- <program> [args]", file=sys.stderr)
    err = device_unavailable(opts.device)
    if err:
        return error_exit(err)
    return launch(program, opts, quiet=ns.quiet, cli_set=cli_given(ns))


def cli_given(ns) -> list[str]:
    """The option keys the command line set: a script's msmemscope.config() sets the others."""
    keys = [k for k in ("events", "level", "call_stack", "analysis", "steps", "collect_mode", "device", "watch",
                        "output", "data_format", "log_level", "compress", "keep_steps") if getattr(ns, k) is not None]
    if ns.verbose and "log_level" not in keys:
        keys.append("log_level")
    return keys


def device_unavailable(device):
    """A --device this machine does not have: one line, before anything runs."""
    if not device or device == "cpu":
        return None
    kind, _, idx = device.partition(":")
    if kind == "npu":
        import importlib.util
        if importlib.util.find_spec("torch_npu") is None:
            return f"--device={device}: no Ascend NPU here (torch_npu is not installed)"
        return None
    if kind == "cuda":
        try:
            import torch
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception as e:
            return f"--device={device}: cannot check for CUDA devices ({e})"
        if n == 0:
            return f"--device={device}: no CUDA device is available"
        if idx and int(idx) >= n:
            return f"--device={device}: this machine has {n} CUDA device(s) (0-{n - 1})"
    return None


def _module_program_after_dashes(parser, argv: list[str]) -> list[str]:
    """``msmemscope [options] -m pkg.mod args``: argparse takes ``-m`` for an option of ours (we have
    none) and refuses it; the program starts there, as after ``--``. Not where ``-m`` is the value
    of an option before it (``-o -m``)."""
    takes_value = {s for a in parser._actions for s in a.option_strings if a.nargs != 0}
    for i, tok in enumerate(argv):
        if tok == "--":
            break
        if tok == "-m" and (i == 0 or argv[i - 1] not in takes_value):
            return argv[:i] + ["--"] + argv[i:]
        if not tok.startswith("-") and (i == 0 or argv[i - 1] not in takes_value):
            break  # the program began: its own -m is its own
    return argv


def resolve_command(program: list[str]) -> list[str]:
    first = program[0]
    if first == "-m":
        if len(program) < 2:
            raise UsageError("-m needs a module name")
        return [sys.executable] + program
    if first.endswith(".py"):
        if not os.path.isfile(first):
            raise UsageError(f"program '{first}': no such file")
        return [sys.executable] + program
    if os.path.sep in first:
        if not os.path.exists(first):
            raise UsageError(f"program '{first}': no such file")
        return program
    if shutil.which(first) is None:
        raise UsageError(f"program '{first}': command not found")
    return program


def launch(program: list[str], opts: O.Options, quiet: bool = False, cli_set=()) -> int:
    try:
        cmd = resolve_command(program)
    except UsageError as e:
        return error_exit(str(e))
    created_root = not os.path.exists(opts.output)
    from .io.files import cannot_write_under
    why = cannot_write_under(opts.output)
    if why:
        return error_exit(f"--output: cannot write to {opts.output}: {why}")
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    boot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
    env = dict(os.environ)
    env["MSMEMSCOPE_OPTIONS"] = opts.to_json()
    env["MSMEMSCOPE_CLI_SET"] = ",".join(cli_set)
    runs_fd, runs_file = tempfile.mkstemp(prefix="msmemscope_runs_")
    os.close(runs_fd)
    env["MSMEMSCOPE_RUNS"] = runs_file  # each traced process appends its run folder (wherever config() put it)
    env["MSMEMSCOPE_PKG_ROOT"] = pkg_root
    if quiet:
        env["MSMEMSCOPE_QUIET"] = "1"
    # every traced process of this launch writes it into its config.json: the results are the
    # folders this launch made, not another launcher's on the same -o root
    launch_id = env["MSMEMSCOPE_LAUNCH_ID"] = f"{os.getpid()}-{os.urandom(6).hex()}"
    env["PYTHONPATH"] = boot + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    before = set(os.listdir(opts.output))
    started = time.time()
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as e:
        return error_exit(f"cannot start '{program[0]}': {e.strerror}", 127)

    def forward(signum, _frame):
        if signum == signal.SIGINT and _same_group(proc.pid):
            return  # Ctrl-C went to the whole process group: the program has it already
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass
    # Ctrl-C reaches the program through the terminal's process group; the launcher waits for
    # it to finish its own handling, as a shell does, and never sends it a second one (which
    # would land in the program's own clean-up). SIGTERM and SIGHUP, sent to the launcher
    # alone by a scheduler, are forwarded.
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    code = rc if rc >= 0 else 128 - rc
    new = sorted(d for d in set(os.listdir(opts.output)) - before if d.startswith("msmemscope_"))
    mine = [f for f in (os.path.join(opts.output, d) for d in new) if _launched_by(f, launch_id)]
    mine = _listed_runs(runs_file, mine)
    if not os.listdir(opts.output) and not before and created_root:
        try:
            os.rmdir(opts.output)  # the script's config() chose another output folder
        except OSError:
            pass
    _wait_for_writers(mine)
    if not quiet:
        _print_results(opts, mine, time.time() - started)
    return code


def _listed_runs(runs_file, found):
    """Run folders the traced processes reported (``MSMEMSCOPE_RUNS``) plus those found under the
    output root; only those that still exist (a run folder moved by config() is listed twice)."""
    listed = []
    try:
        with open(runs_file, "rb") as f:
            listed = [os.fsdecode(ln.strip()) for ln in f if ln.strip()]
    except OSError:
        pass
    finally:
        try:
            os.unlink(runs_file)
        except OSError:
            pass
    out = []
    for d in found + listed:
        d = os.path.abspath(d)
        if d not in out and os.path.isdir(d):
            out.append(d)
    return sorted(out)


def _same_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == os.getpgrp()
    except OSError:
        return False


def _launched_by(folder: str, launch_id: str) -> bool:
    """The run folder was made by a process of this launch (its config.json says so)."""
    import json
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            cfg = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(cfg, dict) and cfg.get("launch_id") == launch_id


def _wait_for_writers(folders):
    """A program killed by a signal may leave its dump writer process draining the last rows."""
    from .io.files import dump_files
    from .io.spool import wait_for_writer
    for folder in folders:
        for dump in dump_files(folder):
            if not wait_for_writer(dump):
                print(f"[{PROG}] the dump writer of {folder} is still busy; its results may be incomplete",
                      file=sys.stderr)


def _print_results(opts, folders, seconds):
    if not folders:
        print(f"[{PROG}] no Python process of the program imported torch: nothing was traced", file=sys.stderr)
        return
    try:
        from .report.console import run_summary
        run_summary(folders, seconds)
    except Exception as e:  # the results are on disk whatever the summary does
        print(f"[{PROG}] results: {', '.join(folders)} (summary failed: {e})", file=sys.stderr)


def entry():
    sys.exit(main())


if __name__ == "__main__":
    entry()
