"""Every config group composes against its schema; bad input fails before any model is built."""
from __future__ import annotations

import os
import re

import pytest
import torch
from hydra.errors import ConfigCompositionException

from longstride.recipes.config.plan import validate
from tests.conftest import CONFIGS, compose_cfg, run_cli

GROUPS = ["model", "data", "parallel", "optim", "logger", "paths", "train"]


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


# Options with mandatory values (???) need them filled for the schema check to finish.
REQUIRED = {
    ("model", "checkpoint"): ["model.checkpoint=/ckpt"],
    ("data", "files"): ["data.sources.main.path=/corpus/*.jsonl", "data.tokenizer=/tok"],
    ("data", "local_dir"): ["data.sources.local.path=/texts"],
}


def assert_contains(actual, expected, where: str) -> None:
    """Every value the YAML file sets arrives in the typed config (dicts compared key by key; ??? skipped)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), (where, actual)
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} missing from the composed config"
            assert_contains(actual[key], value, f"{where}.{key}")
    elif expected != "???":
        assert actual == expected, (where, actual, expected)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_group_option_composes(group, option):
    from omegaconf import OmegaConf

    required = REQUIRED.get((group, option), [])
    cfg = compose_cfg([f"{group}={option}", *required])
    node = getattr(cfg, group)
    assert type(node).__name__.endswith("Config"), f"{group} is not typed by its schema dataclass: {type(node)}"
    filled = OmegaConf.from_dotlist([o.split(".", 1)[1] for o in required if o.startswith(f"{group}.")])
    written = OmegaConf.to_container(OmegaConf.merge(OmegaConf.load(CONFIGS / group / f"{option}.yaml"), filled))
    written = {k: v for k, v in written.items() if k != "defaults"}
    assert written, f"{group}/{option}.yaml sets nothing"
    assert_contains(OmegaConf.to_container(OmegaConf.structured(node), enum_to_str=True), written, group)


@pytest.mark.parametrize("recipe", group_options("recipe"))
def test_every_recipe_composes(recipe):
    extra = {"smollm3_3b_64k": ["data.tokenizer=/tok", "data.sources.main.path=/corpus/*.parquet"],
             "extend_pretrained": ["model.checkpoint=/ckpt"]}.get(recipe, [])
    cfg = compose_cfg([f"recipe={recipe}", *extra])
    lens = [s.seq_len for s in cfg.recipe.stages.values()]
    assert lens == sorted(lens) and len(lens) >= 2
    thetas = [s.rope_theta for s in cfg.recipe.stages.values()]
    for (l0, t0), (l1, t1) in zip(zip(lens, thetas), zip(lens[1:], thetas[1:])):
        assert (t1 > t0) if l1 > l0 else (t1 == t0), "a longer stage bumps the RoPE base; a same-length one keeps it"


def test_real_recipe_shape():
    cfg = compose_cfg(["recipe=smollm3_3b_64k", "data.tokenizer=/tok", "data.sources.main.path=/c/*.parquet"])
    st = cfg.recipe.stages
    assert [s.seq_len for s in st.values()] == [4096, 32768, 65536]
    assert [s.rope_theta for s in st.values()] == [5e4, 2e6, 5e6]
    assert cfg.model.num_hidden_layers == 36 and cfg.model.nope_interval == 4


def expect_error(overrides, match, world=2, exc=ValueError):  # the tiny recipe runs on 2 ranks
    with pytest.raises(exc, match=match):
        validate(compose_cfg(overrides), world)


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigCompositionException, match="hiden_size"):  # plain override: Hydra refuses
        compose_cfg(["model.hiden_size=3"])
    with pytest.raises(ValueError, match=r"model.hiden_size"):  # forced with +: the schema walk refuses
        compose_cfg(["+model.hiden_size=3"])
    with pytest.raises(ValueError, match=r"recipe.stages.s2_2k.sequence_len"):
        compose_cfg(["+recipe.stages.s2_2k.sequence_len=3"])


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigCompositionException, match=r"recipe.stages.s1_256.seq_len"):
        compose_cfg(["recipe.stages.s1_256.seq_len=long"])


def test_stages_must_not_shrink():
    expect_error(["recipe.stages.s2_2k.seq_len=128"], r"recipe.stages.s2_2k.seq_len=128 is shorter than the previous")
    validate(compose_cfg(["recipe=tiny", "recipe.stages.s2_2k.seq_len=256", "recipe.stages.s2_2k.cp=1"]), 2)


def test_rope_base_positive():
    expect_error(["recipe.stages.s2_2k.rope_theta=0"], r"recipe.stages.s2_2k.rope_theta=0.0 must be positive")


def test_seq_len_divisible_for_cp():
    expect_error(["recipe.stages.s2_2k.seq_len=2050", "recipe.stages.s2_2k.cp=2"],
                 r"seq_len=2050 is not divisible by 2 x cp = 4", world=2)


def test_cp_impl_degrees_checked_against_the_model_heads():
    # the tiny model has 4 query heads; s2_2k and s3_4k run cp=2
    expect_error(["parallel.cp_impl=upipe", "parallel.upipe_heads=3"],
                 r"parallel.upipe_heads=3 must be a multiple of the Ulysses degree 2 and divide the 4 query heads; "
                 r"valid: \[2, 4\]")
    expect_error(["parallel.cp_impl=hybrid"], r"parallel.ulysses=0: hybrid .*one of \[1, 2\]")
    expect_error(["parallel.cp_impl=hybrid", "parallel.ulysses=1", "parallel.upipe_heads=2"],
                 r"parallel.upipe_heads=2 splits a Ulysses group's heads into stages, and parallel.ulysses=1 makes "
                 r"no group \(recipe.stages.s2_2k.cp=2 is all ring\); drop parallel.upipe_heads or set "
                 r"parallel.ulysses to one of \[2\]")
    world4 = ["recipe.stages.s1_256.batch_tokens=8192", "recipe.stages.s2_2k.cp=4", "recipe.stages.s3_4k.cp=4"]
    expect_error(["parallel.cp_impl=ulysses", "model.num_attention_heads=6", "model.num_key_value_heads=2",
                  "model.head_dim=16", *world4],
                 r"s2_2k.cp=4: the Ulysses degree 4 must divide the model's 6 query heads", world=4)
    validate(compose_cfg(["parallel.cp_impl=upipe"]), 2)
    validate(compose_cfg(["parallel.cp_impl=hybrid", "parallel.ulysses=2", *world4]), 4)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.ulysses=2"], r"parallel.ulysses=2 is read by cp_impl=hybrid, and this run is cp_impl=ring"),
    (["parallel.upipe_heads=2"], r"parallel.upipe_heads=2 is read by cp_impl=upipe or hybrid, and this run is "
                                 r"cp_impl=ring"),
    (["parallel.cp_impl=ulysses", "parallel.ulysses=2"], r"parallel.ulysses=2 is read by cp_impl=hybrid .*drop"),
    (["parallel.cp_impl=upipe", "parallel.ulysses=2"], r"parallel.ulysses=2 is read by cp_impl=hybrid .*drop"),
])
def test_a_setting_the_chosen_cp_method_does_not_read_is_refused_not_ignored(overrides, message):
    expect_error(overrides, message)


def test_world_not_divisible_by_cp():
    expect_error(["recipe.stages.s1_256.cp=2"], r"s1_256.cp: world size 3 is not divisible by cp 2", world=3)


def test_batch_tokens_must_divide():
    expect_error(["recipe.stages.s2_2k.batch_tokens=3000"], r"batch_tokens=3000 is not a multiple of dp 1")


def test_missing_checkpoint_dir(tmp_path):
    expect_error(["model=checkpoint", "model.checkpoint=/no/such/dir"], r"model.checkpoint='/no/such/dir' does not exist")
    (tmp_path / "weights.bin").write_text("x")
    expect_error(["model=checkpoint", f"model.checkpoint={tmp_path / 'weights.bin'}"], r"weights.bin' is a file")


def test_a_source_keeping_no_documents_is_refused():
    expect_error(["data.sources.stdlib.max_docs=0"], r"data.sources.stdlib.max_docs=0 must be >= 1")


def test_mandatory_values_named():
    expect_error(["model=checkpoint"], r"model.arch=checkpoint needs model.checkpoint=")
    expect_error(["data=files"], r"data.sources.main.path is not set")
    expect_error(["data=local_dir"], r"data.sources.local.path is not set")


def test_unknown_stage_selected():
    expect_error(["stage=s9"], r"stage='s9' is not in recipe 'tiny'")


def test_steps_xor_tokens():
    expect_error(["recipe.stages.s1_256.tokens=1000"], r"give exactly one of steps or tokens")


def test_data_group_replaces_sources():
    cfg = compose_cfg(["data=files", "data.sources.main.path=/c/*.jsonl"])
    assert list(cfg.data.sources) == ["main"]


def test_kernel_not_installed_fails_before_compute():
    # this machine has no CUDA: both GPU kernels are refused before compute, naming the install
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here: the error path cannot occur")
    for kernel in ("torch_flash", "flash_attn"):
        for extra in ([], ["recipe.stages.s1_256.cp=2"]):
            expect_error([f"parallel.kernel={kernel}", *extra], rf"parallel.kernel={kernel} needs CUDA")


CHOICES = {  # every choice field of the schema: a typo fails while Hydra composes, listing the choices
    "parallel.kernel": "auto, torch_flash, flash_attn, sdpa, math",
    "parallel.flash_impl": "FA2, FA3, FA4",
    "parallel.balance": "zigzag, docs",
    "recipe.stages.s3_4k.balance": "zigzag, docs",
    "recipe.stages.s2_2k.schedule": "cosine, wsd, constant",
    "data.packing": "best_fit, concat",
    "train.precision": "auto, bf16, fp32",
    "model.arch": "smollm3, checkpoint",
    "model.checkpoint_mode": "full, selective",
    "logger.wandb_mode": "offline, online, disabled",
}


def test_registry_names_fail_before_compute_with_the_registry_listed():
    """parallel.cp_impl and a source's kind are the keys of their registries (parallel/cp.py METHODS,
    data/sources.py KINDS), checked by validate with every valid name in the message."""
    expect_error(["parallel.cp_impl=typo", "recipe.stages.s2_2k.cp=2"],
                 r"parallel.cp_impl='typo' is unknown; use one of \['ring', 'ulysses', 'upipe', 'hybrid'\]", world=2)
    expect_error(["data.sources.stdlib.kind=typo"], r"data.sources.stdlib.kind='typo' is unknown; use one of "
                 r"\['stdlib', 'local_dir', 'files', 'disk', 'hub', 'synthetic', 'pymanual'\]")


@pytest.mark.parametrize("key", list(CHOICES))
def test_choice_typo_fails_at_composition_with_the_choices(key):
    with pytest.raises(ConfigCompositionException, match=f"Error merging override {key}=typo") as e:
        compose_cfg([f"{key}=typo"])
    assert f"Invalid value 'typo', expected one of [{CHOICES[key]}]" in str(e.value.__cause__)
    assert f"full_key: {key}" in str(e.value.__cause__)


def test_the_schema_imports_constants_not_runtime_modules():
    """Composing and typing a config needs no torch, transformers, datasets or accelerate: the schema imports
    only the groups' dataclasses and choices (checks that need runtime modules live in recipes/config/plan.py)."""
    import subprocess
    import sys

    code = ("import sys, longstride.recipes.config.schema; "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_cpu_launch_on_a_gpu_machine_plans_for_the_cpu(monkeypatch):
    """ACCELERATE_USE_CPU on a machine with a bf16 GPU (`accelerate launch --cpu`, or set for a multi-process CPU
    run): accelerate runs on the CPU, so the run's precision must be fp32 and its plan the CPU's, not bf16 /
    torch_flash for a GPU it does not use."""
    import torch

    from longstride.recipes.config.plan import resolve_precision
    from longstride.recipes.train import use_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert not use_cpu() and resolve_precision("auto", on_gpu=True) == "bf16"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # what `accelerate launch --cpu` sets
    assert use_cpu() and resolve_precision("auto", on_gpu=not use_cpu()) == "no"
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_precision("bf16", on_gpu=False)


def test_a_tokenizer_that_does_not_load_or_fit_the_model_is_refused(tmp_path):
    from longstride.recipes.config.schema import SHIPPED

    expect_error([f"data.tokenizer={tmp_path}"], rf"data.tokenizer={tmp_path} could not be loaded as an HF tokenizer")
    shipped = f"{SHIPPED}/tiny_base_256"
    expect_error([f"data.tokenizer={shipped}", "model.vocab_size=100"],
                 r"makes ids up to 4095 but model.vocab_size is 100; raise it or set model.vocab_size=null")
    validate(compose_cfg([f"data.tokenizer={shipped}", "model.vocab_size=4096"]), 2)


def test_a_pretrained_model_is_refused_a_tokenizer_that_is_not_its_own(tmp_path):
    """model=checkpoint with data.tokenizer=null would train a new BPE whose ids mean nothing to the model (it
    trained, at a loss near chance); a tokenizer with more ids than the model embeds would fail at its first
    forward. Both are refused at validation, naming the field and the fix."""
    from transformers import AutoTokenizer

    from longstride.recipes.config.schema import SHIPPED

    base = os.path.join(SHIPPED, "tiny_base_256")
    with pytest.raises(ValueError, match=rf"model.checkpoint={base} with data.tokenizer=null would train a new "
                                         rf"tokenizer.*set data.tokenizer={base}$"):
        validate(compose_cfg(["recipe=tiny_extend", "data.tokenizer=null"]), 2)
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"eos_token": "<|new_end|>"})  # an EOS packing writes, with an id past the embedding
    tok.save_pretrained(tmp_path / "bigger")
    with pytest.raises(ValueError, match=rf"data.tokenizer={tmp_path / 'bigger'} makes ids up to 4096 but "
                                         rf"model.checkpoint=.* embeds 4096"):
        validate(compose_cfg(["recipe=tiny_extend", f"data.tokenizer={tmp_path / 'bigger'}"]), 2)
    validate(compose_cfg(["recipe=tiny_extend"]), 2)  # its own tokenizer passes


