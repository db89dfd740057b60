"""One stage's training loop: build or resume, train to the step budget, save checkpoints.

The model stays a single-device transformers model; data parallelism (DDP through accelerate) is
applied from outside. The loss of an optimizer step is the sum of token losses over all micro-
batches and ranks divided by the global count of labelled tokens, so gradient accumulation and
data parallelism give the same update as one big batch.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from longstride.data.batch import collate
from longstride.data.pipeline import split_holdout, stage_loader, stage_sequences
from longstride.data.stream import streaming_stage
from longstride.model.build import build_model
from longstride.model.checkpointing import enable_checkpointing
from longstride.model.loss import IGNORE_INDEX, ChunkedLossLM
from longstride.model.memory import device_memory_gib, estimate
from longstride.model.rmsnorm import lean_rms_norms
from longstride.model.tiling import tile_mlps
from longstride.parallel.attention import CPContext, cp_context, shard_for_cp, use_longstride_attention
from longstride.parallel.config import ParallelDims, cp_degrees, describe_cp
from longstride.parallel.fsdp import apply_fsdp, full_state_dict, grad_norm_clip, use_fsdp
from longstride.parallel.kernels import resolve_kernel
from longstride.recipes.checkpoint import (final_dir, latest_checkpoint, load_training_state, remove_partial, rng_state,
                                           save_checkpoint, set_rng_state, step_name, verified_final)
from longstride.recipes.faults import NonFiniteGuard, StopSignals, Stopped, check_finite_parameters, stage_input
from longstride.recipes.runlock import fingerprint
from longstride.recipes.schedule import build_scheduler
from longstride.recipes.tracking import peak_memory_gib


@dataclass
class RunContext:
    cfg: object  # recipes.schema.Config
    accelerator: object
    tokenizer: object
    corpus: object
    tracker: object
    recipe_dir: str
    cfg_dict: dict  # the resolved config, logged with every stage's run
    lock: object = None  # recipes.runlock.RunLock held by the main process for the run


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sums x over all ranks in place; NCCL reduces device tensors only, so a CPU x travels through the GPU."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and x.device.type == "cpu":
            x.copy_(all_reduce_sum(x.to(f"cuda:{torch.cuda.current_device()}")))
        else:
            dist.all_reduce(x)
    return x


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms, biases and embeddings (1-D tensors and embedding tables)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass(frozen=True)
class BatchPrep:
    """Turns a full PackedBatch into what this rank's forward takes: its CP share and attention layout."""

    doc_masking: bool
    kernel: str
    cp: CPContext = CPContext()

    def __call__(self, batch: dict) -> tuple[dict, object]:
        return shard_for_cp(batch, self.doc_masking, self.kernel, self.cp)


def forward_sum(model, local: tuple[dict, object], device) -> torch.Tensor:
    """Summed token loss of this rank's share of one PackedBatch (moved to `device`)."""
    mb, layout = local
    mb = {k: v.to(device) for k, v in mb.items()}
    return model(mb["input_ids"], mb["labels"], mb["position_ids"], doc_layout=layout)


def label_count(local: tuple[dict, object]) -> int:
    return int((local[0]["labels"] != IGNORE_INDEX).sum())


@torch.no_grad()
def validation_loss(model, held_out, dp_rank: int, dp: int, device, prep: BatchPrep) -> float:
    """Mean token loss over the held-out sequences (each data rank takes its share, each CP rank its
    part of the sequence), all ranks agree."""
    if not len(held_out):
        return float("nan")
    model.eval()
    total, count = torch.zeros(()), torch.zeros(())
    for i in range(dp_rank, len(held_out), dp):
        local = prep(collate([held_out[i]]))
        total += forward_sum(model, local, device).float().cpu()
        count += label_count(local)
    model.train()
    return (all_reduce_sum(total) / all_reduce_sum(count).clamp(min=1)).item()


