"""The offline error every reader and check raises; its own module so the reader and the
validation layer (io/validate.py) both use it without importing each other."""


class DumpError(Exception):
    """A dump that cannot be read; the message names the file and, where known, the line."""


def why_write_failed(exc) -> str:
    """A failed write in a few words, for the one line the user reads: 'No space left on device
    (/out/x.csv)'. SQLite says only "disk I/O error" when a write is refused with EFBIG or EIO (a
    file-size limit, a failing disk; a full disk is its own "database or disk is full"), so that
    case names the SQLite code and what it usually means."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    text = str(exc) or type(exc).__name__
    code = getattr(exc, "sqlite_errorname", None)
    if code and code.startswith("SQLITE_IOERR"):
        return f"{text} ({code}: the disk is full or failing, or the file reached its size limit)"
    return text if isinstance(exc, OSError) or code else f"{type(exc).__name__}: {text}"
