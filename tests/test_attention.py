"""Document-masked attention: parity with a dense masked reference, and exact isolation of documents
inside a real transformers model."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from longstride.model.build import build_model
from longstride.model.config import ModelConfig
from longstride.parallel.attention import use_longstride_attention
from longstride.parallel.cp import DocLayout
from longstride.parallel.kernels import doc_attention


def dense_reference(q, k, v, doc_ids, scale):
    # Explicit L x L mask: allowed iff same document and key index <= query index (test-only).
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    L = q.shape[2]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    mask = (causal & same)[:, None]
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double()


def random_doc_ids(B, L, gen):
    rows = []
    for _ in range(B):
        cuts = sorted(torch.randperm(L - 1, generator=gen)[:5].add(1).tolist())
        lens = np.diff([0, *cuts, L])
        rows.append(torch.from_numpy(np.repeat(np.arange(len(lens)), lens)))
    return torch.stack(rows)


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (9, 3)])
def test_doc_attention_matches_masked_reference(kernel, heads):
    gen = torch.Generator().manual_seed(0)
    B, L, D = 2, 96, 16
    H, Hkv = heads
    q = torch.randn(B, H, L, D, generator=gen, requires_grad=True)
    k = torch.randn(B, Hkv, L, D, generator=gen, requires_grad=True)
    v = torch.randn(B, Hkv, L, D, generator=gen, requires_grad=True)
    doc = random_doc_ids(B, L, gen)
    doc[0, :3] = torch.tensor([0, 1, 2]).clamp(max=doc[0, 3])  # documents of length 1 included
    doc[0] = torch.cummax(doc[0], 0).values
    out = doc_attention(q, k, v, doc, D ** -0.5, kernel)
    ref = dense_reference(q, k, v, doc, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


def test_other_documents_logits_unchanged_when_one_document_changes():
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2)
    model = build_model(cfg, rope_theta=1e4, seq_len=64, vocab_size=50, eos_id=0, pad_id=1).eval()
    use_longstride_attention(model)
    lens = [10, 25, 1, 28]
    doc = torch.from_numpy(np.repeat(np.arange(4), lens))[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    ids = torch.randint(2, 50, (1, 64))
    changed = ids.clone()
    changed[0, 10:35] = torch.randint(2, 50, (25,))  # rewrite document 1 entirely
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, doc_layout=DocLayout(doc)).logits
        b = model(input_ids=changed, position_ids=pos, doc_layout=DocLayout(doc)).logits
        c = model(input_ids=changed, position_ids=pos, doc_layout=DocLayout(None)).logits  # masking off
    others = (doc[0] != 1)
    assert torch.equal(a[0, others], b[0, others]), "other documents must be bit-identical"
    assert not torch.equal(a[0, doc[0] == 1], b[0, doc[0] == 1])
    assert not torch.allclose(a[0, doc[0] == 3], c[0, doc[0] == 3]), "without masking, later docs see doc 1"


def test_autocast_model_runs_and_matches_sdpa():
    # under bf16 autocast transformers hands attention fp32 q/k (RoPE by fp32 cos/sin) and bf16 v: longstride
    # casts them to autocast's dtype, as SDPA does, instead of failing in the kernel
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2)
    model = build_model(cfg, rope_theta=1e4, seq_len=64, vocab_size=50, eos_id=0, pad_id=1)
    ids, pos = torch.randint(2, 50, (1, 64)), torch.arange(64)[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.set_attn_implementation("sdpa")
        want = model(input_ids=ids, position_ids=pos).logits.float()
        use_longstride_attention(model)
        got = model(input_ids=ids, position_ids=pos, doc_layout=DocLayout(torch.zeros_like(ids))).logits.float()
        got.sum().backward()
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def _capped_reference(q, k, v, doc_ids, scale, window, softcap):
    """fp64 attention with an explicit L x L mask (same document, causal, within the window) and soft-capped
    scores: softcap * tanh(s / softcap), as Gemma 2's eager attention computes them."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    i = torch.arange(q.shape[2])
    d = i[:, None] - i[None]
    mask = (d >= 0) & (d < (window or q.shape[2])) & (doc_ids[:, :, None] == doc_ids[:, None, :])
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap) if softcap else s
    return torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1) @ v.double()


