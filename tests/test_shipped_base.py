"""The shipped base models (model/shipped/: tiny_base_256, the main job's, and tiny_base_256_allrope, the
ablation's RoPE-on-every-layer base): each loads like any HF checkpoint, its files match its manifest, the command
that made it still composes, and the main job's recipe starts from tiny_base_256."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from longstride.recipes.checkpoint.format import MANIFEST, verify
from longstride.whole_dir import is_partial
from tests.conftest import REPO, compose_cfg

SHIPPED = REPO / "model" / "shipped" / "tiny_base_256"
ALL_SHIPPED = sorted(p for p in (REPO / "model" / "shipped").iterdir()
                     if (p / MANIFEST).is_file() and not is_partial(str(p)))  # not one being shipped


def manifest(folder=SHIPPED) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def test_every_shipped_model_is_covered():
    assert [p.name for p in ALL_SHIPPED] == ["tiny_base_256", "tiny_base_256_allrope"]


def test_loads_as_an_hf_checkpoint_trained_at_256():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED).eval()
    assert model.config.max_position_embeddings == 256
    assert model.config.rope_parameters["rope_theta"] == 1e4
    assert model.config.no_rope_layers == [1, 1, 1, 0], "NoPE on layer 4 of 4"
    ids = tok("def add(a, b):\n    return a + b\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


@pytest.mark.parametrize("folder", ALL_SHIPPED, ids=lambda p: p.name)
def test_files_match_the_manifest(folder):
    assert verify(str(folder)) is None


@pytest.mark.parametrize("folder", ALL_SHIPPED, ids=lambda p: p.name)
def test_its_configs_say_what_a_final_s_say(folder):
    """As save_config writes them: the KV cache on for a user's generate(), the RoPE base under the key older
    readers take, and a NoPE interval that rebuilds the list (the all-RoPE base said 1: every layer NoPE)."""
    from longstride.model.build import nope_pattern

    config = json.loads((folder / "config.json").read_text())
    assert config["use_cache"] and json.loads((folder / "generation_config.json").read_text())["use_cache"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert nope_pattern(config["num_hidden_layers"], config["no_rope_layer_interval"]) == config["no_rope_layers"]


def test_a_changed_byte_is_caught(tmp_path):
    files = manifest()["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(files)
    copy = tmp_path / "base"
    shutil.copytree(SHIPPED, copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert verify(str(copy)) == "model.safetensors does not match its checksum"


@pytest.mark.parametrize("folder", ALL_SHIPPED, ids=lambda p: p.name)
def test_manifest_records_how_it_was_made_and_its_own_scores(folder):
    m = manifest(folder)
    made = m["made_by"]
    assert made["recipe"] == "tiny_base" and made["stage"] == "s1_256"
    assert made["command"].endswith(" ".join(made["overrides"]))
    assert len(m["commit"]) >= 40
    scores = m["ruler"]["scores"]
    assert m["ruler"]["samples"] >= 20 and set(scores) == {"niah_single_1", "synth_kv"}
    assert set(scores["synth_kv"]) == {"256", "512"}


@pytest.mark.parametrize("folder", ALL_SHIPPED, ids=lambda p: p.name)
def test_the_command_that_made_it_still_composes(folder):
    made = manifest(folder)["made_by"]
    cfg = compose_cfg(made["overrides"])
    assert cfg.recipe.name == "tiny_base" and list(cfg.recipe.stages) == ["s0_copy", made["stage"]]
    assert cfg.recipe.stages[made["stage"]].seq_len == 256 and cfg.recipe.stages[made["stage"]].rope_theta == 1e4
    assert cfg.train.seed == made["train_seed"] and cfg.data.seed == made["data_seed"]
    config = json.loads((folder / "config.json").read_text())
    assert config["no_rope_layers"] == ([1] * 4 if cfg.model.nope_interval == 0 else [1, 1, 1, 0])


def test_main_job_extends_the_shipped_base():
    cfg = compose_cfg(["recipe=tiny_extend"])
    shipped = str(SHIPPED)  # ${shipped:tiny_base_256}: the same folder from any working directory
    assert cfg.model.arch == "checkpoint" and cfg.model.checkpoint == shipped and cfg.data.tokenizer == shipped
    stages = cfg.recipe.stages
    assert [s.seq_len for s in stages.values()] == [2048, 4096] and all(s.cp == 2 for s in stages.values())
    assert [s.rope_theta for s in stages.values()] == [4e5, 1e6]


@pytest.mark.parametrize("field", ["model.checkpoint", "data.tokenizer"])
def test_a_missing_base_is_named_before_training(field, tmp_path):
    from tests.conftest import run_cli

    res = run_cli(["recipe=tiny_extend", f"{field}={tmp_path}/nowhere", f"paths.output_root={tmp_path}/out",
                   "recipe.stages.s2_2k.cp=1", "recipe.stages.s3_4k.cp=1",
                   "logger.wandb_mode=disabled"], timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"{field}='{tmp_path}/nowhere'" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "nothing written before it"


def test_shipping_copies_the_weights_however_they_are_saved(tmp_path):
    """A final saved in one file or in shards (a large model: model-0000N-of-0000M.safetensors and their index)
    ships its weights; a folder without weights is refused before anything is copied."""
    from longstride.recipes.checkpoint.ship import shipped_files

    one, sharded, none = (tmp_path / n for n in ("one", "sharded", "none"))
    for d, names in [(one, ["config.json", "model.safetensors", "tokenizer.json", "optimizer.pt"]),
                     (sharded, ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                "model.safetensors.index.json", "manifest.json"]),
                     (none, ["config.json", "tokenizer.json"])]:
        d.mkdir()
        for n in names:
            (d / n).write_text("")
    assert shipped_files(str(one)) == ["config.json", "tokenizer.json", "model.safetensors"]
    assert shipped_files(str(sharded)) == ["config.json", "model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    with pytest.raises(ValueError, match="holds no safetensors weights"):
        shipped_files(str(none))


@pytest.mark.parametrize("scores_fail", [False, True])
def test_shipping_builds_aside_and_renames_whole(tmp_path, monkeypatch, scores_fail):
    """ship() copies, scores and writes the manifest in a sibling folder and renames it into place: the shipped
    folder verifies; a failure while scoring leaves neither it nor the staging folder; a killed ship's folder is
    removed; a destination whose parent is missing is refused before anything is written."""
    from longstride.recipes.checkpoint import ship

    def scores(directory, samples, name):
        assert directory != str(dest) and not dest.exists(), "scored before it is in place"
        if scores_fail:
            raise RuntimeError("RULER failed")
        return {"samples": samples, "name": name}

    monkeypatch.setattr(ship, "own_scores", scores)
    monkeypatch.setattr(ship, "provenance", lambda final: {"recipe": "test"})
    dest = tmp_path / "shipped" / "m"
    with pytest.raises(ValueError, match="does not exist; create it"):
        ship.ship(str(SHIPPED), str(dest), 3)
    dest.parent.mkdir()
    (dest.parent / "m.partial-999999999").mkdir()  # a killed ship's folder: its process is gone
    if scores_fail:
        with pytest.raises(RuntimeError, match="RULER failed"):
            ship.ship(str(SHIPPED), str(dest), 3)
        assert os.listdir(dest.parent) == [], "nothing left behind"
        return
    extra = ship.ship(str(SHIPPED), str(dest), 3)
    assert extra["ruler"] == {"samples": 3, "name": "m"} and verify(str(dest)) is None
    assert os.listdir(dest.parent) == ["m"]
