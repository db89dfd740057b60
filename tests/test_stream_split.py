"""A streamed stage resumed on another number of data-parallel ranks (data/stream_split.py): every row of the epoch
the old ranks were in is read exactly once by old and new ranks together, and every document an old rank had drawn
reaches a batch."""
from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch

from longstride.data.config import DataConfig, SourceConfig
from longstride.data.stream import streaming_stage
from longstride.data.stream_split import resplit
from longstride.data.tokenizer import train_bpe
from tests.test_stream import corpus_docs, write_jsonl

L, MB = 128, 2


@pytest.fixture(scope="module", params=[2, 0], ids=["held_out", "none_held_out"])
def setup(tmp_path_factory, request):
    """A files source of 5 jsonl files (a stream of rows, each rank reading past the others' rows; with nothing held
    out datasets reorders its files by the epoch, which every layout must share) and a local_dir source (one file a
    document, each rank opening only its own), 3:1 by tokens; small enough that some ranks wrap into later epochs."""
    d = tmp_path_factory.mktemp("split")
    a, b = corpus_docs("a", 40, 0), corpus_docs("b", 17, 1)
    a[20] = "   "  # skipped and counted
    (d / "b").mkdir()
    for i, text in enumerate(b):
        (d / "b" / f"{i:02d}.txt").write_text(text)
    for k in range(5):
        write_jsonl(d / f"a{k}.jsonl", a[8 * k:8 * k + 8])
    tok = train_bpe(a + b, 300)
    cfg = DataConfig(sources={"a": SourceConfig(kind="files", path=str(d / "a*.jsonl"), weight=3.0),
                              "b": SourceConfig(kind="local_dir", path=str(d / "b"), weight=1.0)},
                     streaming=True, eval_sequences=request.param, stream_open_seqs=6)
    return cfg, tok, str(d)


def loaders(setup, world: int, packing: str, seq_len: int = L, stages=None, mixture=None) -> list:
    """Each rank's loader of a stage at `seq_len` (`stages`: every stage of the run, for the held-out rows)."""
    cfg, tok, d = setup
    cfg = DataConfig(**{**cfg.__dict__, "packing": packing})
    return [streaming_stage(cfg, tok, seq_len, tok.pad_token_id, mixture, MB, r, world, d, stages)[0]
            for r in range(world)]


def recorded(loader, drawn: list) -> None:
    """Appends (source, epoch, document) to `drawn` for every document the loader's packer draws."""
    packer = loader.loader.dataset
    draw = packer.next_document

    def next_document():
        before = dict(packer.counters["tokens"])
        ids = draw()
        name = next(n for n, t in packer.counters["tokens"].items() if t != before[n])
        drawn.append((name, packer.counters["epoch"][name], tuple(ids.tolist())))
        return ids
    packer.next_document = next_document


def trained(batch: dict, pad: int) -> Counter:
    """Each document piece of a batch as a tuple of token ids (padding left out)."""
    out = Counter()
    for ids, doc in zip(batch["input_ids"], batch["doc_ids"]):
        for k in doc.unique().tolist():
            piece = ids[doc == k]
            if not bool((piece == pad).all()):
                out[tuple(piece.tolist())] += 1
    return out


def through_a_file(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)  # as a checkpoint holds it, loaded as a resume loads it
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def epoch_rows(setup, name: str, stages=None) -> Counter:
    """The documents of one epoch of source `name` past its held-out rows, as one rank reads them."""
    (one,), drawn = loaders(setup, 1, "best_fit", stages=stages), []
    recorded(one, drawn)
    while one.loader.dataset.counters["epoch"][name] == 0:
        next(one)
    return Counter(doc for n, e, doc in drawn if n == name and e == 0)


@pytest.mark.parametrize("layouts, packing", [((2, 1), "best_fit"), ((2, 3), "best_fit"), ((1, 2), "concat"),
                                              ((2, 3, 2), "best_fit")])
