"""The synthetic retrieval source (data/synthetic.py): answers are where the document says, documents
depend on (seed, index) alone, exact resume through the loader, mixture shares, the in-format eval."""
from __future__ import annotations

import hashlib
import random
import re

import numpy as np
import pytest

from longstride.data import synthetic
from longstride.data.config import DataConfig, SourceConfig, SyntheticConfig
from longstride.data.corpus import build_corpus, mixture_documents
from longstride.data.sources import drop_skipped, load_source, stream_source
from longstride.data.tokenizer import train_bpe

KINDS = {"kv": 1.0, "multikey": 1.0, "chain": 1.0}
GROUPS = {"attr": "[a-z ]+", "key": "[a-z]+-[a-z]+", "value": r"\S+", "names": "[A-Z ]+"}


def form(template: str) -> re.Pattern:
    """A sentence form of data/synthetic.py as a regex with its fields as named groups."""
    pattern = re.escape(template)
    for name, group in GROUPS.items():
        pattern = pattern.replace(rf"\{{{name}\}}", f"(?P<{name}>{group})", 1).replace(rf"\{{{name}\}}", f"(?P={name})")
    return re.compile(pattern + "$")


FACT = [form(f) for f in synthetic.FACT_FORMS]
CHAIN_FACT = re.compile(r"([A-Z]{4} starts with the value \d+|Set [A-Z]{4} to \d+|[A-Z]{4} takes whatever [A-Z]{4} holds"
                        r"|Let [A-Z]{4} equal [A-Z]{4})\.$")
QUESTION = [(form(q), form(a)) for q, a in synthetic.QUESTION_FORMS]


def doc(i: int, seed: int = 0, words=(20, 400), share: float = 0.5, repeat: float = 0.0) -> str:
    return synthetic.document(seed, i, words[0], words[1], KINDS, share, repeat)


def facts_of(body: list[str]) -> dict:
    """key -> value for every fact line of a kv / multikey document body."""
    found = {}
    for line in body:
        for form in FACT:
            m = form.match(line)
            if m:
                found[m["key"]] = m["value"].rstrip(".")
    return found


def chain_holders(lines: list[str], value: str) -> list[str]:
    """Follows the chain through the text: the name set to `value`, then every name copying a holder."""
    holders = []
    for line in lines:
        first = re.match(rf"(?:(?P<a>[A-Z]{{4}}) starts with the value|Set (?P<b>[A-Z]{{4}}) to) {value}\.$", line)
        copy = re.match(r"(?:(?P<a>[A-Z]{4}) takes whatever (?P<p>[A-Z]{4}) holds|Let (?P<b>[A-Z]{4}) equal "
                        r"(?P<q>[A-Z]{4}))\.$", line)
        if first:
            holders.append(first["a"] or first["b"])
        elif copy and (copy["p"] or copy["q"]) in holders:
            holders.append(copy["a"] or copy["b"])
    return holders


def split_qa(lines: list[str]) -> tuple[list[str], list[str]]:
    """(body, questions and answers) of a document's lines."""
    is_question = lambda line: line.startswith(synthetic.CHAIN_QUESTION[0][:20]) or any(  # noqa: E731
        q.match(line) for q, _ in QUESTION)
    qa_start = next(i for i, line in enumerate(lines) if is_question(line))
    return lines[:qa_start], lines[qa_start:]


def is_monotone(text: str) -> bool:
    """A document of 200+ filler words whose body is one repeated line (a varied one has 15+ distinct lines)."""
    return len(set(split_qa(text.split("\n"))[0])) < 10


@pytest.mark.parametrize("repeat", [0.0, 1.0])
@pytest.mark.parametrize("index", range(60))
def test_every_answer_is_where_the_document_says(index, repeat):
    lines = doc(index, repeat=repeat).split("\n")
    body, tail = split_qa(lines)
    assert len(tail) % 2 == 0 and tail, tail
    for question, answer_line in zip(tail[::2], tail[1::2]):
        m = re.match(r"Question: which names end up holding (\d+)\?$", question)
        if m:  # chain: every name that ends up holding the value, in order of assignment
            assert answer_line.startswith("Answer: ")
            assert answer_line[len("Answer: "):].split(" ") == chain_holders(body, m[1]), (question, answer_line)
            continue
        (q, a), = [(q, a) for q, a in QUESTION if q.match(question)]
        key, answer = q.match(question)["key"], a.match(answer_line)
        assert answer, (question, answer_line)
        assert facts_of(body)[key] == answer["value"], (question, answer_line, index)
        assert answer.groupdict().get("key", key) == key


