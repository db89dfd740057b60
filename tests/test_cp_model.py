"""End to end under context parallelism: a tiny transformers model's loss and parameter gradients with
the batch sharded over gloo ranks equal the one-process ones, for ring (zig-zag), Ulysses, UPipe and
Ulysses x ring."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longstride.model.build import build_model
from longstride.model.config import ModelConfig
from longstride.model.loss import IGNORE_INDEX, ChunkedLossLM
from longstride.model.prepare import patch_model
from longstride.model.selective import ATTENTION_OPS
from longstride.model.selective import policy as selective_policy
from longstride.parallel.attention import use_longstride_attention
from longstride.parallel.config import ParallelConfig, ParallelDims
from longstride.parallel.cp import CPContext, cp_context, cp_degrees, shard_for_cp
from longstride.parallel.spawn import run_gloo

L = 96
# Micro-batch 1 (what the tiny recipe's long stage trains with). Both layouts have a length-1 document and
# one spanning several chunks of the 4-chunk layout. In the first every rank's own chunks hold several
# document pieces; in the second rank 1's chunks (tokens 24-71 at cp=2) lie inside one document while
# rank 0's hold four pieces, so the two ranks' kernels lay out dK/dV differently.
LENGTHS = {"every_rank_several_docs": [30, 1, 50, 15], "a_rank_inside_one_doc": [20, 70, 1, 5]}


def packed_batch(lengths: list[int] = LENGTHS["every_rank_several_docs"]) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 50, (1, L), generator=g)
    lens = torch.tensor(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lens)[None]
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, :-1] = ids[0, 1:]
    labels[0, (lens.cumsum(0) - 1)] = IGNORE_INDEX  # no label across a document boundary
    return {"input_ids": ids, "labels": labels, "position_ids": (torch.arange(L) - starts)[None],
            "doc_ids": doc}


class SelectiveCache:
    """A selective-checkpointing policy that records what model/selective.policy keeps, bytes per storage, under the
    key `layer` holds when the op runs (None: not recorded); wanted(op, tensor) filters. Passed to patch_model through
    `recording`, since checkpointing binds its policy when switched on (benchmarks.common.KeptOutputs: each kept op's
    outputs, on the torch releases that ask the policy before the op too)."""

    def __init__(self, wanted=lambda op, t: True):
        from benchmarks.common import KeptOutputs

        self.layer, self.kept, self.wanted = 0, {}, wanted
        self.policy = KeptOutputs(selective_policy, self._kept)

    def __call__(self, ctx, op, *args, **kwargs):
        return self.policy(ctx, op, *args, **kwargs)

    def _kept(self, op, outs: list) -> None:
        for t in (t for t in outs if self.layer is not None and self.wanted(op, t)):
            self.kept.setdefault(self.layer, {})[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    @contextmanager
    def recording(self):
        from longstride.model import checkpointing

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(checkpointing, "_selective_policy", self)
            yield

    def total(self) -> int:
        return sum(sum(kept.values()) for kept in self.kept.values())


def tiny_model(ac: str = "none", cache: SelectiveCache = None, layers: Optional[int] = None) -> ChunkedLossLM:
    """ac: activation checkpointing mode; with checkpointing every memory saver is on: the layers tiled
    (tiles of 16 tokens, norms folded in; not with ":untiled" after the mode) and the lean RMSNorm backward.
    cache: records what selective checkpointing keeps; layers: checkpoint the first `layers` of the 2 only."""
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2)
    lm = build_model(cfg, rope_theta=1e4, seq_len=L, vocab_size=50, eos_id=0, pad_id=1, seed=5)
    mode, _, untiled = ac.partition(":")
    if mode != "none":
        with cache.recording() if cache else nullcontext():
            patch_model(lm, mode, offload=False, mlp_tile=0 if untiled else 16, lean_norms=True,
                        checkpoint_layers=layers)
    use_longstride_attention(lm)
    return ChunkedLossLM(lm, tile=20)


class AttentionKernelCalls(TorchDispatchMode):
    """Counts the attention calls (model/selective.ATTENTION_OPS: longstride's attention op, torch's SDPA kernels) that
    really run while it is entered: entered around backward, what selective checkpointing's recompute runs rather
    than takes from its cache."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.name() in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_exchanges():
    """Counts Ulysses' all-to-alls (parallel/ulysses's all_to_all_single) while entered, in box[0]: entered around
    backward, the exchanges backward runs, its recompute's included."""
    from longstride.parallel import ulysses

    box, exchange = [0], ulysses.all_to_all_single

    def counted(*args, **kwargs):
        box[0] += 1
        return exchange(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ulysses, "all_to_all_single", counted)
        yield box


def loss_and_grads(cp: CPContext, lengths: list[int], doc_masking: bool, ac: str = "none", calls: list = None,
                   kept: list = None, exchanges: list = None):
    """calls: gets the attention calls backward ran; kept: gets what selective checkpointing's cache holds, bytes per
    layer and local token; exchanges: gets the all-to-alls backward ran"""
    cache = SelectiveCache() if kept is not None else None
    model = tiny_model(ac, cache)
    local, layout = shard_for_cp(packed_batch(lengths), doc_masking, cp)
    loss = model(local["input_ids"], local["labels"], local["position_ids"], doc_layout=layout)
    if kept is not None:
        kept.append(cache.total() / model.lm.config.num_hidden_layers / local["input_ids"].numel())
    with AttentionKernelCalls() as counted, counted_exchanges() as exchanged:
        loss.backward()
    if calls is not None:
        calls.append(counted.n)
    if exchanges is not None:
        exchanges.append(exchanged[0])
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, n: int, par: ParallelConfig, ac: str, path: str) -> None:
    import torch.distributed as dist

    cp = cp_context(par.cp_impl, ParallelDims(n, 1, n), cp_degrees(par, n, heads=4), "cpu", "sdpa", par.balance)
    out, calls, kept, exchanges, unchecked = {}, [], [], [], []
    loss_and_grads(cp, LENGTHS["every_rank_several_docs"], True, exchanges=unchecked)  # backward's own exchanges
    for lname, lengths in LENGTHS.items():
        for doc_masking in (True, False):
            loss, grads = loss_and_grads(cp, lengths, doc_masking, ac, calls,
                                         kept if ac.startswith("selective") else None, exchanges)
            for t in (loss, *grads.values()):
                dist.all_reduce(t)  # the global loss sum and gradient are sums over CP ranks
            out[lname, doc_masking] = (loss, grads)
    if rank == 0:
        torch.save({"results": out, "backward_attention_calls": sum(calls), "selective_kept": kept,
                    "backward_exchanges": exchanges, "unchecked_backward_exchanges": unchecked[0]}, path)


