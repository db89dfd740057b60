"""longstride's attention inside transformers models, through transformers' registries.

`register()` adds the name "longstride" to AttentionInterface and AttentionMaskInterface. The mask
function builds no L x L mask: it returns None, or a note of what the model's own mask would hold beyond plain
causal attention (padding, documents, a window: MaskNote), which the attention checks its call against. The
attention function reads the batch's document layout from the `doc_layout` keyword that the training step passes
to the model forward, which transformers forwards untouched to every attention call, and the layer's own pattern
(sliding window, chunk, sinks: parallel/pattern.py) from the layer and the arguments it passes.

With context parallelism, `parallel.cp.shard_for_cp` cuts a packed batch into this rank's share and
builds the ring plan from the full batch's document ids; the model then sees only local tokens (RoPE
is computed for local positions only) and every attention call runs the stage's CP method
(parallel/cp.py METHODS).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from longstride.model.tiling import autocast_on, forward_tree
from longstride.parallel.cp import DocLayout, method
from longstride.parallel.kernels import SOFTCAP_KERNELS, doc_attention, resolve_kernel
from longstride.parallel.pattern import ABSENT, LAYER_TYPES, Pattern, config_softcap, layer_pattern

NAME = "longstride"


# Attention arguments transformers models pass that change what attention computes and that longstride's kernels
# do not implement: refused when set, never dropped (a T5-style position bias, sparse attention)
UNSUPPORTED_KWARGS = {"position_bias": "an additive position bias",
                      "sinks": "attention sinks under the name sinks (longstride reads GPT-OSS's s_aux)",
                      "block_indices": "block-sparse attention", "indices": "indexed sparse attention",
                      # DataCollatorWithFlattening(return_flash_attn_kwargs=True): documents longstride reads from
                      # doc_layout only (LongstrideCollator); computed as one causal row they would see each other
                      "cu_seq_lens_q": "documents as flash-attention sequence lengths",
                      "cu_seq_lens_k": "documents as flash-attention sequence lengths"}


def unsupported_attention(model: torch.nn.Module, split_longest: int = 0) -> list[str]:
    """What in `model` longstride's attention would not compute: layer types other than full, sliding-window and
    chunked attention (parallel/pattern.py), chunked layers without a chunk size,
    attention modules without a causal mask (config.is_causal=False too), a model that computes attention in its
    own code rather than through transformers' attention interface (dispatches), a value head size other than the
    query's, a mask computed from the values (Doge), attention dropout in a model being trained; and with
    `split_longest` (the longest sequence a stage splits over context-parallel ranks, 0: none), what reads a
    token's position from the tokens one rank holds (position_dependent). Empty for Llama, Qwen3, SmolLM3,
    Mistral, Qwen2, Gemma 2 and 3, OLMo 3, GPT-OSS, Llama 4's text model and the like. A config whose settings vary
    by layer (transformers' per_layer_config, Gemma 4) is refused before anything else is read of it."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    per_layer = sorted(getattr(cfg, "per_layer_attributes", None) or ())  # transformers' heterogeneous configs
    if per_layer:
        return [f"{type(cfg).__name__} sets {', '.join(per_layer)} per layer (config.per_layer_config), which "
                "longstride's attention, memory plan and kernels read as one value for every layer"]
    found = []
    types = list(getattr(cfg, "layer_types", None) or [])
    other = [i for i, t in enumerate(types) if t not in LAYER_TYPES]
    if other:
        found.append(f"config.layer_types: {sorted({types[i] for i in other})} at layers {other[:6]}"
                     + ("..." if len(other) > 6 else ""))
    if "chunked_attention" in types and not getattr(cfg, "attention_chunk_size", None):
        found.append("config.layer_types has chunked_attention layers but config.attention_chunk_size is not set")
    dropped = drops_call_kwargs(model)
    if dropped:
        found.append(f"{dropped} calls its attention without passing on the forward's keyword arguments, so the "
                     "document layout (doc_layout) never reaches longstride's attention: documents would see each "
                     "other, and a context-parallel rank only its own tokens")
    if not dispatches(model):
        found.append(f"{type(model).__name__} computes attention in its own code, not through transformers' attention "
                     "interface, so longstride's attention would never run (each document would see the others, and "
                     "a context-parallel rank only its own tokens)")
    if getattr(cfg, "is_causal", True) is False:
        found.append("config.is_causal=False (bidirectional attention)")
    v_dim = getattr(cfg, "v_head_dim", None)
    qk_dim = getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None)
    if v_dim and qk_dim and v_dim != qk_dim:
        found.append(f"config.v_head_dim={v_dim} differs from the query/key head size {qk_dim} (multi-head latent "
                     "attention: the kernels take one head size)")
    if model.training and getattr(cfg, "attention_dropout", 0.0):
        found.append(f"config.attention_dropout={cfg.attention_dropout} (attention dropout while training; set "
                     "it to 0.0 in the checkpoint's config.json to train without it)")
    for name, mod in model.named_modules():
        attention = name.endswith(("attn", "attention")) or "Attention" in type(mod).__name__
        if attention and getattr(mod, "is_causal", True) is False:  # BERT's sits at ...attention.self
            found.append(f"{name}.is_causal=False (bidirectional attention)")
        if callable(getattr(mod, "prepare_dynamic_mask", None)):  # an additive mask from the values (Doge)
            found.append(f"{name} ({type(mod).__name__}) adds a per-head mask computed from its values (dynamic mask "
                         "attention)")
    return found + (position_dependent(cfg, split_longest) if split_longest else [])


