"""Streaming data for corpora larger than memory (`data.streaming=true`).

Each source is a `datasets.IterableDataset` read lazily (data/sources.py: stream_source), split
across data-parallel ranks, checked (bad documents skipped and counted) and tokenised by a batched
map. Sources are mixed by token deficit: the next document comes from the source furthest below
its weight's share of the tokens drawn so far, so the mixture is exact and needs no RNG. A source
that runs out starts its next epoch.

`StreamPacker` packs them online into sequences of exactly seq_len tokens (data/packing.py:
OnlinePacker, best-fit over `open_seqs` open sequences or concatenate-and-chunk). Its state (stream positions, mixer counters, open and ready sequences) resumes the
stream exactly; torchdata's StatefulDataLoader stores it in every checkpoint.

The validation sequences are packed from the first documents of the unsharded stream (eval_sequences
x seq_len tokens of them; a stdlib source's from its first file past those synthetic filler draws lines from). Every
rank's training stream leaves out, per source, the most rows any stage of the run validates on, so no stage trains
on what another validates on.
"""
from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Callable

import datasets
import numpy as np
import torch

from longstride.data.batch import PackedSequences, collate, packed_item
from longstride.data.config import DataConfig
from longstride.data.files import digest
from longstride.data.loader import stateful_loader
from longstride.data.packing import OnlinePacker, pack
from longstride.data.pipeline import mixture_weights
from longstride.data.sources import (filler_prefix, stream_read_error, stream_rows_identity, stream_source,
                                     stream_split_by_rows, walk_files, walked)
from longstride.data.synthetic import FILLER_FILES, filler_sources
from longstride.data.tokenizer import tokenize_fn


def tokenized(ds: datasets.IterableDataset, tokenizer, epoch: int | None = None) -> datasets.IterableDataset:
    """The rows tokenised; `epoch` (not for a walked source, whose order is its own): set for datasets' shard order."""
    ds = ds.map(tokenize_fn(tokenizer), batched=True, batch_size=64, remove_columns=["text"])
    if epoch is not None:
        ds.set_epoch(epoch)
    return ds