def test_a_re_split_reads_every_row_of_the_epoch_once_and_trains_every_drawn_document(setup, layouts, packing):
    """Ranks of each layout take 7 steps (each rank's packer reads its own number of rows), their states are
    re-split for the next layout; then the last layout's ranks read on until every source is past the epoch the
    first re-split was in. Each source's rows of that epoch, over every rank of every layout, are its whole epoch
    once; and every document drawn is in some batch or still pending in the last ranks' packers."""
    pad = setup[1].pad_token_id
    drawn, seen, epochs = [], Counter(), None
    ranks = loaders(setup, layouts[0], packing)
    for i, world in enumerate(layouts):
        for r in ranks:
            recorded(r, drawn)
        for _ in range(7):
            for r in ranks:
                seen += trained(next(r), pad)
        if i + 1 == len(layouts):
            break
        states = [through_a_file(r.state_dict()) for r in ranks]
        if epochs is None:
            epochs = {n: max(s["dataset_state"]["counters"]["epoch"][n] for s in states) for n in ("a", "b")}
        new = layouts[i + 1]
        ranks = loaders(setup, new, packing)
        behind = {n for n in ("a", "b") if len({s["dataset_state"]["counters"]["epoch"][n] for s in states}) > 1}
        for way, r in enumerate(ranks):
            state, notes = resplit(states, way, new, {"a": "data.sources.a", "b": "data.sources.b"})
            assert {n for n in ("a", "b") if any(note.startswith(f"data.sources.{n}: ") for note in notes)} == behind
            r.load_state_dict(through_a_file(state))
    assert epochs is not None
    while any(r.loader.dataset.counters["epoch"][n] <= epochs[n] for r in ranks for n in epochs):
        for r in ranks:
            seen += trained(next(r), pad)
    for n, epoch in epochs.items():
        got = Counter(doc for m, e, doc in drawn if m == n and e == epoch)
        assert got == epoch_rows(setup, n), (n, epoch, sum(got.values()))
    pending = Counter()
    for r in ranks:
        packer = r.loader.dataset.packer
        for seq in packer.open + packer.ready:
            pending.update(tuple(p.tolist()) for p in seq)
    if packing == "best_fit":  # no document is cut (all are shorter than a sequence): pieces are documents
        assert seen + pending == Counter(doc for _, _, doc in drawn)
    else:  # concat cuts documents at sequence ends: the tokens are conserved
        tokens = lambda c: sum(len(k) * v for k, v in c.items())  # noqa: E731
        assert tokens(seen) + tokens(pending) == sum(len(doc) for _, _, doc in drawn)


def pending_pieces(ranks) -> Counter:
    out = Counter()
    for r in ranks:
        packer = r.loader.dataset.packer
        for seq in packer.open + packer.ready:
            out.update(tuple(p.tolist()) for p in seq)
    return out


STAGES = [(L, None), (2 * L, None)]  # a run of two stages: the rows held out are the same for both


