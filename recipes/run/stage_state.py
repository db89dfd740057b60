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
               "val_loss_start": run.val_start} if with_state else None
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
    the data position is re-split when the checkpoint had another number of data-parallel ranks."""
    acc = ctx.accelerator
    trainer, mine = load_training_state(path, acc.process_index, acc.num_processes,
                                        resplit=not ctx.cfg.data.streaming)
    load_shards_checked(path, run.model, run.optimizer)
    run.scheduler.load_state_dict(trainer["scheduler"])
    run.step, run.tokens_seen, run.val_start = trainer["step"], trainer["tokens_seen"], trainer["val_loss_start"]
    with stage_input(run.plan.name):  # a data position the stage's data no longer has: exit 2, naming the stage
        run.loader.load_state_dict(mine["data"])
    set_rng_state(mine["rng"])
    dp = run.plan.dims.dp
    ctx.tracker.info("stage %s: resuming from %s (step %d)%s", run.plan.name, path, run.step,
                     "" if mine["data"].get("world", dp) == dp else
                     f"; its data position re-split from {mine['data']['world']} to {dp} data-parallel ranks")
