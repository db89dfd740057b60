"""eval compare: the base and each stage of a run on the same samples, YaRN rows on the last, the table,
files and plot; auto batching by tokens gives the one-by-one answers; bad input named before any model loads."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from longstride.eval.cli import checkpoint_label, parse_compare, run_checkpoints
from longstride.eval.ruler.compare import main, plan_rows
from longstride.eval.ruler.fit import make_sample
from longstride.eval.ruler.generate import batches, greedy_generate
from longstride.eval.ruler.tasks import ALL_TASKS, NOISE
from tests.conftest import micro_checkpoint, report


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two checkpoints sharing a tokenizer: trained lengths 512 and 1024 (as a base and its next stage)."""
    root = tmp_path_factory.mktemp("compare")
    micro_checkpoint(root / "base", 1000, 512, extra_texts=(NOISE,) * 20)
    micro_checkpoint(root / "stage", 1000, 1024, extra_texts=(NOISE,) * 20)
    return root / "base", root / "stage"


def test_batches_by_tokens_keep_every_prompt_once():
    widths = [300, 100, 200, 900, 100]
    assert batches(widths, 2, 0) == [[1, 4], [2, 0], [3]]
    got = batches(widths, 0, 400)
    assert sorted(i for b in got for i in b) == list(range(5))
    assert all(len(b) * max(widths[i] for i in b) <= 400 or len(b) == 1 for b in got)
    assert got == [[1, 4], [2], [0], [3]]
    assert batches(widths, 0, 600) == [[1, 4, 2], [0], [3]]


def test_auto_batches_answer_like_one_by_one(two):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(two[0])
    model = AutoModelForCausalLM.from_pretrained(two[0]).eval()
    prompts = [make_sample(ALL_TASKS["synth_kv"], L, i, tok).prompt_ids for i, L in enumerate((200, 300, 400, 500))]
    one = greedy_generate(model, tok, prompts, 10, batch_size=1)
    auto = greedy_generate(model, tok, prompts, 10, batch_size=0, batch_tokens=1200)
    assert auto == one and all(one)


def test_buffer_layer_writes_in_place_and_refuses_overflow():
    from longstride.eval.hf_adapter import BufferLayer

    keys, values = torch.zeros(2, 1, 5, 3), torch.zeros(2, 1, 5, 3)
    layer = BufferLayer(keys, values, filled=2)
    ptr = keys.data_ptr()
    for step in range(3):
        k, v = layer.update(torch.full((2, 1, 1, 3), step + 1.0), torch.full((2, 1, 1, 3), -step - 1.0))
        assert k.shape[-2] == 3 + step and k.data_ptr() == ptr and layer.get_seq_length() == 3 + step
    assert k[0, 0, :, 0].tolist() == [0, 0, 1, 2, 3] and v[1, 0, -1, 0].item() == -3
    with pytest.raises(RuntimeError, match="KV buffer full"):
        layer.update(torch.zeros(2, 1, 1, 3), torch.zeros(2, 1, 1, 3))
    layer.keep([1])
    assert layer.keys.shape == (1, 1, 5, 3) and layer.keys.data_ptr() == ptr, "row 1 moved into slot 0, in place"
    assert layer.keys[0, 0, :, 0].tolist() == [0, 0, 1, 2, 3] and layer.values[0, 0, -1, 0].item() == -3


def test_buffer_layer_keeps_rows_in_order():
    from longstride.eval.hf_adapter import BufferLayer

    keys = torch.arange(5.0)[:, None, None, None].expand(5, 2, 4, 3).contiguous()
    layer = BufferLayer(keys, -keys, filled=3)
    layer.keep([0, 2, 3])
    assert layer.keys[:, 0, 0, 0].tolist() == [0, 2, 3] and layer.values[:, 1, 2, 2].tolist() == [0, -2, -3]
    layer.keep([1, 2])
    assert layer.keys[:, 0, 0, 0].tolist() == [2, 3] and layer.keys.shape == (2, 2, 3, 3)
    assert layer.update(torch.full((2, 2, 1, 3), 9.0), torch.zeros(2, 2, 1, 3))[0][:, :, -1].eq(9).all()