@pytest.mark.parametrize("layouts", [(1, 1), (2, 2), (2, 1), (1, 3)])
def test_the_next_stage_goes_on_reading_where_the_stage_before_stopped(setup, layouts):
    """A stage at 128 tokens on layouts[0] ranks takes 7 steps; the next stage, at 256 tokens on layouts[1] ranks,
    starts from its ranks' positions (the own rank's, or re-split: recipes/run/stage_state.carry_streams) and reads
    until each source is past the epoch the first stage was in. Each source's rows of that epoch, over both stages,
    are the whole epoch once (no document the first stage read is read again while the epoch lasts), and every
    document drawn is trained or still pending: the first stage's pending pieces went into the next stage's packer."""
    pad, (old, new) = setup[1].pad_token_id, layouts
    drawn, seen = [], Counter()
    ranks = loaders(setup, old, "best_fit", stages=STAGES)
    for r in ranks:
        recorded(r, drawn)
    for _ in range(7):
        for r in ranks:
            seen += trained(next(r), pad)
    states = [through_a_file(r.state_dict()) for r in ranks]
    epochs = {n: max(s["dataset_state"]["counters"]["epoch"][n] for s in states) for n in ("a", "b")}
    assert all(s["dataset_state"]["counters"]["epoch_rows"]["a"] for s in states), "the first stage read rows of a"
    nxt, carried = loaders(setup, new, "best_fit", 2 * L, STAGES), 0
    for way, r in enumerate(nxt):
        state = states[way]["dataset_state"] if new == old else \
            resplit(states, way, new, {"a": "data.sources.a", "b": "data.sources.b"})[0]["dataset_state"]
        carried += r.loader.dataset.carry_over({"a": state, "b": state}, state)
        assert r.loader.dataset.counters["tokens"] == {"a": 0, "b": 0}, "the next stage's mixture starts afresh"
        recorded(r, drawn)
    packers = [s["dataset_state"]["packer"] for s in states]
    assert carried == sum(len(seq) for p in packers for seq in p["open"] + p["ready"]) > 0, \
        "the first stage's drawn but untrained pieces, each packed first in the next stage"
    while any(r.loader.dataset.counters["epoch"][n] <= epochs[n] for r in nxt for n in epochs):
        for r in nxt:
            seen += trained(next(r), pad)
    for n, epoch in epochs.items():
        got = Counter(doc for m, e, doc in drawn if m == n and e == epoch)
        assert got == epoch_rows(setup, n, STAGES), (n, epoch, sum(got.values()))
    assert seen + pending_pieces(nxt) == Counter(doc for _, _, doc in drawn)


def test_a_source_left_out_of_carry_over_starts_from_its_beginning(setup):
    """carry_over for source a only (b's rows numbered otherwise now: carry_streams' check): a goes on with the rows
    the first stage would have read next, b starts from its first row as a fresh stage's b does."""
    (first,) = loaders(setup, 1, "best_fit", stages=STAGES)
    for _ in range(5):
        next(first)
    state = through_a_file(first.state_dict())["dataset_state"]
    (fresh,), (nxt,) = (loaders(setup, 1, "best_fit", 2 * L, STAGES) for _ in range(2))
    nxt.loader.dataset.carry_over({"a": state})
    assert nxt.loader.dataset.counters["epoch_rows"] == {"a": state["counters"]["epoch_rows"]["a"], "b": 0}
    assert state["counters"]["epoch_rows"]["b"] > 0

    def docs(loader) -> dict:
        """The first 6 documents of each source the loader's packer draws."""
        drawn = []
        recorded(loader, drawn)
        while min(sum(n == m for n, _, _ in drawn) for m in ("a", "b")) < 6:
            loader.loader.dataset.next_document()
        return {m: [doc for n, _, doc in drawn if n == m][:6] for m in ("a", "b")}
    got, on, afresh = docs(nxt), docs(first), docs(fresh)
    assert got["a"] == on["a"] != afresh["a"] and got["b"] == afresh["b"] != on["b"]


