"""Tiled MLP and activation checkpointing: the same loss and gradients as the plain model (fp32), and
the MLP's wide activations really exist for one tile at a time, in forward and in the backward recompute."""
from __future__ import annotations

import contextlib
import gc
import re
import weakref

import pytest
import torch

from longstride.model.checkpointing import enable_checkpointing
from longstride.model.prepare import patch_model
from longstride.model.rmsnorm import rms_norm
from longstride.model.selective import policy as _selective_policy
from longstride.model.tiling import tiled_apply
from tests.test_cp_model import L, packed_batch, tiny_model


def loss_and_grads(model):
    b = packed_batch()
    from longstride.parallel.cp import DocLayout

    model.zero_grad(set_to_none=True)
    loss = model(b["input_ids"], b["labels"], b["position_ids"], doc_layout=DocLayout(b["doc_ids"]))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def saved_per_layer(model, shared: bool = True, autocast: bool = False, weights: bool = True) -> list[int]:
    """Bytes each decoder layer's forward hands autograd to keep for backward (parameters excluded; a storage
    saved twice counted once), measured with saved-tensor hooks over one packed batch; shared=False leaves out
    the storages several layers save (RoPE's cos/sin, made once for the model); autocast: under bf16 autocast;
    weights=False leaves out the bf16 copies autocast makes of the weights (tensors without a token dimension)."""
    from longstride.model.loss import decoder_layers
    from longstride.parallel.cp import DocLayout

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, saved = [None], {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in params and (weights or L in t.shape):
            saved.setdefault(current[0], {})[ptr] = t.untyped_storage().nbytes()
        return t

    layers = decoder_layers(model.lm)
    index = {id(layer): i for i, layer in enumerate(layers)}

    def entered(call):  # the layer's whole call: transformers 5.17 checkpoints __call__, the layer's hooks inside
        def whole(self, *args, **kwargs):
            current[0] = index.get(id(self))
            try:
                return call(self, *args, **kwargs)
            finally:
                current[0] = None
        return whole

    b = packed_batch()
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), bf16:
        for cls in {type(layer) for layer in layers}:
            mp.setattr(cls, "__call__", entered(cls.__call__))
        model(b["input_ids"], b["labels"], b["position_ids"], doc_layout=DocLayout(b["doc_ids"]))
    per_layer = [saved.get(i, {}) for i in range(len(layers))]
    if not shared:
        seen = [ptr for own in per_layer for ptr in own]
        per_layer = [{p: n for p, n in own.items() if seen.count(p) == 1} for own in per_layer]
    return [sum(own.values()) for own in per_layer]


def assert_same(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert abs(la.item() - lb.item()) <= 1e-6 * abs(lb.item()), (what, la, lb)
    for k in gb:
        err = ((ga[k] - gb[k]).abs().max() / gb[k].abs().max().clamp(min=1e-12)).item()
        assert err <= 1e-5, f"{what}: {k} relative gradient difference {err:.2e}"


def test_tiled_mlp_equals_plain_and_holds_one_tile_at_a_time():
    plain = loss_and_grads(tiny_model())
    model = tiny_model()
    patched = patch_model(model.lm, "none", offload=False, mlp_tile=16, lean_norms=False)
    assert patched.tiled_layers == 2 and patched.lean_norms == 0
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model.lm, "none", offload=False, mlp_tile=16, lean_norms=False)
    rows = []
    for layer in model.lm.model.layers:
        layer.mlp.gate_proj.register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    tiled = loss_and_grads(model)
    assert_same(tiled, plain, "tiled MLP, norms folded into the tiles")
    # 96 tokens in tiles of 16: 6 tiles per layer in forward, recomputed once more in backward
    assert max(rows) == 16 and len(rows) == 2 * 6 * 2, rows
    assert L % 16 == 0
    x = torch.randn(1, 5, 32)
    assert model.lm.model.layers[0].input_layernorm(x) is x, "the input norm runs inside the q/k/v tiles"
    patched.undo()
    assert model.lm.model.layers[0].input_layernorm(x) is not x, "undo restores the norms"
    assert "forward" not in vars(model.lm.model.layers[0].mlp), "undo gives the MLP back its class's forward"
    assert_same(loss_and_grads(model), plain, "undone")
    # in one step: the folded norms' tiles call the lean forward
    patched = patch_model(model.lm, "full", offload=False, mlp_tile=16, lean_norms=True)
    assert patched.lean_norms == 2 * 2 + 1 and patched.tiled_layers == 2
    assert model.lm.model.layers[0].input_layernorm(x) is x and model.lm.is_gradient_checkpointing
    assert_same(loss_and_grads(model), plain, "tiled, lean RMSNorm, full checkpointing")
    patched.undo()
    assert not model.lm.is_gradient_checkpointing and not any("forward" in vars(m) for m in model.lm.modules())
    with pytest.raises(ValueError, match="checkpointing mode 'some'"):
        patch_model(model.lm, "some", offload=False, mlp_tile=16, lean_norms=True)
    assert not any("forward" in vars(m) for m in model.lm.modules()), "a refused patch leaves nothing behind"
    patch_model(model.lm, "none", offload=False, mlp_tile=16, lean_norms=True)
    layer = weakref.ref(model.lm.model.layers[0])
    del model, patched
    gc.collect()
    assert layer() is None, "a patched model is freed once dropped (nothing outside it holds its modules)"


