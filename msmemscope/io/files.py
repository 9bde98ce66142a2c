"""Creating output files and folders safely: never overwrite, never follow a
planted symlink, private permissions."""
from __future__ import annotations

import os

FILE_MODE = 0o640
DIR_MODE = 0o750


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
    """The dumps a run wrote under ``folder`` (any depth): ``memscope_dump_*.csv`` / ``.csv.zst`` / ``.db``."""
    import glob
    return sorted(set(glob.glob(os.path.join(folder, "**", "memscope_dump_*.csv"), recursive=True)
                      + glob.glob(os.path.join(folder, "**", "memscope_dump_*.csv.zst"), recursive=True)
                      + glob.glob(os.path.join(folder, "**", "memscope_dump_*.db"), recursive=True)))


def unique_path(path: str) -> str:
    """``path`` if free, else ``stem_1.ext``, ``stem_2.ext``…: an earlier result is never overwritten."""
    if not os.path.lexists(path):
        return path
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.lexists(f"{stem}_{n}{ext}"):
        n += 1
    return f"{stem}_{n}{ext}"


def create_new(path: str, binary: bool = False):
    """Open a new file for writing; fails if anything (file or symlink) is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    if binary:
        return os.fdopen(fd, "wb")
    return os.fdopen(fd, "w", encoding="utf-8", newline="")
