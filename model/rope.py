"""Where a stage's RoPE changes go: the RoPE base bump and YaRN, written into a transformers config.

Most models keep one `rope_parameters` dict for every layer (Llama, Qwen3, SmolLM3, whose NoPE layers skip it;
Llama 4, whose global full_attention layers are NoPE, so only its chunked RoPE layers read it). Others keep one
entry per layer type, `rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}` (Gemma 3: local
layers at base 10K, global ones at 1M; OLMo 3: YaRN on its full-attention layers only, which transformers writes
there from a legacy `rope_scaling`). On those, a bump or YaRN goes to the layer types that `model.rope_layer_types`
names, by default `full_attention` alone: Gemma 3 (arXiv:2503.19786) raises only its global layers'
base and OLMo 3 extends only its full-attention layers with YaRN, leaving the local layers' short windows as
trained. The entries are written through the config's own `rope_parameters`, so a saved stage loads and runs the
same with plain `AutoModelForCausalLM.from_pretrained`.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from transformers import PretrainedConfig

FIELD = "model.rope_layer_types"
DEFAULT_TYPES = ["full_attention"]  # what rope_layer_types=None means on a model with RoPE per layer type


def per_type_keys(config: PretrainedConfig) -> list[str]:
    """The layer types whose RoPE `config` keeps apart (Gemma 3, OLMo 3: full_attention, sliding_attention);
    [] when one `rope_parameters` serves every layer. transformers' own rule: the keys of `rope_parameters`
    that the config declares as layer types (`nested_rope_parameter_keys`, present from 5.x on)."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = getattr(config, "nested_rope_parameter_keys", None)
    if nested is not None:
        return list(nested(params))
    declared = getattr(config, "layer_types", None) or ()
    return [key for key in params if key in declared]


def rope_entries(text) -> list[tuple[Optional[str], dict]]:
    """A text config's RoPE entries: (layer type, its rope_parameters) for a model with RoPE per layer type, else
    [(None, the shared rope_parameters)]; a NoPE type's entry is {}."""
    params, keys = getattr(text, "rope_parameters", None) or {}, per_type_keys(text)
    return [(k, params[k] or {}) for k in keys] if keys else [(None, params)]


def rope_targets(config: PretrainedConfig, layer_types: Optional[list[str]],
                 field: str = FIELD) -> Optional[list[str]]:
    """The `rope_parameters` entries that a bump or YaRN writes: None = the one dict every layer shares; else the
    layer types named by `layer_types` (None: full_attention, DEFAULT_TYPES). A selection the config cannot
    express is a ValueError naming `field`, the config class and the fix."""
    name, keys = type(config).__name__, per_type_keys(config)
    if not has_rope(config):
        raise ValueError(f"{name} keeps no rope_parameters (learned positions, ALiBi, or a fixed rotary_dim RoPE): a "
                         "stage's RoPE base (recipe.stages.*.rope_theta) and YaRN (yarn.factor, model.yarn) cannot be "
                         "written to it; longstride extends models whose RoPE transformers configures there")
    if not keys:
        if layer_types is not None:
            raise ValueError(
                f"{field}={list(layer_types)}: {name} keeps one rope_parameters for every layer that uses RoPE, so a "
                f"per-type RoPE base or YaRN cannot be expressed (it would reach every RoPE layer); set {field}=null")
        return None
    chosen = DEFAULT_TYPES if layer_types is None else list(layer_types)
    how = f"{field}=null means {DEFAULT_TYPES}" if layer_types is None else f"{field}={chosen}"
    if not chosen:
        raise ValueError(f"{field}=[]: name at least one of {name}'s RoPE layer types {keys}, or null for "
                         f"{DEFAULT_TYPES}")
    unknown = [t for t in chosen if t not in keys]
    if unknown:
        raise ValueError(f"{how}, but {name} keeps no RoPE for layer types {unknown}: its rope_parameters are per "
                         f"layer type {keys}; set {field} to some of those, e.g. {field}=[{keys[0]}]")
    nope = [t for t in chosen if config.rope_parameters[t] is None]
    if nope:
        raise ValueError(f"{how}, but {name}'s layer types {nope} have no RoPE (rope_parameters is null: NoPE); "
                         f"set {field} to layer types with RoPE among {[k for k in keys if k not in nope]}")
    return chosen


