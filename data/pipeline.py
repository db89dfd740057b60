"""One stage's data: corpus -> mixture -> (long-document upsampling) -> packing -> loader."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from longstride.data.batch import PackedSequences
from longstride.data.config import DataConfig, LossOn
from longstride.data.corpus import Corpus, mixture_documents, upsample_long
from longstride.data.loader import EpochLoader
from longstride.data.packing import pack


def stage_sequences(cfg: DataConfig, corpus: Corpus, seq_len: int, pad_id: int,
                    mixture: Optional[dict] = None, long_docs=None) -> tuple[PackedSequences, dict]:
    weights = dict(mixture) if mixture else {name: src.weight for name, src in cfg.sources.items()}
    docs = mixture_documents(corpus, weights, cfg.seed)
    docs = upsample_long(docs, corpus.doc_len, long_docs or cfg.long_docs, cfg.seed)
    plan, stats = pack(corpus.doc_start[docs], corpus.doc_len[docs], seq_len, cfg.packing)
    stats.update(qa_docs_cut(cfg, corpus, docs, seq_len))
    stats.update(source_shares(corpus, docs))
    long_min = (long_docs or cfg.long_docs).min_tokens
    if long_min:
        lens = corpus.doc_len[docs]
        stats["long_doc_token_share"] = float(lens[lens >= long_min].sum() / lens.sum())
    return PackedSequences(corpus.tokens, plan, pad_id), stats


def source_shares(corpus: Corpus, docs: np.ndarray) -> dict:
    """Each source's share of an epoch's input tokens (upsampling included), and, where some tokens are context
    only (synthetic sources with loss_on=qa), of the tokens that are loss targets (a document's first token and
    context-only tokens are none)."""
    def shares(per_doc: np.ndarray) -> dict:
        return {name: round(float(per_doc[corpus.doc_source[docs] == i].sum() / per_doc.sum()), 4)
                for i, name in enumerate(corpus.sources)}

    out = {"source_token_share": shares(corpus.doc_len[docs])}
    target = corpus.tokens >= 0
    if not target.all():  # documents lie back to back in corpus order: one sum per document
        per_doc = np.add.reduceat(target, corpus.doc_start, dtype=np.int64) - target[corpus.doc_start]
        out["source_loss_token_share"] = shares(per_doc[docs])
    return out


def qa_docs_cut(cfg: DataConfig, corpus: Corpus, docs: np.ndarray, seq_len: int) -> dict:
    """{"qa_docs_cut": {source: share}} for the synthetic sources with loss_on=qa in this epoch: the share of
    their documents longer than seq_len. Packing splits those, and the piece holding the questions can no
    longer see the facts they ask about, so its answers are noise to train on. Empty if there is none."""
    cut = {}
    for i, name in enumerate(corpus.sources):
        src = cfg.sources[name]
        mine = corpus.doc_len[docs[corpus.doc_source[docs] == i]]
        if src.kind == "synthetic" and src.synthetic.loss_on == LossOn.qa and len(mine):
            cut[name] = round(float((mine > seq_len).mean()), 4)
    return {"qa_docs_cut": cut} if cut else {}


def split_holdout(dataset: PackedSequences, n_eval: int, seed: int):
    """(train, held-out) subsets: a seeded choice of n_eval sequences never trained on."""
    if n_eval < 0 or n_eval >= len(dataset):
        raise ValueError(f"data.eval_sequences={n_eval} must be in [0, {len(dataset)}) for this stage's packing")
    held = np.sort(np.random.default_rng(seed).choice(len(dataset), n_eval, replace=False))
    keep = np.setdiff1d(np.arange(len(dataset)), held)
    return torch.utils.data.Subset(dataset, keep.tolist()), torch.utils.data.Subset(dataset, held.tolist())


def stage_loader(dataset, micro_batch_size: int, dp_rank: int, dp_world: int,
                 cfg: DataConfig, stage_index: int) -> EpochLoader:
    return EpochLoader(dataset, micro_batch_size, dp_rank, dp_world, seed=cfg.seed + 1000 * stage_index,
                       num_workers=cfg.num_workers)
