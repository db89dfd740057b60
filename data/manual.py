"""The `pymanual` source kind: the Python reference manual's topics, one document each, from the shipped
standard-library snapshot (data/files.py), the same text under every Python. Also RULER's essay haystack
(eval/ruler/words.py).
"""
from __future__ import annotations

import functools

import datasets

from longstride.data.config import SourceConfig
from longstride.data.files import STDLIB_SNAPSHOT, stdlib_root


@functools.lru_cache(maxsize=1)
def manual_topics() -> tuple[str, ...]:
    """The Python reference manual's topic texts, by topic name: CPython 3.11.7's `pydoc_data/topics.py` from the
    shipped standard-library snapshot, as unpacked once (data/files.py stdlib_root), read as a literal and never
    run, so the text is the same under every Python (each interpreter's own pydoc_data differs by version)."""
    import ast

    source = (stdlib_root() / "pydoc_data" / "topics.py").read_text(encoding="utf-8")
    assign = [n for n in ast.parse(source).body if isinstance(n, ast.Assign)
              and getattr(n.targets[0], "id", None) == "topics"]
    assert len(assign) == 1, "the shipped pydoc_data/topics.py assigns `topics` once"
    topics = ast.literal_eval(assign[0].value)
    return tuple(topics[k] for k in sorted(topics))


def check_source(src: SourceConfig, field: str) -> None:
    if not STDLIB_SNAPSHOT.is_file():
        raise ValueError(f"{field}.kind=pymanual reads the manual's topics from {STDLIB_SNAPSHOT}, which is missing; "
                         "reinstall longstride (pip install -e .) from a complete checkout")


def _rows(max_docs):
    for text in manual_topics()[:max_docs]:
        yield {"text": text, "skip": "" if text.strip() else "empty"}


def load_manual(src, cache_dir, num_proc, field):
    return datasets.Dataset.from_list(list(_rows(src.max_docs)))


def stream_manual(src, cache_dir, field, world):
    return datasets.IterableDataset.from_generator(_rows, gen_kwargs={"max_docs": src.max_docs})
