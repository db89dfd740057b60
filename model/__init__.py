"""Building transformers models for long-context training: config, RoPE base, NoPE layers, YaRN, loss."""