def drops_call_kwargs(model: torch.nn.Module) -> str:
    """The decoder layer class whose forward calls its attention module (self.self_attn / attn / attention) without
    `**kwargs`, read from its source (transformers' StableLM, Nemotron), or "" (also where there is no source)."""
    import ast

    from longstride.model.loss import decoder_layers

    try:
        layer = type(decoder_layers(model)[0])
    except (ValueError, IndexError, AttributeError):
        return ""
    tree = forward_tree(layer)
    if tree is None:
        return ""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in ("self_attn", "attn", "attention") and isinstance(n.func.value, ast.Name)
             and n.func.value.id == "self"]
    passes = any(k.arg is None for c in calls for k in c.keywords)
    return layer.__name__ if calls and not passes else ""


def dispatches(model: torch.nn.Module) -> bool:
    """Whether the model's attention goes through transformers' attention interface (config._attn_implementation),
    where longstride's attention plugs in: already switched to it, or transformers' own test of the model's source
    (Bloom, MPT, GPT-NeoX-Japanese and other older classes compute attention in their own code)."""
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return True
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    return bool(can_set()) if can_set is not None else True


def position_dependent(cfg, split_longest: int) -> list[str]:
    """What a model computes from the largest position, or the count, of the tokens one process holds, where
    context parallelism hands each rank only its share of a `split_longest`-token sequence (so ranks would
    disagree with each other and with one process): longrope RoPE (Phi-3), which picks its long or short
    frequencies from the batch's largest position once sequences pass its original window, and Llama 4's query
    temperature on NoPE layers, which transformers takes from 0..n-1 over the tokens a process holds, from
    floor_scale positions on. Shorter stages compute neither, so they pass. (Dynamic NTK RoPE acts only past the
    model's max positions, which a stage raises to its own length: it never acts in training.)"""
    from longstride.model.rope import length_dependent

    found = []
    for key, kind, window in length_dependent(cfg):
        if kind == "longrope" and split_longest > window:
            found.append(f"config.rope_parameters{f'[{key!r}]' if key else ''} rope_type=longrope picks its "
                         f"frequencies from the batch's largest position, past {window} positions, and a "
                         f"context-parallel rank sees only its own (a {split_longest}-token stage with cp > 1; "
                         f"train stages over {window} tokens with cp=1)")
    tuning, floor = getattr(cfg, "attn_temperature_tuning", False), getattr(cfg, "floor_scale", None)
    if tuning and floor and split_longest >= int(floor):
        found.append(f"config.attn_temperature_tuning={tuning} scales NoPE layers' queries by position from "
                     f"floor_scale={floor} on, counting the tokens a process holds, which under context parallelism "
                     f"are not the sequence's (a {split_longest}-token stage with cp > 1; train stages of "
                     f"{floor} tokens or more with cp=1)")
    return found


