"""longstride/whole_dir.py: a directory written aside and renamed, so that it exists only whole."""
from __future__ import annotations

import os

import pytest

from longstride.whole_dir import Appeared, is_partial, staged


def test_the_directory_appears_only_when_the_block_ends(tmp_path):
    out = tmp_path / "m"
    with staged(str(out)) as tmp:
        assert is_partial(tmp) and os.path.dirname(tmp) == str(tmp_path) and not out.exists()
        (tmp_path / os.path.basename(tmp) / "w").write_text("x")
    assert (out / "w").read_text() == "x" and os.listdir(tmp_path) == ["m"]


def test_an_error_in_the_block_leaves_nothing_and_out_as_it_was(tmp_path):
    out = tmp_path / "m"
    out.mkdir()  # an empty folder the user made for it
    with pytest.raises(RuntimeError, match="killed"):
        with staged(str(out)) as tmp:
            open(os.path.join(tmp, "half"), "w").close()
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == ["m"] and os.listdir(out) == []
    with staged(str(out)) as tmp:  # an empty folder is taken
        open(os.path.join(tmp, "w"), "w").close()
    assert os.listdir(out) == ["w"]


def test_a_directory_made_meanwhile_is_kept_and_named(tmp_path):
    out = tmp_path / "m"
    with pytest.raises(Appeared, match=f"{out} appeared while it was being written"):
        with staged(str(out)) as tmp:
            open(os.path.join(tmp, "mine"), "w").close()
            out.mkdir()
            (out / "theirs").write_text("t")
    assert os.listdir(tmp_path) == ["m"] and os.listdir(out) == ["theirs"]


def test_a_writer_killed_mid_write_leaves_only_its_partial_folder_which_the_next_writer_removes(tmp_path):
    """A real SIGKILL inside the block (no cleanup runs): `out` never appears half written; the dead writer's
    folder stays until the next writer of `out` removes it and writes `out` whole."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "m"
    child = ("import os, signal, sys\nfrom longstride.whole_dir import staged\n"
             "with staged(sys.argv[1]) as tmp:\n"
             "    open(os.path.join(tmp, 'half'), 'w').write('x')\n"
             "    print(tmp, flush=True)\n"
             "    os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", child, str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    partial = r.stdout.strip()
    assert is_partial(partial) and os.listdir(partial) == ["half"] and not out.exists()
    with staged(str(out)) as tmp:
        open(os.path.join(tmp, "w"), "w").close()
    assert os.listdir(tmp_path) == ["m"] and os.listdir(out) == ["w"]


def test_a_dead_writers_partial_folder_is_removed_and_a_live_or_remote_ones_kept(tmp_path):
    """Whether a writer runs is known on its own host only: another host's folder (a shared file system) is kept."""
    import socket

    out, host = tmp_path / "m", socket.gethostname()
    dead, live = tmp_path / f"m.partial-{host}-999999999", tmp_path / f"m.partial-{host}-{os.getppid()}"
    remote, old_form = tmp_path / "m.partial-another-host-999999999", tmp_path / "m.partial-999999999"
    for folder in (dead, live, remote, old_form):
        folder.mkdir()
    with staged(str(out)) as tmp:
        assert os.path.basename(tmp) == f"m.partial-{host}-{os.getpid()}"
    assert sorted(os.listdir(tmp_path)) == sorted(["m", live.name, remote.name])


def test_a_tokenizer_another_process_cached_first_is_the_one_loaded(tmp_path, monkeypatch):
    """Two processes train the same tokenizer at once: the one that renames second keeps the first's."""
    from longstride.data import tokenizer

    trained = tokenizer.train_bpe(["def f(x):\n    return x\n"] * 20, 300)
    final = tmp_path / "tokenizers" / "k"

    def train_while_another_finishes(texts, vocab_size, split_digits):
        trained.save_pretrained(str(final))  # the other process's, renamed into place while this one trained
        (final / "marker").write_text("theirs")
        return trained

    monkeypatch.setattr(tokenizer, "train_bpe", train_while_another_finishes)
    tok = tokenizer.cached_bpe([], 300, str(tmp_path), "k")
    assert tok.vocab_size == trained.vocab_size and (final / "marker").read_text() == "theirs"
    assert os.listdir(final.parent) == ["k"]
