"""RULER's tasks: their definitions (templates, answer prefixes, needle formats, new-token budgets, metrics)
and the rendering of one sample's text for a given haystack size.

A sample is made in two steps, so the haystack-size search never changes what a sample asks:
`draw()` fixes keys, values, needle depths, chains and queries from a generator seeded by
(seed, task, length, index) (a QA task's question by (seed, task, index): the same at every length, as in
RULER); `render(units)` then lays out a haystack of `units` (prose words, noise
lines, distractor needles, list words or documents) around them, deterministically.
"""
from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Optional

from longstride.data import synthetic
from longstride.eval.ruler.words import NOISE, common_words, cwe_words, prose_words, word_list


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # niah | vt | cwe | fwe | qa
    max_new_tokens: int  # RULER's tokens_to_generate
    metric: str  # "all" = string_match_all, "part" = string_match_part
    params: dict = field(default_factory=dict)


def _niah(name, haystack, key="words", value="numbers", k=1, v=1, q=1):
    return Task(name, "niah", 128, "all", dict(haystack=haystack, key=key, value=value, k=max(k, q), v=v, q=q))


TASKS = {t.name: t for t in [
    _niah("niah_single_1", "noise"),
    _niah("niah_single_2", "essay"),
    _niah("niah_single_3", "essay", value="uuids"),
    _niah("niah_multikey_1", "essay", k=4),
    _niah("niah_multikey_2", "needle"),
    _niah("niah_multikey_3", "needle", key="uuids", value="uuids"),
    _niah("niah_multivalue", "essay", v=4),
    _niah("niah_multiquery", "essay", q=4),
    Task("vt", "vt", 30, "all", dict(chains=1, hops=4)),
    Task("cwe", "cwe", 120, "all", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    Task("fwe", "fwe", 50, "all", dict(alpha=2.0)),
    Task("qa_1", "qa", 32, "part", dict(dataset="squad")),
    Task("qa_2", "qa", 32, "part", dict(dataset="hotpotqa")),
]}
SYNTHETIC = [name for name, t in TASKS.items() if t.kind != "qa"]
# Not RULER: the training format of the synthetic retrieval source (data/synthetic.py), first question
# only, filler of this source's own sentences and standard-library lines (the "in-format" score).
IN_FORMAT = {t.name: t for t in [Task(f"synth_{kind}", "synth", 32, "all", dict(kind=kind, corpus_share=0.5))
                                 for kind in ("kv", "multikey", "chain")]}
ALL_TASKS = {**TASKS, **IN_FORMAT}

NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_v} afterwards.\n{context}\n"
                 "What are all the special magic {type_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
QA_TEMPLATE = (QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n" + QA_INSTRUCTION
               + "\n\nQuestion: {query}")
QA_PREFIX = " Answer:"

DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's needle depth grid (% of the haystack)
VT_ICL_NOISE = 15  # noise lines of vt's one-shot example (RULER sizes it to ~500 tokens)


@dataclass
class Rendered:
    content: str  # the user turn
    answer_prefix: str  # appended after the chat template's assistant header
    answers: list[str]
    depth: Optional[float] = None  # the needle's depth (%), single-needle tasks


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(word_list('adjectivelist'))}-{rng.choice(word_list('nounlist'))}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _singular(text: str) -> str:
    """RULER's wording for one needle and one query."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def _insert(units: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert items (in order) at depths (%) of a list of haystack pieces."""
    out, last = [], 0
    for item, depth in sorted(zip(items, depths), key=lambda p: p[1]):
        pos = int(len(units) * depth / 100)
        out += units[last:pos] + [item]
        last = pos
    return out + units[last:]


def _zeta(a: float, n: int = 10000) -> float:
    """Riemann zeta for a > 1: partial sum plus the Euler-Maclaurin tail."""
    return sum(k ** -a for k in range(1, n)) + n ** (1 - a) / (a - 1) + 0.5 * n ** -a


