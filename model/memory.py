"""Memory accounting: a per-stage estimate printed before training, with a warning when the stage
will not fit, and the device memory it is compared with.

The estimate, per rank, in bytes:
  parameters 4 P, gradients 4 P, AdamW state 8 P (fp32 master weights; divided by the FSDP world)
  activations per token: b bytes per element of a matmul's output (4 fp32, 2 bf16), r of the residual stream and
  the norms (b; 4 under bf16 autocast over fp32 weights), q = Hq d, qkv = (Hq + 2 Hkv) d; for one layer (LayerParts,
  read from the model's first decoder layer):
    one layer, not checkpointed  attention: b (qkv + q) + 4 Hq (post-RoPE q/k, v, its output, fp32 lse), plus
                                 b (q + Hkv d) where v is a view of one fused q/k/v output (NeoX, Phi-3);
                                 each norm on the hidden stream: what it keeps (lean RMSNorm r H + 4, LayerNorm
                                 r H + 8, an RMSNorm of another form, such as Gemma's, 8 H + 4 in fp32) and its
                                 output as its readers keep it: r H, or under autocast b H per projection that
                                 reads it (each casts its own copy; an upper bound for a post-norm);
                                 q/k norms (Qwen3, OLMo 2, Gemma 3) likewise on q and k, 4 bytes per row;
                                 the MLP: b 4 I gated (gate, up, activation, product), b 2 I otherwise, a
                                 mixture of experts per expert a token goes to (_mlp_keeps);
                                 tiled (model/tiling.py): no MLP term, the tiles keep their input (r H), and in
                                 a pre-norm layer (its norms folded in) r 2 H for the norms (input, residual)
    none                         every layer's set
    full checkpointing           r H per layer (its input), plus one layer's set while it is recomputed
    selective                    r H per layer (its input) and the outputs of its matmuls, b each (selective_keeps:
                                 q/k/v, the output projection, the MLP's or experts' projections), attention's
                                 output and lse (b q + 4 Hq), under plain Ulysses its head-layout q and K/V too
                                 (ulysses_keeps), plus one layer's set (an upper bound: the outputs kept are in it)
    plain Ulysses                a layer's set also holds its replicated K/V heads (ulysses_replicas)
    the first k layers only      k checkpointed layers as above and n - k whole sets (whose backward frees them
    (checkpoint_layers)          before the first recompute: no extra set while k < n)
    with offload (CUDA)          the layer inputs (r H per layer) live in host memory instead; the device
                                 holds two of them (the one in use and the one being prefetched)
    at the peak, in one layer's attention backward: the gradients r H + b (q + qkv) (residual stream,
    attention output, q/k/v), and RoPE's cos/sin, r 2 d, read by every layer
  autocast's bf16 copies of the weights: 2 P (its cache holds every layer's until the forward ends, checkpointed or not)
  loss: min(L, tile) x V x 4 x 3 bytes (fp32 logits, their softmax and gradient, one tile at a time)
  MLP tile working set: tile x I x b x 4
The per-layer terms count what autograd keeps, in the style of Korthikanti et al. (2022), for attention that never
materialises L x L scores; tests/test_memory_estimate.py holds them against what the layers of nine architectures
keep, and benchmarks/bench_memory.py measures the real figures (benchmarks/README.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from longstride.model.loss import decoder_layers
from longstride.model.offload import pinned_bytes
from longstride.model.rmsnorm import computes_rms_norm
from longstride.model.tiling import pre_norm


def kv_heads(config) -> int:
    """Key/value heads: num_key_value_heads, or the query heads where a config has none (GPT-NeoX, GPT-2)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


@dataclass(frozen=True)
class LayerParts:
    """The parts of a decoder layer whose activations the estimate counts; the default is the Llama form."""

    pre_norm: bool = True        # tiles fold the norms in (model/tiling.PRE_NORM_LAYERS)
    norms: tuple = ("lean", "lean")  # each norm on the hidden stream: lean | layer | other
    qk_norm: str = ""            # "" none | head (one row per head: Qwen3, Gemma 3) | whole (OLMo 2)
    qk_norm_kind: str = "lean"
    gated_mlp: bool = True
    fused_qkv: bool = False
    mlp_inputs: int = 2          # projections reading the MLP's input: gate and up, or one (fused, or a plain MLP)
    experts_per_token: int = 0   # a mixture of experts: the experts each token goes to (0: a dense MLP)
    experts: int = 0             # ... and how many there are (the router's logits)
    shared_expert: bool = False  # ... with a dense expert every token goes through (Qwen2-MoE, Llama 4)
    act_kept: int = 0            # I-wide tensors the activation keeps beyond its input (Python GELUs: ACT_KEPT)