def head_shape(config) -> tuple[int, int]:
    """(query heads, head size) of a transformers config; a multimodal config's text model's."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    return heads, int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)


def auto_kernel(model: torch.nn.Module, ring: bool = False) -> str:
    """parallel.kernel=auto's pick for `model` as it is: its parameters' device and dtype (bf16/fp16: the flash
    kernels), its head size and its soft-capped scores (Gemma 2); ring: under ring attention."""
    param = next(model.parameters())
    return resolve_kernel("auto", param.device.type, ring=ring, half=param.dtype in (torch.float16, torch.bfloat16),
                          head_dim=head_shape(model.config)[1],
                          softcap=bool(config_softcap(model.config.get_text_config(decoder=True))))


def check_supported(model: torch.nn.Module, split_longest: int = 0) -> None:
    """Refuses, before compute, a model whose attention longstride would compute wrongly (naming each layer and
    field); causal, windowed, chunked, soft-capped and sink attention pass."""
    found = unsupported_attention(model, split_longest)
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise NotImplementedError(
            f"{type(model).__name__}: longstride's attention computes causal attention within documents (with "
            f"sliding windows, chunks, soft-capped scores and sinks), and this model's attention needs more: {shown}. "
            f"Refused rather than silently dropped. Train it without longstride's attention "
            f"(attn_implementation='sdpa' or 'eager', no context parallelism)")


def longstride_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         doc_layout: Optional[DocLayout] = None, **kwargs):
    # query: (B, H, L, D), key/value: (B, Hkv, L, D) -> ((B, L, H, D), None)
    if dropout:
        raise NotImplementedError(f"attention dropout {dropout} while training (the model's config.attention_dropout): "
                                  "longstride's attention computes none; set attention_dropout to 0.0 in the "
                                  "checkpoint's config.json (or on model.config before training)")
    where = refuse_call(module, query, kwargs, "longstride's attention")
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            f"{where}: {query.shape[2]} query positions against {key.shape[2]} key positions (a forward with a KV "
            "cache: model.generate, or past_key_values/cache). longstride's attention computes whole packed "
            "sequences, for training and evaluation; decode with the model's own attention: "
            "model.set_attn_implementation('sdpa'), or 'eager' for a model without SDPA (Gemma 2, GPT-OSS)")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"{where}: value heads of size {value.shape[-1]} against query heads of size "
                                  f"{query.shape[-1]}; longstride's kernels take one head size")
    layout = doc_layout or DocLayout(None)
    # the keys' whole length: this rank's share times the CP degree (a window at least that long cuts nothing)
    longest = key.shape[2] * (layout.cp.degrees.cp if layout.cp.method else 1)
    pattern = layer_pattern(module, kwargs.get("sliding_window", ABSENT), kwargs.get("softcap")).within(longest)
    check_mask(where, attention_mask, doc_layout, pattern, longest)
    if pattern.softcap and doc_layout is None:  # a plain call (no layout, so no kernel chosen): one that caps
        half = query.dtype in (torch.float16, torch.bfloat16)
        layout = DocLayout(None, cp=replace(layout.cp, kernel=resolve_kernel(
            "auto", query.device.type, half=half, head_dim=query.shape[-1], softcap=True)))
    if pattern.softcap and layout.cp.kernel not in SOFTCAP_KERNELS:
        raise NotImplementedError(f"{where} soft-caps its attention scores (softcap={pattern.softcap}) and "
                                  f"parallel.kernel={layout.cp.kernel} does not; use parallel.kernel=auto (it picks "
                                  "math, or flash_attn on CUDA when installed) or math; with the HF Trainer, "
                                  "setup_cp(..., config=model.config)")
    sinks = kwargs.get("s_aux")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value = _same_dtype(query, key, value)
    if layout.cp.method is None:
        out = doc_attention(query, key, value, layout.doc_ids, scale=scale, kernel=layout.cp.kernel,
                            bounds=layout.bounds, pattern=pattern, sinks=sinks)
    else:
        out = method(layout.cp.method).attention(query, key, value, layout, scale, pattern=pattern, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def refuse_call(module, query, kwargs: dict, who: str) -> str:
    """What one attention call asks for that `who` (an attention function) does not compute, refused naming it:
    bidirectional attention, UNSUPPORTED_KWARGS; its sinks (s_aux) checked against the query heads. Returns the
    call's name for further messages."""
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"{where} asks for bidirectional attention (is_causal=False), which {who} does "
                                  "not implement; refused rather than dropped")
    for key_name, what in UNSUPPORTED_KWARGS.items():
        if kwargs.get(key_name) is not None:
            raise NotImplementedError(f"{where} asks for {what} ({key_name}), which {who} does not implement; "
                                      "refused rather than dropped")
    sinks = kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"{where}: attention sinks (s_aux) of shape {tuple(sinks.shape)}, expected one per query "
                         f"head ({query.shape[1]},)")
    return where


