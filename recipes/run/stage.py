"""One stage's training loop: build or resume, train to the step budget, save checkpoints.

The model stays a single-device transformers model; data and context parallelism are applied from
outside (parallel/parallelize.py, parallel/cp.py). The loss of an optimizer step is the sum of token
losses over all micro-batches and ranks divided by the global count of labelled tokens, so gradient
accumulation and data parallelism give the same update as one big batch. Policies live in their own
modules: faults (recipes/run/faults.py), checkpoints (recipes/run/stage_state.py, recipes/checkpoint/format.py),
metrics (recipes/run/tracking.py, recipes/run/flops.py), profiles (recipes/run/profiling.py), the memory check
before a stage trains (recipes/memory/fit.py).

Test hook (recipes/run/faults.test_kill): LONGSTRIDE_TEST_CRASH_AT_STEP=N SIGKILLs the process after optimizer
step N of every stage it runs (a hard crash, as an OOM killer or preemption would), for the resume tests.
"""
from __future__ import annotations

import hashlib
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
from transformers import AutoConfig

from longstride.data.batch import collate
from longstride.data.pipeline import (data_fingerprint, holdout_documents, mixture_weights, stage_loader,
                                      stage_sequences, validation_sequences)
from longstride.data.sources import walked
from longstride.data.stream import streaming_stage
from longstride.data.tokenizer import tokenizer_fingerprint
from longstride.model.build import build_model, scratch_notes
from longstride.model.compile import fresh_start, report_compiled
from longstride.model.loss import decoder_layers
from longstride.model.memory import kv_heads
from longstride.model.rope import rope_placement, written_base
from longstride.parallel.collectives import all_reduce, differing, together
from longstride.parallel.config import WorldMesh, describe_cp
from longstride.parallel.cp import cp_context
from longstride.parallel.kernels import activate_flash_impl
from longstride.parallel.parallelize import Parallelized, parallelize
from longstride.recipes.checkpoint.background import BackgroundSave
from longstride.recipes.checkpoint.format import (CheckpointError, final_dir, latest_checkpoint, remove_partial,
                                                  step_name, verified_final)
from longstride.recipes.config.plan import StagePlan, Unplanned
from longstride.recipes.memory.fit import log_memory_estimate
from longstride.recipes.run.faults import (NonFiniteError, NonFiniteGuard, StageInputError, StopSignals, Stopped,
                                             stage_input, test_kill)
from longstride.recipes.run.flops import StepFlops, peak_flops
from longstride.recipes.run.profiling import StepProfiler, rank_log
from longstride.recipes.run.schedule import build_scheduler
from longstride.recipes.run.stage_state import carry_streams, restore_stage, save_stage, settle_saves
from longstride.recipes.run.step import (Step, build_optimizer, build_step, label_count, loss_sum,
                                        next_micro_batches, optimizer_step)
from longstride.recipes.run.tracking import peak_memory_gib, reset_peak_memory

if TYPE_CHECKING:  # the types of the run's objects, for readers and checkers only
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase

    from longstride.data.corpus import Corpus
    from longstride.recipes.config.schema import Config
    from longstride.recipes.run.runlock import RunLock
    from longstride.recipes.run.tracking import Tracker


