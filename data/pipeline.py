"""One stage's data: corpus -> mixture -> (long-document upsampling) -> packing -> loader.

Validation documents are chosen once per run (`holdout_documents`), Megatron-style, from whole documents: no stage
trains on a document any stage validates on, and none is a file whose lines synthetic filler trains on. Each stage
validates on a prefix of them in its own mixture.
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence

import numpy as np

from longstride.data.batch import PackedSequences
from longstride.data.config import DataConfig, LossOn
from longstride.data.corpus import Corpus, mixture_documents, upsample_long
from longstride.data.loader import EpochLoader
from longstride.data.packing import pack
from longstride.data.synthetic import FILLER_FILES, filler_sources

MAX_HELD_SHARE = 0.5  # of a source's tokens: holding out more would leave a stage training on little of it


def mixture_weights(cfg: DataConfig, mixture: Optional[dict]) -> dict[str, float]:
    """Source -> weight in a stage: its mixture, or else every source's own weight (not normalised)."""
    return dict(mixture) if mixture else {name: src.weight for name, src in cfg.sources.items()}


def stage_weights(cfg: DataConfig, mixture: Optional[dict]) -> dict[str, float]:
    """Source -> share of a stage's tokens (mixture_weights, normalised; sources of weight 0 left out)."""
    weights = mixture_weights(cfg, mixture)
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items() if w > 0}


def trained_documents(corpus: Corpus, held: dict) -> np.ndarray:
    """The mask of the corpus's documents a stage may train on: all but the `held` ones (holdout_documents)."""
    keep = np.ones(len(corpus.doc_len), dtype=bool)
    if held:
        keep[np.concatenate(list(held.values())).astype(np.int64)] = False
    return keep


def check_long_docs(cfg: DataConfig, corpus: Corpus, stages: dict, run_stages) -> None:
    """Before any stage trains: each stage's long-document upsampling (its own long_docs, else data.long_docs) finds
    documents of at least min_tokens among those the stage draws (its mixture's draw of the documents no stage
    validates on, as stage_sequences makes it), naming the field; found only when that stage built its data, a run
    learnt it after the stages before it had trained. `stages`: name -> StageConfig of the stages to run;
    `run_stages`: (seq_len, mixture) of every stage of the recipe, which the held-out documents are chosen for."""
    keep = None
    for name, s in stages.items():
        field, ld = (f"recipe.stages.{name}.long_docs", s.long_docs) if s.long_docs else \
            ("data.long_docs", cfg.long_docs)
        if ld.min_tokens <= 0 or ld.min_share <= 0:
            continue
        if keep is None:
            keep = trained_documents(corpus, holdout_documents(cfg, corpus, run_stages))
        weights = stage_weights(cfg, s.mixture)
        lens = corpus.doc_len[mixture_documents(corpus, weights, cfg.seed, keep)]
        if not (lens >= ld.min_tokens).any():
            raise ValueError(f"{field}.min_tokens={ld.min_tokens} for stage {name}: no document the stage draws from "
                             f"{sorted(weights)} is that long (the longest: {int(lens.max()) if len(lens) else 0} "
                             "tokens); lower it, or add longer documents or weight their source up")


def _prefix_to(docs: np.ndarray, doc_len: np.ndarray, tokens: float) -> np.ndarray:
    """The shortest prefix of docs with at least `tokens` tokens (all of docs if they have fewer)."""
    return docs[:int(np.searchsorted(np.cumsum(doc_len[docs]), tokens)) + 1]