def test_a_source_a_stage_leaves_out_goes_on_where_the_last_stage_that_read_it_stopped(setup, tmp_path):
    """Stages s1 (a and b), s2 (b's weight 0: it reads only a), s3 (a and b), each starting from the final before it
    as the recipe does (recipes/run/stage_state.carry_streams reading the finals' rank0.pt): s3 goes on with a where
    s2 stopped and with b where s1 stopped (before, s2's final held no position of b and s3 read b from its first
    row again); a final of another tokenizer carries no pending pieces."""
    from types import SimpleNamespace

    from longstride.model.manifest import write_manifest
    from longstride.parallel.config import ParallelDims
    from longstride.recipes.run.stage_state import carry_streams

    mix = {"a": 1.0, "b": 0.0}
    stages = [(L, None), (L, mix), (2 * L, None)]
    ctx = SimpleNamespace(cfg=SimpleNamespace(recipe=SimpleNamespace(stages={"s1": 0, "s2": 0, "s3": 0})),
                          recipe_dir=str(tmp_path), accelerator=SimpleNamespace(process_index=0), tokenizer_id="t")

    def stage(name, seq_len, mixture, steps, tokenizer="t"):
        (loader,) = loaders(setup, 1, "best_fit", seq_len, stages, mixture)
        run = SimpleNamespace(loader=loader, plan=SimpleNamespace(dims=ParallelDims.from_world(1, 1)))
        before = list(stages[:["s1", "s2", "s3"].index(name)])
        note = carry_streams(ctx, run, str(tmp_path / ["s1", "s2", "s3"][len(before) - 1] / "final")) if before \
            else ""
        counters = dict(loader.loader.dataset.counters["epoch_rows"])
        for _ in range(steps):
            next(loader)
        final = tmp_path / name / "final"
        final.mkdir(parents=True)
        torch.save({"data": loader.state_dict(), "origin": loader.origin, "dp": 1, "tokenizer": tokenizer},
                   final / "rank0.pt")
        write_manifest(str(final), 1)
        return note, counters, through_a_file(loader.state_dict())["dataset_state"]["counters"]

    _, _, s1 = stage("s1", L, None, 5)
    note2, start2, s2 = stage("s2", L, mix, 5, tokenizer="other")
    assert start2 == {"a": s1["epoch_rows"]["a"]} and "b" not in s2["epoch_rows"], "s2 reads a alone, from s1's"
    note3, start3, _ = stage("s3", 2 * L, None, 1)
    assert start3 == {"a": s2["epoch_rows"]["a"], "b": s1["epoch_rows"]["b"]} and s1["epoch_rows"]["b"] > 0
    assert note3 == (f"; its streams go on from {tmp_path / 's2' / 'final'}'s positions; b from "
                     f"{tmp_path / 's1' / 'final'}'s (not read since)"), note3
    assert "pending" in note2 and "pending" not in note3, "s2's final was written under another tokenizer"
    # s1's final damaged since (a byte of its rank0.pt): its positions are not used, and b starts from its beginning
    garbled = tmp_path / "s1" / "final" / "rank0.pt"
    data = bytearray(garbled.read_bytes())
    data[-1] ^= 1
    garbled.write_bytes(bytes(data))
    (loader,) = loaders(setup, 1, "best_fit", 2 * L, stages, None)
    run = SimpleNamespace(loader=loader, plan=SimpleNamespace(dims=ParallelDims.from_world(1, 1)))
    note = carry_streams(ctx, run, str(tmp_path / "s2" / "final"))
    assert f"{tmp_path / 's1' / 'final'}'s stream positions are not used: rank0.pt does not match its checksum" \
        in note, note
    assert dict(loader.loader.dataset.counters["epoch_rows"]) == {"a": s2["epoch_rows"]["a"], "b": 0}


