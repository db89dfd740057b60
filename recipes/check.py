"""`longstride check`: is longstride's attention exact for this model, on this data, under this CP layout?

    longstride check recipe=tiny seq_len=1024                    # the recipe's last stage, ring over its cp ranks
    longstride check checkpoint=DIR seq_len=1024 cp=2 parallel.cp_impl=ulysses [any training override]
    longstride check recipe=extend_pretrained model.checkpoint=DIR data.tokenizer=DIR stage=x4 seq_len=512
    torchrun --nproc-per-node 4 -m longstride.recipes.check checkpoint=DIR cp=4   # one rank per GPU, NCCL

One packed batch of the stage's own data (its tokenizer, mixture and packing: the first micro-batch its loader
gives, with document ids) runs one forward and backward three ways, all in fp32:
  eager     the model's own eager attention, each document alone in its sequence (skipped with eager=false)
  1 device  longstride's attention on one process with document masks, the kernel the stage runs there
  CP        longstride's attention under parallel.cp_impl over cp ranks: without a launcher, cp local gloo
            processes on the CPU; under torchrun / accelerate launch, the launched processes (NCCL on GPUs)
Compared: the logits, the loss, every decoder layer's output and every parameter's gradient; 1 device against
eager (the kernels), CP against 1 device (the CP method). The table gives the worst relative error
(max |a - b| / max |b| of a tensor, the worst tensor of the row) per layer type (config.layer_types) and for the
parameters outside the decoder layers ("other": embeddings, final norm, head). Exit status 0 within `tolerance`,
1 beyond it (naming the first layer whose output differs and the worst parameter), 2 on bad input, before any
compute. The model runs as transformers builds it, without the stage's memory savers (activation checkpointing,
MLP tiles, the chunked loss: tests/test_cp_model.py checks those under CP).

Test hook (STYLE rule 16; recipes/faults.py keeps the training loop's): LONGSTRIDE_TEST_CHECK_FAULT=cp_drops_window
makes every CP method compute each layer without its sliding window while the one-device and eager runs keep it,
the mistake tests/test_check.py asserts this command catches. Read once, when a CP rank starts (inject_test_fault).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from longstride.model.loss import IGNORE_INDEX
from longstride.overrides import parse, run
from longstride.parallel.config import CPDegrees, ParallelDims
from longstride.parallel.cp import CPContext, cp_context, cp_degrees, shard_for_cp

TEST_FAULT = "LONGSTRIDE_TEST_CHECK_FAULT"


@dataclass
class CheckConfig:
    checkpoint: str = ""  # an HF model dir: model=checkpoint model.checkpoint=DIR (and its tokenizer, if it has one)
    cp: int = 0  # CP degree checked; 0 = the stage's cp (2 where the stage runs without CP)
    seq_len: int = 0  # tokens per packed sequence; 0 = the stage's (eager is L x L per document: shorten long stages)
    rows: int = 0  # packed sequences in the batch; 0 = the stage's micro_batch_size
    tolerance: float = 1e-4  # worst relative error allowed (fp32)
    eager: bool = True  # also check the one-device run against the model's own eager attention
    overrides: list = field(default_factory=list)  # training overrides (recipe=, stage=, model.*, data.*, parallel.*)


@dataclass(frozen=True)
class Job:
    """Everything a process of the check needs, resolved and validated (picklable: the gloo processes get it)."""

    cfg: object  # recipes.schema.Config
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

    @property
    def what_cp(self) -> str:
        return f"{self.cfg.parallel.cp_impl} cp={self.cp}"


def parse_args(argv: list[str]):
    """(CheckConfig, the composed training Config) from key=value arguments."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from longstride.model.build import check_checkpoint_dir
    from longstride.overrides import _reason
    from longstride.recipes.memplan import compose_training

    names = {f.name for f in dataclasses.fields(CheckConfig)} - {"overrides"}
    mine = [a for a in argv if a.split("=", 1)[0].lstrip("+") in names or a in ("-h", "--help")]
    cc = parse(CheckConfig, mine, "longstride check", __doc__.split("\n\nTest hook")[0])  # --help: not the hook
    cc.overrides = [a for a in argv if a not in mine]
    overrides = list(cc.overrides)
    if cc.checkpoint:
        check_checkpoint_dir(cc.checkpoint, "checkpoint")
        overrides = ["model=checkpoint", f"model.checkpoint={cc.checkpoint}", *overrides]
        given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
        if "data.tokenizer" not in given and any(os.path.isfile(os.path.join(cc.checkpoint, f))
                                                 for f in ("tokenizer.json", "tokenizer_config.json")):
            overrides.append(f"data.tokenizer={cc.checkpoint}")
    try:
        return cc, compose_training(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_reason(e) + " (see longstride check --help)") from None


