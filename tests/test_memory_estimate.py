"""The per-stage memory estimate against what a real model keeps: the bytes each decoder layer's forward
saves for backward, measured with saved-tensor hooks on the tiny model for each memory-saving switch, and on
tiny models of six architectures; and the state terms, which follow the parameter count and the FSDP world."""
from __future__ import annotations

import pytest
import torch
from transformers import SmolLM3Config

from longstride.model.loss import ChunkedLossLM
from longstride.model.memory import LayerParts, device_memory_gib, estimate, layer_parts
from longstride.model.offload import pinned_bytes
from longstride.model.prepare import patch_model
from longstride.parallel.attention import use_longstride_attention
from tests.test_cp_model import L, tiny_model
from tests.test_tiling import saved_per_layer

CFG = SmolLM3Config(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152)
P = 135_000_000


def layer_bytes_per_token(ac: str, tile: int, autocast: bool = False) -> tuple[list[float], object]:
    """Bytes per token each decoder layer's forward hands autograd (parameters and autocast's copies of them
    excluded), and the config."""
    model = tiny_model()
    patch_model(model.lm, ac, offload=False, mlp_tile=tile, lean_norms=True)
    assert not model.lm.model.layers[-1].self_attn.use_rope, "the last tiny layer is NoPE: no cos/sin in its figure"
    return [b / L for b in saved_per_layer(model, autocast=autocast, weights=False)], model.lm.config


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("ac, tile", [("full", 0), ("none", 16), ("none", 0)])
def test_layer_estimate_matches_what_a_layer_keeps(ac, tile, autocast):
    """Checkpointed, tiled and plain layers of the tiny model keep exactly what the estimate says (the layer input;
    the tiled set; the plain set with the lean norms), in fp32 and under bf16 autocast over fp32 weights (an fp32
    residual stream and norms, bf16 matmul outputs, each projection's own bf16 copy of its input)."""
    measured, config = layer_bytes_per_token(ac, tile, autocast)
    est = estimate(config, 1, L, ac, tile, 1024, act_bytes=2 if autocast else 4,
                   autocast=autocast)["layer_bytes_per_token"]
    assert est == measured[-1], (ac, tile, est, measured)


def test_autocast_weight_copies_are_counted():
    """Under autocast every layer keeps bf16 copies of its matmuls' weights; the estimate's weight_casts (2 bytes a
    parameter: autocast's cache holds them all until the forward ends, checkpointed or not) covers them."""
    model = tiny_model()
    casts = sum(saved_per_layer(model, autocast=True)) - sum(saved_per_layer(model, autocast=True, weights=False))
    assert casts == 2 * sum(p.numel() for p in model.lm.model.layers.parameters() if p.ndim == 2), casts
    P = sum(p.numel() for p in model.parameters())
    for ac in ("none", "full", "selective"):
        est = estimate(model.lm.config, P, L, ac, 0, 1024, act_bytes=2, autocast=True)["weight_casts"] * 2 ** 30
        assert casts <= est < 1.2 * casts, (ac, casts, est)
    assert estimate(model.lm.config, P, L, "none", 0, 1024, act_bytes=2)["weight_casts"] == 0, "FSDP2's bf16 weights"


def _arch(name):
    import transformers as T

    # no width equals the batch's L tokens, so that a weight's bf16 copy never passes for an activation
    kw = dict(vocab_size=50, hidden_size=40, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return {"llama": lambda: T.LlamaConfig(num_key_value_heads=2, **kw),
            "qwen3": lambda: T.Qwen3Config(num_key_value_heads=2, head_dim=10, **kw),
            "gpt_neox": lambda: T.GPTNeoXConfig(**kw),
            "gemma3": lambda: T.Gemma3TextConfig(num_key_value_heads=2, head_dim=10, sliding_window=1000, **kw),
            "olmo2": lambda: T.Olmo2Config(num_key_value_heads=2, **kw),
            "phi3": lambda: T.Phi3Config(num_key_value_heads=2, **kw),
            "phi": lambda: T.PhiConfig(**{**kw, "num_attention_heads": 5}),  # an even rotary width
            "mixtral": lambda: T.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **kw),
            "qwen2_moe": lambda: T.Qwen2MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=60, shared_expert_intermediate_size=100, **kw),
            }[name]()