def log_memory_estimate(ctx: RunContext, name: str, lm, tokens: int, ac: str, mlp_tile: int, shard: int,
                        offload: bool) -> None:
    """The stage's per-rank memory estimate (model/memory.py) against the device's, with a warning."""
    acc, tracker = ctx.accelerator, ctx.tracker
    est = estimate(lm.config, sum(p.numel() for p in lm.parameters()), tokens, ac, mlp_tile,
                   ctx.cfg.model.loss_tile_tokens, shard, act_bytes=2 if acc.mixed_precision == "bf16" else 4,
                   offload=offload)
    avail, where = device_memory_gib(acc.device)
    tracker.info("stage %s: memory estimate per rank %.2f GiB (parameters %.2f, gradients %.2f, optimizer %.2f, "
                 "activations %.2f at %d B/token, loss %.2f) of %.1f GiB (%s)", name, est["total"], est["parameters"],
                 est["gradients"], est["optimizer"], est["activations"], est["activation_bytes_per_token"],
                 est["loss"], avail, where)
    if offload:
        tracker.info("stage %s: %.2f GiB of checkpointed layer inputs per rank offloaded to pinned host memory",
                     name, est["host_activations"])
    if est["total"] > 0.9 * avail:
        tracker.warning("stage %s will likely not fit: about %.1f GiB per rank against %.1f GiB; raise its cp, set "
                        "model.activation_checkpointing=true and mlp_tile_tokens, or lower micro_batch_size", name,
                        est["total"], avail)


def stage_data(ctx: RunContext, index: int, stage, pad_id: int, dp_rank: int, dp: int):
    """(loader, held-out sequences, packing stats) of one stage: streamed, or packed from the corpus."""
    cfg = ctx.cfg
    if cfg.data.streaming:
        return streaming_stage(cfg.data, ctx.tokenizer, stage.seq_len, pad_id, stage.mixture, stage.micro_batch_size,
                               dp_rank, dp, os.path.abspath(cfg.paths.cache_dir))
    dataset, pack_stats = stage_sequences(cfg.data, ctx.corpus, stage.seq_len, pad_id, stage.mixture, stage.long_docs)
    train_set, held_out = split_holdout(dataset, cfg.data.eval_sequences, cfg.data.seed + index)
    return stage_loader(train_set, stage.micro_batch_size, dp_rank, dp, cfg.data, index), held_out, pack_stats