def test_compare_scores_every_checkpoint_on_the_same_samples(two, tmp_path, capsys):
    base, stage = two
    res = main([f"checkpoints=[{base},{stage}]", "tasks=[synth_kv]", "lengths=[256,512]", "yarn=[2]",
                "yarn_lengths=[2048]", "num_samples=2", f"out={tmp_path}", "threads=1"])
    out = capsys.readouterr().out
    assert "synth_kv: score (%), 2 samples per cell; * = trained length" in out
    assert [r["label"] for r in res["rows"]] == ["base", "stage", "stage + YaRN x2"]
    assert [r["trained"] for r in res["rows"]] == [512, 1024, 1024]
    assert res["rows"][2]["lengths"] == [2048] and res["rows"][0]["samples"] == {"synth_kv": {256: 2, 512: 2}}
    by_key = {}
    for r in res["records"]:
        by_key.setdefault((r["task"], r["length"], r["index"]), []).append((r["answers"], r["prompt_tokens"]))
    same = [v for (t, L, i), v in by_key.items() if L in (256, 512)]
    assert len(same) == 4 and all(len(v) == 2 and v[0] == v[1] for v in same), "one sample set for every checkpoint"
    assert res["rows"][0]["sample_set"] == res["rows"][1]["sample_set"]
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert len(saved["records"]) == 2 * 2 * 2 + 2 and (tmp_path / "compare.png").stat().st_size > 0
    assert saved["rows"][2]["yarn"] == 2.0 and saved["complete"] is True
    assert saved["rows"][2]["applied_rope"]["rope_parameters"]["rope_type"] == "yarn"
    assert saved["rows"][0]["applied_rope"]["rope_parameters"]["rope_type"] == "default"
    only_yarn = main([f"checkpoints=[{base},{stage}]", "tasks=[synth_kv]", "yarn=[2]", "yarn_lengths=[2048]",
                      "plain_rows=false", "num_samples=1", f"out={tmp_path}/yarn", "threads=1"])
    assert [r["label"] for r in only_yarn["rows"]] == ["stage + YaRN x2"] and len(only_yarn["records"]) == 1


def test_a_checkpoint_with_another_tokenizer_is_said_to_score_its_own_samples(two, tmp_path, capsys):
    base, _ = two
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "chat_template.jinja").write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    res = main([f"checkpoints=[{base},{other}]", "tasks=[synth_kv]", "lengths=[512]", "yarn=[]", "num_samples=1",
                f"out={tmp_path}/out", "threads=1"])
    err = capsys.readouterr().err
    assert "other's tokenizer (or chat template) differs from base's: its rows are scored on their own samples" in err
    first, second = (r["sample_set"] for r in res["rows"])
    assert len(first) == 12 and first != second
    prompts = {r["checkpoint"]: r["prompt_tokens"] for r in res["records"]}
    assert set(prompts) == {"base", "other"}


def _compare_worker(rank, world, args, out):
    """`longstride eval compare ARGS out=OUT` on a gloo rank of run_gloo (as under torchrun)."""
    import os

    os.environ["WORLD_SIZE"] = str(world)  # what torchrun sets; the process group exists already
    torch.set_num_threads(1)
    got = main([*args, f"out={out}"])
    assert (got is None) == (rank > 0), "rank 0 returns (and writes) the result"


def test_two_processes_split_the_samples_and_save_what_one_process_does(two, tmp_path):
    """Launched on 2 processes (3 samples: 2 on rank 0, 1 on rank 1), every row's records, scores and sample
    counts are one process's; at 128 tokens, where no task fits, both skip the same tasks."""
    from longstride.parallel.spawn import run_gloo

    base, stage = two
    args = [f"checkpoints=[{base},{stage}]", "tasks=[niah_single_1,synth_kv]", "lengths=[128,512]", "yarn=[2]",
            "yarn_lengths=[1024]", "num_samples=3", "threads=1"]
    one = json.loads(json.dumps(main(args + [f"out={tmp_path / 'one'}"])))
    run_gloo(_compare_worker, 2, args, str(tmp_path / "two"))
    two_ranks = json.loads((tmp_path / "two" / "compare.json").read_text())
    assert two_ranks["complete"] and len(two_ranks["records"]) == len(one["records"]) > 0
    assert two_ranks["records"] == one["records"]
    assert [(r["label"], r["scores"], r["samples"]) for r in two_ranks["rows"]] == \
        [(r["label"], r["scores"], r["samples"]) for r in one["rows"]]
    # each rank names what does not fit with its own first sample's size: the same tasks and lengths skipped
    assert {m.split(":")[0] for m in two_ranks["skipped"]} == {m.split(":")[0] for m in one["skipped"]} == \
        {"niah_single_1 does not fit in 128 tokens", "synth_kv does not fit in 128 tokens"}