def test_facts_sit_at_their_depths():
    rng = random.Random(3)
    for _ in range(50):
        spec = synthetic.draw(rng, "multikey")
        pieces = [f"filler {i}." for i in range(200)]
        body, _ = synthetic.render(spec, pieces)
        lines = body.split("\n")
        for fact, depth in zip(spec.facts, spec.depths):
            before = sum(1 for line in lines[:lines.index(fact)] if line.startswith("filler"))
            assert before == round(200 * depth / 100), (depth, before)


def test_monotone_documents_repeat_one_line_around_their_facts():
    """repeat_share=1: the body is one line of 2-5 of the generator's sentences, repeated, with the facts
    planted in it; repeat_share=0.3: about that share of documents is monotone, the rest varied."""
    sentences = set(synthetic.SENTENCES + synthetic.MONOTONE)
    for i in range(40):
        body, _ = split_qa(doc(i, words=(200, 400), repeat=1.0).split("\n"))
        line = max(set(body), key=body.count)
        facts = [b for b in body if b != line]  # a document plants 1-6 facts (multikey) or 2-5 (chain)
        assert body.count(line) >= 4 and 1 <= len(facts) <= 6, (i, facts)  # 200+ words, lines of 5-45 words
        assert all(any(f.match(b) for f in FACT) or CHAIN_FACT.match(b) for b in facts), facts
        parts = re.findall(r"[^.]+\.", line)
        assert 2 <= len(parts) <= 5 and {p.strip() for p in parts} <= sentences
    docs = [doc(i, words=(200, 400), repeat=0.3) for i in range(400)]
    monotone = [is_monotone(d) for d in docs]
    assert 0.22 < np.mean(monotone) < 0.38
    varied = [i for i, m in enumerate(monotone) if not m]
    assert all(docs[i] == doc(i, words=(200, 400)) for i in varied)  # the coin has its own generator


def test_sources_pass_repeat_share_to_their_documents(cache_dir):
    """Loaded and streamed sources make monotone documents at repeat_share=1, and the cached dataset is another."""
    src = synth(num_docs=12, min_words=200, max_words=300, repeat_share=1.0, loss_on="qa")
    loaded = load_source(src, str(cache_dir), field="data.sources.r")
    streamed = list(stream_source(src, str(cache_dir), field="data.sources.r"))
    assert all(is_monotone(r["text"]) for r in loaded) and [r["text"] for r in streamed] == loaded["text"]
    plain = load_source(synth(num_docs=12, min_words=200, max_words=300, loss_on="qa"), str(cache_dir), field="x")
    assert not any(is_monotone(r["text"]) for r in plain) and plain.cache_files != loaded.cache_files


def test_documents_without_repeat_share_are_unchanged():
    """The default (repeat_share 0) draws exactly as before it existed: the digest of 40 documents, taken with
    the generator before repeat_share was added (it feeds the main job, whose README table rests on them)."""
    text = "".join(synthetic.document(0, i, 20, 400, KINDS, 0.5) for i in range(40))
    assert hashlib.sha256(text.encode()).hexdigest() == "04a07cd7e973afeb1957ad8a4d2413ddd40f7ba17dc026baa2a47b854e99a21c"


def test_a_document_depends_on_seed_and_index_only():
    forward = [doc(i) for i in range(20)]
    backward = [doc(i) for i in reversed(range(20))][::-1]
    assert forward == backward
    assert len(set(forward)) == 20
    assert doc(5, seed=1) != doc(5, seed=0)
    lengths = [len(doc(i, words=(200, 300), share=0.0).split()) for i in range(30)]
    assert min(lengths) >= 200 and max(lengths) < 300 + 120  # filler of the drawn size, plus facts and questions


