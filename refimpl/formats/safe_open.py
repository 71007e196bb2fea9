"""Opening the user's files without hanging or tracing back. Every reader of a user file goes through here.

Why: `open()` on a FIFO blocks until a writer appears, and reading a character device (/dev/zero) never ends; a
path with a NUL byte raises ValueError, a symlink loop or an over-long name raises OSError. So a path is checked
(`check_path`), opened with O_NONBLOCK (opening a FIFO returns at once), and the open descriptor is `fstat`ed:
only a regular file is read. Symlinks are followed (the Hugging Face cache is made of them); what they resolve
to must still be a regular file.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from refimpl.errors import CheckpointError, quote

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def check_path(path, what: str = "path", error: type[Exception] = CheckpointError) -> Path:
    """`path` as a Path, refused with one clear line if no OS call could take it (a NUL byte, not text)."""
    try:
        text = os.fspath(path)
    except TypeError:
        raise error(f"{what} must be a file path, got {quote(path)}") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise error(f"{what} {quote(text)} contains a NUL byte, which no file name can hold")
    if not text:
        raise error(f"{what} is empty")
    return Path(text)


def os_error(path, e: OSError, what: str = "", error: type[Exception] = CheckpointError) -> Exception:
    """One line for an OS failure on `path` (not found, ELOOP, ENAMETOOLONG, permission denied...)."""
    reasons = {errno.ENOENT: "file not found", errno.ELOOP: "too many levels of symbolic links (a symlink loop?)",
               errno.ENAMETOOLONG: "file name too long", errno.EACCES: "permission denied",
               errno.ENOTDIR: "a component of the path is not a directory"}
    reason = reasons.get(e.errno, e.strerror or type(e).__name__)
    return error(f"{path}: {reason}{f' ({what})' if what else ''}")


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def stat_path(path, what: str = "", error: type[Exception] = CheckpointError) -> os.stat_result | None:
    """os.stat (following symlinks) or None if nothing is there; other OS failures are one clean error."""
    path = check_path(path, error=error)
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise os_error(path, e, what, error) from None


def regular_file(path, what: str = "", error: type[Exception] = CheckpointError) -> Path:
    """`path` if it is (or links to) a regular file; for libraries that open files by name themselves."""
    path = check_path(path, error=error)
    st = stat_path(path, what, error)
    if st is None:
        raise error(f"{path}: file not found{f' ({what})' if what else ''}")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: is {file_kind(st.st_mode)}, expected a regular file"
                    f"{f' ({what})' if what else ''}")
    return path


def open_regular(path, what: str = "", error: type[Exception] = CheckpointError):
    """A binary file object for `path`, which must be a regular file; never blocks on a FIFO or device."""
    path = check_path(path, error=error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise os_error(path, e, what, error) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path}: is {file_kind(mode)}, expected a regular file{f' ({what})' if what else ''}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path, what: str = "", error: type[Exception] = CheckpointError, limit: int | None = None) -> bytes:
    """The whole regular file (refused past `limit` bytes: a 'config' that is really a 50 GB file)."""
    with open_regular(path, what, error) as f:
        if limit is not None:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise error(f"{path}: is {size} bytes, more than the {limit} expected"
                            f"{f' ({what})' if what else ''}")
        try:
            return f.read()
        except OSError as e:
            raise os_error(path, e, what, error) from None
