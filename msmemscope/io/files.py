"""Creating output files and folders safely: never overwrite, never follow a
planted symlink, private permissions."""
from __future__ import annotations

import contextlib
import os

FILE_MODE = 0o640
DIR_MODE = 0o750

# Fault injection for the reliability tests: MSMEMSCOPE_FAULT=<role>:<n>:<ERRNO>[,…] makes the
# n-th write of a process of that role ("traced": the traced process; "writer": the dump writer
# process) fail with that errno; ``<n>+`` makes it and every later one fail, as a full disk does.
# Counted writes: each file created (create_new), each batch of dump rows, each batch handed to
# the writer process.
ROLE = "traced"
_writes = 0
_faults = None


def fault_point() -> None:
    global _writes, _faults
    if _faults is None:
        import errno
        _faults = {}
        for part in os.environ.get("MSMEMSCOPE_FAULT", "").split(","):
            role, _, rest = part.strip().partition(":")
            n, _, name = rest.partition(":")
            sticky = n.endswith("+")
            n = n.rstrip("+")
            if role and n.isdigit() and hasattr(errno, name):
                _faults[role] = (int(n), getattr(errno, name), sticky)
    if not _faults:
        return
    _writes += 1
    hit = _faults.get(ROLE)
    if hit is not None and (_writes == hit[0] or hit[2] and _writes > hit[0]):
        raise OSError(hit[1], os.strerror(hit[1]) + " (injected by MSMEMSCOPE_FAULT)")


def make_dirs(path: str) -> str:
    """Create ``path`` and any missing parents, each 0o750; refuse a symlink planted at ``path``."""
    if os.path.islink(path):
        raise OSError(f"refusing to write through the symlink {path}")
    if os.path.isdir(path):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    if parent and not os.path.isdir(parent):
        make_dirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if os.path.islink(path) or not os.path.isdir(path):
            raise
    return path


def dump_files(folder: str) -> list[str]:
    """The dumps a run wrote under ``folder`` (any depth): ``memscope_dump_*.csv`` / ``.csv.zst`` / ``.db``.
    Regular files only: a FIFO or device planted under a dump's name would block a reader."""
    import glob
    found = set(glob.glob(os.path.join(folder, "**", "memscope_dump_*.csv"), recursive=True)
                + glob.glob(os.path.join(folder, "**", "memscope_dump_*.csv.zst"), recursive=True)
                + glob.glob(os.path.join(folder, "**", "memscope_dump_*.db"), recursive=True))
    return sorted(p for p in found if is_regular(p))


def is_regular(path: str) -> bool:
    """A regular file (through symlinks): not a FIFO, socket or device, which can block a read."""
    import stat
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def unique_path(path: str) -> str:
    """``path`` if free, else ``stem_1.ext``, ``stem_2.ext``…: an earlier result is never overwritten."""
    if not os.path.lexists(path):
        return path
    stem, ext = os.path.splitext(path)
    if ext == ".zst" and stem.endswith(".csv"):  # x.csv.zst -> x_1.csv.zst
        stem, ext = stem[:-4], ".csv.zst"
    n = 1
    while os.path.lexists(f"{stem}_{n}{ext}"):
        n += 1
    return f"{stem}_{n}{ext}"


def create_new(path: str, binary: bool = False):
    """Open a new file for writing; fails if anything (file or symlink) is already there."""
    fault_point()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    if binary:
        return os.fdopen(fd, "wb")
    # a path that is not UTF-8 (a stack line, a report's title) is written as \\udcff: the file stays UTF-8
    return os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", newline="")


def cannot_write_under(root: str) -> str:
    """Why no run folder can be made under ``root`` ("" where one can): its folders made, writable,
    and a file created and removed there (``os.access`` says yes to root on a read-only mount)."""
    try:
        make_dirs(root)
        if not os.access(root, os.W_OK | os.X_OK):
            return "not writable"
        probe = unique_path(os.path.join(root, f".msmemscope_probe_{os.getpid()}"))
        create_new(probe).close()
        os.unlink(probe)
        return ""
    except OSError as e:
        return e.strerror or str(e)


@contextlib.contextmanager
def write_new(path: str, binary: bool = False):
    """``create_new`` for a file written whole at once (a report, an export, a result): where the
    write fails (a full disk, an error making its content) no part of it stays behind. A
    truncated file stayed in its place, and the next run, which never overwrites, wrote ``_1``."""
    f = create_new(path, binary)
    try:
        with f:
            yield f
    except BaseException:
        remove_quietly(path)
        raise


def remove_quietly(path: str) -> None:
    """Remove a file we made, if it is there (no error where it cannot be)."""
    try:
        os.unlink(path)
    except OSError:
        pass


class polars_path:
    """A path polars can open: polars takes UTF-8 paths only, so a path that is not (a file named
    with bytes such as ``\\xff``, held by Python as surrogates) is opened here and handed over as
    ``/proc/self/fd/N``. Other sources (paths, buffers) pass through."""

    def __init__(self, source):
        self.source, self.fd = source, None

    def __enter__(self):
        if isinstance(self.source, str):
            try:
                self.source.encode("utf-8")
            except UnicodeEncodeError:
                self.fd = os.open(self.source, os.O_RDONLY)
                return f"/proc/self/fd/{self.fd}"
        return self.source

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
        return False