@dataclass
class RunContext:
    cfg: Config
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    corpus: Optional[Corpus]  # None when the data streams
    tracker: Tracker
    recipe_dir: str
    cfg_dict: dict  # the resolved config, logged with every stage's run
    plans: dict[str, StagePlan | Unplanned]  # resolved once by validate (Unplanned: a stage this launch skips)
    lock: Optional[RunLock] = None  # held by the main process for the run
    mesh: Optional[WorldMesh] = None  # the run's one device mesh, built by the first stage that needs it

    @cached_property
    def tokenizer_id(self) -> str:
        """The run's tokenizer's fingerprint (data/tokenizer.py), stored with each step checkpoint and checked on
        resume: one tokenizer per run, so computed once."""
        return tokenizer_fingerprint(self.tokenizer)

    @cached_property
    def corpus_id(self) -> str:
        """SHA-256 of the in-memory corpus's tokens (context-only marks included), part of every stage's data
        fingerprint: with the packing plan's spans it names every sequence's tokens, so an edit that keeps every
        document's length is caught too. One corpus per run, so hashed once."""
        return hashlib.sha256(memoryview(np.ascontiguousarray(self.corpus.tokens))).hexdigest()

    def world_mesh(self) -> WorldMesh:
        """The run's WorldMesh (collective the first time: every rank runs the same stages in order)."""
        if self.mesh is None:
            self.mesh = WorldMesh(self.accelerator.device.type, self.accelerator.num_processes)
            self.tracker.info("device mesh: %d ranks, built once for the run (each stage's dp x ring x ulysses is "
                              "a view of it)", self.mesh.world)
        return self.mesh


@dataclass
class StageRun:
    """One stage's live objects and counters: what train_step, evaluation and saving act on."""

    plan: StagePlan
    lm: torch.nn.Module  # the single-device transformers model inside `model`
    model: Parallelized
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    loader: object  # data.pipeline's StatefulDataLoader or data.stream.StreamLoader: iterable, state_dict()
    held_out: Sequence[dict]  # validation items (PackedBatch rows)
    pack_stats: dict
    built: Step  # the step's parts (recipes/run/step.py): its CP context and batch preparation
    data_id: str  # the data's fingerprint (stage_data), stored with each step checkpoint and checked on resume
    flops: StepFlops  # the model's FLOPs per step, for the tflops and mfu metrics
    saves: Optional[BackgroundSave] = None  # train.async_save: the step checkpoint being written behind the steps
    step: int = 0
    tokens_seen: int = 0
    val_start: Optional[float] = None

    def prep(self, batch: dict) -> tuple[dict, object]:
        """A full PackedBatch -> this rank's share of it and its attention layout."""
        return self.built.prep(batch)


@torch.no_grad()
def validation_loss(ctx: RunContext, run: StageRun) -> float:
    """Mean token loss over the held-out sequences (each data rank takes its share, each CP rank its
    part of the sequence); all ranks agree. Every rank runs the same number of forwards (FSDP2 gathers the
    parameters over all ranks in each): a rank past the end of its share runs the first sequence again and
    counts nothing of it."""
    if not len(run.held_out):
        return float("nan")
    run.model.eval()
    dims, device = run.plan.dims, ctx.accelerator.device
    total, count = torch.zeros(()), torch.zeros(())
    first, rounds = dims.dp_rank(ctx.accelerator.process_index), math.ceil(len(run.held_out) / dims.dp)
    for i in range(first, first + rounds * dims.dp, dims.dp):
        local = run.prep(collate([run.held_out[i if i < len(run.held_out) else 0]]))
        loss = loss_sum(run.model, local, device).float().cpu()
        if i < len(run.held_out):
            total += loss
            count += label_count(local)
    run.model.train()
    return (all_reduce(total) / all_reduce(count).clamp(min=1)).item()


