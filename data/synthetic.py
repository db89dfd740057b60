"""Synthetic retrieval documents: filler text with facts planted at chosen depths, then questions
whose answers are in the document (the long-stage data of Qwen2.5-1M / ProLong-style recipes).

A document is drawn from a generator seeded by (seed, index) alone, so any document can be made
again on its own (exact resume, streaming, tests). Three kinds of fact:
  kv        one key with a value, one question about it
  multikey  several keys with values (distractors), questions about some of them
  chain     a value assigned to a name, then names copying names; asks for every name holding it
  copy      a list of words to remember, asked back in full (dense in-context copying, the signal that
            makes induction heads form; the words are standard-library identifiers)
The wording, the keys (made-up words and this file's own word lists) and the filler (this file's
own sentences and lines of the Python standard library) are not RULER's (eval/ruler/tasks.py),
so a RULER score after training on these measures transfer, not a memorised prompt.

A share of documents (`repeat_share`) has a monotone filler instead: one line of a few of the sentences
repeated (the passkey layout), a strong copy prior that the answer must overrule (varied filler never asks it).

`Spec` separates what a document asks from how much filler surrounds it, as RULER's samplers do:
`draw(rng, kind)` fixes keys, values, depths and questions; `render(spec, filler)` lays them out.
"""
from __future__ import annotations

import math
import os
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from longstride.data.config import LossOn, SourceConfig
from longstride.data.files import digest, excluded_files, list_files, stdlib_digest, stdlib_root

if TYPE_CHECKING:  # the RULER eval renders these documents without loading datasets (0.6 s of its start)
    import datasets

SENTENCES = (
    "A narrow road climbs past the quarry toward the ridge.", "The ferry waits at the pier until the bell rings.",
    "Rain gathers in the gutters of the old market.", "Someone left a lamp burning in the upstairs window.",
    "The orchard smells of cut grass after the storm.", "Two herons stand still in the shallow water.",
    "The baker opens the shutters before dawn.", "A freight train rattles across the iron bridge.",
    "Moss covers the north side of every stone wall.", "The clock tower chimes a quarter past the hour.",
    "Fishing boats drift back into the harbour at dusk.", "The library keeps its maps in tall oak drawers.",
    "Snow settles quietly on the roofs of the village.", "A kettle whistles somewhere down the corridor.",
    "Wind turns the pages of a book left on the bench.", "The potter shapes a bowl on a slow wheel.",
    "Lanterns sway above the stalls of the night fair.", "A fox crosses the field and slips under the fence.",
    "The tram stops twice before the university gate.", "Fresh paint dries on the doors of the boathouse.",
    "Bees hum among the lavender by the garden path.", "The miller counts the sacks stacked by the door.",
    "A cold current runs beneath the surface of the lake.", "Children chalk numbers on the courtyard stones.",
    "The observatory dome opens as the sky darkens.", "Ivy climbs the chimney of the empty farmhouse.",
    "The postman whistles as he sorts the letters.", "Thunder rolls far away over the eastern hills.",
    "A violin is being tuned in the room next door.", "The tide leaves ribbons of kelp along the beach.",
)
MONOTONE = ("The road is long.", "The water is cold.", "The door is open.", "The bread is warm.",
            "The hill is steep.", "The night is still.", "On and on we walk.", "Round it goes again.")
FIRST = ("amber", "cobalt", "silent", "northern", "hollow", "crimson", "rapid", "golden", "misty", "iron",
         "lunar", "velvet", "frozen", "copper", "quiet", "scarlet", "distant", "bright", "stony", "hidden")
SECOND = ("harbor", "lantern", "falcon", "meadow", "compass", "glacier", "orchard", "anchor", "beacon", "canyon",
          "thistle", "otter", "quarry", "sparrow", "willow", "comet", "ledger", "summit", "badger", "kestrel")
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
ATTRS = ("access code", "room number", "ticket number", "serial number", "locker code", "badge number",
         "account number", "pin", "reference id", "order number")
FACT_FORMS = ("The {attr} of {key} is {value}.", "{key} was given the {attr} {value}.",
              "Note for later: the {attr} for {key} reads {value}.", "Record {key}: {attr} {value}.",
              "Keep in mind that {key} uses the {attr} {value}.")