@pytest.fixture(scope="module")
def tok():
    return train_bpe([doc(i) for i in range(40)], 400)


def synth(num_docs=300, seed=0, **kw) -> SourceConfig:
    kw = {"kinds": KINDS, "min_words": 20, "max_words": 200, **kw}
    return SourceConfig(kind="synthetic", synthetic=SyntheticConfig(seed=seed, num_docs=num_docs, **kw))


def test_loaded_and_streamed_sources_hold_the_same_documents(cache_dir):
    src = synth(num_docs=25)
    ds, skipped = drop_skipped(load_source(src, str(cache_dir)))
    assert not skipped and ds["text"] == [doc(i, words=(20, 200)) for i in range(25)]
    streamed = [row["text"] for row in stream_source(src, str(cache_dir), rank=1, world=2, leave_out=range(4))]
    assert streamed == ds["text"][4:][1::2]


def test_mixture_token_shares_within_two_percent(cache_dir, tok):
    cfg = DataConfig(sources={"a": synth(seed=1), "b": synth(seed=2, corpus_share=0.0)})
    corpus = build_corpus(cfg, tok, str(cache_dir))
    for wa in (0.2, 0.5, 0.8):
        docs = mixture_documents(corpus, {"a": wa, "b": 1 - wa}, seed=0)
        share = corpus.doc_len[docs][corpus.doc_source[docs] == 0].sum() / corpus.doc_len[docs].sum()
        assert abs(share - wa) <= 0.02, (wa, share)


def test_the_loss_token_share_counts_what_carries_loss(cache_dir, tok):
    """A loss_on=qa source weighs its filler in the mixture but trains only its questions and answers: the stage
    logs each source's share of the loss targets beside its share of the input, counted here from the packed
    labels themselves (data/batch.py packed_item), one document at a time."""
    from longstride.data.batch import packed_item
    from longstride.data.pipeline import source_shares
    from longstride.model.loss import IGNORE_INDEX

    cfg = DataConfig(sources={"qa": synth(seed=3, num_docs=60, loss_on="qa"), "all": synth(seed=4, num_docs=60)})
    corpus = build_corpus(cfg, tok, str(cache_dir))
    docs = mixture_documents(corpus, {"qa": 0.5, "all": 0.5}, seed=0)
    got = source_shares(corpus, docs)
    targets = np.zeros(2)
    for d in docs:
        start, n = int(corpus.doc_start[d]), int(corpus.doc_len[d])
        labels = packed_item([corpus.tokens[start:start + n]], n, tok.pad_token_id)["labels"]
        targets[corpus.doc_source[d]] += (np.asarray(labels) != IGNORE_INDEX).sum()
    want = targets / targets.sum()
    assert got["source_token_share"]["qa"] == pytest.approx(0.5, abs=0.02)
    assert got["source_loss_token_share"]["qa"] == pytest.approx(want[0], abs=1e-4), (got, want)
    assert want[0] < 0.3, "the qa source's filler carries no loss"


def test_resume_through_the_loader_is_exact(cache_dir, tok):
    from longstride.data.pipeline import stage_loader, stage_sequences

    cfg = DataConfig(sources={"r": synth(num_docs=200)})
    corpus = build_corpus(cfg, tok, str(cache_dir))
    seqs, _ = stage_sequences(cfg, corpus, 128, tok.pad_token_id)
    expected = [next(loader) for loader in [stage_loader(seqs, 2, 0, 1, cfg, 0)] for _ in range(30)]
    part = stage_loader(seqs, 2, 0, 1, cfg, 0)
    for _ in range(11):
        next(part)
    resumed = stage_loader(seqs, 2, 0, 1, cfg, 0)
    resumed.load_state_dict(part.state_dict())
    for i in range(11, 30):
        got = next(resumed)
        assert all(np.array_equal(got[k], expected[i][k]) for k in expected[i]), i


