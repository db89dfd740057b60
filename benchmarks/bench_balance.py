"""Document-aware load balancing (parallel/balance.py) on real packed batches: how far the slowest CP
rank's attention work is above the mean, zig-zag against the balancer, and what planning costs.

Sequences are best-fit packed from the embedded (stdlib) corpus at 16K, 32K and 64K tokens, as the
recipe packs them, and from the same corpus with long documents upsampled (data.long_docs: documents
of >= L/4 tokens make up 80% of the tokens), as long-context stages do. Work is exact: the causal
within-document (query, key) pairs of each rank's queries, which equals the ring plan's own count.
  imbalance   slowest / mean rank work, median and worst over the sampled sequences; target <= 1.05
  plan_ms     balanced_assignment + this rank's ring_plan for one sequence (median); plan_vs_step: that
              over --step-s, by default the tiny recipe's 4K-stage step here (4.1 s, README main job)

    python -m benchmarks.bench_balance [--seqs 24]      # writes benchmarks/results/bench_balance.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.common import print_table, write_results
from longstride.data.config import DataConfig, LongDocConfig, SourceConfig
from longstride.data.corpus import build_corpus, build_tokenizer, upsample_long
from longstride.data.packing import pack
from longstride.parallel.balance import balanced_assignment, imbalance, rank_work, token_work
from longstride.parallel.blocks import ring_plan
from longstride.parallel.zigzag import zigzag

LENGTHS = (16384, 32768, 65536)
NS = (2, 4, 8, 16)


def packed_docs(corpus, ids: np.ndarray, length: int, count: int, seed: int) -> list[np.ndarray]:
    """Document ids (1, L) of `count` random best-fit packed sequences of the documents `ids`."""
    plan, _ = pack(corpus.doc_start[ids], corpus.doc_len[ids], length, "best_fit")
    pick = np.random.default_rng(seed).choice(len(plan), size=min(count, len(plan)), replace=False)
    out = []
    for i in sorted(pick.tolist()):
        lens = plan.seg_len[plan.seq_ptr[i]:plan.seq_ptr[i + 1]].tolist()
        if sum(lens) < length:
            lens.append(length - sum(lens))  # padding is its own document
        out.append(np.repeat(np.arange(len(lens)), lens)[None])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=24, help="packed sequences sampled per length and mixture")
    ap.add_argument("--step-s", type=float, default=4.1,
                    help="step time to compare planning with (default: the tiny recipe's 4K stage here, s/step)")
    args = ap.parse_args()
    cfg = DataConfig(sources={"stdlib": SourceConfig(kind="stdlib")})
    tok = build_tokenizer(cfg, ".cache/longstride")
    corpus = build_corpus(cfg, tok, ".cache/longstride")
    every = np.arange(len(corpus.doc_len))
    rows = []
    for L in LENGTHS:
        mixtures = {"stdlib": every,
                    "stdlib, long docs upsampled": upsample_long(every, corpus.doc_len,
                                                                 LongDocConfig(min_tokens=L // 4, min_share=0.8), 0)}
        for mname, ids in mixtures.items():
            seqs = packed_docs(corpus, ids, L, args.seqs, seed=L)
            docs_per_seq = statistics.median(int(d.max()) + 1 for d in seqs)
            for n in NS:
                zz, bal, ks, plan_ms = [], [], [], []
                for d in seqs:
                    work = token_work(d)
                    t0 = time.perf_counter()
                    a = balanced_assignment(d, n)
                    ring_plan(torch.from_numpy(d), 1, L, n, 0, a)
                    plan_ms.append(1e3 * (time.perf_counter() - t0))
                    zz.append(imbalance(rank_work(work, zigzag(n))))
                    bal.append(imbalance(rank_work(work, a)))
                    ks.append(a.k)
                rows.append({"length": L, "mixture": mname, "docs_per_seq": docs_per_seq, "N": n,
                             "zigzag_median": statistics.median(zz), "zigzag_worst": max(zz),
                             "docs_median": statistics.median(bal), "docs_worst": max(bal),
                             "chunks_per_rank_median": statistics.median(ks), "plan_ms": statistics.median(plan_ms),
                             "plan_vs_step": statistics.median(plan_ms) / 1e3 / args.step_s})
    print(f"slowest / mean rank attention work on {args.seqs} best-fit packed sequences per row (stdlib corpus)")
    print_table(rows, ["length", "mixture", "docs_per_seq", "N", "zigzag_median", "zigzag_worst", "docs_median",
                       "docs_worst", "chunks_per_rank_median", "plan_ms", "plan_vs_step"])
    worst = max(r["docs_worst"] for r in rows)
    print(f"worst slowest/mean with the balancer: {worst:.4f} (target <= 1.05); zig-zag's worst: "
          f"{max(r['zigzag_worst'] for r in rows):.4f}")
    print("results:", write_results("bench_balance", rows, {"seqs": args.seqs, "step_s": args.step_s,
                                                             "worst_docs": worst}))


if __name__ == "__main__":
    main()
