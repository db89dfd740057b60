"""RULER results out: the printed tasks x lengths table, JSON and CSV files, plots, wandb.

Plots: score vs length per task (with the mean and the threshold), and for the niah_single tasks a
needle depth x length heatmap (mean score per depth bin and length).
"""
from __future__ import annotations

import csv
import json
import os
from typing import Optional

DEPTH_BINS = [0, 20, 40, 60, 80, 101]  # needle depth (%) bins of the heatmap


def format_table(summary: dict) -> str:
    lengths, table = summary["lengths"], summary["table"]
    names = [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths]
    width = max([len(t) for t in table] + [8])
    lines = [f"{'task':<{width}} " + " ".join(f"{n:>7}" for n in names)]
    for task, cells in table.items():
        lines.append(f"{task:<{width}} " + " ".join(f"{cells[L]:7.1f}" if L in cells else f"{'-':>7}" for L in lengths))
    if summary["mean"]:
        lines.append(f"{'mean':<{width}} " + " ".join(f"{summary['mean'][L]:7.1f}" for L in lengths))
        eff = summary["effective_length"]
        lines.append(f"wAvg(inc) {summary['wavg_inc']:.1f}  wAvg(dec) {summary['wavg_dec']:.1f}  effective length "
                     f"(mean >= {summary['threshold']:g} at every length up to it): {eff if eff else 'none'}")
    return "\n".join(lines)


def write_files(out: str, stem: str, config: dict, summary: dict, records: list[dict], skipped: list[str]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"config": config, "summary": summary, "skipped": skipped, "samples": records}, f, indent=1)
    with open(os.path.join(out, f"{stem}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", "length", "score", "samples"])
        for task, cells in summary["table"].items():
            for length, score in sorted(cells.items()):
                w.writerow([task, length, round(score, 2), sum(1 for r in records
                                                             if r["task"] == task and r["length"] == length)])


def single_needle(records: list[dict]) -> list[dict]:
    return [r for r in records if r["task"].startswith("niah_single") and r.get("depth") is not None]


def depth_grid(records: list[dict], lengths: list[int]) -> list[list[Optional[float]]]:
    """Mean score (percent) per depth bin (rows) and length (columns) over the niah_single samples (a multi-key
    or synth task's depth is one needle's among several)."""
    records = single_needle(records)
    grid = []
    for lo, hi in zip(DEPTH_BINS, DEPTH_BINS[1:]):
        row = []
        for L in lengths:
            hits = [r["score"] for r in records if r.get("depth") is not None and lo <= r["depth"] < hi
                    and r["length"] == L]
            row.append(100 * sum(hits) / len(hits) if hits else None)
        grid.append(row)
    return grid


def plot(out: str, stem: str, summary: dict, records: list[dict], title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths, paths = summary["lengths"], []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for task, cells in summary["table"].items():
        xs = [L for L in lengths if L in cells]
        ax.plot(xs, [cells[L] for L in xs], "o-", alpha=0.7, label=task)
    if summary["mean"]:
        ax.plot(lengths, [summary["mean"][L] for L in lengths], "k-", lw=2.5, label="mean")
    ax.axhline(summary["threshold"], color="grey", ls=":", label=f"threshold {summary['threshold']:g}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
    ax.set_ylim(-3, 103)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("score (%)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(os.path.join(out, f"{stem}_scores.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if single_needle(records):
        grid = np.array([[np.nan if v is None else v for v in row] for row in depth_grid(records, lengths)])
        fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 3.8))
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
        ax.set_yticks(range(len(DEPTH_BINS) - 1), [f"{lo}-{min(hi, 100)}%" for lo, hi in zip(DEPTH_BINS, DEPTH_BINS[1:])])
        ax.set_xlabel("context length")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{title}: niah_single score by depth", fontsize=9)
        fig.colorbar(im, ax=ax, label="score (%)")
        fig.tight_layout()
        paths.append(os.path.join(out, f"{stem}_depth.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def log_wandb(mode: str, project: str, name: str, config: dict, summary: dict, images: list[str], out: str) -> None:
    import wandb

    run = wandb.init(project=project, name=name, mode=mode, config=config, dir=out, job_type="eval")
    try:
        metrics = {f"ruler/{task}/{L}": s for task, cells in summary["table"].items() for L, s in cells.items()}
        metrics.update({f"ruler/mean/{L}": s for L, s in summary["mean"].items()})
        for key in ("wavg_inc", "wavg_dec", "effective_length"):
            if summary.get(key) is not None:
                metrics[f"ruler/{key}"] = summary[key]
        rows = [[task, L, s] for task, cells in summary["table"].items() for L, s in sorted(cells.items())]
        metrics["ruler/table"] = wandb.Table(columns=["task", "length", "score"], data=rows)
        metrics.update({f"ruler/{os.path.basename(p)[:-4]}": wandb.Image(p) for p in images})
        run.log(metrics)
    finally:
        run.finish()
