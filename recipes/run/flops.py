"""Model FLOPs of a training step, for the loop's `tflops` and `mfu` metrics (and benchmarks/gpu_bench.py's).

Counted as the model's work, whatever the step recomputes (activation checkpointing) or skips: forward and
backward are 3x the forward; the forward is 2 FLOPs per weight of every linear layer per token (the LM head
included, the embedding lookup not), plus attention's QK^T and PV, 4 x heads x head_dim FLOPs per (query, key)
pair that the document mask and each layer's pattern let a query see (parallel/balance.token_work: a windowed
layer counts min(position + 1, window) keys, a chunked one its chunk's). Every position of the batch counts,
padding included (as tokens_per_s does). Mixture-of-experts models are not counted (each token runs only some
experts' weights): their steps log no tflops. A vision tower beside the text layers is not counted.

This counts less than torchtitan's or Megatron-LM's estimates on packed data, which count attention over the whole
sequence (every position attending every earlier one): here only the pairs a document mask keeps, so a packed
batch's TFLOP/s reads lower than theirs for the same step time. Padding positions count as a document of their own.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from transformers.pytorch_utils import Conv1D

from longstride.model.loss import text_decoder
from longstride.parallel.balance import token_work
from longstride.parallel.pattern import config_patterns

# dense bf16 tensor-core peak per GPU, FLOP/s (vendor datasheets), by a part of torch.cuda.get_device_name
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12, "H200": 989e12,
             "A100": 312e12}  # the first name found in the device's wins: the NVL and PCIe parts before the rest
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
LINEAR = (torch.nn.Linear, Conv1D)  # GPT-2's projections are transformers' Conv1D, a linear layer stored transposed


def peak_flops(device: torch.device) -> Optional[float]:
    """This GPU's dense bf16 peak, or None (a CPU, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def train_flops(linear_weights: int, attention_width: int, tokens: int, layer_pairs: int) -> float:
    """One training step's model FLOPs: `tokens` positions through `linear_weights` weights of linear layers, and
    `layer_pairs` (query, key) pairs summed over the layers, each 4 x attention_width (heads x head_dim) FLOPs."""
    return 3.0 * (2 * linear_weights * tokens + 4 * attention_width * layer_pairs)


class StepFlops:
    """A model's FLOPs per step, from its linear layers, its config's attention shape and layer patterns, and each
    batch's documents."""

    def __init__(self, lm: torch.nn.Module, peak: Optional[float] = None):
        self.peak = peak  # FLOP/s the device could do (peak_flops), for mfu; None: no mfu
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        self.moe = next((a for a in EXPERTS if (getattr(cfg, a, 0) or 0) > 1), None)
        head = lm.get_output_embeddings()  # the text layers and the LM head: not a vision tower beside them
        self.linear = sum(m.weight.numel() for m in text_decoder(lm).modules() if isinstance(m, LINEAR)) + \
            (head.weight.numel() if isinstance(head, LINEAR) else 0)
        heads = cfg.num_attention_heads
        self.width = heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.patterns = config_patterns(cfg)

    @property
    def counted(self) -> bool:
        return self.moe is None

    def pairs(self, doc_ids: torch.Tensor, masked: bool = True) -> int:
        """(query, key) pairs over the layers of one batch's rows (B, L) of document ids; masked=False
        (data.doc_masking=false): each row attends causally as one document."""
        docs = np.asarray(doc_ids.cpu())
        return int(token_work(docs if masked else np.zeros_like(docs), self.patterns).sum())

    def step(self, tokens: int, layer_pairs: int) -> float:
        return train_flops(self.linear, self.width, tokens, layer_pairs)
