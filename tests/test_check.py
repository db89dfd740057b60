"""`longstride check` (recipes/check/command.py) on tiny random models of transformers' own classes saved as checkpoints
with a tiny BPE tokenizer, on a corpus of short documents the test writes (several documents per packed row, so
windows and chunks cross document and CP-chunk boundaries): Mistral (one sliding window for every layer), Gemma 3
(local + global layers), Gemma 2 (local + global layers, soft-capped scores), GPT-OSS (sinks + windows) and Llama 4
(chunked + NoPE layers), the configs of tests/test_attention_patterns.py MODELS, pass under ring cp=2, with the
one-device run also matching the model's own eager attention.

The injected mistake: LONGSTRIDE_TEST_CHECK_FAULT=cp_drops_window (recipes/check/command.py's test hook, injected by
recipes/check/runs.py) makes every CP method compute each layer without its sliding window while the one-device
and eager runs keep it, as a CP method that ignored the layer's pattern would. The check must exit 1 and name
layer 0, a sliding_attention layer, as the first layer whose output differs. Bad input (a missing checkpoint, a
seq_len the CP layout cannot cut, a kernel without the model's soft-cap) exits 2 before any compute, naming the field.
"""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from longstride import cli
from longstride.recipes.check import command as check, runs as check_runs
from tests.test_attention_patterns import MODELS, make_matter