@pytest.mark.parametrize("window, softcap", [(None, None), (None, 2.0), (300, 2.0)])
def test_the_math_kernel_holds_one_tile_of_scores_at_a_time(window, softcap, monkeypatch):
    """A 900-token document (more than three query tiles of dense.BAND_TILE) and a 200-token one: the math
    kernel's output and gradients match the fp64 reference within 1e-5, and the most bytes alive at once in
    its forward and backward are under half what the same call holds with one tile for the whole document."""
    from longstride.parallel import dense
    from longstride.parallel.pattern import Pattern
    from longstride.recipes.memory.trace import LiveBytes

    H, Hkv, L, D = 4, 2, 1100, 16
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, L, D, generator=g) for h in (H, Hkv, Hkv, H))
    q = q * 2  # scores of a few units: the cap bends them
    doc_ids = torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([900, 200]))[None]

    def run():
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with LiveBytes() as live:
            out = doc_attention(*x, doc_ids, D ** -0.5, "math", pattern=Pattern(window, softcap=softcap))
            out.backward(dout)
        return [out, *(t.grad for t in x)], live.peak

    got, peak = run()
    xr = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = _capped_reference(*xr, doc_ids, D ** -0.5, window, softcap)
    ref.backward(dout.double())
    for g, want in zip(got, [ref, *(t.grad for t in xr)]):
        assert (g.double() - want).abs().max() <= 1e-5 * want.abs().max()
    monkeypatch.setattr(dense, "BAND_TILE", 1024)  # one tile holds the whole document
    _, whole = run()
    assert peak < 0.5 * whole, (peak, whole)


def test_the_math_kernel_keeps_fp32_scores_under_autocast():
    """Autocast reaches inside the attention op: under bf16 autocast the math kernel's score matmuls would run in
    bf16. Its log-sum-exp stays within 1e-5 of the fp64 one (bf16 scores: about 3e-2), and tiled gradients come
    back in fp32, as one tile's do."""
    from longstride.parallel.dense import DENSE
    from longstride.parallel.kernels import doc_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 300, 16, generator=g).bfloat16() for h in (4, 2, 2, 4))
    bounds = [((0, 300),)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = doc_attention_forward(q, k, v, bounds, "math", 0.25)
        grads = DENSE["math"][1](dout, q, k, v, out, lse, scale=0.25, causal=True)
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.25
    want = torch.logsumexp(s.masked_fill(~torch.ones(300, 300, dtype=torch.bool).tril(), float("-inf")), -1)
    assert lse.dtype == torch.float32 and (lse.double() - want).abs().max() < 1e-5
    assert [x.dtype for x in grads] == [torch.float32] * 3


def test_a_traced_math_kernel_runs_its_largest_tile_and_counts_the_real_peak():
    """On fake tensors (longstride plan, the stage-start trace) the math kernel runs only its largest tile, forward
    and backward (its forward's soft-cap tanh: once, against once a tile), and reaches the same peak as the real
    call over all its tiles (LiveBytes), for a causal and a windowed document."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from longstride.parallel.pattern import Pattern
    from longstride.recipes.memory.trace import LiveBytes

    class Tiles(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in (torch.ops.aten.tanh.default, torch.ops.aten.tanh_.default)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, h, 900, 16, generator=g) for h in (4, 2, 2, 4)]
    for window in (None, 300):
        got = {}
        for fake in (False, True):
            mode = FakeTensorMode() if fake else contextlib.nullcontext()
            with mode:
                q, k, v, dout = (mode.from_tensor(t) if fake else t.clone() for t in inputs)
                x = [t.requires_grad_(True) for t in (q, k, v)]
                with LiveBytes() as live, Tiles() as tiles:
                    doc_attention(*x, None, 0.25, "math", pattern=Pattern(window, softcap=2.0)).backward(dout)
            got[fake] = (tiles.n, live.peak)
        assert got[False][0] == 4 and got[True][0] == 1, got  # 900 queries: 4 tiles of 256
        assert got[True][1] == got[False][1], (window, got)