class Sampler:
    """Draws and renders samples of one task at one length. `cap` bounds the haystack size (a `soft_cap` only
    bounds the first search: past it when the capped size fits)."""

    def __init__(self, task: Task, length: int, seed: int, index: int, haystack: Optional[str] = None,
                 qa: Optional["QAData"] = None):
        self.task, self.length, self.index, self.haystack, self._seed = task, length, index, haystack, seed
        self.rng = random.Random(f"{seed}/{task.name}/{length}/{index}")
        self.seed = self.rng.getrandbits(64)
        self.min_units, self.cap, self.soft_cap = 1, None, False
        self.monotone = True  # a larger size never tokenizes shorter (fit.make_sample may then start from a guess)
        getattr(self, f"_draw_{task.kind}")(qa)

    def render(self, units: int) -> Rendered:
        return getattr(self, f"_render_{self.task.kind}")(units)

    # --- needle in a haystack
    def _draw_niah(self, qa):
        p, rng = self.task.params, self.rng
        self.keys = [_random_value(p["key"], rng) for _ in range(p["k"])]
        self.values = [[_random_value(p["value"], rng) for _ in range(p["v"])] for _ in self.keys]
        self.needles = [NEEDLE.format(type_v=p["value"], key=k, value=v)
                        for k, vs in zip(self.keys, self.values) for v in vs]
        rng.shuffle(self.needles)
        if len(self.needles) == 1:  # spread single needles over the depth grid for the depth x length map
            self.depths = [DEPTHS[(self.index * 17) % len(DEPTHS)]]
        else:
            self.depths = sorted(rng.sample(DEPTHS, len(self.needles)))
        asked = rng.sample(range(p["k"]), p["q"])
        self.queries = [self.keys[i] for i in asked]
        self.answers = [a for i in asked for a in self.values[i]]

    def _render_niah(self, units):
        p = self.task.params
        if p["haystack"] == "essay":
            words = prose_words(self.haystack)
            text = " ".join(words[i % len(words)] for i in range(units))
            sentences = [s for s in re.split(r"(?<=\.) ", text) if s]
            context = " ".join(_insert(sentences, self.needles, self.depths))
        else:
            if p["haystack"] == "noise":
                lines = [NOISE] * units
            else:  # distractor needles with other keys
                rng, lines = random.Random(self.seed), []
                while len(lines) < units:
                    key = _random_value(p["key"], rng)
                    if key not in self.keys:
                        lines.append(NEEDLE.format(type_v=p["value"], key=key, value=_random_value(p["value"], rng)))
            context = "\n".join(_insert(lines, self.needles, self.depths))
        template, prefix, type_v = NIAH_TEMPLATE, NIAH_PREFIX, p["value"]
        if p["q"] * p["v"] == 1:
            template, prefix, type_v = _singular(template), _singular(prefix), type_v[:-1]
        q = self.queries
        query = ", ".join(q[:-1]) + ", and " + q[-1] if len(q) > 1 else q[0]
        return Rendered(template.format(type_v=type_v, context=context, query=query),
                        prefix.format(type_v=type_v, query=query), list(self.answers),
                        self.depths[0] if len(self.needles) == 1 else None)

    # --- variable tracking
    def _chain(self, letters: int, hops: int):
        names = []
        while len(names) < hops + 1:
            name = "".join(self.rng.choices(string.ascii_uppercase, k=letters))
            if name not in names:
                names.append(name)
        value = str(self.rng.randint(10000, 99999))
        return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]

    @staticmethod
    def _vt_text(lines: int, statements: list[str], fractions: list[float]) -> str:
        """Noise lines with the statements at the given fractions of the way through (in order)."""
        noise = [NOISE + "\n"] * lines
        return " ".join(_insert(noise, statements, [100 * f for f in fractions])).replace(". \n", ".\n")

    def _draw_vt(self, qa):
        p = self.task.params
        self.chains = [self._chain(5, p["hops"]) for _ in range(p["chains"])]
        self.fractions = [sorted(self.rng.random() for _ in chain) for _, chain in self.chains]
        icl_names, icl_chain = self._chain(3, min(10, p["hops"]))
        icl_value = icl_chain[0].split("=")[-1].strip()
        icl_context = self._vt_text(VT_ICL_NOISE, icl_chain, sorted(self.rng.random() for _ in icl_chain))
        self.icl = (VT_TEMPLATE.format(context=icl_context, query=icl_value)
                    + VT_PREFIX.format(num_v=len(icl_names), query=icl_value) + " ".join(icl_names))

    def _render_vt(self, units):
        statements = [(s, f) for (_, chain), fr in zip(self.chains, self.fractions) for s, f in zip(chain, fr)]
        context = self._vt_text(units, [s for s, _ in statements], [f for _, f in statements])
        names, chain = self.chains[0]
        value = chain[0].split("=")[-1].strip()
        return Rendered(self.icl + "\n\n" + VT_TEMPLATE.format(context=context, query=value),
                        VT_PREFIX.format(num_v=len(names), query=value), list(names))

    # --- common words
    def _draw_cwe(self, qa):
        # the search stays within the word list first (the samples it always made), and goes on past it with
        # compound words (words.cwe_words) only when the whole list fits: `soft_cap`
        self.min_units, self.cap, self.soft_cap = self.task.params["num_cw"], len(common_words()), True
        self.monotone = False  # each size redraws its words: more words can tokenize shorter, so no guessing

    def _cwe_list(self, rng, num_words, freq_cw, freq_ucw):
        words = rng.sample(cwe_words(num_words), num_words)
        common, uncommon = words[:self.task.params["num_cw"]], words[self.task.params["num_cw"]:]
        listed = common * freq_cw + uncommon * freq_ucw
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    def _render_cwe(self, units):
        p, rng = self.task.params, random.Random(self.seed * 1000003 + units)
        short = self.length < 4096  # RULER's lighter repeats below 4K
        example, example_answer = self._cwe_list(rng, 20 if short else 40, 3 if short else 10, 1 if short else 3)
        context, answer = self._cwe_list(rng, units, 6 if short else p["freq_cw"], 1 if short else p["freq_ucw"])
        shot = (CWE_TEMPLATE.format(context=example) + CWE_PREFIX + " "
                + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_answer)))
        return Rendered(shot + "\n" + CWE_TEMPLATE.format(context=context), CWE_PREFIX, answer)

    # --- frequent words (coded words with Zipf frequencies; the top one is the '....' noise)
    def _draw_fwe(self, qa):
        vocab = set()
        size = max(self.length // 50, 8)
        while len(vocab) < size:
            vocab.add("".join(self.rng.choices(string.ascii_lowercase, k=6)))
        self.vocab = sorted(vocab)
        self.rng.shuffle(self.vocab)
        self.vocab[0] = "..."
        self.min_units = 64  # below this the third and fourth ranks can tie
        self.monotone = False  # each size reshuffles its words: its token count may dip, so no guessing

    def _render_fwe(self, units):
        a = self.task.params["alpha"]
        z = _zeta(a)
        words = [w for k, w in enumerate(self.vocab, 1) for _ in range(int(units * k ** -a / z))]
        random.Random(self.seed * 1000003 + units).shuffle(words)
        return Rendered(FWE_TEMPLATE.format(context=" ".join(words)), FWE_PREFIX, self.vocab[1:4])

    # --- the synthetic retrieval source's own format
    def _draw_synth(self, qa):
        self.spec = synthetic.draw(self.rng, self.task.params["kind"])

    def _render_synth(self, units):
        runs, pieces = synthetic.filler_runs(random.Random(self.seed), self.task.params["corpus_share"]), []
        while len(pieces) < units:
            pieces += next(runs)
        body, qa = synthetic.render(self.spec, pieces[:units])
        prompt, answer = qa[0]
        question, prefix = prompt.rsplit("\n", 1)
        return Rendered(f"{body}\n{question}", f"\n{prefix}", answer.split(" ") if self.spec.kind == "chain"
                        else [answer], self.spec.depths[0] if len(self.spec.facts) == 1 else None)

    # --- question answering over local SQuAD / HotpotQA files
    def _draw_qa(self, qa):
        # the question depends on (seed, task, index) only, as RULER asks question `index` at every length, so a
        # score against length holds the questions fixed; its distractors are first the other paragraphs of the
        # gold paragraph's own article (SQuAD; RULER's more_context), then the rest of the file, each in a drawn order
        self.qa = qa
        self.question = qa.questions[random.Random(f"{self._seed}/{self.task.name}/{self.index}").randrange(
            len(qa.questions))]
        gold, near = set(self.question["docs"]), list(self.question.get("near", ()))
        taken = gold | set(near)
        far = [i for i in range(len(qa.docs)) if i not in taken]
        self.rng.shuffle(near)
        self.rng.shuffle(far)
        self.distractors = near + far
        self.min_units, self.cap = len(gold), len(qa.docs)
        self.monotone = False  # each size reshuffles its documents: its token count may dip, so no guessing

    def _render_qa(self, units):
        chosen = list(self.question["docs"]) + self.distractors[:units - len(self.question["docs"])]
        random.Random(self.seed * 1000003 + units).shuffle(chosen)
        context = "\n\n".join(f"Document {i + 1}:\n{self.qa.docs[d]}" for i, d in enumerate(chosen))
        return Rendered(QA_TEMPLATE.format(context=context, query=self.question["query"]), QA_PREFIX,
                        list(self.question["answers"]))


@dataclass
class QAData:
    docs: list[str]
    # {"query", "answers", "docs": indices into docs, "near": the other paragraphs of its SQuAD article}
    questions: list[dict]


def load_qa(kind: str, path: str) -> QAData:
    """SQuAD v1/v2 json (`data[].paragraphs[].qas[]`) or HotpotQA json (a list of
    {question, answer, context: [[title, sentences]]}), as RULER reads them."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    docs, index, questions = [], {}, []

    def doc_id(text):
        if text not in index:
            index[text] = len(docs)
            docs.append(text)
        return index[text]

    try:
        if kind == "squad":
            for article in raw["data"]:
                article_docs = [doc_id(para["context"]) for para in article["paragraphs"]]
                for para, d in zip(article["paragraphs"], article_docs):
                    for qa in para["qas"]:
                        if not qa.get("is_impossible") and qa["answers"]:
                            questions.append({"query": qa["question"], "docs": [d],
                                              "near": [n for n in dict.fromkeys(article_docs) if n != d],
                                              "answers": sorted({a["text"] for a in qa["answers"]})})
        else:
            for item in raw:
                ids = [doc_id(f"{title}\n{''.join(sents)}") for title, sents in item["context"]]
                questions.append({"query": item["question"], "answers": [item["answer"]], "docs": ids})
    except (KeyError, TypeError) as e:
        raise ValueError(f"qa.{kind}={path!r} is not a {kind} json file (missing {e}); give the dev set "
                         f"file as released") from None
    if not questions:
        raise ValueError(f"qa.{kind}={path!r} has no answerable question")
    return QAData(docs, questions)