def test_a_random_mlp_s_tiles_recompute_the_masks_their_forward_drew():
    """An MLP with dropout (Seed-OSS's residual dropout; PhiMoE's sampled routing draws alike): each tile's
    recompute drew new masks, so the gradients were those of another forward (0.39 relative off for Seed-OSS).
    They now equal autograd's through the same tiles, drawing from the same seed."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 16)).train()
    x = torch.randn(2, 24, 16, requires_grad=True)
    dy = torch.randn(2, 24, 16)
    params = list(mlp.parameters())

    def grads(tiled: bool):
        torch.manual_seed(7)
        y = tiled_apply(mlp, x, params, 8) if tiled else torch.cat([mlp(t) for t in x.split(8, dim=-2)], dim=-2)
        got = torch.autograd.grad(y, [x, *params], dy)
        return y.detach(), got, torch.rand(1)  # the draw after the step: the caller's random stream goes on as it was

    (y, want, after), (y_t, got, after_t) = grads(False), grads(True)
    assert torch.equal(y, y_t) and torch.equal(after, after_t)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_lean_rms_norm_equals_transformers(dtype, tol):
    from transformers.models.smollm3.modeling_smollm3 import SmolLM3RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = SmolLM3RMSNorm(48, eps=1e-5)
    norm.weight.data = torch.randn(48, generator=g)
    x = torch.randn(2, 40, 48, generator=g).to(dtype).requires_grad_()
    ref = norm(x)
    dy = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad(ref, (x, norm.weight), dy)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert out.dtype == ref.dtype and torch.equal(out, ref), "the forward is transformers' own expression"
    for a, b in zip(torch.autograd.grad(out, (x, norm.weight), dy), ref_grads):
        assert a.dtype == b.dtype
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= tol
    assert sorted(t.numel() for t in saved) == [48, 80, 80 * 48], "keeps x, the weight and 1/rms only"


def test_tiled_layers_keep_only_what_attention_needs():
    """What the autograd graph holds per decoder layer with the layer tiled (no checkpointing): the layer
    input (read by the q/k/v tiles), the residual after attention (read by the MLP tiles), post-RoPE q/k,
    v, the attention output and its log-sum-exp, and cos/sin in RoPE layers. Nothing else as wide as the
    sequence: no normed tensor, no MLP intermediate, no norm statistics."""
    model = tiny_model()
    patch_model(model.lm, "none", offload=False, mlp_tile=16, lean_norms=True)
    cfg = model.lm.config
    H, d, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    saved = saved_per_layer(model)
    for i, layer in enumerate(model.lm.model.layers):
        rope = 2 * d if layer.self_attn.use_rope else 0
        expected = 4 * L * (2 * H + 2 * Hq * d + 2 * Hkv * d + Hq + rope)
        assert saved[i] == expected, (i, saved[i], expected)


def test_activation_checkpointing_full_and_selective_same_loss_and_gradients():
    plain = loss_and_grads(tiny_model())
    model = tiny_model()
    enable_checkpointing(model.lm, "full")
    assert_same(loss_and_grads(model), plain, "full activation checkpointing")
    model = tiny_model()
    enable_checkpointing(model.lm, "selective")
    assert_same(loss_and_grads(model), plain, "selective activation checkpointing")
    for mode in ("full", "selective"):
        both = tiny_model(ac=mode)
        assert_same(loss_and_grads(both), plain, f"tiled MLP inside {mode}-checkpointed layers")


def test_tiles_recompute_under_the_forward_autocast_and_are_not_cached_by_selective_checkpointing():
    seen = []
    lin = torch.nn.Linear(8, 8)
    ref_lin = torch.nn.Linear(8, 8)
    ref_lin.load_state_dict(lin.state_dict())

    def fn(t):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                     _selective_policy(None, torch.ops.aten.mm.default)))
        return lin(t) * 2

    x = torch.randn(1, 10, 8, requires_grad=True)
    dy = torch.randn(1, 10, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiled_apply(fn, x, list(lin.parameters()), 4)
    assert y.dtype == torch.bfloat16
    (y.float() * dy).sum().backward()
    forward, backward = seen[:3], seen[3:]
    assert len(backward) == 3 and all(not g and a and p.name == "PREFER_RECOMPUTE" for g, a, p in forward), forward
    assert all(g and a for g, a, _ in backward), "backward recomputes each tile with grad, under autocast"
    assert _selective_policy(None, torch.ops.aten.mm.default).name == "PREFER_SAVE", "outside a tile: kept"
    # the same output and gradients as the untiled op under the same autocast (bf16: tile sums differ in rounding)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr = ref_lin(xr) * 2
    (yr.float() * dy).sum().backward()
    assert torch.equal(y, yr), "tiles compute each token exactly as the whole op does"
    for got, want, what in [(x.grad, xr.grad, "dx"), (lin.weight.grad, ref_lin.weight.grad, "dW"),
                            (lin.bias.grad, ref_lin.bias.grad, "db")]:
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 2e-2, f"{what}: relative difference {err:.3g} from the untiled op"


def test_no_grad_forward_tiles_without_checkpoint():
    from longstride.parallel.cp import DocLayout

    b = packed_batch()
    losses = []
    for tile in (0, 16):
        model = tiny_model()
        patch_model(model.lm, "none", offload=False, mlp_tile=tile, lean_norms=False)
        with torch.no_grad():
            losses.append(model(b["input_ids"], b["labels"], b["position_ids"], doc_layout=DocLayout(b["doc_ids"])))
    assert abs(losses[0].item() - losses[1].item()) <= 1e-6 * abs(losses[0].item()), losses


def test_offloaded_activations_same_gradients_and_prefetched_in_order():
    """The offload hooks' bookkeeping (simulated on CPU: copies stand in for the transfers): the layer
    inputs leave at save time, each comes back before it is needed (fetched while the layer after it
    runs backward), every tensor is copied once however many layers save it, nothing is left over."""
    plain = loss_and_grads(tiny_model())
    for mode in ("full", "selective"):
        model = tiny_model()
        offloader = enable_checkpointing(model.lm, mode, simulate_offload=True)
        offloader.min_bytes = 1  # torch 2.11 saves an empty placeholder per checkpointed layer: left on device
        assert_same(loss_and_grads(model), plain, f"{mode} checkpointing with offload")
        trace = offloader.trace
        packs = [i for op, i in trace if op == "pack"]
        unpacks = [(n, i) for n, (op, i) in enumerate(trace) if op == "unpack"]
        layers = len(model.lm.model.layers)
        assert len(packs) >= layers and len(packs) == len(set(packs))
        assert not offloader.items and not offloader.live, "every offloaded tensor was read back and released"
        hidden = [i for i in packs if sum(1 for _, j in unpacks if j == i) == 1]  # read once: layer inputs
        assert len(hidden) >= layers
        for (n_prev, _), (n, i) in zip(unpacks, unpacks[1:]):
            fetched = trace.index(("fetch", i))
            assert fetched < n_prev, f"tensor {i} was fetched only when needed, not prefetched"
    with pytest.raises(ValueError, match="activation checkpointing mode"):
        enable_checkpointing(tiny_model().lm, "some")


def test_a_model_of_another_layout_trains_through_the_same_step_parts():
    """GPT-NeoX keeps its decoder under gpt_neox and its layers' attention under `attention`: ChunkedLossLM with
    tiled MLPs, full checkpointing and offload (simulated) and longstride's attention gives the model's own eager
    loss and gradients over packed documents (each document run alone as the reference)."""
    import transformers as T

    from longstride.model.loss import ChunkedLossLM, decoder_layers
    from longstride.parallel.attention import use_longstride_attention

    def neox():
        torch.manual_seed(3)
        cfg = T.GPTNeoXConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4)
        cfg._attn_implementation = "eager"
        return T.GPTNeoXForCausalLM(cfg).float()

    b = packed_batch()
    ref = neox()
    total = 0.0
    for d in b["doc_ids"][0].unique():
        at = (b["doc_ids"][0] == d).nonzero()[:, 0]
        logits = ref(input_ids=b["input_ids"][:, at], position_ids=b["position_ids"][:, at]).logits
        total = total + torch.nn.functional.cross_entropy(logits[0], b["labels"][0, at], reduction="sum")
    total.backward()
    lm = neox()
    assert len(decoder_layers(lm)) == 2
    patched = patch_model(lm, "full", offload=False, mlp_tile=16, lean_norms=True, simulate_offload=True)
    assert patched.tiled_layers == 2
    use_longstride_attention(lm)
    model = ChunkedLossLM(lm, tile=20)
    got = loss_and_grads(model)
    assert_same(got, (total.detach(), {f"lm.{n}": p.grad for n, p in ref.named_parameters()}), "GPT-NeoX")


def test_selective_checkpointing_refuses_a_kept_output_changed_in_place():
    """A matmul's output, kept by selective checkpointing, changed in place afterwards (through matmul's
    _unsafe_view, which shares no version counter with it) fails loudly in backward instead of recomputing from a
    changed value; the same function without the in-place change keeps the plain gradients."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(5, 8, requires_grad=True)

    def layer(t, in_place):
        y = torch.ops.aten._unsafe_view(torch.mm(t, w), [5, 2, 3])
        y = y.add_(1.0) if in_place else y + 1.0
        return torch.tanh(y)

    context = partial(create_selective_checkpoint_contexts, _selective_policy)
    layer(x, False).sum().backward()
    plain = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    checkpoint(layer, x, False, use_reentrant=False, context_fn=context).sum().backward()
    torch.testing.assert_close((x.grad, w.grad), plain, rtol=0, atol=0)
    out = checkpoint(layer, x, True, use_reentrant=False, context_fn=context)
    with pytest.raises(RuntimeError, match="cached during selective activation checkpoint has been mutated"):
        out.sum().backward()


