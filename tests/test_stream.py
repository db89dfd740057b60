"""Streaming sources and online packing (data.streaming=true): exact resume, token-weighted mixture,
disjoint data-parallel shares, held-out documents never trained on, bad input."""
from __future__ import annotations

import io
import os
import json
import re

import numpy as np
import pytest
import torch

from longstride.data.config import DataConfig, SourceConfig
from longstride.data.stream import streaming_stage
from longstride.data.tokenizer import train_bpe

L, MB = 128, 2


def write_jsonl(path, docs, column="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({column: d, "id": 0}) + "\n")
    return str(path)


def corpus_docs(prefix: str, n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "stream", "token", "pack", "ring"]
    return [f"{prefix}{i} " + " ".join(rng.choice(words, int(rng.integers(1, 60)))) for i in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    a, b = corpus_docs("a", 30, 0), corpus_docs("b", 12, 1)
    a[20], b[8] = "   ", ""  # skipped and counted
    tok = train_bpe(a + b, 300)
    cfg = DataConfig(sources={"a": SourceConfig(kind="files", path=write_jsonl(d / "a.jsonl", a), weight=3.0),
                              "b": SourceConfig(kind="files", path=write_jsonl(d / "b.jsonl", b), weight=1.0)},
                     streaming=True, eval_sequences=2, stream_open_seqs=128)
    return cfg, tok, str(d)


def stage(setup, rank=0, world=1, packing="best_fit"):
    cfg, tok, d = setup
    cfg = DataConfig(**{**cfg.__dict__, "packing": packing})
    return streaming_stage(cfg, tok, L, tok.pad_token_id, None, MB, rank, world, d)


def docs_of(batch: dict) -> set:
    """Each document (piece) of a batch as a tuple of token ids."""
    out = set()
    for ids, doc in zip(batch["input_ids"], batch["doc_ids"]):
        for k in doc.unique().tolist():
            out.add(tuple(ids[doc == k].tolist()))
    return out


@pytest.mark.parametrize("packing", ["best_fit", "concat"])
def test_resume_yields_identical_sequences_across_epochs(setup, packing):
    loader, _, _ = stage(setup, packing=packing)
    expected = [next(loader) for _ in range(40)]  # ~5K tokens: both sources wrap into further epochs
    assert loader.loader.dataset.counters["epoch"]["b"] >= 1 and loader.loader.dataset.counters["epoch"]["a"] >= 1
    part, _, _ = stage(setup, packing=packing)
    for _ in range(13):
        next(part)
    buf = io.BytesIO()
    torch.save(part.state_dict(), buf)  # through a checkpoint file, as training does
    resumed, _, _ = stage(setup, packing=packing)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    for i in range(13, 40):
        got = next(resumed)
        for key in expected[i]:
            assert torch.equal(got[key], expected[i][key]), (packing, i, key)


def test_every_sequence_is_full_length_and_tokens_are_conserved(setup):
    loader, _, report = stage(setup)
    batches = [next(loader) for _ in range(20)]
    assert all(b["input_ids"].shape == (MB, L) for b in batches)
    packer = loader.loader.dataset
    c, pk = packer.counters, packer.packer
    open_tokens = sum(len(p) for seq in pk.open for p in seq)
    assert pk.counts["used"] + open_tokens == sum(c["tokens"].values()), "every drawn token is packed or still open"
    # the whitespace and empty rows (past the held-out ones) are skipped and counted once per epoch
    assert report["held_out_rows"]["a"][1] <= 20 and report["held_out_rows"]["b"][1] <= 8, report
    assert c["skipped"] == {"a": {"whitespace": c["epoch"]["a"]}, "b": {"empty": c["epoch"]["b"]}}, c
    r = packer.report()
    assert r["padding_fraction"] < 0.05, r
    # the mixture follows the token weights 3:1
    share = c["tokens"]["a"] / sum(c["tokens"].values())
    assert abs(share - 0.75) < 0.02, share


def test_data_parallel_shares_are_disjoint_and_skip_the_held_out_documents(setup):
    r0, held, _ = stage(setup, 0, 2)
    r1, _, _ = stage(setup, 1, 2)
    n = 6  # within the first epoch of both shares
    d0 = set().union(*(docs_of(next(r0)) for _ in range(n)))
    d1 = set().union(*(docs_of(next(r1)) for _ in range(n)))
    assert d0 and d1 and not (d0 & d1), "data-parallel ranks read disjoint documents"
    held_docs = docs_of({k: torch.from_numpy(np.stack([h[k] for h in held])) for k in held[0]})
    pad = (0,)
    assert not (held_docs - {pad}) & (d0 | d1), "held-out documents are never trained on"


def test_bad_streaming_input(tmp_path, setup):
    _, tok, d = setup
    bad_col = DataConfig(sources={"x": SourceConfig(kind="files", path=write_jsonl(tmp_path / "x.jsonl", ["hi"], "body"))},
                         streaming=True)
    with pytest.raises(ValueError, match=r"data.sources.x.text_column='text' is not a column; the columns are "
                                         r"\['body', 'id'\]"):
        streaming_stage(bad_col, tok, L, 0, None, MB, 0, 1, d)
    empty = DataConfig(sources={"e": SourceConfig(kind="files", path=write_jsonl(tmp_path / "e.jsonl", ["", "  "]))},
                       streaming=True, eval_sequences=1)
    with pytest.raises(ValueError, match=r"data.sources.e: no usable document in a whole pass \(skipped: "
                                         r"\{'empty': 1, 'whitespace': 1\}\)"):
        streaming_stage(empty, tok, L, 0, None, MB, 0, 1, d)
    small = DataConfig(sources={"s": SourceConfig(kind="files", path=write_jsonl(tmp_path / "s.jsonl", ["a b"] * 3))},
                       streaming=True, eval_sequences=8)
    with pytest.raises(ValueError, match=rf"data.sources.s: validating on its share of data.eval_sequences=8 x {L} "
                                         r"tokens reads all of its documents; lower data.eval_sequences"):
        streaming_stage(small, tok, L, 0, None, MB, 0, 1, d)
    one = DataConfig(sources={"a": SourceConfig(kind="files", path=write_jsonl(tmp_path / "a.jsonl", ["a b"] * 9)),
                              "book": SourceConfig(kind="files", path=write_jsonl(tmp_path / "b.jsonl", ["b " * 300]))},
                     streaming=True, eval_sequences=0)
    loader, _, _ = streaming_stage(one, tok, L, 0, None, MB, 1, 2, d)  # rank 1 of 2 gets no row of the one book
    with pytest.raises(ValueError, match=r"data.sources.book: no usable document in a whole pass of data-parallel "
                                         r"rank 1's share \(1 in 2 rows or files\) .*; a streamed source needs at "
                                         r"least 2 rows"):
        next(iter(loader))
    missing = DataConfig(sources={"m": SourceConfig(kind="files", path=str(tmp_path / "nope.jsonl"))}, streaming=True)
    with pytest.raises(ValueError, match=r"data.sources.m.path=.*nope.jsonl': file not found"):
        streaming_stage(missing, tok, L, 0, None, MB, 0, 1, d)


@pytest.mark.parametrize("kind", ["disk", "files"])
def test_a_sharded_source_split_over_ranks_skips_the_streams_held_out_rows(tmp_path, kind):
    """A source of several shards (a save_to_disk dataset, a glob of files) split over 2 ranks: the first 7 rows of
    the stream (held out) are read by no rank, and every other row by exactly one. Split by shards, datasets
    skipped each rank's own first rows instead: held-out rows trained, as many others never read."""
    from longstride.data.sources import stream_source

    rows = [f"row {i}" for i in range(100)]
    if kind == "disk":
        import datasets

        datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "disk"))
        src = SourceConfig(kind="disk", path=str(tmp_path / "disk"))
    else:
        write_jsonl(tmp_path / "a.jsonl", rows[:50])
        write_jsonl(tmp_path / "b.jsonl", rows[50:])
        src = SourceConfig(kind="files", path=str(tmp_path / "*.jsonl"))
    seen = [int(r["text"].split()[1]) for rank in range(2)
            for r in stream_source(src, str(tmp_path / "cache"), "x", rank, 2, leave_out=range(7))]
    assert sorted(seen) == list(range(7, 100)), (sorted(set(range(7)) & set(seen)), len(seen))


