"""Sharded step checkpoints (parallel/shards.py) on one process: the model and AdamW state round-trip
exactly, a tied LM head is stored once, `longstride export-hf` turns the shards into an HF directory with
the same weights, and a shard file carrying a pickled payload is refused without running it. A
write failing on one of two gloo ranks raises on both. The rest of the multi-process side (each rank its own file,
resume on another process count, FSDP2 <-> DDP) runs in tests/test_checkpoint_faults.py and tests/test_train.py."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.conftest import report

REPO = Path(__file__).resolve().parents[1]


class Wrapped(torch.nn.Module):
    """The shape training saves: the HF model under `lm.` (ChunkedLossLM)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm


def tiny(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=384, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = Wrapped(LlamaForCausalLM(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def trained(seed: int):
    model, opt = tiny(seed)
    for _ in range(2):
        model.lm(input_ids=torch.randint(0, 384, (2, 12)), labels=torch.randint(0, 384, (2, 12))).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture
def step_dir(tmp_path):
    """A step checkpoint as a save writes it: shards, config, tokenizer, manifest."""
    from transformers import AutoTokenizer

    from longstride.parallel.parallelize import Parallelized
    from longstride.recipes.checkpoint.format import writing_checkpoint

    model, opt = trained(0)
    path = str(tmp_path / "s1" / "step_000002")
    os.makedirs(os.path.dirname(path))
    tok = AutoTokenizer.from_pretrained(REPO / "model" / "shipped" / "tiny_base_256")
    with writing_checkpoint(path, rank=0, is_main=True, trainer_state={"step": 2},
                            rank_state={"data": {}}, meta={"step": 2}) as d:
        Parallelized(model, False, None).save_state(d, opt)
        model.lm.config.save_pretrained(d)
        tok.save_pretrained(d)
    return path, model, opt


def test_model_and_optimizer_round_trip_exactly_and_the_tie_is_stored_once(step_dir):
    from longstride.parallel.parallelize import Parallelized
    from longstride.parallel.shards import SafeReader

    path, model, opt = step_dir
    names = set(SafeReader(path).read_metadata().state_dict_metadata)
    assert "model.lm.model.embed_tokens.weight" in names and "model.lm.lm_head.weight" not in names, names
    fresh, fresh_opt = tiny(1)  # other weights, an optimizer that never stepped
    assert not torch.equal(fresh.lm.model.embed_tokens.weight, model.lm.model.embed_tokens.weight)
    Parallelized(fresh, False, None).load_state(path, fresh_opt)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], fresh_opt.state[b][key]), (name, key)
    assert fresh.lm.lm_head.weight is fresh.lm.model.embed_tokens.weight, "still tied after the load"
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_export_hf_writes_the_same_weights_as_an_hf_directory(step_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from longstride.recipes.checkpoint.format import verify
    from longstride.recipes.checkpoint.export import main

    path, model, _ = step_dir
    out = str(tmp_path / "hf")
    main([f"checkpoint={path}", f"out={out}"])
    assert verify(out) is None
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, p in model.lm.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name
    with pytest.raises(ValueError, match="exists; choose a new directory"):
        main([f"checkpoint={path}", f"out={out}"])
    with pytest.raises(ValueError, match="not a sharded step checkpoint"):
        main([f"checkpoint={out}", f"out={tmp_path / 'again'}"])
    from longstride.model.model_dir import check_checkpoint_dir

    check_checkpoint_dir(out, "checkpoint")  # what eval and model.checkpoint take
    with pytest.raises(ValueError, match=r"is a sharded step checkpoint .* longstride export-hf checkpoint="):
        check_checkpoint_dir(path, "checkpoint")


class _Payload:
    """Unpickled, it would create the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def test_shard_metadata_with_a_pickled_payload_is_refused_and_never_runs(step_dir, tmp_path):
    from longstride.parallel.parallelize import Parallelized
    from longstride.recipes.checkpoint.format import CheckpointError, load_shards_checked, verify, write_manifest

    path, _, _ = step_dir
    marker = tmp_path / "payload-ran"
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        real = pickle.load(f)
    real.storage_meta = _Payload(str(marker))  # inside DCP's own record, where a plain pickle.load would run it
    with open(meta, "wb") as f:
        pickle.dump(real, f)
    write_manifest(path, 1)
    assert verify(path) is None, "the manifest vouches for the files: whoever wrote them wrote it"
    fresh, opt = tiny(1)
    with pytest.raises(CheckpointError, match=r"\.metadata holds a 'pathlib\.Path\.touch' object"):
        load_shards_checked(path, Parallelized(fresh, False, None), opt)
    assert not marker.exists(), "the payload ran"


def test_a_non_tensor_shard_item_with_a_payload_is_refused_and_never_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    from longstride.parallel.parallelize import Parallelized
    from longstride.recipes.checkpoint.format import CheckpointError, load_shards_checked

    marker = tmp_path / "payload-ran"
    model, opt = trained(0)
    path = str(tmp_path / "ck")
    Parallelized(model, False, None).save_state(path, opt)
    from longstride.parallel.shards import _state
    state = _state(model, opt)
    state["optim"]["param_groups"][0]["lr"] = _Payload(str(marker))  # a value a load reads, as a pickled byte item
    dcp.save(state, checkpoint_id=path)
    fresh, fresh_opt = tiny(1)
    with pytest.raises(CheckpointError, match=r"holds an item .*param_groups.* not tensors and plain data"):
        load_shards_checked(path, Parallelized(fresh, False, None), fresh_opt)
    assert not marker.exists(), "the payload ran"


def _stream_worker(rank, world, root):
    from longstride.parallel.config import WorldMesh
    from longstride.parallel.fsdp import apply_fsdp, stream_weights

    model, _ = tiny(0)
    if rank == 0:
        model.lm.save_pretrained(os.path.join(root, "reference"))
    apply_fsdp(model, model.lm.model.layers, "cpu", world, None, WorldMesh("cpu", world))
    for name, shard_bytes in (("one_file", 2 ** 30), ("many_files", 8_000)):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        stream_weights(model.lm, os.path.join(root, name), rank == 0, shard_bytes)
        if rank == 0:
            model.lm.config.save_pretrained(os.path.join(root, name))


def test_fsdp2_final_weights_stream_into_the_files_save_pretrained_writes(tmp_path):
    """2 gloo processes, FSDP2: the weights gathered a tensor at a time give the bytes save_pretrained writes
    (one file), and with a small file budget several files plus the index, which transformers loads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from longstride.parallel.spawn import run_gloo

    run_gloo(_stream_worker, 2, str(tmp_path))
    ref = (tmp_path / "reference" / "model.safetensors").read_bytes()
    assert (tmp_path / "one_file" / "model.safetensors").read_bytes() == ref
    files = sorted(p.name for p in (tmp_path / "many_files").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    want = load_file(str(tmp_path / "reference" / "model.safetensors"))
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "many_files")
    for name, w in want.items():
        assert torch.equal(got.get_parameter(name), w), name
    assert got.lm_head.weight is got.model.embed_tokens.weight


def _index_fault_worker(rank, world, root):
    from longstride.parallel.config import WorldMesh
    from longstride.parallel.fsdp import apply_fsdp, stream_weights

    model, _ = tiny(0)
    apply_fsdp(model, model.lm.model.layers, "cpu", world, None, WorldMesh("cpu", world))
    try:
        stream_weights(model.lm, root, rank == 0, 8_000)
        said = "no error"
    except OSError as e:
        said = str(e)
    with open(os.path.join(root, f"rank{rank}.txt"), "w") as f:
        f.write(said)


def test_an_index_the_main_rank_cannot_write_fails_every_rank(tmp_path):
    """A final's index file that cannot be written (a folder in its place: a real OSError from open) fails every
    rank with the main rank's reason, at the one agreement the weights files' failures use; it failed the main rank
    alone before, leaving the others in a collective it never reached."""
    from longstride.parallel.spawn import run_gloo

    (tmp_path / "model.safetensors.index.json").mkdir()
    run_gloo(_index_fault_worker, 2, str(tmp_path))
    said = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert said[0].startswith("the main rank could not write the weights: [Errno 21] Is a directory"), said
    assert said[1] == "the main rank could not write the weights", said


def test_shard_metadata_naming_a_dotted_path_through_an_allowed_module_is_refused(tmp_path):
    """Pickle resolves a dotted name attribute by attribute from the module it names, so an allowed module
    that imports torch would hand out any of torch's attributes (here a file opener); a name with a dot is
    refused whatever its module."""
    from longstride.parallel.shards import SafeReader, UnsafeCheckpoint

    marker = str(tmp_path / "payload-ran")

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    # protocol 4: STACK_GLOBAL(DCP's metadata module, "torch.storage.io.FileIO")(marker, "w")
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + text("torch.distributed.checkpoint.metadata")
                                         + text("torch.storage.io.FileIO") + b"\x93" + text(marker) + text("w")
                                         + b"\x86R.")
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata holds a '.*torch\.storage\.io\.FileIO' object"):
        SafeReader(str(tmp_path)).read_metadata()
    assert not os.path.exists(marker), "the payload ran"
    with open(tmp_path / ".metadata", "rb") as f:  # the check is not vacuous: plain pickle runs it
        pickle.load(f).close()
    assert os.path.exists(marker)


def test_a_step_checkpoint_from_before_shards_is_refused_naming_what_to_do(tmp_path):
    from longstride.parallel.parallelize import Parallelized
    from longstride.recipes.checkpoint.format import CheckpointError, load_shards_checked

    model, opt = tiny(0)
    model.lm.save_pretrained(tmp_path)  # the old layout: whole weights, no shards
    with pytest.raises(CheckpointError, match=r"from before sharded checkpoints .* model\.checkpoint="):
        load_shards_checked(str(tmp_path), Parallelized(model, False, None), opt)


def test_a_step_checkpoint_file_its_manifest_leaves_out_is_damage(tmp_path):
    """A shard, its .metadata or config.json left out of a step checkpoint's manifest could be truncated or edited
    unseen (a resume read it and failed, or trained on it, instead of falling back): every file the directory holds
    must be listed."""
    import json

    from longstride.recipes.checkpoint.format import verify, write_manifest

    ck = tmp_path / "step_000004"
    ck.mkdir()
    for name in ("trainer.pt", "stage.json", "rank0.pt", "__0_0.distcp", ".metadata", "config.json"):
        (ck / name).write_bytes(name.encode())
    write_manifest(str(ck), world_size=1)
    assert verify(str(ck)) is None
    for left_out in ("__0_0.distcp", ".metadata", "config.json"):
        manifest = json.loads((ck / "manifest.json").read_text())
        del manifest["files"][left_out]
        (ck / "manifest.json").write_text(json.dumps(manifest))
        assert verify(str(ck)) == f"manifest.json does not list {left_out}, which this checkpoint has"
        write_manifest(str(ck), world_size=1)


def test_a_checkpoint_whose_parameter_groups_differ_from_this_run_s_resumes(tmp_path):
    """A step checkpoint written by a longstride that put GPT-2's embedding tables (wte, wpe) in the decayed group
    (recipes/run/schedule.param_groups since keeps every nn.Embedding undecayed): loaded into this run's groups, the
    saved group matched onto the other left one group without its hyperparameters and the first step raised
    KeyError 'betas'. Each parameter's state now comes back under this run's groups, moments included."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from longstride.parallel.shards import load_shards, save_shards
    from longstride.recipes.run.schedule import param_groups

    def model_and(groups):
        torch.manual_seed(0)
        model = Wrapped(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)))
        return model, torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95))

    def old_groups(model):  # the name rule alone: wte and wpe decayed
        named = [(n, p) for n, p in model.named_parameters()]
        return [{"params": [p for n, p in named if p.ndim >= 2 and "embed" not in n], "weight_decay": 0.1},
                {"params": [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)], "weight_decay": 0.0}]

    old, opt = model_and(old_groups)
    ids = torch.randint(0, 64, (2, 12))
    old.lm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    save_shards(str(tmp_path), old, opt)
    new, opt2 = model_and(lambda m: param_groups(m, 0.1))
    load_shards(str(tmp_path), new, opt2)
    wte = new.lm.transformer.wte.weight
    assert any(p is wte for p in opt2.param_groups[1]["params"]) and opt2.param_groups[1]["betas"] == (0.9, 0.95)
    assert torch.equal(opt2.state[wte]["exp_avg"], opt.state[old.lm.transformer.wte.weight]["exp_avg"])
    new.lm(input_ids=ids, labels=ids).loss.backward()
    opt2.step()


def _one_rank_fails_worker(rank, world, root, where):
    """Both ranks write checkpoint root/s1/step_000001; `where` fails on one rank for real: "rank1" its own part
    (a file under a folder that does not exist), "seal" the main rank's manifest (a value JSON cannot write).
    Each rank records what it raised."""
    from longstride.recipes.checkpoint.format import writing_checkpoint

    path = os.path.join(root, "s1", "step_000001")
    manifest = {"unwritable": object()} if where == "seal" else None
    def write():
        with writing_checkpoint(path, rank=rank, is_main=rank == 0, trainer_state={"step": 1}, rank_state={},
                                meta={"step": 1}, world_size=world, manifest=manifest) as d:
            if rank == 1 and where == "rank1":
                open(os.path.join(d, "missing", "part"), "wb").close()
        return "no error"
    report(os.path.join(root, f"{where}-rank{rank}.txt"), write)


@pytest.mark.parametrize("where", ["rank1", "seal"])
def test_a_save_failing_on_one_rank_raises_on_every_rank(tmp_path, where):
    """One rank's part of a save failed: it raised, and the others waited at the save's next barrier until the
    launcher or the collective timeout (30 minutes) ended them, without the reason. Every rank now raises: the
    failed one its own error, the others naming the checkpoint and another rank; nothing looks complete."""
    from longstride.parallel.spawn import run_gloo

    os.makedirs(tmp_path / "s1")
    run_gloo(_one_rank_fails_worker, 2, str(tmp_path), where)
    said = [(tmp_path / f"{where}-rank{r}.txt").read_text() for r in range(2)]
    failed, other = (said[1], said[0]) if where == "rank1" else (said[0], said[1])
    assert failed.startswith("CheckpointError: could not write checkpoint") and "No such file" in failed \
        if where == "rank1" else failed.startswith("TypeError: ") and "not JSON serializable" in failed, said
    assert other == (f"CheckpointError: could not write checkpoint {tmp_path}/s1/step_000001 on another rank (its "
                     "log says why); the earlier checkpoints are intact: rerun to resume from the newest"
                     if where == "rank1" else f"CheckpointError: the main rank failed to seal checkpoint {tmp_path}/"
                     "s1/step_000001 (its log says why and whether the checkpoint is complete); rerun to resume from "
                     "the newest intact checkpoint"), said
    assert not (tmp_path / "s1" / "step_000001").exists()


def test_a_pruning_failure_after_the_seal_says_the_checkpoint_is_complete(tmp_path):
    """train.keep_last's removal of an older checkpoint failed after the new one was in place (here a leftover
    folder under the name it is renamed to first): the raw OSError read as a failed save. It is a CheckpointError
    saying the checkpoint is complete; it is, and the older one is still there."""
    from longstride.recipes.checkpoint.format import CheckpointError, TMP_PREFIX, step_name, verify, writing_checkpoint

    stage = tmp_path / "s1"

    def save(step, keep_last):
        with writing_checkpoint(str(stage / step_name(step)), rank=0, is_main=True, trainer_state={"step": step},
                                rank_state={}, meta={}, keep_last=keep_last):
            pass

    save(1, 0)
    os.makedirs(stage / f"{TMP_PREFIX}old-{step_name(1)}" / "leftover")
    with pytest.raises(CheckpointError, match=rf"checkpoint {stage}/step_000002 is written and complete, but then "
                                              r".* failed \(\[Errno 39\] Directory not empty"):
        save(2, 1)
    assert verify(str(stage / "step_000002")) is None and verify(str(stage / "step_000001")) is None
