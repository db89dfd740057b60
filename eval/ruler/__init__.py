"""RULER-style long-context evaluation (Hsieh et al. 2024, arXiv:2404.06654), fully offline:
tasks.py (definitions, sample rendering), words.py (word lists, haystack prose), fit.py (exact length
targeting), generate.py (greedy batched generation, chunked prefill), score.py (metrics, summaries),
report.py (table, files, plots, wandb), run.py (the command's run; its options: eval/cli.py)."""