@pytest.mark.parametrize("bad, field", [(dict(kinds={"kv": 1.0, "lookup": 1.0}), "kinds"),
                                        (dict(kinds={"kv": 0.0}), "kinds"),
                                        (dict(min_words=50, max_words=10), "min_words"),
                                        (dict(corpus_share=1.5), "corpus_share"),
                                        (dict(repeat_share=-0.1), "repeat_share"),
                                        (dict(repeat_share=1.5), "repeat_share"),
                                        (dict(loss_on="answers"), "loss_on")])
def test_bad_synthetic_settings_name_the_field(cache_dir, bad, field):
    with pytest.raises(ValueError, match=rf"data.sources.r.synthetic.*{field}|{field}.*data.sources.r"):
        load_source(synth(**bad), str(cache_dir), field="data.sources.r")


def test_loss_on_qa_trains_only_on_questions_and_answers(cache_dir, tok):
    """loss_on=qa: the packed labels are exactly the question-and-answer tokens (and the EOS), the
    inputs are the same tokens as with loss_on=all, and the filler and facts are context only."""
    from longstride.data.pipeline import stage_sequences
    from longstride.model.loss import IGNORE_INDEX

    kinds = {"kv": 1.0, "multikey": 1.0, "chain": 1.0, "copy": 1.0}
    got = {}
    for loss_on in ("all", "qa"):
        cfg = DataConfig(sources={"r": synth(num_docs=40, kinds=kinds, loss_on=loss_on)}, packing="best_fit")
        seqs, _ = stage_sequences(cfg, build_corpus(cfg, tok, str(cache_dir)), 2048, tok.pad_token_id)
        got[loss_on] = [seqs[i] for i in range(len(seqs))]
    checked = 0
    for every, qa in zip(got["all"], got["qa"]):
        assert np.array_equal(every["input_ids"], qa["input_ids"]) and np.array_equal(every["doc_ids"], qa["doc_ids"])
        for d in np.unique(qa["doc_ids"]):
            rows = np.flatnonzero(qa["doc_ids"] == d)
            ids, labels = qa["input_ids"][rows], qa["labels"][rows]
            text = tok.decode(ids)
            if ids[-1] != tok.eos_token_id:
                continue  # padding (no document is cut at this length)
            trained = tok.decode(labels[labels != IGNORE_INDEX][:-1])  # without the final EOS
            body = text[:text.index(trained)]
            assert trained and text == body + trained + tok.eos_token, text
            assert trained.startswith("\n") and not any(trained.lstrip("\n").startswith(f[:8]) for f in
                                                      ("Remember", "The ", "Record"))
            assert (every["labels"][rows][:-1] != IGNORE_INDEX).all()  # loss_on=all: every token a target
            checked += 1
    assert checked >= 30


def test_packing_reports_qa_documents_it_splits(cache_dir, tok):
    """A loss_on=qa source's documents longer than the sequence lose their facts when split: the stage's
    packing stats give their share (the recipe warns above 5%); loss_on=all sources are not reported."""
    from longstride.data.pipeline import stage_sequences

    cfg = DataConfig(sources={"qa": synth(num_docs=60, loss_on="qa"), "lm": synth(num_docs=60, seed=1)})
    corpus = build_corpus(cfg, tok, str(cache_dir))
    lens = corpus.doc_len[corpus.doc_source == 0]
    for seq_len in (128, 512, int(lens.max())):
        _, stats = stage_sequences(cfg, corpus, seq_len, tok.pad_token_id, {"qa": 1.0, "lm": 1.0})
        assert set(stats["qa_docs_cut"]) == {"qa"}
        assert stats["qa_docs_cut"]["qa"] == pytest.approx((lens > seq_len).mean(), abs=0.1)
    assert stats["qa_docs_cut"]["qa"] == 0 and (lens > 128).mean() > 0.5
    assert "qa_docs_cut" not in stage_sequences(cfg, corpus, 128, tok.pad_token_id, {"lm": 1.0})[1]


def test_filler_stops_at_the_piece_that_reaches_its_length():
    for i in range(100):
        rng = random.Random(i)
        words = rng.randint(1, 300)
        pieces = synthetic.filler(rng, words, 0.5)
        counts = [len(p.split()) for p in pieces]
        assert sum(counts) >= words > sum(counts[:-1])


