"""`longstride eval ruler`: RULER on any local HF causal-LM checkpoint, with YaRN from the command line.

    longstride eval ruler checkpoint=outputs/tiny/s3_4k/final lengths=[1024,2048,4096] num_samples=4
    longstride eval ruler checkpoint=DIR lengths=[16384] tasks=[niah_single_1,vt] yarn.factor=2
    torchrun --nproc-per-node 2 -m longstride.eval.ruler checkpoint=DIR ...   # samples split over processes
    torchrun --nproc-per-node 2 -m longstride.eval.ruler checkpoint=DIR prefill=cp ...  # each prefill split

Writes <out>/ruler[_yarnF][_DTYPE].{json,csv} and plots (_DTYPE when dtype= is not float32; default out:
outputs/eval/<checkpoint path>, see eval/cli.py; never inside the checkpoint unless out= says so). A QA task
without its file, a length past the model's positions and a length too short for a task are reported and skipped;
the rest still runs. A name that is no task, like any other bad option, is refused before anything loads.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict
from datetime import timedelta
from typing import Optional

import torch

from longstride.eval.cli import RulerConfig, default_out, parse_ruler, results_stem
from longstride.eval.load import DTYPES, applied_rope, eval_config, eval_tokenizer, load_eval_model
from longstride.eval.ruler.cp_prefill import cp_prefill, world_cp
from longstride.eval.ruler.fit import DoesNotFit, chat_template_note, make_sample
from longstride.eval.ruler.generate import greedy_generate, greedy_generate_cached
from longstride.eval.ruler.notes import note
from longstride.eval.ruler.report import format_table, log_wandb, plot, write_files
from longstride.eval.ruler.score import sample_score, summarize
from longstride.eval.ruler.tasks import ALL_TASKS, load_qa
from longstride.eval.ruler.words import prose_words
from longstride.parallel.attention import position_dependent
from longstride.parallel.collectives import together
from longstride.model.rope import has_rope, max_positions, yarn_unit
from longstride.parallel.cp import CPContext


def runnable_tasks(cfg: RulerConfig) -> tuple[list[str], dict, list[str]]:
    """The tasks that can run, their QA data, and a message per task skipped (a QA task without its dev file;
    a name that is no task was refused with the options, eval/cli.check_generation)."""
    tasks, qa, skipped = [], {}, []
    for name in dict.fromkeys(cfg.tasks):
        kind = ALL_TASKS[name].params.get("dataset")
        if kind:
            path = getattr(cfg.qa, kind)
            if not path:
                skipped.append(f"{name} skipped: it needs a local {kind} dev file (qa.{kind}=PATH)")
                continue
            qa[name] = load_qa(kind, path)
        tasks.append(name)
    return tasks, qa, skipped


def reachable_lengths(cfg: RulerConfig, max_positions: int, unit: int,
                      rope: bool = True) -> tuple[list[int], list[str]]:
    """The lengths within the model's positions, and a note for each other one; `unit`: what yarn.factor
    multiplies (model/rope.yarn_unit); `rope`: False for a model without rope_parameters (no YaRN hint)."""
    ok, skipped = [], []
    for L in sorted(dict.fromkeys(cfg.lengths)):
        if L > max_positions and not cfg.extrapolate:
            hint = ""
            if rope:
                factor = f"a larger yarn.factor (now {cfg.yarn.factor:g})" if cfg.yarn.factor else \
                    f"yarn.factor={math.ceil(L / unit)}"
                hint = f"add {factor} (YaRN), or "
            skipped.append(f"length {L} skipped: the model's max positions are {max_positions}; {hint}"
                           "extrapolate=true to measure it without")
        else:
            ok.append(L)
    return ok, skipped


EVAL_GATHER_TIMEOUT_S = 6 * 3600


def launched_ranks():
    """(rank, world) when launched with several processes (torchrun / accelerate launch), the process group started
    (each rank on its own GPU); (0, 1) in one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        if torch.cuda.is_available():  # each rank its own GPU (eval_device() reads the current one), before NCCL
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # with prefill=local the ranks meet only after scoring their shares, which may differ by minutes of
        # decoding: not NCCL's default 10 minutes, which stopped a rank far ahead; a rank that dies ends the launch
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                             timeout=timedelta(seconds=EVAL_GATHER_TIMEOUT_S))
    return (torch.distributed.get_rank(), world) if world > 1 else (0, 1)