def holdout_documents(cfg: DataConfig, corpus: Corpus,
                      stages: Sequence[tuple[int, Optional[dict]]]) -> dict[str, np.ndarray]:
    """The run's validation documents: source -> documents, in a seeded order. Per source, the first documents of a
    shuffle (of those whose lines no synthetic filler trains on: corpus.doc_in_filler) holding the most tokens any
    stage (seq_len, mixture) validates on from it: its share of that stage's eval_sequences x seq_len. Every stage's
    epoch leaves all of them out (stage_sequences)."""
    need: dict[str, float] = {}
    for seq_len, mixture in stages:
        for name, share in stage_weights(cfg, mixture).items():
            need[name] = max(need.get(name, 0.0), share * cfg.eval_sequences * seq_len)
    in_filler = corpus.doc_in_filler if corpus.doc_in_filler is not None else np.zeros(len(corpus.doc_len), bool)
    held = {}
    for i, name in enumerate(corpus.sources):
        docs = np.flatnonzero(corpus.doc_source == i)
        if need.get(name, 0) <= 0:
            held[name] = docs[:0]
            continue
        pool = np.flatnonzero((corpus.doc_source == i) & ~in_filler)  # no file whose lines synthetic filler trains on
        room = corpus.doc_len[pool].sum()
        if len(pool) < len(docs) and room < need[name]:
            raise ValueError(f"data.sources.{name}: validating on {int(need[name])} of its tokens (its stage share "
                             f"of data.eval_sequences={cfg.eval_sequences} x seq_len) needs more than the {room} "
                             f"tokens of its files past the first {FILLER_FILES} of the standard library, whose lines "
                             f"the filler of data.sources.{{{','.join(filler_sources(cfg.sources))}}} trains on "
                             f"(synthetic.corpus_share > 0); give data.sources.{name}.max_docs more files, set their "
                             "synthetic.corpus_share=0 or lower data.eval_sequences")
        order = pool[np.random.default_rng([cfg.seed, 1, i]).permutation(len(pool))]
        held[name] = _prefix_to(order, corpus.doc_len, need[name])
        kept, total = corpus.doc_len[held[name]].sum(), corpus.doc_len[docs].sum()
        if len(held[name]) == len(docs) or kept > MAX_HELD_SHARE * total:
            raise ValueError(f"data.eval_sequences={cfg.eval_sequences}: validating on {int(need[name])} tokens of "
                             f"source {name} (its stage share of eval_sequences x seq_len) holds out {kept} of its "
                             f"{total} tokens, more than {MAX_HELD_SHARE:.0%}; lower data.eval_sequences or give "
                             f"data.sources.{name} more documents")
    return held


def stage_sequences(cfg: DataConfig, corpus: Corpus, seq_len: int, pad_id: int,
                    mixture: Optional[dict] = None, long_docs=None,
                    held: Optional[dict] = None) -> tuple[PackedSequences, dict]:
    """One epoch of the stage packed, leaving out the `held` documents (holdout_documents)."""
    keep = trained_documents(corpus, held) if held else None
    docs = mixture_documents(corpus, stage_weights(cfg, mixture), cfg.seed, keep)
    docs = upsample_long(docs, corpus.doc_len, long_docs or cfg.long_docs, cfg.seed)
    plan, stats = pack(corpus.doc_start[docs], corpus.doc_len[docs], seq_len, cfg.packing)
    stats.update(qa_docs_cut(cfg, corpus, docs, seq_len))
    stats.update(source_shares(corpus, docs))
    long_min = (long_docs or cfg.long_docs).min_tokens
    if long_min:
        lens = corpus.doc_len[docs]
        stats["long_doc_token_share"] = float(lens[lens >= long_min].sum() / lens.sum())
    if held is not None:
        stats["held_out_documents"] = {name: len(d) for name, d in held.items() if len(d)}
    return PackedSequences(corpus.tokens, plan, pad_id), stats


def validation_sequences(cfg: DataConfig, corpus: Corpus, held: dict, seq_len: int, pad_id: int,
                         mixture: Optional[dict] = None) -> tuple[PackedSequences, dict]:
    """The stage's validation set: from each source's held-out documents, the first ones holding its mixture share
    of eval_sequences x seq_len tokens, packed as training packs (at least eval_sequences sequences: all are kept,
    since best-fit puts the longest documents in the first sequences)."""
    n_tokens = cfg.eval_sequences * seq_len
    parts = [_prefix_to(held[name], corpus.doc_len, share * n_tokens)
             for name, share in stage_weights(cfg, mixture).items() if n_tokens and len(held.get(name, ()))]
    docs = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    plan, _ = pack(corpus.doc_start[docs], corpus.doc_len[docs], seq_len, cfg.packing)
    return PackedSequences(corpus.tokens, plan, pad_id), {"validation": {"sequences": len(plan),
                                                                         "documents": len(docs)}}


def data_fingerprint(meta: dict, *arrays: np.ndarray) -> str:
    """SHA-256 of what a stage's data position points into: `meta` (as JSON) and the arrays' bytes. Every step
    checkpoint stores it, and a resume over other data is refused (recipes/run/stage_state.py restore_stage)."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode())
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


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


def stage_loader(dataset, micro_batch_size: int, dp_rank: int, dp_world: int,
                 cfg: DataConfig, stage_index: int) -> EpochLoader:
    return EpochLoader(dataset, micro_batch_size, dp_rank, dp_world, seed=cfg.seed + 1000 * stage_index,
                       num_workers=cfg.num_workers)
