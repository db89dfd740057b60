"""Before a stage trains: its per-rank memory (model/memory.py's analytic estimate, and its step traced on fake
tensors where train.trace_memory asks: recipes/memory/trace.py) against the device's, logged, with a warning when
it will likely not fit. `ctx` and `plan` are the stage loop's RunContext and StagePlan (recipes/run/stage.py).
"""
from __future__ import annotations

import os

from longstride.model.memory import device_memory_gib, estimate, layer_parts, precision


def log_memory_estimate(ctx, plan, lm) -> None:
    """The stage's per-rank memory estimate (model/memory.py) against the device's, with a warning."""
    acc, tracker, s, spec = ctx.accelerator, ctx.tracker, plan.stage, plan.step
    est = estimate(lm.config, sum(p.numel() for p in lm.parameters()), s.micro_batch_size * s.seq_len // plan.dims.cp,
                   ac=spec.checkpointing, mlp_tile=spec.mlp_tile, loss_tile=spec.loss_tile,
                   shard=acc.num_processes if plan.fsdp else 1, offload=spec.offload,
                   parts=layer_parts(lm, spec.lean_norms), **precision(acc.mixed_precision == "bf16", plan.fsdp),
                   ac_layers=spec.checkpoint_layers, ulysses=plan.degrees.plain_ulysses(lm.config.num_attention_heads))
    avail, where = device_memory_gib(acc.device, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    tracker.info(f"stage {plan.name}: memory estimate per rank {est['total']:.2f} GiB (parameters "
                 f"{est['parameters']:.2f}, gradients {est['gradients']:.2f}, optimizer {est['optimizer']:.2f}, "
                 f"activations {est['activations']:.2f} at {int(est['activation_bytes_per_token'])} B/token, "
                 f"autocast's weight copies {est['weight_casts']:.2f}, loss {est['loss']:.2f}, MLP tiles "
                 f"{est['mlp_tiles']:.2f}) of {avail:.1f} GiB ({where})")
    if spec.offload:
        tracker.info("stage %s: %.2f GiB of checkpointed layer inputs per rank offloaded to pinned host memory",
                     plan.name, est["host_activations"])
    need = est["total"]
    if acc.is_main_process and _trace_on(ctx.cfg.train.trace_memory, acc.device.type):
        need = max(need, log_traced_memory(ctx, plan, lm, est["total"]) or 0.0)
    if ctx.cfg.train.async_save:  # the rank's state copied to host memory (FSDP2's shard twice while staging)
        copy = (est["parameters"] + est["optimizer"]) * (2 if plan.fsdp else 1)
        tracker.info("stage %s: a step checkpoint saved in the background holds about %.2f GiB more host memory per "
                     "rank until it is written (train.async_save)", plan.name, copy)
        need += copy if acc.device.type == "cpu" else 0.0
    if need > 0.9 * avail:
        tracker.warning("stage %s will likely not fit: about %.1f GiB per rank against %.1f GiB; raise its cp, set "
                        "model.activation_checkpointing=true (every layer: no checkpoint_layers) and mlp_tile_tokens, "
                        "or lower micro_batch_size", plan.name, need, avail)


def _trace_on(choice: str, device_type: str) -> bool:
    choice = str(choice).lower()
    return choice == "true" or (choice == "auto" and device_type == "cuda")


def log_traced_memory(ctx, plan, lm, analytic_gib: float) -> float | None:
    """The stage's step traced for this device (recipes/memory/trace.py, in a child process) beside the analytic
    estimate, and its peak GiB; a trace that fails is a warning (None), never a stopped run."""
    from longstride.recipes.memory.trace import stage_program, trace_in_child

    acc, gib = ctx.accelerator, 2 ** 30
    prog = stage_program(ctx.cfg, plan, acc.num_processes, docs=4, config=lm.config,
                         gpu=acc.device.type == "cuda", bf16=acc.mixed_precision == "bf16")
    try:
        # the other ranks wait in their next collective meanwhile: the trace must end well before it times out
        r = trace_in_child(prog, timeout_s=min(600.0, ctx.cfg.train.collective_timeout_s / 2))
    except Exception as e:  # noqa: BLE001 - a planning aid: the stage runs without it
        ctx.tracker.warning("stage %s: the memory trace failed (%s: %s); training goes on", plan.name,
                            type(e).__name__, e)
        return None
    g = {k: r[k] / gib for k in ("peak", "parameters", "gradients", "optimizer", "activations")}
    ctx.tracker.info(f"stage {plan.name}: traced step per rank {g['peak']:.2f} GiB (parameters {g['parameters']:.2f}, "
                     f"gradients {g['gradients']:.2f}, optimizer {g['optimizer']:.2f}, activations "
                     f"{g['activations']:.2f}; recipes/memory/trace.py) against the analytic {analytic_gib:.2f} GiB "
                     f"({100 * (analytic_gib - g['peak']) / g['peak']:+.0f}%)")
    return g["peak"]