def _same_dtype(q, k, v):
    """Under autocast, transformers hands attention q/k in fp32 (RoPE multiplies them by fp32 cos/sin) and v in
    the autocast dtype; the kernels and the ring's messages need one dtype: autocast's (as SDPA would cast
    to), else the widest of the three. A cast keeps the tensor's (B, L, H, D) memory layout."""
    device = q.device.type
    if autocast_on(device):
        dtype = torch.get_autocast_dtype(device)
    elif q.dtype == k.dtype == v.dtype:
        return q, k, v
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@dataclass(frozen=True)
class MaskNote:
    """In place of transformers' mask, which longstride's attention does not build (documents come as
    `doc_layout`), what that mask would hold beyond plain causal attention: padding (zeros in attention_mask),
    anything else (documents from position_ids restarting at 0, a model's extra mask rules), and the window or
    chunk (`local`) the model's own mask gives the layers it is built for. None stands for a plain causal mask.
    `padding`: padding before a real token (left or inside a row: "padding (zeros in attention_mask)"). `rule`: a
    mask rule of the model's own (sees_later: bidirectional attention, a prefix or image block), which no doc_layout
    describes."""
    padding: bool = False
    beyond_causal: bool = False
    local: Optional[int] = None
    rule: bool = False


def no_mask(*args, attention_mask=None, allow_is_causal_skip: bool = True, local_size: Optional[int] = None, **kwargs):
    """transformers' mask call -> None or a MaskNote. Right padding is not padding here: causal attention computes
    every real token exactly without it (only the padding's own outputs, which nothing reads, differ)."""
    padding = False
    if attention_mask is not None and attention_mask.dim() == 2:
        real = attention_mask.bool()
        padding = bool((~real[:, :-1] & real[:, 1:]).any())  # a padded position before a real one
    note = MaskNote(padding, not allow_is_causal_skip, int(local_size) if local_size else None,
                    sees_later(allow_is_causal_skip=allow_is_causal_skip, **kwargs))
    return None if note == MaskNote() else note


