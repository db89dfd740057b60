"""What one attention layer computes beyond causal attention within documents: a sliding window, chunked
attention, soft-capped scores, attention sinks. Read from the layer itself (the arguments transformers passes and
the model's config), applied by every kernel and CP method (parallel/kernels.py, parallel/ring.py, parallel/window.py).

    window  key k is visible to query q (same document, k <= q) only when q - k < window: transformers'
            sliding_window (Mistral, Qwen2, Gemma 3 local layers, OLMo 3, GPT-OSS)
    chunk   each document is cut into chunks of `chunk` tokens from its own start and a query sees only its
            own chunk: Llama 4's chunked layers (attention_chunk_size). Counted from each document's start,
            as if the document were alone in its sequence (its RoPE positions restart there too); with one
            document per row that is transformers' own chunking
    softcap each score s (scale * q.k) becomes softcap * tanh(s / softcap) before the softmax: Gemma 2's
            attn_logit_softcapping. It changes the scores, not which keys a query sees; the math kernel and
            flash-attn apply it (parallel/kernels.py resolve_kernel picks one of them)
    sinks   per query head, a logit that joins every softmax with a zero value (GPT-OSS `s_aux`): the output
            is scaled by sigmoid(lse - sink), folded in through the log-sum-exp after every block is merged

Chunks are a refinement of the documents (each (document, chunk) pair its own run), so every kernel and the
ring's block geometry compute them unchanged. Windows need banded blocks (parallel/dense.py) and, under a
ring, a halo exchange instead of the ring (parallel/window.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from longstride.parallel.blocks import run_starts

# layer types (config.layer_types) whose attention longstride computes
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class Pattern:
    window: Optional[int] = None
    chunk: Optional[int] = None
    softcap: Optional[float] = None

    def __post_init__(self):
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"attention {name}={value} must be a positive number of tokens (or None)")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap={self.softcap} must be a positive number (or None)")

    @property
    def causal(self) -> bool:
        """Every query sees its whole document up to itself (no window, no chunk; a soft-cap may apply)."""
        return self.window is None and self.chunk is None

    def within(self, length: int) -> "Pattern":
        """The same pattern on sequences of `length` tokens: a window or chunk that long cuts nothing."""
        cut = lambda x: x if x is not None and x < length else None  # noqa: E731
        return Pattern(cut(self.window), cut(self.chunk), self.softcap)


CAUSAL = Pattern()


def layer_types(cfg, n: Optional[int] = None) -> list[str]:
    """Each of the n (default: the config's) decoder layers' type, from a text config: config.layer_types, or
    for a config without them (Mistral) one window on every layer (sliding_attention) or none (full_attention)."""
    n = (getattr(cfg, "num_hidden_layers", 0) or 0) if n is None else n
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) == n:
        return types
    return ["sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * n


def model_patterns(model) -> tuple:
    """((Pattern, number of layers), ...) of a transformers model's decoder layers, from its config: what the
    CP balancer weighs (parallel/balance.py)."""
    return config_patterns(model.config)


def config_patterns(config) -> tuple:
    """model_patterns from a model's config alone (no weights: `longstride check` reads it before building)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    counts: dict = {}
    for t in layer_types(cfg):
        p = Pattern(window if t == "sliding_attention" else None,
                    getattr(cfg, "attention_chunk_size", None) if t == "chunked_attention" else None,
                    config_softcap(cfg))
        counts[p] = counts.get(p, 0) + 1
    return tuple(counts.items())


# Text configs that carry attn_logit_softcapping but whose attention never applies it (transformers' Gemma 3 keeps
# the field and passes no softcap to its attention call): a value set there caps nothing
SOFTCAP_UNUSED = {"gemma3_text"}


def config_softcap(cfg) -> Optional[float]:
    """The attention scores' soft-cap of a text config (Gemma 2's attn_logit_softcapping), or None (also where the
    model's attention ignores the field: SOFTCAP_UNUSED)."""
    if getattr(cfg, "model_type", None) in SOFTCAP_UNUSED:
        return None
    return float(getattr(cfg, "attn_logit_softcapping", None) or 0) or None


ABSENT = object()  # a keyword the attention call did not pass (an explicit None is a full-attention layer)


def layer_pattern(module, sliding_window=ABSENT, softcap=None) -> Pattern:
    """The pattern of one attention module of a transformers model: the window it passes at call time (when it
    passes none, its own `sliding_window`: Qwen2-MoE), its layer type's chunking (Llama 4:
    config.layer_types[i] == "chunked_attention" with config.attention_chunk_size) and the soft-cap it passes
    (Gemma 2). An explicit sliding_window=None is a full layer, whatever the module keeps (EXAONE 4 keeps the
    window on every layer and passes None on its full ones)."""
    window = getattr(module, "sliding_window", None) if sliding_window is ABSENT else sliding_window
    chunk = None
    cfg, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(cfg, "layer_types", None)
    if types and idx is not None and idx < len(types) and types[idx] == "chunked_attention":
        chunk = getattr(cfg, "attention_chunk_size", None)
        if not chunk:
            raise ValueError(f"{type(module).__name__} layer {idx} is a chunked_attention layer but "
                             "config.attention_chunk_size is not set; set it or change config.layer_types")
    return Pattern(int(window) if window else None, int(chunk) if chunk else None,
                   float(softcap) if softcap else None)


def chunk_bounds(bounds, chunk: Optional[int]):
    """Per row, (start, end) of each document run -> of each (document, chunk) run."""
    if chunk is None:
        return bounds
    return [tuple((a, min(a + chunk, e)) for s, e in row for a in range(s, e, chunk)) for row in bounds]


def chunk_docs(docs: Optional[np.ndarray], chunk: Optional[int], shape: tuple) -> Optional[np.ndarray]:
    """(B, L) document ids (None: one document per row) -> ids of (document, chunk) runs, each its own id."""
    if chunk is None:
        return docs
    docs = np.zeros(shape, dtype=np.int64) if docs is None else docs
    out = np.empty(shape, dtype=np.int64)
    for b, row in enumerate(docs):
        new = np.r_[True, row[1:] != row[:-1]] | ((np.arange(shape[1]) - doc_starts(row)) % chunk == 0)
        out[b] = np.cumsum(new) - 1
    return out


def doc_starts(row: np.ndarray) -> np.ndarray:
    """row: (L,) document ids -> each token's document start."""
    starts = run_starts(row)
    return starts[np.searchsorted(starts, np.arange(len(row)), side="right") - 1]


# ---- attention sinks: one more "block" of the merge, a zero value with logit sinks[h] ----

def has_sinks(module: torch.nn.Module) -> bool:
    """Whether an attention module learns sinks (GPT-OSS keeps them as `sinks` and passes them as s_aux)."""
    return isinstance(getattr(module, "sinks", None), torch.nn.Parameter)


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor]):
    """out: (B, H, L, D) merged output, lse: (B, H, L) fp32, sinks: (H,) -> (out, lse) of the softmax that also
    holds each head's sink. The backward of every kernel, handed these, gives exact dQ/dK/dV (the sink's value
    is zero, so it adds nothing to dO . O's other terms)."""
    if sinks is None:
        return out, lse
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new = torch.logaddexp(lse, sink)
    return (out * torch.exp(lse - new).unsqueeze(-1).to(out.dtype)), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor]):
    """d loss / d sinks from the folded out and lse: -sum over queries of P(sink) * (dO . O), per head."""
    if sinks is None:
        return None
    p = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)  # (B, H, L)
    dot = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return (-(p * dot).sum((0, 2))).to(sinks.dtype)
