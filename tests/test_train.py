"""The recipe runner end to end on a micro recipe: stages chain, bases bump, resume is exact."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from longstride.data.batch import PackedSequences
from longstride.data.loader import EpochLoader
from longstride.data.packing import pack
from longstride.recipes.train import run
from tests.conftest import compose_cfg, crash_after, read_metrics, run_cli


def test_recipe_chains_stages_and_bumps_rope_base(micro, tmp_path):
    cfg = compose_cfg(micro)
    finals = run(cfg)
    assert [os.path.basename(os.path.dirname(f)) for f in finals] == ["s1_256", "s2_2k", "s3_4k"]
    prev, val = None, []  # val: each stage's validation loss at its start and end (the same held-out documents)
    for final, (name, stage) in zip(finals, cfg.recipe.stages.items()):
        model = AutoModelForCausalLM.from_pretrained(final)
        assert model.config.rope_parameters["rope_theta"] == stage.rope_theta
        assert model.config.no_rope_layers == [1, 0], "NoPE on every 2nd layer in the micro model"
        assert model.config.max_position_embeddings >= stage.seq_len
        AutoTokenizer.from_pretrained(final)
        if prev is not None:  # the stage started from the previous one's weights, then trained
            init = dict(prev.named_parameters())
            diffs = [float((p - init[n]).abs().max().detach()) for n, p in model.named_parameters()]
            assert 0 < max(diffs) < 1.0
        prev = model
        metrics = read_metrics(tmp_path / "out" / "tiny" / name)
        assert sorted(metrics) == list(range(0, stage.steps + 1))
        assert "val_loss" in metrics[0] and "val_loss" in metrics[stage.steps]
        val.append((metrics[0]["val_loss"], metrics[stage.steps]["val_loss"]))
        assert metrics[1]["rope_theta"] == stage.rope_theta and metrics[1]["seq_len"] == stage.seq_len
        # every position of the batch against those with a loss (no padding, no document's last token)
        assert all(0 < m["loss_tokens_per_s"] < m["tokens_per_s"] for s, m in metrics.items() if s)
    # each stage starts where the one before ended (its RoPE base bumped), not from a fresh model (s1's start)
    fresh = val[0][0]
    for (_, end), (start, _) in zip(val, val[1:]):
        assert start == pytest.approx(end, abs=0.05) and fresh - start > 0.2, val
    # Rerunning a finished recipe trains nothing and keeps the checkpoints.
    before = os.path.getmtime(os.path.join(finals[-1], "model.safetensors"))
    run(cfg)
    assert os.path.getmtime(os.path.join(finals[-1], "model.safetensors")) == before


def test_stage_loss_falls(tmp_path, cache_dir):
    from tests.conftest import micro_overrides

    cfg = compose_cfg(micro_overrides(tmp_path / "out", cache_dir) + [
        "stage=s1_256", "recipe.stages.s1_256.steps=30", "recipe.stages.s1_256.lr=3e-3",
        "recipe.stages.s1_256.save_every=0"])
    run(cfg)
    metrics = read_metrics(tmp_path / "out" / "tiny" / "s1_256")
    losses = [metrics[s]["loss"] for s in range(1, 31)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
    assert metrics[30]["val_loss"] < metrics[0]["val_loss"] - 0.3, "held-out loss falls too"
    meta = json.loads((tmp_path / "out" / "tiny" / "s1_256" / "final" / "stage.json").read_text())
    assert meta["val_loss_end"] == metrics[30]["val_loss"]


def test_sigkill_mid_stage_then_rerun_resumes_bitwise(tmp_path, cache_dir):
    from tests.conftest import micro_overrides

    crashed = micro_overrides(tmp_path / "crash", cache_dir)
    clean = micro_overrides(tmp_path / "clean", cache_dir)
    first = run_cli(crashed + ["stage=s1_256"])
    assert first.returncode == 0, first.stderr[-2000:]
    # s1 is complete and skipped; s2 saves at step 2 and is SIGKILLed after step 3.
    r = run_cli(crashed, crash_after(3))
    assert r.returncode == -9, r.stderr[-2000:]
    stage_dir = tmp_path / "crash" / "tiny" / "s2_2k"
    assert (stage_dir / "step_000002").is_dir() and not (stage_dir / "final").exists()
    resumed = run_cli(crashed)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr + resumed.stdout
    ref = run_cli(clean)
    assert ref.returncode == 0, ref.stderr[-2000:]
    # the run's held-out documents, chosen once for its three stages (64, 128, 256 tokens): per stage, the shorter
    # ones would hold out fewer
    held = re.findall(r"'held_out_documents': (\{[^}]*\})", ref.stderr)
    assert len(held) == 3 and len(set(held)) == 1, held
    for stage in ("s1_256", "s2_2k", "s3_4k"):
        a = read_metrics(tmp_path / "crash" / "tiny" / stage)
        b = read_metrics(tmp_path / "clean" / "tiny" / stage)
        assert sorted(a) == sorted(b)
        assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)], stage  # bitwise
        assert a[max(a)]["val_loss"] == b[max(b)]["val_loss"]
    wa = AutoModelForCausalLM.from_pretrained(tmp_path / "crash" / "tiny" / "s3_4k" / "final").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(tmp_path / "clean" / "tiny" / "s3_4k" / "final").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_loader_resume_yields_identical_sequences():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 90, 300)
    tokens = np.arange(lens.sum(), dtype=np.int32)
    plan, _ = pack(np.concatenate([[0], np.cumsum(lens)[:-1]]), lens, 64, "best_fit")
    ds = PackedSequences(tokens, plan, pad_id=0)
    full = EpochLoader(ds, 4, rank=1, world=2, seed=7)
    expected = [next(full)["input_ids"] for _ in range(40)]  # crosses several epochs
    part = EpochLoader(ds, 4, rank=1, world=2, seed=7)
    for _ in range(13):
        next(part)
    state = part.state_dict()
    resumed = EpochLoader(ds, 4, rank=1, world=2, seed=7)
    resumed.load_state_dict(state)
    for i in range(13, 40):
        assert torch.equal(next(resumed)["input_ids"], expected[i]), i
    other = EpochLoader(ds, 4, rank=0, world=2, seed=7)
    mine = {tuple(x.tolist()) for b in expected[:5] for x in b}
    theirs = {tuple(x.tolist()) for b in [next(other)["input_ids"] for _ in range(5)] for x in b}
    assert not mine & theirs, "data-parallel ranks read disjoint sequences"
    fewer = PackedSequences(tokens, dataclasses.replace(plan, seq_ptr=plan.seq_ptr[:-1]), pad_id=0)
    with pytest.raises(ValueError, match=f"epoch of {len(ds)} packed sequences, but this stage now packs {len(ds) - 1}"):
        EpochLoader(fewer, 4, rank=1, world=2, seed=7).load_state_dict(state)
    with warnings.catch_warnings():  # torchdata's constructor warns under this torch; the stage logs stay clean
        warnings.simplefilter("error")
        EpochLoader(ds, 4, rank=0, world=2, seed=7)


def test_a_resume_over_changed_data_is_refused_and_resume_data_false_starts_it_afresh(tmp_path, cache_dir):
    """A stage killed after its step-3 checkpoint, then one digit of one of its source files changed: every
    document keeps its token count (asserted: byte-level pre-tokenisation splits a digit off from the letters before
    it), so the packing plan and the sequence count (what the loader's own check compares) stay the same, but the
    rerun's data position would name other tokens; it exits 2 naming the stage, the checkpoint and the fixes. With train.resume_data=false the rerun keeps the checkpoint's
    weights and step and starts the data afresh."""
    from longstride.data.files import list_files, stdlib_root
    from tests.conftest import micro_overrides

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, path in enumerate(list_files(stdlib_root(), "**/*.py")[:60]):
        (docs / f"{i:03d}.py").write_text(open(path, encoding="utf-8").read(), encoding="utf-8")
    run_args = micro_overrides(tmp_path / "out", cache_dir) + [
        "stage=s1_256", "data.sources.stdlib.kind=local_dir", f"data.sources.stdlib.path={docs}",
        "data.sources.stdlib.glob=*.py"]
    killed = run_cli(run_args, crash_after(4))
    assert killed.returncode == -9, killed.stderr[-2000:]
    last = docs / "059.py"  # past the tokenizer's training bytes: the tokenizer stays the same
    text = last.read_text(encoding="utf-8")
    at = max(i for i, c in enumerate(text) if c.isdigit())
    last.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:], encoding="utf-8")
    refused = run_cli(run_args)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert re.search(r"stage s1_256: .*step_000003 was written over other data: an edited, added or removed source .*"
                     r"train.resume_data=false.*train.resume=false", refused.stderr), refused.stderr[-2000:]
    afresh = run_cli(run_args + ["train.resume_data=false"])
    assert afresh.returncode == 0, afresh.stderr[-2000:]
    counts = re.findall(r"packing \{'seq_len': 64, 'sequences': (\d+)", killed.stderr + afresh.stderr)
    assert len(counts) == 2 and counts[0] == counts[1], counts  # the count check alone would have resumed
    tokens = re.findall(r"corpus: .*'tokens': (\{[^}]*\})", killed.stderr + afresh.stderr)
    assert len(tokens) == 2 and tokens[0] == tokens[1], tokens  # so would a fingerprint of the plan's spans alone
    assert "resuming from" in afresh.stderr and "its data from the start of the epoch" in afresh.stderr
    assert sorted(read_metrics(tmp_path / "out" / "tiny" / "s1_256")) == list(range(7))  # steps 4-6 after 0-3


def test_a_checkpoint_without_a_data_fingerprint_or_under_another_tokenizer_is_refused(tmp_path):
    """A checkpoint from before the fingerprint cannot show its data position is this data's: refused unless
    train.resume_data=false. One trained with another tokenizer (a BPE retrained on changed texts, or another EOS)
    is refused, a checkpoint from before the fingerprint by the tokenizer saved in it; the same tokenizer saved and
    loaded back has the same fingerprint."""
    from longstride.data.tokenizer import load_tokenizer, tokenizer_fingerprint, train_bpe
    from longstride.recipes.run.stage_state import check_same_tokenizer, data_problem

    assert "was written by a longstride that recorded no data fingerprint" in data_problem(None, "d")
    assert "was written over other data" in data_problem("e", "d")
    assert data_problem("d", "d") is None
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(50)]
    one, other = train_bpe(texts, 300), train_bpe(texts[::2] + ["class A:\n    pass\n"] * 9, 300)
    one.save_pretrained(tmp_path / "ck")
    assert tokenizer_fingerprint(load_tokenizer(str(tmp_path / "ck"))) == tokenizer_fingerprint(one)
    with pytest.raises(ValueError, match=r"ck was trained with another tokenizer .*data.tokenizer=<the copy> "
                                         r"train.resume_from=\S*ck train.resume_data=false"):
        check_same_tokenizer(tokenizer_fingerprint(one), other, str(tmp_path / "ck"))
    with pytest.raises(ValueError, match="another tokenizer"):  # no fingerprint: the tokenizer saved in it
        check_same_tokenizer(None, other, str(tmp_path / "ck"))
    check_same_tokenizer(None, one, str(tmp_path / "ck"))
    check_same_tokenizer(tokenizer_fingerprint(one), one, str(tmp_path / "ck"))
    # the same texts to ids, but another EOS between documents (an edited tokenizer_config.json): refused, where the
    # fingerprint of before (a checkpoint's written then, without EOS, BOS and padding) is taken as it was
    eos_changed = load_tokenizer(str(tmp_path / "ck"))
    eos_changed.eos_token = eos_changed.pad_token
    assert tokenizer_fingerprint(eos_changed, legacy=True) == tokenizer_fingerprint(one, legacy=True)
    with pytest.raises(ValueError, match="another tokenizer"):
        check_same_tokenizer(tokenizer_fingerprint(one), eos_changed, str(tmp_path / "ck"))
    check_same_tokenizer(tokenizer_fingerprint(one, legacy=True), one, str(tmp_path / "ck"))
    with pytest.raises(ValueError, match="another tokenizer"):
        check_same_tokenizer(tokenizer_fingerprint(one, legacy=True), other, str(tmp_path / "ck"))


def test_checkpoint_dir_that_does_not_exist(micro):
    cfg = compose_cfg(micro + ["stage=s3_4k"])
    with pytest.raises(ValueError, match="run stage=s2_2k"):
        run(cfg)


def _one_vs_two_processes(tmp_path, cache_dir, extra, expect: str | list, crash_at: int | None = None,
                          one: Path | None = None, absent: tuple = ()) -> None:
    """Runs stage s1 in one process (or reads `one`, a stage folder of that run: the suite's s1_reference) and under
    accelerate launch with the 2-process CPU config (gloo); the losses must agree up to reduction order. crash_at:
    the 2-process run is first SIGKILLed after that step, then rerun, and resumes from its last checkpoint. expect:
    texts its output holds; absent: texts it must not."""
    import subprocess

    from tests.conftest import REPO, accelerate_launch, micro_overrides

    def overrides(root, two):
        return [o for o in micro_overrides(root, cache_dir) if "micro_batch_size" not in o] + [
            "stage=s1_256", "recipe.stages.s1_256.micro_batch_size=4", *extra(two)]

    if one is None:
        ran = run_cli(overrides(tmp_path / "one", False))
        assert ran.returncode == 0, ran.stderr[-2000:]
        one = tmp_path / "one" / "tiny" / "s1_256"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def launch(extra=None):
        args = overrides(tmp_path / "two", True)
        if extra:  # the killed run traces nothing: only the resumed run's trace is read
            args = [a for a in args if a != "train.trace_memory=true"]
        return subprocess.run([*accelerate_launch(), "-m", "longstride.recipes.train", *args], cwd=REPO,
                              env={**env, **(extra or {})}, capture_output=True, text=True, timeout=600)
    if crash_at is not None:
        killed = launch(crash_after(crash_at))
        assert killed.returncode != 0 and not (tmp_path / "two" / "tiny" / "s1_256" / "final").exists()
    two = launch()
    assert two.returncode == 0, two.stderr[-3000:]
    if crash_at is not None:
        assert "resuming from" in two.stderr + two.stdout
    for text in [expect] if isinstance(expect, str) else expect:
        assert text in two.stderr + two.stdout, text
    for text in absent:
        assert text not in two.stderr + two.stdout, text
    a, b = read_metrics(one), read_metrics(tmp_path / "two" / "tiny" / "s1_256")
    assert sorted(a) == sorted(b)
    for s in a:
        # grad_norm too: Adam barely notices a gradient off by a constant factor, so losses alone would not
        for key in ("loss", "val_loss", "grad_norm"):
            if key in a[s]:
                assert b[s][key] == pytest.approx(a[s][key], rel=1e-5, abs=1e-6), (s, key)
    assert all("grad_norm" in m for m in a.values() if "loss" in m), "every step logs its gradient norm"
    for s in (s for s in a if "tflops" in a[s]):  # the same batches' model FLOPs (recipes/run/flops.py), per rank
        assert 2 * b[s]["tflops"] / b[s]["tokens_per_s"] == pytest.approx(a[s]["tflops"] / a[s]["tokens_per_s"],
                                                                           rel=1e-9), s
    assert sorted(p.name for p in (tmp_path / "two" / "tiny" / "s1_256" / "step_000003").glob("rank*.pt")) == \
        ["rank0.pt", "rank1.pt"]


def test_two_process_data_parallel_matches_one_process(tmp_path, cache_dir):
    """dp=2 x accumulation 2 sees the same sequences as dp=1 x accumulation 4."""
    _one_vs_two_processes(tmp_path, cache_dir, lambda two: ["recipe.stages.s1_256.batch_tokens=1024"], "dp 2, cp 1")


def test_two_process_context_parallel_matches_one_process(tmp_path, cache_dir, s1_reference):
    """cp=2 (zig-zag ring attention, documents masked) on 2 ranks sees the same sequences as one process
    with cp=1: each rank holds half of every sequence, and the loss is normalised by the global count."""
    _one_vs_two_processes(tmp_path, cache_dir, lambda two: [f"recipe.stages.s1_256.cp={2 if two else 1}"],
                          "dp 1, cp 2", one=s1_reference)


def test_fsdp2_with_context_parallel_resumes_and_matches_one_process(tmp_path, cache_dir, s1_reference):
    """FSDP2 over the dp x cp ranks (parameters and optimizer state sharded, forced on for CPU) with
    cp=2, full activation checkpointing and the layers tiled in 16-token tiles (tiled ops return their
    parameters' gradients through autograd, which FSDP2 reduces), killed after step 4 and rerun: the
    losses still equal the plain one-process run's, and so does its final's every tensor. Rank 0 also traces each
    stage's step (recipes/memory/trace.py, in a child process beside the real process group) and logs it beside the
    analytic estimate."""
    lean = ["model.activation_checkpointing=true", "model.mlp_tile_tokens=16", "train.trace_memory=true"]
    _one_vs_two_processes(tmp_path, cache_dir, lambda two: [f"recipe.stages.s1_256.cp={2 if two else 1}",
                                                            f"parallel.fsdp={'true' if two else 'false'}",
                                                            *(lean if two else [])],
                          ["model FSDPChunkedLossLM", "activation checkpointing full; MLP tile 16",
                           "stage s1_256: traced step per rank", "device mesh: 2 ranks, built once for the run"],
                          crash_at=4, one=s1_reference)
    from safetensors.torch import load_file

    two, one = (load_file(str(stage / "final" / "model.safetensors")) for stage in (tmp_path / "two" / "tiny" /
                                                                                    "s1_256", s1_reference))
    assert two.keys() == one.keys(), "FSDP2's final holds the same tensors as one process's (a tie once)"
    # and the same values: after the kill, the resume and 6 AdamW steps each tensor is within 1e-4 of its largest
    # entry (measured 1e-5: reduction order, which Adam's normalised steps carry into the weights)
    gap = {k: ((two[k] - one[k]).abs().max() / one[k].abs().max()).item() for k in one}
    assert max(gap.values()) < 1e-4, sorted(gap.items(), key=lambda kv: -kv[1])[:3]


def test_two_process_upipe_matches_one_process(tmp_path, cache_dir, s1_reference):
    """cp=2 with UPipe (Ulysses all-to-all in 2 stages of 2 query heads), selective activation
    checkpointing of the first layer only and the MLP tiled in 16-token tiles, through accelerate launch: the losses
    equal the plain one-process run's."""
    lean = ["model.activation_checkpointing=true", "model.checkpoint_mode=selective", "model.mlp_tile_tokens=16",
            "recipe.stages.s1_256.checkpoint_layers=1"]
    _one_vs_two_processes(tmp_path, cache_dir, lambda two: [f"recipe.stages.s1_256.cp={2 if two else 1}",
                                                            "parallel.cp_impl=upipe", "parallel.upipe_heads=2",
                                                            *(lean if two else [])],
                          ["cp 2 upipe: ulysses 2, 2 heads per stage",
                           "activation checkpointing selective (the first 1 of 2 layers); MLP tile 16"],
                          one=s1_reference)


def test_a_streaming_stage_killed_on_two_processes_resumes_on_one(tmp_path, cache_dir):
    """data.streaming=true over 2 data-parallel processes, killed after step 4 (checkpoint at step 3), resumed on one
    process: the two ranks' stream positions are re-split (data/stream_split.py, whose tests check the rows) and the
    stage trains on to its end from step 3."""
    from tests.conftest import micro_overrides
    from tests.test_faults import start

    args = micro_overrides(tmp_path, cache_dir) + ["stage=s1_256", "data.streaming=true"]
    proc = start(args, launcher=True, env_extra=crash_after(4))
    out, _ = proc.communicate(timeout=600)
    stage = tmp_path / "tiny" / "s1_256"
    assert proc.returncode != 0 and (stage / "step_000003").is_dir(), out[-3000:]
    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 3); its stream positions re-split from 2 to 1 data-parallel ranks" in resumed.stderr
    m = read_metrics(stage)
    assert sorted(m) == list(range(7)) and all(np.isfinite(m[s]["loss"]) for s in range(1, 7))


def test_a_streaming_stage_killed_as_a_ring_of_two_resumes_on_one_process_with_the_same_data(tmp_path, cache_dir):
    """data.streaming=true as cp=2 x dp=1, killed after step 4 (checkpoint at step 3), continued from step 3 as
    cp=1 on one process (train.resume_from: the config changed): the same data-parallel rank's stream position is
    read (rank 0's of the ring), nothing is re-split, and steps 4-6 see the sequences of an uninterrupted one-process
    streaming run (losses within 1e-5: the ring reduces in another order)."""
    from tests.conftest import micro_overrides
    from tests.test_faults import start

    def args(root, cp):
        return micro_overrides(root, cache_dir) + ["stage=s1_256", "data.streaming=true",
                                                   f"recipe.stages.s1_256.cp={cp}"]

    proc = start(args(tmp_path / "x", 2), launcher=True, env_extra=crash_after(4))
    out, _ = proc.communicate(timeout=600)
    stage = tmp_path / "x" / "tiny" / "s1_256"
    assert proc.returncode != 0 and (stage / "step_000003").is_dir(), out[-3000:]
    resumed = run_cli(args(tmp_path / "x", 1) + [f"train.resume_from={stage / 'step_000003'}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {stage / 'step_000003'}" in resumed.stderr and "re-split" not in resumed.stderr
    clean = run_cli(args(tmp_path / "clean", 1))
    assert clean.returncode == 0, clean.stderr[-3000:]
    a, b = read_metrics(stage), read_metrics(tmp_path / "clean" / "tiny" / "s1_256")
    assert sorted(a) == sorted(b) == list(range(7))
    for s in range(1, 7):
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-5), s


def test_a_streamed_stage_goes_on_from_where_the_stage_before_stopped(tmp_path, cache_dir):
    """data.streaming=true: s1_256 on 2 data-parallel processes, then s2_2k on one. s2_2k's streams start at s1_256's
    final positions re-split from 2 ranks to 1 (the rows past what s1 read, s1's pending pieces packed first: the
    rows are checked in tests/test_stream_split.py). Rerun from s1_256's final with the stdlib source's files
    changed (train.resume_from: s2_2k and s3_4k again), its stream starts from the beginning, the log says why."""
    from tests.conftest import micro_overrides
    from tests.test_faults import start

    args = micro_overrides(tmp_path, cache_dir) + ["data.streaming=true"]
    first = start(args + ["stage=s1_256"], launcher=True)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:]
    final = tmp_path / "tiny" / "s1_256" / "final"
    s1 = [torch.load(final / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [s["dp"] for s in s1] == [2, 2] and s1[0]["origin"] == s1[1]["origin"] and s1[0]["tokenizer"]
    second = run_cli(args + ["stage=s2_2k"])
    assert second.returncode == 0, second.stderr[-3000:]
    pending = sum(len(seq) for s in s1 for seq in s["data"]["dataset_state"]["packer"]["open"] +
                  s["data"]["dataset_state"]["packer"]["ready"])
    assert pending and (f"stage s2_2k: from {final}; its streams go on from {final}'s positions; {pending} pending "
                        "document pieces packed first") in second.stderr
    s2 = torch.load(tmp_path / "tiny" / "s2_2k" / "final" / "rank0.pt", weights_only=True)["data"]["dataset_state"]
    split = s2["splits"]["stdlib"]  # the re-split share s2 reads: past every row either rank of s1 read
    read = [s["data"]["dataset_state"]["counters"]["epoch_rows"]["stdlib"] for s in s1]
    assert split["ways"] == 1 and split["tail"] + len(split["gaps"]) >= 2 * min(read) > 0
    again = run_cli(args + [f"train.resume_from={final}", "data.sources.stdlib.max_docs=50",
                            "recipe.stages.s3_4k.steps=2"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"its streams from their beginning (['stdlib']: changed since {final}, from their beginning)" in \
        again.stderr


def test_streaming_stage_sigkill_then_rerun_resumes_exactly(tmp_path, cache_dir):
    """data.streaming=true: the stage reads the stdlib files lazily and packs online; killed after step
    4 (checkpoint at step 3) and rerun, its losses equal an uninterrupted streaming run's bitwise."""
    from tests.conftest import micro_overrides

    def run(root, env=None):
        return run_cli(micro_overrides(root, cache_dir) + ["stage=s1_256", "data.streaming=true"], env)

    killed = run(tmp_path / "crash", crash_after(4))
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run(tmp_path / "crash")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr + resumed.stdout and "'streaming': True" in resumed.stderr + resumed.stdout
    clean = run(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-2000:]
    a, b = read_metrics(tmp_path / "crash" / "tiny" / "s1_256"), read_metrics(tmp_path / "clean" / "tiny" / "s1_256")
    assert sorted(a) == sorted(b) and len(a) >= 6
    assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)]
    assert a[max(a)]["val_loss"] == b[max(b)]["val_loss"]


def test_a_later_stage_s_long_document_upsampling_is_checked_before_the_first_stage_trains(tmp_path, cache_dir):
    """s3_4k's long_docs asks for documents longer than any the corpus holds: found when s3 built its data, after s1
    and s2 had trained; now exit 2 at the start, naming the stage's field, nothing trained."""
    from tests.conftest import micro_overrides

    r = run_cli(micro_overrides(tmp_path, cache_dir) + ["recipe.stages.s3_4k.long_docs={min_tokens:10000000,"
                                                        "min_share:0.3}"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("recipe.stages.s3_4k.long_docs.min_tokens=10000000 for stage s3_4k: no document the stage draws from "
            "['stdlib'] is that long") in r.stderr
    assert not (tmp_path / "tiny" / "s1_256" / "metrics.jsonl").exists()