# What sets each architecture apart in the estimate: q/k norms per head (Qwen3), LayerNorm, a fused q/k/v and a
# two-matrix MLP (GPT-NeoX), four norms of Gemma's own form with q/k norms (Gemma 3), post-norms and q/k norms
# over the whole projection (OLMo 2), a fused q/k/v under pre-norms outside PRE_NORM_LAYERS (Phi-3), one norm
# feeding attention and the MLP in parallel with a Python GELU (Phi-2), experts (Mixtral) with a shared one
# (Qwen2-MoE).
PARTS = {"llama": LayerParts(),
         "qwen3": LayerParts(qk_norm="head"),
         "gpt_neox": LayerParts(pre_norm=False, norms=("layer", "layer"), gated_mlp=False, fused_qkv=True,
                                mlp_inputs=1),
         "gemma3": LayerParts(pre_norm=False, norms=("other",) * 4, qk_norm="head", qk_norm_kind="other"),
         "olmo2": LayerParts(pre_norm=False, qk_norm="whole"),
         "phi3": LayerParts(pre_norm=False, fused_qkv=True, mlp_inputs=1),
         "phi": LayerParts(pre_norm=False, norms=("layer",), gated_mlp=False, mlp_inputs=1, act_kept=3),
         "mixtral": LayerParts(pre_norm=False, mlp_inputs=1, experts_per_token=2, experts=4),
         "qwen2_moe": LayerParts(pre_norm=False, mlp_inputs=1, experts_per_token=2, experts=4, shared_expert=True)}
MOE = ("mixtral", "qwen2_moe")


# The experts' routed tensors have no L-token dimension, so under autocast they cannot be told from the weights'
# copies (saved_per_layer): mixtures of experts are held to the estimate in fp32.
CASES = [(arch, tile, autocast) for arch in sorted(PARTS) for tile in (0, 16) for autocast in (False, True)
         if not (autocast and arch in MOE)]


@pytest.mark.parametrize("arch, tile, autocast", CASES)
def test_layer_estimate_follows_the_architecture(arch, tile, autocast):
    """layer_parts reads what sets a model's layers apart, and with it the estimate of one layer's set (plain, or
    tiled: the MLP alone outside PRE_NORM_LAYERS; fp32 or bf16 autocast) is an upper bound within 20% of what every
    layer of a tiny model of that architecture keeps, cos/sin (made once, read by every layer) and autocast's copies
    of the weights left out."""
    import transformers as T

    torch.manual_seed(0)
    config = _arch(arch)
    config._attn_implementation = "eager"
    lm = T.AutoModelForCausalLM.from_config(config).float()
    parts = layer_parts(lm, lean_norms=True)
    assert parts == PARTS[arch], parts
    patch_model(lm, "none", offload=False, mlp_tile=tile, lean_norms=True)
    use_longstride_attention(lm)
    model = ChunkedLossLM(lm, tile=20)
    measured = [b / L for b in saved_per_layer(model, shared=False, autocast=autocast, weights=arch in MOE)]
    est = estimate(lm.config, 1, L, "none", tile, 1024, act_bytes=2 if autocast else 4, parts=parts,
                   autocast=autocast)["layer_bytes_per_token"]
    assert all(m <= est <= 1.2 * m for m in measured), (est, measured)
    if arch in ("llama", "qwen3", "phi3") or (arch == "olmo2" and not autocast):
        assert measured == [est] * len(measured), "lean norms, an unfused or Phi-3 q/k/v: the exact set"


def selective_cache_per_layer(lm, tile: int, autocast: bool, weights: bool) -> list[float]:
    """Bytes per token selective checkpointing's cache holds for each decoder layer after one forward: the outputs
    its policy keeps (model/selective.policy, wrapped to see them; a storage counted once), over one packed batch;
    weights=False leaves out tensors without the batch's L tokens (autocast's weight copies)."""
    from longstride.model.loss import decoder_layers
    from longstride.parallel.cp import DocLayout
    from tests.test_cp_model import SelectiveCache, packed_batch

    cache = SelectiveCache(lambda op, t: weights or L in t.shape)
    with cache.recording():
        patch_model(lm, "selective", offload=False, mlp_tile=tile, lean_norms=True)
    use_longstride_attention(lm)
    layers = decoder_layers(lm)
    cache.layer = None
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: setattr(cache, "layer", i))
        layer.register_forward_hook(lambda m, a, o: setattr(cache, "layer", None))
    b = packed_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ChunkedLossLM(lm.train(), tile=20)(b["input_ids"], b["labels"], b["position_ids"],
                                           doc_layout=DocLayout(b["doc_ids"]))
    assert len(cache.kept) == len(layers), "every layer ran under selective checkpointing"
    return [sum(cache.kept[i].values()) / L for i in range(len(layers))]