IMPLS = {  # name: (processes, parallel config, checkpointing mode, MLP tiled with it); 4 query / 2 K/V heads
    "ring2": (2, ParallelConfig(cp_impl="ring"), "none"),
    "ring2_tiled_mlp_full_ac": (2, ParallelConfig(cp_impl="ring"), "full"),
    "ring2_tiled_mlp_selective_ac": (2, ParallelConfig(cp_impl="ring"), "selective"),
    # untiled, selective checkpointing caches q/k/v's projections, whose views CP attention reads
    "ring2_selective_ac": (2, ParallelConfig(cp_impl="ring"), "selective:untiled"),
    "upipe2_U2_selective_ac": (2, ParallelConfig(cp_impl="upipe", upipe_heads=2), "selective:untiled"),
    "ulysses2": (2, ParallelConfig(cp_impl="ulysses"), "none"),
    # 2 K/V heads over 4 ranks: each replicated twice, as the estimate's kept K/V counts
    "ulysses4_selective_ac": (4, ParallelConfig(cp_impl="ulysses"), "selective:untiled"),
    "upipe2_U2_tiled_mlp_full_ac": (2, ParallelConfig(cp_impl="upipe", upipe_heads=2), "full"),
    "hybrid_ring2xulysses2": (4, ParallelConfig(cp_impl="hybrid", ulysses=2), "none"),
    # Ulysses' Function around a ring of two: the ring's output kept, its exchange not run again in backward
    "hybrid_ring2xulysses2_selective_ac": (4, ParallelConfig(cp_impl="hybrid", ulysses=2), "selective:untiled"),
    # document-aware chunk assignment (parallel/balance.py): 8 chunks per rank for every_rank_several_docs
    "ring2_balance_docs_tiled_mlp_full_ac": (2, ParallelConfig(cp_impl="ring", balance="docs"), "full"),
    "hybrid_ring2xulysses2_balance_docs": (4, ParallelConfig(cp_impl="hybrid", ulysses=2, balance="docs"), "none"),
}


def test_docs_balance_changes_the_layout_of_the_first_batch():
    from longstride.parallel.balance import balanced_assignment
    from longstride.parallel.zigzag import zigzag

    a = balanced_assignment(packed_batch()["doc_ids"].numpy(), 2)
    assert a != zigzag(2) and a.k == 8, "the balance_docs cases above must run a non-zig-zag assignment"


@pytest.mark.parametrize("impl", list(IMPLS))
def test_cp_loss_and_gradients_equal_single_process(impl, tmp_path):
    path = str(tmp_path / "cp.pt")
    n, par, ac = IMPLS[impl]
    run_gloo(_worker, n, par, ac, path)
    saved = torch.load(path)
    got, reran = saved["results"], saved["backward_attention_calls"]
    # selective checkpointing keeps attention's output (a ring's too: no block or K/V message again); full
    # checkpointing recomputes the whole layer
    assert (reran == 0) == (ac != "full"), f"{impl}: backward ran attention {reran} times"
    # nor Ulysses' all-to-alls (inside the same op): backward exchanges what it exchanges without checkpointing
    exchanged, unchecked = saved["backward_exchanges"], saved["unchecked_backward_exchanges"]
    exchanging = par.cp_impl != "ring"
    assert (unchecked > 0) == exchanging, (impl, unchecked)
    assert all(n > unchecked if ac == "full" and exchanging else n == unchecked for n in exchanged), (
        impl, unchecked, exchanged)
    if ac == "selective:untiled":  # and what it keeps is what the estimate counts per local token: one device's set,
        # and plain Ulysses' head-layout q and K/V
        from longstride.model.memory import layer_parts, selective_keeps

        lm = tiny_model(ac).lm
        est = selective_keeps(lm.config, layer_parts(lm, lean_norms=True), 4, tiled=False,
                              ulysses=cp_degrees(par, n, heads=4).plain_ulysses(4))
        assert saved["selective_kept"] == [est] * 4, (impl, est, saved["selective_kept"])
    for lname, lengths in LENGTHS.items():
        for doc_masking in (True, False):
            case = f"{impl} {lname} doc_masking={doc_masking}"
            loss1, grads1 = loss_and_grads(CPContext(), lengths, doc_masking)
            lossn, gradsn = got[lname, doc_masking]
            assert abs(lossn.item() - loss1.item()) <= 1e-5 * abs(loss1.item()), (case, lossn, loss1)
            worst = max(((gradsn[k] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                        for k, g in grads1.items())
            assert worst <= 1e-5, f"{case}: worst relative gradient difference {worst:.2e}"
        assert not torch.allclose(got[lname, True][0], got[lname, False][0]), "document masking must change the loss"
