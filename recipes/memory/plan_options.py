"""`longstride plan`'s command line: its options and the named GPU (configs/hardware/<name>.yaml), parsed and
checked without torch, so that --help and a typo answer at once (recipes/memory/memplan.py plans)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from longstride.overrides import module_doc, parse_own, writable_dir
from longstride.recipes.config.compose import CONFIGS, compose_training


@dataclass
class Hardware:
    name: str = "???"
    memory_gib: float = 0.0  # the GPU's memory as nvidia-smi reports it
    reserve_gib: float = 3.0  # CUDA context (~0.5), cuBLAS workspace, NCCL communicators and buffers
    fragmentation: float = 0.05  # share of the rest the caching allocator's blocks leave unusable

    @property
    def usable_gib(self) -> float:
        return (self.memory_gib - self.reserve_gib) * (1 - self.fragmentation)


@dataclass
class PlanConfig:
    hardware: str = "h100_80g"  # a file of configs/hardware/ without .yaml
    gpus_per_node: int = 8
    nodes: int = 1
    search: bool = True  # the longest seq_len that fits each stage, with its settings
    docs: int = 4  # documents per traced sequence (the ring plan's blocks follow them)
    out: str = ""  # also write the plan as JSON here
    overrides: list = field(default_factory=list)  # training overrides (recipe=..., model.*, ...), as given


def hardware(name: str) -> Hardware:
    folder = os.path.join(CONFIGS, "hardware")
    known = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
    if name not in known:
        raise ValueError(f"hardware={name!r} is unknown; known: {', '.join(known)} (configs/hardware/)")
    merged = OmegaConf.merge(OmegaConf.structured(Hardware), OmegaConf.load(os.path.join(folder, f"{name}.yaml")))
    return OmegaConf.to_object(merged)


def parse_plan(argv: list[str]) -> tuple:
    """-> (PlanConfig, its Hardware, the composed training Config): plan's own keys from argv; the rest are
    training overrides (kept in PlanConfig.overrides as given)."""
    pc = parse_own(PlanConfig, argv, "longstride plan", module_doc("longstride.recipes.memory.memplan"))
    hw = hardware(pc.hardware)
    if pc.gpus_per_node < 1 or pc.nodes < 1:
        raise ValueError(f"gpus_per_node={pc.gpus_per_node} and nodes={pc.nodes} must be >= 1")
    if pc.out and os.path.isdir(pc.out):
        raise ValueError(f"out={pc.out!r} is a folder; give the JSON file to write, e.g. out=plan.json")
    if pc.out:
        writable_dir(os.path.dirname(pc.out) or ".", shown=pc.out)
    return pc, hw, compose_training(pc.overrides, "longstride plan")