@pytest.mark.parametrize("arch, tile, autocast", CASES)
def test_selective_estimate_follows_the_architecture(arch, tile, autocast):
    """What selective checkpointing's cache keeps of each layer (its matmuls' outputs: q/k/v, the output projection,
    the MLP's or the experts' and router's projections; attention's output and lse, one device here; nothing of the
    tiles) is what selective_keeps counts, exactly,
    in fp32 and under autocast (bf16 outputs). The estimate's selective layer adds the layer's input, which the
    checkpoint holds (the residual adds are recomputed, so no cache holds it)."""
    import transformers as T

    from longstride.model.memory import selective_keeps

    torch.manual_seed(0)
    config = _arch(arch)
    config._attn_implementation = "eager"
    lm = T.AutoModelForCausalLM.from_config(config).float()
    parts = layer_parts(lm, lean_norms=True)
    measured = selective_cache_per_layer(lm, tile, autocast, weights=arch in MOE)
    b = 2 if autocast else 4
    est = selective_keeps(lm.config, parts, b, tiled=bool(tile))
    assert measured == [est] * len(measured), (est, measured)
    layer = estimate(lm.config, 1, L, "selective", tile, 1024, act_bytes=b, parts=parts,
                     autocast=autocast)["layer_bytes_per_token"]
    assert layer == est + (4 if autocast else b) * lm.config.hidden_size, "and the layer's input"


ARCHS = ["llama", "qwen3", "gpt_neox", "gemma3", "olmo2", "phi3", "phi", "mixtral", "qwen2_moe"]
# (arch, autocast, batch): the packed batch of four documents for every architecture; one document (the kernel's
# output is attention's, no copy) and a 12-token sliding window (Gemma 3's local layers: the band's tiles, each with
# its own kernel call) besides
KEEP_CASES = ([(arch, autocast, "docs") for arch in ARCHS for autocast in (False, True)]
              + [("llama", False, "one_doc"), ("gemma3", False, "window"), ("gemma3", True, "window_one_doc")])


@pytest.mark.parametrize("arch, autocast, batch", KEEP_CASES)
def test_selective_checkpointing_keeps_each_architectures_loss_and_gradients(arch, autocast, batch):
    """The outputs selective checkpointing keeps are the matmuls' and attention's; a layer that changed one in place
    afterwards would hand backward a wrong cached value. On each of the nine architectures (one process, untiled:
    tiles keep nothing in the cache), in fp32 and under bf16 autocast (whose casts are recomputed), the loss and every
    gradient equal those without checkpointing, to fp32 rounding (the recompute runs the same ops on the same
    values), and backward's recompute never runs attention's kernels (their outputs are the kept ones), where full
    checkpointing's does (the count's own check)."""
    import transformers as T

    from longstride.parallel.cp import DocLayout
    from tests.test_cp_model import AttentionKernelCalls, packed_batch

    b = packed_batch([L] if batch.endswith("one_doc") else [30, 1, 50, 15])
    got, reran = [], []
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        config = _arch(arch)
        config._attn_implementation = "eager"
        if batch.startswith("window"):
            config.sliding_window = 12
        lm = T.AutoModelForCausalLM.from_config(config).float()
        patch_model(lm, mode, offload=False, mlp_tile=0, lean_norms=True)
        use_longstride_attention(lm)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = ChunkedLossLM(lm.train(), tile=20)(b["input_ids"], b["labels"], b["position_ids"],
                                                      doc_layout=DocLayout(b["doc_ids"]))
        with AttentionKernelCalls() as calls:
            loss.backward()
        reran.append(calls.n)
        got.append((loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}))
    assert reran[:2] == [0, 0] and reran[2] > 0, f"attention's kernels ran in backward: {reran} (none, selective, full)"
    loss0, g0 = got[0]
    for loss1, g1 in got[1:]:
        torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
        assert g1.keys() == g0.keys() and g0
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


