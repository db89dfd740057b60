"""eval.ruler: chunked batched generation, prefix-cached and context-parallel prefill, the command line on a micro
checkpoint, bad input (its samples and metrics: tests/test_ruler_samples.py)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from longstride.eval.ruler.fit import make_sample
from longstride.eval.ruler.generate import greedy_generate
from longstride.eval.cli import parse_ruler
from longstride.eval.ruler.run import main
from longstride.eval.ruler.tasks import TASKS
from tests.conftest import report


@pytest.fixture(scope="module")
def checkpoint(ruler_checkpoint):
    return ruler_checkpoint


@pytest.fixture(scope="module")
def tok(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def test_chunked_batched_generation_equals_one_by_one(checkpoint, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    prompts = [make_sample(TASKS["niah_single_2"], L, i, tok).prompt_ids for i, L in enumerate((600, 900, 1000))]
    whole = greedy_generate(model, tok, prompts, 12, batch_size=1, prefill_chunk=4096)
    chunked = greedy_generate(model, tok, prompts, 12, batch_size=3, prefill_chunk=128)
    assert chunked == whole and all(len(a) > 0 for a in whole)
    with torch.no_grad():  # the first new token is the full forward pass's argmax
        first = model(torch.tensor([prompts[0]])).logits[0, -1].argmax()
    assert whole[0].startswith(tok.decode([int(first)]))


@pytest.mark.parametrize("path", ["cpu flash", "lower-right sdpa"])
def test_prefix_cached_prefill_gives_the_full_forward_cache_and_logits(path, monkeypatch):
    """A prompt prefilled in chunks from the cached prefix it shares with another prompt gives the KV cache and
    last-token logits of one forward of the whole prompt through transformers' own attention: hybrid RoPE/NoPE
    layers, YaRN, grouped K/V heads; the first prompt's too. Both prefill paths: the CPU's two flash calls and
    the GPU's one SDPA call with torch's lower-right causal bias (here on CPU, where torch materialises it)."""
    from transformers import DynamicCache

    from longstride.eval.hf_adapter import buffer_cache, cache_kw, put_row, row_prefix
    from longstride.eval.ruler import attention
    from longstride.eval.ruler.generate import _prefill, shared_prefix
    from longstride.model.build import build_model
    from longstride.model.config import ModelConfig, YarnConfig

    if path == "lower-right sdpa":
        monkeypatch.setattr(attention, "_prefill_cpu", attention._prefill_lower_right)

    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2, initializer_range=0.3, yarn=YarnConfig(factor=2.0))
    model = build_model(cfg, rope_theta=1e4, seq_len=128, vocab_size=300, eos_id=0, pad_id=1).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.no_rope_layers == [1, 0, 1]
    g = torch.Generator().manual_seed(0)
    a = torch.randint(2, 300, (230,), generator=g).tolist()
    b = a[:150] + torch.randint(2, 300, (80,), generator=g).tolist()  # past the 128 positions YaRN stretches
    b[150] = a[150] + 1
    kw, cpu = cache_kw(model), torch.device("cpu")

    def reference(ids):
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True, **{kw: DynamicCache(config=model.config)})
        return out.past_key_values, out.logits[0, -1]

    cache_a, logits_a = _prefill(model, a, 100, cpu, kw)
    assert shared_prefix(a, b) == 150 and shared_prefix(a, a) == len(a) - 1
    batch = buffer_cache(model, cache_a, 1, 3 + len(a), 3 + len(a))  # a's prompt in row 0 from column 3
    put_row(batch, 0, cache_a, 3 + len(a))
    cache_b, logits_b = _prefill(model, b, 48, cpu, kw, row_prefix(model, batch, 0, 3, 150))
    for ids, cache, logits in ((a, cache_a, logits_a), (b, cache_b, logits_b)):
        ref_cache, ref_logits = reference(ids)
        assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-4), (logits - ref_logits).abs().max()
        for mine, theirs in zip(cache.layers, ref_cache.layers, strict=True):
            assert mine.keys.shape == theirs.keys.shape == (1, 2, len(ids), 8)
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5) and torch.allclose(mine.values, theirs.values,
                                                                                         atol=1e-5)


def test_command_line_runs_reports_and_skips(checkpoint, squad, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"tasks: \['nope'\] is no task; known tasks: niah_single_1"):  # a typo
        main([f"checkpoint={checkpoint}", "tasks=[niah_single_1,nope]", f"out={tmp_path}", "threads=1"])
    res = main([f"checkpoint={checkpoint}", "lengths=[1536,2048,4096]", "num_samples=2",
                "tasks=[niah_single_1,niah_multikey_2,vt,cwe,fwe,qa_1,qa_2]", f"qa.squad={squad}",
                f"out={tmp_path}", "threads=1"])
    err = capsys.readouterr().err
    assert "qa_2 skipped: it needs a local hotpotqa dev file (qa.hotpotqa=PATH)" in err
    assert "length 4096 skipped: the model's max positions are 2048; add yarn.factor=2" in err
    summary = res["summary"]
    assert set(summary["table"]) == {"niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe", "qa_1"}
    assert summary["lengths"] == [1536, 2048] and len(res["records"]) == 6 * 2 * 2
    saved = json.loads((tmp_path / "ruler.json").read_text())
    assert saved["summary"]["mean"] == {str(k): v for k, v in summary["mean"].items()}
    assert all(r["prediction"] is not None and r["prompt_tokens"] <= r["length"] for r in saved["samples"])
    assert (tmp_path / "ruler.csv").read_text().count("\n") == 1 + 6 * 2
    assert (tmp_path / "ruler_scores.png").stat().st_size > 0 and (tmp_path / "ruler_depth.png").stat().st_size > 0
    # YaRN from the command line reaches the skipped length
    yarn = main([f"checkpoint={checkpoint}", "lengths=[4096]", "num_samples=1", "tasks=[niah_single_1]",
                 "yarn.factor=2", f"out={tmp_path}", "threads=1", "wandb=offline", "dtype=bfloat16"])
    assert yarn["summary"]["lengths"] == [4096] and (tmp_path / "ruler_yarn2_bfloat16.json").is_file()
    saved = json.loads((tmp_path / "ruler_yarn2_bfloat16.json").read_text())["config"]
    assert saved["yarn"]["factor"] == 2.0
    rope = saved["applied_rope"]  # what to give the model elsewhere for these numbers
    assert rope["max_position_embeddings"] == 4096 and rope["rope_parameters"]["rope_type"] == "yarn"
    assert rope["rope_parameters"]["factor"] == 2.0 and rope["rope_parameters"]["original_max_position_embeddings"] \
        == 2048
    assert not (tmp_path / "ruler_yarn2.json").exists(), "a bf16 run's files sit beside a float32 run's, not over"
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0, "the scores and plots went to an offline wandb run"


def test_bad_input(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="checkpoint=<dir> is required"):
        parse_ruler([])
    with pytest.raises(ValueError, match="has no config.json"):
        parse_ruler([f"checkpoint={tmp_path}"])
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(ValueError, match="has no weights"):
        parse_ruler([f"checkpoint={tmp_path}"])
    (tmp_path / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="has no tokenizer"):
        parse_ruler([f"checkpoint={tmp_path}"])
    with pytest.raises(ValueError, match="lengths="):
        parse_ruler([f"checkpoint={checkpoint}", "lengths=[0]"])
    with pytest.raises(ValueError, match="qa.squad="):
        parse_ruler([f"checkpoint={checkpoint}", f"qa.squad={tmp_path}/missing.json"])
    with pytest.raises(ValueError, match=r"Could not override 'num_sample': Key 'num_sample' not in 'RulerConfig' "
                                         r"\(see longstride eval ruler --help\)"):
        parse_ruler([f"checkpoint={checkpoint}", "num_sample=3"])
    with pytest.raises(ValueError, match=r"override dtype=float8: Invalid value 'float8', expected one of "
                                         r"\[float32, bfloat16, float16\]"):
        parse_ruler([f"checkpoint={checkpoint}", "dtype=float8"])
    with pytest.raises(ValueError, match="prefill=cp splits each prompt over several processes"):
        parse_ruler([f"checkpoint={checkpoint}", "prefill=cp"])
    with pytest.raises(ValueError, match=r"prefill=cp prefills .*: batch_size, draft are not read there"):
        parse_ruler([f"checkpoint={checkpoint}", "prefill=cp", "draft=0", "batch_size=2"])
    with pytest.raises(ValueError, match=r"prefill=cp prefills .*: prefill_chunk is not read there"):
        parse_ruler([f"checkpoint={checkpoint}", "prefill=cp", "prefill_chunk=4096"])
    with pytest.raises(ValueError, match="nothing to run: no runnable task"):
        main([f"checkpoint={checkpoint}", "tasks=[qa_2]"])  # its dev file not given: skipped, and nothing is left
    with pytest.raises(ValueError, match=r"tasks: \['nope'\] is no task"):  # with the options, before torch runs
        parse_ruler([f"checkpoint={checkpoint}", "tasks=[nope]"])
    with pytest.raises(ValueError, match="haystack="):
        main([f"checkpoint={checkpoint}", "tasks=[niah_single_2]", f"haystack={tmp_path}/none"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"text": "x"}]}]}))
    with pytest.raises(ValueError, match="is not a squad json file"):
        main([f"checkpoint={checkpoint}", "tasks=[qa_1]", f"qa.squad={bad}"])


def _cp_prefill_worker(rank, world, checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longstride.eval.ruler.cp_prefill import cp_prefill, world_cp
    from longstride.eval.ruler.generate import greedy_generate_cached

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    cp = world_cp("cpu")  # once: it builds the processes' mesh
    for i, L in enumerate((700, 1000)):
        prompt = make_sample(TASKS["niah_single_2"], L, i, tok).prompt_ids
        cache = cp_prefill(model, prompt, cp)
        done = cache.get_seq_length()
        assert done % (2 * world) == 0 and len(prompt) - 2 * world <= done < len(prompt)
        with torch.no_grad():
            ref = model(torch.tensor([prompt[:done]]), use_cache=True).past_key_values
        for layer in range(model.config.num_hidden_layers):
            for got, want in ((cache.layers[layer].keys, ref.layers[layer].keys),
                              (cache.layers[layer].values, ref.layers[layer].values)):
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, f"rank {rank} layer {layer}: cache differs by {err:.2e}"
        answer = greedy_generate_cached(model, tok, prompt, cache, 12)
        assert answer == greedy_generate(model, tok, [prompt], 12)[0]


def test_context_parallel_prefill_gives_the_single_process_cache_and_answer(checkpoint):
    from longstride.parallel.spawn import run_gloo

    run_gloo(_cp_prefill_worker, 2, str(checkpoint))


def _ruler_worker(rank, world, args, out) -> dict:
    """`longstride eval ruler ARGS out=OUT` on a gloo rank of run_gloo: what the command returns."""
    import os

    os.environ["WORLD_SIZE"] = str(world)  # what torchrun sets; the process group exists already
    torch.set_num_threads(1)
    return main([*args, f"out={out}"])


def test_several_processes_split_samples_or_prefill_and_agree_with_one(checkpoint, tmp_path):
    """2 processes: samples split between them (default; gloo ranks) or every prompt's prefill split with ring
    attention (prefill=cp; the command under torchrun); both give the one-process predictions."""
    import os
    import subprocess
    import sys

    from longstride.parallel.spawn import run_gloo

    args = [f"checkpoint={checkpoint}", "lengths=[1024]", "num_samples=3", "tasks=[niah_single_2,vt]", "threads=1"]
    one = main(args + [f"out={tmp_path / 'one'}"])
    run_gloo(_ruler_worker, 2, [*args, "prefill=local"], str(tmp_path / "local"))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "longstride.eval.ruler", *args, "prefill=cp", f"out={tmp_path / 'cp'}"], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=300)
    for mode in ("local", "cp"):
        saved = json.loads((tmp_path / mode / "ruler.json").read_text())["samples"]
        assert [(r["task"], r["index"], r["prediction"]) for r in saved] == \
            [(r["task"], r["index"], r["prediction"]) for r in one["records"]], mode


def _reporting_worker(rank, world, args, out):
    import os

    report(os.path.join(out, f"said{rank}.txt"), lambda: _ruler_worker(rank, world, args, out), lambda got: "done")


@pytest.mark.timeout(180)  # before, rank 1 waited at the closing barrier for the eval's hours-long timeout
def test_results_rank_0_cannot_write_end_every_process(checkpoint, tmp_path):
    """Only rank 0 writes the results; when it could not (here ruler.json is a directory), rank 1 waited at the last
    barrier for it until the launcher (or, under srun, the eval's 6-hour timeout) ended it. Now both end there."""
    from longstride.parallel.spawn import run_gloo

    (tmp_path / "ruler.json").mkdir()
    args = [f"checkpoint={checkpoint}", "lengths=[512]", "num_samples=2", "tasks=[niah_single_1]", "threads=1"]
    run_gloo(_reporting_worker, 2, args, str(tmp_path))
    said = [(tmp_path / f"said{r}.txt").read_text() for r in range(2)]
    assert said == [f"IsADirectoryError: [Errno 21] Is a directory: '{tmp_path / 'ruler.json'}'",
                    "RuntimeError: eval.ruler: rank 0 could not write the results (its log says why)"], said


def _uneven_share_worker(rank, world, checkpoint, out):
    for name, args in _UNEVEN.items():
        got = _ruler_worker(rank, world, [f"checkpoint={checkpoint}", *args, "threads=1"], f"{out}/{name}")
        if rank == 0:
            with open(f"{out}/{name}.json", "w") as f:
                json.dump({k: got[k] for k in ("records", "skipped")}, f)


# one sample on two processes (rank 1's share is empty); synth_kv's sample 0 does not fit 100 tokens in the shipped
# tokenizer and sample 1 does, so rank 0 alone finds that it does not fit
_UNEVEN = {"one_sample": ["lengths=[256]", "num_samples=1", "tasks=[synth_kv]"],
           "fit_on_one_rank": ["lengths=[100,256]", "num_samples=2", "tasks=[synth_kv]"]}


def test_two_processes_with_uneven_shares_score_what_one_process_does(tmp_path):
    """num_samples below the processes left a rank nothing to score (it crashed on samples[0]); a task at a length
    that one rank's sample does not fit was skipped there and scored on the other's half. Both now give what
    one process gives."""
    from longstride.parallel.spawn import run_gloo
    from longstride.recipes.config.schema import SHIPPED

    SHIPPED_BASE = f"{SHIPPED}/tiny_base_256"
    run_gloo(_uneven_share_worker, 2, SHIPPED_BASE, str(tmp_path))
    for name, args in _UNEVEN.items():
        one = main([f"checkpoint={SHIPPED_BASE}", *args, f"out={tmp_path}/one_{name}", "threads=1"])
        two = json.loads((tmp_path / f"{name}.json").read_text())
        assert [(r["task"], r["length"], r["index"], r["prediction"]) for r in two["records"]] == \
            [(r["task"], r["length"], r["index"], r["prediction"]) for r in one["records"]], name
        assert two["skipped"] == one["skipped"], name
    assert {r["length"] for r in one["records"]} == {256} and "synth_kv does not fit in 100" in one["skipped"][0]


def test_nothing_fitting_any_length_is_an_error_not_an_empty_table(checkpoint, tmp_path, monkeypatch):
    from longstride.eval.ruler import run

    def loaded(*args, **kwargs):
        raise AssertionError("the samples are made before the model loads")

    monkeypatch.setattr(run, "load_eval_model", loaded)
    with pytest.raises(ValueError, match=r"nothing to run: no task fits any of lengths \[64\]"):
        main([f"checkpoint={checkpoint}", "lengths=[64]", "num_samples=1", "tasks=[niah_single_1]",
              f"out={tmp_path}"])
    assert not list(tmp_path.iterdir()), "no empty results written"


def test_a_task_whose_shortest_length_is_past_the_model_s_positions_says_how_to_reach_it(tmp_path, capsys):
    """`use lengths >= N` alone sent a user to a length the model then skipped (past its max positions)."""
    from longstride.recipes.config.schema import SHIPPED

    with pytest.raises(ValueError, match="nothing to run: no task fits"):
        main([f"checkpoint={SHIPPED}/tiny_base_256", "lengths=[128]", "num_samples=1", "tasks=[niah_single_1]",
              f"out={tmp_path}", "threads=1"])
    assert re.search(r"niah_single_1 does not fit in 128 tokens: .* use lengths >= \d+, past the model's max "
                     r"positions \(256\): leave the task out, or reach that length with a larger yarn.factor",
                     capsys.readouterr().err)


def test_cp_prefill_refuses_a_model_that_reads_positions_from_a_rank_s_own_tokens(tmp_path, monkeypatch):
    """prefill=cp splits each prompt over the processes: Phi-3's longrope (past its original window) would pick
    its frequencies from each rank's own positions, so it is refused before any prompt is made."""
    import transformers as T

    from longstride.eval.ruler import run as ruler_run
    from longstride.recipes.config.schema import SHIPPED

    config = T.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          original_max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                           "long_factor": [1.0] * 4, "original_max_position_embeddings": 64})
    T.Phi3ForCausalLM(config).save_pretrained(tmp_path / "phi3")
    T.AutoTokenizer.from_pretrained(f"{SHIPPED}/tiny_base_256").save_pretrained(tmp_path / "phi3")
    monkeypatch.setattr(ruler_run, "launched_ranks", lambda: (0, 2))  # as under torchrun with 2 processes
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"prefill=cp: .*rope_type=longrope .* use prefill=local"):
        main([f"checkpoint={tmp_path / 'phi3'}", "lengths=[2048]", "num_samples=1", "tasks=[niah_single_1]",
              "prefill=cp", f"out={tmp_path / 'out'}"])


def test_a_launched_eval_puts_each_rank_on_its_own_gpu(monkeypatch):
    """Under torchrun on GPUs each rank selects its LOCAL_RANK's GPU before NCCL starts (eval_device() reads the
    current GPU; without it every rank's model went to cuda:0), and the group waits hours at its gather. torch.cuda
    and the process group are stood in for here (no GPU on CPU CI)."""
    from longstride.eval.ruler import run as ruler_run

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, timeout: calls.append(("init", backend, timeout.total_seconds())))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    assert ruler_run.launched_ranks() == (1, 2)
    # the ranks meet once, after scoring shares that may differ by minutes: not NCCL's default 10 minutes
    assert calls == [("set_device", 1), ("init", "nccl", 6 * 3600)]