@pytest.mark.parametrize("damage, message", [
    ("no_weights", "has no weights (none of model.safetensors"),
    ("truncated", "model.safetensors cannot be read (Error while deserializing header"),
    ("truncated_with_manifest", "does not match its manifest.json: model.safetensors has"),
])
def test_a_base_checkpoint_without_readable_weights_is_refused_at_validation(tmp_path, damage, message):
    """The user's own base: missing or torn weights are named at validation, not met as transformers' traceback
    after the corpus was built; a base longstride wrote (with its manifest) is checked against the manifest."""
    import shutil

    from longstride.recipes.config.schema import SHIPPED

    base = tmp_path / "base"
    shutil.copytree(os.path.join(SHIPPED, "tiny_base_256"), base)
    if damage != "truncated_with_manifest":
        (base / "manifest.json").unlink()  # an HF directory as most are
    weights = base / "model.safetensors"
    if damage == "no_weights":
        weights.unlink()
    else:
        os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ValueError, match=re.escape(f"model.checkpoint='{base}'") + ".*" + re.escape(message)):
        validate(compose_cfg(["recipe=tiny_extend", f"model.checkpoint={base}", f"data.tokenizer={base}"]), 2)


def test_wandb_online_without_a_login_is_refused_before_compute(micro, tmp_path, monkeypatch):
    """wandb.init would raise its UsageError after the corpus and model are built (eval ruler's after scoring); the
    check reads what wandb reads (WANDB_API_KEY, the netrc entry for its host)."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))
    online = micro + ["logger.wandb_mode=online"]
    with pytest.raises(ValueError, match=r"logger.wandb_mode=online needs a wandb login"):
        validate(compose_cfg(online), 1)
    from longstride.eval.cli import parse_ruler
    from longstride.recipes.config.schema import SHIPPED

    with pytest.raises(ValueError, match=r"^wandb=online needs a wandb login"):  # eval ruler too, before it loads
        parse_ruler([f"checkpoint={SHIPPED}/tiny_base_256", "wandb=online", f"out={tmp_path / 'eval'}"])
    (tmp_path / "netrc").write_text("machine github.com\n  login user\n  password abc\n")  # another host's login
    with pytest.raises(ValueError, match=r"logger.wandb_mode=online needs a wandb login"):
        validate(compose_cfg(online), 1)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    validate(compose_cfg(online), 1)
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.lab:8080")  # a self-hosted server: its host:port entry
    (tmp_path / "netrc").write_text("machine wandb.lab:8080\n  login user\n  password abc\n")
    validate(compose_cfg(online), 1)
    (tmp_path / "netrc").unlink()
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nbase_url = http://wandb.lab:8080\napi_key = abc\n")
    validate(compose_cfg(online), 1)


@pytest.mark.parametrize("overrides, message", [
    (["train.resume=false", "train.resume_from=/x"], "contradict each other"),
    (["stage=s2_2k", "train.resume=false"], "drop stage="),
    (["stage=s2_2k", "train.resume_from=/x"], "drop stage="),
])
def test_contradictory_restart_options(micro, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(micro + overrides), 1)


def test_output_root_that_is_a_file(micro, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="paths.output_root=.*afile' is a file"):
        validate(compose_cfg(micro + [f"paths.output_root={tmp_path / 'afile'}"]), 1)


def test_a_stdlib_source_reading_the_manual_beside_a_pymanual_source_is_refused():
    """The pymanual source's documents are pydoc_data/topics.py's text and it holds some out for validation; a stdlib
    source reading that file trained on them (gpu_extend_64k's exclude had dropped it)."""
    from longstride.recipes.config.plan import _check_data

    over = ["recipe=gpu_extend_64k"]
    _check_data(compose_cfg(over))
    with pytest.raises(ValueError, match=r"data.sources.stdlib reads pydoc_data/topics.py, the text of "
                                         r"data.sources.pymanual .*exclude=\"test/test_\[t-z\]\*.py,pydoc_data/topics.py\""):
        _check_data(compose_cfg(over + ["data.sources.stdlib.exclude='test/test_[t-z]*.py'"]))


def test_a_held_out_stdlib_file_that_synthetic_filler_would_train_on_is_refused():
    """Synthetic filler takes lines from the first standard-library files; holding one of them out of the stdlib
    source (for `eval ppl`) while a synthetic source draws filler from it would train on it anyway."""
    from longstride.recipes.config.plan import _check_data

    over = ["recipe=gpu_extend_64k"]
    _check_data(compose_cfg(over))  # its held-out test/test_[t-z]*.py lie past the filler's files
    with pytest.raises(ValueError, match=r"data.sources.stdlib.exclude holds out _pydecimal.py, whose lines the "
                                         r"filler of data.sources.\{copy_short,.*retrieval_32k.*\} .*set their "
                                         r"synthetic.corpus_share=0 or hold out"):
        _check_data(compose_cfg(over + ["data.sources.stdlib.exclude=_pydecimal.py"]))


def test_a_stage_s_long_docs_can_be_set_from_the_command_line(tmp_path):
    """recipe.stages.<s>.long_docs is null (it takes data.long_docs) and OmegaConf can set neither a field under it
    nor a group on it (an AssertionError traceback, exit 1): a field or a {...} group now lands on the stage, the
    fields it does not give taken from data.long_docs; an unknown field or stage is named."""
    cfg = compose_cfg(["recipe=tiny", "data.long_docs.min_tokens=64", "recipe.stages.s2_2k.long_docs.min_share=0.25"])
    assert (cfg.recipe.stages["s2_2k"].long_docs.min_tokens, cfg.recipe.stages["s2_2k"].long_docs.min_share) == \
        (64, 0.25) and cfg.recipe.stages["s1_256"].long_docs is None
    cfg = compose_cfg(["recipe=tiny", "recipe.stages.s2_2k.long_docs={min_tokens:100,min_share:0.5}"])
    assert (cfg.recipe.stages["s2_2k"].long_docs.min_tokens, cfg.recipe.stages["s2_2k"].long_docs.min_share) == \
        (100, 0.5)
    with pytest.raises(ValueError, match=re.escape("recipe.stages.s2_2k.long_docs.share=0.5: long_docs takes "
                                                   "['min_share', 'min_tokens']")):
        compose_cfg(["recipe=tiny", "recipe.stages.s2_2k.long_docs.share=0.5"])
    with pytest.raises(ValueError, match="recipe.stages.s9: no such stage in the recipe"):
        compose_cfg(["recipe=tiny", "recipe.stages.s9.long_docs.min_share=0.5"])
    # through `longstride train` (Hydra's own compose, then the stage's long_docs): its range checked before compute
    r = run_cli(["recipe=tiny", "recipe.stages.s2_2k.long_docs.min_tokens=100", "logger.wandb_mode=disabled",
                 "recipe.stages.s2_2k.long_docs.min_share=1.5", "recipe.stages.s2_2k.cp=1",
                 "recipe.stages.s3_4k.cp=1", f"paths.output_root={tmp_path}"])
    assert r.returncode == 2 and "recipe.stages.s2_2k.long_docs.min_share=1.5 must be in [0, 1)" in r.stderr, \
        r.stderr[-2000:]
    assert not (tmp_path / "tiny").exists(), "refused before anything is written"
