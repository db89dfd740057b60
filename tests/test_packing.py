"""Packing: every token placed exactly once, sequences never overflow, labels never cross documents."""
from __future__ import annotations

import numpy as np
import pytest

from longstride.data.batch import PackedSequences, collate
from longstride.data.corpus import upsample_long
from longstride.data.config import LongDocConfig
from longstride.data.packing import best_fit_decreasing, pack, pack_concat, split_long
from longstride.model.loss import IGNORE_INDEX


def random_docs(seed: int, n: int = 400, max_len: int = 700):
    rng = np.random.default_rng(seed)
    lens = np.concatenate([rng.integers(1, 60, n // 2), rng.integers(1, max_len, n - n // 2), [1, 256, 513]])
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return starts.astype(np.int64), lens.astype(np.int64)


@pytest.mark.parametrize("method", ["best_fit", "concat"])
@pytest.mark.parametrize("seq_len", [64, 256])
def test_every_token_exactly_once(method, seq_len):
    starts, lens = random_docs(0)
    plan, stats = pack(starts, lens, seq_len, method)
    covered = np.zeros(int(lens.sum()), dtype=np.int64)
    for s, n in zip(plan.seg_start, plan.seg_len):
        covered[s:s + n] += 1
    if method == "best_fit":
        assert (covered == 1).all()
    else:  # concat drops only the final partial sequence
        assert (covered <= 1).all() and covered.sum() == (lens.sum() // seq_len) * seq_len
    per_seq = np.add.reduceat(plan.seg_len, plan.seq_ptr[:-1])
    assert (per_seq <= seq_len).all()
    assert 0 <= stats["padding_fraction"] < 1
    # no segment crosses a document boundary: its first and last token lie in the same document
    ends = np.cumsum(lens)
    first = np.searchsorted(ends, plan.seg_start, side="right")
    assert (plan.seg_len > 0).all() and (first == np.searchsorted(ends, plan.seg_start + plan.seg_len - 1,
                                                                  side="right")).all()


def test_best_fit_cuts_only_long_documents_and_pads_little():
    starts, lens = random_docs(1, n=3000)
    L = 512
    plan, stats = pack(starts, lens, L, "best_fit")
    _, concat_stats = pack(starts, lens, L, "concat")
    # read off the plan: a document of at most L tokens is one whole segment, a longer one several
    doc = np.searchsorted(np.cumsum(lens), plan.seg_start, side="right")
    pieces = np.bincount(doc, minlength=len(lens))
    short = lens <= L
    assert (pieces[short] == 1).all() and (pieces[~short] > 1).all()
    whole = {(int(a), int(n)) for a, n in zip(plan.seg_start, plan.seg_len)}
    assert all((int(a), int(n)) in whole for a, n in zip(starts[short], lens[short]))
    assert stats["docs_cut_fraction"] == pytest.approx((pieces > 1).mean()) == pytest.approx((lens > L).mean())
    assert stats["docs_cut_fraction"] < concat_stats["docs_cut_fraction"]
    assert stats["padding_fraction"] < 0.01


def test_best_fit_decreasing_is_optimal_on_exact_fit():
    # 6 items that fill 3 bins exactly: BFD must find it.
    lens = np.array([6, 4, 5, 5, 7, 3])
    bins = best_fit_decreasing(lens, 10)
    assert np.bincount(bins, weights=lens).tolist() == [10, 10, 10]


def test_split_long_pieces():
    s, n, cut = split_long(np.array([0, 10]), np.array([10, 25]), 8)
    assert n.tolist() == [8, 2, 8, 8, 8, 1] and s.tolist() == [0, 8, 10, 18, 26, 34] and cut == 2


def test_concat_counts_cut_documents():
    plan, cut = pack_concat(np.array([0, 5, 11]), np.array([5, 6, 9]), 8)
    # the doc at [5, 11) spans the boundary at 8, and the one at [11, 20) loses 16-19 to the dropped tail
    assert len(plan) == 2 and cut == 2
    assert pack_concat(np.array([0, 5, 10]), np.array([5, 5, 5]), 4)[1] == 3  # the last one's tail dropped too


def test_batch_fields_restart_per_document_and_labels_stay_inside():
    tokens = np.arange(1000, dtype=np.int32) + 10
    starts, lens = np.array([0, 100, 130, 300]), np.array([5, 1, 40, 3])
    plan, _ = pack(starts, lens, 64, "best_fit")
    ds = PackedSequences(tokens, plan, pad_id=0)
    batch = collate([ds[i] for i in range(len(ds))])
    assert set(batch) == {"input_ids", "labels", "position_ids", "doc_ids"}
    placed = []
    for b in range(len(ds)):
        ids, lab, pos, doc = (batch[k][b].numpy() for k in ("input_ids", "labels", "position_ids", "doc_ids"))
        for d in np.unique(doc):
            idx = np.flatnonzero(doc == d)
            assert (pos[idx] == np.arange(len(idx))).all(), "RoPE positions restart at 0 in each document"
            assert lab[idx[-1]] == IGNORE_INDEX, "no label across a document boundary"
            if (ids[idx] == 0).all():  # the sequence's padding (the corpus's ids are >= 10): no loss on it
                assert idx[-1] == len(ids) - 1 and (lab[idx] == IGNORE_INDEX).all()
                continue
            assert (lab[idx[:-1]] == ids[idx[1:]]).all(), "each label is the document's next token"
            placed.append(tuple(ids[idx].tolist()))
        assert np.all(np.diff(doc) >= 0)
    assert sorted(placed) == sorted(tuple(tokens[a:a + n].tolist()) for a, n in zip(starts, lens))
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == int((lens - 1).sum()) == 45


def test_long_document_upsampling_reaches_share():
    lens = np.array([10] * 90 + [100] * 2)
    docs = upsample_long(np.arange(len(lens)), lens, LongDocConfig(min_tokens=50, min_share=0.5), seed=0)
    picked = lens[docs]
    assert picked[picked >= 50].sum() / picked.sum() >= 0.5
    assert set(docs.tolist()) == set(range(len(lens)))  # nothing dropped