QUESTION_FORMS = (("Question: what is the {attr} of {key}?", "Answer: {value}"),
                  ("Q: which {attr} belongs to {key}?", "A: {value}"),
                  ("Recall the {attr} given to {key}.", "It was {value}"),
                  ("Which {attr} was noted for {key} in the lines above?",
                   "The {attr} noted for {key} in the lines above was {value}"))
CHAIN_FIRST = ("{key} starts with the value {value}.", "Set {key} to {value}.")
CHAIN_COPY = ("{key} takes whatever {prev} holds.", "Let {key} equal {prev}.")
CHAIN_QUESTION = ("Question: which names end up holding {value}?", "Answer: {names}")
KINDS = ("kv", "multikey", "chain", "copy")
DEFAULT_KINDS = {"kv": 0.4, "multikey": 0.4, "chain": 0.2}  # synthetic.kinds left empty
COPY_FACT = "Remember this list: {words}."
COPY_QUESTION = ("Repeat the list you were asked to remember.", "The list:")


def made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))


def random_key(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{made_up_word(rng)}-{made_up_word(rng)}"
    return f"{rng.choice(FIRST)}-{rng.choice(SECOND)}"


def random_value(rng: random.Random) -> str:
    if rng.random() < 0.8:
        return str(rng.randint(10 ** 4, 10 ** 8 - 1))
    return made_up_word(rng) + str(rng.randint(10, 99))


def chain_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(4))


@dataclass
class Spec:
    """What a document asks, independent of its filler. facts: sentences planted at `depths` (% of the
    filler); questions: (question, answer prefix, answer) asked after the filler, in order."""

    kind: str
    facts: list[str]
    depths: list[float]
    questions: list[tuple[str, str, str]]


def _kv(rng: random.Random, keys: int, asked: int) -> Spec:
    names = []
    while len(names) < keys:
        key = random_key(rng)
        if key not in names:
            names.append(key)
    attr = rng.choice(ATTRS)  # one attribute per document: the key alone decides the answer
    values = [random_value(rng) for _ in names]
    facts = [rng.choice(FACT_FORMS).format(attr=attr, key=k, value=v) for k, v in zip(names, values)]
    questions = []
    for i in rng.sample(range(keys), asked):
        q, a = rng.choice(QUESTION_FORMS)
        prefix, tail = a.split("{value}")
        questions.append((q.format(attr=attr, key=names[i]), prefix.rstrip().format(attr=attr, key=names[i]),
                          values[i] + tail))
    return Spec("kv" if keys == 1 else "multikey", facts, [rng.uniform(0, 100) for _ in facts], questions)


def _chain(rng: random.Random, hops: int) -> Spec:
    names = []
    while len(names) < hops + 1:
        name = chain_name(rng)
        if name not in names:
            names.append(name)
    value = str(rng.randint(10 ** 4, 10 ** 6 - 1))
    facts = [rng.choice(CHAIN_FIRST).format(key=names[0], value=value)]
    facts += [rng.choice(CHAIN_COPY).format(key=names[j + 1], prev=names[j]) for j in range(hops)]
    q, a = CHAIN_QUESTION
    return Spec("chain", facts, sorted(rng.uniform(0, 100) for _ in facts),
                [(q.format(value=value), a.split("{names}")[0].rstrip(), " ".join(names))])


def _copy(rng: random.Random, length: int) -> Spec:
    words = " ".join(rng.choice(identifiers()) for _ in range(length))
    q, prefix = COPY_QUESTION
    return Spec("copy", [COPY_FACT.format(words=words)], [rng.uniform(0, 100)], [(q, prefix, words + ".")])


def draw(rng: random.Random, kind: str) -> Spec:
    if kind == "kv":
        return _kv(rng, 1, 1)
    if kind == "multikey":
        keys = rng.randint(2, 6)
        return _kv(rng, keys, rng.randint(1, keys))
    if kind == "chain":
        return _chain(rng, rng.randint(1, 4))
    if kind == "copy":
        return _copy(rng, rng.randint(8, 24))
    raise ValueError(f"synthetic kind {kind!r} is unknown; use one of {KINDS}")


FILLER_FILES = 400  # the first standard-library .py files (sorted paths) whose lines are filler


def filler_files() -> list[str]:
    return list_files(stdlib_root(), "**/*.py")[:FILLER_FILES]


def filler_sources(sources: dict) -> list[str]:
    """The synthetic sources whose filler trains on standard-library lines (synthetic.corpus_share > 0)."""
    return [n for n, s in sources.items() if s.kind == "synthetic" and s.synthetic.corpus_share > 0]