def test_copy_documents_ask_back_the_list_they_plant():
    for i in range(50):
        body, qa = synthetic.document_parts(4, i, 10, 40, {"copy": 1.0}, 0.0)
        words = re.search(r"Remember this list: ([A-Za-z ]+)\.", body).group(1).split()
        assert 8 <= len(words) <= 24 and all(w in synthetic.identifiers() for w in words)
        assert qa == f"\n{synthetic.COPY_QUESTION[0]}\n{synthetic.COPY_QUESTION[1]} {' '.join(words)}."


@pytest.mark.parametrize("task", ["synth_kv", "synth_multikey", "synth_chain"])
def test_in_format_eval_prompt_holds_its_answer_and_grows_with_length(tok, task):
    from longstride.eval.ruler.fit import make_sample
    from longstride.eval.ruler.tasks import ALL_TASKS

    short, long = (make_sample(ALL_TASKS[task], L, 3, tok, chat=False) for L in (256, 1024))
    assert short.units < long.units and len(long.prompt_ids) <= 1024 - 32
    for sample in (short, long):
        text = tok.decode(sample.prompt_ids)
        assert text.endswith(("Answer:", "A:", "was"))
        body = text[:text.rindex("\n", 0, len(text) - 10)]  # without the question
        assert all(a in body for a in sample.answers)  # the value (or every chain name) is planted in the body


def test_split_digits_gives_one_token_per_digit_in_every_context():
    texts = [doc(i) for i in range(40)]
    tok = train_bpe(texts, 400, split_digits=True)
    for text in ("The pin of amber-otter is 77967205.", "Answer: 77967205", "x = 77967205\n", "(77967205)"):
        pieces = [tok.decode([i]) for i in tok(text)["input_ids"]]
        start = next(i for i, p in enumerate(pieces) if p.strip() == "7")
        assert [p.strip() for p in pieces[start:start + 8]] == list("77967205"), pieces
        assert tok.decode(tok(text)["input_ids"]) == text


def test_validation_checks_synthetic_sources_before_compute():
    from longstride.recipes.config.plan import validate
    from tests.conftest import compose_cfg

    validate(compose_cfg(["data=retrieval"]), 2)
    cfg = compose_cfg(["data=retrieval", "data.sources.retrieval_long.synthetic.min_words=0"])
    with pytest.raises(ValueError, match=r"data.sources.retrieval_long.synthetic: need num_docs >= 1"):
        validate(cfg, 2)


def test_a_configs_kinds_replace_the_default_ones(cache_dir):
    """kinds: {copy: 1.0} in a config means copy documents only (OmegaConf merges dicts key by key, so a
    non-empty schema default would have added its kinds); a source that names none gets DEFAULT_KINDS."""
    from longstride.data.synthetic import kinds_of as synthetic_kinds
    from tests.conftest import compose_cfg

    sources = compose_cfg(["recipe=tiny_retrieval"]).data.sources
    assert dict(sources["copy_short"].synthetic.kinds) == {"copy": 1.0}
    assert synthetic_kinds(sources["retrieval_mid"]) == synthetic.DEFAULT_KINDS
    src = SourceConfig(kind="synthetic", synthetic=SyntheticConfig(**{**vars(sources["copy_short"].synthetic),
                                                                       "num_docs": 30}))
    texts = drop_skipped(load_source(src, str(cache_dir)))[0]["text"]
    assert all(synthetic.COPY_QUESTION[0] in t for t in texts)


@pytest.mark.parametrize("task", ["copy", "kv"])
def test_bare_copy_loop_runs(tmp_path, tok, capsys, task):
    """benchmarks/retrieval_bare_loop (the induction experiment in benchmarks/README) runs end to end."""
    from benchmarks.retrieval_bare_loop import main

    tok.save_pretrained(tmp_path / "tok")
    main(["--task", task, "--tokenizer", str(tmp_path / "tok"), "--steps", "2", "--rows", "2", "--probe-every", "2"])
    assert re.search(r"step 2  copy/answer-token accuracy [01]\.\d{3}", capsys.readouterr().out)