def make_groups(cfg: RulerConfig, tasks: list[str], lengths: list[int], tok, share, qa: dict,
                skipped: list[str], max_positions: Optional[int] = None) -> list[tuple]:
    """(task, length, samples) for every task and length that fits; the indices in `share` only. A task
    too long for a length is noted in `skipped` (with what reaching its shortest length takes where that is past
    the model's `max_positions`)."""
    groups = []
    if said := chat_template_note(tok, cfg.chat):
        note(said)
    for name in tasks:
        for L in lengths:
            try:
                mine = []
                for i in share:  # a sample's haystack size is the next one's guess (the same size, found sooner)
                    mine.append(make_sample(ALL_TASKS[name], L, i, tok, seed=cfg.seed, chat=cfg.chat,
                                            haystack=cfg.haystack, qa=qa.get(name),
                                            guess=mine[-1].units if mine else None))
            except DoesNotFit as e:
                skipped.append(str(e) + _past_positions(e.needed, max_positions, cfg))
                note(skipped[-1])
                continue
            groups.append((name, L, mine))
    return groups


def _past_positions(needed: int, max_positions: Optional[int], cfg: RulerConfig) -> str:
    """What a length of `needed` tokens takes when it is past the model's positions ("" when it is not)."""
    if max_positions is None or needed <= max_positions or cfg.extrapolate:
        return ""
    return (f", past the model's max positions ({max_positions}): leave the task out, or reach that length with "
            "a larger yarn.factor (YaRN) or extrapolate=true")


def common_groups(groups: list[tuple], skipped: list[str], world: int) -> list[tuple]:
    """The (task, length) groups every rank kept, with every rank's skip messages in `skipped` (in place). A
    task's fixed parts differ from sample to sample, so a sample that does not fit on one rank drops the task at
    that length on every rank, as it does in one process, instead of scoring it on the other ranks' share."""
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, ([(name, L) for name, L, _ in groups], list(skipped)))
    kept = set.intersection(*(set(keys) for keys, _ in gathered))
    skipped[:] = list(dict.fromkeys(msg for _, msgs in gathered for msg in msgs))
    return [g for g in groups if (g[0], g[1]) in kept]


def score_group(model, tok, samples: list, cfg: RulerConfig, cp: Optional[CPContext] = None) -> list[dict]:
    """One record per sample of one task and length: the greedy answer and its score. cp: every prompt's
    prefill split over the processes (prefill=cp)."""
    if not samples:  # a rank whose share of the samples is empty (num_samples below the processes)
        return []
    budget = samples[0].max_new_tokens
    if cp is not None:
        preds = [greedy_generate_cached(model, tok, s.prompt_ids, cp_prefill(model, s.prompt_ids, cp), budget)
                 for s in samples]
    else:
        preds = greedy_generate(model, tok, [s.prompt_ids for s in samples], max_new_tokens=budget,
                                batch_size=cfg.batch_size, prefill_chunk=cfg.prefill_chunk,
                                batch_tokens=cfg.batch_tokens,
                                references=[s.answers for s in samples] if cfg.stop_when_scored else None,
                                metric=samples[0].metric, draft=cfg.draft)
    return [{"task": s.task, "length": s.length, "index": s.index, "depth": s.depth, "units": s.units,
             "prompt_tokens": len(s.prompt_ids), "answers": s.answers, "prediction": pred,
             "score": sample_score(pred, s.answers, s.metric)} for s, pred in zip(samples, preds)]


def main(argv: list[str]) -> Optional[dict]:
    return execute(parse_ruler(argv))