class StreamPacker(torch.utils.data.IterableDataset):
    """Endless packed sequences (PackedBatch items) from token-weighted streamed sources."""

    def __init__(self, factories: dict[str, Callable[..., datasets.IterableDataset]], weights: dict[str, float],
                 seq_len: int, pad_id: int, method: str = "best_fit", open_seqs: int = 64, held_rows=None,
                 share: tuple[int, int] = (0, 1), by_rows=None, read_error=None):
        # factories[name](epoch, split=None): the source's rows of this rank in that epoch (split: a re-split's
        # share, stream_split.py)
        self.factories, self.seq_len, self.pad_id = factories, seq_len, pad_id
        self.share = share  # (data-parallel rank, ranks) whose share of each source this reads (for errors)
        self.by_rows = dict(by_rows or {})  # whether each source's share is every ranks-th row (re-splittable)
        self.packer = OnlinePacker(seq_len, method, open_seqs)
        total = sum(weights.get(n, 0.0) for n in factories)
        self.weights = {n: weights.get(n, 0.0) / total for n in factories if weights.get(n, 0.0) > 0}
        self.held_rows = held_rows or {}  # rows of each source skipped because they are held out (for errors)
        self.read_error = read_error  # read_error(name, exception): a record the reader cannot decode, worded
        self.load_state_dict(None)

    def state_dict(self) -> dict:
        return {"sources": {n: ds.state_dict() for n, ds in self._ds.items()}, "counters": copy.deepcopy(self.counters),
                "packer": self.packer.state_dict(), "splits": copy.deepcopy(self.splits),
                # a source read through a re-split's share is read by rows, whatever this layout's own split is
                "by_rows": {n: self.by_rows.get(n, False) or self.splits.get(n) is not None for n in self.weights}}

    def load_state_dict(self, state) -> None:
        """A state this class wrote, or a re-split one (stream_split.resplit: its sources start at their split's
        first row, and "packer" lists the packer states this rank takes over)."""
        names = list(self.weights)
        self.counters = copy.deepcopy(state["counters"]) if state else {
            key: {n: ({} if key == "skipped" else 0) for n in names}
            for key in ("epoch", "tokens", "rows", "skipped", "epoch_docs", "epoch_rows")}
        # a state from before the per-epoch row counts: None (unknown) until each source's next epoch
        self.counters.setdefault("epoch_rows", {n: None for n in names})
        self.splits = copy.deepcopy(state.get("splits", {})) if state else {}
        packed = state["packer"] if state else None
        self.packer.load_state_dict(None if isinstance(packed, list) else packed)
        if isinstance(packed, list):
            self.packer.adopt(packed)
        self._ds, self._its = {}, {}
        for n in names:
            ds = self.factories[n](self.counters["epoch"][n], self.splits.get(n))
            if state and state["sources"][n] is not None:
                ds.load_state_dict(state["sources"][n])
            self._ds[n] = ds

    def carry_over(self, positions: dict, pending=None) -> int:
        """A new stage's streams go on where earlier stages stopped: `positions` maps a source to the stream state
        (this data-parallel rank's, or a re-split's: data/stream_split.py) of the last final that read it; the other
        sources start at their beginning. Token counts start at zero (the stage's mixture is its own); `pending`:
        the state whose packers' open and ready sequences (documents drawn and not trained on) are packed first.
        Returns how many such pieces it carried."""
        counters = {"tokens": {}, "rows": {}, "skipped": {}, "epoch": {}, "epoch_docs": {}, "epoch_rows": {}}
        for n in self.weights:
            counters["tokens"][n], counters["rows"][n], counters["skipped"][n] = 0, 0, {}
            for key in ("epoch", "epoch_docs", "epoch_rows"):
                counters[key][n] = positions[n]["counters"][key].get(n) if n in positions else 0
        self.load_state_dict({"counters": counters, "packer": None,
                              "sources": {n: positions[n]["sources"][n] if n in positions else None
                                          for n in self.weights},
                              "splits": {n: positions[n]["splits"][n] for n in positions
                                         if n in self.weights and positions[n]["splits"].get(n)}})
        packers = [] if pending is None else pending["packer"] if isinstance(pending["packer"], list) else \
            [pending["packer"]]
        pieces = [p for s in packers if s for seq in s["ready"] + s["open"] for p in seq]
        for p in pieces:
            self.packer.add(p.numpy() if isinstance(p, torch.Tensor) else np.asarray(p, dtype=np.int32))
        return len(pieces)

    def report(self) -> dict:
        return {**self.packer.stats(), "streaming": True, "skipped": self.counters["skipped"],
                "rows": dict(self.counters["rows"])}

    def next_document(self) -> np.ndarray:
        """The next usable document's token ids, from the source furthest below its token share."""
        c = self.counters
        drawn = sum(c["tokens"].values())
        name = max(self.weights, key=lambda n: (self.weights[n] * (drawn + 1) - c["tokens"][n], -list(self.weights).index(n)))
        while True:
            it = self._its.get(name)
            if it is None:
                it = self._its[name] = iter(self._ds[name])
            try:
                row = next(it, None)
            except Exception as e:  # a record the reader cannot decode, met mid-stream
                reworded = self.read_error(name, e) if self.read_error is not None else None
                if reworded is None:
                    raise
                raise reworded from e
            if row is None:  # the source is exhausted: its next epoch
                if not c["epoch_docs"][name]:
                    held, (rank, ranks) = self.held_rows.get(name, 0), self.share
                    where = "" if ranks == 1 else f" of data-parallel rank {rank}'s share (1 in {ranks} rows or files)"
                    raise ValueError(
                        f"data.sources.{name}: no usable document in a whole pass{where} (skipped: "
                        f"{c['skipped'][name]}" + (f"; {held} of its rows are held out for validation, lower "
                                                   "data.eval_sequences" if held else "") + ")" +
                        ("; the source is empty" if ranks == 1 else
                         f"; a streamed source needs at least {ranks} rows (files, for a walked source) so that "
                         "every data-parallel rank reads some: add some, drop it, or stream with fewer ranks"))
                c["epoch"][name] += 1
                c["epoch_docs"][name] = c["epoch_rows"][name] = 0
                self.splits[name] = None  # every epoch starts whole, shared by this layout's ranks
                ds = self.factories[name](c["epoch"][name])
                self._ds[name], self._its[name] = ds, None
                continue
            c["rows"][name] += 1
            if c["epoch_rows"][name] is not None:
                c["epoch_rows"][name] += 1
            if row["skip"]:
                c["skipped"][name][row["skip"]] = c["skipped"][name].get(row["skip"], 0) + 1
                continue
            ids = np.asarray(row["input_ids"], dtype=np.int32)
            c["tokens"][name] += len(ids)
            c["epoch_docs"][name] += 1
            return ids

    def __iter__(self):
        while True:
            while not self.packer.ready:
                self.packer.add(self.next_document())
            yield packed_item(self.packer.ready.pop(0), self.seq_len, self.pad_id)