def _rewrite(config: PretrainedConfig, targets: Optional[list[str]], change: Callable[[dict], None]) -> None:
    """Applies `change` to a copy of the shared rope_parameters dict (targets None) or of each target type's
    entry, and stores the result back: the other types' entries stay as they are."""
    params = config.rope_parameters
    if targets is None:
        shared = dict(params or {"rope_type": "default"})
        change(shared)
        config.rope_parameters = shared
        return
    per_type = {key: (dict(entry) if entry is not None else None) for key, entry in params.items()}
    for layer_type in targets:
        change(per_type[layer_type])
    config.rope_parameters = per_type


TRAINED = "longstride_trained_length"  # the config attribute each stage writes: the length it trained at


def trained_length(config: PretrainedConfig) -> int:
    """The context length a checkpoint was last trained at: what a longstride stage recorded in its config, else
    its max positions. They differ when a stage trains a model at a shorter length than the window its own
    config declares (SmolLM2's 8K, extended at a new RoPE base at 4K): eval's trained-length marks and YaRN's
    original window are the stage's length, not the declared one."""
    text = config.get_text_config(decoder=True)
    return int(getattr(text, TRAINED, None) or text.max_position_embeddings)


def length_dependent(config: PretrainedConfig) -> list[tuple[Optional[str], str, int]]:
    """The RoPE entries whose frequencies transformers picks from each forward's largest position: (layer type, or
    None for the one shared entry; rope_type; the window past which they change). longrope switches to its long
    factors past its original window (Phi-3); dynamic NTK rescales past max positions."""
    text, found = config.get_text_config(decoder=True), []
    for key, entry in rope_entries(text):
        kind = entry.get("rope_type")
        if kind == "longrope":
            window = (entry.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                               0) or text.max_position_embeddings)
        elif kind == "dynamic":
            window = text.max_position_embeddings
        else:
            continue
        found.append((key, kind, int(window or 0)))
    return found


def has_rope(config: PretrainedConfig) -> bool:
    """Whether a config's text model keeps its RoPE in rope_parameters, where a base bump and YaRN are written (not
    GPT-2's learned positions, Bloom's ALiBi, GPT-J's rotary_dim)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return hasattr(text, "rope_parameters")


def max_positions(config: PretrainedConfig) -> int:
    """A config's max positions (a multimodal model's text config's: Gemma 3's top-level config has none), or
    further where its own YaRN reaches further (Qwen3's way to switch YaRN on: x4 over 32768 beside a declared
    40960)."""
    text = config.get_text_config(decoder=True)
    return max([int(text.max_position_embeddings), *(int(e["original_max_position_embeddings"] * e["factor"])
                                                     for e in _yarn_entries(text))])


def yarn_unit(config: PretrainedConfig, trained: int) -> int:
    """What eval's yarn.factor multiplies (its hints divide a length by it): the reach of a checkpoint that is
    already YaRN (apply_yarn stretches it), else the length it was trained at (YaRN runs over that)."""
    return max_positions(config) if _yarn_entries(config.get_text_config(decoder=True)) else trained


def _yarn_entries(text) -> list[dict]:
    return [e for _, e in rope_entries(text)
            if e.get("rope_type") == "yarn" and e.get("original_max_position_embeddings") and e.get("factor")]


def rope_base(config: PretrainedConfig) -> Optional[float]:
    """The RoPE base of a config's full-attention layers (the one entry of a model with one rope_parameters)."""
    params = config.get_text_config(decoder=True).rope_parameters or {}
    if "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return params.get("rope_theta")


def written_base(config: PretrainedConfig, layer_types: Optional[list[str]] = None) -> Optional[float]:
    """The highest RoPE base among the entries that a stage's bump writes (rope_targets), as `config` has them
    before the bump (a base below it lowers that entry); None where it keeps none."""
    text = config.get_text_config(decoder=True)
    if not has_rope(text):
        return None
    targets = rope_targets(text, layer_types)
    entries = [text.rope_parameters or {}] if targets is None else [text.rope_parameters[t] or {} for t in targets]
    bases = [float(e["rope_theta"]) for e in entries if e.get("rope_theta") is not None]
    return max(bases, default=None)