def test_the_attention_ops_kept_are_this_torchs_ops_and_ours_is_kept_without_grad():
    """Each aten name in ATTENTION_OPS is an op of this torch build (the GPU kernels' names, which no CPU run
    dispatches, checked here against typos) and longstride's own op is registered; the policy keeps torch's SDPA
    kernels under grad only and longstride's attention op (which runs inside an autograd.Function, without grad)
    always; a matmul without grad is not kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    from longstride.model.selective import ATTENTION_OP, ATTENTION_OPS, policy
    from longstride.parallel import attention_call  # registers ATTENTION_OP

    ops = []
    for name in sorted(ATTENTION_OPS):
        space, _, op = name.partition("::")
        packet = getattr(getattr(torch.ops, space), op, None)
        assert packet is not None, f"{name} is not an op of torch {torch.__version__}"
        ops.append(packet.default)
    assert {op.name() for op in ops} == ATTENTION_OPS
    assert attention_call._attention_forward._opoverload.name() == ATTENTION_OP
    save, recompute = CheckpointPolicy.PREFER_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    for op in ops:
        assert policy(None, op) == save, "under grad"
        with torch.no_grad():
            assert policy(None, op) == (save if op.name() == ATTENTION_OP else recompute), op.name()
    with torch.no_grad():
        assert policy(None, torch.ops.aten.mm.default) == recompute, "a matmul inside an autograd.Function"


def test_switches_order_and_offload():
    def per_token(ac, tile, **kw):
        return estimate(CFG, P, 8192, ac, tile, 1024, **kw)

    full, none = per_token("full", 1024), per_token("none", 1024)
    assert full["activation_bytes_per_token"] < per_token("selective", 0)["activation_bytes_per_token"] \
        < per_token("none", 0)["activation_bytes_per_token"]
    assert full["activation_bytes_per_token"] < per_token("selective", 1024)["activation_bytes_per_token"] \
        < none["activation_bytes_per_token"], "tiled too: selective keeps the o-projection's output beside the input"
    off = per_token("full", 1024, offload=True)
    layer_input = full["layer_bytes_per_token"]
    assert abs(off["host_activations"] * 2 ** 30 - CFG.num_hidden_layers * pinned_bytes(layer_input * 8192)) < 1, \
        "offload: every layer input lives in host memory, each in a block of the pinned allocator's"
    assert [pinned_bytes(n) for n in (576 * 2 * 8192, 2 ** 20, 2 ** 20 + 1)] == [2 ** 24, 2 ** 20, 2 ** 21], \
        "a power of two at least the tensor's size (576 wide: 1.78x)"
    assert off["activation_bytes_per_token"] == full["activation_bytes_per_token"] - \
        (CFG.num_hidden_layers - 2) * layer_input, "two layer inputs stay on the device (in use, prefetched)"
    assert per_token("none", 1024, offload=True)["host_activations"] == 0


def test_state_terms_and_sharding():
    one = estimate(CFG, P, 4096, "full", 1024, 1024)
    eight = estimate(CFG, P, 4096, "full", 1024, 1024, shard=8)
    assert abs(one["parameters"] * 2 ** 30 - 4 * P) < 1 and abs(one["optimizer"] - 2 * one["parameters"]) < 1e-9
    assert abs(eight["optimizer"] * 8 - one["optimizer"]) < 1e-9
    assert abs(one["loss"] * 2 ** 30 - 1024 * 49152 * 12) < 1, "one loss tile of fp32 logits at a time"
    gib_keys = ("parameters", "gradients", "optimizer", "activations", "loss", "mlp_tiles")
    assert abs(one["total"] - sum(one[k] for k in gib_keys)) < 1e-9
    gib, where = device_memory_gib(torch.device("cpu"), local_ranks=2)
    assert gib > 0 and "2 local ranks" in where


@pytest.mark.parametrize("traced_gib, warns", [(None, False), (0.5, False), (9.5, True)])
def test_the_fit_warning_takes_the_larger_of_estimate_and_trace(monkeypatch, traced_gib, warns):
    """Before a stage trains: a traced step whose peak is above 90% of the device's memory warns even where the
    analytic estimate fits; a trace that failed (None) leaves the estimate alone."""
    from types import SimpleNamespace as NS

    from longstride.parallel.config import CPDegrees
    from longstride.recipes.memory import fit
    from longstride.recipes.run.step import StepSpec

    monkeypatch.setattr(fit, "device_memory_gib", lambda device, local_ranks: (10.0, "test"))
    monkeypatch.setattr(fit, "log_traced_memory", lambda ctx, plan, lm, gib: traced_gib)
    model = tiny_model()
    messages = []
    tracker = NS(info=lambda *a: None, warning=lambda msg, *a: messages.append(msg % a))
    acc = NS(num_processes=1, mixed_precision="no", device=torch.device("cpu"), is_main_process=True)
    ctx = NS(accelerator=acc, tracker=tracker, cfg=NS(train=NS(trace_memory="true", async_save=False)))
    plan = NS(name="s", stage=NS(micro_batch_size=1, seq_len=L), dims=NS(cp=1), degrees=CPDegrees(),
              step=StepSpec(), fsdp=False)
    fit.log_memory_estimate(ctx, plan, model.lm)
    assert bool(messages) == warns, messages
    if warns:
        assert "about 9.5 GiB per rank against 10.0 GiB" in messages[0]


def test_layer_parts_sees_the_pre_norm_form_through_a_wrapped_class():
    """FSDP2 swaps a sharded layer's class for a subclass named FSDP<name>: the layer keeps its pre-norm form (the
    tiles fold its norms) and its estimate."""
    from longstride.model.tiling import pre_norm

    lm = tiny_model().lm
    layer = lm.model.layers[0]
    assert pre_norm(layer) and layer_parts(lm, lean_norms=True).pre_norm
    layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    assert pre_norm(layer) and layer_parts(lm, lean_norms=True) == LayerParts()


def test_layer_parts_reads_layers_of_other_names():
    """Llama 4 names its MLP feed_forward (experts with a shared one); NanoChat's q/k norms have no weight: both are
    read, not a crash before training (the estimate is a planning aid)."""
    import transformers as T

    kw = dict(vocab_size=50, hidden_size=40, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              pad_token_id=0, bos_token_id=0, eos_token_id=0)
    llama4 = layer_parts(T.Llama4ForCausalLM(T.Llama4TextConfig(num_key_value_heads=2, head_dim=10, num_local_experts=2,
                                                                intermediate_size_mlp=80, **kw)), lean_norms=True)
    assert (llama4.experts_per_token, llama4.experts, llama4.shared_expert) == (1, 2, True), llama4
    nanochat = layer_parts(T.AutoModelForCausalLM.from_config(T.NanoChatConfig(**kw)), lean_norms=True)
    assert nanochat.qk_norm == "head" and not nanochat.experts_per_token, nanochat


@pytest.mark.parametrize("mode, k", [("full", 2), ("selective", 1), ("full", 4)])
def test_checkpointing_the_first_layers_keeps_the_others_whole(mode, k):
    """model.checkpoint_layers=k: the first k decoder layers keep what `mode` keeps (their input, to the saved-tensor
    hooks; selective's cache besides), the others all they keep without checkpointing, measured layer by layer on a
    4-layer Llama; the estimate's activations grow by what was measured over full checkpointing of every layer, and
    the loss and gradients are those without checkpointing."""
    import transformers as T

    from longstride.model.memory import selective_keeps
    from longstride.parallel.cp import DocLayout
    from tests.test_cp_model import packed_batch

    got, b = {}, packed_batch()
    for run, layers in (("none", None), ("every", None), ("first", k)):
        torch.manual_seed(0)
        config = _arch("llama")
        config.num_hidden_layers, config._attn_implementation = 4, "eager"
        lm = T.AutoModelForCausalLM.from_config(config).float()
        patch_model(lm, "none" if run == "none" else mode, offload=False, mlp_tile=0, lean_norms=True,
                    checkpoint_layers=layers)
        use_longstride_attention(lm)
        model = ChunkedLossLM(lm.train(), tile=20)
        saved = saved_per_layer(model, shared=False)
        loss = model(b["input_ids"], b["labels"], b["position_ids"], doc_layout=DocLayout(b["doc_ids"]))
        loss.backward()
        est = estimate(config, 1, L, "none" if run == "none" else mode, 0, 1024, parts=layer_parts(lm, True),
                       ac_layers=layers)["activation_bytes_per_token"]
        got[run] = (saved, est, loss.detach(), {n: p.grad for n, p in lm.named_parameters()})
    none, every, first = got["none"][0], got["every"][0], got["first"][0]
    assert first == every[:k] + none[k:] and every[0] < none[0], (first, every, none)
    # selective's cache, which no saved-tensor hook sees, is held by the k layers rather than by all 4
    cache = selective_keeps(config, layer_parts(lm, True), 4, tiled=False) * L if mode == "selective" else 0
    # and the estimate: every layer's recompute holds one whole set beside the kept ones; k < 4 whole layers free
    # theirs in backward before the first recompute, so no set is added to them
    recompute = none[0] if k < 4 else 0
    assert got["first"][1] - got["every"][1] == (sum(first) - sum(every) - (4 - k) * cache - recompute) / L
    torch.testing.assert_close(got["first"][2], got["none"][2], rtol=1e-6, atol=1e-6)
    for n, g in got["none"][3].items():
        torch.testing.assert_close(got["first"][3][n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_checkpoint_layers_is_checked_before_anything_is_built():
    """A stage's own value (recipe=tiny: s1_256 without checkpointing, s2_2k and s3_4k with) out of the model's range,
    on a stage without checkpointing, or beside offload on CUDA, and the model's where no stage checkpoints: refused,
    naming the field. The model's value applies to the stages that checkpoint."""
    from longstride.recipes.config.plan import validate
    from tests.conftest import compose_cfg

    def plan(*extra, device="cpu"):
        return validate(compose_cfg(["recipe=tiny", *extra]), 2, device, assume_gpu=device == "cuda",
                        check_data=False)

    got = plan("recipe.stages.s2_2k.checkpoint_layers=2")
    assert got["s2_2k"].step.checkpoint_layers == 2 and got["s3_4k"].step.checkpoint_layers is None
    got = plan("model.checkpoint_layers=3", "recipe.stages.s3_4k.checkpoint_layers=4")
    assert [p.step.checkpoint_layers for p in got.values()] == [None, 3, None], "s1 runs none; 4 of 4: every layer"
    off = ["recipe.stages.s2_2k.activation_checkpointing=false", "recipe.stages.s3_4k.activation_checkpointing=false"]
    for extra, device, match in (
            (["model.checkpoint_layers=5"], "cpu", r"model.checkpoint_layers=5: the model has 4 decoder layers"),
            (["recipe.stages.s3_4k.checkpoint_layers=0"], "cpu", r"recipe.stages.s3_4k.checkpoint_layers=0"),
            (["recipe.stages.s1_256.checkpoint_layers=2"], "cpu", "s1_256.checkpoint_layers=2 is read with activation"),
            (["model.checkpoint_layers=2", *off], "cpu", "no stage runs it"),
            (["model.checkpoint_layers=2", "model.offload_activations=true"], "cuda", "needs all of them")):
        with pytest.raises(ValueError, match=match):
            plan(*extra, device=device)


def test_kept_outputs_hands_each_kept_op_its_own_output_on_every_pass():
    """benchmarks.common.KeptOutputs, which the selective measurements read, on this torch (2.13: ctx.op_output;
    2.11, the GPU machine's: the caching mode's output): each forward hands the kept matmuls' outputs, the same
    on a second pass after a backward (2.11 asks the policy again while recomputing: nothing is handed then)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from benchmarks.common import KeptOutputs

    got = []
    policy = KeptOutputs(lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_SAVE if op == torch.ops.aten.mm.default
                         else CheckpointPolicy.PREFER_RECOMPUTE, lambda op, outs: got.append((op, outs)))
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    for _ in range(2):
        got.clear()
        y = checkpoint(lambda a: (a @ w).exp() @ w.t(), x, use_reentrant=False,
                       context_fn=partial(create_selective_checkpoint_contexts, policy))
        assert [op for op, _ in got] == [torch.ops.aten.mm.default] * 2
        first, second = got[0][1][0], got[1][1][0]
        torch.testing.assert_close(first, x @ w)
        torch.testing.assert_close(second, y)
        y.sum().backward()
    assert len(got) == 2, "nothing handed while backward recomputed"