def prepare(cc: CheckConfig, cfg, world: int) -> Job:
    """Every check of the command's input, before any data is read or model built. world: the processes a
    launcher started (1: none, the CP ranks are local gloo processes)."""
    from longstride.parallel.kernels import resolve_kernel
    from longstride.recipes.plan import check_model_and_data, seq_len_unit
    from longstride.recipes.schema import selected_stages
    from longstride.recipes.train import use_cpu

    names = list(cfg.recipe.stages)
    if not names:
        raise ValueError(f"recipe {cfg.recipe.name!r} lists no stages; add recipe.stages.<name> entries")
    selected_stages(cfg)  # an unknown stage= fails naming the stages
    name = cfg.stage or names[-1]
    s = cfg.recipe.stages[name]
    heads = check_model_and_data(cfg)
    cp = cc.cp or (s.cp if s.cp > 1 else 2)
    if cp < 2:
        raise ValueError(f"cp={cp}: the check compares a run over cp >= 2 ranks with one device; give cp=2 or more")
    degrees = cp_degrees(cfg.parallel, cp, heads, where="cp")
    seq_len, where = (cc.seq_len, "seq_len") if cc.seq_len else (s.seq_len, f"recipe.stages.{name}.seq_len")
    unit = seq_len_unit(degrees)
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
    return Job(cfg, name, seq_len, rows, cp, degrees, resolve_kernel(kernel, device_type, ring=False, half=False),
               resolve_kernel(kernel, device_type, ring=True, half=False),
               str(s.balance if s.balance is not None else cfg.parallel.balance), cc.tolerance, cc.eager, device_type)


# ---- the data and the model ----

def stage_batch(job: Job) -> tuple[dict, Job]:
    """The stage's first micro-batch (a PackedBatch of job.rows x job.seq_len) and the job with the tokenizer's
    sizes; the data pipeline's own errors name the stage."""
    from longstride.data.corpus import build_corpus, build_tokenizer
    from longstride.data.pipeline import split_holdout, stage_loader, stage_sequences
    from longstride.data.stream import streaming_stage
    from longstride.recipes.faults import stage_input

    cfg, s = job.cfg, job.cfg.recipe.stages[job.stage]
    index = list(cfg.recipe.stages).index(job.stage)
    data = dataclasses.replace(cfg.data, num_workers=0)  # one batch: no loader workers
    cache = os.path.abspath(cfg.paths.cache_dir)
    with stage_input(job.stage):
        tok = build_tokenizer(data, cache)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if data.streaming:
            loader, _, _ = streaming_stage(data, tok, job.seq_len, pad, s.mixture, job.rows, 0, 1, cache)
        else:
            dataset, _ = stage_sequences(data, build_corpus(data, tok, cache), job.seq_len, pad, s.mixture,
                                         s.long_docs)
            train, _ = split_holdout(dataset, data.eval_sequences, data.seed + index)
            loader = stage_loader(train, job.rows, 0, 1, data, index)
        batch = next(iter(loader))
    job = dataclasses.replace(job, vocab=len(tok), eos=tok.eos_token_id, pad=pad)
    check_vocab(job, batch)
    return batch, job


def load_model(job: Job, device: torch.device) -> torch.nn.Module:
    """The stage's model as training builds it (its RoPE base, its config at the stage's length), in fp32; weights a
    checkpoint lacks are initialised from train.seed, so every process holds the same model."""
    from longstride.model.build import build_model

    cfg, s = job.cfg, job.cfg.recipe.stages[job.stage]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        lm = build_model(cfg.model, s.rope_theta, s.seq_len, job.vocab, job.eos, job.pad, seed=cfg.train.seed)
    return lm.float().eval().to(device)