def _reporting_compare_worker(rank, world, args, out):
    import os

    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    report(os.path.join(out, f"rank{rank}.txt"), lambda: main([*args, f"out={out}"]), lambda got: "scored")


def _failing_compare_worker(rank, world, args, out):
    """As _compare_worker, rank 1 unable to load the second checkpoint; writes what each rank raised."""
    import os

    from longstride.eval.ruler import compare

    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    load = compare.load_eval_model

    def loaded(checkpoint, *a, **kw):
        if rank == 1 and os.path.basename(checkpoint) == "stage":
            raise OSError(f"{checkpoint}/model.safetensors: Input/output error")
        return load(checkpoint, *a, **kw)

    compare.load_eval_model = loaded
    report(os.path.join(out, f"rank{rank}.txt"), lambda: main([*args, f"out={out}"]), lambda got: "scored")


@pytest.mark.timeout(180)  # before, the others waited at the next gather for the eval's hours-long timeout
@pytest.mark.parametrize("fault", ["load", "save"])
def test_a_process_failing_on_its_part_ends_every_process(two, tmp_path, fault):
    """Under a launcher that leaves the others running (srun, a hand-started group), a process that failed left the
    others waiting at the next gather: rank 1 unable to load a checkpoint (its read simulated to fail), rank 0 unable
    to write compare.json (a directory there). Now every process ends at that row, the others naming it."""
    from longstride.parallel.spawn import run_gloo

    base, stage = two
    args = [f"checkpoints=[{base},{stage}]", "tasks=[niah_single_1]", "lengths=[512]", "yarn=[]",
            "num_samples=2", "threads=1"]
    out = tmp_path / "out"
    (out / "compare.json" if fault == "save" else out).mkdir(parents=True)
    run_gloo(_failing_compare_worker if fault == "load" else _reporting_compare_worker, 2, args, str(out))
    said = [(out / f"rank{r}.txt").read_text() for r in range(2)]
    if fault == "save":
        assert said == [f"IsADirectoryError: [Errno 21] Is a directory: '{out / 'compare.json'}'",
                        f"RuntimeError: eval.compare: rank 0 could not write {out} (its log says why)"], said
        return
    assert said == ["RuntimeError: eval.compare: another process failed on stage (its log says why)",
                    f"OSError: {stage}/model.safetensors: Input/output error"], said
    kept = json.loads((out / "compare.json").read_text())  # the row scored before it, saved
    assert not kept["complete"] and [r["label"] for r in kept["rows"]] == ["base"]


def test_compare_cut_short_keeps_the_rows_it_scored(two, tmp_path, monkeypatch):
    """The second checkpoint runs out of memory as it loads (a device window's cap would kill it likewise): the
    first row's scores are already on disk, marked incomplete."""
    import longstride.eval.ruler.compare as compare

    base, stage = two
    loads = []

    def load_then_fail(checkpoint, *args, **kwargs):
        loads.append(checkpoint)
        if len(loads) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected at the second checkpoint)")
        return load_eval_model(checkpoint, *args, **kwargs)

    load_eval_model = compare.load_eval_model
    monkeypatch.setattr(compare, "load_eval_model", load_then_fail)
    with pytest.raises(torch.OutOfMemoryError):
        main([f"checkpoints=[{base},{stage}]", "tasks=[synth_kv]", "lengths=[256]", "yarn=[2]",
              "yarn_lengths=[2048]", "num_samples=2", f"out={tmp_path}", "threads=1"])
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["complete"] is False and [r["label"] for r in saved["rows"]] == ["base"]
    assert saved["rows"][0]["samples"] == {"synth_kv": {"256": 2}} and len(saved["records"]) == 2
    assert (tmp_path / "compare.png").stat().st_size > 0


def test_run_folder_gives_base_then_stages_and_names_a_missing_stage(two, tmp_path):
    base, stage = two
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"model:\n  arch: checkpoint\n  checkpoint: {base}\n"
                                     "recipe:\n  name: r\n  stages:\n    s2_2k: {}\n    s3_4k: {}\n")
    shutil.copytree(stage, run / "s2_2k" / "final")
    with pytest.raises(ValueError, match="stage s3_4k has no final checkpoint"):
        run_checkpoints(str(run))
    shutil.copytree(stage, run / "s3_4k" / "final")
    assert run_checkpoints(str(run)) == [("base (base)", str(base)), ("s2_2k", str(run / "s2_2k" / "final")),
                                         ("s3_4k", str(run / "s3_4k" / "final"))]
    assert checkpoint_label(str(run / "s2_2k" / "final")) == "s2_2k" and checkpoint_label(f"{base}/") == "base"


