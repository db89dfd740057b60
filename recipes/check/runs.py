"""The three runs `longstride check` compares, each one forward and backward of the batch in fp32 recording the
logits, the summed loss, every decoder layer's output and every gradient (a Result): the model's eager attention
one document at a time, longstride's attention on one device (references), and the CP method over cp ranks
(cp_run on each rank; cp_local starts them as local gloo processes).

The test hook lives here (STYLE rule 16; documented in recipes/check/command.py): LONGSTRIDE_TEST_CHECK_FAULT=
cp_drops_window, read once when a CP rank starts (inject_test_fault).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from longstride.model.loss import IGNORE_INDEX, chunked_cross_entropy_sum, output_head
from longstride.parallel.config import ParallelDims
from longstride.parallel.cp import CPContext, cp_context, shard_for_cp
from longstride.recipes.check.inputs import doc_spans, layer_stack, load_model
from longstride.recipes.check.job import Job

TEST_FAULT = "LONGSTRIDE_TEST_CHECK_FAULT"


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
        _, layers = layer_stack(lm)
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


def run_longstride(lm, batch: dict, doc_masking: bool, cp: CPContext, device) -> Result:
    """longstride's attention on this rank's share of the batch (the whole batch on one device); the buffers hold
    this rank's tokens only."""
    from longstride.model.loss import decoder
    from longstride.parallel.attention import use_longstride_attention

    use_longstride_attention(lm)
    lm.zero_grad(set_to_none=True)
    B, L = batch["input_ids"].shape
    index = torch.arange(L).expand(B, L).contiguous()
    local, layout = shard_for_cp({**batch, "index": index}, doc_masking, cp)
    local = {k: v.to(device) for k, v in local.items()}
    rec = Recorder(lm, (B, L), device)
    rec.where = (torch.arange(B, device=device), local["index"])
    hidden = []  # the decoder's output, which the training loss reads (not the model's logits)
    hook = decoder(lm).register_forward_hook(lambda module, args, out: hidden.append(out.last_hidden_state))
    try:
        logits = lm(input_ids=local["input_ids"], position_ids=local["position_ids"], doc_layout=layout).logits
    finally:
        hook.remove()
    rec.put(rec.logits, logits)
    # the loss as training computes it (model/loss.py, through the model's whole output head), so a head term the
    # chunked loss missed shows as a loss and gradients unlike the eager run's
    loss = chunked_cross_entropy_sum(hidden[0], output_head(lm), local["labels"])
    loss.backward()
    return _result(lm, rec, loss)


def references(job: Job, batch: dict, device) -> tuple[Optional[Result], Result, object]:
    """(eager or None, one device, the model) on one process."""
    from longstride.parallel.attention import check_supported

    lm = load_model(job, device)
    # before any compute: attention longstride does not implement, also split over job.cp ranks, is refused
    check_supported(lm, job.seq_len if job.cp > 1 else 0)
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
            return _attention(q, k, v, layout, scale, pattern=pattern, sinks=sinks)
        module.attention = windowless


def cp_run(rank: int, world: int, job: Job, batch: dict, device) -> Result:
    """This rank's share under the CP method, the global sums all-reduced into every rank's buffers
    (collective: every rank of the group calls it)."""
    from longstride.parallel.pattern import model_patterns

    inject_test_fault()
    cfg = job.cfg
    lm = load_model(job, device)
    # as training makes it (recipes/run/stage.py): balance=docs weighs each layer type's work
    cp = cp_context(cfg.parallel.cp_impl, ParallelDims(world, 1, world), job.degrees, device_type=device.type,
                    kernel=job.cp_kernel, balance=job.balance, balance_chunks=cfg.parallel.balance_chunks,
                    patterns=model_patterns(lm))
    res = run_longstride(lm, batch, cfg.data.doc_masking, cp, device)
    for t in res.tensors():
        dist.all_reduce(t)  # each token's logits and outputs from the one rank that holds it; loss, grads: sums
    return res


def _gloo_rank(rank: int, world: int, job: Job, batch: dict, path: str) -> None:
    res = cp_run(rank, world, job, batch, torch.device("cpu"))
    if rank == 0:
        torch.save(vars(res), path)


def cp_local(job: Job, batch: dict) -> Result:
    """The CP run on job.cp local gloo processes (CPU), rank 0's all-reduced Result read back here."""
    from longstride.parallel.spawn import run_gloo

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cp.pt")
        run_gloo(_gloo_rank, job.cp, job, batch, path)
        return Result(**torch.load(path))