def execute(cfg: RulerConfig) -> Optional[dict]:
    """The command on parsed options (eval/cli.parse_ruler)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tasks, qa, skipped = runnable_tasks(cfg)
    if cfg.haystack is not None or any(ALL_TASKS[t].params.get("haystack") == "essay" for t in tasks):
        prose_words(cfg.haystack)  # a bad haystack source fails here, before any model is loaded
    config, original = eval_config(cfg.checkpoint, cfg.yarn, cfg.rope_layer_types)
    lengths, too_long = reachable_lengths(cfg, max_positions(config), yarn_unit(config, original), has_rope(config))
    skipped += too_long
    for msg in skipped:
        note(msg)
    if not tasks or not lengths:
        raise ValueError("nothing to run: " + ("no runnable task" if not tasks else "no reachable length")
                         + " (see the messages above)")
    owned = not torch.distributed.is_initialized()  # a group launched_ranks makes is ours to close
    rank, world = launched_ranks()
    cp = cfg.prefill == "cp"
    share = range(cfg.num_samples) if cp else range(rank, cfg.num_samples, world)  # cp: every rank, every sample
    if cp and world > 1:  # each prompt split over the ranks: what reads positions from a rank's own tokens is refused
        found = position_dependent(config.get_text_config(decoder=True), max(lengths))
        if found:
            raise ValueError(f"prefill=cp: {'; '.join(found)}; use prefill=local (samples split over the processes)")

    def elsewhere() -> RuntimeError:  # a process failing on its part ends every process there, not at their next
        # gather (hours later, unless the launcher ends them)
        return RuntimeError(f"eval.ruler: another process failed on {cfg.checkpoint} (its log says why)")

    def made():  # the samples first: what fits no length fails before the weights load
        tok = eval_tokenizer(cfg.checkpoint)
        return tok, make_groups(cfg, tasks, lengths, tok=tok, share=share, qa=qa, skipped=skipped,
                                max_positions=max_positions(config))

    tok, groups = together(made, elsewhere)
    if world > 1 and not cp:
        groups = common_groups(groups, skipped, world)
    if not groups:
        raise ValueError(f"nothing to run: no task fits any of lengths {lengths} (see the messages above); give "
                         "longer lengths")
    model, tok, info = together(lambda: load_eval_model(cfg.checkpoint, cfg.yarn, cfg.rope_layer_types,
                                                        dtype=DTYPES[cfg.dtype], tokenizer=tok), elsewhere)
    limit = info.position_limit  # a learned table of positions: past it an index error, not extrapolation
    for L in sorted({L for _, L, _ in groups if limit and L > limit}):
        skipped.append(f"length {L} skipped: {type(model).__name__} learns a table of {limit} positions and cannot "
                       "take longer inputs")
        note(skipped[-1])
    groups = [g for g in groups if not (limit and g[1] > limit)]
    if not groups:
        raise ValueError(f"nothing to run: no length within the model's {limit} learned positions")
    cp_ctx = world_cp(info.device.type) if cp else None

    def scored() -> list[dict]:  # (prefill=cp: one failing inside a prompt's collectives leaves the others there)
        records = []
        for name, L, samples in groups:
            part = score_group(model, tok, samples, cfg, cp_ctx)
            records += part
            if rank == 0:
                print(f"{name:<16} {L:>7}  {100 * sum(r['score'] for r in part) / max(len(part), 1):6.1f}  "
                      f"({len(part)} samples on rank 0)", flush=True)
        return records

    records = together(scored, elsewhere)
    if world > 1 and not cp:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, records)
        records = sorted((r for part in gathered for r in part), key=lambda r: (r["task"], r["length"], r["index"]))
    result = together(lambda: _report(cfg, records, skipped, applied_rope(config)), main_only=True,
                      elsewhere=lambda: RuntimeError("eval.ruler: rank 0 could not write the results (its log says "
                                                     "why)"))
    if world > 1:  # every rank leaves together: a rank exiting while another still ran once made gloo abort
        torch.distributed.barrier()
        if owned:
            torch.distributed.destroy_process_group()
    return result


def _report(cfg: RulerConfig, records: list[dict], skipped: list[str], rope: dict) -> dict:
    """The table, the files, the plots and wandb, from every rank's records (rank 0); `rope`: the RoPE the model
    ran with (eval/load.applied_rope), recorded beside the options."""
    summary = summarize(records, cfg.threshold)
    print(format_table(summary))
    out = cfg.out or default_out(cfg.checkpoint)
    stem = results_stem("ruler", cfg.yarn.factor, cfg.dtype)
    name = "/".join(os.path.normpath(os.path.abspath(cfg.checkpoint)).split(os.sep)[-2:])  # e.g. s3_4k/final
    title = name + (f" + YaRN x{cfg.yarn.factor:g}" if cfg.yarn.factor else "")
    config = {**asdict(cfg), "applied_rope": rope}
    write_files(out, stem, config, summary, records, skipped)
    images = []
    try:
        images = plot(out, stem, summary, records, title)
    except ImportError:
        note("matplotlib not installed; skipping the plots (pip install 'longstride[eval]')")
    if cfg.wandb != "disabled":
        log_wandb(cfg.wandb, cfg.wandb_project, f"ruler-{title}", config=config, summary=summary,
                  images=images, out=out)
    print(f"eval.ruler: results in {out}/{stem}.json")
    return {"summary": summary, "records": records, "skipped": skipped}
