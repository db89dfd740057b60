"""Tiled MLP and activation checkpointing: the same loss and gradients as the plain model (fp32), and
the MLP's wide activations really exist for one tile at a time, in forward and in the backward recompute."""
from __future__ import annotations

import pytest
import torch

from model.checkpointing import enable_checkpointing
from model.tiling import tile_mlps
from tests.test_cp_model import L, packed_batch, tiny_model


def loss_and_grads(model):
    b = packed_batch()
    from parallel.attention import DocLayout

    loss = model(b["input_ids"], b["labels"], b["position_ids"], doc_layout=DocLayout(b["doc_ids"]))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert abs(la.item() - lb.item()) <= 1e-6 * abs(lb.item()), (what, la, lb)
    for k in gb:
        err = ((ga[k] - gb[k]).abs().max() / gb[k].abs().max().clamp(min=1e-12)).item()
        assert err <= 1e-5, f"{what}: {k} relative gradient difference {err:.2e}"


def test_tiled_mlp_equals_plain_and_holds_one_tile_at_a_time():
    plain = loss_and_grads(tiny_model())
    model = tiny_model()
    assert tile_mlps(model.lm, 16) == 2
    assert tile_mlps(model.lm, 16) == 2, "tiling twice re-tiles the original forward, never nests"
    rows = []
    for layer in model.lm.model.layers:
        layer.mlp.gate_proj.register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    tiled = loss_and_grads(model)
    assert_same(tiled, plain, "tiled MLP")
    # 96 tokens in tiles of 16: 6 tiles per layer in forward, recomputed once more in backward
    assert max(rows) == 16 and len(rows) == 2 * 6 * 2, rows
    assert L % 16 == 0


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


def test_no_grad_forward_tiles_without_checkpoint():
    from parallel.attention import DocLayout

    b = packed_batch()
    losses = []
    for tile in (0, 16):
        model = tiny_model()
        tile_mlps(model.lm, tile)
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
        offloader.min_bytes = 0
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
