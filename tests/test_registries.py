"""The two registries: a context-parallel method is one entry in parallel/cp.py METHODS plus its own
module, a data source kind one entry in data/sources.py KINDS plus its functions. A new entry is reached
from validation, sharding, attention, loading and streaming with nothing else edited."""
from __future__ import annotations

import types

import datasets
import torch

from longstride.data.config import SourceConfig
from longstride.data.sources import KINDS, Kind, load_source, stream_source
from longstride.parallel import cp as cp_module
from longstride.parallel.attention import longstride_attention
from longstride.parallel.config import CPDegrees
from longstride.parallel.cp import CPContext, cp_degrees, shard_for_cp
from longstride.recipes.config.plan import validate
from tests.conftest import compose_cfg


def test_a_new_cp_method_is_one_registry_entry(monkeypatch):
    calls = []

    def degrees(cfg, cp, heads, where, world):
        calls.append("degrees")
        return CPDegrees(ring=cp)

    def shard(batch, docs, cp):
        calls.append("shard")
        half = batch["input_ids"].shape[1] // 2
        return {k: v[:, :half] for k, v in batch.items()}, "a plan"

    def attention(q, k, v, layout, scale, pattern, sinks):
        calls.append(("attention", layout.plan, layout.cp.method))
        return torch.zeros_like(q)

    monkeypatch.setitem(cp_module.METHODS, "halves", types.SimpleNamespace(degrees=degrees, shard=shard,
                                                                            attention=attention))
    plans = validate(compose_cfg(["parallel.cp_impl=halves"]), 2)
    assert plans["s2_2k"].degrees == CPDegrees(ring=2) and calls.count("degrees") == 2, "s2 and s3 run with cp=2"
    assert cp_degrees(types.SimpleNamespace(cp_impl="halves"), 1, 4) == CPDegrees(), "cp=1 needs no method"
    batch = {"input_ids": torch.arange(8)[None], "doc_ids": torch.zeros(1, 8, dtype=torch.long)}
    local, layout = shard_for_cp(batch, True, CPContext("halves", CPDegrees(ring=2)))
    assert local["input_ids"].tolist() == [[0, 1, 2, 3]] and layout.plan == "a plan"
    q = torch.randn(1, 2, 4, 8)
    out, _ = longstride_attention(None, q, q[:, :1], q[:, :1], None, doc_layout=layout)
    assert out.shape == (1, 4, 2, 8) and calls[-1] == ("attention", "a plan", "halves")


def _rows(n: int):
    for i in range(n):
        yield {"text": f"document {i} " * 3, "skip": ""}


def test_a_new_source_kind_is_one_table_entry(monkeypatch, tmp_path):
    checked = []

    def check(src, field):
        checked.append(field)
        if src.max_docs is None:
            raise ValueError(f"{field}.max_docs must be set for the counting kind")

    kind = Kind(check=check,
                load=lambda src, cache_dir, num_proc, field: datasets.Dataset.from_list(list(_rows(src.max_docs))),
                stream=lambda src, cache_dir, field, world: datasets.IterableDataset.from_generator(
                    _rows, gen_kwargs={"n": src.max_docs}))
    monkeypatch.setitem(KINDS, "counting", kind)
    src = SourceConfig(kind="counting", max_docs=5)
    assert load_source(src, str(tmp_path))["text"][4] == "document 4 " * 3
    assert [r["text"] for r in stream_source(src, str(tmp_path), leave_out=range(3))] == ["document 3 " * 3, "document 4 " * 3]
    validate(compose_cfg(["data.sources.stdlib.kind=counting", "data.sources.stdlib.max_docs=5"]), 2)
    assert checked == ["data.sources", "data.sources", "data.sources.stdlib"]
    try:
        validate(compose_cfg(["data.sources.stdlib.kind=counting"]), 2)
    except ValueError as e:
        assert "data.sources.stdlib.max_docs must be set" in str(e)
    else:
        raise AssertionError("the kind's own check did not run in validation")


def test_hybrid_with_one_ulysses_rank_is_a_ring():
    """parallel.cp_impl=hybrid with parallel.ulysses=1 has no Ulysses group: its attention is the ring's (here a
    one-rank ring), equal to single-device document attention."""
    from longstride.parallel import hybrid
    from longstride.parallel.kernels import doc_attention

    cfg = types.SimpleNamespace(ulysses=1, upipe_heads=0)
    assert hybrid.degrees(cfg, 2, 4, "cp") == CPDegrees(2, 1, 0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 16, 8, generator=g) for h in (4, 2, 2))
    docs = torch.tensor([[0] * 5 + [1] * 11])
    batch = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "doc_ids": docs}
    local, layout = shard_for_cp(batch, True, CPContext("hybrid", CPDegrees(1, 1), kernel="sdpa"))
    out, _ = longstride_attention(None, q, k, v, None, doc_layout=layout)
    want = doc_attention(q, k, v, docs, 8 ** -0.5, "sdpa").transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
