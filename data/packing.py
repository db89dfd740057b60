"""Packing documents into sequences of exactly `seq_len` tokens.

best_fit: documents longer than the sequence are first split into seq_len-sized pieces, then all
pieces are placed by best-fit-decreasing (each piece goes into the fullest sequence it still fits
in), which cuts only the over-long documents and leaves almost no padding.
concat: the classic concatenate-and-chunk, for comparison: no padding, many documents cut.
A plan is segments (start in the flat token array, length) grouped per sequence, CSR style.
OnlinePacker does the same one document at a time, for streams (data/stream.py).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PackPlan:
    seq_len: int
    seg_start: np.ndarray  # (S,) int64 offsets into the corpus' flat tokens
    seg_len: np.ndarray  # (S,) int64
    seq_ptr: np.ndarray  # (num_sequences + 1,) segments of sequence i are seg_ptr[i]:seg_ptr[i+1]

    def __len__(self) -> int:
        return len(self.seq_ptr) - 1

    def stats(self, num_docs: int, docs_cut: int) -> dict:
        used = int(self.seg_len.sum())
        capacity = len(self) * self.seq_len
        return {
            "seq_len": self.seq_len,
            "sequences": len(self),
            "padding_fraction": 1.0 - used / capacity if capacity else 0.0,
            "docs_cut_fraction": docs_cut / num_docs if num_docs else 0.0,
            "docs_per_sequence": len(self.seg_len) / len(self) if len(self) else 0.0,
        }


def split_long(starts: np.ndarray, lens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Pieces of at most seq_len tokens; returns (piece starts, piece lengths, documents cut)."""
    n_pieces = (lens + seq_len - 1) // seq_len
    doc_of_piece = np.repeat(np.arange(len(lens)), n_pieces)
    first_piece = np.cumsum(n_pieces) - n_pieces
    k = np.arange(len(doc_of_piece)) - first_piece[doc_of_piece]  # piece index within its document
    p_start = starts[doc_of_piece] + k * seq_len
    p_len = np.minimum(lens[doc_of_piece] - k * seq_len, seq_len)
    return p_start.astype(np.int64), p_len.astype(np.int64), int((n_pieces > 1).sum())


def best_fit_decreasing(lens: np.ndarray, capacity: int) -> np.ndarray:
    """Bin index for each item (all lens <= capacity). Bins are kept by remaining space in a
    sorted list, so each placement is one bisect: O(n log n) overall."""
    order = np.argsort(-lens, kind="stable")
    bin_of = np.empty(len(lens), dtype=np.int64)
    free_sizes: list[int] = []  # distinct remaining capacities that some bin has, ascending
    bins_with: dict[int, list[int]] = {}  # remaining capacity -> bins with exactly that much
    n_bins = 0
    for i in order.tolist():
        need = int(lens[i])
        j = bisect.bisect_left(free_sizes, need)
        if j == len(free_sizes):
            b, left = n_bins, capacity - need
            n_bins += 1
        else:
            room = free_sizes[j]
            group = bins_with[room]
            b = group.pop()
            if not group:
                del bins_with[room]
                free_sizes.pop(j)
            left = room - need
        bin_of[i] = b
        if left > 0:
            if left not in bins_with:
                bins_with[left] = []
                bisect.insort(free_sizes, left)
            bins_with[left].append(b)
    return bin_of


def _plan_from_bins(p_start: np.ndarray, p_len: np.ndarray, bin_of: np.ndarray, seq_len: int) -> PackPlan:
    order = np.lexsort((np.arange(len(bin_of)), bin_of))  # by bin, then original piece order
    counts = np.bincount(bin_of, minlength=int(bin_of.max()) + 1 if len(bin_of) else 0)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return PackPlan(seq_len, p_start[order], p_len[order], ptr)


def pack_best_fit(starts: np.ndarray, lens: np.ndarray, seq_len: int) -> tuple[PackPlan, int]:
    p_start, p_len, cut = split_long(starts, lens, seq_len)
    return _plan_from_bins(p_start, p_len, best_fit_decreasing(p_len, seq_len), seq_len), cut


def pack_concat(starts: np.ndarray, lens: np.ndarray, seq_len: int) -> tuple[PackPlan, int]:
    """Documents back to back, cut every seq_len tokens; the last partial sequence is dropped. Cut: a document that
    crosses a sequence boundary or loses tokens to the dropped tail."""
    ends = np.cumsum(lens)
    begins = ends - lens
    n_seq = int(ends[-1] // seq_len) if len(ends) else 0
    bounds = np.arange(1, n_seq) * seq_len  # cut points inside the stream
    # Segments are the documents intersected with [k*L, (k+1)*L) windows.
    cuts = np.unique(np.concatenate([begins, bounds, [n_seq * seq_len]]))
    cuts = cuts[cuts <= n_seq * seq_len]
    seg_lo, seg_hi = cuts[:-1], cuts[1:]
    doc = np.searchsorted(ends, seg_lo, side="right")
    seg_start = starts[doc] + (seg_lo - begins[doc])
    seq = seg_lo // seq_len
    counts = np.bincount(seq, minlength=n_seq)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    spans = (np.searchsorted(bounds, begins, side="right") != np.searchsorted(bounds, ends - 1, side="right"))
    cut = int((spans | (ends > n_seq * seq_len)).sum())  # the dropped tail's documents lose their ends, or all
    return PackPlan(seq_len, seg_start.astype(np.int64), (seg_hi - seg_lo).astype(np.int64), ptr), cut


METHODS = ("best_fit", "concat")  # data.packing's choices (data/config.py Packing), offline and online


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"data.packing={method!r} is unknown; use one of {list(METHODS)}")


