"""`longstride plan`: each stage's memory per rank on a named GPU, from one traced training step, the longest
sequence that fits, and for a stage that does not fit the smallest change that makes it fit.

    longstride plan recipe=smollm3_3b_64k hardware=h100_80g gpus_per_node=8 nodes=1
    longstride plan recipe=tiny_extend hardware=a100_40g gpus_per_node=2 [any training override]

Each stage's step is traced (recipes/memory/trace.py: fake tensors, one rank of gpus_per_node x nodes under a fake
process group, bf16, torch's flash attention, the stage's CP, checkpointing, tiling, offload and FSDP2 as
planned for that many GPUs) and counted as the CUDA caching allocator's allocated bytes. What a GPU also
holds (the CUDA context, cuBLAS workspace, NCCL buffers) is the hardware's reserve, and the allocator's
fragmentation a stated share of the rest: both are assumptions, not traced. The longest sequence comes from
the trace itself: with flash attention every per-rank term is constant or linear in the sequence length, so
two traces give the line, and a third at the answer checks it. Every figure is an estimate: nothing here ran
on a GPU. Hardware files: configs/hardware/<name>.yaml.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import replace

from longstride.model.build import stage_config
from longstride.model.memory import estimate, precision
from longstride.overrides import run
from longstride.parallel.config import ParallelConfig
from longstride.parallel.cp import cp_degrees
from longstride.recipes.config.plan import validate
from longstride.recipes.memory.plan_options import Hardware, PlanConfig, parse_plan
from longstride.recipes.memory.trace import stage_program, trace_step

GIB = 2 ** 30


def model_config(cfg, stage):
    """The transformers config a stage trains (model/build.stage_config), without weights."""
    vocab = 0 if cfg.model.arch == "checkpoint" else cfg.model.vocab_size or _tokenizer_size(cfg.data)
    return stage_config(cfg.model, stage.rope_theta, stage.seq_len, vocab, 0, 0)


def vocabulary(cfg) -> str:
    """The vocabulary the plan traces and where it comes from, for its header: without data.tokenizer or
    model.vocab_size it is data.vocab_size's, the BPE a run would train, likely far smaller than the tokenizer the
    recipe means (SmolLM3's has 128,256 tokens), and the embeddings and loss with it."""
    if cfg.model.arch == "checkpoint":
        return "vocabulary: the checkpoint's"
    if cfg.model.vocab_size:
        return f"vocabulary {cfg.model.vocab_size:,} (model.vocab_size)"
    if cfg.data.tokenizer:
        return f"vocabulary {_tokenizer_size(cfg.data):,} (data.tokenizer)"
    return (f"vocabulary {cfg.data.vocab_size:,} (data.vocab_size: the BPE the run trains without data.tokenizer; "
            "plan with yours: data.tokenizer=DIR or model.vocab_size=N)")


def _tokenizer_size(data) -> int:
    if data.tokenizer:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(data.tokenizer))
    return data.vocab_size  # the BPE tokenizer training builds on the corpus


def peak_line(prog, first: dict, length: int) -> tuple[float, float, dict]:
    """(fixed bytes, bytes per token, the trace at `length`) of forward + backward's peak, through `first`
    (the trace at prog.seq_len) and a trace at `length`: with flash attention it is a straight line in the
    length. The update's own peak (peak_optimizer) does not grow with it and is checked apart."""
    second = trace_step(prog.at(length))
    slope = (second["peak_backward"] - first["peak_backward"]) / (length - prog.seq_len)
    return first["peak_backward"] - slope * prog.seq_len, slope, second


CHECK_WITHIN = 8  # the line's answer is checked by a trace when it is at most this many times the stage's length


