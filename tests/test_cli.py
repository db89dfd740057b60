"""The command line itself: one installed `longstride` package and command, --help on every command,
bad input a message naming the field before any work, eval results outside the checkpoint."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from longstride.eval.cli import default_out
from tests.conftest import REPO, run_cli


def test_cli_bad_input_is_a_message_not_a_traceback(tmp_path):
    r = run_cli(["recipe=tiny", f"paths.output_root={tmp_path}", "recipe.stages.s2_2k.rope_theta=-1"])
    assert r.returncode == 2
    assert "recipe.stages.s2_2k.rope_theta=-1.0 must be positive" in r.stderr
    assert "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir()), "nothing is written before validation passes"


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_one_package_and_one_command_outside_the_checkout(tmp_path):
    # from a folder that is not the checkout: only `longstride` is importable, not data/model/eval/...
    code = ("import importlib.util as u, longstride, longstride.parallel.ring, longstride.configs; "
            "print([m for m in ('data', 'model', 'eval', 'parallel', 'recipes') if u.find_spec(m)])")
    r = _run([sys.executable, "-c", code], tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    exe = shutil.which("longstride")
    assert exe, "pip install -e . installs the longstride console script"
    r = _run([exe, "--help"], tmp_path)
    assert r.returncode == 0 and "longstride eval ruler" in r.stdout
    r = _run([exe, "nope"], tmp_path)
    assert r.returncode == 2 and "unknown command 'nope'" in r.stderr


@pytest.mark.parametrize("command,expect", [
    (["train", "--help"], "Configuration groups"),  # Hydra's help, configs found from the installed package
    (["train", "--help"], "accelerate and hardware are listed above but are not training groups"),
    (["eval", "ruler", "--help"], "dtype=float32"),
    (["eval", "ppl", "--help"], "max_docs=8"),
    (["convert-gguf", "--help"], "out=null"),
])
def test_every_command_has_help(command, expect, tmp_path):
    r = _run([shutil.which("longstride") or "longstride", *command], tmp_path)
    assert r.returncode == 0 and expect in r.stdout, r.stdout + r.stderr
    assert not any(tmp_path.iterdir()), "--help writes nothing"


def test_train_takes_a_mixture_on_the_command_line_as_the_whole_mixture(tmp_path):
    """`longstride train` (Hydra's main) replaces a stage's mixture given as {...}: stdlib alone at weight 0 has no
    positive weight and is refused at validation; merged into the recipe's other weights it would have trained."""
    r = _run([shutil.which("longstride"), "train", "recipe=tiny_extend", "recipe.stages.s2_2k.mixture={stdlib:0.0}",
              "logger.wandb_mode=disabled"], tmp_path)
    assert r.returncode == 2 and "recipe.stages.s2_2k.mixture={'stdlib': 0.0} must be source weights >= 0 with a " \
        "positive sum" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("command", [["eval", "ruler", "lengths=[512]"], ["eval", "ppl"], ["eval", "compare"],
                                     ["plan", "recipe=tiny"]])
def test_an_out_that_cannot_be_written_fails_before_any_compute(tmp_path, command):
    """out= under a file (the eval commands' results folder, plan's JSON file) exits 2 naming out= while the
    command's arguments are read, not with a traceback once the scoring is done."""
    from longstride.recipes.config.schema import SHIPPED

    (tmp_path / "afile").write_text("")
    base = f"{SHIPPED}/tiny_base_256"
    where = {"ruler": [f"checkpoint={base}"], "ppl": [f"checkpoint={base}"],
             "compare": [f"checkpoints=[{base},{base}]", "tasks=[niah_single_1]"]}.get(command[1], [])
    out = "afile/plan.json" if command[0] == "plan" else "afile/results"
    r = _run([shutil.which("longstride"), *command, *where, f"out={out}"], tmp_path)
    assert r.returncode == 2 and f"out='{out}': results cannot be written there" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_mistyped_training_key_is_one_line_and_exit_2(tmp_path):
    """A key the schema lacks fails while the command line is composed, as every other bad input: exit 2, one line
    naming it, before Hydra's main (which exits 1 with its HYDRA_FULL_ERROR hint)."""
    r = _run([shutil.which("longstride"), "train", "recipe=tiny", "recipe.stages.s2_2k.stepz=5"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == ("longstride: Could not override 'recipe.stages.s2_2k.stepz': "
                                                      "Key 'stepz' not in 'StageConfig' (see longstride train --help)")
    r = _run([shutil.which("longstride"), "train", "model=checkpoint", f"model.checkpoint={tmp_path}/none"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (f"longstride: model.checkpoint='{tmp_path}/none' does not "
                                                      "exist; point it at a local HF model directory"), r.stderr


def test_choice_typos_name_the_key_and_the_choices(tmp_path):
    r = _run([shutil.which("longstride"), "train", "parallel.balance=zigzg"], tmp_path)
    assert r.returncode != 0 and "expected one of [zigzag, docs]" in r.stderr
    r = _run([shutil.which("longstride"), "train", "parallel.cp_impl=zigzag"], tmp_path)  # a registry name
    assert r.returncode == 2 and "parallel.cp_impl='zigzag' is unknown; use one of ['ring', 'ulysses', 'upipe', " \
        "'hybrid']" in r.stderr and "Traceback" not in r.stderr
    r = _run([shutil.which("longstride"), "eval", "ruler", "checkpoint=x", "prefill=ring"], tmp_path)
    assert r.returncode == 2 and "Invalid value 'ring', expected one of [local, cp]" in r.stderr
    assert "Traceback" not in r.stderr


def test_eval_results_go_under_outputs_never_into_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert default_out("outputs/tiny/s3_4k/final") == os.path.join("outputs", "eval", "tiny-s3_4k-final")
    assert default_out("checkpoints/smollm2") == os.path.join("outputs", "eval", "checkpoints-smollm2")
    outside = str(REPO / "outputs" / "tiny" / "s3_4k" / "final")
    assert default_out(outside) == os.path.join("outputs", "eval", "tiny-s3_4k-final")
    for ckpt in ("outputs/tiny/s3_4k/final", outside, "/abs/model"):
        assert not os.path.abspath(default_out(ckpt)).startswith(os.path.abspath(ckpt) + os.sep)


def test_small_commands_name_what_is_wrong(tmp_path):
    """export-hf on a missing path, convert-gguf on a missing file (before asking for the gguf package), and an eval
    command's threads below 1: each a one-line error naming the field."""
    from longstride.eval.cli import parse_ruler
    from longstride.model.convert_gguf import convert
    from longstride.recipes.checkpoint.export import export_hf
    from longstride.recipes.config.schema import SHIPPED

    with pytest.raises(ValueError, match=r"checkpoint='/no/such' does not exist; give a step checkpoint"):
        export_hf("/no/such", str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"gguf='/no/such.gguf' does not exist"):
        convert("/no/such.gguf", str(tmp_path / "out"))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "used" / "notes").mkdir(parents=True)  # an out that is not empty would be replaced or merged into
    with pytest.raises(ValueError, match=r"out='.*used' is not empty; choose another directory"):
        convert(str(tmp_path / "model.gguf"), str(tmp_path / "used"))
    with pytest.raises(ValueError, match=r"threads=-1 must be >= 1"):
        parse_ruler([f"checkpoint={SHIPPED}/tiny_base_256", "threads=-1"])


def test_eval_commands_refuse_a_checkpoint_without_readable_weights(tmp_path):
    """A torn copy (truncated safetensors), a config-only directory, or a copy that no longer matches the manifest
    longstride wrote with it (bit rot in a weight) is named by every eval command before the model is loaded, as
    training's validation does (model/model_dir.py check_checkpoint_weights)."""
    from longstride.eval.cli import parse_compare, parse_ppl, parse_ruler
    from longstride.recipes.config.schema import SHIPPED

    torn = tmp_path / "torn"
    shutil.copytree(os.path.join(SHIPPED, "tiny_base_256"), torn)
    (torn / "manifest.json").unlink()  # an HF directory as most are: no manifest to check against
    os.truncate(torn / "model.safetensors", (torn / "model.safetensors").stat().st_size // 2)
    bare = tmp_path / "bare"
    shutil.copytree(torn, bare)
    (bare / "model.safetensors").unlink()
    rot = tmp_path / "rot"  # one byte of a weight flipped: the file reads, its manifest says otherwise
    shutil.copytree(os.path.join(SHIPPED, "tiny_base_256"), rot)
    with open(rot / "model.safetensors", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    for parse_cmd in (parse_ruler, parse_ppl):
        with pytest.raises(ValueError, match=rf"checkpoint='{rot}' does not match its manifest.json: "
                                             "model.safetensors does not match its checksum"):
            parse_cmd([f"checkpoint={rot}"])
        with pytest.raises(ValueError, match=rf"checkpoint='{torn}': model.safetensors cannot be read"):
            parse_cmd([f"checkpoint={torn}"])
        with pytest.raises(ValueError, match=rf"checkpoint='{bare}' has no weights"):
            parse_cmd([f"checkpoint={bare}"])
    with pytest.raises(ValueError, match=rf"checkpoints\[1\]='{torn}': model.safetensors cannot be read"):
        parse_compare([f"checkpoints=[{os.path.join(SHIPPED, 'tiny_base_256')},{torn}]", f"out={tmp_path / 'c'}"])


def test_your_own_recipe_from_a_config_dir_and_a_stage_added_on_the_command_line(tmp_path):
    """A recipe file outside the package (--config-dir DIR, DIR/recipe/NAME.yaml) composes for training and for
    compose_training (`plan`, `check`); a stage added as an override, which OmegaConf cannot build as a typed stage,
    exits 2 saying how to add one instead of Hydra's "dict is not a subclass of StageConfig"."""
    from longstride.recipes.config.compose import compose_training

    (tmp_path / "mine" / "recipe").mkdir(parents=True)
    text = (REPO / "configs" / "recipe" / "tiny.yaml").read_text().replace("name: tiny\n", "name: mine\n", 1)
    (tmp_path / "mine" / "recipe" / "mine.yaml").write_text(text)
    mine = str(tmp_path / "mine")
    for argv in (["--config-dir", mine, "recipe=mine"], [f"--config-dir={mine}", "recipe=mine"]):
        assert compose_training(argv).recipe.name == "mine"
    with pytest.raises(ValueError, match="--config-dir '/no/such' is not a directory"):
        compose_training(["--config-dir", "/no/such", "recipe=mine"])
    shadow = tmp_path / "shadow" / "recipe"  # a copy under a shipped name, edited: Hydra would read the shipped one
    shadow.mkdir(parents=True)
    (shadow / "tiny.yaml").write_text(text)
    assert compose_training(["hydra.searchpath=[file://" + str(shadow.parent) + "]", "recipe=tiny"]).recipe.name \
        == "tiny"  # what Hydra does on its own: the edit is ignored
    with pytest.raises(ValueError, match=r"recipe/tiny.yaml has the path of longstride's own configs/recipe/tiny.yaml"
                                         r".*rename yours \(say recipe/my_tiny.yaml\)"):
        compose_training(["--config-dir", str(shadow.parent), "recipe=tiny"])
    r = _run([shutil.which("longstride"), "train", "--config-dir", str(shadow.parent), "recipe=tiny", "--cfg", "job"],
             tmp_path)
    assert r.returncode == 2 and "rename yours" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # what Hydra does not search is not checked: your own accelerate/ and hardware/ files beside recipe/
    (tmp_path / "mine" / "accelerate").mkdir()
    (tmp_path / "mine" / "accelerate" / "gpu8.yaml").write_text("num_processes: 8\n")
    assert compose_training(["--config-dir", mine, "recipe=mine"]).recipe.name == "mine"
    assert compose_training(["--config-dir", str(REPO / "configs"), "recipe=tiny"]).recipe.name == "tiny"
    # mistakes inside your own file: the key named (OmegaConf's first line alone did not), the missing package line
    bad = tmp_path / "bad" / "recipe"
    bad.mkdir(parents=True)
    (bad / "mine.yaml").write_text(text.replace("batch_tokens: 4096", "batch_tokens: 4.5e3", 1))
    with pytest.raises(ValueError, match=r"Value '4500.0' of type 'float' could not be converted to Integer \(at "
                                         r"recipe.stages.s1_256.batch_tokens\)"):
        compose_training(["--config-dir", str(bad.parent), "recipe=mine"], "longstride train")
    (bad / "mine.yaml").write_text(text.replace("steps:", "stepz:", 1))
    with pytest.raises(ValueError, match=r"Key 'stepz' not in 'StageConfig' \(at recipe.stages.s1_256.stepz\)"):
        compose_training(["--config-dir", str(bad.parent), "recipe=mine"], "longstride train")
    (bad / "mine.yaml").write_text(text.replace("# @package _global_\n", "", 1))
    with pytest.raises(ValueError, match=r"Could not override 'model@recipe.model': a recipe file begins with the "
                                         r"line `# @package _global_`"):
        compose_training(["--config-dir", str(bad.parent), "recipe=mine"], "longstride train")
    r = _run([shutil.which("longstride"), "train", "--config-dir", mine, "recipe=mine", "--cfg", "job"], tmp_path)
    assert r.returncode == 0 and "name: mine" in r.stdout, r.stderr
    for added in ("+recipe.stages.s4={seq_len:8192}", "recipe.stages.s4.seq_len=8192"):
        r = _run([shutil.which("longstride"), "train", "recipe=tiny", added], tmp_path)
        assert r.returncode == 2 and f"{added}: recipe.stages.s4 is not a stage of this recipe" in r.stderr, r.stderr
        assert "--config-dir DIR recipe=NAME" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ValueError, match=r"recipe.stages.s4 is not a stage of this recipe"):
        compose_training(["recipe=tiny", "+recipe.stages.s4={seq_len:8192}"], "longstride plan")
    for added in ("+data.sources.long={kind:files,path:/x.jsonl}", "data.sources.long.path=/x.jsonl"):
        with pytest.raises(ValueError, match=r"data.sources.long is not a source of this data config, and a source "
                                             r"cannot be added on the command line.* --config-dir DIR data=NAME"):
            compose_training(["data=files", added], "longstride train")
    r = _run([shutil.which("longstride"), "train", "recipe=tiny", "recipe.stages.s2_2k.steps=-1", "--cfg", "job"],
             tmp_path)
    # an existing stage's field is not the hint's case: it composes (the range is checked when training starts)
    assert r.returncode == 0 and "steps: -1" in r.stdout and "not a stage of this recipe" not in r.stderr, r.stderr
    r = _run([shutil.which("longstride"), "train", "recipe=tiny_extend", "recipe.stages.s2_2k.mixture={stdlib:1.0}",
              "--cfg", "job"], tmp_path)  # Hydra prints its merge; a note says what trains
    assert r.returncode == 0 and "training replaces recipe.stages.s2_2k.mixture with {'stdlib': 1.0}" in r.stderr, \
        r.stderr


def test_a_list_or_a_group_given_the_other_shape_says_how_the_command_spells_it():
    """eval compare's yarn is a list of factors, eval ruler's a group: each command's error for the other's
    spelling says its own."""
    from longstride.eval.cli import CompareConfig, RulerConfig
    from longstride.overrides import parse

    with pytest.raises(ValueError, match=r"yarn is a list here: yarn=\[2\] \(see longstride eval compare --help\)"):
        parse(CompareConfig, ["yarn.factor=2"], "longstride eval compare")
    with pytest.raises(ValueError, match=r"yarn is a group here: yarn.factor=2 \(its fields: factor, "):
        parse(RulerConfig, ["yarn=2"], "longstride eval ruler")
    assert parse(CompareConfig, ["tasks.0=vt"], "longstride eval compare").tasks[0] == "vt"  # an index is no key


def test_help_and_bad_options_answer_before_torch_is_imported(tmp_path):
    """Every command but train parses its options in a module that imports neither torch nor transformers (about
    six CPU-seconds a process here), so --help, a mistyped key, a missing checkpoint and a bad field beside a good
    checkpoint (whose weights' headers and manifest are read) answer at once: the modules loaded after all of them
    are listed, and each bad input still exits 2 naming the field."""
    from longstride.recipes.config.schema import SHIPPED

    good = f"checkpoint={SHIPPED}/tiny_base_256"
    code = """if True:
        import contextlib, io, json, sys
        from longstride.cli import main
        runs = [["eval", "ruler", "--help"], ["eval", "ppl", "--help"], ["eval", "compare", "--help"],
                ["check", "--help"], ["plan", "--help"], ["export-hf", "--help"], ["convert-gguf", "--help"],
                ["eval", "ruler", "checkpoint=x", "prefill=ring"], ["eval", "ppl", "checkpoint=/no/such"],
                ["eval", "compare", "run=/no/such"], ["plan", "recipe=tiny", "recipe.stages.s2_2k.stepz=5"],
                ["plan", "hardware=h100"], ["check", "chekpoint=x"], ["check", "checkpoint=/no/such"],
                ["eval", "ruler", GOOD, "lengths=[8]"], ["eval", "ppl", GOOD, "tile=0"],
                ["export-hf", "checkpoint=/no/such", "out=/no/where"]]
        got = []
        for argv in runs:
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                try:
                    main(argv)
                except SystemExit as e:
                    got.append([e.code, err.getvalue().strip()])
        print(json.dumps({"got": got, "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}))
    """
    r = _run([sys.executable, "-c", code.replace("GOOD", repr(good))], tmp_path)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [], out
    codes = [c for c, _ in out["got"]]
    assert codes == [0] * 7 + [2] * 10, out["got"]
    errors = [e for _, e in out["got"][7:]]
    assert "Invalid value 'ring', expected one of [local, cp]" in errors[0]
    assert "checkpoint='/no/such' does not exist" in errors[1]
    assert "run='/no/such' has no config.yaml" in errors[2]
    assert "Key 'stepz' not in 'StageConfig'" in errors[3]
    assert "hardware='h100' is unknown" in errors[4]
    assert "Could not override 'chekpoint': Key 'chekpoint' not in 'Config'" in errors[5]
    assert "checkpoint='/no/such' does not exist" in errors[6]
    assert "lengths=[8]: give token lengths >= 16" in errors[7] and "tile=0 must be >= 1" in errors[8]
    assert "checkpoint='/no/such' does not exist; give a step checkpoint" in errors[9]


def test_a_multirun_sweep_gives_each_job_its_own_run_directory(tmp_path):
    """`-m optim.implementation=foreach,for_loop`: every job wrote to one recipe directory, so the second found the
    first's run ("already complete": nothing trained; a swept lr: refused, ending the sweep). Each job now writes
    under paths.output_root/<its swept overrides>, and both train."""
    from tests.conftest import micro_overrides

    r = run_cli(["-m", *micro_overrides(tmp_path, tmp_path / "cache"), "stage=s1_256", "recipe.stages.s1_256.steps=2",
                 "optim.implementation=foreach,for_loop"])
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("optim.implementation=foreach", "optim.implementation=for_loop"):
        assert (tmp_path / job / "tiny" / "s1_256" / "final").is_dir(), sorted(p.name for p in tmp_path.iterdir())
    assert "already complete" not in r.stderr and (tmp_path / "multirun.yaml").is_file()
    assert not (REPO / "multirun.yaml").exists(), "nothing written where the command ran"


def test_accelerate_gradient_accumulation_from_the_environment_is_refused(micro):
    """accelerate reads ACCELERATE_GRADIENT_ACCUMULATION_STEPS into every Accelerator, and its backward() divided
    each loss by it: every gradient 4x too small (the grad norm too, grad_clip 4x looser), the logged loss as ever."""
    r = run_cli(micro + ["stage=s1_256", "recipe.stages.s1_256.steps=2"],
                env_extra={"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"})
    assert r.returncode == 2 and "accelerate's gradient accumulation is 4 (from the environment: " \
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in r.stderr, r.stderr[-3000:]
    assert " loss " not in r.stdout + r.stderr, "refused before any step"


@pytest.mark.parametrize("env, said", [
    ({"ACCELERATE_USE_FSDP": "true"}, "distributed_type: FSDP (ACCELERATE_USE_FSDP) is not how longstride trains"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "distributed_type: DEEPSPEED (ACCELERATE_USE_DEEPSPEED)"),
    ({"ACCELERATE_USE_MEGATRON_LM": "1"}, "distributed_type: MEGATRON_LM (ACCELERATE_USE_MEGATRON_LM)"),
    ({"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}, "parallelism_config (ACCELERATE_USE_PARALLELISM_CONFIG)"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, "dynamo_backend inductor (ACCELERATE_DYNAMO_BACKEND) would compile"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "mixed_precision: fp16 (ACCELERATE_MIXED_PRECISION) is not what this "
                                             "run trains in: train.precision=auto sets it"),
])
def test_accelerate_launch_settings_longstride_does_not_take_are_refused(micro, env, said):
    """An accelerate config of the user's own: its FSDP / DeepSpeed / Megatron-LM distributed type (Megatron's
    backward computed no gradients: a run that trained nothing), a dynamo backend (the whole model compiled around
    the checkpointed layers) or fp16 (silently trained in bf16) were taken without a word."""
    r = run_cli(micro + ["stage=s1_256", "recipe.stages.s1_256.steps=2"], env_extra=env)
    assert r.returncode == 2 and said in r.stderr, r.stderr[-3000:]


def test_the_launcher_s_precision_is_taken_where_it_agrees_and_logged(micro):
    r = run_cli(micro + ["stage=s1_256", "recipe.stages.s1_256.steps=2"],
                env_extra={"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_BACKEND": "no"})
    assert r.returncode == 0 and "(DistributedType.NO, mixed precision no)" in r.stderr, r.stderr[-3000:]
    r = run_cli(micro + ["stage=s1_256", "train.precision=fp32"], env_extra={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert r.returncode == 2 and "mixed_precision: bf16 (ACCELERATE_MIXED_PRECISION) is not what this run trains " \
        "in: train.precision=fp32 sets it" in r.stderr, r.stderr[-3000:]
