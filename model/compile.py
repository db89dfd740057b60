"""torch.compile of a training step's decoder layers (train.compile), part by part, and of its loss's tile.

Each decoder layer's parts (its attention block, its MLP, its norms: the layer's child modules) is compiled on its
own with `module.compile()`, which keeps parameter names and checkpoints plain transformers. Inductor fuses what runs
around the matmuls: norms, RoPE, the MLP's activation and gating, and the backward's elementwise ops.

Why the parts and not the whole layer (torchtitan compiles whole blocks): longstride's attention stays out of every
graph (parallel/attention.py registers it with torch.compiler.disable: its Python picks the kernel, the ring's or
Ulysses' collectives and the document layout per call, which a graph would freeze), so dynamo splits the attention
block around it. Transformers' activation checkpointing wraps a layer's whole forward, and a checkpointed region
compiles only whole: with attention outside, dynamo would give up on the layer and run it eagerly. The parts run
inside the checkpoint instead, compiled, and backward's recompute runs the same compiled graphs. A tiled part
(model/tiling.py) is not compiled as a module: its tiles' autograd Function stays outside the graphs, and each
tile's function compiles instead (compile_tile).

Selective activation checkpointing is refused with compile: its policy (model/selective.py) keeps the matmuls'
outputs by watching each op, and inside a compiled graph it sees only the graph's matmul calls, writing into the
graph's own buffers, so it would recompute them all: full checkpointing's cost with more kept.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from longstride.model.loss import decoder_layers, tile_loss_sum
from longstride.model.tiling import runs_tiled


def check_compile(compile_: bool, checkpointing: str, field: str = "model.checkpoint_mode") -> None:
    """Compile and the checkpointing mode `checkpointing` (none | full | selective) together, or the reason not."""
    if compile_ and checkpointing == "selective":
        raise NotImplementedError(f"train.compile=true with {field}=selective: selective checkpointing keeps the "
                                  "matmuls' outputs by watching each op, which compiled graphs hide from it, so it "
                                  f"would recompute them all (model/compile.py). Set {field}=full (recompute each "
                                  "layer, compiled), or train.compile=false")


def compile_tile(fn):
    """A tiled part's per-tile function (model/tiling.py: a norm and the projections after it, or the MLP) through
    torch.compile: tiling's own autograd Function stays outside the graphs (its backward calls autograd.grad), and
    the tile it runs in forward and recomputes in backward is one compiled graph. One Python function serves every
    tiled part, so its graphs are one per part kind (the MLP, q, k/v) and gradient mode, and the shorter last tile
    recompiles once with its length symbolic (dynamo's automatic dynamic shapes; the widths stay static): 11 graphs on
    an 8-layer SmolLM3 with tiles, past dynamo's default limit of 8 (fresh_start raises it)."""
    return torch.compile(fn)


def compiled_loss_tile():
    """The chunked loss's tile (model/loss.tile_loss_sum: the output head's logits and their cross-entropy sum)
    through torch.compile: the logits' cast to fp32, the log-sum-exp and, in backward's recompute, the softmax
    gradient fuse around the head's matmul (torchtitan compiles its loss too)."""
    return torch.compile(tile_loss_sum)


def compile_layers(lm: torch.nn.Module, checkpointing: str = "none") -> int:
    """Compiles each decoder layer's child modules in place (see the module docstring), but those that run tiled
    (their tiles are compiled instead: compile_tile); returns how many. The compilation itself happens in the first
    forward, and again for the first forward without gradients."""
    check_compile(True, checkpointing)
    parts = [child for layer in decoder_layers(lm) for child in layer.children() if not runs_tiled(child)]
    for part in parts:
        part.compile()
    return len(parts)


# Graphs a compiled function may hold before dynamo runs it eagerly (its default: 8). The parts of every layer share a
# few Python functions (a layer class's forward, a norm's, the tiles' function), each taking one graph per layer kind
# (RoPE or NoPE, the tiled MLP or a q or k/v projection) and per gradient mode (training, the tiles' forward and the
# validation run without gradients): past 8 with tiles on (measured: 11 on 8 layers), whatever the number of layers.
RECOMPILE_LIMIT = 64


def fresh_start() -> None:
    """Dynamo's in-process caches and counters cleared (Inductor's disk cache stays), its recompile limit raised to
    RECOMPILE_LIMIT: a stage's model and shapes are new, and the previous stage's graphs would only count towards the
    limit (three micro stages in one process reached the default 8, where a function runs eagerly)."""
    torch.compiler.reset()
    _counters().clear()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def _counters():
    from torch._dynamo.utils import counters  # dynamo's own tally (no public form); compile_status reads it

    return counters


# The graph breaks train.compile makes on purpose: at longstride's attention and at tiled parts (model/tiling.py)
_OWN_BREAK = "Skip calling `torch.compiler.disable()`d function"


class CompileStatus(NamedTuple):
    """Since fresh_start: graphs dynamo compiled, frames it gave up on and ran eagerly, why (the first line of each
    reason it recorded), graph breaks other than the ones compile makes on purpose."""

    graphs: int
    eager_frames: int
    eager_why: list
    other_breaks: int


def compile_status() -> CompileStatus:
    c = _counters()
    other = sum(n for reason, n in c["graph_break"].items() if not reason.startswith(_OWN_BREAK))
    return CompileStatus(int(c["stats"]["unique_graphs"]), int(c["frames"]["total"] - c["frames"]["ok"]),
                         sorted({r.split("\n")[0] for r in c["unimplemented"]}), int(other))


def report_compiled(tracker, metrics: dict) -> None:
    """After a compiled stage's first step (`metrics`: its metrics, with its tokens_per_s), logs how many graphs this
    process compiled for the stage and what the step cost; warns when none were, or when dynamo ran some of the
    parts eagerly (a recompile limit, an unsupported op), or broke their graphs where compile does not (an op it
    cannot trace in the model's own code: those parts are compiled in pieces)."""
    graphs, eager, why, other = compile_status()
    if not graphs:
        tracker.warning("train.compile=true compiled no graph in the first step: the layers' parts ran eagerly "
                        "(torch.compile fell back without an error); the run goes on uncompiled")
    elif eager:
        tracker.warning(f"torch.compile: {graphs} graphs compiled for this stage, and {eager} of the parts' functions "
                        f"ran eagerly ({'; '.join(why) or 'no reason recorded'}); TORCH_LOGS=recompiles,graph_breaks "
                        "says where")
    else:
        tracker.info(f"torch.compile: {graphs} graphs compiled for this stage (the first step ran at "
                     f"{metrics['tokens_per_s']:.0f} tokens/s, compiling included)")
        if other:
            tracker.warning(f"torch.compile: {other} graph breaks in the layers' parts beyond longstride's own (at "
                            "attention and at tiles): those parts are compiled in pieces; TORCH_LOGS=graph_breaks "
                            "says where")