def filler_rows(paths: list[str]) -> int:
    """The number of filler files at the head of a stdlib source's files (`paths`, in its order). The filler files
    are the first of the same sorted walk, so those the source has (all not excluded, up to max_docs) come first."""
    filler = set(filler_files())
    return next((i for i, p in enumerate(paths) if p not in filler), len(paths))


def check_filler_held_out(sources: dict) -> None:
    """Refuses a run whose stdlib source holds files out (`exclude`, e.g. for `eval ppl`) that a synthetic
    source's filler would bring back into training (its `corpus_share` of lines comes from filler_files())."""
    held = {n: s for n, s in sources.items() if s.kind == "stdlib" and s.exclude}
    filled = filler_sources(sources)
    if not held or not filled:
        return
    filler = set(filler_files())
    for name, src in held.items():
        back = sorted(excluded_files(stdlib_root(), src.exclude, f"data.sources.{name}.exclude") & filler)
        if back:
            shown = ", ".join(os.path.relpath(p, stdlib_root()) for p in back[:3]) + (" ..." if len(back) > 3 else "")
            raise ValueError(f"data.sources.{name}.exclude holds out {shown}, whose lines the filler of "
                             f"data.sources.{{{','.join(filled)}}} (synthetic.corpus_share > 0) trains on; set their "
                             f"synthetic.corpus_share=0 or hold out files past the first {FILLER_FILES} of the "
                             "standard library")


@lru_cache(maxsize=1)
def corpus_lines() -> tuple[str, ...]:
    """Non-blank lines of the standard library's .py files (sorted paths): the corpus' own text."""
    lines = []
    for path in filler_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            lines += [line.strip() for line in f if line.strip()]
    return tuple(lines)


@lru_cache(maxsize=1)
def identifiers() -> tuple[str, ...]:
    """The distinct words (3+ letters) of the corpus lines, sorted: many, mostly one token each."""
    return tuple(sorted({w for line in corpus_lines() for w in re.findall(r"[A-Za-z]{3,}", line)}))


def filler_runs(rng: random.Random, corpus_share: float):
    """Endless runs of filler pieces: runs of this file's sentences and runs of consecutive
    standard-library lines, in proportion `corpus_share` (by runs)."""
    lines = corpus_lines() if corpus_share > 0 else ()
    while True:
        if lines and rng.random() < corpus_share:
            start = rng.randrange(len(lines))
            yield list(lines[start:start + rng.randint(3, 12)])
        else:
            yield [rng.choice(SENTENCES) for _ in range(rng.randint(3, 8))]


def monotone_runs(rng: random.Random):
    """Endless copies of one line: 2-5 short sentences (this file's own) drawn once."""
    line = " ".join(rng.sample(SENTENCES + MONOTONE, rng.randint(2, 5)))
    while True:
        yield [line]


def filler(rng: random.Random, words: int, corpus_share: float, monotone: random.Random | None = None) -> list[str]:
    """Filler pieces (sentences or lines) up to the first that brings the total to `words` words: a
    short document stays short, even though runs hold 3-12 pieces. Given `monotone` (a generator of its
    own), the pieces are one line repeated (monotone_runs), and `rng` is not drawn from."""
    pieces, count = [], 0
    for run in monotone_runs(monotone) if monotone else filler_runs(rng, corpus_share):
        for piece in run:
            if count >= words:
                return pieces
            pieces.append(piece)
            count += len(piece.split())


def plant(pieces: list[str], facts: list[str], depths: list[float]) -> list[str]:
    """`pieces` with each fact inserted at its depth (% of the pieces), facts kept in order of depth."""
    out, last = [], 0
    for fact, depth in sorted(zip(facts, depths), key=lambda p: p[1]):
        pos = int(round(len(pieces) * depth / 100))
        out += pieces[last:pos] + [fact]
        last = pos
    return out + pieces[last:]