def check_vocab(job: Job, batch: dict) -> None:
    """The batch's token ids against the model's vocabulary (read from its config, no weights)."""
    from longstride.model.build import stage_config

    s = job.cfg.recipe.stages[job.stage]
    config = stage_config(job.cfg.model, s.rope_theta, s.seq_len, job.vocab, job.eos, job.pad)
    vocab, top = config.get_text_config(decoder=True).vocab_size, int(batch["input_ids"].max())
    if top >= vocab:
        raise ValueError(f"data.tokenizer: the batch has token id {top} but the model's vocabulary is {vocab}; use the "
                         "model's own tokenizer (data.tokenizer=<the checkpoint dir>)")


def decoder_layers(lm) -> tuple[str, torch.nn.ModuleList]:
    """(dotted name, module) of the model's list of decoder layers."""
    for name, mod in lm.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(mod, torch.nn.ModuleList):
            return name, mod
    raise NotImplementedError(f"{type(lm).__name__} has no ModuleList of decoder layers named 'layers' to group by")


def layer_types(lm, n: int) -> list[str]:
    """Each decoder layer's type: config.layer_types; a config without them (Mistral) has one window for every
    layer (sliding_attention) or none (full_attention)."""
    cfg = lm.config.get_text_config(decoder=True)
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) == n:
        return types
    return ["sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * n


def param_groups(lm) -> dict[str, str]:
    """Parameter name -> its decoder layer's type, "other" outside the decoder layers."""
    prefix, layers = decoder_layers(lm)
    types = layer_types(lm, len(layers))
    out = {}
    for name, _ in lm.named_parameters():
        rest = name[len(prefix) + 1:].split(".", 1)[0] if name.startswith(prefix + ".") else ""
        out[name] = types[int(rest)] if rest.isdigit() else "other"
    return out


def describe_layers(lm, seq_len: int) -> str:
    """'sliding_attention: window 16 (layers 0, 2); full_attention (layers 1, 3)': what each layer type computes."""
    from longstride.parallel.pattern import layer_pattern

    cfg = lm.config.get_text_config(decoder=True)
    _, layers = decoder_layers(lm)
    seen: dict = {}
    for i, (t, layer) in enumerate(zip(layer_types(lm, len(layers)), layers)):
        attn, what = getattr(layer, "self_attn", None), []
        if attn is not None:
            p = layer_pattern(attn, getattr(cfg, "sliding_window", None) if t == "sliding_attention" else None)
            what += [f"{k} {v}" + (f" (>= seq_len {seq_len}: cuts nothing here)" if v >= seq_len else "")
                     for k, v in (("window", p.window), ("chunk", p.chunk)) if v]
            if isinstance(getattr(attn, "sinks", None), torch.nn.Parameter):
                what.append("sinks")
        seen.setdefault((t, ", ".join(what)), []).append(i)
    return "; ".join(f"{t}{': ' + w if w else ''} (layers {', '.join(map(str, ix))})" for (t, w), ix in seen.items())


# ---- one forward and backward ----

@dataclass
class Result:
    """One run's tensors over the whole batch, fp32: logits (B, L, V), the summed token loss, each decoder layer's
    output (B, L, hidden) and each parameter's gradient."""

    logits: torch.Tensor
    loss: torch.Tensor
    outputs: list
    grads: dict

    def tensors(self) -> list:
        return [self.logits, self.loss, *self.outputs, *self.grads.values()]

    def cpu(self) -> "Result":
        return Result(self.logits.cpu(), self.loss.cpu(), [o.cpu() for o in self.outputs],
                      {k: g.cpu() for k, g in self.grads.items()})


class Recorder:
    """Writes the logits and each decoder layer's output of every forward into full-batch buffers at the token
    positions that forward holds (`where`: rows (b,), columns (b, l)); zeros elsewhere, so CP ranks' buffers add
    up to the whole batch."""

    def __init__(self, lm, shape: tuple, device):
        _, layers = decoder_layers(lm)
        hidden = lm.config.get_text_config(decoder=True).hidden_size
        self.outputs = [torch.zeros(*shape, hidden, device=device) for _ in layers]
        self.logits = torch.zeros(*shape, lm.get_output_embeddings().out_features, device=device)
        self.where = None
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.put(self.outputs[i], out)
        return hook

    def put(self, full: torch.Tensor, part: torch.Tensor) -> None:
        rows, cols = self.where
        full[rows[:, None], cols] = part.detach().float()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                                             ignore_index=IGNORE_INDEX)