def longest(prog, usable: int, first: dict) -> tuple[int, bool, list]:
    """The longest seq_len whose traced peak fits `usable` bytes, from the line through traces at the stage's
    length and twice it. Past CHECK_WITHIN x the stage's length, the line through traces at twice and four times it
    instead, where it is steeper: the peak is the largest of the step's phases, each growing at its own rate, so a
    phase with a large fixed part (a large vocabulary's logits tile) can hold it at the stage's length and another
    overtake it further out (SmolLM3-3B's 4K stage: 102,967 from the first line, against that of 2x and 4x). When the
    answer is within CHECK_WITHIN x the stage's length a trace there checks it (stepping down 5% while it does not
    fit); further out a trace would take minutes (its loss and MLP tiles grow with the length), and the line stands.
    Returns (length or 0, checked, the traces made)."""
    unit = 1 if prog.cp == 1 else prog.degrees.seq_len_unit
    L1 = prog.seq_len
    fixed, slope, second = peak_line(prog, first, 2 * L1)
    points = [(L1, first["peak"]), (2 * L1, second["peak"])]
    if max(first["peak_optimizer"], second["peak_optimizer"]) > usable or slope <= 0:  # the update alone fails
        return 0, False, points
    guess = int((usable - fixed) / slope) // unit * unit
    if guess > CHECK_WITHIN * L1:
        third = trace_step(prog.at(4 * L1))
        points.append((4 * L1, third["peak"]))
        if third["peak_optimizer"] > usable:
            return 0, False, points
        steeper = (third["peak_backward"] - second["peak_backward"]) / (2 * L1)
        if steeper > slope:
            fixed, slope = second["peak_backward"] - steeper * 2 * L1, steeper
            guess = int((usable - fixed) / slope) // unit * unit
    if guess > CHECK_WITHIN * L1:
        return guess, False, points
    for _ in range(4):
        if guess < unit:
            return 0, True, points
        peak = trace_step(prog.at(guess))["peak"]
        points.append((guess, peak))
        if peak <= usable:
            return guess, True, points
        guess = int(guess * 0.95) // unit * unit
    return 0, True, points


