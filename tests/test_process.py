"""longstride.process: a command's process skips the interpreter's last garbage collection at exit."""
from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, sys
from longstride.process import skip_exit_collection
gc.disable()  # no automatic collection before exit: only the interpreter's last one could find the cycle
class Cycle:
    def __del__(self):
        print("collected", flush=True)
c = Cycle()
c.me = c
del c
if sys.argv[1] == "skip":
    skip_exit_collection()
print("exiting", flush=True)
"""


def test_the_exit_collection_is_skipped_only_when_asked():
    """A reference cycle left at exit: the interpreter's final collection finds and finalizes it, unless the
    command asked to skip that collection (recipes/train.py and every other command do, at their start)."""
    def run(mode: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    assert run("keep") == ["exiting", "collected"]
    assert run("skip") == ["exiting"]