def test_a_walked_source_identity_follows_its_files_and_their_sizes_not_their_root(tmp_path):
    """What numbers a streamed local_dir source's rows, for the resume fingerprint: another file, or an edit that
    changes a file's size, is another identity; the same files under another root are the same one; a dangling
    link (read as a skipped document) is named, not a crash."""
    from longstride.data.sources import stream_rows_identity

    def identity(root):
        return stream_rows_identity(SourceConfig(kind="local_dir", path=str(root), glob="*.txt"), "data.sources.d")

    one, two = tmp_path / "one", tmp_path / "two"
    for root in (one, two):
        root.mkdir()
        for i in range(3):
            (root / f"{i}.txt").write_text(f"document {i}\n" * 4)
    same = identity(one)
    assert identity(two) == same
    (two / "1.txt").write_text("document 1\n" * 5)
    assert identity(two) != same
    (two / "1.txt").write_text("document 1\n" * 4)
    assert identity(two) == same
    (two / "3.txt").write_text("another\n")
    assert identity(two) != same
    (one / "4.txt").symlink_to(one / "gone.txt")  # dangling: the reader counts it skipped, the identity names it
    assert identity(one) != same


def test_a_walked_source_is_listed_once_a_stage_and_read_as_listed(tmp_path, monkeypatch):
    """A streamed local_dir source's files are walked once per stage (its validation heads for every stage, its
    training passes, its fingerprint), and the stage reads them as walked: a file added mid-stage is not read in
    the next epoch (the fingerprint would not name it), and the stage's identity is the walked files'."""
    from longstride.data import sources

    root = tmp_path / "docs"
    root.mkdir()
    texts = corpus_docs("d", 40, 3)
    for i, t in enumerate(texts):
        (root / f"{i:02d}.txt").write_text(t)
    tok = train_bpe(texts, 300)
    cfg = DataConfig(sources={"d": SourceConfig(kind="local_dir", path=str(root), glob="*.txt")}, streaming=True,
                     eval_sequences=1, stream_open_seqs=8)
    walks = []
    real = sources.list_files
    monkeypatch.setattr(sources, "list_files", lambda *a, **k: walks.append(a) or real(*a, **k))
    loader, _, report = streaming_stage(cfg, tok, L, tok.pad_token_id, None, MB, 0, 1, str(tmp_path),
                                        stages=[(L, None), (2 * L, None), (4 * L, None)])
    (root / "99.txt").write_text("zzz " * 40)  # added mid-stage
    for _ in range(30):  # past the first epoch: the source is read again
        next(loader)
    assert loader.loader.dataset.counters["epoch"]["d"] >= 1
    assert len(walks) == 1, walks
    new = tuple(tok("zzz " * 40)["input_ids"][:3])
    assert not any(tuple(b["input_ids"][r, i:i + 3].tolist()) == new for b in [next(loader) for _ in range(10)]
                   for r in range(MB) for i in range(L - 2))
    src = cfg.sources["d"]
    assert report["rows_identity"]["d"] != sources.stream_rows_identity(src, "data.sources.d")
    (root / "99.txt").unlink()
    assert report["rows_identity"]["d"] == sources.stream_rows_identity(src, "data.sources.d")


