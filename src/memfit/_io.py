"""Files memfit writes: every one atomically, so an interrupt, a full disk or a crash never leaves half a file.

A file is written to a temporary file in the target's own folder (so the rename stays on one filesystem), flushed
to disk, then renamed over the target: readers see the old file or the new one, never a torn one. On any failure
the temporary file is removed and the target is left as it was.

Example::

    >>> import os, tempfile
    >>> from memfit._io import write_atomic
    >>> path = write_atomic(os.path.join(tempfile.mkdtemp(), "plan.json"), '{"schema": 1}')
    >>> path.read_text()
    '{"schema": 1}'
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from memfit.errors import UsageError


def check_output_path(path: str | os.PathLike[str], what: str = "the output") -> Path:
    """``path`` as a file memfit may write: not a folder, in a folder that exists and is writable.

    Called before long work, so a bad ``--save`` or ``--report`` fails at once rather than after minutes.

    Raises:
        UsageError: one line naming the path and what to do.
    """
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"cannot write {what} to {str(target)!r}: it is a directory. "
                         f"Name a file inside it, e.g. {str(target / target.name)!r}.")
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"cannot write {what} to {str(target)!r}: the folder {str(folder)!r} does not exist. "
                         "Create it first or name another path.")
    problem = _unwritable(folder)
    if problem:
        raise UsageError(f"cannot write {what} to {str(target)!r}: the folder {str(folder)!r} is not writable "
                         f"({problem}). Name a path in a folder you can write to.")
    return target


def check_output_dir(path: str | os.PathLike[str], what: str = "the output") -> Path:
    """``path`` as a folder memfit may write files into: a writable folder, or one it can create.

    Raises:
        UsageError: one line naming the path and what to do.
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"cannot write {what} into {str(folder)!r}: it is a file, not a directory. "
                         "Name a directory (it is created if missing).")
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = _unwritable(existing) if existing.is_dir() else "not a folder"
    if problem:
        raise UsageError(f"cannot write {what} into {str(folder)!r}: {str(existing)!r} is not writable "
                         f"({problem}). Name a folder you can write to.")
    return folder


def _unwritable(folder: Path) -> str:
    """Why no file can be created in ``folder``, or ''. A real probe: permission bits say nothing for root,
    a read-only mount or an ACL."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "permission denied"
    try:
        fd, probe = tempfile.mkstemp(prefix=".memfit-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(probe)
    return ""


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], *, what: str = "the output") -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path`` for binary writing; on a clean exit it replaces ``path``.

    Raises:
        UsageError: the file could not be written (full disk, permissions): one line, the temporary file gone.
    """
    target = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise UsageError(f"cannot write {what} to {str(target)!r}: {exc.strerror or exc}.") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the rename must not land on disk before the data does
        # mkstemp makes the file private (0600); give it the permissions the user's umask gives any new file
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"cannot write {what} to {str(target)!r}: {exc.strerror or exc}.") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike[str], payload: bytes | str, *, what: str = "the output") -> Path:
    """Write ``payload`` (text is UTF-8) to ``path`` atomically and return the path.

    Raises:
        UsageError: as ``atomic_open``.
    """
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    with atomic_open(path, what=what) as f:
        f.write(data)
    return Path(path)
