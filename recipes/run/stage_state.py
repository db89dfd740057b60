"""A stage's checkpoints: what a save writes (a step checkpoint: the model and optimizer as per-rank
shards, the scheduler and loop counters, each rank's data position and RNG, the config and tokenizer; a
final: the HF model) and how a resume puts it back. The file format, the manifest and verification are
recipes/checkpoint/format.py's, the shards parallel/shards.py's.
"""
from __future__ import annotations

from longstride.model.build import save_config
from longstride.recipes.checkpoint.format import (load_shards_checked, load_training_state, rng_state, set_rng_state,
                                                  writing_checkpoint)
from longstride.recipes.run.faults import check_finite_parameters, stage_input
from longstride.recipes.run.runlock import fingerprint


def save_stage(ctx, run, path: str, with_state: bool, extra_meta: dict | None = None) -> None:
    """Collective: every rank calls it. with_state: a resumable step checkpoint; else the stage's final model.
    NaN parameters are refused before anything is written."""
    acc, plan, model = ctx.accelerator, run.plan, run.model
    check_finite_parameters(model.parameters(), path)
    trainer = {"scheduler": run.scheduler.state_dict(), "step": run.step, "tokens_seen": run.tokens_seen,
               "val_loss_start": run.val_start, "data": run.data_id,
               "tokenizer": run.tokenizer_id} if with_state else None
    with writing_checkpoint(
        path, rank=acc.process_index, is_main=acc.is_main_process, barrier=acc.wait_for_everyone,
        trainer_state=trainer,
        rank_state={"data": run.loader.state_dict(), "rng": rng_state()} if with_state else None,
        meta={"recipe": ctx.cfg.recipe.name, "stage": plan.name, "step": run.step, "seq_len": plan.stage.seq_len,
              "rope_theta": plan.stage.rope_theta, "tokens_seen": run.tokens_seen, "packing": run.pack_stats,
              **(extra_meta or {})},
        world_size=acc.num_processes,
        manifest={"dp": plan.dims.dp, "cp": plan.dims.cp, "config": fingerprint(ctx.cfg_dict)},
        keep_last=ctx.cfg.train.keep_last if with_state else 0,
    ) as directory:
        if with_state:  # a step checkpoint: per-rank shards, and the config and tokenizer that make it an HF dir
            model.save_state(directory, run.optimizer)
        else:  # a final: the HF directory, its weights streamed from the shards under FSDP2
            model.save_weights(run.lm, directory, acc.is_main_process)
        if acc.is_main_process:
            if with_state:
                save_config(run.lm, directory)
            ctx.tokenizer.save_pretrained(directory)


def restore_stage(ctx, run, path: str) -> None:
    """Puts a step checkpoint's state back into a freshly built run: the model's weights and the optimizer
    from the shards (re-sharded to this run's processes and layout), the rest from trainer.pt and rank<r>.pt;
    the data position is re-split when the checkpoint had another number of data-parallel ranks. A checkpoint
    whose data fingerprint is not this stage's (its data changed since, or it predates the fingerprint) is refused
    before anything is loaded, unless train.resume_data=false, which starts the stage's data afresh."""
    acc, fresh_data = ctx.accelerator, not ctx.cfg.train.resume_data
    trainer, mine = load_training_state(path, acc.process_index, acc.num_processes,
                                        resplit=not ctx.cfg.data.streaming)
    with stage_input(run.plan.name):  # data the checkpoint's position does not point into: exit 2, naming the stage
        check_same_tokenizer(trainer.get("tokenizer"), run.tokenizer_id, path)
        if not fresh_data:
            check_same_data(trainer.get("data"), run.data_id, path)
    load_shards_checked(path, run.model, run.optimizer)
    run.scheduler.load_state_dict(trainer["scheduler"])
    run.step, run.tokens_seen, run.val_start = trainer["step"], trainer["tokens_seen"], trainer["val_loss_start"]
    with stage_input(run.plan.name):
        if not fresh_data:
            run.loader.load_state_dict(mine["data"])
    set_rng_state(mine["rng"])
    dp = run.plan.dims.dp
    ctx.tracker.info("stage %s: resuming from %s (step %d)%s", run.plan.name, path, run.step,
                     "; its data from the start of the epoch (train.resume_data=false)" if fresh_data else
                     "" if mine["data"].get("world", dp) == dp else
                     f"; its data position re-split from {mine['data']['world']} to {dp} data-parallel ranks")


def check_same_data(saved, current: str, path: str) -> None:
    """Refuses a resume whose checkpoint's data fingerprint (data/pipeline.py data_fingerprint) is missing or not
    `current`: its data position would name other sequences, or validation other documents."""
    if saved == current:
        return
    why = ("was written by a longstride that recorded no data fingerprint" if saved is None else
           "was written over other data: an edited or added source file, another data config or a longstride whose "
           "packing or held-out split differs")
    raise ValueError(f"{path} {why}, so its data position would name other sequences; resume with the data it was "
                     "written with, keep its weights, optimizer and step but start this stage's data afresh "
                     "(train.resume_data=false: the first sequences may repeat what it trained on), or start the stage "
                     "over (train.resume=false)")


def check_same_tokenizer(saved, current: str, path: str) -> None:
    """Refuses a resume under another tokenizer than the checkpoint's (data.tokenizer=null retrains one when the
    texts of its first source change): the model's embeddings would read other ids. A checkpoint from before the
    fingerprint passes (its data fingerprint is missing too, which check_same_data refuses)."""
    if saved is not None and saved != current:
        raise ValueError(f"{path} was trained with another tokenizer than this run's (its vocabulary differs: with "
                         "data.tokenizer=null a BPE is trained on the first source, so its files changed); restore "
                         f"the files it was trained on, or continue under its own tokenizer: data.tokenizer={path} "
                         f"train.resume_from={path}")
