"""`longstride check`'s options (CheckConfig, parsed here without torch, so that --help and a typo answer at once)
and the Job they resolve to: every check of the command's input, made before any data is read or model built
(recipes/check/command.py runs the job)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from longstride.model.model_dir import check_checkpoint_dir, has_tokenizer
from longstride.overrides import module_doc, parse_own
from longstride.parallel.config import CPDegrees
from longstride.recipes.config.compose import compose_training


@dataclass
class CheckConfig:
    checkpoint: str = ""  # an HF model dir: model=checkpoint model.checkpoint=DIR (and its tokenizer, if it has one)
    cp: int = 0  # CP degree checked; 0 = the stage's cp (2 where the stage runs without CP)
    seq_len: int = 0  # tokens per packed sequence; 0 = the stage's (eager is L x L per document: shorten long stages)
    rows: int = 0  # packed sequences in the batch; 0 = the stage's micro_batch_size
    tolerance: float = 1e-4  # worst relative error allowed (fp32)
    eager: bool = True  # also check the one-device run against the model's own eager attention
    allow_unexercised: bool = False  # run although the batch tests no document mask / window / chunk it has
    overrides: list = field(default_factory=list)  # training overrides (recipe=, stage=, model.*, data.*, parallel.*)


def parse_args(argv: list[str]):
    """(CheckConfig, the composed training Config) from key=value arguments."""
    doc = module_doc("longstride.recipes.check.command").split("\n\nTest hook")[0]  # --help: not the hook
    cc = parse_own(CheckConfig, argv, "longstride check", doc)
    overrides = list(cc.overrides)
    if cc.checkpoint:
        check_checkpoint_dir(cc.checkpoint, "checkpoint")
        overrides = ["model=checkpoint", f"model.checkpoint={cc.checkpoint}", *overrides]
        given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
        if "data.tokenizer" not in given and has_tokenizer(cc.checkpoint):
            overrides.append(f"data.tokenizer={cc.checkpoint}")
    return cc, compose_training(overrides, "longstride check")


@dataclass(frozen=True)
class Job:
    """Everything a process of the check needs, resolved and validated (picklable: the gloo processes get it)."""

    cfg: object  # recipes.config.schema.Config
    stage: str
    seq_len: int
    rows: int
    cp: int
    degrees: CPDegrees
    kernel: str  # one device
    cp_kernel: str
    balance: str
    tolerance: float
    eager: bool
    device_type: str
    vocab: int = 0  # the tokenizer's size, eos and pad ids (a from-scratch model is sized by them)
    eos: int = 0
    pad: int = 0
    unexercised: tuple = ()  # what the model computes that the batch does not test (inputs.unexercised)
    allow_unexercised: bool = False

    @property
    def what_cp(self) -> str:
        return f"{self.cfg.parallel.cp_impl} cp={self.cp}"


def prepare(cc: CheckConfig, cfg, world: int) -> Job:
    """Every check of the command's input, before any data is read or model built. world: the processes a
    launcher started (1: none, the CP ranks are local gloo processes)."""
    from longstride.parallel.cp import cp_degrees
    from longstride.parallel.kernels import FLASH_KERNELS, resolve_kernel
    from longstride.recipes.config.plan import check_model_and_data
    from longstride.recipes.config.schema import selected_stages
    from longstride.recipes.train import use_cpu

    names = list(cfg.recipe.stages)
    if not names:
        raise ValueError(f"recipe {cfg.recipe.name!r} lists no stages; add recipe.stages.<name> entries")
    selected_stages(cfg)  # an unknown stage= fails naming the stages
    name = cfg.stage or names[-1]
    s = cfg.recipe.stages[name]
    seq_len, where = (cc.seq_len, "seq_len") if cc.seq_len else (s.seq_len, f"recipe.stages.{name}.seq_len")
    shape = check_model_and_data(cfg, split_longest=seq_len)  # the check splits seq_len tokens over its cp ranks
    cp = cc.cp or (s.cp if s.cp > 1 else 2)
    if cp < 2:
        raise ValueError(f"cp={cp}: the check compares a run over cp >= 2 ranks with one device; give cp=2 or more")
    degrees = cp_degrees(cfg.parallel, cp, shape.heads, where="cp")
    unit = degrees.seq_len_unit
    if seq_len < unit or seq_len % unit:
        near = sorted({max(unit, seq_len // unit * unit), (seq_len // unit + 1) * unit})
        raise ValueError(f"{where}={seq_len}: {cfg.parallel.cp_impl} cp={cp} (ring {degrees.ring} x ulysses "
                         f"{degrees.ulysses}) cuts each sequence into pieces of a multiple of {unit} tokens; give "
                         f"seq_len= a multiple of {unit}, e.g. {' or '.join(map(str, near))}")
    rows = cc.rows or s.micro_batch_size
    if rows < 1:
        raise ValueError(f"rows={rows} must be >= 1 (0 = the stage's micro_batch_size)")
    if not (math.isfinite(cc.tolerance) and cc.tolerance > 0):
        raise ValueError(f"tolerance={cc.tolerance} must be a positive number, e.g. 1e-4")
    if world > 1 and world != cp:
        raise ValueError(f"cp={cp} but the launcher started {world} processes; launch {cp} (torchrun "
                         f"--nproc-per-node {cp}) or set cp={world}")
    device_type = "cuda" if world > 1 and not use_cpu() else "cpu"
    kernel = str(cfg.parallel.kernel)
    if kernel in FLASH_KERNELS:
        raise ValueError(f"parallel.kernel={kernel}: longstride check compares in fp32 and the flash kernels take only "
                         "bf16/fp16; check with parallel.kernel=auto or math (tests/gpu/test_kernels_gpu.py holds "
                         f"{kernel} to the fp32 kernels on a GPU)")
    return Job(cfg, name, seq_len, rows=rows, cp=cp, degrees=degrees,
               kernel=resolve_kernel(kernel, device_type, ring=False, half=False, softcap=shape.softcap),
               cp_kernel=resolve_kernel(kernel, device_type, ring=True, half=False, softcap=shape.softcap),
               balance=str(s.balance if s.balance is not None else cfg.parallel.balance),
               tolerance=cc.tolerance, eager=cc.eager, device_type=device_type,
               allow_unexercised=cc.allow_unexercised)
