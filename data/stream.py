"""Streaming data for corpora larger than memory (`data.streaming=true`).

Each source is a `datasets.IterableDataset` read lazily (data/sources.py: stream_source), split
across data-parallel ranks, checked (bad documents skipped and counted) and tokenised by a batched
map. Sources are mixed by token deficit: the next document comes from the source furthest below
its weight's share of the tokens drawn so far, so the mixture is exact and needs no RNG. A source
that runs out starts its next epoch.

`StreamPacker` packs online into sequences of exactly seq_len tokens. best_fit: documents longer
than the sequence are cut into seq_len pieces, each piece goes into the open sequence with the
least room that still fits it (a new one if none does); a full sequence is emitted at once, and
when more than `open_seqs` are open the fullest is emitted. concat: one open sequence, documents
cut at its end. Its state (stream positions, mixer counters, open and ready sequences) resumes the
stream exactly; torchdata's StatefulDataLoader stores it in every checkpoint.

The validation sequences are packed from the first documents of the unsharded stream (eval_sequences
x seq_len tokens of them); every rank's training stream skips the rows they came from.
"""
from __future__ import annotations

import copy
import itertools
from typing import Callable

import datasets
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from data.batch import PackedSequences, collate, packed_item
from data.config import DataConfig
from data.packing import pack
from data.sources import stream_source


def tokenized(ds: datasets.IterableDataset, tokenizer) -> datasets.IterableDataset:
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    return ds.map(tokenize, batched=True, batch_size=64, remove_columns=["text"])


class StreamPacker(torch.utils.data.IterableDataset):
    """Endless packed sequences (PackedBatch items) from token-weighted streamed sources."""

    def __init__(self, factories: dict[str, Callable[[], datasets.IterableDataset]], weights: dict[str, float],
                 seq_len: int, pad_id: int, method: str = "best_fit", open_seqs: int = 64, held_rows=None):
        if method not in ("best_fit", "concat"):
            raise ValueError(f"data.packing={method!r} is unknown; use best_fit or concat")
        self.factories, self.seq_len, self.pad_id, self.method = factories, seq_len, pad_id, method
        total = sum(weights.get(n, 0.0) for n in factories)
        self.weights = {n: weights.get(n, 0.0) / total for n in factories if weights.get(n, 0.0) > 0}
        self.open_seqs = max(1, open_seqs if method == "best_fit" else 1)
        self.held_rows = held_rows or {}  # rows of each source skipped because they are held out (for errors)
        self.load_state_dict(None)

    # ---- state ----
    def state_dict(self) -> dict:
        return {"sources": {n: ds.state_dict() for n, ds in self._ds.items()}, "counters": copy.deepcopy(self.counters),
                "open": [list(s) for s in self._open], "ready": list(self._ready)}

    def load_state_dict(self, state) -> None:
        self.counters = copy.deepcopy(state["counters"]) if state else {
            "epoch": {n: 0 for n in self.weights}, "tokens": {n: 0 for n in self.weights},
            "rows": {n: 0 for n in self.weights}, "skipped": {n: {} for n in self.weights},
            "epoch_docs": {n: 0 for n in self.weights},
            "sequences": 0, "used": 0, "pieces": 0, "docs": 0, "docs_cut": 0}
        self._ds, self._its = {}, {}
        for n in self.weights:
            ds = self.factories[n]()
            ds.set_epoch(self.counters["epoch"][n])
            if state:
                ds.load_state_dict(state["sources"][n])
            self._ds[n] = ds
        self._open = [list(s) for s in state["open"]] if state else []
        self._ready = list(state["ready"]) if state else []

    def report(self) -> dict:
        c = self.counters
        cap = c["sequences"] * self.seq_len
        return {"seq_len": self.seq_len, "streaming": True, "sequences": c["sequences"],
                "padding_fraction": 1 - c["used"] / cap if cap else 0.0,
                "docs_cut_fraction": c["docs_cut"] / c["docs"] if c["docs"] else 0.0,
                "docs_per_sequence": c["pieces"] / c["sequences"] if c["sequences"] else 0.0,
                "skipped": c["skipped"], "rows": dict(c["rows"])}

    # ---- documents ----
    def next_document(self) -> np.ndarray:
        c = self.counters
        drawn = sum(c["tokens"].values())
        name = max(self.weights, key=lambda n: (self.weights[n] * (drawn + 1) - c["tokens"][n], -list(self.weights).index(n)))
        while True:
            it = self._its.get(name)
            if it is None:
                it = self._its[name] = iter(self._ds[name])
            row = next(it, None)
            if row is None:  # the source is exhausted: its next epoch
                if not c["epoch_docs"][name]:
                    held = self.held_rows.get(name, 0)
                    raise ValueError(f"data.sources.{name}: no usable document in a whole pass (skipped: "
                                     f"{c['skipped'][name]}" + (f"; the first {held} rows are held out for validation, "
                                     "lower data.eval_sequences" if held else "") + "); the source is empty")
                c["epoch"][name] += 1
                c["epoch_docs"][name] = 0
                ds = self.factories[name]()
                ds.set_epoch(c["epoch"][name])
                self._ds[name], self._its[name] = ds, None
                continue
            c["rows"][name] += 1
            if row["skip"]:
                c["skipped"][name][row["skip"]] = c["skipped"][name].get(row["skip"], 0) + 1
                continue
            ids = np.asarray(row["input_ids"], dtype=np.int32)
            c["tokens"][name] += len(ids)
            c["epoch_docs"][name] += 1
            c["docs"] += 1
            return ids

    # ---- packing ----
    def _emit(self, i: int) -> None:
        seq = self._open.pop(i)
        self.counters["sequences"] += 1
        self.counters["used"] += sum(len(p) for p in seq)
        self.counters["pieces"] += len(seq)
        self._ready.append(seq)

    def _place(self, doc: np.ndarray) -> None:
        L = self.seq_len
        if self.method == "concat":
            parts = 0
            while len(doc):
                if not self._open:
                    self._open.append([])
                room = L - sum(len(p) for p in self._open[0])
                self._open[0].append(doc[:room])
                doc, parts = doc[room:], parts + 1
                if len(self._open[0][-1]) == room:
                    self._emit(0)
            self.counters["docs_cut"] += parts > 1
            return
        self.counters["docs_cut"] += len(doc) > L
        for piece in (doc[s:s + L] for s in range(0, len(doc), L)):
            rooms = [L - sum(len(p) for p in seq) for seq in self._open]
            fits = [(r, i) for i, r in enumerate(rooms) if r >= len(piece)]
            if fits:
                i = min(fits)[1]
                self._open[i].append(piece)
            else:
                self._open.append([piece])
                i = len(self._open) - 1
            if sum(len(p) for p in self._open[i]) == L:
                self._emit(i)
            elif len(self._open) > self.open_seqs:
                self._emit(int(np.argmin([L - sum(len(p) for p in seq) for seq in self._open])))

    def __iter__(self):
        while True:
            while not self._ready:
                self._place(self.next_document())
            yield packed_item(self._ready.pop(0), self.seq_len, self.pad_id)


