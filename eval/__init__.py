"""Evaluation of checkpoints: perplexity vs context length (eval.ppl), with YaRN at eval time."""
