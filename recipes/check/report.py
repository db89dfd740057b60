"""`longstride check`'s verdict: the comparisons (1 device vs eager: the kernels; CP vs 1 device: the CP method), the
worst relative error per row (logits, loss, layer outputs and gradients per layer type, "other"), the header saying
what was checked, the table and the line naming what differs (recipes/check/command.py prints it)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from longstride.recipes.check.inputs import describe_layers, doc_spans, layer_stack, lm_layer_types, param_layer_types
from longstride.recipes.check.job import Job
from longstride.recipes.check.runs import Result


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """max |a - b| / max(max |b|, floor); NaN when either holds NaN (a failure: not <= any tolerance)."""
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return math.nan
    return ((a - b).abs().max() / b.abs().max().clamp(min=floor)).item() if b.numel() else 0.0


GRAD_FLOOR = 1e-3  # of the largest gradient in a parameter's group


def grad_errors(got: Result, ref: Result, groups: dict[str, str]) -> dict[str, float]:
    """Each parameter's gradient error: max |got - ref| over the larger of max |ref| and GRAD_FLOOR times the
    largest gradient in its group. A gradient that is zero in exact arithmetic holds rounding noise only, which two
    attentions make differently (a key bias without RoPE: softmax ignores what it adds to a query's every score),
    so it is judged against the gradients around it, not against itself."""
    top: dict[str, float] = {}
    for n, g in groups.items():
        top[g] = max(top.get(g, 0.0), float(ref.grads[n].abs().max()) if ref.grads[n].numel() else 0.0)
    return {n: rel(got.grads[n], ref.grads[n], floor=max(GRAD_FLOOR * top[g], 1e-30)) for n, g in groups.items()}


def _order(err: float) -> float:
    return math.inf if math.isnan(err) else err


@dataclass
class Comparison:
    """One column of the table: row key -> (worst error, which tensor: "layer 3", a parameter name, "")."""

    title: str
    cells: dict

    def beyond(self, tol: float) -> list:
        return [k for k, (e, _) in self.cells.items() if not e <= tol]


def compare(title: str, got: Result, ref: Result, types: list[str], groups: dict[str, str]) -> Comparison:
    """Row keys: "logits", "loss", ("output", layer type), ("grad", layer type or "other")."""
    cells = {"logits": (rel(got.logits, ref.logits), ""),
             "loss": (rel(got.loss.reshape(1), ref.loss.reshape(1)), "")}
    for t in dict.fromkeys(types):
        errs = {i: rel(got.outputs[i], ref.outputs[i]) for i, x in enumerate(types) if x == t}
        worst = max(errs, key=lambda i: _order(errs[i]))
        cells["output", t] = (errs[worst], f"layer {worst}")
    grad_err = grad_errors(got, ref, groups)
    for g in dict.fromkeys(groups.values()):
        errs = {n: grad_err[n] for n, x in groups.items() if x == g}
        worst = max(errs, key=lambda n: _order(errs[n]))
        cells["grad", g] = (errs[worst], worst)
    return Comparison(title, cells)


def verdict(c: Comparison, got: Result, ref: Result, types: list[str], groups: dict[str, str], tol: float) -> str:
    """One line naming what differs in a failed comparison: the first layer whose output differs (where the
    mistake enters), the worst parameter, the logits and the loss."""
    parts = []
    first = next((i for i, (a, b) in enumerate(zip(got.outputs, ref.outputs)) if not rel(a, b) <= tol), None)
    if first is not None:
        parts.append(f"first layer whose output differs: layer {first} ({types[first]}), "
                     f"{rel(got.outputs[first], ref.outputs[first]):.1e}")
    e, name = max((c.cells[k] for k in c.cells if k[0] == "grad"), key=lambda x: _order(x[0]))
    if not e <= tol:
        parts.append(f"worst parameter: {name} ({groups[name]}), gradient {e:.1e}")
    parts += [f"{k} {c.cells[k][0]:.1e}" for k in ("logits", "loss") if not c.cells[k][0] <= tol]
    return f"{c.title} beyond {tol:.0e}: " + "; ".join(parts)


def _row_name(key) -> str:
    return key if isinstance(key, str) else f"{'output' if key[0] == 'output' else 'gradient'} ({key[1]})"


@dataclass
class Report:
    ok: bool
    table: str
    comparisons: list
    failures: list  # one verdict line per failed comparison


def report(job: Job, batch: dict, lm, *, eager: Optional[Result], one: Result, cp: Result, where: str) -> Report:
    """The comparisons (1 device vs eager, CP vs 1 device), the table and the verdict."""
    _, layers = layer_stack(lm)
    types, groups, tol = lm_layer_types(lm, len(layers)), param_layer_types(lm), job.tolerance
    runs = [(f"{job.what_cp} vs 1 device", cp, one)]
    if eager is not None:
        runs.insert(0, ("1 device vs eager", one, eager))
    comps = [compare(t, got, ref, types, groups) for t, got, ref in runs]
    failures = [verdict(c, got, ref, types, groups, tol) for c, (_, got, ref) in zip(comps, runs) if c.beyond(tol)]
    lines = [*header(job, batch, lm, where), "", *table(comps, types, groups, tol), ""]
    if failures:
        lines += [f"check FAILED: {f}" for f in failures]
    else:
        title, key, (e, which) = max(((c.title, k, c.cells[k]) for c in comps for k in c.cells),
                                     key=lambda x: _order(x[2][0]))
        lines.append(f"check passed: every error within {tol:.0e}; the largest: {title}, {_row_name(key)}"
                     + (f" {which}" if which else "") + f", {e:.1e}"
                     + (f" (not tested: {'; '.join(job.unexercised)})" if job.unexercised else ""))
    return Report(not failures, "\n".join(lines), comps, failures)


def header(job: Job, batch: dict, lm, where: str) -> list[str]:
    """What was checked: the model, the batch, what each layer type computes, the kernels and the CP layout."""
    cfg, (B, L) = job.cfg, batch["input_ids"].shape
    spans = [doc_spans(batch["doc_ids"][b]) for b in range(B)]
    model = cfg.model.checkpoint if cfg.model.arch == "checkpoint" else \
        f"model.arch={cfg.model.arch} (seed {cfg.train.seed})"
    d = job.degrees
    return [f"longstride check: {type(lm).__name__} from {model}; recipe {cfg.recipe.name}, stage {job.stage}",
            f"  batch: {B} x {L} tokens of the stage's data, {sum(map(len, spans))} documents (longest "
            f"{max(e - s for row in spans for s, e in row)} tokens), document masking "
            f"{'on' if cfg.data.doc_masking else 'off'}; fp32 on {job.device_type}",
            f"  layers: {describe_layers(lm, L)}",
            *([f"  not tested by this batch (allow_unexercised=true): {'; '.join(job.unexercised)}"]
              if job.unexercised else []),
            f"  1 device: kernel {job.kernel}; {job.what_cp}: ring {d.ring} x ulysses {d.ulysses}, kernel "
            f"{job.cp_kernel}, balance {job.balance}, {where}",
            f"worst relative error (max |a - b| / max |b| of a tensor, the worst tensor of each row; tolerance "
            f"{job.tolerance:.0e})"]


def table(comps: list, types: list[str], groups: dict[str, str], tol: float) -> list[str]:
    """One column per comparison; rows: logits, loss, layer outputs and gradients per layer type, "other"."""
    counts = {g: sum(1 for x in groups.values() if x == g) for g in dict.fromkeys(groups.values())}
    labels = [("logits", "logits"), ("loss", "loss"), (None, "layer outputs")]
    labels += [(("output", t), f"  {t} ({types.count(t)} layers)") for t in dict.fromkeys(types)]
    labels += [(None, "gradients")] + [(("grad", g), f"  {g} ({n} tensors)") for g, n in counts.items()]
    width, cols = max(len(s) for _, s in labels) + 2, [len(c.title) + 4 for c in comps]
    lines = [(" " * width + "".join(c.title.rjust(w) + " " * 5 for c, w in zip(comps, cols))).rstrip()]
    for key, label in labels:
        cells = "" if key is None else "".join(
            f"{c.cells[key][0]:.1e}".rjust(w) + (" FAIL" if not c.cells[key][0] <= tol else " " * 5)
            for c, w in zip(comps, cols))
        lines.append((label.ljust(width) + cells).rstrip())
    return lines
