"""Run a recipe's stages in order: each starts from the previous stage's final checkpoint, writes its
RoPE base into the model config and starts a fresh LR schedule. Rerunning the same command after an
interruption resumes from the newest complete checkpoint; finished stages are skipped.

CPU, the embedded tiny recipe (no GPU, no download, no account):
    longstride train recipe=tiny
    accelerate launch --config_file configs/accelerate/cpu.yaml -m longstride.recipes.train recipe=tiny
GPU node (8 GPUs):
    accelerate launch --config_file configs/accelerate/gpu8.yaml -m longstride.recipes.train recipe=smollm3_3b_64k \
        data.tokenizer=/path/to/tokenizer data.sources.main.path=/path/to/corpus
One stage only:  ... recipe=tiny stage=s2_2k
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import hydra
from omegaconf import DictConfig, OmegaConf

from longstride.bad_input import is_bad_input
from longstride.process import cuda_allocator_default, skip_exit_collection
from longstride.recipes.config.compose import set_long_docs, split_long_docs
from longstride.recipes.config.schema import Config, selected_stages, to_schema

# torch, transformers, accelerate and the checkpoint code are imported where they are used, after the command line
# composed: a typo, --help and --cfg answer without loading them (recipes/config/compose.py)

STAGE_LONG_DOCS: list = []  # entry(): the stage long_docs overrides Hydra cannot apply, set on main's config


def write_hydra_files(recipe_dir: str) -> None:
    """Hydra's own record of the run (config, overrides, hydra settings), written once by rank 0."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    out = os.path.join(recipe_dir, ".hydra")
    os.makedirs(out, exist_ok=True)
    OmegaConf.save(OmegaConf.create(list(hc.overrides.task)), os.path.join(out, "overrides.yaml"))
    OmegaConf.save(hc, os.path.join(out, "hydra.yaml"))


def start_stage_index(cfg: Config, recipe_dir: str) -> tuple[list[str], str | None]:
    """(stages to run, the first one's init checkpoint): with stage=NAME, the previous stage's final one,
    which must exist."""
    from longstride.model.manifest import check_files
    from longstride.recipes.checkpoint.format import damaged_final, final_dir

    stages, names = selected_stages(cfg), list(cfg.recipe.stages)
    first = names.index(stages[0])
    init_from = final_dir(os.path.join(recipe_dir, names[first - 1])) if first > 0 else None
    if init_from and not os.path.isdir(init_from):
        raise missing_final(stages[0], names[first - 1], init_from)
    # its sizes here, before any work; its checksums once the ranks share the reading (train_stages): every rank
    # hashing it here would read it world times
    problem = init_from and check_files(init_from, hashes=False)
    if problem:
        raise damaged_final(init_from, problem)
    return stages, init_from


def missing_final(stage: str, previous: str, init_from: str) -> ValueError:
    return ValueError(f"stage={stage} starts from {previous}'s final checkpoint {init_from}, which does not exist; "
                      f"run stage={previous} (or the whole recipe) first")


def stages_to_train(cfg: Config, recipe_dir: str) -> list[str]:
    """The stages this launch may train: stage= or every one, less those whose final checkpoint is written (verified
    only when the stage comes up: hashing a large final here would be a second pass over it) and that the restart
    options keep (train.resume=false moves every final aside; train.resume_from its stage's and the later ones')."""
    from longstride.recipes.checkpoint.format import final_dir
    from longstride.recipes.config.schema import selected_stages

    names, rewound = list(cfg.recipe.stages), set()
    if cfg.train.resume_from:  # <recipe_dir>/<stage>/<checkpoint>: that stage and the later ones train again
        stage = os.path.basename(os.path.dirname(os.path.normpath(cfg.train.resume_from)))
        rewound = set(names[names.index(stage):]) if stage in names else set()
    return [n for n in selected_stages(cfg) if not cfg.train.resume or n in rewound
            or not os.path.isdir(final_dir(os.path.join(recipe_dir, n)))]


def use_cpu() -> bool:
    """The device accelerate will run on: the CPU where there is no GPU, and where ACCELERATE_USE_CPU asks for it
    on a GPU machine (`accelerate launch --cpu` sets it; a config's `use_cpu: true` does so only for a single
    process, so a multi-process CPU run on a GPU machine needs ACCELERATE_USE_CPU=1 in the environment), so that
    precision and kernel are planned for the device that runs."""
    import torch
    from accelerate.utils import parse_flag_from_env

    return not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")


