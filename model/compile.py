"""torch.compile of a training step's decoder layers (train.compile), part by part.

Each decoder layer's parts (its attention block, its MLP, its norms: the layer's child modules) is compiled on its
own with `module.compile()`, which keeps parameter names and checkpoints plain transformers. Inductor fuses what runs
around the matmuls: norms, RoPE, the MLP's activation and gating, and the backward's elementwise ops.

Why the parts and not the whole layer (torchtitan compiles whole blocks): longstride's attention stays out of every
graph (parallel/attention.py registers it with torch.compiler.disable: its Python picks the kernel, the ring's or
Ulysses' collectives and the document layout per call, which a graph would freeze), so dynamo splits the attention
block around it. Transformers' activation checkpointing wraps a layer's whole forward, and a checkpointed region
compiles only whole: with attention outside, dynamo would give up on the layer and run it eagerly. The parts run
inside the checkpoint instead, compiled, and backward's recompute runs the same compiled graphs.

Selective activation checkpointing is refused with compile: its policy (model/selective.py) keeps the matmuls'
outputs by watching each op, and inside a compiled graph it sees only the graph's matmul calls, writing into the
graph's own buffers, so it would recompute them all: full checkpointing's cost with more kept.
"""
from __future__ import annotations

import torch

from longstride.model.loss import decoder_layers


def check_compile(compile_: bool, checkpointing: str, field: str = "model.checkpoint_mode") -> None:
    """Compile and the checkpointing mode `checkpointing` (none | full | selective) together, or the reason not."""
    if compile_ and checkpointing == "selective":
        raise ValueError(f"train.compile=true with {field}=selective: selective checkpointing keeps the matmuls' "
                         "outputs by watching each op, which compiled graphs hide from it, so it would recompute "
                         f"them all (model/compile.py). Set {field}=full (recompute each layer, compiled), or "
                         "train.compile=false")


def compile_layers(lm: torch.nn.Module, checkpointing: str = "none") -> int:
    """Compiles each decoder layer's child modules in place (see the module docstring); returns how many. The
    compilation itself happens in the first forward, and again for the first forward without gradients."""
    check_compile(True, checkpointing)
    parts = [child for layer in decoder_layers(lm) for child in layer.children()]
    for part in parts:
        part.compile()
    return len(parts)


def fresh_start() -> None:
    """Dynamo's in-process caches and counters cleared (Inductor's disk cache stays): a stage's model and shapes are
    new, and the previous stage's graphs would only count towards dynamo's recompile limit (8 a function: past it,
    a function runs eagerly, which three micro stages in one process reached)."""
    torch.compiler.reset()
    _counters().clear()


def _counters():
    from torch._dynamo.utils import counters  # dynamo's own tally (no public form); compile_status reads it

    return counters


def compile_status() -> tuple[int, int, list[str]]:
    """Since fresh_start: (graphs dynamo compiled, frames it gave up on and ran eagerly, why: the first line of each
    reason it recorded)."""
    c = _counters()
    eager = c["frames"]["total"] - c["frames"]["ok"]
    return int(c["stats"]["unique_graphs"]), int(eager), sorted({r.split("\n")[0] for r in c["unimplemented"]})


def report_compiled(tracker, metrics: dict) -> bool:
    """After a compiled stage's first step (`metrics`: its metrics, with its tokens_per_s), logs how many graphs this
    process compiled for the stage and what the step cost; warns when none were, or when dynamo ran some of the
    parts eagerly (a recompile limit, an unsupported op). Returns True."""
    graphs, eager, why = compile_status()
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
    return True
