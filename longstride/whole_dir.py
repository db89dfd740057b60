"""A directory that exists only whole: written under `<out>.partial-<host>-<pid>` beside it, then renamed into place.

Every command that writes a directory others read (convert-gguf, export-hf, ship, the embedded corpus's unpack,
a cached tokenizer) writes it this way, so that a crash or a kill never leaves a half-written directory under the
final name, and what a killed writer left behind is removed by the next writer of the same directory.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
from typing import Iterator

PARTIAL = ".partial-"  # <out>.partial-<host>-<pid>: a directory being written by process <pid> on <host>


class Appeared(ValueError):
    """`out` was created by someone else while this process wrote its own: theirs is kept, never replaced."""


def is_partial(path: str) -> bool:
    return PARTIAL in os.path.basename(os.path.normpath(path))


@contextlib.contextmanager
def staged(out: str) -> Iterator[str]:
    """Yields a fresh empty folder beside `out` to write into; when the block ends without an error, renames it to
    `out` (which may be an empty folder) and makes the rename durable. An error in the block removes the folder and
    leaves `out` as it was. A non-empty `out` made meanwhile raises Appeared and is not touched. The parent folder
    must exist; partial folders of `out` whose writer (on this host) is gone are removed first."""
    out = os.path.normpath(os.path.abspath(out))
    parent, host = os.path.dirname(out), socket.gethostname()
    for stale in glob.glob(glob.escape(out) + PARTIAL + "*"):
        writer_host, _, pid = stale.rsplit(PARTIAL, 1)[1].rpartition("-")
        # another host's writer (a shared file system) cannot be seen from here: its folder is left alone
        if writer_host in ("", host) and not _alive(pid):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = f"{out}{PARTIAL}{host}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # this pid's own leftover: a writer before it reused the pid
    os.mkdir(tmp)
    appeared = Appeared(f"{out} appeared while it was being written; it was kept, move it aside and run again")
    try:
        yield tmp
        if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
            raise appeared
        try:
            os.replace(tmp, out)
        except OSError:
            if os.path.exists(out):  # made between the check and the rename
                raise appeared from None
            raise
        fsync_path(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: str) -> bool:
    """Whether a partial folder's writer still runs."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        pass
    return True