def _result(lm, rec: Recorder, loss: torch.Tensor) -> Result:
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float()
             for n, p in lm.named_parameters()}
    rec.close()
    return Result(rec.logits, loss.detach().float(), rec.outputs, grads)


def run_eager(lm, batch: dict, doc_masking: bool, device) -> Result:
    """The model's own eager attention, each document alone in its sequence (with doc_masking), else each row whole
    under a plain causal mask (an all-ones attention mask, so transformers does not read documents from the
    restarting positions)."""
    lm.set_attn_implementation("eager")
    lm.zero_grad(set_to_none=True)
    B, L = batch["input_ids"].shape
    rec = Recorder(lm, (B, L), device)
    loss = torch.zeros((), device=device)
    for b in range(B):
        spans = doc_spans(batch["doc_ids"][b]) if doc_masking else [(0, L)]
        for s, e in spans:
            x = {k: batch[k][b:b + 1, s:e].to(device) for k in ("input_ids", "position_ids", "labels")}
            mask = {} if doc_masking else {"attention_mask": torch.ones_like(x["input_ids"])}
            rec.where = (torch.tensor([b], device=device), torch.arange(s, e, device=device)[None])
            logits = lm(input_ids=x["input_ids"], position_ids=x["position_ids"], **mask).logits
            rec.put(rec.logits, logits)
            part = _loss(logits, x["labels"])
            part.backward()
            loss += part.detach()
    return _result(lm, rec, loss)