def record_trained_length(config: PretrainedConfig, seq_len: int) -> None:
    """Writes the length a stage trains at into its config (trained_length reads it)."""
    setattr(config.get_text_config(decoder=True), TRAINED, int(seq_len))


def set_rope_base(config: PretrainedConfig, rope_theta: float, seq_len: int,
                  layer_types: Optional[list[str]] = None, field: str = FIELD) -> PretrainedConfig:
    """Write a stage's RoPE base (positive: recipes/config/plan.py checks it) into the layers `layer_types` selects
    (rope_targets) and its context length into a config (in place, returned): the length it trains at
    (trained_length), and max positions raised to it (never lowered below a window the config declares)."""
    text = config.get_text_config(decoder=True)
    targets = rope_targets(text, layer_types, field)
    _rewrite(text, targets, lambda params: params.update(rope_theta=float(rope_theta)))
    text.max_position_embeddings = max(int(seq_len), int(text.max_position_embeddings or 0))
    record_trained_length(config, seq_len)
    return config


def yarn_original_ok(factor: Optional[float], original: Optional[int]) -> bool:
    """Whether a YaRN original window (model.yarn / eval's yarn .original_max_position_embeddings) may be used:
    unset, or at least one token together with a factor (alone it would do nothing)."""
    return original is None or (original >= 1 and bool(factor))


YARN_ORIGINAL_RULE = "null (the trained length), or >= 1 tokens together with {}.factor"


def apply_yarn(config: PretrainedConfig, factor: float, original_max_position_embeddings: Optional[int] = None,
               layer_types: Optional[list[str]] = None, field: str = FIELD, stretch: bool = False,
               yarn_field: str = "model.yarn", default_original: Optional[int] = None) -> PretrainedConfig:
    """Switch the layers `layer_types` selects (rope_targets) to YaRN with `factor` (in place, returned), their RoPE
    base kept. Plain RoPE (rope_type default) becomes YaRN x factor over `original_max_position_embeddings` (None:
    `default_original`, else the length the model was trained at, trained_length). RoPE that is already YaRN
    keeps its own original window: `stretch` (eval's
    yarn.factor: "reach factor x further than the checkpoint") multiplies its factor by `factor`; otherwise (a
    stage's model.yarn: "YaRN x factor", which each stage writes again on the previous stage's checkpoint) its
    factor must already be `factor`. Any other scaling (linear, llama3, longrope,
    dynamic, ...) is refused naming `yarn_field`: YaRN would replace it, not extend it. Max positions become the
    largest original window x factor, never fewer than before."""
    if factor is None or factor <= 1.0:
        raise ValueError(f"{yarn_field}.factor={factor} must be > 1 (for example 2 to go from 64K to 128K)")
    text = config.get_text_config(decoder=True)
    targets = rope_targets(text, layer_types, field)
    entries = {None: text.rope_parameters or {}} if targets is None else {t: text.rope_parameters[t] for t in targets}
    plans = {key: _yarn_plan(type(text).__name__, key, entry, factor, original_max_position_embeddings,
                             default_original or trained_length(config), stretch, yarn_field)
             for key, entry in entries.items()}

    def to_yarn(params: dict, key=None) -> None:
        new_factor, original = plans[key]
        params.pop("attention_factor", None)  # _yarn_plan refused a non-default one: transformers recomputes it
        params.update(rope_type="yarn", factor=float(new_factor), original_max_position_embeddings=original)
        params.setdefault("rope_theta", getattr(text, "default_theta", 10000.0))

    if targets is None:
        _rewrite(text, None, to_yarn)
    else:
        for key in targets:
            _rewrite(text, [key], lambda params, key=key: to_yarn(params, key))
    text.max_position_embeddings = max(int(text.max_position_embeddings),
                                       *(int(original * f) for f, original in plans.values()))
    if getattr(text, "original_max_position_embeddings", None) is not None:
        # transformers standardises rope_parameters again when it builds the model, and a top-level window (Phi-3's,
        # for its longrope) then replaces the one written here: keep the two equal
        originals = sorted({original for _, original in plans.values()})
        if len(originals) > 1:
            raise ValueError(f"{yarn_field}: {type(text).__name__} keeps one original_max_position_embeddings for "
                             f"every layer type, and YaRN here would need {originals}; give "
                             f"{yarn_field}.original_max_position_embeddings")
        text.original_max_position_embeddings = originals[0]
    return config