def test_a_walked_source_s_ranks_each_open_only_their_own_files(tmp_path, monkeypatch):
    """local_dir over 4 ranks with 2 files held out: each of the other 38 files is read by exactly one rank, and a
    rank opens only the files it yields (split by rows, every rank read every file and kept one row in 4)."""
    import builtins
    import collections

    from longstride.data.sources import stream_source

    root = tmp_path / "docs"
    root.mkdir()
    for i in range(40):
        (root / f"{i:02d}.txt").write_text(f"document {i}")
    src = SourceConfig(kind="local_dir", path=str(root), glob="*.txt")
    opened, real = collections.Counter(), builtins.open

    def counting(path, *args, **kwargs):
        if str(path).startswith(str(root)):
            opened[path] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    seen = []
    for rank in range(4):
        opened.clear()
        rows = [r["text"] for r in stream_source(src, str(tmp_path / "cache"), "x", rank, 4, range(0, 2))]
        assert sum(opened.values()) == len(rows) in (9, 10), (rank, len(rows), sum(opened.values()))
        seen += rows
    assert sorted(seen) == sorted(f"document {i}" for i in range(2, 40))


@pytest.mark.parametrize("bad_line, problem", [(b'{"text": "broken\n', "not JSON"),
                                               (b'{"text": "bad \xff bytes"}\n', "not UTF-8")])