def make_accelerator(cfg: Config, world: int):
    """accelerate's Accelerator: cpu=True where there is no GPU or the launch asked for the CPU (under a
    multi-process launch accelerate then uses gloo); a collective waiting longer than
    train.collective_timeout_s (a stuck rank) fails the run."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from longstride.recipes.config.plan import resolve_precision
    from longstride.recipes.run.faults import die_with_parent

    check_launcher(str(cfg.train.precision))
    if world > 1:
        die_with_parent()  # a killed launcher takes its workers with it
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.train.collective_timeout_s))
    cpu = use_cpu()
    return Accelerator(mixed_precision=resolve_precision(cfg.train.precision, on_gpu=not cpu), cpu=cpu,
                       kwargs_handlers=[timeout])


def check_launcher(precision: str) -> None:
    """The accelerate launch settings longstride does not take, refused before any process group exists: its own
    config's distributed_type FSDP / DEEPSPEED / MEGATRON_LM (accelerate would shard, wrap or skip the backward
    behind longstride's own FSDP2 and step), a dynamo_backend (it would compile the whole loss-wrapped model,
    checkpointed layers included), and a mixed_precision longstride does not train in or that train.precision
    contradicts. They reach the process as accelerate launch's ACCELERATE_* variables."""
    from accelerate.utils import parse_flag_from_env

    use = "distributed_type: MULTI_GPU (longstride shards with its own FSDP2: parallel.fsdp; checkpoints "
    for flag, kind, fix in (
            ("ACCELERATE_USE_FSDP", "FSDP", use + "with model.activation_checkpointing, model.offload_activations)"),
            ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED", use + "and clips with its own step: optim.grad_clip)"),
            ("ACCELERATE_USE_MEGATRON_LM", "MEGATRON_LM", use + "with its own step)")):
        if parse_flag_from_env(flag):
            raise ValueError(f"the accelerate config's distributed_type: {kind} ({flag}) is not how longstride "
                             f"trains; launch with {fix}")
    if parse_flag_from_env("ACCELERATE_USE_PARALLELISM_CONFIG"):
        raise ValueError("the accelerate config's parallelism_config (ACCELERATE_USE_PARALLELISM_CONFIG) would apply "
                         "accelerate's own parallelism; drop it: longstride's context parallelism is "
                         "recipe.stages.X.cp with parallel.cp_impl")
    steps = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    if steps.strip() not in ("", "1"):  # accelerate's backward() would divide every gradient by it
        raise ValueError(f"accelerate's gradient accumulation is {steps} (from the environment: "
                         "ACCELERATE_GRADIENT_ACCUMULATION_STEPS, which a DeepSpeed config's "
                         "gradient_accumulation_steps also sets), which would scale every gradient down by it; "
                         "longstride accumulates micro-batches itself (recipe.stages.X.batch_tokens over "
                         "micro_batch_size): unset it")
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "").lower()
    if dynamo not in ("", "no"):
        raise ValueError(f"the accelerate config's dynamo_backend {dynamo} (ACCELERATE_DYNAMO_BACKEND) would compile "
                         "the whole model around longstride's checkpointed layers and attention; set it to 'no' and "
                         "use train.compile=true, which compiles the decoder layers' parts")
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mixed in ("fp16", "fp8") or (mixed == "bf16" and precision == "fp32"):
        raise ValueError(f"the accelerate config's mixed_precision: {mixed} (ACCELERATE_MIXED_PRECISION) is not what "
                         f"this run trains in: train.precision={precision} sets it (auto: bf16 on a GPU that has "
                         "it, else fp32; bf16; fp32); set the launcher's mixed_precision to bf16 or 'no' to match")


def record_run(cfg: Config, raw: DictConfig | None, recipe_dir: str, resolved: dict, tracker) -> None:
    """Main process: the restart decisions (train.resume_from, train.resume=false, a changed config; see
    recipes/run/runlock.py), then the run's config files. What a restart supersedes is moved aside, never deleted."""
    from longstride.recipes.checkpoint.format import resume_from_stage, supersede_after
    from longstride.recipes.run.runlock import check_identity

    names, resume_from = list(cfg.recipe.stages), cfg.train.resume_from

    def rewind():  # only where resume_from is applied now: a requeued job finds it applied, and maybe since deleted
        resume_from_stage(resume_from, recipe_dir, names)  # by keep_last, and resumes the run's newest checkpoint
        for moved in supersede_after(resume_from, recipe_dir, names):
            tracker.info("train.resume_from: moved %s aside", moved)

    check_identity(recipe_dir, resolved, cfg.train.resume, resume_from, rewind)
    OmegaConf.save(OmegaConf.structured(cfg), os.path.join(recipe_dir, "config.yaml"))
    if raw is not None:
        write_hydra_files(recipe_dir)