def stage_data(ctx: RunContext, plan: StagePlan, pad_id: int):
    """(loader, held-out sequences, packing stats, data fingerprint) of one stage: streamed, or packed from the
    corpus. The held-out documents are the run's (every stage of the recipe), so no stage trains on what another
    validates on. The fingerprint names what the loader's position points into: in memory the packing plan (the
    corpus spans of every sequence), the corpus's tokens (so an edit that keeps every length counts too) and the
    held-out documents; streamed, the mixture, the held-out rows, the validation sequences' tokens (the head of every
    source) and each walked or files source's files with their sizes."""
    cfg, stage, dims = ctx.cfg, plan.stage, plan.dims
    dp_rank = dims.dp_rank(ctx.accelerator.process_index)
    stages = run_stages(cfg)
    with stage_input(plan.name):  # the data's own checks (too many eval_sequences for a source, ...) as exit 2
        if cfg.data.streaming:
            loader, held_out, report = streaming_stage(
                cfg.data, ctx.tokenizer, stage.seq_len, pad_id=pad_id, mixture=stage.mixture,
                micro_batch_size=stage.micro_batch_size, dp_rank=dp_rank, dp=dims.dp,
                cache_dir=os.path.abspath(cfg.paths.cache_dir), stages=stages)
            meta = {"seq_len": stage.seq_len, "weights": mixture_weights(cfg.data, stage.mixture),
                    "packing": str(cfg.data.packing), "open_seqs": cfg.data.stream_open_seqs,
                    "micro_batch_size": stage.micro_batch_size, "held_out_rows": report["held_out_rows"],
                    "rows": report.pop("rows_identity"),
                    # a walked source's epochs read its files in walked_order, every dp-th to a rank (before: each
                    # rank's own files in datasets' order, and earlier every dp-th row of all of them)
                    **({"walked_order": 1} if any(walked(s) for s in cfg.data.sources.values()) else {})}
            return loader, held_out, report, data_fingerprint(meta, *(h["input_ids"] for h in held_out))
        held = holdout_documents(cfg.data, ctx.corpus, stages)
        train_set, pack_stats = stage_sequences(cfg.data, ctx.corpus, stage.seq_len, pad_id, stage.mixture,
                                                stage.long_docs, held)
        held_out, val_stats = validation_sequences(cfg.data, ctx.corpus, held, stage.seq_len, pad_id, stage.mixture)
        loader = stage_loader(train_set, stage.micro_batch_size, dp_rank, dims.dp, cfg.data, plan.index)
        p = train_set.plan
        # the loader's own position counts micro-batches of its seeded order: both are part of what it points into
        meta = {"seq_len": p.seq_len, "held_out": list(held), "order_seed": loader.sampler.seed,
                "micro_batch_size": stage.micro_batch_size, "corpus": ctx.corpus_id}
        return loader, held_out, {**pack_stats, **val_stats}, data_fingerprint(
            meta, p.seq_ptr, p.seg_start, p.seg_len, *held.values())


def agreed_stage_data(ctx: RunContext, plan: StagePlan, pad_id: int):
    """stage_data, the same on every rank. Collective: a rank that could not read the stage's data fails every rank
    (the others naming another rank), and ranks that read different tokenizers or data (a file that differs between
    nodes) fail together naming what differs, before the step whose collectives would then not match."""
    data = together(lambda: stage_data(ctx, plan, pad_id), lambda: StageInputError(
        f"stage {plan.name}: another process could not read the stage's data (its log says why)"))
    apart = differing({"tokenizer": ctx.tokenizer_id[:19], "data": data[3][:16], "held-out sequences": len(data[1])})
    if apart:
        raise StageInputError(f"stage {plan.name}: the processes did not read the same tokenizer and data ("
                              f"{'; '.join(apart)}); every process must see the same files: the same paths on a "
                              "filesystem every node shares, not changed while the run starts")
    return data


def run_stages(cfg) -> list[tuple[int, Optional[dict]]]:
    """(seq_len, mixture) of every stage of the recipe: what the run's held-out documents are chosen for."""
    return [(s.seq_len, s.mixture) for s in cfg.recipe.stages.values()]