class StreamLoader:
    """Micro-batches from a StreamPacker through torchdata's StatefulDataLoader (one process)."""

    def __init__(self, packer: StreamPacker, micro_batch_size: int, origin: dict | None = None):
        self.loader = stateful_loader(packer, batch_size=micro_batch_size, collate_fn=collate, num_workers=0)
        self._it = None
        # per source, what numbers its rows (config, files, held-out rows): a later stage's streams go on from this
        # stage's positions only where it is the same (recipes/run/stage_state.carry_streams)
        self.origin = origin or {}

    @property
    def packer(self) -> StreamPacker:
        return self.loader.dataset

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
                    dp_rank: int, dp: int, cache_dir: str, stages=None) -> tuple[StreamLoader, list, dict]:
    """(training loader of this data rank, held-out items, packing report of the held-out documents).
    Held out: the first documents of the unsharded mixed stream, eval_sequences x seq_len tokens of them,
    packed in memory (all their sequences: at least eval_sequences). Every rank's training stream leaves out, per
    source, the most rows any of `stages` ((seq_len, mixture) of every stage of the run; default: this one)
    holds out: report["held_out_rows"][source] = [first, end) (a stdlib source's first rows past its filler files);
    report["rows_identity"][source]: what numbers its rows (sources.stream_rows_identity), for the fingerprint."""
    # a stdlib or local_dir source's files, walked once: every pass of the stage (its heads, its epochs) reads
    # these, and the fingerprint names them (a file added mid-stage waits for the next stage)
    paths = {n: walk_files(s, f"data.sources.{n}") for n, s in cfg.sources.items() if walked(s)}
    # a stdlib source's first files may be ones whose lines synthetic filler trains on: its held-out rows start after
    first = {n: filler_prefix(s, cfg.sources, f"data.sources.{n}", paths.get(n)) for n, s in cfg.sources.items()}
    for n, k in first.items():
        if k and cfg.eval_sequences and k == len(paths[n]):
            fillers = ",".join(filler_sources(cfg.sources))
            raise ValueError(f"data.sources.{n}: all {k} of its files are among the first {FILLER_FILES} of the "
                             f"standard library, whose lines the filler of data.sources.{{{fillers}}} trains on "
                             "(synthetic.corpus_share > 0), so none can be held out for validation; give "
                             f"data.sources.{n}.max_docs more files, set their synthetic.corpus_share=0 or "
                             "data.eval_sequences=0")

    def read_error(name: str, e: Exception):
        return stream_read_error(cfg.sources[name], f"data.sources.{name}", e)

    def factories(rank: int, world: int, leave_out: dict) -> dict:
        return {n: (lambda epoch=0, split=None, n=n, s=s: tokenized(stream_source(
                    s, cache_dir, f"data.sources.{n}", rank, world, leave_out.get(n, range(0)), paths.get(n), split,
                    epoch), tokenizer, None if walked(s) else epoch))
                for n, s in cfg.sources.items()}

    def head(length: int, mix) -> tuple[list, StreamPacker]:
        packer = StreamPacker(factories(0, 1, {n: range(k) for n, k in first.items()}), mixture_weights(cfg, mix),
                              length, pad_id, cfg.packing, read_error=read_error)
        docs, total = [], 0
        while total < cfg.eval_sequences * length:
            docs.append(packer.next_document())
            total += len(docs[-1])
        for n, epoch in packer.counters["epoch"].items():
            if epoch:  # read past its end: the held-out rows would be every row (and validation repeat documents)
                raise ValueError(f"data.sources.{n}: validating on its share of data.eval_sequences="
                                 f"{cfg.eval_sequences} x {length} tokens reads all of its documents"
                                 + (f" past its first {first[n]} (files whose lines synthetic filler trains on)"
                                    if first[n] else "") + "; lower data.eval_sequences or give it more documents")
        return docs, packer

    docs, mine = head(seq_len, mixture)
    held_out, report = [], {"seq_len": seq_len, "streaming": True}
    if docs:
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        plan, report = pack(np.cumsum(lens) - lens, lens, seq_len, cfg.packing)
        seqs = PackedSequences(np.concatenate(docs), plan, pad_id)
        held_out = [seqs[i] for i in range(len(seqs))]
        report = {**report, "streaming": True, "measured_on": f"{len(docs)} held-out documents"}
    rows = dict(mine.counters["rows"])
    for length, mix in stages or ():
        if (length, mix) != (seq_len, mixture) and cfg.eval_sequences:
            for n, r in head(length, mix)[1].counters["rows"].items():
                rows[n] = max(rows.get(n, 0), r)
    held = {n: range(first[n], first[n] + r) for n, r in rows.items() if r}
    by_rows = {n: stream_split_by_rows(s, cache_dir, f"data.sources.{n}", dp, held.get(n, range(0)))
               for n, s in cfg.sources.items()}
    train = StreamPacker(factories(dp_rank, dp, held), mixture_weights(cfg, mixture), seq_len, pad_id, cfg.packing,
                         cfg.stream_open_seqs, held_rows=rows, share=(dp_rank, dp), by_rows=by_rows,
                         read_error=read_error)
    identity = {n: stream_rows_identity(s, f"data.sources.{n}", paths.get(n)) for n, s in cfg.sources.items()}
    origin = {n: digest([{k: v for k, v in asdict(s).items() if k != "weight"}, identity[n],
                         [held[n].start, held[n].stop] if n in held else None]) for n, s in cfg.sources.items()}
    return StreamLoader(train, micro_batch_size, origin), held_out, {
        **report, "skipped": mine.counters["skipped"], "held_out_rows": {n: [r.start, r.stop] for n, r in held.items()},
        "rows_identity": identity}
