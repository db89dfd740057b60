"""Chunked cross-entropy equals the plain one, in value and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longstride.model.loss import IGNORE_INDEX, chunked_cross_entropy_sum


@pytest.mark.parametrize("tile", [1, 7, 64, 1000])
def test_chunked_loss_matches_plain(tile):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 50, 16, generator=gen, requires_grad=True)
    w = torch.randn(40, 16, generator=gen, requires_grad=True)
    y = torch.randint(0, 40, (2, 50), generator=gen)
    y[0, 10:20] = IGNORE_INDEX
    y[1, -1] = IGNORE_INDEX
    got = chunked_cross_entropy_sum(h, w, y, tile)
    ref = F.cross_entropy((h @ w.T).reshape(-1, 40), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-6)
    ga = torch.autograd.grad(got, (h, w))
    gb = torch.autograd.grad(ref, (h, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_tile():
    with pytest.raises(ValueError, match="model.loss_tile_tokens"):
        chunked_cross_entropy_sum(torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long), 0)


def test_a_batch_without_targets_still_backpropagates_zero():
    """A micro-batch whose tokens are all context only (synthetic loss_on=qa) has no target: its loss is 0
    and backward must still run (a data-parallel rank that skipped it would leave the others waiting)."""
    h = torch.randn(2, 30, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    loss = chunked_cross_entropy_sum(h, w, torch.full((2, 30), IGNORE_INDEX), 8)
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad is not None and w.grad is not None
    assert not h.grad.any() and not w.grad.any()