def build_stage(ctx: RunContext, plan: StagePlan, init_from: Optional[str], resume: Optional[str] = None) -> StageRun:
    """The stage's model (from `init_from`, the config's checkpoint, or scratch; resuming, from the step
    checkpoint's config, its weights then restored from the shards) patched and parallelized, its optimizer,
    LR schedule and data."""
    cfg, acc, tok, stage = ctx.cfg, ctx.accelerator, ctx.tokenizer, plan.stage
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with stage_input(plan.name):  # a resume whose config no longer fits its checkpoint: exit 2, naming the stage
        lm = build_model(cfg.model, stage.rope_theta, stage.seq_len, len(tok), tok.eos_token_id, pad_id,
                         init_from=init_from, seed=cfg.train.seed, resume=resume, bos_id=tok.bos_token_id)
    mesh = ctx.world_mesh() if plan.dims.cp > 1 or plan.fsdp else None
    cp = cp_context(cfg.parallel.cp_impl, plan.dims, plan.degrees, device_type=acc.device.type, kernel=plan.kernel,
                    balance=plan.balance, balance_chunks=cfg.parallel.balance_chunks, mesh=mesh)
    if plan.step.compile:
        fresh_start()
    built = build_step(lm, plan.step, cp)
    if plan.kernel == "torch_flash":
        activate_flash_impl(str(cfg.parallel.flash_impl))
    log_memory_estimate(ctx, plan, lm)
    model = parallelize(built.module, decoder_layers(lm), plan.fsdp, acc, mesh)
    optimizer = build_optimizer(lm, cfg.optim, stage.lr, acc.device.type)
    scheduler = build_scheduler(optimizer, stage.total_steps, stage.warmup_steps, stage.schedule, stage.floor_ratio,
                                stage.decay_share)
    loader, held_out, pack_stats, data_id = agreed_stage_data(ctx, plan, pad_id)
    return StageRun(plan, lm, model, optimizer, scheduler=scheduler, loader=loader, held_out=held_out,
                    pack_stats=pack_stats, built=built, data_id=data_id,
                    flops=StepFlops(lm, peak_flops(acc.device) if acc.mixed_precision == "bf16" else None),
                    saves=BackgroundSave() if cfg.train.async_save else None)


def log_stage_start(ctx: RunContext, run: StageRun, init_from: Optional[str], resumed: bool, carried: str = "") -> None:
    cfg, acc, plan, s = ctx.cfg, ctx.accelerator, run.plan, run.plan.stage
    if not resumed:
        ctx.tracker.info("stage %s: from %s%s", plan.name,
                         init_from or ("model.checkpoint" if cfg.model.checkpoint else "scratch"), carried)
    spec = plan.step
    ac = spec.checkpointing != "none"
    layers = "" if not ac or spec.checkpoint_layers is None else \
        f" (the first {spec.checkpoint_layers} of {len(decoder_layers(run.lm))} layers)"
    offload = "" if not (ac and cfg.model.offload_activations) else \
        (", offloaded to host" if spec.offload else ", offload ignored on CPU")
    compiled = f"; torch.compile on {run.built.compiled} parts of the decoder layers" \
        f"{', their tiles' if spec.mlp_tile else ''} and the loss's tile (the first step compiles them)" \
        if run.built.compiled else ""
    ctx.tracker.info(f"stage {plan.name}: model {type(run.model.module).__name__} on {acc.device} "
                     f"({acc.distributed_type}, mixed precision {acc.mixed_precision}); activation checkpointing "
                     f"{spec.checkpointing if ac else 'off'}{layers}{offload}; MLP tile {spec.mlp_tile or 'off'}; "
                     f"attention kernel {plan.kernel}{compiled}")
    cp_text = describe_cp(cfg.parallel.cp_impl, plan.degrees, kv_heads(run.lm.config)) if plan.dims.cp > 1 else ""
    packing = {k: round(v, 4) if isinstance(v, float) else v for k, v in run.pack_stats.items()}
    rounded = f" (tokens={s.tokens} rounded down to whole steps)" if s.tokens and s.tokens % s.batch_tokens else ""
    ctx.tracker.info(f"stage {plan.name}: seq_len {s.seq_len}, rope_theta {s.rope_theta:g}, {s.total_steps} steps x "
                     f"{s.batch_tokens} tokens{rounded} (accumulation {plan.accum}, dp {plan.dims.dp}, "
                     f"cp {plan.dims.cp}{cp_text}); packing {packing}")
    if s.save_every >= s.total_steps > 1:  # as 0: no step checkpoint, so a crash restarts the stage
        ctx.tracker.warning(f"stage {plan.name}: recipe.stages.{plan.name}.save_every={s.save_every} is not below its "
                            f"{s.total_steps} steps, so no step checkpoint is written but at a stop signal, and a "
                            "crash (a killed process, a node lost) restarts the stage; lower it to resume mid-stage")
    scratch = not (resumed or init_from or cfg.model.arch == "checkpoint")
    for said in scratch_notes(cfg.model, len(ctx.tokenizer)) if scratch else []:
        ctx.tracker.warning("stage %s: %s", plan.name, said)
    placement = rope_placement(run.lm.config, cfg.model.rope_layer_types)
    if placement:
        ctx.tracker.info("stage %s: %s", plan.name, placement)
    source = init_from or (cfg.model.checkpoint if cfg.model.arch == "checkpoint" else None)
    before = None if resumed or source is None else \
        written_base(AutoConfig.from_pretrained(source), cfg.model.rope_layer_types)
    if before and s.rope_theta < before:
        ctx.tracker.warning(f"stage {plan.name}: recipe.stages.{plan.name}.rope_theta={s.rope_theta:g} is below the "
                            f"RoPE base of the model it starts from ({before:g}, {source}), so this stage lowers it; "
                            "context extension raises the base at each stage. If that is not what you meant, set "
                            f"recipe.stages.{plan.name}.rope_theta to {before:g} or more")
    for name, share in run.pack_stats.get("qa_docs_cut", {}).items():
        if share > 0.05:
            ctx.tracker.warning("stage %s: %.0f%% of source %s's documents are longer than seq_len %d, so packing "
                                "splits them and their answers lose the facts they ask about; lower "
                                "data.sources.%s.synthetic.max_words or give this stage a source of shorter documents",
                                plan.name, 100 * share, name, s.seq_len, name)


