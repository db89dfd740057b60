"""Memory accounting: a per-stage estimate printed before training, with a warning when the stage
will not fit, and the device memory it is compared with.

The estimate, per rank, in bytes:
  parameters 4 P, gradients 4 P, AdamW state 8 P (fp32 master weights; divided by the FSDP world)
  activations per token, b bytes per element (4 fp32, 2 under bf16 autocast), with q = Hq d and
  qkv = (Hq + 2 Hkv) d:
    one layer, not checkpointed  plain: b (10 H + 2 qkv + 4 I)   (norms, residuals, q/k/v/o, the MLP's
                                 gate/up/activation/product);
                                 tiled (model/tiling.py, a pre-norm layer): b (2 H + qkv + q) + 4 Hq (its
                                 input, the residual, post-RoPE q/k and v, the attention output, fp32 lse)
    none                         every layer's set
    full checkpointing           b H per layer (its input), plus one layer's set while it is recomputed
    selective                    b 10 H per layer (the cheap ops' outputs; an upper bound: with the lean
                                 RMSNorm and tiles their ops recompute), plus one layer's set
    with offload (CUDA)          the layer inputs (b H per layer) live in host memory instead; the device
                                 holds two of them (the one in use and the one being prefetched)
    at the peak, in one layer's attention backward: the gradients b (H + q + qkv) (residual stream,
    attention output, q/k/v), and RoPE's cos/sin, b 2 d, read by every layer
  loss: min(L, tile) x V x 4 x 3 bytes (fp32 logits, their softmax and gradient, one tile at a time)
  MLP tile working set: tile x I x b x 4
The constants follow the usual per-layer accounting (Korthikanti et al., 2022) for attention that
never materialises L x L scores; tests/test_tiling.py pins the tiled layer's set exactly, and
benchmarks/bench_memory.py measures the real figures (benchmarks/README.md).
"""
from __future__ import annotations

import torch


def kv_heads(config) -> int:
    """Key/value heads: num_key_value_heads, or the query heads where a config has none (GPT-NeoX, GPT-2)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def estimate(config, num_params: int, tokens: int, ac: str, mlp_tile: int, loss_tile: int, shard: int = 1,
             act_bytes: int = 4, offload: bool = False) -> dict:
    """GiB per rank for a stage: tokens = micro_batch_size x seq_len / cp on this rank."""
    H, n = config.hidden_size, config.num_hidden_layers
    I = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * H  # GPT-2: n_inner
    d = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q = config.num_attention_heads * d
    qkv = q + 2 * kv_heads(config) * d
    if mlp_tile:  # bytes per token one layer keeps without checkpointing
        layer = act_bytes * (2 * H + qkv + q) + 4 * config.num_attention_heads
    else:
        layer = act_bytes * (10 * H + 2 * qkv + 4 * I)
    peak = act_bytes * (H + q + qkv) + act_bytes * 2 * d  # gradients in one layer's backward, cos/sin
    per_layer = {"none": layer, "full": act_bytes * H, "selective": act_bytes * 10 * H}[ac]
    kept = n * per_layer + (layer if ac != "none" else 0) + peak
    host = 0
    if offload and ac != "none":
        host = n * act_bytes * H  # the layer inputs, in pinned host memory
        kept += 2 * act_bytes * H - host
    gib = 2 ** 30
    out = {
        "parameters": 4 * num_params / shard / gib,
        "gradients": 4 * num_params / shard / gib,
        "optimizer": 8 * num_params / shard / gib,
        "activations": kept * tokens / gib,
        "loss": min(tokens, loss_tile) * config.vocab_size * 4 * 3 / gib,
        "mlp_tiles": (mlp_tile * I * act_bytes * 4 / gib) if mlp_tile else 0.0,
        "activation_bytes_per_token": kept,
        "layer_bytes_per_token": per_layer,  # what each layer keeps from its forward for backward
        "host_activations": host * tokens / gib,
    }
    out["total"] = sum(v for k, v in out.items() if k not in ("activation_bytes_per_token", "layer_bytes_per_token",
                                                              "host_activations"))
    return out


def device_memory_gib(device: torch.device, local_ranks: int = 1) -> tuple[float, str]:
    """(GiB this rank may use, where the figure comes from); on CPU the available host memory shared by
    `local_ranks` processes of this machine."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total / 2 ** 30, "CUDA total"
    import psutil  # an accelerate dependency

    return psutil.virtual_memory().available / local_ranks / 2 ** 30, f"CPU available / {local_ranks} local ranks"
