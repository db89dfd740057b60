"""A stage's checkpoints: what a save writes (a step checkpoint: the model and optimizer as per-rank
shards, the scheduler and loop counters, each rank's data position and RNG, the config and tokenizer; a
final: the HF model, streamed also each rank's stream positions) and how a resume, or the next stage's streams, put it
back. The file format, the manifest and verification are
recipes/checkpoint/format.py's, the shards parallel/shards.py's.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from longstride.data.stream_split import resplit, splittable
from longstride.data.tokenizer import load_tokenizer, save_tokenizer, tokenizer_fingerprint
from longstride.model.manifest import check_files
from longstride.model.model_dir import has_tokenizer
from longstride.model.build import save_config
from longstride.model.rope import max_positions
from longstride.parallel.collectives import raise_if_any
from longstride.recipes.checkpoint.format import (CheckpointError, failed_on_another_rank, load_rank_state,
                                                  load_shards_checked, load_training_state, manifest_world, rng_state,
                                                  set_rng_state, writing_checkpoint)
from longstride.recipes.run.faults import check_finite_parameters, stage_input
from longstride.recipes.run.runlock import fingerprint


def save_stage(ctx, run, path: str, with_state: bool, extra_meta: dict | None = None) -> None:
    """Collective: every rank calls it. with_state: a resumable step checkpoint (written in the background with
    train.async_save: recipes/checkpoint/background.py's BackgroundSave); else the stage's final model. NaN parameters
    are refused before anything is written."""
    acc, plan, model = ctx.accelerator, run.plan, run.model
    settle_saves(ctx, run, every_rank=True)  # one save at a time: the one in flight sealed first (a failure raised)
    started = time.perf_counter()
    background = run.saves if with_state else None  # train.async_save: a step checkpoint's shards written behind
    check_finite_parameters(model.parameters(), path)
    trainer = {"scheduler": run.scheduler.state_dict(), "step": run.step, "tokens_seen": run.tokens_seen,
               "val_loss_start": run.val_start, "data": run.data_id, "tokenizer": ctx.tokenizer_id,
               "dp": plan.dims.dp} if with_state else None
    with writing_checkpoint(
        path, rank=acc.process_index, is_main=acc.is_main_process,
        trainer_state=trainer,
        rank_state={"data": run.loader.state_dict(), "rng": rng_state()} if with_state else
        # a streamed stage's final: where each data-parallel rank's streams stopped (its first CP rank's, as every
        # CP rank of it holds the same), for later stages to go on from (carry_streams)
        {"data": run.loader.state_dict(), "origin": run.loader.origin, "dp": plan.dims.dp,
         "tokenizer": ctx.tokenizer_id} if streamed(run) and acc.process_index % plan.dims.cp == 0 else None,
        meta={"recipe": ctx.cfg.recipe.name, "stage": plan.name, "step": run.step, "seq_len": plan.stage.seq_len,
              "rope_theta": plan.stage.rope_theta, "tokens_seen": run.tokens_seen, "packing": run.pack_stats,
              **(extra_meta or {})},
        world_size=acc.num_processes,
        manifest={"dp": plan.dims.dp, "cp": plan.dims.cp, "config": fingerprint(ctx.cfg_dict)},
        keep_last=ctx.cfg.train.keep_last if with_state else 0,
        background=background,
    ) as directory:
        if with_state:  # a step checkpoint: per-rank shards, and the config and tokenizer that make it an HF dir
            shards = model.save_state(directory, run.optimizer, background=background is not None)
            if background is not None:
                background.track(shards, started)
        else:  # a final: the HF directory, its weights streamed from the shards under FSDP2
            model.save_weights(run.lm, directory, acc.is_main_process)
        if acc.is_main_process:
            if with_state:
                save_config(run.lm, directory)
            save_tokenizer(ctx.tokenizer, directory, max_positions(run.lm.config))


def settle_saves(ctx, run, failed_elsewhere: bool = False, every_rank: bool = False) -> None:
    """Waits for the step checkpoint in flight (train.async_save), logging how long it held training and when it
    was sealed; raises CheckpointError if it failed here or, `failed_elsewhere`, on another rank. every_rank: every
    rank calls it at this point, and every rank raises when the save failed on any (a collective)."""
    if run.saves is None:
        return
    path, error = run.saves.in_flight, None
    try:
        if run.saves.wait():
            ctx.tracker.info("step checkpoint %s written in the background: training held %.2f s, sealed %.1f s "
                             "after the save began", path, run.saves.held, run.saves.sealed_s)
    except CheckpointError as e:
        if not every_rank:
            raise
        error = e
    if every_rank:
        raise_if_any(error, lambda: failed_on_another_rank(path))
    if failed_elsewhere and path:
        raise failed_on_another_rank(path)


def restore_stage(ctx, run, path: str) -> None:
    """Puts a step checkpoint's state back into a freshly built run: the model's weights and the optimizer
    from the shards (re-sharded to this run's processes and layout), the rest from trainer.pt and rank<r>.pt;
    the data position is re-split when the checkpoint had another number of data-parallel ranks. A checkpoint
    trained with another tokenizer is refused. One whose data position this stage cannot use (data_problem: its
    data changed or it predates the fingerprint; or a streamed one that stream_split.resplit cannot re-split) is
    refused too, unless train.resume_data=false: then the stage's data starts afresh and its start validation loss
    is measured again on this run's held-out documents."""
    acc, cfg, dims = ctx.accelerator, ctx.cfg, run.plan.dims
    trainer, mine = load_training_state(path, acc.process_index)
    data, note = mine["data"], ""
    with stage_input(run.plan.name):  # a position the stage cannot use: exit 2, naming the stage
        check_same_tokenizer(trainer.get("tokenizer"), ctx.tokenizer, path)
        problem = data_problem(trainer.get("data"), run.data_id)
        if cfg.data.streaming and not problem:
            try:
                data, note = streamed_position(ctx, path, trainer.get("dp", dims.dp), dims)
            except ValueError as e:
                problem = f"holds streamed positions that cannot be re-split to {dims.dp} data-parallel ranks ({e})"
        if problem and cfg.train.resume_data:
            raise ValueError(f"{path} {problem}, so its data position would name other sequences; resume with the "
                             "data and layout it was written with, keep its weights, optimizer and step but start "
                             "this stage's data afresh (train.resume_data=false: the first sequences may repeat what "
                             f"it trained on), or start the stage over ({restart_stage(ctx, run.plan.name)})")
    configured = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    load_shards_checked(path, run.model, run.optimizer)
    changed = keep_configured_hyperparameters(run, trainer["scheduler"], configured)
    run.step, run.tokens_seen = trainer["step"], trainer["tokens_seen"]
    run.val_start = None if problem else trainer["val_loss_start"]  # None: measured again, on this run's documents
    with stage_input(run.plan.name):
        if not problem:
            run.loader.load_state_dict(data)
    set_rng_state(mine["rng"])
    if changed:
        ctx.tracker.info("stage %s: the checkpoint's %s; training on with this config's", run.plan.name, changed)
    ctx.tracker.info("stage %s: resuming from %s (step %d)%s", run.plan.name, path, run.step,
                     f"; its data from the start of the epoch (train.resume_data=false: {problem})" if problem else
                     note or ("" if data.get("world", dims.dp) == dims.dp else
                              f"; its data position re-split from {data['world']} to {dims.dp} data-parallel ranks"))


def streamed(run) -> bool:
    return hasattr(run.loader, "origin")  # data.stream.StreamLoader


def carry_streams(ctx, run, final: Optional[str]) -> str:
    """A stage that starts from a previous stage's `final` (not resumed) goes on with each streamed source where
    the last stage that read it stopped (`final`'s, or, for a source an in-between stage left out, an earlier
    final's: their positions, re-split when the number of data-parallel ranks changed), so a later stage reads past
    what earlier ones trained on instead of rereading it; the documents `final`'s stage had drawn and not trained on
    are packed first (StreamPacker.carry_over), unless a source or the tokenizer changed since. A source whose rows
    are numbered otherwise now (its config, files or held-out rows changed: `origin`), one no earlier final holds
    positions of, or one read as whole shards per rank that cannot be re-split, starts from its beginning. Returns
    a note for the log."""
    if not streamed(run) or final is None:
        return ""
    packer, origin, dims = run.loader.packer, run.loader.origin, run.plan.dims
    dp_rank = dims.dp_rank(ctx.accelerator.process_index)
    positions, where, pending, notes = {}, {}, None, []
    for i, f in enumerate(_finals_before(ctx, final)):
        if not os.path.isfile(os.path.join(f, "rank0.pt")):  # an in-memory stage's, or written before positions
            notes += [f"{f} holds no stream positions"] if i == 0 else []
            break
        damage = i and check_files(f, lambda world: ("rank0.pt",), only=lambda name: name.startswith("rank"))
        if damage:
            notes.append(f"{f}'s stream positions are not used: {damage}")
            break
        head = load_rank_state(f, 0)
        same = {n for n, d in head["origin"].items() if origin.get(n) == d}
        read = set(head["data"]["dataset_state"]["counters"]["epoch"])  # the sources that stage read
        changed = sorted(n for n in packer.weights if n in head["origin"] and n not in same)
        if i == 0 and changed:
            notes.append(f"{changed}: changed since {f}, from their beginning")
        take = (set(packer.weights) - set(positions)) & same & read
        if not take:
            continue
        if head["dp"] == dims.dp:
            state = written_position(f, head["dp"], dp_rank, head)["dataset_state"]
        else:
            states = [written_position(f, head["dp"], r, head) for r in range(head["dp"])]
            whole = take - splittable(states)
            if whole:
                notes.append(f"{sorted(whole)}: from their beginning, {f}'s {head['dp']} data-parallel ranks read "
                             f"whole shards of them, which cannot be re-split to {dims.dp}")
            take -= whole
            data, lagging = resplit(states, dp_rank, dims.dp, {}, sorted(take)) if take else (None, [])
            state, notes = data and data["dataset_state"], notes + lagging
        for n in take:
            positions[n], where[n] = state, f
        if i == 0 and state is not None and not changed and head.get("tokenizer") == ctx.tokenizer_id:
            pending = state
    carried = packer.carry_over(positions, pending)
    if not positions:
        return "; its streams from their beginning" + (f" ({'; '.join(notes)})" if notes else "")
    older = sorted(n for n, f in where.items() if f != final)
    return (f"; its streams go on from {final}'s positions"
            + "".join(f"; {n} from {where[n]}'s (not read since)" for n in older)
            + "".join(f"; {n}" for n in notes)
            + (f"; {carried} pending document pieces packed first" if carried else ""))


def _finals_before(ctx, final: str) -> list[str]:
    """`final`, then the finals of this run's stages before its stage, newest first (only `final` when it is not a
    stage's final of this run)."""
    stage_dir = os.path.dirname(os.path.normpath(final))
    names, name = list(ctx.cfg.recipe.stages), os.path.basename(stage_dir)
    if name not in names or os.path.normpath(os.path.dirname(stage_dir)) != os.path.normpath(ctx.recipe_dir):
        return [final]
    return [final] + [os.path.join(ctx.recipe_dir, n, "final") for n in reversed(names[:names.index(name)])]


def written_position(path: str, written_dp: int, dp_rank: int, first: Optional[dict] = None) -> dict:
    """The data position data-parallel rank `dp_rank` of the run that wrote checkpoint `path` saved (its first
    process's: every process of one data-parallel rank held the same); `first`: rank0.pt's state, already read."""
    rank = dp_rank * (manifest_world(path) // written_dp)
    return (first if rank == 0 and first is not None else load_rank_state(path, rank))["data"]


def streamed_position(ctx, path: str, written_dp: int, dims) -> tuple[dict, str]:
    """(this process's stream position, a note for the log): the state its data-parallel rank saved, or, written
    with another number of data-parallel ranks, every old rank's re-split (data/stream_split.py; ValueError naming
    the source when it cannot be). The old run's processes of one data-parallel rank held the same position."""
    dp_rank = dims.dp_rank(ctx.accelerator.process_index)
    if written_dp == dims.dp:
        return written_position(path, written_dp, dp_rank), ""
    states = [written_position(path, written_dp, i) for i in range(written_dp)]
    names = {n: f"data.sources.{n}" for n in ctx.cfg.data.sources}
    data, notes = resplit(states, dp_rank, dims.dp, names)
    return data, (f"; its stream positions re-split from {written_dp} to {dims.dp} data-parallel ranks"
                  + "".join(f"; {n}" for n in notes))


# what a parameter group takes from the config over a restored checkpoint: its hyperparameters and how AdamW's update
# runs (optim.implementation: a CPU checkpoint resumed on GPUs runs fused there)
CONFIGURED = ("initial_lr", "betas", "eps", "weight_decay", "fused", "foreach")


def keep_configured_hyperparameters(run, scheduler_state: dict, configured: list[dict]) -> str:
    """The config's peak lr, betas, eps, weight decay and AdamW implementation over a restored optimizer and
    schedule. The shards bring back the checkpoint's in each parameter group and the schedule's state its peak lr
    (LambdaLR.base_lrs), so a rerun that changed them (a lower lr after non-finite steps, as NonFiniteError advises)
    would train at the old ones; the config wins, as with Megatron-LM's override_opt_param_scheduler. The step's lr
    is the config's peak times the schedule at the restored step. Returns what changed, for the log ("" when nothing
    did)."""
    groups = run.optimizer.param_groups
    peaks = [g["initial_lr"] for g in configured]
    step = scheduler_state["last_epoch"]
    lrs = [peak * f(step) for peak, f in zip(peaks, run.scheduler.lr_lambdas)]
    changed = sorted({f"{k} {old.get(k)} (now {new[k]})" for old, new in zip(groups, configured)
                      for k in CONFIGURED if k in new and old.get(k) != new[k]})
    for g, new, lr in zip(groups, configured, lrs):
        g.update({k: new[k] for k in CONFIGURED if k in new}, lr=lr)
        # a restored `step` sits where the checkpoint's implementation kept it (fused: on the parameter's device);
        # the configured one reads it there: on the device fused, else on the host (a device `step` under the
        # foreach and loop updates is read with .item(), a device sync per tensor per step)
        home = None if g.get("fused") or g.get("capturable") else torch.device("cpu")
        for p in g["params"]:
            state = run.optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(home or p.device)
    run.scheduler.load_state_dict({**scheduler_state, "base_lrs": peaks, "_last_lr": lrs})
    return ", ".join(changed).replace("initial_lr", "peak lr")


def data_problem(saved, current: str):
    """Why a checkpoint's data position does not fit this stage, or None: its data fingerprint (data/pipeline.py
    data_fingerprint) is missing or not `current`."""
    if saved is None:
        return "was written by a longstride that recorded no data fingerprint"
    if saved != current:
        return ("was written over other data: an edited, added or removed source file, another data config, or a "
                "longstride whose packing, held-out split or data fingerprint differs (a checkpoint written before "
                "the fingerprint covered the corpus's tokens and streamed files' sizes, or before streamed stages "
                "could resume on another number of data-parallel ranks, is such a one)")
    return None


def restart_stage(ctx, stage: str) -> str:
    """The setting that runs `stage` again from its start: train.resume=false for the first stage (which moves the
    run aside), else train.resume_from=<the previous stage's final> (which moves this stage and later ones aside)."""
    names = list(ctx.plans)
    i = names.index(stage)
    return f"train.resume_from={os.path.join(ctx.recipe_dir, names[i - 1], 'final')}" if i else "train.resume=false"


def check_same_tokenizer(saved, tok, path: str) -> None:
    """Refuses a resume under another tokenizer than the checkpoint's, `tok` this run's (data.tokenizer=null retrains
    one when the texts of its first source change; an edited tokenizer_config.json can change EOS or BOS): the model's
    embeddings would read other ids. A checkpoint from before the fingerprint is compared by the tokenizer saved in
    it; one from before the fingerprint covered EOS, BOS and padding by the fingerprint of its time."""
    if saved is None and has_tokenizer(path):
        saved = tokenizer_fingerprint(load_tokenizer(path))
    current = tokenizer_fingerprint(tok, legacy=saved is not None and not saved.startswith("v2:"))
    if saved is not None and saved != current:
        raise ValueError(f"{path} was trained with another tokenizer than this run's (with data.tokenizer=null a BPE "
                         "is trained on the first source's first texts, so those changed); restore the files it was "
                         "trained on, or copy its tokenizer files out (newer step checkpoints replace this one) and "
                         f"continue under them: data.tokenizer=<the copy> train.resume_from={path} "
                         "train.resume_data=false")