def train_stage(ctx: RunContext, index: int, name: str, stage, init_from: str | None) -> str:
    """Runs (or resumes, or skips if finished) one stage; returns its final checkpoint dir."""
    cfg, acc, tracker = ctx.cfg, ctx.accelerator, ctx.tracker
    stage_dir = os.path.join(ctx.recipe_dir, name)
    final = final_dir(stage_dir)
    if verified_final(stage_dir):
        tracker.info("stage %s already complete: %s", name, final)
        return final
    if acc.is_main_process:
        remove_partial(stage_dir)
    acc.wait_for_everyone()

    dims = ParallelDims.from_world(acc.num_processes, stage.cp, where=f"recipe.stages.{name}.cp")
    dp_rank = dims.dp_rank(acc.process_index)
    accum = stage.batch_tokens // (dims.dp * stage.micro_batch_size * stage.seq_len)
    total = stage.total_steps
    resume = latest_checkpoint(stage_dir, warn=tracker.warning)

    tok = ctx.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    lm = build_model(cfg.model, stage.rope_theta, stage.seq_len, len(tok), tok.eos_token_id, pad_id,
                     init_from=resume or init_from, seed=cfg.train.seed)
    ac = cfg.model.activation_checkpointing if stage.activation_checkpointing is None else stage.activation_checkpointing
    ac_mode = cfg.model.checkpoint_mode if ac else "none"
    offload = bool(ac and cfg.model.offload_activations and acc.device.type == "cuda")
    if cfg.model.lean_rms_norm:
        lean_rms_norms(lm)
    enable_checkpointing(lm, ac_mode, offload=offload)
    mlp_tile = cfg.model.mlp_tile_tokens if stage.mlp_tile_tokens is None else stage.mlp_tile_tokens
    tile_mlps(lm, mlp_tile)
    use_longstride_attention(lm)
    kernel = resolve_kernel(cfg.parallel.kernel, acc.device.type, ring=dims.cp > 1)
    degrees = cp_degrees(cfg.parallel, stage.cp, lm.config.num_attention_heads, where=f"recipe.stages.{name}.cp")
    balance = cfg.parallel.balance if stage.balance is None else stage.balance
    prep = BatchPrep(cfg.data.doc_masking, kernel, cp_context(dims, degrees, acc.device.type, balance,
                                                             cfg.parallel.balance_chunks))
    fsdp = use_fsdp(cfg.parallel.fsdp, acc.device.type, acc.num_processes)
    log_memory_estimate(ctx, name, lm, stage.micro_batch_size * stage.seq_len // dims.cp,
                        ac_mode, mlp_tile, acc.num_processes if fsdp else 1, offload)
    if fsdp:  # parameters, gradients and optimizer state sharded over all dp x cp ranks
        lm.to(acc.device)
        bf16 = acc.mixed_precision == "bf16"
        model = apply_fsdp(ChunkedLossLM(lm, cfg.model.loss_tile_tokens), lm.model.layers, acc.device.type,
                           acc.num_processes, torch.bfloat16 if bf16 else None)
    else:  # DDP over all dp x cp ranks (or a single process)
        model = acc.prepare(ChunkedLossLM(lm, cfg.model.loss_tile_tokens))
    optimizer = torch.optim.AdamW(param_groups(lm, cfg.optim.weight_decay), lr=stage.lr,
                                  betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    scheduler = build_scheduler(optimizer, total, stage.warmup_steps, stage.schedule, stage.min_lr_ratio,
                                stage.decay_fraction)

    with stage_input(name):  # the data's own checks (too few sequences for eval_sequences, ...) as exit 2
        loader, held_out, pack_stats = stage_data(ctx, index, stage, pad_id, dp_rank, dims.dp)

    def evaluate() -> float:
        return validation_loss(model, held_out, dp_rank, dims.dp, acc.device, prep)

    step, tokens_seen, val_start = 0, 0, None
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
    last_good = resume or init_from  # the checkpoint to go back to, updated at each save (never re-hashed per step)
    if resume:
        trainer, mine = load_training_state(resume, acc.process_index, acc.num_processes,
                                            resplit=not cfg.data.streaming)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=trainer["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(trainer["scheduler"])
        step, tokens_seen, val_start = trainer["step"], trainer["tokens_seen"], trainer["val_loss_start"]
        loader.load_state_dict(mine["data"])
        set_rng_state(mine["rng"])
        tracker.info("stage %s: resuming from %s (step %d)%s", name, resume, step,
                     "" if mine["data"].get("world", dims.dp) == dims.dp else
                     f"; its data position re-split from {mine['data']['world']} to {dims.dp} data-parallel ranks")
    else:
        tracker.info("stage %s: from %s", name, init_from or ("model.checkpoint" if cfg.model.checkpoint else "scratch"))
    tracker.info("stage %s: model %s on %s (%s); activation checkpointing %s%s; MLP tile %s", name,
                 type(model).__name__, acc.device, acc.distributed_type, ac_mode if ac else "off",
                 "" if not (ac and cfg.model.offload_activations) else
                 (", offloaded to host" if acc.device.type == "cuda" else ", offload ignored on CPU"),
                 mlp_tile or "off")
    tracker.info("stage %s: seq_len %d, rope_theta %g, %d steps x %d tokens (accumulation %d, dp %d, cp %d%s); "
                 "packing %s", name, stage.seq_len, stage.rope_theta, total, stage.batch_tokens, accum, dims.dp,
                 dims.cp, describe_cp(cfg.parallel.cp_impl, degrees, lm.config.num_key_value_heads) if dims.cp > 1 else "",
                 {k: round(v, 4) if isinstance(v, float) else v for k, v in pack_stats.items()})

    def save(path: str, with_state: bool, extra_meta: dict | None = None) -> None:
        check_finite_parameters(model.parameters(), path)
        # FSDP2: the full weights are gathered (collective) and the optimizer state stays sharded per rank
        full = {k.removeprefix("lm."): v for k, v in full_state_dict(model).items()} if fsdp else None
        save_lm = (lambda d: lm.save_pretrained(d, state_dict=full)) if fsdp else \
            (lambda d: acc.unwrap_model(model).lm.save_pretrained(d))
        # the whole optimizer state by parameter name (gathered from the shards under FSDP2, a collective),
        # so that a run resumes on any number of processes, with or without FSDP
        opt_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True)) if with_state else None
        save_checkpoint(
            path, rank=acc.process_index, is_main=acc.is_main_process, barrier=acc.wait_for_everyone,
            save_model=lambda d: (save_lm(d), tok.save_pretrained(d)),
            trainer_state={"scheduler": scheduler.state_dict(), "step": step, "tokens_seen": tokens_seen,
                           "val_loss_start": val_start, "optimizer": opt_state}
            if with_state else None,
            rank_state={"data": loader.state_dict(), "rng": rng_state()} if with_state else None,
            meta={"recipe": cfg.recipe.name, "stage": name, "step": step, "seq_len": stage.seq_len,
                  "rope_theta": stage.rope_theta, "tokens_seen": tokens_seen, "packing": pack_stats,
                  **(extra_meta or {})},
            world_size=acc.num_processes, manifest={"dp": dims.dp, "cp": dims.cp, "config": fingerprint(ctx.cfg_dict)},
            keep_last=cfg.train.keep_last if with_state else 0,
        )

    stack = contextlib.ExitStack()
    tracker.start_stage(name, stage_dir, total, step, {"stage": name, **asdict(stage), "packing": pack_stats,
                                                        "config": ctx.cfg_dict})
    try:
        model.train()
        stop = stack.enter_context(StopSignals())
        if val_start is None:
            val_start = evaluate()
            tracker.log_values(0, {"val_loss": val_start})
        while step < total:
            t0 = time.perf_counter()
            micro = [prep(next(loader)) for _ in range(accum)]
            count = all_reduce_sum(torch.tensor(float(sum(label_count(m) for m in micro))))
            loss_sum = torch.zeros((), dtype=torch.float32)
            for i, mb in enumerate(micro):
                if fsdp:
                    model.set_requires_gradient_sync(i == accum - 1)
                sync = contextlib.nullcontext() if fsdp or i == accum - 1 else acc.no_sync(model)
                with sync:
                    part = forward_sum(model, mb, acc.device)
                    # DDP averages gradients over all dp x cp ranks; each CP rank holds part of the sequence's
                    # gradient (its tokens' loss, plus the dK/dV its ring received), so scaling by world
                    # makes the update the global sum / global count.
                    acc.backward(part * (acc.num_processes / count.clamp(min=1).item()))
                loss_sum += part.detach().float().cpu()
            clip = grad_norm_clip if fsdp else acc.clip_grad_norm_
            # the global norm (clipping to it when optim.grad_clip > 0): the non-finite check needs it
            grad_norm = float(clip(model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf))
            lr = scheduler.get_last_lr()[0]
            loss = (all_reduce_sum(loss_sum) / count.clamp(min=1)).item()
            update = guard.step_ok(step + 1, loss, grad_norm, last_good)
            if update:
                optimizer.step()
                scheduler.step()
            else:
                tracker.warning("step %d: loss %s, gradient norm %s: not finite, update skipped (%d in a row)",
                                step + 1, loss, grad_norm, guard.in_row)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += stage.batch_tokens
            mem_method, mem = peak_memory_gib(acc.device)
            tracker.log(step, {"loss": loss, "lr": lr, "tokens_per_s": stage.batch_tokens / (time.perf_counter() - t0),
                               "tokens_seen": tokens_seen, "rope_theta": stage.rope_theta, "seq_len": stage.seq_len,
                               "grad_norm": grad_norm, "skipped": int(not update), f"peak_mem_gib_{mem_method}": mem})
            # not in a run of skipped steps: the state that just gave non-finite gradients is not worth keeping
            if stage.save_every and step % stage.save_every == 0 and step < total and not guard.in_row:
                last_good = os.path.join(stage_dir, step_name(step))
                save(last_good, with_state=True)
            signum = stop.requested(acc.device)
            if signum:  # preemption or Ctrl-C on any rank: all save this step (the same decision on each), then stop
                if not guard.in_row and last_good != os.path.join(stage_dir, step_name(step)):
                    last_good = os.path.join(stage_dir, step_name(step))
                    save(last_good, with_state=True)
                raise Stopped(signum, f"stopped by {signal.Signals(signum).name} after step {step} of stage {name}; "
                                      f"newest checkpoint {last_good or 'none yet'}; rerun the command to resume (without "
                                      "train.resume=false or train.resume_from, which would start over)")
            if cfg.train.crash_at_step is not None and step == cfg.train.crash_at_step:
                tracker.finish_stage()
                os.kill(os.getpid(), signal.SIGKILL)  # a hard crash, as an OOM killer or preemption would
        val_end = evaluate()
        tracker.log_values(step, {"val_loss": val_end})
        tracker.info("stage %s: validation loss %.4f -> %.4f", name, val_start, val_end)
        save(final, with_state=False, extra_meta={"val_loss_start": val_start, "val_loss_end": val_end})
    finally:
        stack.close()
        tracker.finish_stage()
    acc.free_memory()
    tracker.info("stage %s done: %s", name, final)
    return final
