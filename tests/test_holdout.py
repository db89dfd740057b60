"""The run's validation documents (data/pipeline.py holdout_documents, data/stream.py streaming_stage): chosen once
for every stage, so no stage trains on a document that any stage validates on, and each stage validates on its own
mixture's share of eval_sequences x seq_len held-out tokens."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from longstride.data.config import DataConfig, SourceConfig
from longstride.data.corpus import Corpus
from longstride.data.pipeline import holdout_documents, stage_sequences, validation_sequences
from longstride.data.stream import streaming_stage

STAGES = [(64, {"a": 1.0, "b": 1.0}), (256, {"a": 0.2, "b": 0.8}), (512, {"a": 0.9, "b": 0.1})]


def _corpus(n_a: int = 400, n_b: int = 300) -> Corpus:
    """Two sources of documents 10-300 tokens long; every token id is its document's index, so a sequence names the
    documents in it."""
    rng = np.random.default_rng(0)
    lens = rng.integers(10, 300, n_a + n_b)
    tokens = np.repeat(np.arange(n_a + n_b, dtype=np.int32), lens)
    return Corpus(tokens, np.cumsum(lens) - lens, lens.astype(np.int64),
                  np.repeat(np.arange(2, dtype=np.int16), [n_a, n_b]), ["a", "b"])


def _cfg(eval_sequences: int = 4) -> DataConfig:
    return DataConfig(sources={"a": SourceConfig(kind="files"), "b": SourceConfig(kind="files")},
                      eval_sequences=eval_sequences)


PAD = 10**6  # no document's id


def _docs(seqs) -> set[int]:
    return {int(t) for i in range(len(seqs)) for t in np.unique(seqs[i]["input_ids"])} - {PAD}


def test_no_stage_trains_on_a_document_any_stage_validates_on():
    corpus, cfg = _corpus(), _cfg()
    held = holdout_documents(cfg, corpus, STAGES)
    trained, validated = set(), {}
    for seq_len, mixture in STAGES:
        train, stats = stage_sequences(cfg, corpus, seq_len, PAD, mixture, held=held)
        trained |= _docs(train)
        val, vstats = validation_sequences(cfg, corpus, held, seq_len, PAD, mixture)
        validated[seq_len] = _docs(val)
        assert len(val) >= cfg.eval_sequences and vstats["validation"]["sequences"] == len(val)
        assert stats["held_out_documents"] == {k: len(v) for k, v in held.items()}
        tokens = {s: corpus.doc_len[[d for d in validated[seq_len] if corpus.doc_source[d] == i]].sum()
                  for i, s in enumerate(corpus.sources)}
        for name, w in mixture.items():  # each source gives at least its share, and one document more at most
            share = w / sum(mixture.values()) * cfg.eval_sequences * seq_len
            assert share <= tokens[name] < share + corpus.doc_len.max(), (seq_len, name, tokens, share)
    every = set().union(*validated.values())
    assert every and not every & trained, "a validation document is trained on"
    assert every == {int(d) for v in held.values() for d in v}, "every held-out document validates some stage"


def test_the_held_out_documents_are_the_runs_not_the_stages():
    """Held out for the first stage alone, the documents the later, longer stages validate on are trained on
    in the first: what the split over all stages prevents."""
    corpus, cfg = _corpus(), _cfg()
    first = holdout_documents(cfg, corpus, STAGES[:1])
    train_first = _docs(stage_sequences(cfg, corpus, 64, PAD, STAGES[0][1], held=first)[0])
    held = holdout_documents(cfg, corpus, STAGES)
    later = _docs(validation_sequences(cfg, corpus, held, 512, PAD, STAGES[2][1])[0])
    assert later & train_first, "the per-stage split trains the later stage's validation documents"


def test_the_split_is_seeded_and_stable():
    corpus = _corpus()
    one, two = holdout_documents(_cfg(), corpus, STAGES), holdout_documents(_cfg(), corpus, STAGES)
    assert all(np.array_equal(one[k], two[k]) for k in one)
    other = holdout_documents(DataConfig(**{**_cfg().__dict__, "seed": 7}), corpus, STAGES)
    assert not np.array_equal(one["a"], other["a"])


def test_no_eval_sequences_holds_nothing_out():
    corpus, cfg = _corpus(), _cfg(0)
    held = holdout_documents(cfg, corpus, STAGES)
    assert all(len(v) == 0 for v in held.values())
    assert len(validation_sequences(cfg, corpus, held, 64, PAD, STAGES[0][1])[0]) == 0


def test_holding_out_more_than_half_a_source_is_refused():
    corpus = _corpus(n_b=20)  # b: about 3K tokens; the 512-token stage asks 10% x 16 x 512 = 820 of them
    with pytest.raises(ValueError, match=r"data.eval_sequences=40: validating on \d+ tokens of source b .* more than "
                                         r"50%; lower data.eval_sequences or give data.sources.b more documents"):
        holdout_documents(_cfg(40), corpus, STAGES)


def test_a_streaming_stage_skips_what_a_later_stage_holds_out(tmp_path):
    from tests.test_stream import L, MB, corpus_docs, docs_of, write_jsonl
    from longstride.data.tokenizer import train_bpe

    a, b = corpus_docs("a", 40, 0), corpus_docs("b", 20, 1)
    tok = train_bpe(a + b, 300)
    cfg = DataConfig(sources={"a": SourceConfig(kind="files", path=write_jsonl(tmp_path / "a.jsonl", a), weight=3.0),
                              "b": SourceConfig(kind="files", path=write_jsonl(tmp_path / "b.jsonl", b), weight=1.0)},
                     streaming=True, eval_sequences=2, stream_open_seqs=128)
    later = (4 * L, {"a": 1.0})
    _, held, report = streaming_stage(cfg, tok, later[0], tok.pad_token_id, later[1], MB, 0, 1, str(tmp_path))
    held_docs = docs_of({k: torch.from_numpy(np.stack([h[k] for h in held])) for k in held[0]}) - {(tok.pad_token_id,)}

    def trained(stages) -> set:
        loader, _, rep = streaming_stage(cfg, tok, L, tok.pad_token_id, None, MB, 0, 1, str(tmp_path), stages=stages)
        return set().union(*(docs_of(next(loader)) for _ in range(6))), rep  # within the first epoch

    def first_pieces_of(docs: set, pieces: set) -> set:
        return {p for p in pieces for d in docs if d[:len(p)] == p}

    alone, _ = trained(None)
    assert first_pieces_of(held_docs, alone), "trained alone, this stage reads the later stage's held-out rows"
    both, rep = trained([(L, None), later])
    assert rep["held_out_rows"]["a"] == report["held_out_rows"]["a"]
    assert not first_pieces_of(held_docs, both), "a later stage's held-out document is trained on"


def _filler_cfg(max_docs: int, corpus_share: float, streaming: bool = False) -> DataConfig:
    """The stdlib's first max_docs files beside a synthetic source whose filler takes corpus_share of its lines from
    the first FILLER_FILES of them."""
    from longstride.data.config import SyntheticConfig

    return DataConfig(sources={"stdlib": SourceConfig(kind="stdlib", max_docs=max_docs),
                               "r": SourceConfig(kind="synthetic", weight=0.2, synthetic=SyntheticConfig(
                                   num_docs=20, min_words=20, max_words=60, corpus_share=corpus_share))},
                      eval_sequences=8, streaming=streaming)


@pytest.fixture(scope="module")
def stdlib_tok():
    from longstride.data.files import list_files, stdlib_root
    from longstride.data.tokenizer import train_bpe

    return train_bpe([open(p, encoding="utf-8").read() for p in list_files(stdlib_root(), "**/*.py")[:30]], 400)


def test_no_held_out_file_is_one_whose_lines_the_filler_trains_on(cache_dir, stdlib_tok):
    """A synthetic source with corpus_share > 0 trains on runs of lines of the stdlib's first FILLER_FILES files,
    so none of those may validate: in memory the held-out stdlib documents are other files (read back from their
    tokens); streamed, the held-out rows start past them. Without stdlib filler, the same seed holds out some."""
    from longstride.data.corpus import build_corpus
    from longstride.data.files import list_files, stdlib_root
    from longstride.data.sources import stream_source
    from longstride.data.synthetic import FILLER_FILES, filler_files
    from longstride.data.tokenizer import tokenize_fn

    filler = {open(p, encoding="utf-8").read() for p in filler_files()}
    n = FILLER_FILES + 20

    def held_texts(cfg) -> list[str]:
        corpus = build_corpus(cfg, stdlib_tok, str(cache_dir))
        held = holdout_documents(cfg, corpus, [(1024, None)])["stdlib"]
        return [stdlib_tok.decode(corpus.tokens[corpus.doc_start[d]:corpus.doc_start[d] + corpus.doc_len[d] - 1])
                for d in held]

    texts = held_texts(_filler_cfg(n, 0.5))
    walked = [open(p, encoding="utf-8").read() for p in list_files(stdlib_root(), "**/*.py")[:n]]
    assert texts and set(texts) <= set(walked[FILLER_FILES:]), "a held-out document is not a file past the filler's"
    assert set(held_texts(_filler_cfg(n, 0.0))) & filler, "the control holds out none of the first files"
    with pytest.raises(ValueError, match=r"data.sources.stdlib: validating on \d+ of its tokens .* past the first "
                                         r"400 of the standard library, whose lines the filler of data.sources.\{r\} "
                                         r"trains on .* data.sources.stdlib.max_docs more files"):
        held_texts(_filler_cfg(FILLER_FILES, 0.5))

    _, held, report = streaming_stage(_filler_cfg(n, 0.5, streaming=True), stdlib_tok, 1024,
                                      stdlib_tok.pad_token_id, None, 1, 0, 1, str(cache_dir))
    lo, hi = report["held_out_rows"]["stdlib"]
    assert held and lo == FILLER_FILES and hi > lo
    # the validation sequences hold exactly those files' tokens (and the synthetic source's): no filler file
    got = Counter(int(t) for h in held for t in h["input_ids"] if t != stdlib_tok.pad_token_id)
    want = Counter(t for text in walked[lo:hi] for t in tokenize_fn(stdlib_tok)({"text": [text]})["input_ids"][0])
    assert not want - got, "a held-out row's tokens are not in the validation sequences"
    with pytest.raises(ValueError, match=r"data.sources.stdlib: all 400 of its files are among the first 400 .*"
                                         r"data.sources.stdlib.max_docs more files"):
        streaming_stage(_filler_cfg(FILLER_FILES, 0.5, streaming=True), stdlib_tok, 1024, stdlib_tok.pad_token_id,
                        None, 1, 0, 1, str(cache_dir))
    src = SourceConfig(kind="stdlib", max_docs=n)  # what the training stream reads: every row but the held-out
    assert [r["text"] for r in stream_source(src, str(cache_dir), leave_out=range(lo, hi))] == walked[:lo] + walked[hi:]


def test_long_document_upsampling_is_checked_on_the_documents_the_stage_draws():
    """Source a holds the corpus's one long document but weighs 0.05: the stage's draw of a (its seeded share of a's
    documents) leaves it out, so upsampling would find no long document at that stage's start. The early check
    (recipes/train.py setup, before any stage trains) draws as the stage does and refuses it; weighted up, a passes."""
    from types import SimpleNamespace

    from longstride.data.config import LongDocConfig
    from longstride.data.pipeline import check_long_docs

    lens = np.array([1000] + [10] * 550)
    src = np.array([0] * 51 + [1] * 500, dtype=np.int16)
    corpus = Corpus(np.zeros(lens.sum(), np.int32), np.concatenate([[0], np.cumsum(lens)[:-1]]), lens, src,
                    ["a", "b"], {}, None)
    stage = {"s": SimpleNamespace(long_docs=LongDocConfig(500, 0.3), mixture=None)}
    light = DataConfig(sources={"a": SourceConfig(weight=0.05), "b": SourceConfig(weight=0.95)}, eval_sequences=0)
    with pytest.raises(ValueError, match=r"recipe.stages.s.long_docs.min_tokens=500 for stage s: no document the "
                                         r"stage draws from \['a', 'b'\] is that long \(the longest: 10 tokens\)"):
        check_long_docs(light, corpus, stage, [(64, None)])
    heavy = DataConfig(sources={"a": SourceConfig(weight=0.5), "b": SourceConfig(weight=0.5)}, eval_sequences=0)
    check_long_docs(heavy, corpus, stage, [(64, None)])