def test_a_bad_record_met_mid_stream_names_the_file_and_line(tmp_path, setup, bad_line, problem):
    """A record the reader cannot decode, met while the stream is read (past the first record, which validation
    reads), fails naming the file and line as the in-memory read does (it was datasets' bare "Trailing data")."""
    _, tok, d = setup
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} " + "word " * 40}) + "\n"
                                              for i in range(40)))
    f = tmp_path / "b.jsonl"  # the second file: validation reads the first file's first record only
    f.write_bytes(b'{"text": "one"}\n{"text": "two"}\n' + bad_line + b'{"text": "after"}\n')
    cfg = DataConfig(sources={"bad": SourceConfig(kind="files", path=str(tmp_path / "*.jsonl"))}, streaming=True,
                     eval_sequences=1)
    with pytest.raises(ValueError, match=re.escape(f"data.sources.bad.path: {f}:3: {problem}")):
        loader, _, _ = streaming_stage(cfg, tok, L, tok.pad_token_id, None, MB, 0, 1, d)  # its held-out head
        for _ in range(200):  # or training
            next(loader)


def _bad_record_on_rank1_worker(rank, world, root):
    from longstride.recipes.run.faults import stage_input
    from longstride.recipes.run.step import next_micro_batches

    docs = corpus_docs("d", 40, rank)
    good = write_jsonl(os.path.join(root, f"good{rank}.jsonl"), docs)
    path = good if rank == 0 else os.path.join(root, "b*.jsonl")  # rank 1's second file has a bad third record
    cfg = DataConfig(sources={"bad": SourceConfig(kind="files", path=path)}, streaming=True, eval_sequences=1)
    tok = train_bpe(docs, 300)
    loader, _, _ = streaming_stage(cfg, tok, L, tok.pad_token_id, None, MB, 0, 1, os.path.join(root, f"c{rank}"))
    step = 0
    try:
        for step in range(1, 300):
            with stage_input("s1"):  # as the stage's step reads it: exit 2 on every rank
                next_micro_batches(loader, 2, lambda b: (b, None))
        said = "no error"
    except Exception as e:  # noqa: BLE001 - what each rank raised is the test's subject
        said = f"{type(e).__name__}: {e}"
    with open(os.path.join(root, f"rank{rank}.txt"), "w") as f:
        f.write(f"step {step}: {said}")


@pytest.mark.timeout(120)  # before the fix, rank 0 waited in the all-reduce for the collective timeout
def test_a_bad_record_met_by_one_rank_stops_every_rank_at_that_step(tmp_path):
    """A streamed record one data-parallel rank cannot decode, met mid-stage: that rank raised while the others
    waited in the step's token-count all-reduce until the launcher or the collective timeout ended them. Every rank
    now leaves at that step: the failing one with its own error, the others naming another rank."""
    from longstride.parallel.spawn import run_gloo

    write_jsonl(tmp_path / "b1.jsonl", corpus_docs("e", 1100, 5))  # past the first 1000 rows tokenized
    (tmp_path / "b2.jsonl").write_bytes(b'{"text": "one"}\n{"text": "two"}\n{"text": "broken\n{"text": "after"}\n')
    run_gloo(_bad_record_on_rank1_worker, 2, str(tmp_path))
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    step = said[1].split(":")[0]
    assert re.fullmatch(r"step \d+", step) and step != "step 1", said  # mid-stage: past the first step
    assert said[1].startswith(f"{step}: StageInputError: stage s1: data.sources.bad.path: {tmp_path}/b2.jsonl:3: not "
                              "JSON"), said
    assert said[0] == f"{step}: StageInputError: stage s1: another rank failed to read or prepare this step's data " \
                      "(its log says why)", said