def test_what_cannot_be_re_split_is_refused_naming_the_source(setup):
    ranks = loaders(setup, 2, "best_fit")
    for r in ranks:
        next(r)
    states = [r.state_dict() for r in ranks]
    names = {"a": "data.sources.a", "b": "data.sources.b"}
    sharded = [{**s, "dataset_state": {**s["dataset_state"], "by_rows": {"a": False, "b": True}}} for s in states]
    with pytest.raises(ValueError, match=r"data.sources.a: its 2 data-parallel ranks read whole shards of it"):
        resplit(sharded, 0, 1, names)
    old = [{**s, "dataset_state": {**s["dataset_state"], "counters": {
        k: v for k, v in s["dataset_state"]["counters"].items() if k != "epoch_rows"}}} for s in states]
    with pytest.raises(ValueError, match=r"data.sources.a: the checkpoint was written by a longstride that kept no "
                                         r"per-epoch row counts"):
        resplit(old, 0, 1, names)
    packer = loaders(setup, 2, "best_fit")[1].loader.dataset  # a rank that resumed such a checkpoint
    packer.load_state_dict(old[1]["dataset_state"])
    assert packer.counters["epoch_rows"] == {"a": None, "b": None}, "unknown until the source's next epoch"
    with pytest.raises(ValueError, match=r"data.sources.a: the checkpoint was written by a longstride that kept no "):
        resplit([states[0], {**states[1], "dataset_state": packer.state_dict()}], 0, 1, names)
    assert resplit(states, 0, 1, names)[0]["dataset_state"]["splits"]["a"]["ways"] == 1
    # rank 1 a whole epoch of b further than rank 0: rank 0's rest of its epoch is left out, and the log says so
    c = states[1]["dataset_state"]["counters"]
    ahead = {**c, "epoch": {**c["epoch"], "b": states[0]["dataset_state"]["counters"]["epoch"]["b"] + 1}}
    lagging = [states[0], {**states[1], "dataset_state": {**states[1]["dataset_state"], "counters": ahead}}]
    epoch = ahead["epoch"]["b"]
    _, notes = resplit(lagging, 0, 1, names)
    assert (f"data.sources.b: data-parallel ranks of 2 in an earlier epoch than {epoch} ({{0: {epoch - 1}}}, rank: "
            f"epoch); the rest of their share of those epochs is left out and epoch {epoch} goes on") in notes, notes


def test_each_epoch_reads_in_the_order_every_layout_shares(setup):
    """The local_dir source's files: as walked in the first epoch, then walked_order's permutation for the epoch;
    the files source's rows: the same order every epoch with held-out rows (skip() fixes datasets' shard order),
    else its 5 files reordered by datasets from the epoch on."""
    from longstride.data.sources import walked_order

    (one,), drawn = loaders(setup, 1, "best_fit"), []
    recorded(one, drawn)
    while min(one.loader.dataset.counters["epoch"].values()) < 2:
        next(one)
    order = lambda n, e: [doc for m, ep, doc in drawn if m == n and ep == e]  # noqa: E731
    first = order("b", 0)
    assert order("b", 1) == [first[i] for i in walked_order(len(first), 1)] != first
    assert sorted(order("a", 1)) == sorted(order("a", 0))
    assert (order("a", 1) == order("a", 0)) == bool(setup[0].eval_sequences)


def test_chained_re_splits_of_any_layouts_read_every_row_once():
    """The position arithmetic alone, over 400 random chains of up to 4 layouts of 1-6 ranks on 50 rows, each rank
    having read any number of its rows: what the ranks read plus what the last layout's shares hold is every row
    once, and the datasets filter of a share keeps exactly the rows split_rows lists (the walked files' path), also
    past the rows before the share's first, skipped unread."""
    from longstride.data.stream_split import _rest, first_row, keeps, split_rows

    rng, count = np.random.default_rng(0), 50
    for _ in range(400):
        split, read_rows = {"gaps": [], "tail": 0, "ways": int(rng.integers(1, 7))}, []
        for _ in range(int(rng.integers(1, 5))):
            shares = [split_rows({**split, "way": w}, count) for w in range(split["ways"])]
            for w, share in enumerate(shares):
                keep = keeps({**split, "way": w})
                assert [g for g in range(count) if keep(None, g)] == share
                first = first_row({**split, "way": w})  # the rows before it skipped unread
                keep = keeps({**split, "way": w}, first)
                assert [g for g in range(first, count) if keep(None, g - first)] == share
            read = [int(rng.integers(0, len(share) + 1)) for share in shares]
            read_rows += [g for share, k in zip(shares, read) for g in share[:k]]
            gaps, tail = _rest(split, read)
            split = {"gaps": gaps, "tail": tail, "ways": int(rng.integers(1, 7))}
        rest = [g for w in range(split["ways"]) for g in split_rows({**split, "way": w}, count)]
        assert sorted(read_rows + rest) == list(range(count))
