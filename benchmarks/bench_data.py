"""Packing quality and speed on the embedded corpus (the stdlib, tiny recipe's BPE tokenizer).

For each sequence length: padding fraction, fraction of documents cut, and throughput (tokens/s,
one core) of packing + collating every sequence, for best-fit-decreasing, concatenate-and-chunk,
and transformers' DataCollatorWithFlattening (which collates a given batch and does not pack: it is
fed greedy runs of documents of about L tokens, so only its collation speed is comparable).
`stream best_fit` is the streaming packer (data.streaming=true: OnlinePacker with 64 open sequences)
fed the documents one at a time in corpus order; its padding counts the sequences it emitted, as in
an endless stream (the few still open at the corpus' end are not flushed).

    python -m benchmarks.bench_data            # writes benchmarks/results/bench_data.json
Targets: best-fit padding < 0.5%, documents cut <= 1/10 of concat's, >= 20M tokens/s.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.common import print_table, write_results
from longstride.data.batch import PackedSequences, collate, packed_item
from longstride.data.config import DataConfig, SourceConfig
from longstride.data.corpus import build_corpus, build_tokenizer
from longstride.data.packing import OnlinePacker, pack


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def pack_and_collate(starts, lens, tokens, L, method, pad_id):
    plan, stats = pack(starts, lens, L, method)
    ds = PackedSequences(tokens, plan, pad_id)
    for i in range(len(ds)):
        collate([ds[i]])
    return stats


def stream_pack_and_collate(docs, L, pad_id, open_seqs=64) -> dict:
    packer = OnlinePacker(L, "best_fit", open_seqs)
    for d in docs:
        packer.add(d)
        while packer.ready:
            collate([packed_item(packer.ready.pop(0), L, pad_id)])
    return packer.stats()


def flattening(docs: list[np.ndarray], L: int) -> int:
    from transformers import DataCollatorWithFlattening

    coll = DataCollatorWithFlattening(return_position_ids=True)
    batch, used, n = [], 0, 0
    for d in docs:
        if used + len(d) > L and batch:
            n += coll(batch)["input_ids"].numel()
            batch, used = [], 0
        batch.append({"input_ids": d[:L].tolist()})
        used += min(len(d), L)
    return n


def main(lengths=(4096, 32768, 65536)) -> list[dict]:
    torch.set_num_threads(1)
    cfg = DataConfig(sources={"stdlib": SourceConfig(kind="stdlib")})
    tok = build_tokenizer(cfg, ".cache/longstride")
    corpus = build_corpus(cfg, tok, ".cache/longstride")
    starts, lens, tokens = corpus.doc_start, corpus.doc_len, corpus.tokens
    n_tok = int(lens.sum())
    print(f"corpus: {len(lens)} documents, {n_tok} tokens (median {int(np.median(lens))}, max {int(lens.max())})")
    rows = []
    for L in lengths:
        for method in ("best_fit", "concat"):
            t, stats = timed(lambda: pack_and_collate(starts, lens, tokens, L, method, tok.pad_token_id))
            rows.append({"seq_len": L, "method": method, "padding_%": 100 * stats["padding_fraction"],
                         "docs_cut_%": 100 * stats["docs_cut_fraction"], "docs_per_seq": stats["docs_per_sequence"],
                         "Mtok_per_s": n_tok / t / 1e6})
        docs = [tokens[s:s + n] for s, n in zip(starts.tolist(), lens.tolist())]
        t, stats = timed(lambda: stream_pack_and_collate(docs, L, tok.pad_token_id))
        rows.append({"seq_len": L, "method": "stream best_fit (64 open)", "padding_%": 100 * stats["padding_fraction"],
                     "docs_cut_%": 100 * stats["docs_cut_fraction"], "docs_per_seq": stats["docs_per_sequence"],
                     "Mtok_per_s": stats["sequences"] * L * (1 - stats["padding_fraction"]) / t / 1e6})
        t, n = timed(lambda: flattening(docs, L), repeats=1)
        rows.append({"seq_len": L, "method": "hf_flattening (collate only)", "padding_%": 0.0,
                     "docs_cut_%": 100 * float((lens > L).mean()), "docs_per_seq": float("nan"),
                     "Mtok_per_s": n / t / 1e6})
    print_table(rows, ["seq_len", "method", "padding_%", "docs_cut_%", "docs_per_seq", "Mtok_per_s"])
    for L in lengths:
        bf = next(r for r in rows if r["seq_len"] == L and r["method"] == "best_fit")
        cc = next(r for r in rows if r["seq_len"] == L and r["method"] == "concat")
        print(f"L={L}: best-fit cuts {bf['docs_cut_%'] / max(cc['docs_cut_%'], 1e-9):.2f}x the documents concat cuts; "
              f"padding {bf['padding_%']:.3f}%; {bf['Mtok_per_s']:.1f}M tokens/s")
    print("results:", write_results("bench_data", rows, {"corpus_tokens": n_tok, "corpus_docs": len(lens)}))
    return rows


if __name__ == "__main__":
    main(tuple(int(x) for x in sys.argv[1:]) or (4096, 32768, 65536))
