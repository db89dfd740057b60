"""The per-stage memory estimate: each memory-saving switch lowers the activation bytes per token by
what it removes, and the state terms follow the parameter count and the FSDP world."""
from __future__ import annotations

import torch
from transformers import SmolLM3Config

from longstride.model.memory import device_memory_gib, estimate

CFG = SmolLM3Config(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152)
P = 135_000_000


def per_token(ac, tile):
    return estimate(CFG, P, 8192, ac, tile, 1024)["activation_bytes_per_token"]


def test_switches_lower_activation_memory_by_what_they_remove():
    H, I, n, q, d = 576, 1536, 30, 9 * 64, 64
    qkv = q + 6 * 64
    layer = 4 * (10 * H + 2 * qkv + 4 * I)
    peak = 4 * (H + q + qkv) + 4 * 2 * d
    assert per_token("none", 0) == n * layer + peak
    tiled = 4 * (2 * H + qkv + q) + 4 * 9
    assert per_token("none", 1024) == n * tiled + peak, "a tiled layer keeps no I-wide and no normed activation"
    assert per_token("full", 0) == n * 4 * H + layer + peak, "full: the layer inputs plus one layer recomputed"
    assert per_token("full", 1024) == n * 4 * H + tiled + peak
    assert per_token("full", 0) < per_token("selective", 0) < per_token("none", 0)
    assert per_token("full", 1024) < per_token("none", 1024) < per_token("selective", 1024), \
        "a tiled layer keeps less than selective checkpointing's cheap-op outputs"
    assert per_token("none", 0) / per_token("full", 1024) > 15
    off = estimate(CFG, P, 8192, "full", 1024, 1024, offload=True)
    assert off["activation_bytes_per_token"] == per_token("full", 1024) - (n - 2) * 4 * H, \
        "offload: two layer inputs stay on the device, the rest go to the host"
    assert abs(off["host_activations"] * 2 ** 30 - n * 4 * H * 8192) < 1
    assert estimate(CFG, P, 8192, "none", 1024, 1024, offload=True)["host_activations"] == 0


def test_state_terms_and_sharding():
    one = estimate(CFG, P, 4096, "full", 1024, 1024)
    eight = estimate(CFG, P, 4096, "full", 1024, 1024, shard=8)
    assert abs(one["parameters"] * 2 ** 30 - 4 * P) < 1 and abs(one["optimizer"] - 2 * one["parameters"]) < 1e-9
    assert abs(eight["optimizer"] * 8 - one["optimizer"]) < 1e-9
    assert abs(one["loss"] * 2 ** 30 - 1024 * 49152 * 12) < 1, "one loss tile of fp32 logits at a time"
    assert abs(one["total"] - sum(v for k, v in one.items() if k not in ("total", "activation_bytes_per_token"))) < 1e-9
    gib, where = device_memory_gib(torch.device("cpu"))
    assert gib > 0 and "CPU" in where
