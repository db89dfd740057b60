"""Files on disk: walking a tree for a glob (installed packages left out), telling unreadable entries
apart without opening them, and a stable short hash for cache keys. Shared by the corpus sources
(data/sources.py), the synthetic documents' filler (data/synthetic.py) and eval ppl.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sysconfig
from pathlib import Path

SKIP_EXCLUDED_DIRS = {"site-packages", "__pycache__", "dist-packages"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


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