def sees_later(mask_function=None, use_vmap: bool = False, allow_is_causal_skip: bool = True, batch_size: int = 1,
               q_length: int = 0, q_offset: int = 0, kv_length: int = 0, kv_offset: int = 0, device=None, **_) -> bool:
    """Whether the call's mask holds a rule of the model's own beyond causal attention, windows, chunks and packed
    documents: an or/and mask function the model passed to transformers (`use_vmap`: bidirectional attention, Gemma
    3's image blocks on its sliding layers, any narrower rule; not evaluated, since under a context-parallel shard
    transformers looks such a function up by position values past the shard's length), or one of transformers' own
    rules letting a query see a later key (prefix or image blocks from block_sequence_ids). Those are asked for each
    query's next key, (q, q + 1), which a rule opening a run of two or more tokens to each other allows somewhere;
    transformers' functions take index tensors that broadcast. A plain causal call (allow_is_causal_skip) holds
    none."""
    from torch._subclasses.fake_tensor import FakeTensor

    if use_vmap:
        return True
    asked = min(q_length, kv_offset + kv_length - 1 - q_offset)  # queries with a next key among the call's keys
    if mask_function is None or allow_is_causal_skip or asked < 1:
        return False
    q = torch.arange(q_offset, q_offset + asked, device=device)[None, :]
    if q.is_meta or isinstance(q, FakeTensor):  # a memory trace (recipes/memory/trace.py): no values; the run asks
        return False
    rows = torch.arange(batch_size, device=device)[:, None]
    return bool(mask_function(rows, torch.zeros_like(rows), q, q + 1).any())


def check_mask(where: str, mask, doc_layout, pattern: Pattern, longest: int) -> None:
    """The attention call against the mask transformers' eager attention would have used (no_mask's note): refused
    where they differ, never computed one way or the other. Padding, and documents no doc_layout describes, are
    not computed; nor is a layer whose call asks for another window or chunk than its mask holds (a config whose
    layer types and sliding_window disagree; a model whose mask ignores the window its calls pass)."""
    if mask is not None and not isinstance(mask, MaskNote):  # transformers passes a caller's 4D mask on as it is
        raise NotImplementedError(f"{where}: the call carries a mask built outside longstride's mask function (a 4D "
                                  f"attention_mask, {type(mask).__name__}), which longstride's attention would not "
                                  "read; give documents as doc_layout (LongstrideCollator) or run the model's own "
                                  "attention")
    note = mask or MaskNote()
    if note.rule:
        raise NotImplementedError(f"{where}: the model's own mask holds a rule of its own (letting a query see later "
                                  "keys: bidirectional attention, or a prefix or image block that attends both ways; "
                                  "or an or/and mask function the model passes to transformers), which longstride's "
                                  "causal attention does not compute; run the model's own attention")
    if note.padding or (note.beyond_causal and doc_layout is None):
        what = "padding (zeros in attention_mask)" if note.padding else \
            "more than causal attention (packed documents: position_ids restarting at 0; or a model's own mask rule)"
        raise NotImplementedError(f"{where}: the batch's mask holds {what}, and longstride's attention reads documents "
                                  "only from doc_layout; pack the rows with longstride's collator (LongstrideCollator: "
                                  "documents, padding as a trailing document), or run the model's own attention")
    masked, called = Pattern(note.local).within(longest).window, pattern.window or pattern.chunk
    if masked != called:
        raise NotImplementedError(
            f"{where}: its attention call asks for {'a window or chunk of ' + str(called) if called else 'no window'}"
            f" and transformers' own mask for it holds {'one of ' + str(masked) if masked else 'none'} (see "
            "config.sliding_window, config.layer_types, use_sliding_window); refused rather than computing one of "
            "them. Make the config consistent, or run the model's own attention")


# torch.compile (train.compile, model/compile.py) leaves longstride's attention out of its graphs: the function's Python
# picks the kernel, the collectives and the document layout per call (parallel/attention_call.py holds the call for the
# op), which a graph would freeze. Dynamo splits a compiled module around it; nothing changes without compile.
_OUTSIDE_GRAPHS = torch.compiler.disable(longstride_attention)


def register() -> str:
    AttentionInterface.register(NAME, _OUTSIDE_GRAPHS)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME


def use_longstride_attention(model: torch.nn.Module) -> None:
    check_supported(model)
    register()
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:  # transformers only warns when a model cannot switch
        raise NotImplementedError(f"{type(model).__name__} kept attn_implementation="
                                  f"{model.config._attn_implementation!r}: it computes attention in its own code, "
                                  "so longstride's attention would never run; refused rather than ignored")