def test_bad_input_is_named(two, tmp_path, capsys):
    with pytest.raises(ValueError, match="give run=DIR"):
        main([])
    with pytest.raises(ValueError, match="has no config.yaml"):
        main([f"run={tmp_path}"])
    with pytest.raises(ValueError, match="yarn factors are > 1"):
        main([f"checkpoints=[{two[0]}]", "yarn=[1]"])
    with pytest.raises(ValueError, match="plain_rows=false leaves only the YaRN rows"):
        main([f"checkpoints=[{two[0]}]", "plain_rows=false", "yarn=[]"])
    with pytest.raises(ValueError, match="qa.squad="):
        main([f"checkpoints=[{two[0]}]", f"qa.squad={tmp_path}/missing.json"])
    with pytest.raises(ValueError, match=r"tasks: \['niah_single1'\] is no task; known tasks: niah_single_1"):
        parse_compare([f"checkpoints=[{two[0]}]", "tasks=[niah_single1]"])
    with pytest.raises(ValueError, match=r"nothing to run: no task fits any of lengths \[64\]"):
        main([f"checkpoints=[{two[0]}]", "tasks=[synth_kv]", "lengths=[64]", "yarn=[]", "num_samples=1",
              f"out={tmp_path}/short", "threads=1"])
    with pytest.raises(ValueError, match="Key 'sample' not in 'CompareConfig'"):
        main([f"checkpoints=[{two[0]}]", "sample=3"])
    # a YaRN row the last checkpoint's RoPE refuses is named before the plain rows are scored, not after them
    linear = tmp_path / "linear"
    shutil.copytree(two[1], linear)
    cfg = json.loads((linear / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (linear / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"^yarn=\[2.0\]: .*linear: .*already scaled \(rope_type=linear, factor 2.0\)"
                                         r".*; yarn=\[\] compares without YaRN rows$"):
        main([f"checkpoints=[{two[0]},{linear}]", "yarn=[2]", "tasks=[niah_single_1]", "num_samples=1",
              f"out={tmp_path}/linear_out"])
    assert not (tmp_path / "linear_out").exists()
    # left at its default, yarn gives no rows to a RoPE that takes none (Llama 3.1's llama3), with a note; YaRN rows
    # where it does
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    (linear / "config.json").write_text(json.dumps(cfg))
    for last, factors in ((linear, []), (two[1], [2.0, 4.0])):
        rows = plan_rows(parse_compare([f"checkpoints=[{two[0]},{last}]", f"out={tmp_path}/plan"]),
                         [("base", str(two[0])), ("last", str(last))])
        assert [r.yarn for r in rows] == [None, None] + factors
    assert "no YaRN rows (the default yarn=[2.0, 4.0] left out): " in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"yarn=\[2.0\]: .*; yarn=\[\] compares without YaRN rows, with "
                                         r"plain_rows=true$"):
        plan_rows(parse_compare([f"checkpoints=[{linear}]", "plain_rows=false", "yarn=[2]", f"out={tmp_path}/plan"]),
                  [("last", str(linear))])
    with pytest.raises(ValueError, match="plain_rows=false leaves only the YaRN rows, and .* takes none"):
        plan_rows(parse_compare([f"checkpoints=[{linear}]", "plain_rows=false", f"out={tmp_path}/plan"]),
                  [("last", str(linear))])


def test_answers_end_once_scored_with_the_same_scores(two):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longstride.eval.ruler.generate import _decode, decided, stop_ids
    from longstride.eval.ruler.score import sample_score

    tok = AutoTokenizer.from_pretrained(two[0])
    model = AutoModelForCausalLM.from_pretrained(two[0]).eval()
    eos = stop_ids(model, tok)
    samples = [make_sample(ALL_TASKS["synth_kv"], 300, i, tok) for i in range(4)]
    prompts = [s.prompt_ids for s in samples]
    full = greedy_generate(model, tok, prompts, 16)
    # references taken from each full answer's own text: every row's score is decided early on
    refs = [[a.strip()[:3] or "zz-never"] for a in full]
    early = greedy_generate(model, tok, prompts, 16, references=refs)
    assert [sample_score(a, r, "all") for a, r in zip(full, refs)] == [sample_score(a, r, "all")
                                                                        for a, r in zip(early, refs)]
    assert all(f.startswith(e) for f, e in zip(full, early)) and sum(map(len, early)) < sum(map(len, full))
    # the criterion itself: a row is done only when every reference is in its decoded answer
    ids = tok(" alpha beta", add_special_tokens=False)["input_ids"]
    text = _decode(tok, ids, eos)
    assert text.lower().strip() == "alpha beta"
    assert decided(text, ["ALPHA", "beta"], "all") and not decided(text, ["alpha", "gamma"], "all")
    assert decided(text, ["alpha", "gamma"], "part")


@pytest.mark.parametrize("attention", ["cpu_kernels", "sdpa", "eager"])
def test_prompt_lookup_drafts_give_the_one_token_answers_in_fewer_forwards(attention, monkeypatch):
    """The shipped base model repeats itself past 256 tokens (the regime drafts are for). Prompts of three lengths
    in one batch (left padding), with and without early ends: the answers with drafts are the one-token-a-step
    answers, in fewer forwards. With this module's CPU attention, and as a GPU runs: the prefill's lower-right
    causal SDPA call, then the model's own SDPA or eager attention under transformers' 2-D mask with the rejected
    drafts' holes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import longstride.eval.ruler.attention as ruler_attention
    import longstride.eval.ruler.generate as generate
    from tests.conftest import REPO

    shipped = REPO / "model" / "shipped" / "tiny_base_256"
    tok = AutoTokenizer.from_pretrained(shipped)
    model = AutoModelForCausalLM.from_pretrained(shipped).eval()
    if attention != "cpu_kernels":
        monkeypatch.setattr(generate, "cpu_kernels", lambda device: False)
        monkeypatch.setattr(ruler_attention, "_prefill_cpu", ruler_attention._prefill_lower_right)
        model.set_attn_implementation(attention)
    samples = [make_sample(ALL_TASKS["niah_single_1"], L, i, tok) for i, L in enumerate((512, 512, 600, 700, 700))]
    prompts, refs = [s.prompt_ids for s in samples], [s.answers for s in samples]
    forwards, forward = [0], model.forward

    def counted(*args, **kwargs):
        forwards[0] += 1
        return forward(*args, **kwargs)

    model.forward = counted
    got = {}
    for draft in (0, 4):
        for references in (None, refs):
            forwards[0] = 0
            got[draft, references is None] = (greedy_generate(model, tok, prompts, 40, references=references,
                                                              draft=draft), forwards[0])
    for full in (True, False):
        (plain, n_plain), (drafted, n_drafted) = got[0, full], got[4, full]
        assert drafted == plain and all(plain)
        assert n_drafted < n_plain - 5, (n_drafted, n_plain)


def test_drafts_propose_what_followed_the_latest_recurrence_of_the_last_tokens():
    from longstride.eval.ruler.generate import Drafts

    d = Drafts([[5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 4, 5, 6, 7], [1, 2, 3], [4, 4]], room=4)
    drafts, length = d.propose(3)
    # row 0: [5, 6, 7] recurs at 0 and 6; the latest with 3 tokens after it is 6 -> 2, 3, 4
    assert drafts[0].tolist() == [2, 3, 4] and length.tolist() == [3, 0, 1]
    assert drafts[2, :1].tolist() == [4]  # the last token alone recurs: what followed it, up to the end
    d.append(1, 2)  # row 1 is now [1, 2, 3, 2]: its last token recurs, followed by 3, 2
    assert d.propose(3)[0][1, :2].tolist() == [3, 2] and d.propose(3)[1][1] == 2
    d.keep([1])
    assert d.propose(2)[1].tolist() == [2]


@pytest.mark.parametrize("task", ["niah_single_1", "synth_kv", "cwe"])
def test_a_guessed_haystack_size_finds_the_searched_one(tok_of_two, task):
    first = make_sample(ALL_TASKS[task], 1600, 0, tok_of_two)
    for i in range(1, 4):
        for guess in (first.units, first.units - 7, first.units + 9, 10 ** 6):
            plain, guessed = make_sample(ALL_TASKS[task], 1600, i, tok_of_two), \
                make_sample(ALL_TASKS[task], 1600, i, tok_of_two, guess=guess)
            assert guessed.units == plain.units and guessed.prompt_ids == plain.prompt_ids


@pytest.fixture(scope="module")
def tok_of_two(two):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(two[0])