def pack(starts: np.ndarray, lens: np.ndarray, seq_len: int, method: str) -> tuple[PackPlan, dict]:
    check_method(method)
    plan, cut = (pack_best_fit if method == "best_fit" else pack_concat)(starts, lens, seq_len)
    return plan, plan.stats(len(lens), cut)


class OnlinePacker:
    """Packs documents as they arrive. best_fit: each piece (documents longer than seq_len are cut
    into seq_len pieces) goes into the open sequence with the least room that still fits it, or a new
    one; a full sequence is ready at once, and when more than `open_seqs` are open the fullest is
    made ready. concat: one open sequence, documents cut at its end. Its state is tensors and plain data
    (the pending pieces as tensors), so a checkpoint holding it loads with torch.load(weights_only=True)."""

    def __init__(self, seq_len: int, method: str = "best_fit", open_seqs: int = 64):
        check_method(method)
        self.seq_len, self.method = seq_len, method
        self.open_seqs = max(1, open_seqs) if method == "best_fit" else 1
        self.load_state_dict(None)

    def state_dict(self) -> dict:
        pieces = lambda seq: [torch.from_numpy(np.ascontiguousarray(p)) for p in seq]  # noqa: E731
        return {"open": [pieces(seq) for seq in self.open], "ready": [pieces(seq) for seq in self.ready],
                "counts": dict(self.counts)}

    def load_state_dict(self, state) -> None:
        arrays = lambda seq: [p.numpy() if isinstance(p, torch.Tensor) else np.asarray(p) for p in seq]  # noqa: E731
        self.open = [arrays(seq) for seq in state["open"]] if state else []  # lists of token arrays
        self.used = [sum(len(p) for p in seq) for seq in self.open]
        self.ready = [arrays(seq) for seq in state["ready"]] if state else []
        self.counts = dict(state["counts"]) if state else {"sequences": 0, "used": 0, "pieces": 0, "docs": 0,
                                                           "docs_cut": 0}

    def adopt(self, states: list[dict]) -> None:
        """Takes over other packers' pending sequences (their states; data/stream_split.py, a resume on fewer
        data-parallel ranks): their ready ones as they are, their open ones as open ones of this packer (concat:
        their pieces go on filling its one open sequence in order), the fullest made ready while more than
        open_seqs are open; their counts are added to this one's."""
        for state in states:
            other = OnlinePacker(self.seq_len, self.method, self.open_seqs)
            other.load_state_dict(state)
            self.ready += other.ready
            for k, v in other.counts.items():
                self.counts[k] += v
            for seq in other.open:
                if self.method == "concat":
                    for piece in seq:
                        self._fill(piece)
                    continue
                self.open.append(seq)
                self.used.append(sum(len(p) for p in seq))
                while len(self.open) > self.open_seqs:
                    self._emit(int(np.argmax(self.used)))

    def _emit(self, i: int) -> None:
        seq, used = self.open.pop(i), self.used.pop(i)
        self.counts["sequences"] += 1
        self.counts["used"] += used
        self.counts["pieces"] += len(seq)
        self.ready.append(seq)

    def _put(self, i: int, piece: np.ndarray) -> None:
        if i == len(self.open):
            self.open.append([])
            self.used.append(0)
        self.open[i].append(piece)
        self.used[i] += len(piece)

    def _fill(self, doc: np.ndarray) -> int:
        """concat: `doc` into the one open sequence, cut where it is full (then ready); returns the parts."""
        parts = 0
        while len(doc):
            room = self.seq_len - (self.used[0] if self.open else 0)
            self._put(0, doc[:room])
            doc, parts = doc[room:], parts + 1
            if self.used[0] == self.seq_len:
                self._emit(0)
        return parts

    def add(self, doc: np.ndarray) -> None:
        L = self.seq_len
        self.counts["docs"] += 1
        if self.method == "concat":
            self.counts["docs_cut"] += self._fill(doc) > 1
            return
        self.counts["docs_cut"] += len(doc) > L
        for s in range(0, len(doc), L):
            piece = doc[s:s + L]
            best, room = len(self.open), L + 1
            for i, u in enumerate(self.used):
                if len(piece) <= L - u < room:
                    best, room = i, L - u
            self._put(best, piece)
            if self.used[best] == L:
                self._emit(best)
            elif len(self.open) > self.open_seqs:
                self._emit(int(np.argmax(self.used)))

    def stats(self) -> dict:
        c, cap = self.counts, self.counts["sequences"] * self.seq_len
        return {"seq_len": self.seq_len, "sequences": c["sequences"],
                "padding_fraction": 1 - c["used"] / cap if cap else 0.0,
                "docs_cut_fraction": c["docs_cut"] / c["docs"] if c["docs"] else 0.0,
                "docs_per_sequence": c["pieces"] / c["sequences"] if c["sequences"] else 0.0}