class YarnRefused(ValueError):
    """A RoPE that YaRN cannot be applied to (scaled otherwise, or yarn with an attention factor of its own):
    `why` without the field and the fix, for a command that offers its own fix."""

    def __init__(self, field: str, why: str, fix: str):
        super().__init__(f"{field}{why}; {fix}")
        self.why = why


def _yarn_plan(name: str, key: Optional[str], entry: dict, factor: float, original: Optional[int], max_positions: int,
               stretch: bool, yarn_field: str) -> tuple[float, int]:
    """(the YaRN factor, the original window) that one rope_parameters entry gets; a ValueError naming `yarn_field`
    where the entry's RoPE is scaled otherwise, or is YaRN in a way that a new factor would misstate."""
    where = f"{name}'s RoPE" + (f" for {key} layers" if key else "")
    kind = entry.get("rope_type") or "default"
    if kind == "default":
        return factor, int(original or max_positions)
    if kind != "yarn":
        raise YarnRefused(
            f"{yarn_field}.factor={factor:g}: ", f"{where} is already scaled (rope_type={kind}, factor "
            f"{entry.get('factor')}), and YaRN would replace that scaling rather than extend it; longstride applies "
            "YaRN to plain RoPE (rope_type default) or extends a RoPE that is already yarn",
            f"drop {yarn_field}.factor")
    old_factor, saved = float(entry.get("factor") or 1.0), int(entry.get("original_max_position_embeddings")
                                                               or max_positions)
    if original and int(original) != saved:
        raise ValueError(f"{yarn_field}.original_max_position_embeddings={original}: {where} is already yarn over "
                         f"{saved} positions, which it keeps; drop {yarn_field}.original_max_position_embeddings")
    default_attention = 0.1 * math.log(old_factor) + 1.0 if old_factor > 1 else 1.0
    attention = entry.get("attention_factor")
    if attention is not None and abs(float(attention) - default_attention) > 1e-4:
        raise YarnRefused(f"{yarn_field}.factor={factor:g}: ", f"{where} is yarn with its own attention_factor "
                          f"{attention} (not YaRN's 0.1 ln(factor) + 1 = {default_attention:.4f}), which cannot be "
                          "carried to a new factor", f"drop {yarn_field}.factor")
    if not stretch and old_factor != factor:
        raise ValueError(f"{yarn_field}.factor={factor:g}: {where} is already yarn x{old_factor:g} over {saved} "
                         f"positions; a stage keeps it (set {yarn_field}.factor={old_factor:g}) or drops "
                         f"{yarn_field}.factor, and eval's yarn.factor stretches it further")
    return (old_factor * factor if stretch else factor), saved


def rope_placement(config: PretrainedConfig, layer_types: Optional[list[str]], field: str = FIELD) -> Optional[str]:
    """For the stage log: which layer types a model with RoPE per layer type had its base and YaRN written to,
    and every type's RoPE now; None for a model with one rope_parameters."""
    text = config.get_text_config(decoder=True)
    targets = rope_targets(text, layer_types, field)
    if targets is None:
        return None
    why = f"{field}=null: the full-attention layers, as Gemma 3 and OLMo 3 extend" if layer_types is None else \
        f"{field}={targets}"
    now = "; ".join(f"{key} {entry.get('rope_type')} base {entry.get('rope_theta')}" if entry else f"{key} NoPE"
                    for key, entry in text.rope_parameters.items())
    return f"{type(text).__name__} keeps RoPE per layer type: base and YaRN written to {targets} only ({why}); {now}"
