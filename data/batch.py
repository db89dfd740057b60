"""Packed sequences as training examples, and their collation into a PackedBatch.

A PackedBatch is a dict of (B, L) int64 tensors:
  input_ids     token ids (padding: the pad id, in its own trailing "document")
  labels        the next token *within the same document*, IGNORE_INDEX at each document's last
                token, on padding and where the next token is context only (stored negative by
                context_only below); labels are aligned: no shift happens later, so CP can shard them
  position_ids  RoPE positions, restarting at 0 in every document
  doc_ids       0, 1, 2, ... per document in the row (decides masking)
Causality follows the order of the tokens: context parallelism cuts the sequence into chunks and
the ring plan (parallel/blocks.py) knows each chunk's place, so no per-token index travels with them.
No L x L mask exists anywhere.
"""
from __future__ import annotations

import numpy as np
import torch

from longstride.data.packing import PackPlan
from longstride.model.loss import IGNORE_INDEX

BATCH_KEYS = ("input_ids", "labels", "position_ids", "doc_ids")


def context_only(token_id):
    """How a token that is input but no loss target is stored in the corpus: -(id + 1), never a valid id.
    Its own inverse, so the same call decodes it (ints or arrays)."""
    return -token_id - 1


class PackedSequences(torch.utils.data.Dataset):
    def __init__(self, tokens: np.ndarray, plan: PackPlan, pad_id: int):
        self.tokens, self.plan, self.pad_id = tokens, plan, pad_id

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> dict:
        p = self.plan
        lo, hi = int(p.seq_ptr[i]), int(p.seq_ptr[i + 1])
        pieces = [self.tokens[s:s + n] for s, n in zip(p.seg_start[lo:hi].tolist(), p.seg_len[lo:hi].tolist())]
        return packed_item(pieces, p.seq_len, self.pad_id)


def packed_item(pieces: list[np.ndarray], L: int, pad_id: int) -> dict:
    """One packed sequence of exactly L tokens from its documents (or document pieces), in order."""
    lens = np.array([len(x) for x in pieces], dtype=np.int64)
    used = int(lens.sum())
    ids = np.full(L, pad_id, dtype=np.int64)
    ids[:used] = np.concatenate(pieces) if pieces else []
    context = ids < 0
    ids[context] = context_only(ids[context])
    seg_begin = np.cumsum(lens) - lens
    if used < L:  # padding is one more document so that no real token ever sees it
        lens = np.append(lens, L - used)
        seg_begin = np.append(seg_begin, used)
    doc = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(L) - np.repeat(seg_begin, lens)
    labels = np.empty(L, dtype=np.int64)
    labels[:-1] = ids[1:]
    labels[:-1][context[1:]] = IGNORE_INDEX
    labels[seg_begin + lens - 1] = IGNORE_INDEX
    labels[used:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc}


def collate(items: list[dict]) -> dict:
    return {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in BATCH_KEYS}
