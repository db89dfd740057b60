"""Offline material for RULER's haystacks and needles: wonderwords' word lists and local English prose.

RULER (Hsieh et al. 2024, arXiv:2404.06654) draws needle keys as adjective-noun pairs and common words
from the `wonderwords` package's lists, which ship inside the package (read here, never downloaded).
Its essay haystack is Paul Graham's essays; the one deviation here is the prose: by default the Python
reference manual's text (CPython 3.11.7's `pydoc_data/topics.py` from the shipped standard-library
snapshot, the same under every Python), with its code examples dropped, or any local text files the user points at (`haystack=DIR_OR_FILE`).
"""
from __future__ import annotations

import random
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Optional

# RULER's repeated-noise haystack (niah_single_1, vt).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PROSE_SUFFIXES = (".txt", ".md", ".rst")


@lru_cache(maxsize=None)
def word_list(name: str) -> tuple[str, ...]:
    """wonderwords' `nounlist`, `adjectivelist` or `verblist`, sorted and deduplicated."""
    text = resources.files("wonderwords").joinpath("assets", f"{name}.txt").read_text(encoding="utf-8")
    return tuple(sorted({w.strip() for w in text.splitlines() if w.strip()}))


@lru_cache(maxsize=None)
def common_words() -> tuple[str, ...]:
    """cwe's vocabulary: nouns, adjectives and verbs, deduplicated and sorted."""
    return tuple(sorted(set(word_list("nounlist") + word_list("adjectivelist") + word_list("verblist"))))


def cwe_words(n: int) -> tuple[str, ...]:
    """The words cwe draws `n` distinct ones from: common_words() while it holds n; past that (about 120K tokens
    with a 50K-150K-entry tokenizer), where RULER switches to a larger English word list that does not ship
    offline, common_words() followed by two-word compounds of them ("harbourwindow") in a fixed order, so a
    sample fills its length instead of stopping short at the list's end."""
    words = common_words()
    return words if n <= len(words) else _with_compounds(1 << (n - 1).bit_length())


@lru_cache(maxsize=4)
def _with_compounds(size: int) -> tuple[str, ...]:
    words = common_words()
    rng, seen, out = random.Random("cwe compounds"), set(words), list(words)
    while len(out) < size:
        word = rng.choice(words) + rng.choice(words)
        if word not in seen:
            seen.add(word)
            out.append(word)
    return tuple(out)


def _default_prose() -> str:
    from longstride.data.files import STDLIB_SNAPSHOT
    from longstride.data.manual import manual_topics

    if not STDLIB_SNAPSHOT.is_file():
        raise ValueError(f"no default haystack prose: {STDLIB_SNAPSHOT} is missing; reinstall longstride from a "
                         "complete checkout, or set haystack=<dir or file of English .txt/.md/.rst text>")
    # Indented 5+ spaces = a code example or a grammar rule inside the 2-space-indented manual text;
    # lines of only punctuation are reST heading underlines.
    return "\n".join(line for topic in manual_topics() for line in topic.splitlines()
                     if not line.startswith("     ") and re.search(r"[A-Za-z0-9]", line))


@lru_cache(maxsize=None)
def prose_words(source: Optional[str] = None) -> tuple[str, ...]:
    """Whitespace-split words of the haystack prose (RULER joins its essays the same way)."""
    if source is None:
        text = _default_prose()
    else:
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in PROSE_SUFFIXES and p.is_file())
        elif path.is_file():
            files = [path]
        else:
            raise ValueError(f"haystack={source!r} does not exist; give a directory or file of English text, "
                             f"or leave it unset for the Python manual's prose")
        text = "\n".join(p.read_text(encoding="utf-8", errors="ignore") for p in files)
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    if len(words) < 1000:
        raise ValueError(f"haystack={source!r} has {len(words) if words != ('',) else 0} words; give at least "
                         f"1000 words of {'/'.join(PROSE_SUFFIXES)} text")
    return words
