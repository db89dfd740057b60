"""`longstride eval compare`: RULER on a base model and on each stage of its extension, on the same
samples, with YaRN at eval time on the last stage: one table (checkpoint x length, per task) and one plot.

    longstride eval compare run=outputs/tiny_extend          # the run's base model and every stage's final/
    longstride eval compare checkpoints=[BASE,STAGE1,STAGE2] lengths=[1024,2048,4096,8192] yarn=[2]
    torchrun --nproc-per-node 8 -m longstride.eval.ruler.compare run=outputs/RUN   # samples split over 8 GPUs

Every checkpoint is scored on the same samples (they are made once per tokenizer: checkpoints whose tokenizers
differ are scored on samples of the same seeds sized to each one's tokens, said in a note), lengths past a
checkpoint's trained length included (that is the point: the drop beyond it). Rows: each checkpoint
without YaRN at `lengths`, then the last one with each YaRN factor at `yarn_lengths`. Writes
<out>/compare.json (scores, sample counts, every prediction) and <out>/compare.png after each row, the rows
scored so far (`"complete": false` until the last). Launched on several processes, each loads every row's model
and scores sample i on rank i mod N: the same records and scores as one process (rank 0 writes them; a task
too long for a length is named by each rank from its own samples).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Iterator, Optional

import torch

from longstride.eval.cli import CompareConfig, compare_name, compare_out, compared_checkpoints, parse_compare
from longstride.eval.load import DTYPES, applied_rope, eval_config, eval_tokenizer, load_eval_model
from longstride.eval.ruler.notes import note
from longstride.eval.ruler.run import (common_groups, launched_ranks, make_groups, runnable_tasks,
                                       score_group)
from longstride.model.config import YarnConfig
from longstride.model.model_dir import TOKENIZER_FILES
from longstride.model.rope import YarnRefused, rope_base
from longstride.parallel.collectives import together

DEFAULT_YARN = [2.0, 4.0]  # yarn=null: these factors where the last checkpoint's RoPE takes YaRN


@dataclass
class Row:
    label: str
    checkpoint: str
    yarn: Optional[float]
    trained: int  # the checkpoint's max positions: the length its last stage trained at
    rope_theta: Optional[float]
    lengths: list
    sample_set: str = ""  # the digest (12 hex digits) of the tokenizer whose samples the row is scored on
    applied_rope: dict = field(default_factory=dict)  # the RoPE it ran with, YaRN applied (eval/load.applied_rope)


def tokenizer_digest(checkpoint: str) -> str:
    """What a checkpoint's prompts are made by: its tokenizer files and its chat template (transformers 5 saves it
    beside them), so checkpoints share prompts only when both agree."""
    h = hashlib.sha256()
    for name in (*TOKENIZER_FILES, "chat_template.jinja", "chat_template.json"):
        p = os.path.join(checkpoint, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def plan_rows(cfg: CompareConfig, named: list[tuple[str, str]]) -> list[Row]:
    rows = []
    for label, ckpt in named:
        config, trained = eval_config(ckpt)
        rows.append(Row(label, ckpt, None, trained, rope_base(config), [], applied_rope=applied_rope(config)))
    last = rows[-1].trained
    lengths = sorted(cfg.lengths) or [256] + [2 ** k for k in range(9, 40) if 2 ** k <= 2 * last and 2 ** k > 256]
    for r in rows:
        r.lengths = lengths
    yarn_lengths = sorted(cfg.yarn_lengths) or [2 * last, 4 * last]
    base = rows[-1]
    factors = DEFAULT_YARN if cfg.yarn is None else cfg.yarn
    stretched = {}
    try:  # a scaling YaRN may not stretch, or bad rope_layer_types: refused before any row is scored
        for f in factors:
            stretched[f] = applied_rope(eval_config(base.checkpoint, YarnConfig(factor=f), cfg.rope_layer_types)[0])
    except YarnRefused as e:
        if cfg.yarn is not None:
            fix = "yarn=[] compares without YaRN rows" + ("" if cfg.plain_rows else ", with plain_rows=true")
            raise ValueError(f"yarn={list(cfg.yarn)}: {base.checkpoint}: {e.why}; {fix}") from None
        if not cfg.plain_rows:
            raise ValueError(f"plain_rows=false leaves only the YaRN rows, and {base.checkpoint} takes none: "
                             f"{e.why}") from None
        note(f"no YaRN rows (the default yarn={DEFAULT_YARN} left out): {e.why}")
        factors = []
    rows = rows if cfg.plain_rows else []
    rows += [Row(f"{base.label} + YaRN x{f:g}", base.checkpoint, f, base.trained, base.rope_theta, yarn_lengths,
                 applied_rope=stretched[f]) for f in factors]
    return rows


def format_tables(rows: list[Row], scores: dict, counts: dict, tasks: list[str]) -> str:
    lengths = sorted({L for r in rows for L in r.lengths})
    names = [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths]
    width = max(len(r.label) for r in rows) + 2
    lines = []
    for task in tasks:
        n = sorted({counts[i].get(task, {}).get(L, 0) for i in range(len(rows)) for L in rows[i].lengths} - {0})
        lines.append(f"\n{task}: score (%), {'/'.join(map(str, n)) or 0} samples per cell; * = trained length")
        lines.append(f"{'checkpoint':<{width}} {'base':>7} " + " ".join(f"{x:>6}" for x in names))
        for i, r in enumerate(rows):
            cells = []
            for L in lengths:
                s = scores[i].get(task, {}).get(L)
                cells.append(f"{'-':>5} " if s is None else f"{s:5.0f}{'*' if L == r.trained else ' '}")
            theta = f"{r.rope_theta:.0e}".replace("e+0", "e") if r.rope_theta else "-"
            lines.append(f"{r.label:<{width}} {theta:>7} " + " ".join(cells))
    return "\n".join(lines)


def plot(path: str, rows: list[Row], scores: dict, tasks: list[str], title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        note(f"matplotlib not installed; no {os.path.basename(path)} (pip install 'longstride[eval]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), sharey=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    last_plain = max([i for i, r in enumerate(rows) if r.yarn is None], default=0)  # YaRN rows take its colour
    smallest_yarn = min([r.yarn for r in rows if r.yarn is not None], default=None)
    for ax, task in zip(axes[0], tasks):
        for i, r in enumerate(rows):
            color = colors[(i if r.yarn is None else last_plain) % len(colors)]
            xs = [L for L in r.lengths if L in scores[i].get(task, {})]
            style = "o-" if r.yarn is None else ("s--" if r.yarn == smallest_yarn else "^:")
            ax.plot(xs, [scores[i][task][L] for L in xs], style, color=color, label=r.label)
            if r.yarn is None:
                ax.axvline(r.trained, color=color, ls=":", alpha=0.6)
        ax.set_xscale("log", base=2)
        ticks = sorted({L for r in rows for L in r.lengths})
        ax.set_xticks(ticks, [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in ticks])
        ax.set_ylim(-3, 103)
        ax.set_xlabel("context length (tokens); dotted: each checkpoint's trained length")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("score (%)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class Scored:
    """Every row's scores: by row index, {task: {length: score (%)}} and {task: {length: samples}}, and every
    sample's record (with its row's label and YaRN factor)."""
    scores: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    records: list = field(default_factory=list)


def score_rows(cfg: CompareConfig, rows: list[Row], tasks: list[str], qa: dict, skipped: list[str],
               t0: float, out: Scored, rank: int = 0, world: int = 1) -> Iterator[int]:
    """Each row's checkpoint loaded in turn and scored into `out` on the samples of its tokenizer (made once per
    tokenizer, at every length of every row; a task too long for a length is noted in `skipped`); yields each
    row's index once it is scored. Launched on `world` processes, each scores its share of the samples (sample i
    on rank i mod world) and every rank ends a row with every rank's records."""
    all_lengths = sorted({L for r in rows for L in r.lengths})
    groups_by_tok: dict[str, dict] = {}  # tokenizer digest -> {"tok": tokenizer, "groups": {(task, length): samples}}
    digests = {c: tokenizer_digest(c) for c in {r.checkpoint for r in rows}}
    for i, r in enumerate(rows):
        digest = digests[r.checkpoint]
        r.sample_set = digest[:12]
        if digest not in groups_by_tok and groups_by_tok:
            note(f"{r.label}'s tokenizer (or chat template) differs from {rows[0].label}'s: its rows are scored on "
                 "their own samples (the same seeds and needles, haystacks sized to its tokens), not the same "
                 "prompts; compare.json names each row's 'sample_set'")
        elsewhere = partial(failed_elsewhere, r.label)
        if digest not in groups_by_tok:  # the samples before the weights: what fits no length fails first

            def samples():
                tok = eval_tokenizer(r.checkpoint)
                return tok, make_groups(cfg, tasks, all_lengths, tok=tok, share=range(rank, cfg.num_samples, world),
                                        qa=qa, skipped=skipped)

            tok, made = together(samples, elsewhere)
            if world > 1:
                made = common_groups(made, skipped, world)
            if not made:
                raise ValueError(f"nothing to run: no task fits any of lengths {all_lengths} in {r.checkpoint}'s "
                                 "tokenizer (see the messages above); give longer lengths")
            groups_by_tok[digest] = {"tok": tok, "groups": {(name, L): s for name, L, s in made}}
        tok, groups = groups_by_tok[digest]["tok"], groups_by_tok[digest]["groups"]

        def scored() -> list[dict]:  # this rank's share of the row, before the ranks meet
            model, _, _ = load_eval_model(r.checkpoint, YarnConfig(factor=r.yarn), cfg.rope_layer_types,
                                          dtype=DTYPES[cfg.dtype], tokenizer=tok)
            return [x for task in tasks for L in r.lengths if (task, L) in groups
                    for x in score_group(model, tok, groups[task, L], cfg)]

        records = together(scored, elsewhere)
        if world > 1:
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, records)
            records = sorted((x for part in gathered for x in part),
                             key=lambda x: (tasks.index(x["task"]), x["length"], x["index"]))  # one process's order
        out.scores[i], out.counts[i] = {}, {}
        for task in tasks:
            for L in r.lengths:
                part = [x for x in records if x["task"] == task and x["length"] == L]
                if part:
                    out.scores[i].setdefault(task, {})[L] = 100 * sum(x["score"] for x in part) / len(part)
                    out.counts[i].setdefault(task, {})[L] = len(part)
        out.records += [{**x, "checkpoint": r.label, "yarn": r.yarn} for x in records]
        if rank == 0:
            print(f"eval.compare: {r.label} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        yield i


def failed_elsewhere(label: str) -> RuntimeError:
    """What the other ranks raise when one failed making the samples for, loading or scoring checkpoint `label`,
    instead of waiting for it at the ranks' gather (the eval's timeout is hours: eval.ruler.run.launched_ranks)."""
    return RuntimeError(f"eval.compare: another process failed on {label} (its log says why)")


def save(out: str, result: dict, rows: list[Row], scores: dict, tasks: list[str], title: str) -> None:
    """<out>/compare.json (`result`) and <out>/compare.png (`scores`, as plot takes them)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(os.path.join(out, "compare.png"), rows, scores, tasks, title)


def main(argv: list[str]) -> Optional[dict]:
    return execute(parse_compare(argv))


def execute(cfg: CompareConfig) -> Optional[dict]:
    """The command on parsed options (eval/cli.parse_compare); what it saved on rank 0, None on the other ranks."""
    from transformers.utils import logging as hf_logging

    named = compared_checkpoints(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tasks, qa, skipped = runnable_tasks(cfg)
    for msg in skipped:
        note(msg)
    if not tasks:
        raise ValueError("nothing to run: no runnable task (see the messages above)")
    name = compare_name(cfg, named)
    rows = plan_rows(cfg, named)
    out = compare_out(cfg, named)
    hf_logging.set_verbosity_error()  # lengths past a checkpoint's positions are asked for on purpose: no warning
    hf_logging.disable_progress_bar()
    title = f"{name}: RULER score vs context length, {cfg.num_samples} samples per cell"
    owned = not torch.distributed.is_initialized()  # a group launched_ranks makes is ours to close
    rank, world = launched_ranks()
    t0, scored = time.perf_counter(), Scored()
    for i in score_rows(cfg, rows, tasks, qa, skipped, t0, scored, rank, world):

        def saved(done: list[Row]) -> dict:  # rank 0's, after every row: a run cut short keeps the rows it scored
            result = {"config": asdict(cfg), "seconds": time.perf_counter() - t0, "skipped": skipped,
                      "complete": len(done) == len(rows),
                      "rows": [{**asdict(r), "scores": scored.scores[j], "samples": scored.counts[j]}
                               for j, r in enumerate(done)],
                      "records": scored.records}
            save(out, result, done, scored.scores, tasks, title)
            return result

        result = together(lambda: saved(rows[:i + 1]), main_only=True,
                          elsewhere=lambda: RuntimeError(f"eval.compare: rank 0 could not write {out} (its log says "
                                                         "why)"))
    if world > 1:  # every rank leaves together (eval ruler's reason)
        torch.distributed.barrier()
        if owned:
            torch.distributed.destroy_process_group()
    if rank:
        return None
    print(format_tables(rows, scored.scores, scored.counts, tasks))
    print(f"eval.compare: {len(scored.records)} samples in {result['seconds']:.0f} s; results in {out}/compare.json "
          f"and compare.png")
    return result


if __name__ == "__main__":  # torchrun --nproc-per-node N -m longstride.eval.ruler.compare ... (samples split)
    from longstride.overrides import run

    run("eval.compare", main)