def test_moe_and_feed_forward_layers_are_refused_tiles_where_they_would_crash(tmp_path):
    """GPT-OSS's mlp (experts, returning its router scores beside its output) and Llama 4's feed_forward: tiling
    them failed deep in the patch with an AttributeError. patch_model refuses them naming model.mlp_tile_tokens, a
    recipe's validation does so for a checkpoint before any data is read (model or stage field), and
    `longstride plan`'s fixes offer no tile for such a model. A mixture of experts returning its output alone
    (Mixtral; test_memory_estimate tiles it and Qwen2-MoE) is tiled."""
    import transformers as T

    from longstride.model.prepare import patch_model
    from longstride.recipes.config.model_checks import model_shape
    from longstride.recipes.memory.memplan import mlps_tile
    from tests.conftest import compose_cfg

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    gpt_oss = T.GptOssForCausalLM(T.GptOssConfig(**small, num_local_experts=2, num_experts_per_tok=1))
    llama4 = T.Llama4ForCausalLM(T.Llama4TextConfig(**small, intermediate_size_mlp=64, num_local_experts=1))
    for model, why in ((gpt_oss, "GptOssDecoderLayer's mlp (GptOssMLP) returns more than its output"),
                       (llama4, "Llama4TextDecoderLayer has no `mlp` to tile")):
        with pytest.raises(NotImplementedError, match=re.escape(f"model.mlp_tile_tokens=4: {why}")):
            patch_model(model, "none", False, 4, False)
        assert not mlps_tile(model.config)
    assert mlps_tile(T.LlamaConfig(**small))
    assert mlps_tile(T.MixtralConfig(**small, num_local_experts=2, num_experts_per_tok=1))
    gpt_oss.save_pretrained(tmp_path / "gpt_oss")
    base = ["recipe=extend_pretrained", f"model.checkpoint={tmp_path / 'gpt_oss'}", "logger.wandb_mode=disabled"]
    with pytest.raises(ValueError, match=re.escape(  # the recipe's own stage tiles
            "recipe.stages.x2.mlp_tile_tokens=1024, recipe.stages.x4.mlp_tile_tokens=1024: ")):
        model_shape(compose_cfg(base))
    base += ["recipe.stages.x2.mlp_tile_tokens=0", "recipe.stages.x4.mlp_tile_tokens=0"]
    model_shape(compose_cfg(base))  # untiled: accepted
    for tile in ("model.mlp_tile_tokens=512", "recipe.stages.x2.mlp_tile_tokens=512"):
        with pytest.raises(ValueError, match=re.escape(f"{tile}: {tmp_path / 'gpt_oss'}'s GptOssDecoderLayer's mlp "
                                                       "(GptOssMLP) returns more than its output; set it to 0")):
            model_shape(compose_cfg(base + [tile]))
