"""`longstride check`: is longstride's attention exact for this model, on this data, under this CP layout?

    longstride check recipe=tiny seq_len=1024                    # the recipe's last stage, ring over its cp ranks
    longstride check checkpoint=DIR seq_len=1024 cp=2 parallel.cp_impl=ulysses [any training override]
    longstride check recipe=extend_pretrained model.checkpoint=DIR data.tokenizer=DIR stage=x4 seq_len=512
    torchrun --nproc-per-node 4 -m longstride.recipes.check checkpoint=DIR cp=4   # one rank per GPU, NCCL

One packed batch of the stage's own data (its tokenizer, mixture and packing: the first micro-batch its loader
gives, with document ids) runs one forward and backward three ways, all in fp32:
  eager     the model's own eager attention, each document alone in its sequence (skipped with eager=false)
  1 device  longstride's attention on one process with document masks, parallel.kernel's fp32 kernel (auto: sdpa)
  CP        longstride's attention under parallel.cp_impl over cp ranks (auto: sdpa on CPU, math on CUDA): without
            a launcher, cp local gloo processes on the CPU; under torchrun / accelerate launch, the launched
            processes (NCCL on GPUs)
The bf16 flash kernels that GPU training takes are not run here (a flash parallel.kernel is refused):
tests/gpu/test_kernels_gpu.py holds them to these fp32 kernels on a GPU.
A batch that would not test the model's document masks (no row holds two documents) or one of its windows or
chunks (no document longer than it) is refused before any compute (allow_unexercised=true runs it anyway, and
the verdict names what went untested).
Compared: the logits, the loss, every decoder layer's output and every parameter's gradient; 1 device against
eager (the kernels), CP against 1 device (the CP method). The table gives the worst relative error
(max |a - b| / max |b| of a tensor, the worst tensor of the row) per layer type (config.layer_types) and for the
parameters outside the decoder layers ("other": embeddings, final norm, head). Exit status 0 within `tolerance`,
1 beyond it (naming the first layer whose output differs and the worst parameter), 2 on bad input, before any
compute. The model runs as transformers builds it, without the stage's memory savers (activation checkpointing,
MLP tiles: tests/test_cp_model.py checks those under CP); its loss is the chunked loss training computes.

Test hook (STYLE rule 16; recipes/run/faults.py keeps the training loop's): LONGSTRIDE_TEST_CHECK_FAULT=cp_drops_window
makes every CP method compute each layer without its sliding window while the one-device and eager runs keep it,
the mistake tests/test_check.py asserts this command catches. Read once, when a CP rank starts
(recipes/check/runs.inject_test_fault).

The command's modules: recipes/check/job.py (the options, validated into a Job before any compute),
recipes/check/inputs.py (the batch, the model, its layer types), recipes/check/runs.py (the three runs),
recipes/check/report.py (the comparisons and the table); this one parses, runs them and prints.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from longstride.overrides import run
from longstride.parallel.collectives import from_main, together
from longstride.recipes.check.inputs import stage_batch
from longstride.recipes.check.job import Job, parse_args, prepare
from longstride.recipes.check.report import Report, report
from longstride.recipes.check.runs import TEST_FAULT, cp_local, cp_run, references  # noqa: F401  (TEST_FAULT: the hook)


def check_local(job: Job) -> Report:
    """No launcher: the references in this process, the CP run on job.cp local gloo processes (CPU)."""
    batch, job = stage_batch(job)
    eager, one, lm = references(job, batch, torch.device("cpu"))
    cp = cp_local(job, batch)
    return show(report(job, batch, lm, eager=eager, one=one, cp=cp, where=f"{job.cp} local gloo processes"))


def check_launched(job: Job) -> Optional[Report]:
    """Under torchrun / accelerate launch: every rank runs the CP share; rank 0 reads the data (and sends the
    batch), then runs the references on its device, compares and prints. Returns the report on rank 0, None on
    the others; every rank learns the verdict."""
    cuda = job.device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=job.cfg.train.collective_timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
            torch.backends.cudnn.allow_tf32 = False
        batch, job = from_main(lambda: stage_batch(job))  # its failure (bad data, a file) raised on every rank
        cp = cp_run(rank, world, job, batch, device).cpu()

        def verdict() -> Report:
            if cuda:
                torch.cuda.empty_cache()
            eager, one, lm = references(job, batch, device)
            where = f"{world} launched processes ({dist.get_backend()})"
            return show(report(job, batch, lm, eager=eager, one=one, cp=cp, where=where))

        rep = together(verdict, lambda: RuntimeError("check: rank 0 failed computing the references (its log says "
                                                     "why)"), main_only=True)
        # every rank exits with rank 0's verdict, after rank 0 printed it (a launcher stops the rest at the first exit)
        if not from_main(lambda: rep.ok) and rep is None:
            rep = Report(False, "", [], ["see rank 0"])
        return rep
    finally:
        dist.destroy_process_group()


def show(rep: Report) -> Report:
    """The one place the check prints: the process holding the report (this one, or rank 0 of a launch)."""
    print(rep.table, flush=True)
    return rep


def check(argv: list[str]) -> Optional[Report]:
    """Parse, validate, run; the report (None on ranks other than 0 of a launched check that passed)."""
    return check_parsed(parse_args(argv))


def check_parsed(parsed: tuple) -> Optional[Report]:
    """check() on parse_args' (CheckConfig, training Config)."""
    cc, cfg = parsed
    world = int(os.environ.get("WORLD_SIZE", "1"))
    job = prepare(cc, cfg, world)
    return check_launched(job) if world > 1 else check_local(job)


def main(argv: list[str]) -> None:
    execute(parse_args(argv))


def execute(parsed: tuple) -> None:
    """The command on parse_args' output: exit 0 within tolerance, 1 beyond it; ValueError / NotImplementedError
    (bad input) exit 2."""
    try:
        rep = check_parsed(parsed)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    if rep is not None and not rep.ok:
        sys.exit(1)


if __name__ == "__main__":
    run("longstride check", main)
