"""The offline error every reader and check raises; its own module so the reader and the
validation layer (io/validate.py) both use it without importing each other."""


class DumpError(Exception):
    """A dump that cannot be read; the message names the file and, where known, the line."""