def doc_spans(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each document run of one row."""
    ids = doc_ids.tolist()
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))


def run_longstride(lm, batch: dict, doc_masking: bool, cp: CPContext, device) -> Result:
    """longstride's attention on this rank's share of the batch (the whole batch on one device); the buffers hold
    this rank's tokens only."""
    from longstride.parallel.attention import use_longstride_attention

    use_longstride_attention(lm)
    lm.zero_grad(set_to_none=True)
    B, L = batch["input_ids"].shape
    index = torch.arange(L).expand(B, L).contiguous()
    local, layout = shard_for_cp({**batch, "index": index}, doc_masking, cp)
    local = {k: v.to(device) for k, v in local.items()}
    rec = Recorder(lm, (B, L), device)
    rec.where = (torch.arange(B, device=device), local["index"])
    logits = lm(input_ids=local["input_ids"], position_ids=local["position_ids"], doc_layout=layout).logits
    rec.put(rec.logits, logits)
    loss = _loss(logits, local["labels"])
    loss.backward()
    return _result(lm, rec, loss)


def references(job: Job, batch: dict, device) -> tuple[Optional[Result], Result, object]:
    """(eager or None, one device, the model) on one process."""
    from longstride.parallel.attention import check_supported

    lm = load_model(job, device)
    check_supported(lm)  # before any compute: attention longstride does not implement is refused, naming it
    doc_masking = job.cfg.data.doc_masking
    eager = run_eager(lm, batch, doc_masking, device).cpu() if job.eager else None
    one = run_longstride(lm, batch, doc_masking, CPContext(kernel=job.kernel), device).cpu()
    return eager, one, lm


def inject_test_fault() -> None:
    """The one place this command's test fault is injected (see the module docstring): with
    LONGSTRIDE_TEST_CHECK_FAULT=cp_drops_window every CP method is handed each layer's pattern without its
    window. An environment lookup otherwise."""
    fault = os.environ.get(TEST_FAULT)
    if fault is None:
        return
    if fault != "cp_drops_window":
        raise ValueError(f"{TEST_FAULT}={fault!r} is not a fault this command's tests inject; use cp_drops_window")
    from longstride.parallel.cp import METHODS

    for module in set(METHODS.values()):
        def windowless(q, k, v, layout, scale, pattern=None, sinks=None, _attention=module.attention):
            pattern = dataclasses.replace(pattern, window=None) if pattern is not None else pattern
            return _attention(q, k, v, layout, scale, pattern, sinks)
        module.attention = windowless


def cp_run(rank: int, world: int, job: Job, batch: dict, device) -> Result:
    """This rank's share under the CP method, the global sums all-reduced into every rank's buffers
    (collective: every rank of the group calls it)."""
    from longstride.parallel.pattern import model_patterns

    inject_test_fault()
    cfg = job.cfg
    lm = load_model(job, device)
    # as training makes it (recipes/stage.py): balance=docs weighs each layer type's work
    cp = cp_context(cfg.parallel.cp_impl, ParallelDims(world, 1, world), job.degrees, device.type, job.cp_kernel,
                    job.balance, cfg.parallel.balance_chunks, patterns=model_patterns(lm))
    res = run_longstride(lm, batch, cfg.data.doc_masking, cp, device)
    for t in res.tensors():
        dist.all_reduce(t)  # each token's logits and outputs from the one rank that holds it; loss, grads: sums
    return res


def _gloo_rank(rank: int, world: int, job: Job, batch: dict, path: str) -> None:
    res = cp_run(rank, world, job, batch, torch.device("cpu"))
    if rank == 0:
        torch.save(vars(res), path)


# ---- comparison and report ----

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; NaN when either holds NaN (a failure: not <= any tolerance)."""
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return math.nan
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() if b.numel() else 0.0


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
    for g in dict.fromkeys(groups.values()):
        errs = {n: rel(got.grads[n], ref.grads[n]) for n, x in groups.items() if x == g}
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


def report(job: Job, batch: dict, lm, eager: Optional[Result], one: Result, cp: Result, where: str) -> Report:
    """The comparisons (1 device vs eager, CP vs 1 device), the table and the verdict."""
    _, layers = decoder_layers(lm)
    types, groups, tol = layer_types(lm, len(layers)), param_groups(lm), job.tolerance
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
                     + (f" {which}" if which else "") + f", {e:.1e}")
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


# ---- entry points ----

def check_local(job: Job) -> Report:
    """No launcher: the references in this process, the CP run on job.cp local gloo processes (CPU)."""
    from longstride.parallel.spawn import run_gloo

    batch, job = stage_batch(job)
    cpu = torch.device("cpu")
    eager, one, lm = references(job, batch, cpu)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cp.pt")
        run_gloo(_gloo_rank, job.cp, job, batch, path)
        cp = Result(**torch.load(path))
    return show(report(job, batch, lm, eager, one, cp, f"{job.cp} local gloo processes"))


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
        sent = [None]
        if rank == 0:
            try:
                sent = [("ok", *stage_batch(job))]
            except ValueError as e:
                sent = [("error", str(e), None)]
        dist.broadcast_object_list(sent, src=0)
        status, batch, job = sent[0][0], sent[0][1], sent[0][2] or job
        if status == "error":
            raise ValueError(batch)
        cp = cp_run(rank, world, job, batch, device).cpu()
        rep, passed = None, [None]
        if rank == 0:
            if cuda:
                torch.cuda.empty_cache()
            eager, one, lm = references(job, batch, device)
            where = f"{world} launched processes ({dist.get_backend()})"
            rep = show(report(job, batch, lm, eager, one, cp, where))
            passed = [rep.ok]
        # every rank exits with rank 0's verdict, after rank 0 printed it (a launcher stops the rest at the first exit)
        dist.broadcast_object_list(passed, src=0)
        if rep is None and not passed[0]:
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
    cc, cfg = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    job = prepare(cc, cfg, world)
    return check_launched(job) if world > 1 else check_local(job)


def main(argv: list[str]) -> None:
    """The command: exit 0 within tolerance, 1 beyond it; ValueError / NotImplementedError (bad input) exit 2."""
    try:
        rep = check(argv)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    if rep is not None and not rep.ok:
        sys.exit(1)


if __name__ == "__main__":
    run("longstride check", main)
