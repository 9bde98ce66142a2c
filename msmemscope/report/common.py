"""What the report and the exports share: finding a run's dumps and folder,
reading them into one frame, naming the op behind each memory event."""
from __future__ import annotations

import os
import warnings

import polars as pl

from ..io.reader import DEFAULT_COLUMNS, DamagedDumpWarning, DumpError, TruncatedDumpWarning, find_dumps, read_dump, read_dump_batched


class ReportError(Exception):
    """Bad input for a report/export command: printed as one line, exit 2."""


def run_folder_of(path: str) -> str | None:
    """The msmemscope output folder (the one holding config.json) a dump belongs to, if any."""
    d = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path))
    for _ in range(4):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return None


def locate(path: str) -> tuple[list[str], str | None]:
    """The dumps to read for ``path`` (a dump, or an output folder) and their run folder."""
    if not os.path.exists(path):
        raise ReportError(f"{path}: no such file or directory")
    try:
        dumps = find_dumps(path)
    except DumpError as e:
        raise ReportError(str(e)) from None
    folders = sorted({run_folder_of(d) or os.path.dirname(os.path.abspath(d)) for d in dumps})
    if len(folders) > 1:
        raise ReportError(f"{path}: holds {len(folders)} runs; name one of them (e.g. {folders[0]})")
    folder = run_folder_of(path) if os.path.isdir(path) or run_folder_of(path) else None
    if folder is None and os.path.isdir(path):
        folder = os.path.abspath(path)
    return dumps, folder


#: the columns the HTML report reads (read_all(batched=True))
REPORT_COLUMNS = ("id", "event", "event_type", "name", "ts", "tid", "device", "attr", "py_stack", "alloc_id",
                  "size", "used", "total", "owner", "step", "op", "module")


def read_all(dumps: list[str], batched: bool = False) -> pl.DataFrame:
    """Read one or more dumps of one run (one per device) into one frame ordered by time.
    ``batched``: parsed a batch at a time, text columns as categoricals, Attr only on the rows
    other than MALLOC/FREE/ACCESS (``read_dump_batched``: the HTML report of a long run)."""
    frames = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("default", TruncatedDumpWarning)  # a dump cut short is said, once
        warnings.simplefilter("default", DamagedDumpWarning)    # and one with a frame skipped
        for d in dumps:
            try:
                frames.append(read_dump_batched(d, columns=REPORT_COLUMNS) if batched
                              else read_dump(d, columns=DEFAULT_COLUMNS + ("op",)))
            except DumpError as e:
                raise ReportError(str(e)) from None
    if len(frames) == 1:
        return frames[0]
    return pl.concat(frames, how="vertical_relaxed").sort("ts", "id", maintain_order=True)


def with_op(df: pl.DataFrame) -> pl.DataFrame:
    """Set ``op``: the op behind each row — its own name where it has one (our MALLOC/FREE rows
    name their op), else the innermost ATEN op open on its thread (the reader's ``op`` column;
    the original tool writes N/A there)."""
    if "op" not in df.columns:
        from ..io.reader import _enclosing_op
        df = df.with_columns(_enclosing_op(df))
    own = pl.col("name")
    has_own = own.is_not_null() & (own != "N/A") & (own != "")
    if df.schema["name"] == pl.Categorical or df.schema["op"] == pl.Categorical:
        # categoricals (a batched read): the same on the few distinct names, not on every row
        name, enc = own.cast(pl.Categorical), pl.col("op").cast(pl.Categorical)
        df = df.with_columns(op=pl.when(has_own).then(name).otherwise(enc))
        df = df.with_columns(op=pl.when(pl.col("op") == "").then(None).otherwise(pl.col("op")))
        names = df["op"].unique().drop_nulls().cast(pl.String).to_list()
        short = {n: n[len("torch._ops."):] for n in names if n.startswith("torch._ops.")}
        return df.with_columns(pl.col("op").replace(short)) if short else df
    op = pl.when(has_own).then(own).otherwise(pl.col("op"))
    return df.with_columns(op=pl.when(op == "").then(None).otherwise(op).str.replace(r"^torch\._ops\.", ""))


def short_op(name) -> str:
    if not name:
        return ""
    return name[len("torch._ops."):] if name.startswith("torch._ops.") else name


def human_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TB"


def check_output(path: str) -> str:
    """The path to write, never an existing one; errors name the problem in one line."""
    from ..io.files import unique_path
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise ReportError(f"-o {path}: folder {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ReportError(f"-o {path}: cannot write to {d}")
    if os.path.isdir(path):
        raise ReportError(f"-o {path}: is a folder; give a file name")
    return unique_path(path)