def setup(cfg: Config, raw: DictConfig | None):
    """Every check, then the tokenizer and corpus (once for all stages). Bad input fails here,
    before any model is built. Returns (context, stage names to run, first stage's init dir)."""
    import torch

    from longstride.data.corpus import build_corpus, build_tokenizer
    from longstride.data.pipeline import check_long_docs
    from longstride.parallel.collectives import main_first, together
    from longstride.recipes.config.plan import validate
    from longstride.recipes.run.runlock import RunLock, check_shared
    from longstride.recipes.run.stage import RunContext, run_stages
    from longstride.recipes.run.tracking import Tracker

    world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; checked before any process group exists
    recipe_dir = os.path.join(cfg.paths.output_root, cfg.recipe.name)
    plans = validate(cfg, world, "cpu" if use_cpu() else "cuda", runs=stages_to_train(cfg, recipe_dir))
    stages, init_from = start_stage_index(cfg, recipe_dir)
    acc = make_accelerator(cfg, world)
    if acc.num_processes != world:  # the plans were made for WORLD_SIZE processes
        raise ValueError(f"the launcher started {acc.num_processes} processes but WORLD_SIZE is {world}; launch with "
                         "accelerate launch or torchrun, which set WORLD_SIZE")
    def at_main():  # what the other ranks raise when rank 0's own step here fails: they all end at once
        return ValueError("rank 0 could not start the run (its log says why)")

    # before anything is written: a second run on this directory stops here, on every rank
    lock = together(lambda: RunLock(recipe_dir).acquire(), at_main, main_only=True)
    tracker = None
    try:
        check_shared(recipe_dir, lock)
        torch.manual_seed(cfg.train.seed)
        tracker = Tracker(acc.is_main_process, cfg, recipe_dir)
        resolved = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        together(lambda: record_run(cfg, raw, recipe_dir, resolved, tracker), at_main, main_only=True)
        cache_dir = os.path.abspath(cfg.paths.cache_dir)
        if acc.num_processes > 1:  # the others wait in one collective: a corpus that takes longer ends the run there
            streamed = cfg.data.streaming
            tracker.info("tokenizer%s: built by rank 0 while the other %d ranks wait, at most "
                         "train.collective_timeout_s=%d s (longer ends the run at that wait: raise it%s)",
                         "" if streamed else " and corpus", acc.num_processes - 1, cfg.train.collective_timeout_s,
                         "" if streamed else ", or stream: data.streaming=true")

        def read():  # rank 0 trains the tokenizer and fills the caches; the rest reuse them
            tokenizer = build_tokenizer(cfg.data, cache_dir)
            return tokenizer, None if cfg.data.streaming else build_corpus(cfg.data, tokenizer, cache_dir)
        tokenizer, corpus = main_first(read, lambda: ValueError("another process could not build the tokenizer or "
                                                                "read the corpus (its log says why)"))
        # every stage's long-document upsampling can draw, before the first one trains; checked on rank 0's corpus
        # (another rank's differing one is refused where the stage's data are compared: stage.agreed_stage_data)
        if corpus is not None:
            together(lambda: check_long_docs(cfg.data, corpus, {n: cfg.recipe.stages[n] for n in stages},
                                             run_stages(cfg)), at_main, main_only=True)
        tracker.info("corpus: %s", corpus.report if corpus else "streamed (data.streaming=true), read per stage")
    except BaseException:
        if tracker:
            tracker.close()
        if lock:
            lock.release()
        raise
    ctx = RunContext(cfg, acc, tokenizer, corpus=corpus, tracker=tracker, recipe_dir=recipe_dir, cfg_dict=resolved,
                     plans=plans, lock=lock)
    return ctx, stages, init_from


def train_stages(ctx, stages: list[str], init_from: str | None) -> list[str]:
    """The stages in order, each from the previous one's final checkpoint. Returns final dirs."""
    from longstride.recipes.checkpoint.format import verified_final
    from longstride.recipes.run.stage import train_stage

    finals = []
    try:
        # stage=NAME: the previous stage's final, verified by the ranks together before it is read
        if init_from and not verified_final(os.path.dirname(init_from), shared=True):
            raise missing_final(stages[0], os.path.basename(os.path.dirname(init_from)), init_from)
        for name in stages:
            init_from = train_stage(ctx, ctx.plans[name], init_from)
            finals.append(init_from)
    finally:
        ctx.tracker.close()
        if ctx.lock:
            ctx.lock.release()
    return finals


def run(cfg: Config, raw: DictConfig | None = None) -> list[str]:
    return train_stages(*setup(cfg, raw))


