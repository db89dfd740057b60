"""Packing documents into sequences of exactly `seq_len` tokens.

best_fit: documents longer than the sequence are first split into seq_len-sized pieces, then all
pieces are placed by best-fit-decreasing (each piece goes into the fullest sequence it still fits
in), which cuts only the over-long documents and leaves almost no padding.
concat: the classic concatenate-and-chunk, for comparison: no padding, many documents cut.
A plan is segments (start in the flat token array, length) grouped per sequence, CSR style.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


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
    """Documents back to back, cut every seq_len tokens; the last partial sequence is dropped."""
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
    cut = int(spans[begins < n_seq * seq_len].sum())
    return PackPlan(seq_len, seg_start.astype(np.int64), (seg_hi - seg_lo).astype(np.int64), ptr), cut


def pack(starts: np.ndarray, lens: np.ndarray, seq_len: int, method: str) -> tuple[PackPlan, dict]:
    if method == "best_fit":
        plan, cut = pack_best_fit(starts, lens, seq_len)
    elif method == "concat":
        plan, cut = pack_concat(starts, lens, seq_len)
    else:
        raise ValueError(f"data.packing={method!r} is unknown; use best_fit or concat")
    return plan, plan.stats(len(lens), cut)
