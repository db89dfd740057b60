"""longstride.process: a command's process skips the interpreter's last garbage collection at exit; training sets
the CUDA allocator's expandable segments unless the user configured the allocator."""
from __future__ import annotations

import os
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


def test_training_takes_expandable_segments_unless_the_allocator_is_configured(monkeypatch):
    from longstride.process import cuda_allocator_default

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "x")  # recorded as it was, so that the test leaves the environment as it found it
        monkeypatch.delenv(name)
    cuda_allocator_default()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setenv(name, "max_split_size_mb:512")
        cuda_allocator_default()
        assert os.environ[name] == "max_split_size_mb:512" and \
            os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512") == "max_split_size_mb:512", name


FAULTY = '''
def deliberate(x):
    raise ValueError(f"x={x} must be positive; "
                     "give x=1")


def faulty(pairs):
    a, b = pairs
    return a
'''


def test_a_fault_in_longstride_s_own_code_is_not_shown_as_bad_input(tmp_path):
    """Commands print a ValueError as one line, exit 2 (bad input); `a, b = [1, 2, 3]` failing in longstride's code
    read as bad input too, its traceback dropped. A library's message about its input stays one line."""
    import importlib.util
    import json

    import pytest

    from longstride.bad_input import is_bad_input
    from longstride.overrides import run

    (tmp_path / "faulty.py").write_text(FAULTY)
    spec = importlib.util.spec_from_file_location("longstride.faulty_for_test", tmp_path / "faulty.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    said = {}
    for name, call in {"deliberate": lambda: module.deliberate(0), "faulty": lambda: module.faulty([1, 2, 3]),
                       "library": lambda: json.loads("{")}.items():
        with pytest.raises(ValueError) as e:
            call()
        said[name] = is_bad_input(e.value)
    assert said == {"deliberate": True, "faulty": False, "library": True}
    with pytest.raises(ValueError, match="too many values to unpack"):  # its traceback, not a one-line exit 2
        run("longstride test", lambda argv: module.faulty([1, 2, 3]), [])
    with pytest.raises(SystemExit) as e:
        run("longstride test", lambda argv: module.deliberate(0), [])
    assert e.value.code == 2


def test_a_tokenizer_write_on_a_full_disk_is_an_oserror_a_checkpoint_reports(tmp_path):
    """The tokenizers library reports a full disk as a plain Exception (found by the disk-full test when the disk
    filled at a step checkpoint's tokenizer: exit 1 with a traceback); save_tokenizer raises it as an OSError, which
    recipes/checkpoint/format.disk_errors turns into the checkpoint's clean failure. The full disk is real:
    tokenizer.json links to /dev/full."""
    import pytest

    from longstride.data.tokenizer import save_tokenizer, train_bpe
    from longstride.recipes.checkpoint.format import CheckpointError, disk_errors

    tok = train_bpe(["a tiny corpus for a tokenizer"] * 4, 300)
    os.symlink("/dev/full", tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*could not write the tokenizer to .*No "
                                              r"space left on device"):
        with disk_errors(str(tmp_path)):
            save_tokenizer(tok, str(tmp_path), 128)
    assert tok.model_max_length != 128  # the run's tokenizer keeps its own value