def train_step(ctx: RunContext, run: StageRun, guard: NonFiniteGuard, last_good: Optional[str]) -> dict:
    """One optimizer step over plan.accum micro-batches; a non-finite loss or gradient norm skips the update
    (recipes/run/faults.py). Returns the step's metrics."""
    acc, stage, model = ctx.accelerator, run.plan.stage, run.model
    t0 = time.perf_counter()
    masked = run.plan.step.doc_masking
    pairs = (lambda doc_ids: run.flops.pairs(doc_ids, masked)) if run.flops.counted else None
    with stage_input(run.plan.name):  # a streamed record the reader cannot decode, met mid-stage, on any rank: exit 2
        micro, totals = next_micro_batches(run.loader, run.plan.accum, run.prep, pairs)
    count = totals[0]
    done = optimizer_step(model, run.optimizer, micro, count, acc.device, ctx.cfg.optim.grad_clip, run.scheduler,
                          allow=lambda loss, norm: guard.step_ok(run.step + 1, loss, norm, last_good))
    if not done.applied:
        ctx.tracker.warning("step %d: loss %s, gradient norm %s: not finite, update skipped (%d in a row)",
                            run.step + 1, done.loss, done.grad_norm, guard.in_row)
    run.step += 1
    run.tokens_seen += stage.batch_tokens
    mem_method, mem = peak_memory_gib(acc.device)
    seconds = time.perf_counter() - t0
    # tokens_per_s: every position of the step's batch, padding included (as torchtitan counts); loss_tokens_per_s:
    # the positions that carry a loss, over all ranks (no padding, no document's last token)
    metrics = {"loss": done.loss, "lr": done.lr, "tokens_per_s": stage.batch_tokens / seconds,
               "loss_tokens_per_s": count.item() / seconds, "tokens_seen": run.tokens_seen,
               "rope_theta": stage.rope_theta, "seq_len": stage.seq_len, "grad_norm": done.grad_norm,
               "skipped": int(not done.applied), f"peak_mem_gib_{mem_method}": mem}
    if run.flops.counted:  # model FLOP/s per rank (recipes/run/flops.py): each CP rank counted its group's rows
        per_rank = run.flops.step(stage.batch_tokens, int(totals[1].item()) // run.plan.dims.cp) / seconds / \
            acc.num_processes
        metrics["tflops"] = per_rank / 1e12
        if run.flops.peak:
            metrics["mfu"] = per_rank / run.flops.peak
    return metrics


def train_steps(ctx: RunContext, run: StageRun, stage_dir: str, stop: StopSignals, last_good: Optional[str]) -> None:
    """The first validation loss (unless resumed), then steps to the budget, each followed by after_step; the steps
    of profile.*'s window traced (recipes/run/profiling.py)."""
    guard, stage, compile_reported = NonFiniteGuard(ctx.cfg.train.max_nonfinite_steps), run.plan.stage, False
    if run.val_start is None:  # a fresh stage, or a resume whose data started afresh (stage_state.restore_stage)
        run.val_start = validation_loss(ctx, run)
        ctx.tracker.log_values(run.step, {"val_loss": run.val_start})
    acc = ctx.accelerator
    profiler = StepProfiler(ctx.cfg.profile, run.plan.name, stage_dir, acc.process_index, acc.device,
                            rank_log(ctx.tracker.info, acc.is_main_process, acc.process_index), stage.total_steps)
    try:
        while run.step < stage.total_steps:
            with profiler.step(run.step + 1):
                metrics = train_step(ctx, run, guard, last_good)
            if run.built.compiled and not compile_reported:  # rank 0's, after its validation and first step
                report_compiled(ctx.tracker, metrics)
                compile_reported = True
                metrics["compiling"] = 1  # its rates include compiling: flagged in metrics.jsonl and wandb
            last_good = after_step(ctx, run, stage_dir, stop, guard, metrics, last_good)
        if guard.in_row:  # under train.max_nonfinite_steps: the stage ends, its final the last good update's weights
            ctx.tracker.warning("stage %s ended inside a run of %d skipped non-finite steps: its final checkpoint "
                                "holds the weights of the last update applied; look at its loss before a next stage "
                                "builds on it (the last good step checkpoint: %s)", run.plan.name, guard.in_row,
                                last_good or "none")
    except NonFiniteError:  # every rank stops at this step: the checkpoint in flight, which it names, is sealed first
        settle_saves(ctx, run, every_rank=True)
        acc.wait_for_everyone()  # and every rank leaves together
        raise
    except Stopped:
        raise
    except Exception:
        finish_in_flight(ctx, run)
        raise
    finally:  # a window cut short by a stop or an error: what it traced is written
        profiler.close()


def finish_in_flight(ctx: RunContext, run: StageRun) -> None:
    """On this rank's own error: the save in flight is finished if it can be (its failure logged), before the error
    leaves the stage and the run lock is released (a rerun would take the half-sealed directory for its own)."""
    try:
        settle_saves(ctx, run)
    except CheckpointError as e:
        ctx.tracker.warning("%s", e)


def after_step(ctx: RunContext, run: StageRun, stage_dir: str, stop: StopSignals, guard: NonFiniteGuard,
               metrics: dict, last_good: Optional[str]) -> Optional[str]:
    """A step's log line, its checkpoint (every save_every, never inside a run of skipped steps) and a stop signal
    (any rank's: every rank saves this step and raises Stopped). Returns the newest checkpoint."""
    stage = run.plan.stage
    ctx.tracker.log(run.step, metrics)
    here = os.path.join(stage_dir, step_name(run.step))
    if stage.save_every and run.step % stage.save_every == 0 and run.step < stage.total_steps and not guard.in_row:
        save_stage(ctx, run, here, with_state=True)
        last_good = here
    signum, save_failed = stop.requested(run.saves is not None and run.saves.failed())
    if save_failed:  # a background save failed on some rank: every rank stops here, naming it
        settle_saves(ctx, run, failed_elsewhere=True)
    if signum:  # preemption or Ctrl-C on any rank: all save this step (the same decision on each), then stop
        if not guard.in_row and last_good != here:
            save_stage(ctx, run, here, with_state=True)
            last_good = here
        if run.saves is not None:  # the newest checkpoint sealed before any rank exits (a failure: on every rank)
            settle_saves(ctx, run, every_rank=True)
        raise Stopped(signum, f"stopped by {signal.Signals(signum).name} after step {run.step} of stage "
                              f"{run.plan.name}; newest checkpoint {last_good or 'none yet'}; rerun the command "
                              "to resume (without train.resume=false or train.resume_from, which would start over)")
    test_kill("step", run.step, before=ctx.tracker.finish_stage)
    return last_good


def train_stage(ctx: RunContext, plan: StagePlan | Unplanned, init_from: Optional[str]) -> str:
    """Runs (or resumes, or skips if finished) one stage; returns its final checkpoint dir."""
    acc, tracker = ctx.accelerator, ctx.tracker
    stage_dir = os.path.join(ctx.recipe_dir, plan.name)
    final = final_dir(stage_dir)
    # the ranks verify together (each hashes a share of the files) and make the same choice
    if verified_final(stage_dir, shared=True):
        tracker.info("stage %s already complete: %s", plan.name, final)
        return final

    def planned():  # its final is damaged after all: it trains again, on this launch's processes
        if isinstance(plan, Unplanned):  # (on one rank alone where the ranks plan differently: another device)
            raise StageInputError(f"stage {plan.name} has no intact final checkpoint, so it trains again, and its "
                                  f"layout does not fit this launch: {plan.error}")

    together(planned, lambda: StageInputError(f"stage {plan.name} trains again, and another rank's plan for it does "
                                              "not fit this launch (its log says why)"))
    if acc.is_main_process:
        remove_partial(stage_dir)
    acc.wait_for_everyone()
    resume = latest_checkpoint(stage_dir, warn=tracker.warning, shared=True)
    reset_peak_memory(acc.device)
    run = build_stage(ctx, plan, init_from, resume)
    if resume:
        restore_stage(ctx, run, resume)
    carried = "" if resume else carry_streams(ctx, run, init_from)  # streamed: on from where the last stage stopped
    log_stage_start(ctx, run, init_from, resumed=bool(resume), carried=carried)
    config = {"stage": plan.name, **asdict(plan.stage), "packing": run.pack_stats, "config": ctx.cfg_dict}
    together(lambda: tracker.start_stage(plan.name, stage_dir, plan.stage.total_steps, run.step, config),  # rank 0's
             lambda: RuntimeError(f"stage {plan.name}: rank 0 could not start tracking it (its log says why)"))
    try:  # a stop signal during the final validation or save waits for them, as during the steps
        with StopSignals() as stop:
            run.model.train()
            train_steps(ctx, run, stage_dir, stop, last_good=resume or init_from)
            val_end = validation_loss(ctx, run)
            tracker.log_values(run.step, {"val_loss": val_end})
            tracker.info("stage %s: validation loss %.4f -> %.4f", plan.name, run.val_start, val_end)
            save_stage(ctx, run, final, with_state=False, extra_meta={"val_loss_start": run.val_start,
                                                                      "val_loss_end": val_end})
            signum, _ = stop.requested()  # no save is in flight after the final one
            if signum and plan.name == list(ctx.plans)[-1]:  # the last stage: the run is complete, nothing to stop
                tracker.info("stage %s: %s arrived during its final save; the run is complete", plan.name,
                             signal.Signals(signum).name)
            elif signum:  # it arrived during the final validation or save: the stage is complete; stop before the next
                raise Stopped(signum, f"stopped by {signal.Signals(signum).name} at the end of stage {plan.name}, "
                                      f"its final checkpoint {final} saved; rerun the command to go on with the "
                                      "next stage")
    except Exception:  # the final validation or save failed with the last step checkpoint still in flight
        finish_in_flight(ctx, run)
        raise
    finally:
        tracker.finish_stage()
    acc.free_memory()
    tracker.info("stage %s done: %s", plan.name, final)
    return final