ATTENTION = ("self_attn", "attention", "self_attention", "attn")
MLP = ("mlp", "feed_forward", "block_sparse_moe")
FUSED_QKV = ("query_key_value", "qkv_proj", "c_attn", "Wqkv")
# activations written as several tensor ops keep intermediates: NewGELU measured (Phi-2: 3 I-wide tensors), FastGELU
# and QuickGELU counted from their expressions; torch's own gelu/silu keep their input only
ACT_KEPT = {"NewGELUActivation": 3, "FastGELUActivation": 4, "QuickGELUActivation": 1}


def _norm_kind(module: torch.nn.Module, lean: bool) -> str:
    if isinstance(module, torch.nn.LayerNorm):
        return "layer"
    return "lean" if lean and computes_rms_norm(module) else "other"


def _child(module: torch.nn.Module, names: tuple) -> torch.nn.Module | None:
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), torch.nn.Module)), None)


def layer_parts(model: torch.nn.Module, lean_norms: bool) -> LayerParts:
    """The LayerParts of a transformers causal LM's first decoder layer; lean_norms: the lean RMSNorm is on. A part it
    does not find counts as the Llama form's (a gated MLP, unfused q/k/v)."""
    layer, config = decoder_layers(model)[0], model.config
    attn, mlp = _child(layer, ATTENTION), _child(layer, MLP)
    norms = tuple(_norm_kind(m, lean_norms) for _, m in layer.named_children() if "norm" in type(m).__name__.lower())
    qn = getattr(attn, "q_norm", None)
    qn_weight = getattr(qn, "weight", None)
    qk = "" if qn is None else ("whole" if qn_weight is not None and qn_weight.numel() != getattr(attn, "head_dim", -1)
                                else "head")
    moe = mlp is not None and hasattr(mlp, "experts")
    act = type(_child(mlp, ("act_fn", "activation_fn", "act"))).__name__ if mlp is not None else ""
    return LayerParts(pre_norm=pre_norm(layer), norms=norms, qk_norm=qk,
                      qk_norm_kind=_norm_kind(qn, lean_norms) if qn is not None else "lean",
                      gated_mlp=mlp is None or moe or any(hasattr(mlp, n) for n in ("gate_proj", "gate_up_proj")),
                      fused_qkv=any(hasattr(attn, n) for n in FUSED_QKV),
                      mlp_inputs=2 if mlp is None or (hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj")) else 1,
                      experts_per_token=(getattr(config, "num_experts_per_tok", None) or 1) if moe else 0,
                      experts=next((getattr(config, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")
                                    if getattr(config, n, None)), 0) if moe else 0,
                      shared_expert=moe and any(hasattr(mlp, n) for n in ("shared_expert", "shared_experts")),
                      act_kept=ACT_KEPT.get(act, 0))


def _norm_keeps(kind: str, width: int, rows: int, b: int) -> int:
    """Bytes per token a norm over `rows` rows of `width` elements in all keeps for backward, its input in b bytes per
    element; an RMSNorm of another form (Gemma's) computes in fp32 and keeps its fp32 input and normalised tensor."""
    return {"lean": b * width + 4 * rows, "layer": b * width + 8 * rows, "other": 8 * width + 4 * rows}[kind]


def _dims(config) -> tuple[int, int, int, int, int]:
    """(H, I, head_dim, query heads, key/value heads) of a transformers config."""
    H, Hq = config.hidden_size, config.num_attention_heads
    I = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * H  # GPT-2: n_inner
    return H, I, getattr(config, "head_dim", None) or H // Hq, Hq, kv_heads(config)


def layer_keeps(config, parts: LayerParts, b: int, tiled: bool, autocast: bool = False) -> int:
    """Bytes per token one decoder layer keeps for backward, not checkpointed (the module docstring's terms); b: bytes
    per element of the matmuls' outputs; autocast: under bf16 autocast over fp32 weights, where the residual stream
    and the norms stay fp32 and every projection keeps its own bf16 copy of its input."""
    H, I, d, Hq, Hkv = _dims(config)
    q, kv = Hq * d, Hkv * d
    r = 4 if autocast else b  # the residual stream's bytes per element
    keep = b * (q + 2 * kv + q) + 4 * Hq + (b * (q + kv) if parts.fused_qkv else 0)
    if parts.qk_norm:
        rows = (Hq, Hkv) if parts.qk_norm == "head" else (1, 1)
        keep += _norm_keeps(parts.qk_norm_kind, q, rows[0], b) + _norm_keeps(parts.qk_norm_kind, kv, rows[1], b)
    if tiled and parts.pre_norm:
        return keep + r * 2 * H  # the layer input and the residual, which the tiles keep
    # each norm's output as what reads it keeps it: the first feeds attention's projections, the others the MLP's
    # (an upper bound for a norm whose output only joins the residual stream)
    readers, one = _norm_readers(parts, tiled), len(parts.norms) == 1
    for i, kind in enumerate(parts.norms):
        cast = autocast and not (tiled and i)  # a tiled MLP keeps the norm's own output
        keep += _norm_keeps(kind, H, 1, r) + (b * readers[min(i, 1)] if cast else r) * H
    keep += r * H if one and tiled and autocast else 0  # the MLP's tiles keep the norm's output beside the copies
    return keep if tiled else keep + _mlp_keeps(config, parts, b, H, I)


def selective_keeps(config, parts: LayerParts, b: int, tiled: bool, ulysses: int = 1) -> int:
    """Bytes per token selective checkpointing's cache keeps for one decoder layer (model/selective.py): the outputs
    of its matmuls outside autograd Functions (the tiles keep nothing there), b each
    (bf16 under autocast): q, k and v (or one fused q/k/v; in tiles in a pre-norm layer), the output projection's H;
    the MLP, untiled: gate and up (or one fused gate_up, or a plain MLP's fc1) and the down projection's H; a mixture
    of experts: the router's logits, per expert a token goes to its gate_up and down outputs, and a shared expert's
    set with its gate; attention's output b Hq d and its fp32 log-sum-exp 4 Hq (on one device and under every CP
    method: attention is one op, parallel/attention_call.py; where CUDA's sdpa kernel falls back to SDPA's math, its
    L x L scores are kept besides, which this does not count); ulysses: the degree of a plain (one-stage) Ulysses
    exchange, whose op also keeps the head-layout q and K/V (ulysses_keeps). Measured op by op on nine architectures
    (tests/test_memory_estimate.py; under each CP method: tests/test_cp_model.py). The layer's input is not in it
    (the residual adds are recomputed): estimate() adds it, as full checkpointing keeps it."""
    H, I, d, Hq, Hkv = _dims(config)
    keep = H + (0 if tiled and parts.pre_norm else (Hq + 2 * Hkv) * d)  # pre-norm tiles hold q/k/v's projections
    keep += Hq * d  # attention's output
    if tiled:
        pass  # the MLP's tiles keep nothing in the cache
    elif parts.experts_per_token:
        expert = getattr(config, "moe_intermediate_size", None) or I
        shared = getattr(config, "shared_expert_intermediate_size", None) or I
        keep += parts.experts + parts.experts_per_token * (2 * expert + H) + (2 * shared + H + 1
                                                                              if parts.shared_expert else 0)
    else:
        keep += (2 * I if parts.gated_mlp else I) + H
    return b * keep + 4 * Hq + ulysses_keeps(config, b, ulysses)


def ulysses_keeps(config, b: int, n: int) -> int:
    """Bytes per local token that plain Ulysses at degree n keeps beyond one device's attention output and lse, under
    selective checkpointing: the head-layout q (Hq d) and the K/V that travelled (2 lcm(Hkv, n) d: each K/V head
    replicated until they divide by n), which its backward reads and its recompute would otherwise exchange again
    (parallel/ulysses.py). UPipe's stages keep nothing more (their backward exchanges q, out and dout again)."""
    _, _, d, Hq, Hkv = _dims(config)
    return b * (Hq + 2 * math.lcm(Hkv, n)) * d if n > 1 else 0


def ulysses_replicas(config, b: int, n: int) -> int:
    """Bytes per local token that plain Ulysses at degree n saves beyond one device's layer where a layer keeps its
    whole set (no checkpointing, full checkpointing's recompute): the replicas of K/V heads that do not divide by n,
    2 (lcm(Hkv, n) - Hkv) d; its head-layout q and K/V otherwise hold the bytes of the local q, k, v they replace."""
    _, _, d, _, Hkv = _dims(config)
    return b * 2 * (math.lcm(Hkv, n) - Hkv) * d if n > 1 else 0


def _norm_readers(parts: LayerParts, tiled: bool) -> list[int]:
    """The projections that read the first norm's output (attention's q/k/v, and the MLP's where one norm feeds both:
    Phi-2, GPT-J, Cohere) and the later norms' (the MLP's; none where its tiles read it inside their Function)."""
    mlp = 0 if tiled else parts.mlp_inputs
    return [(1 if parts.fused_qkv else 3) + (mlp if len(parts.norms) == 1 else 0), mlp]


def _mlp_keeps(config, parts: LayerParts, b: int, H: int, I: int) -> int:
    """Bytes per token an MLP keeps: gated b 4 I (gate, up, activation, product), plain b 2 I, plus what a Python
    activation keeps (ACT_KEPT); a mixture of experts,
    for each expert a token goes to, the expert's gated set on its moe_intermediate_size and 3 b H (the token's copy
    gathered for it, its output, its weighted output), the router's fp32 logits, softmax and weights (16 bytes an
    expert), and a shared expert's gated set."""
    if not parts.experts_per_token:
        return b * ((4 if parts.gated_mlp else 2) + parts.act_kept) * I
    expert = getattr(config, "moe_intermediate_size", None) or I
    shared = getattr(config, "shared_expert_intermediate_size", None) or I
    return (parts.experts_per_token * (b * 4 * expert + 3 * b * H) + 16 * parts.experts
            + ((b * 4 * shared + 3 * b * H) if parts.shared_expert else 0))


def precision(bf16: bool, fsdp: bool) -> dict:
    """estimate's act_bytes and autocast for a run: bf16 is autocast over fp32 weights (one process, DDP) or, under
    FSDP2, its bf16 weights."""
    return {"act_bytes": 2 if bf16 else 4, "autocast": bf16 and not fsdp}


def estimate(config, num_params: int, tokens: int, ac: str, mlp_tile: int, loss_tile: int, shard: int = 1,
             act_bytes: int = 4, offload: bool = False, parts: LayerParts = LayerParts(),
             autocast: bool = False, ac_layers: Optional[int] = None, ulysses: int = 1) -> dict:
    """GiB per rank for a stage: tokens = micro_batch_size x seq_len / cp on this rank; parts: the model's
    layer_parts (the Llama form by default); act_bytes: 2 under bf16, with autocast: True where bf16 autocast runs
    over fp32 weights (one process, or DDP), False where the weights themselves are bf16 (FSDP2's mixed precision);
    ac_layers: how many layers `ac` checkpoints (model.checkpoint_layers; None: all), the others keeping their whole
    set as without checkpointing; ulysses: the degree of a plain Ulysses exchange (CPDegrees.plain_ulysses; 1: none),
    which selective checkpointing keeps (ulysses_keeps) and whose replicated K/V a whole layer keeps
    (ulysses_replicas)."""
    H, I, d, Hq, Hkv = _dims(config)
    n, q, qkv = config.num_hidden_layers, Hq * d, (Hq + 2 * Hkv) * d
    r = 4 if autocast else act_bytes  # the residual stream's bytes per element
    layer = (layer_keeps(config, parts, act_bytes, tiled=bool(mlp_tile), autocast=autocast)  # per token
             + ulysses_replicas(config, act_bytes, ulysses))
    peak = r * H + act_bytes * (q + qkv) + r * 2 * d  # gradients in one layer's backward, cos/sin
    # full and selective keep each layer's input; selective also its matmuls' outputs
    per_layer = layer if ac == "none" else r * H + (selective_keeps(config, parts, act_bytes, tiled=bool(mlp_tile),
                                                                    ulysses=ulysses) if ac == "selective" else 0)
    k = n if ac == "none" or ac_layers is None else ac_layers  # the layers keeping per_layer; the rest keep `layer`
    layers = k * per_layer + (n - k) * layer  # what every layer keeps at the forward's end
    # backward runs the whole (last) layers' first, freeing them, then recomputes one checkpointed layer at a time
    kept = layers + (layer if ac != "none" and k == n else 0) + peak
    host = 0  # bytes
    if offload and ac != "none":  # the layer inputs, in pinned host memory (in the allocator's power-of-two blocks)
        host = k * pinned_bytes(int(r * H * tokens))
        kept += 2 * r * H - k * r * H
    gib = 2 ** 30
    out = {
        "parameters": 4 * num_params / shard / gib,
        "gradients": 4 * num_params / shard / gib,
        "optimizer": 8 * num_params / shard / gib,
        "activations": kept * tokens / gib,
        # autocast's bf16 copies of the weights: its cache holds every layer's until the forward ends, checkpointed
        # or not
        "weight_casts": (2 * num_params / gib) if autocast else 0.0,
        "loss": min(tokens, loss_tile) * config.vocab_size * 4 * 3 / gib,
        "mlp_tiles": (mlp_tile * I * act_bytes * 4 / gib) if mlp_tile else 0.0,
        "activation_bytes_per_token": kept,
        "layer_bytes_per_token": per_layer,  # what each (checkpointed) layer keeps from its forward for backward
        "layers_bytes_per_token": layers,  # all the layers together (checkpointed and whole)
        "host_activations": host / gib,
    }
    out["total"] = sum(v for k, v in out.items() if k not in ("activation_bytes_per_token", "layer_bytes_per_token",
                                                              "layers_bytes_per_token", "host_activations"))
    return out


def device_memory_gib(device: torch.device, local_ranks: int = 1) -> tuple[float, str]:
    """(GiB this rank may use, where the figure comes from); on CPU the available host memory shared by
    `local_ranks` processes of this machine."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total / 2 ** 30, "CUDA total"
    import psutil  # an accelerate dependency

    return psutil.virtual_memory().available / local_ranks / 2 ** 30, f"CPU available / {local_ranks} local ranks"