def mlps_tile(config) -> bool:
    """Whether model.mlp_tile_tokens can tile the MLPs of a model of `config` (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from longstride.model.tiling import untileable

    with torch.device("meta"):
        return untileable(AutoModelForCausalLM.from_config(config)) is None


def fixes(prog, stage: str, parallel: ParallelConfig, tileable: bool = True):
    """Single changes to `stage` in order of cost: tiling (where the model's MLPs can be: model/tiling.untileable),
    selective checkpointing (backward recomputes the
    elementwise ops only), full checkpointing of the first half, then three quarters, of the layers (each
    recomputes its whole layer; the others keep everything), of every layer, offload, then each larger cp within
    the world under the run's `parallel` settings (its Ulysses degree, UPipe heads). Yields (the overrides that set
    it, the changed program)."""
    step = prog.step
    on = "model.activation_checkpointing=true model.checkpoint_mode="
    layers, field = prog.config.num_hidden_layers, f"recipe.stages.{stage}.checkpoint_layers"
    if not step.mlp_tile and tileable:
        tile = max(256, min(8192, prog.seq_len // prog.cp // 4))  # a few tiles per rank's tokens
        yield f"model.mlp_tile_tokens={tile}", prog.with_step(mlp_tile=tile)
    if step.checkpointing == "none":
        yield f"{on}selective", prog.with_step(checkpointing="selective")
    full_now = (step.checkpoint_layers or layers) if step.checkpointing == "full" else 0  # layers checkpointed fully
    for k in sorted({-(-layers // 2), -(-3 * layers // 4)}):
        if full_now < k < layers and not step.offload:
            yield f"{on}full {field}={k}", prog.with_step(checkpointing="full", checkpoint_layers=k)
    if step.checkpointing != "full" or step.checkpoint_layers is not None:
        every = f" {field}={layers}" if step.checkpoint_layers is not None else ""  # null would take model.'s
        yield f"{on}full{every}", prog.with_step(checkpointing="full", checkpoint_layers=None)
    if step.checkpointing != "none" and step.checkpoint_layers is None and not step.offload:
        yield "model.offload_activations=true", prog.with_step(offload=True)
    cp = prog.cp * 2
    while cp <= prog.world and prog.world % cp == 0:
        try:  # a degree the settings cannot split (hybrid's Ulysses degree, the heads): the next one may
            degrees = cp_degrees(parallel, cp, prog.config.num_attention_heads)
        except ValueError:
            cp *= 2
            continue
        yield f"recipe.stages.{stage}.cp={cp}", replace(prog, cp=cp, degrees=degrees)
        cp *= 2


def plan_stage(cfg, plan, hw: Hardware, world: int, pc: PlanConfig) -> dict:
    t0 = time.perf_counter()
    prog = stage_program(cfg, plan, world, docs=pc.docs, config=model_config(cfg, plan.stage))
    r = trace_step(prog)
    usable = int(hw.usable_gib * GIB)
    n, step = r["num_params"], prog.step
    est = estimate(prog.config, n, prog.micro_batch * prog.seq_len // prog.cp, ac=step.checkpointing,
                   mlp_tile=step.mlp_tile, loss_tile=step.loss_tile, shard=world if prog.fsdp else 1,
                   offload=step.offload, parts=r["layer_parts"], **precision(prog.bf16, prog.fsdp),
                   ac_layers=step.checkpoint_layers,
                   ulysses=prog.degrees.plain_ulysses(prog.config.num_attention_heads))
    row = {"stage": plan.name, "seq_len": prog.seq_len, "cp": prog.cp, "cp_impl": prog.cp_impl if prog.cp > 1 else "",
           "checkpointing": step.checkpointing, "checkpoint_layers": step.checkpoint_layers,
           "layers": prog.config.num_hidden_layers, "kernel": plan.kernel,
           "mlp_tile": step.mlp_tile, "offload": step.offload,
           "fsdp": prog.fsdp, "params": n, **{k: r[k] for k in ("parameters", "gradients", "optimizer",
                                                                "activations", "peak", "host")},
           "analytic": est["total"] * GIB, "usable": usable, "fits": r["peak"] <= usable}
    if pc.search:
        row["longest"], row["longest_checked"], row["search"] = longest(prog, usable, r)
    if not row["fits"]:
        tileable = mlps_tile(prog.config)
        row["fix"] = next((what for what, p in fixes(prog, plan.stage, cfg.parallel, tileable)
                           if trace_step(p)["peak"] <= usable), "none found")
    row["seconds"] = time.perf_counter() - t0
    return row


def _longest(r: dict) -> str:
    if "longest" not in r:
        return "-"
    if not r["longest"]:
        return "none"
    return f"{r['longest']}" + ("" if r["longest_checked"] else " (line)")


def _checkpointing(r: dict) -> str:
    """'none', 'selective', 'full', or 'full 2/4' where only the first layers are checkpointed."""
    k = r["checkpoint_layers"]
    return r["checkpointing"] + (f" {k}/{r['layers']}" if r["checkpointing"] != "none" and k is not None else "")


def print_plan(rows: list[dict], hw: Hardware, world: int, recipe: str, vocab: str = "") -> None:
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    print(f"longstride plan: recipe {recipe} on {world} x {hw.name} ({hw.memory_gib:g} GiB; usable "
          f"{hw.usable_gib:.1f} GiB after a {hw.reserve_gib:g} GiB reserve and {hw.fragmentation:.0%} "
          "fragmentation). ESTIMATES by tracing one step per rank, not measured on a GPU; GiB per rank "
          "(host: offloaded to host memory)" + (f"; {vocab}" if vocab else ""))
    head = ["stage", "seq_len", "cp", "checkpointing", "kernel", "params", "grads", "optim", "activ", "peak",
            "analytic", "diff", "host", "fits", "longest seq_len", "to fit"]
    table = [[r["stage"], str(r["seq_len"]), f"{r['cp']} {r['cp_impl']}".strip(), _checkpointing(r), r["kernel"],
              g(r["parameters"]),
              g(r["gradients"]), g(r["optimizer"]), g(r["activations"]), g(r["peak"]), g(r["analytic"]),
              f"{(r['analytic'] - r['peak']) / r['peak']:+.0%}", g(r["host"]), "yes" if r["fits"] else "NO",
              _longest(r), r.get("fix", "")] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    for line in [head, *table]:
        print("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(line, widths))))


def main(argv: list[str]) -> list[dict]:
    return execute(parse_plan(argv))


def execute(parsed: tuple) -> list[dict]:
    """The command on parse_plan's (PlanConfig, Hardware, training Config)."""
    pc, hw, cfg = parsed
    world = pc.gpus_per_node * pc.nodes
    plans = validate(cfg, world, "cuda", assume_gpu=True, check_data=False)
    rows = [plan_stage(cfg, p, hw, world, pc) for p in plans.values()]
    vocab = vocabulary(cfg)
    print_plan(rows, hw, world, cfg.recipe.name, vocab)
    if pc.out:
        os.makedirs(os.path.dirname(pc.out) or ".", exist_ok=True)
        with open(pc.out, "w") as fh:
            json.dump({"recipe": cfg.recipe.name, "hardware": dataclasses.asdict(hw), "world": world,
                       "vocabulary": vocab,
                       "estimate": "traced, not measured on a GPU", "stages": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    run("longstride plan", main)