def render(spec: Spec, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(body, [(question + answer prefix, answer)]): the filler with the facts planted; each question
    follows the body (and the earlier questions with their answers)."""
    body = "\n".join(plant(pieces, spec.facts, spec.depths))
    return body, [(f"{q}\n{prefix}", answer) for q, prefix, answer in spec.questions]


def document_parts(seed: int, index: int, min_words: int, max_words: int, kinds: dict,
                   corpus_share: float, repeat_share: float = 0.0) -> tuple[str, str]:
    """Document `index` of a synthetic source as (body, questions): filler of a log-uniform length in
    [min_words, max_words] with one drawn spec's facts planted, then its questions and answers."""
    rng = random.Random(f"longstride-synthetic/{seed}/{index}")
    names = sorted(kinds)
    kind = rng.choices(names, weights=[kinds[k] for k in names])[0]
    spec = draw(rng, kind)
    words = int(math.exp(rng.uniform(math.log(min_words), math.log(max_words))))
    coin = random.Random(f"longstride-synthetic/{seed}/{index}/repeat")  # its own draws: varied documents stay as at 0
    body, qa = render(spec, filler(rng, words, corpus_share, coin if coin.random() < repeat_share else None))
    return body, "".join(f"\n{prompt} {answer}" for prompt, answer in qa)


def document(seed: int, index: int, min_words: int, max_words: int, kinds: dict, corpus_share: float,
             repeat_share: float = 0.0) -> str:
    """Document `index` as one text: body then questions (document_parts)."""
    return "".join(document_parts(seed, index, min_words, max_words, kinds, corpus_share, repeat_share))


# The synthetic source kind (data.sources.<name>.kind=synthetic): its checks and its rows as a dataset


def rows(seed: int, start: int, stop: int, min_words: int, max_words: int, kinds: dict, corpus_share: float,
         loss_on: str, repeat_share: float = 0.0):
    """loss_on=qa rows also carry `loss_from`, the character where loss targets start (data/tokenizer.py)."""
    for i in range(start, stop):
        body, qa = document_parts(seed, i, min_words, max_words, kinds, corpus_share, repeat_share)
        yield {"text": body + qa, "skip": "", **({"loss_from": len(body)} if loss_on == LossOn.qa else {})}


def check_source(src: SourceConfig, field: str) -> None:
    s, kinds = src.synthetic, kinds_of(src)
    bad = sorted(set(kinds) - set(KINDS))
    if bad or any(w < 0 for w in kinds.values()) or sum(kinds.values()) <= 0:
        raise ValueError(f"{field}.synthetic.kinds={kinds}: give positive weights for some of {KINDS}")
    if s.num_docs < 1 or not 1 <= s.min_words <= s.max_words:
        raise ValueError(f"{field}.synthetic: need num_docs >= 1 and 1 <= min_words <= max_words "
                         f"(got {s.num_docs}, {s.min_words}, {s.max_words})")
    for name in ("corpus_share", "repeat_share"):
        if not 0 <= getattr(s, name) <= 1:
            raise ValueError(f"{field}.synthetic.{name}={getattr(s, name)} must be in [0, 1]")
    if s.loss_on not in LossOn.names():  # composed configs are checked by OmegaConf already
        raise ValueError(f"{field}.synthetic.loss_on={s.loss_on!r}: use one of {LossOn.names()} (all: every token "
                         "a loss target; qa: only the questions and answers)")


def kinds_of(src: SourceConfig) -> dict:
    """The source's kind weights: its own, or DEFAULT_KINDS where it names none."""
    return dict(src.synthetic.kinds) or dict(DEFAULT_KINDS)


def _row_kwargs(src: SourceConfig, field: str) -> dict:
    s = src.synthetic
    stop = s.num_docs if src.max_docs is None else min(s.num_docs, src.max_docs)
    return dict(seed=s.seed, start=0, stop=stop, min_words=s.min_words, max_words=s.max_words,
                kinds=kinds_of(src), corpus_share=s.corpus_share, loss_on=str(s.loss_on), repeat_share=s.repeat_share)


def load_synthetic(src: SourceConfig, cache_dir: str, num_proc: int, field: str) -> datasets.Dataset:
    import datasets

    kw = _row_kwargs(src, field)
    # the generator's source and the corpus its filler comes from are part of the key, so an edited generator or
    # another corpus makes new documents
    version = digest([Path(__file__).read_text(encoding="utf-8"), stdlib_digest()])
    return datasets.Dataset.from_generator(rows, gen_kwargs=kw, cache_dir=cache_dir,
                                           config_name=f"synthetic-{digest([kw, version])}")


def stream_synthetic(src, cache_dir, field, world):
    import datasets

    return datasets.IterableDataset.from_generator(rows, gen_kwargs=_row_kwargs(src, field))
