"""Tokenised corpus: every document as a run of token ids (EOS appended) in one flat array.

Tokenisation is a batched `datasets.map`, cached by fingerprint next to the source's arrow files.
Per stage, `mixture_documents` picks which documents (and how many repeats) form one epoch:
token-weighted source mixture, then optional length-aware upsampling of long documents.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from longstride.data.config import DataConfig, LongDocConfig
from longstride.data.files import digest
from longstride.data.sources import drop_skipped, filler_prefix, load_source, stream_source
from longstride.data.tokenizer import cached_bpe, check_tokenizer, load_tokenizer, tokenize_fn


@dataclass
class Corpus:
    tokens: np.ndarray  # (N,) int32: all documents back to back, each ending with EOS
    doc_start: np.ndarray  # (D,) int64 offset of each document in `tokens`
    doc_len: np.ndarray  # (D,) int64
    doc_source: np.ndarray  # (D,) int16 index into `sources`
    sources: list[str]
    report: dict = field(default_factory=dict)
    # (D,) bool: documents whose lines synthetic filler also trains on (data/sources.filler_prefix), never held out
    doc_in_filler: Optional[np.ndarray] = None


def build_tokenizer(cfg: DataConfig, cache_dir: str):
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    name, src = next(iter(cfg.sources.items()))
    if cfg.streaming:  # the first tokenizer_train_bytes of the stream
        texts, n = (row["text"] for row in stream_source(src, cache_dir, f"data.sources.{name}") if not row["skip"]), -1
    else:
        ds, _ = drop_skipped(load_source(src, cache_dir, cfg.num_proc, f"data.sources.{name}"))
        texts, n = iter(ds["text"]), len(ds)

    def sample():
        budget = cfg.tokenizer_train_bytes
        for text in texts:
            if budget <= 0:
                return
            budget -= len(text)
            yield text

    source = {k: v for k, v in vars(src).items() if (k != "synthetic" or src.kind == "synthetic") and k != "weight"}
    # the texts themselves are in the key (at most tokenizer_train_bytes): an edited file or a new snapshot under the
    # same source config trains a new tokenizer instead of reusing the old one
    sampled = list(sample())
    content = hashlib.sha256("\0".join(sampled).encode("utf-8", "surrogatepass")).hexdigest()
    key = {"source": source, "n": n, "vocab": cfg.vocab_size, "bytes": cfg.tokenizer_train_bytes, "texts": content}
    if cfg.split_digits:
        key["split_digits"] = True
    tok = cached_bpe(sampled, cfg.vocab_size, cache_dir, f"bpe-{digest(key)}", cfg.split_digits)
    check_tokenizer(tok, "data.tokenizer")
    return tok


def build_corpus(cfg: DataConfig, tokenizer, cache_dir: str) -> Corpus:
    """Loads, cleans and tokenises every source in `cfg.sources` (cached on disk)."""
    os.makedirs(cache_dir, exist_ok=True)
    parts, report = [], {"skipped": {}, "documents": {}, "tokens": {}}
    for name, src in cfg.sources.items():
        if src.weight <= 0:
            raise ValueError(f"data.sources.{name}.weight={src.weight} must be positive; drop the source instead")
        rows = load_source(src, cache_dir, cfg.num_proc, f"data.sources.{name}")
        filler_head = filler_prefix(src, cfg.sources, f"data.sources.{name}")  # rows, usable or skipped
        lead = sum(not r for r in rows.select(range(filler_head))["skip"])  # the documents among them
        ds, skipped = drop_skipped(rows)
        report["skipped"][name] = skipped
        if len(ds) == 0:
            raise ValueError(f"data.sources.{name}: no usable document (skipped: {skipped}); the corpus is empty")
        ds = ds.map(tokenize_fn(tokenizer), batched=True, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                    remove_columns=ds.column_names, desc=f"tokenizing {name}")
        col = ds.data.column("input_ids").combine_chunks()
        offsets = col.offsets.to_numpy().astype(np.int64)
        parts.append((name, col.values.to_numpy().astype(np.int32), offsets, np.arange(len(ds)) < lead))
        report["documents"][name] = len(ds)
        report["tokens"][name] = int(offsets[-1] - offsets[0])
    tokens, starts, lens, srcs, base = [], [], [], [], 0
    for i, (name, toks, offsets, _) in enumerate(parts):
        tokens.append(toks[offsets[0]:offsets[-1]])
        starts.append(offsets[:-1] - offsets[0] + base)
        lens.append(np.diff(offsets))
        srcs.append(np.full(len(offsets) - 1, i, dtype=np.int16))
        base += int(offsets[-1] - offsets[0])
    return Corpus(np.concatenate(tokens), np.concatenate(starts), np.concatenate(lens), np.concatenate(srcs),
                  [p[0] for p in parts], report, np.concatenate([p[3] for p in parts]))


def mixture_documents(corpus: Corpus, weights: dict[str, float], seed: int,
                      keep: Optional[np.ndarray] = None) -> np.ndarray:
    """Document indices for one epoch of a stage: each source contributes `weight` of the tokens
    (normalised), drawn from its documents (those `keep` marks, if given: the rest are held out) in a seeded
    order and repeated when a small source has a large weight. The epoch has as many tokens as the documents
    it may draw from."""
    unknown = set(weights) - set(corpus.sources)
    if unknown:
        raise ValueError(f"stage mixture names unknown sources {sorted(unknown)}; known: {corpus.sources}")
    total_w = sum(weights.values())
    keep = np.ones(len(corpus.doc_len), dtype=bool) if keep is None else keep
    total_tokens = int(corpus.doc_len[keep].sum())
    rng = np.random.default_rng(seed)
    picked = []
    for i, name in enumerate(corpus.sources):
        w = weights.get(name, 0.0) / total_w
        if w <= 0:
            continue
        docs = np.flatnonzero((corpus.doc_source == i) & keep)
        order = docs[rng.permutation(len(docs))]
        target = w * total_tokens
        src_tokens = corpus.doc_len[docs].sum()
        reps = int(target // src_tokens)
        cum = np.concatenate([[0], np.cumsum(corpus.doc_len[order])])
        rest = order[:max(nearest(cum, target - reps * src_tokens, slack_of=target), 0 if reps else 1)]
        picked.append(np.concatenate([np.tile(order, reps), rest]))
    return np.concatenate(picked)


def nearest(cum: np.ndarray, target: float, slack: float = 0.05, slack_of: Optional[float] = None) -> int:
    """How many of a seeded order's documents to take (cum: their running token total from 0) for `target` tokens:
    up to the one that crosses it, unless that one overshoots by more than `slack` of `slack_of` (the source's
    whole share, where `target` is what is left of it after whole repeats; default `target`) and stopping
    short of it comes nearer (a source of a few long documents would otherwise overshoot its weight by most of a
    document: 0.31 for 0.2). Within the slack the crossing document stays, so a large corpus's epochs (and the
    checkpoints whose data position points into them) are the same as before the rule. mixture_documents takes at
    least one document of a source it draws from."""
    k = int(np.searchsorted(cum, target))  # cum[k - 1] < target <= cum[k]
    if 0 < k < len(cum) and cum[k] - target > slack * (slack_of or target) and target - cum[k - 1] < cum[k] - target:
        return k - 1
    return k


def upsample_long(doc_ids: np.ndarray, doc_len: np.ndarray, cfg: LongDocConfig, seed: int) -> np.ndarray:
    """Repeats documents of >= min_tokens until they make up >= min_share of the tokens."""
    if cfg.min_tokens <= 0 or cfg.min_share <= 0:
        return doc_ids
    if not 0 < cfg.min_share < 1:
        raise ValueError(f"data.long_docs.min_share={cfg.min_share} must be in (0, 1)")
    lens = doc_len[doc_ids]
    long = doc_ids[lens >= cfg.min_tokens]
    long_tokens, short_tokens = lens[lens >= cfg.min_tokens].sum(), lens[lens < cfg.min_tokens].sum()
    if len(long) == 0:
        raise ValueError(f"data.long_docs.min_tokens={cfg.min_tokens}: no document is that long; lower it")
    need = cfg.min_share * short_tokens / (1 - cfg.min_share) - long_tokens  # extra long tokens
    if need <= 0:
        return doc_ids
    rng = np.random.default_rng(seed)
    extra = []
    while need > 0:
        order = long[rng.permutation(len(long))]
        cum = np.cumsum(doc_len[order])
        take = order[: int(np.searchsorted(cum, need)) + 1]
        extra.append(take)
        need -= doc_len[take].sum()
    return np.concatenate([doc_ids, *extra])
