"""Options shared by the command line and ``msmemscope.config()``.

One parser per option, each raising ``OptionError`` with a message that names
the option and the values it allows, so both front ends print the same line.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from .events import EVENT_CHOICES

ANALYSES = ("leaks", "decompose", "inefficient", "oom", "none")
LEVELS = ("op", "kernel")
COLLECT_MODES = ("immediate", "deferred")
DATA_FORMATS = ("csv", "db")
COMPRESSIONS = ("none", "zstd")
DEFAULT_ZSTD_LEVEL = 3   # BENCHMARKS.md "Disk of a long run": ~9x at ~200 MB/s of one core
MAX_KEEP_STEPS = 100_000
LOG_LEVELS = ("debug", "info", "warning", "error")
LEVEL_NUMBERS = {"0": "op", "1": "kernel"}      # the original's older values
LOG_LEVEL_ALIASES = {"warn": "warning"}
DEFAULT_OUTPUT = "memscopeDumpResults"
DEFAULT_STACK_DEPTH = 50
DEFAULT_OOM_K = 10

# which events each analysis needs (SPEC §1)
ANALYSIS_EVENTS = {
    "leaks": {"alloc", "free"},
    "oom": {"alloc", "free"},
    "decompose": {"alloc", "free", "access"},
    "inefficient": {"alloc", "free", "access", "launch"},
}


class OptionError(ValueError):
    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


def split_list(value) -> list[str]:
    """Split an option list on ',' or the full-width '，'."""
    if isinstance(value, (list, tuple, set)):
        items = [str(v) for v in value]
    else:
        items = str(value).replace("，", ",").split(",")
    return [i.strip() for i in items if i.strip()]


@dataclass
class WatchSpec:
    start: str | None
    out_id: int | None
    end: str
    full_content: bool


@dataclass
class Options:
    events: set = field(default_factory=lambda: {"alloc", "free", "launch"})
    events_given: bool = False
    level: tuple = ("op",)
    python_stack: int = 0  # depth; 0 = off
    c_stack: int = 0
    analysis: tuple = ("leaks",)
    oom_k: int = DEFAULT_OOM_K
    steps: tuple = ()
    collect_mode: str = "immediate"
    device: str | None = None
    watch: WatchSpec | None = None
    output: str = DEFAULT_OUTPUT
    data_format: str = "csv"
    log_level: str = "info"
    compress: str = "none"      # the CSV dump: "none" (plain, the original's) or "zstd:<level>"
    keep_steps: int = 0         # bounded dump: every row of the last N steps; 0 = every row of every step

    def effective_events(self) -> set:
        """The events written: those asked for plus those the analyses need."""
        ev = set(self.events)
        for a in self.analysis:
            ev |= ANALYSIS_EVENTS.get(a, set())
        if self.watch is not None:
            ev.add("launch")
        if self.python_stack or self.c_stack:
            ev.add("traceback")
        return ev

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["events"] = sorted(self.events)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "Options":
        d = json.loads(text)
        d["events"] = set(d["events"])
        d["level"] = tuple(d["level"])
        d["analysis"] = tuple(d["analysis"])
        d["steps"] = tuple(d["steps"])
        if d.get("watch"):
            d["watch"] = WatchSpec(**d["watch"])
        return cls(**d)


def _choices(option, value, allowed, many=True):
    items = split_list(value)
    if not items:
        raise OptionError(option, f"empty value (allowed: {', '.join(allowed)})")
    if not many and len(items) > 1:
        raise OptionError(option, f"takes one value (allowed: {', '.join(allowed)})")
    for i in items:
        if i not in allowed:
            raise OptionError(option, f"unknown value '{i}' (allowed: {', '.join(allowed)})")
    return items


def _warn(text):
    """A warning about an option value, as the original prints it (stderr, not silenced)."""
    import sys
    print(f"[msmemscope] warning: {text}", file=sys.stderr)


def parse_events(value):
    items = _choices("--events", value, EVENT_CHOICES + ("none",))
    if "none" in items:
        if len(items) > 1:
            _warn(f"--events={','.join(items)}: 'none' is given with other events; 'none' wins "
                  "(no event is recorded beyond what the analyses need)")
        return set()
    return set(items)


def parse_level(value):
    items = [LEVEL_NUMBERS.get(i, i) for i in split_list(value)]
    items = _choices("--level", items, LEVELS)
    return tuple(dict.fromkeys(items))


def _depth(option, text):
    try:
        n = int(text)
    except ValueError:
        raise OptionError(option, f"depth '{text}' is not a number (allowed: 0-1000)") from None
    if not 0 <= n <= 1000:
        raise OptionError(option, f"depth {n} out of range (allowed: 0-1000)")
    return n


def parse_call_stack(value):
    """'python[:N],c[:N]' -> (python_depth, c_depth)."""
    py = c = 0
    for item in split_list(value):
        kind, _, depth = item.partition(":")
        if kind not in ("python", "c"):
            raise OptionError("--call-stack", f"unknown value '{item}' (allowed: python[:N], c[:N], N in 0-1000)")
        n = _depth("--call-stack", depth) if depth else DEFAULT_STACK_DEPTH
        if kind == "python":
            py = n
        else:
            c = n
    return py, c


def parse_analysis(value):
    """'leaks,oom:20' -> (names, oom_k)."""
    names, k = [], DEFAULT_OOM_K
    allowed = "leaks, decompose, inefficient, oom[:K], none"
    for item in split_list(value):
        name, _, arg = item.partition(":")
        if name not in ANALYSES:
            raise OptionError("--analysis", f"unknown value '{item}' (allowed: {allowed})")
        if arg:
            if name != "oom":
                raise OptionError("--analysis", f"'{name}' takes no argument (allowed: {allowed})")
            try:
                k = int(arg)
            except ValueError:
                raise OptionError("--analysis", f"oom:{arg}: K must be a number in 1-1000") from None
            if not 1 <= k <= 1000:
                raise OptionError("--analysis", f"oom:{k}: K must be in 1-1000")
        names.append(name)
    if not names:
        raise OptionError("--analysis", f"empty value (allowed: {allowed})")
    if "none" in names:
        if len(names) > 1:
            _warn(f"--analysis={','.join(names)}: 'none' is given with other analyses; 'none' wins (no analysis)")
        return (), k
    return tuple(dict.fromkeys(names)), k


def parse_steps(value):
    items = split_list(value)
    steps = []
    for i in items:
        try:
            n = int(i)
        except ValueError:
            raise OptionError("--steps", f"'{i}' is not a step number (allowed: up to 5 positive integers)") from None
        if n < 1:
            raise OptionError("--steps", f"'{i}' is not a step number (allowed: up to 5 positive integers)")
        steps.append(n)
    if not steps:
        raise OptionError("--steps", "empty value (allowed: up to 5 positive integers)")
    if len(set(steps)) > 5:
        raise OptionError("--steps", f"{len(set(steps))} steps given (allowed: at most 5)")
    return tuple(sorted(set(steps)))


def parse_device(value):
    v = str(value).strip()
    kind, _, idx = v.partition(":")
    if kind not in ("cpu", "cuda", "npu") or (idx and (not idx.isdigit() or kind == "cpu")):
        raise OptionError("--device", f"unknown value '{v}' (allowed: cpu, cuda[:i], npu[:i])")
    return v


def parse_watch(value):
    """'[start[:outid]],end[,full-content]' -> WatchSpec."""
    items = split_list(value)
    usage = "expected [start[:outid]],end[,full-content]"
    full = False
    if items and items[-1] == "full-content":
        full = True
        items = items[:-1]
    if len(items) == 1:
        _check_watch_op(items[0], usage)
        return WatchSpec(None, None, items[0], full)
    if len(items) != 2:
        raise OptionError("--watch", f"'{value}': {usage}")
    start, _, out = items[0].rpartition(":") if ":" in items[0] else (items[0], "", "")
    out_id = None
    if out:
        if not out.isdigit():
            raise OptionError("--watch", f"outid '{out}' is not a number; {usage}")
        out_id = int(out)
    _check_watch_op(start, usage)
    _check_watch_op(items[1], usage)
    return WatchSpec(start, out_id, items[1], full)


def _check_watch_op(name, usage):
    """An op is named 'aten.mm.default', 'aten.mm', 'mm' (or the dump's 'torch._ops.aten.mm.default'),
    optionally followed by '#N', the N-th call (N >= 1)."""
    op, sep, n = name.partition("#")
    if not op.strip() or (sep and not (n.isdigit() and int(n) >= 1)):
        raise OptionError("--watch", f"op '{name}' is not an op name with an optional call index "
                                     f"'#N' (N >= 1), e.g. aten.mm.default#2; {usage}")


def parse_compress(value):
    """'none' | 'zstd' | 'zstd:N' (N in 1-19) -> 'none' | 'zstd:N'."""
    v = str(value).strip().lower()
    kind, sep, level = v.partition(":")
    usage = "allowed: none, zstd, zstd:N with N in 1-19"
    if kind == "none" and not sep:
        return "none"
    if kind != "zstd":
        raise OptionError("--compress", f"unknown value '{value}' ({usage})")
    n = DEFAULT_ZSTD_LEVEL
    if sep:
        if not level.isdigit() or not 1 <= int(level) <= 19:
            raise OptionError("--compress", f"level '{level}' is not a number in 1-19 ({usage})")
        n = int(level)
    try:
        import zstandard  # noqa: F401
    except ImportError:
        raise OptionError("--compress", "zstd needs the zstandard package (pip install zstandard)") from None
    return f"zstd:{n}"


def parse_keep_steps(value):
    """N >= 1 (0 or 'all': every step kept, the default)."""
    v = str(value).strip().lower()
    if v in ("0", "all", "none", ""):
        return 0
    if not v.isdigit() or not 1 <= int(v) <= MAX_KEEP_STEPS:
        raise OptionError("--keep-steps", f"'{value}' is not a number of steps (allowed: 1-{MAX_KEEP_STEPS}, "
                                          "or 0/all to keep every step)")
    return int(v)


def parse_choice(option, value, allowed):
    return _choices(option, value, allowed, many=False)[0]


def check_output(path):
    p = str(path).strip()
    if not p:
        raise OptionError("--output", "empty path")
    return os.path.abspath(os.path.expanduser(p))


_ALIASES = {"output_path": "output", "format": "data_format"}


def canonical(key: str) -> str:
    """The option a config() keyword sets (``output_path`` -> ``output``, ``format`` -> ``data_format``)."""
    k = str(key).replace("-", "_").lower()
    return _ALIASES.get(k, k)


# config() keyword -> (field, parser); aliases as in the original
def _apply(opts: Options, key: str, value):
    k = key.replace("-", "_").lower()
    if k == "events":
        opts.events, opts.events_given = parse_events(value), True
    elif k == "level":
        opts.level = parse_level(value)
    elif k == "call_stack":
        opts.python_stack, opts.c_stack = parse_call_stack(value)
    elif k == "analysis":
        opts.analysis, opts.oom_k = parse_analysis(value)
    elif k == "steps":
        opts.steps = parse_steps(value)
    elif k == "collect_mode":
        opts.collect_mode = parse_choice("--collect-mode", value, COLLECT_MODES)
    elif k == "device":
        opts.device = parse_device(value)
    elif k == "watch":
        opts.watch = parse_watch(value) if value else None
    elif k in ("output", "output_path"):
        opts.output = check_output(value)
    elif k in ("data_format", "format"):
        opts.data_format = parse_choice("--data-format", value, DATA_FORMATS)
    elif k == "log_level":
        v = str(value).strip().lower()
        opts.log_level = parse_choice("--log-level", LOG_LEVEL_ALIASES.get(v, v), LOG_LEVELS)
    elif k == "compress":
        opts.compress = parse_compress(value)
    elif k == "keep_steps":
        opts.keep_steps = parse_keep_steps(value)
    else:
        allowed = ("events, level, call_stack, analysis, steps, collect_mode, device, watch, "
                   "output (output_path), data_format (format), log_level, compress, keep_steps")
        raise OptionError(key, f"unknown option (allowed: {allowed})")


def build(base: Options | None = None, **kwargs) -> Options:
    opts = dataclasses.replace(base) if base else Options()
    for k, v in kwargs.items():
        if v is not None:
            _apply(opts, k, v)
    if opts.compress != "none" and opts.data_format == "db":
        raise OptionError("--compress", "compresses the CSV dump; a --data-format=db dump is not compressed "
                                        "(choose one of them)")
    return opts