def sweep_job_root(raw: DictConfig, hc) -> None:
    """Under a multirun sweep (-m), each job's runs go under a folder of its own in paths.output_root, named by its
    swept overrides (`optim.lr=0.001`): one recipe directory for every job would make the second job of
    a sweep find the first's run (the same config: "already complete", nothing trained; another: refused)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    if hc.mode != RunMode.MULTIRUN:
        return
    swept = {o.key_or_group for o in OverridesParser.create().parse_overrides(
        [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]) if o.is_sweep_override()}
    job = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") in swept]
    # by its swept values alone (a job keeps its folder when the sweep's lists change; a sweep whose values come
    # from hydra.sweeper.params in a config file: by its number)
    name = ("-".join(job) or f"job{hc.job.num}").replace("/", "_")[:120]
    raw.paths.output_root = os.path.join(raw.paths.output_root, name)
    print(f"longstride: sweep job {hc.job.num}: writing under {raw.paths.output_root}", file=sys.stderr)


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(raw: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from longstride.recipes.checkpoint.format import CheckpointError
    from longstride.recipes.run.faults import NonFiniteError, StageInputError, Stopped

    skip_exit_collection()
    cuda_allocator_default()
    try:
        raw = set_long_docs(raw, STAGE_LONG_DOCS)  # what entry() kept from Hydra: recipes/config/compose.py
        sweep_job_root(raw, HydraConfig.get())
        prepared = setup(to_schema(raw, HydraConfig.get().overrides.task), raw)
    except (ValueError, NotImplementedError) as e:  # bad input: a message, not a traceback
        if not is_bad_input(e):  # a fault in longstride's own code: its traceback
            raise
        print(f"longstride: {e}", file=sys.stderr)
        sys.exit(2)

    try:
        train_stages(*prepared)
    except StageInputError as e:
        print(f"longstride: {e}", file=sys.stderr)
        sys.exit(2)
    except Stopped as e:  # SIGTERM / SIGINT: a checkpoint was saved; the shell's code for that signal
        print(f"longstride: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except CheckpointError as e:  # damaged or mismatched checkpoints: which, why, and what to do
        print(f"longstride: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:  # bad numerical state: a message saying where to resume from
        print(f"longstride: {e}", file=sys.stderr)
        sys.exit(3)


def entry() -> None:
    """`longstride train` and `python -m longstride.recipes.train`: the command line composed once first, so that a
    composition error (a mistyped key or choice, a stage added on the command line: schema.added_stage_hint) is one
    line and exit 2, as every other bad input, not Hydra's traceback hint and exit 1, and so is a model.checkpoint
    that is no model directory; then Hydra's main. Hydra's own flags (--cfg, --help, --multirun, ...) and
    hydra.mode=MULTIRUN sweeps go to it untouched."""
    from longstride.model.model_dir import check_checkpoint_dir
    from longstride.recipes.config.compose import compose_training, config_dirs

    argv = sys.argv[1:]
    dirs = ("--config-dir", "-cd")
    flags = [a for i, a in enumerate(argv) if a.startswith("-") and a not in dirs and not a.startswith("--config-dir=")
             and not (i and argv[i - 1] in dirs)]
    sweep = any(a.split("=", 1)[0].lstrip("+") == "hydra.mode" for a in argv)  # multirun: sweeps Hydra expands
    try:
        config_dirs(argv)  # a --config-dir that is no folder, or whose files Hydra would not read, also with --cfg
        if not flags and not sweep:
            cfg = compose_training(argv, "longstride train")
            if cfg.model.arch == "checkpoint" and cfg.model.checkpoint:  # before torch loads (setup checks it again)
                check_checkpoint_dir(cfg.model.checkpoint, "model.checkpoint")
    except ValueError as e:
        if not is_bad_input(e):
            raise
        print(f"longstride: {e}", file=sys.stderr)
        sys.exit(2)
    if {"--cfg", "-c"} & set(flags):
        note_replaced_weights(argv, flags)
    hydra_side, STAGE_LONG_DOCS[:] = split_long_docs(argv)  # a stage's long_docs, which Hydra cannot set: main's
    sys.argv[1:] = hydra_side
    main()


def note_replaced_weights(argv: list[str], flags: list[str]) -> None:
    """Hydra's --cfg prints its own merge of a {...} weight dict given on the command line; training replaces the
    dict (schema.replace_weight_dicts): a note on stderr says what trains."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from longstride.recipes.config.schema import weight_dict_keys
    from longstride.recipes.config.compose import compose_training

    valued = ("--cfg", "-c", "--package", "-p")  # flags that take the next word (job, hydra, all; a package)
    rest = [a for i, a in enumerate(argv) if a not in flags and not (i and argv[i - 1] in valued)]
    keys = weight_dict_keys(rest)
    if not keys:
        return
    try:
        cfg = OmegaConf.structured(compose_training(rest))
    except (ValueError, HydraException, OmegaConfBaseException):  # Hydra's own run reports a bad command line
        return
    for key in keys:
        print(f"longstride: note: training replaces {key} with {dict(OmegaConf.select(cfg, key))} (Hydra's view "
              "below merges it into the recipe's)", file=sys.stderr)


if __name__ == "__main__":
    entry()
