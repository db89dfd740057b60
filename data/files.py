"""Files on disk: walking a tree for a glob (installed packages left out), telling unreadable entries
apart without opening them, and a stable short hash for cache keys. Shared by the corpus sources
(data/sources.py), the synthetic documents' filler (data/synthetic.py) and eval ppl.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from functools import lru_cache
from pathlib import Path

from longstride.whole_dir import staged

SKIP_EXCLUDED_DIRS = {"site-packages", "__pycache__", "dist-packages"}


STDLIB_SNAPSHOT = Path(__file__).parent / "shipped" / "cpython-3.11.7-lib.tar.xz"


def stdlib_root() -> Path:
    """The embedded corpus: CPython 3.11.7's standard library (its .py files and license), shipped in
    data/shipped/ and unpacked once into the user's cache. Not the running Python's own: that one differs by
    version and by distribution (Ubuntu's Python 3.12 has no test/ package: 569 files against 1,790), and a
    recipe trained on it is trained on other documents (the main job lost its 4K retrieval so, measured)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longstride"
    root = cache / STDLIB_SNAPSHOT.name.removesuffix(".tar.xz")
    stamp = root / ".complete"  # holds the archive's sha256: another archive under the same name unpacks anew
    if not (stamp.is_file() and stamp.read_text() == _archive_hash()):
        _unpack(STDLIB_SNAPSHOT, root, stamp)
    return root


def stdlib_digest() -> str:
    """The shipped corpus' identity (for cache keys of what is made from it)."""
    return _archive_hash()[:16]


@lru_cache(maxsize=1)
def _archive_hash() -> str:
    if not STDLIB_SNAPSHOT.is_file():
        raise FileNotFoundError(f"{STDLIB_SNAPSHOT}: the shipped standard-library corpus is missing; reinstall "
                                "longstride (pip install -e .) from a complete checkout")
    return hashlib.sha256(STDLIB_SNAPSHOT.read_bytes()).hexdigest()


def _unpack(archive: Path, root: Path, stamp: Path) -> None:
    """Under a lock file (the ranks of one launch unpack at once): checked again, then unpacked into a private
    folder and renamed into place, so no process ever reads a half-written tree; what a killed unpack left behind
    (a partial folder, a tree without its stamp) is removed first."""
    import shutil
    import tarfile

    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no POSIX locks (Windows): one process at a time is the caller's to ensure
            pass
        if stamp.is_file() and stamp.read_text() == _archive_hash():
            return  # another process unpacked it while this one waited
        with staged(str(root)) as tmp:  # a killed unpack's partial folder is removed first
            with tarfile.open(archive) as tar:
                # our own archive; the "data" filter (Python >= 3.10.12 / 3.11.4) refuses links and absolute paths
                tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            Path(tmp, stamp.name).write_text(_archive_hash())
            shutil.rmtree(root, ignore_errors=True)  # a tree without its stamp, or another archive's


def list_files(root: Path, patterns: str, unreadable: bool = False) -> list[str]:
    """Sorted files under `root` matching comma-separated glob patterns, without installed packages.
    unreadable: also the matches that are not regular files (dangling or looping links, FIFOs, sockets),
    so that the reader can count them as skipped instead of dropping them unseen."""
    found = set()
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        for path in root.glob(pattern):
            if SKIP_EXCLUDED_DIRS.intersection(path.relative_to(root).parts):
                continue
            if path.is_file() or (unreadable and not path.is_dir()):
                found.add(str(path))
    return sorted(found)


def excluded_files(root: Path, patterns: str, field: str) -> set:
    """The files comma-separated `exclude` patterns leave out under `root`: each file a pattern matches, and every
    file under a folder it matches (`tests` or `tests/**`, for which Python's glob gives the folder alone). A pattern
    that matches no file, or one that is not relative to the root, is refused naming `field`: an exclude that leaves
    nothing out would train on what it was meant to hold out."""
    out = set()
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        try:
            hits = list(root.glob(pattern))
        except (NotImplementedError, ValueError) as e:  # an absolute pattern, an empty one
            raise ValueError(f"{field}={patterns!r}: {pattern!r} is no glob relative to {root} ({e}); give patterns "
                             "under the source's root, e.g. tests/*.txt or a folder, tests") from None
        found = {str(p) for h in hits for p in ([h] if not h.is_dir() else
                                                [Path(f) for f in list_files(h, "**/*", unreadable=True)])
                 if not SKIP_EXCLUDED_DIRS.intersection(p.relative_to(root).parts)}
        if not found:
            raise ValueError(f"{field}={patterns!r}: {pattern!r} matches no file under {root}, so it would leave "
                             "nothing out; fix the pattern (relative to the source's root: tests/*.txt, or a folder, "
                             "tests) or drop it")
        out |= found
    return out


def unreadable(path: str) -> str:
    """Why `path` cannot be read as a text file, or "" (never opens it: opening a FIFO would block)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # dangling link, link loop, vanished
        return "broken_link"
    return "" if stat.S_ISREG(mode) else "not_a_file"


def digest(obj) -> str:
    """A short stable hash of a JSON-able object (Python's hash() changes per process)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