class StreamLoader:
    """Micro-batches from a StreamPacker through torchdata's StatefulDataLoader (one process)."""

    def __init__(self, packer: StreamPacker, micro_batch_size: int):
        self.loader = StatefulDataLoader(packer, batch_size=micro_batch_size, collate_fn=collate, num_workers=0)
        self._it = None

    def __next__(self) -> dict:
        if self._it is None:
            self._it = iter(self.loader)
        return next(self._it)

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it = None


def streaming_stage(cfg: DataConfig, tokenizer, seq_len: int, pad_id: int, mixture, micro_batch_size: int,
                    dp_rank: int, dp: int, cache_dir: str) -> tuple[StreamLoader, list, dict]:
    """(training loader of this data rank, held-out items, packing report of the held-out documents).
    Held out: the first documents of the unsharded mixed stream, eval_sequences x seq_len tokens of them,
    packed in memory; every rank's training stream skips the rows they came from."""
    weights = dict(mixture) if mixture else {n: s.weight for n, s in cfg.sources.items()}

    def factories(rank: int, world: int, skip: dict) -> dict:
        return {n: (lambda n=n, s=s: tokenized(stream_source(s, cache_dir, f"data.sources.{n}", rank, world,
                                                             skip.get(n, 0)), tokenizer))
                for n, s in cfg.sources.items()}

    head = StreamPacker(factories(0, 1, {}), weights, seq_len, pad_id, cfg.packing)
    docs, total = [], 0
    while total < cfg.eval_sequences * seq_len:
        docs.append(head.next_document())
        total += len(docs[-1])
    held_out, report = [], {"seq_len": seq_len, "streaming": True}
    if docs:
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        plan, report = pack(np.cumsum(lens) - lens, lens, seq_len, cfg.packing)
        seqs = PackedSequences(np.concatenate(docs), plan, pad_id)
        held_out = [seqs[i] for i in range(min(cfg.eval_sequences, len(seqs)))]
        report = {**report, "streaming": True, "measured_on": f"{len(docs)} held-out documents"}
    rows = dict(head.counters["rows"])
    train = StreamPacker(factories(dp_rank, dp, rows), weights, seq_len, pad_id, cfg.packing, cfg.stream_open_seqs,
                         held_rows=rows)
    return StreamLoader(train, micro_batch_size), held_out, {**report, "skipped": head.counters["skipped"],
                                                             "held_out_rows": rows}
