"""The original tool's mark API names (``mstx.mark``, ``mstx.range_start``, ``mstx.range_end``)."""
from .capture.marks import mark, range_end, range_start  # noqa: F401