WINDOW = 16  # sliding window / chunk: smaller than a CP chunk (128 tokens / 4 = 32) and than most documents
SEQ_LEN = 128


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(folder, tokenizer): a BPE of 300 tokens trained on a few stdlib files, and docs.jsonl of 60 documents of 1
    to 3 words or 5 to 8 (about 3 to 50 tokens), cut from the same text: its first packed row of 128 tokens holds
    6 documents of 10 to 25 tokens."""
    from longstride.data.files import list_files, stdlib_root
    from longstride.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("check")
    texts = [open(p, encoding="utf-8").read() for p in list_files(stdlib_root(), "**/*.py")[:10]]
    tok = train_bpe(texts, 300)
    words, rng = " ".join(texts).split(), random.Random(0)
    with open(root / "docs.jsonl", "w") as fh:
        for _ in range(60):
            n, start = rng.randint(1, 3) if rng.random() < 0.8 else rng.randint(5, 8), rng.randrange(len(words) - 20)
            fh.write(json.dumps({"text": " ".join(words[start:start + n])}) + "\n")
    return root, tok


def save_checkpoint(root, tok, name: str) -> str:
    """MODELS[name] at WINDOW, sized to the tokenizer, saved with it (sinks and soft-caps made to matter)."""
    make, cls = MODELS[name]
    config = make(WINDOW)
    config.vocab_size, config.eos_token_id, config.pad_token_id = len(tok), tok.eos_token_id, tok.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = make_matter(cls(config))
    path = root / name
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def argv(root, checkpoint: str, *extra: str) -> list[str]:
    return [f"checkpoint={checkpoint}", "data=files", f"data.sources.main.path={root}/docs.jsonl", "data.num_proc=1",
            "data.eval_sequences=1", f"paths.cache_dir={root}/cache", f"seq_len={SEQ_LEN}", *extra]


def test_check_passes_on_a_model_of_another_layout(corpus, capsys):
    """GPT-NeoX keeps its decoder under gpt_neox: the check hooks the decoder get_decoder names, not lm.model."""
    root, tok = corpus
    rep = check.check(argv(root, save_checkpoint(root, tok, "gpt_neox"), "parallel.cp_impl=ring", "cp=2"))
    assert rep.ok, capsys.readouterr().out


@pytest.mark.parametrize("name", ["mistral", "gemma3", "gemma2", "gpt_oss", "llama4"])
def test_check_passes_on_models_with_windows_chunks_and_sinks(name, corpus, capsys):
    root, tok = corpus
    rep = check.check(argv(root, save_checkpoint(root, tok, name), "parallel.cp_impl=ring", "cp=2"))
    out = capsys.readouterr().out
    assert rep.ok, out
    assert [c.title for c in rep.comparisons] == ["1 device vs eager", "ring cp=2 vs 1 device"]
    kind = {"mistral": "sliding_attention", "gemma3": "sliding_attention", "gemma2": "sliding_attention",
            "gpt_oss": "sliding_attention", "llama4": "chunked_attention"}[name]
    assert ("output", kind) in rep.comparisons[1].cells and ("grad", "other") in rep.comparisons[1].cells
    if name == "gemma2":  # soft-capped scores: the kernel auto picks is the math one, on one device and in the ring
        assert "scores soft-capped at 2" in out and "1 device: kernel math" in out and "kernel math, balance" in out
    assert f"{'chunk' if name == 'llama4' else 'window'} {WINDOW}" in out and "check passed" in out
    docs, longest = map(int, re.search(r"(\d+) documents \(longest (\d+) tokens\)", out).groups())
    assert docs >= 4 and longest > WINDOW, "several documents per row, longer than the window: all are exercised"


@pytest.mark.timeout(300)
def test_launched_check_runs_on_torchrun_and_bad_data_ends_every_rank(corpus, tmp_path):
    """Under torchrun (check_launched): rank 0 reads the batch and sends it, every rank runs its CP share, rank 0
    compares and every rank exits with its verdict (before, no test ran this path). Data rank 0 cannot read ends
    the launch, exit 2, naming it (rank 0's reading goes through collectives.from_main: any exception it raises
    reaches the others, where before only a ValueError did and another left them waiting)."""
    import os
    import subprocess
    import sys

    root, tok = corpus
    good = save_checkpoint(root, tok, "mistral")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a line"}\n{"text": \n')  # a record cut off: the reader names the file and line

    def launched(*args):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               "2", "-m", "longstride.recipes.check", *args], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)

    ok = launched(*argv(root, good, "parallel.cp_impl=ring", "cp=2"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.count("check passed") == 1 and "2 launched processes (gloo)" in ok.stdout, ok.stdout[-3000:]
    failed = launched(*[a.replace(f"{root}/docs.jsonl", str(bad)) for a in argv(root, good)], "cp=2",
                      f"paths.cache_dir={tmp_path}/cache")
    # bad input, exit 2, naming the file (torchrun ends the other rank once the first exits: it may not get to say it)
    assert re.search(r"exitcode\s*: 2 ", failed.stderr) and f"data.sources.main.path: {bad}:2: not JSON" in \
        failed.stderr, failed.stderr[-3000:]


def test_check_fails_naming_the_layer_type_when_cp_drops_the_window(corpus, capsys, monkeypatch):
    root, tok = corpus
    monkeypatch.setenv(check.TEST_FAULT, "cp_drops_window")  # read by the gloo processes the check starts
    with pytest.raises(SystemExit) as e:
        cli.main(["check", *argv(root, save_checkpoint(root, tok, "gemma3"), "cp=2")])
    out = capsys.readouterr().out
    assert e.value.code == 1, out
    failed = [line for line in out.splitlines() if line.startswith("check FAILED")]
    assert len(failed) == 1 and failed[0].startswith("check FAILED: ring cp=2 vs 1 device"), out
    assert "first layer whose output differs: layer 0 (sliding_attention)" in failed[0], out
    assert "1 device vs eager" not in failed[0], "the one-device reference keeps the window"


def test_bad_input_fails_before_compute_naming_the_field(corpus, tmp_path, capsys, monkeypatch):
    root, tok = corpus

    def computed(*args, **kwargs):
        raise AssertionError("bad input must fail before the data is read or a model is built")

    monkeypatch.setattr(check, "stage_batch", computed)  # where the command reads the data
    monkeypatch.setattr(check_runs, "load_model", computed)  # where every run builds its model
    gemma2 = save_checkpoint(root, tok, "gemma2")
    good = save_checkpoint(root, tok, "mistral")
    cases = [(argv(root, str(tmp_path / "missing")), "checkpoint="),
             (argv(root, good, "cp=2", "seq_len=126"), "seq_len=126"),
             (argv(root, gemma2, "parallel.kernel=sdpa"), "parallel.kernel=sdpa has no logit soft-capping"),
             (argv(root, good, "cp=3", "parallel.cp_impl=ulysses"), "must divide the model's 4 query heads"),
             (argv(root, good, "model.loss_tile_tokens=0"), "model.loss_tile_tokens=0 must be >= 1"),  # training's
             (argv(root, good, "parallel.kernel=torch_flash"), "compares in fp32"),  # bf16-only kernels
             # a checkpoint named without model=checkpoint: training's refusal, not a check of a new model
             (["recipe=tiny", f"model.checkpoint={good}", *argv(root, good)[1:]],
              f"model.checkpoint={good} is read only with model.arch=checkpoint")]
    for args, expect in cases:
        with pytest.raises(SystemExit) as e:
            cli.main(["check", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and expect in err and "Traceback" not in err, (args, err)


def test_help_lists_the_options_and_not_the_test_hook(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "tolerance=0.0001" in out and "seq_len=0" in out and "cp=0" in out
    assert check.TEST_FAULT not in out


def _packed(*rows: list) -> dict:
    """A PackedBatch from rows of document lengths (tokens 1.., every document labelled but its last token)."""
    from longstride.data.batch import collate, packed_item

    L = max(sum(r) for r in rows)
    return collate([packed_item([np.arange(1, n + 1) for n in r], L, 0) for r in rows])


@pytest.mark.parametrize("name, rows, doc_masking, expect", [
    ("mistral", ([10, 20], [30]), True, []),  # two documents in a row, one longer than the window
    ("mistral", ([10, 12], [15, 3]), True, ["the 16-token window (the longest document has 15 tokens)"]),
    ("llama4", ([40], [50]), True, ["document masks (no row holds two documents)"]),
    ("llama4", ([10, 1], [12]), True, ["document masks (no row holds two documents)",
                                       "the 16-token chunk (the longest document has 12 tokens)"]),
    ("gemma3", ([5, 5, 7],), False, []),  # without document masks the window cuts the 17-token row
    ("gemma3", ([5, 5, 6],), False, ["the 16-token window (the longest row has 16 tokens)"]),
    ("llama", ([3], [4]), False, []),  # plain causal, no document masks: nothing to miss
])
def test_unexercised_names_what_the_batch_does_not_test(name, rows, doc_masking, expect):
    from longstride.recipes.check.inputs import unexercised

    make, _ = MODELS[name]
    assert unexercised(make(WINDOW), _packed(*rows), doc_masking, stage_len=SEQ_LEN) == expect
    # a window or chunk of at least the stage's length cuts nothing in training: not asked for (Phi-3-128k's window
    # beyond its positions, Mistral's 4096 in a 4K stage)
    assert unexercised(make(WINDOW), _packed(*rows), doc_masking, stage_len=WINDOW) == \
        [m for m in expect if "-token" not in m]


def test_a_batch_that_tests_no_window_is_refused_before_compute_unless_allowed(corpus, tmp_path, capsys,
                                                                              monkeypatch):
    """Documents of 1-2 words (every one shorter than the window of 16) cannot show a CP method that drops it:
    exit 2 naming the window before any model is built; allow_unexercised=true runs the check and the verdict
    says what went untested."""
    root, tok = corpus
    with open(tmp_path / "short.jsonl", "w") as fh:
        for i in range(80):
            fh.write(json.dumps({"text": ["a b", "x", "def f"][i % 3]}) + "\n")
    args = [*argv(root, save_checkpoint(root, tok, "mistral"), "cp=2"),
            f"data.sources.main.path={tmp_path}/short.jsonl"]

    def computed(*a, **k):
        raise AssertionError("an untested window must be refused before a model is built")

    with monkeypatch.context() as m:
        m.setattr(check_runs, "load_model", computed)
        with pytest.raises(SystemExit) as e:
            cli.main(["check", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "16-token window" in err and "allow_unexercised=true" in err, err
    rep = check.check([*args, "allow_unexercised=true"])
    out = capsys.readouterr().out
    assert rep.ok and "not tested by this batch" in out and "(not tested: the 16-token window" in out, out


def test_a_gradient_zero_in_exact_arithmetic_is_judged_against_its_layer_s_gradients():
    """recipes/check/report.grad_errors: CTRL's key bias (no RoPE: softmax ignores what it adds to each score) has a
    gradient of rounding noise (~1e-10) that two attentions make differently; against itself that is an error of
    order 1 (`longstride check` failed CTRL's exact attention), against 1e-3 of its group's largest gradient it is
    noise. A small gradient that is wrong (a learned scale left untrained) still counts in full."""
    from longstride.recipes.check.report import grad_errors
    from longstride.recipes.check.runs import Result

    ref = {"w": torch.tensor([0.5, -0.25]), "k_bias": torch.tensor([2.4e-10, -1e-10]), "scale": torch.tensor([0.01])}
    got = {"w": torch.tensor([0.5, -0.25]), "k_bias": torch.tensor([5.2e-10, 3e-10]), "scale": torch.tensor([0.0])}
    result = lambda g: Result(torch.zeros(1), torch.zeros(()), [], g)  # noqa: E731
    errs = grad_errors(result(got), result(ref), {"w": "full", "k_bias": "full", "scale": "other"})
    assert errs["w"] == 0.0 and errs["k_bias"] < 1e-6 and errs["scale"] == 1.0, errs
    alone = grad_errors(result(got), result(ref), {"w": "full", "k_bias": "bias", "scale": "other"})
    assert alone["k_bias"] > 1, alone  # in a group of its own, nothing to judge it against but itself
