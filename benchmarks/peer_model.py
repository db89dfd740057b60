"""Part 2 of bench_peers: a SmolLM2-135M-shaped model's training step, longstride against plain transformers and
ALST's stack (DeepSpeed Ulysses + TiledMLP + TiledFusedLogitsLoss + activation checkpointing).

The model is SmolLM2-135M's shape from its config only (30 layers, hidden 576, 9 query / 3 K/V heads of 64,
MLP 1536, vocabulary 49152; random init, no download), built by longstride's own builder (model/build.py:
transformers' SmolLM3 class with RoPE on every layer, i.e. a Llama). One step = forward, backward and AdamW
on one sequence of L tokens, fp32; none of the rows all-reduces gradients across the context ranks (the same
for every row; a data-parallel wrapper would add the same all-reduce to each).
  plain               transformers as it comes: SDPA, loss from full logits (labels=), no checkpointing;
                      one process (it cannot split a sequence), given all N threads
  alst                DeepSpeed's UlyssesSPAttentionHF over N ranks (SDPA inside), DeepSpeed's TiledMLP
                      (ceil(L/hidden) shards, their example), TiledFusedLogitsLoss (1024-token tiles), HF
                      gradient checkpointing on every layer
  longstride_ring     model/prepare.patch_model (full checkpointing, 1024-token MLP tiles, lean RMSNorm),
  longstride_ulysses  the chunked loss (1024-token tiles) and parallel/cp.py's method over N ranks, as a
  longstride_upipe    training stage runs them
Per row: step time at `--step-length` (median of `--reps` after a warm-up step), and the peak resident
memory per rank (as bench_memory: VmHWM over a step minus the process's RSS after imports, largest rank) at
each of `--lengths`; a straight line through them gives the longest context within `--budget-gib` per
rank (an extrapolated estimate, labelled so: with checkpointing and tiling the step's memory is linear in
L). Pieces: benchmarks/results/bench_peers/model-<row>-n<N>.json.

    python -m benchmarks.bench_peers --model [--n 2] [--lengths 2048 4096] [--step-length 2048] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import RESULTS, proc_status_bytes, reset_peak_rss
from longstride.model.config import ModelConfig
from longstride.recipes.config.schema import OptimConfig
from longstride.recipes.run.step import build_optimizer

# BENCH_PEERS_LAYERS: fewer layers, for a quick check of the rows' code paths only
CONFIG = ModelConfig(hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=int(os.environ.get("BENCH_PEERS_LAYERS", "30")), num_attention_heads=9,
                     num_key_value_heads=3, nope_interval=0)
VOCAB = 49152
TILE = 1024
_ALST_REGISTERED: list = []
ROWS = ("plain", "alst", "longstride_ring", "longstride_ulysses", "longstride_upipe")


def unsupported(row: str, n: int) -> str | None:
    heads = CONFIG.num_attention_heads
    if row in ("alst", "longstride_ulysses", "longstride_upipe") and heads % n:
        who = "UlyssesSPAttentionHF" if row == "alst" else "parallel/heads.py"
        return f"{heads} query heads do not split over {n} ranks ({who} needs N | H); --n 3 runs it"
    if row == "alst":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed not installed (pip install -e \".[peers]\")"
    return None


def _build(length: int):
    from longstride.model.build import build_model

    return build_model(CONFIG, rope_theta=1e5, seq_len=length, vocab_size=VOCAB, eos_id=0, pad_id=1, seed=0)


def _tokens(length: int):
    ids = torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # next-token targets, shifted once
    return ids, labels


def _plain(lm, length, rank, n):
    ids, _ = _tokens(length)
    lm.set_attn_implementation("sdpa")
    return lambda: lm(input_ids=ids, labels=ids).loss


def _longstride(lm, length, rank, n, impl):
    from longstride.data.batch import collate, packed_item
    from longstride.parallel.config import ParallelConfig, ParallelDims
    from longstride.parallel.cp import cp_context, cp_degrees
    from longstride.recipes.run.step import StepSpec, build_step, loss_sum

    degrees = cp_degrees(ParallelConfig(cp_impl=impl), n, CONFIG.num_attention_heads)
    cp = cp_context(impl, ParallelDims(n, 1, n), degrees, "cpu", "sdpa")
    # as a training stage builds its step (recipes/run/step.py): full checkpointing, tiled MLP, lean norms
    step = build_step(lm, StepSpec("full", mlp_tile=TILE, loss_tile=TILE, doc_masking=False), cp)
    local = step.prep(collate([packed_item([_tokens(length)[0][0].numpy()], length, pad_id=1)]))
    return lambda: loss_sum(step.module, local, "cpu") / length


def _alst(lm, length, rank, n):
    import deepspeed
    import deepspeed.comm
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    lm.set_attn_implementation("sdpa")
    if not _ALST_REGISTERED:  # once per process: it swaps transformers' "sdpa" for its wrapper and makes the SP group
        UlyssesSPAttentionHF.register_with_transformers(lm, "sdpa", n, 1, seq_length=length,
                                                        seq_length_is_variable=True)
        _ALST_REGISTERED.append(True)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hidden = lm.config.hidden_size

    def mlp_fn(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    for layer in lm.model.layers:  # DeepSpeed's TiledMLP example: ceil(seqlen / hidden) shards
        mlp = layer.mlp
        mlp.forward = (lambda m: lambda x: TiledMLP.apply(mlp_fn, m, x, math.ceil(x.shape[1] / hidden),
                                                          list(m.parameters())))(mlp)

    def loss_fn(self, x, y):
        return F.cross_entropy(self.lm_head(x).float().view(-1, VOCAB), y.view(-1), ignore_index=-100,
                               reduction="sum")

    ids, labels = _tokens(length)
    c = length // n  # Ulysses' contiguous sequence shard; positions stay global (the wrapper gathers them)
    local_ids, local_labels = ids[:, rank * c:(rank + 1) * c], labels[:, rank * c:(rank + 1) * c]
    pos = torch.arange(rank * c, (rank + 1) * c)[None]

    def loss():
        h = lm.model(input_ids=local_ids, position_ids=pos, use_cache=False).last_hidden_state
        s = TiledFusedLogitsLoss.apply(loss_fn, lm, h, local_labels, None, math.ceil(c / TILE), [lm.lm_head.weight],
                                       "sum")
        return s / length
    del dist
    return loss


def _worker(rank, n, row, lengths, step_length, reps, path):
    zero = proc_status_bytes("VmRSS")
    if row == "plain":
        torch.set_num_threads(int(os.environ.get("BENCH_PEERS_PLAIN_THREADS", "2")))
    out = {"peaks": {}, "times": []}
    for length in sorted(set(lengths) | {step_length}):
        lm = _build(length)
        loss_fn = {"plain": _plain, "alst": _alst}.get(row)
        loss_fn = loss_fn(lm, length, rank, n) if loss_fn else _longstride(lm, length, rank, n, row.split("_")[1])
        opt = build_optimizer(lm, OptimConfig(), lr=1e-4)

        def step():
            loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        # the first step (which creates the optimizer state) gives the check: the same model and tokens, so every
        # row's loss (summed over ranks; plain's mean over L-1 targets put on the others' per-L scale) must agree
        first = step()
        out.setdefault("loss", {})[length] = first * (length - 1) / length if row == "plain" else _sum(first, n)
        for rep in range(reps if length == step_length else 1):
            reset_peak_rss()
            t0 = time.perf_counter()
            step()
            wall = time.perf_counter() - t0
            peak = proc_status_bytes("VmHWM") - zero
            if length == step_length:
                out["times"].append(_max(wall, n))
            out["peaks"][length] = max(out["peaks"].get(length, 0.0), _max(peak, n))
        del lm, opt, loss_fn
    if rank == 0:
        torch.save(out, path)


def _max(x: float, n: int) -> float:
    if n == 1:
        return float(x)
    import torch.distributed as dist

    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sum(x: float, n: int) -> float:
    import torch.distributed as dist

    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def fit_budget(peaks: dict, budget: float) -> dict:
    L = np.array(sorted(int(k) for k in peaks), dtype=np.float64)
    y = np.array([peaks[k] for k in sorted(peaks, key=int)])
    if len(L) < 2:
        return {}
    b, a = np.polyfit(L, y, 1)
    return {"fixed_gib": a / 2 ** 30, "kib_per_token": b / 1024, "max_len_estimate": float((budget - a) / b)}


def main(argv=None) -> None:
    from benchmarks import bench_peers
    from longstride.parallel.spawn import run_gloo

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_peers --model")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--step-length", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--pieces", default=os.path.join(RESULTS, "bench_peers"))
    args = ap.parse_args(argv)
    os.makedirs(args.pieces, exist_ok=True)
    for row in args.rows:
        n = 1 if row == "plain" else args.n
        piece = os.path.join(args.pieces, f"model-{row}-n{args.n}.json")
        if os.path.exists(piece) and not args.force:
            continue
        result = {"row": row, "ranks": n, "date": time.strftime("%Y-%m-%d %H:%M"), "versions": bench_peers.versions()}
        reason = unsupported(row, args.n)
        if reason is None:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "out.pt")
                try:
                    run_gloo(_worker, n, row, args.lengths, args.step_length, args.reps, path)
                    got = torch.load(path)
                except Exception as e:  # the row's reason, the other rows go on
                    reason = f"failed: {type(e).__name__}: {str(e).splitlines()[-1][:300]}"
            if reason is None:
                budget = args.budget_gib * 2 ** 30
                result.update({"step_length": args.step_length, "step_s": statistics.median(got["times"]),
                               "step_times_s": got["times"], "peak_bytes": {str(k): v for k, v in got["peaks"].items()},
                               "loss": {str(k): v for k, v in got["loss"].items()},
                               "budget_gib": args.budget_gib, **fit_budget(got["peaks"], budget),
                               "wall_s": time.perf_counter() - t0})
        if reason:
            result["reason"] = reason
        with open(piece, "w") as f:
            json.dump(result, f, indent=1)
        print(f"model {row} n={args.n}: {result.get('step_s', reason)}", flush=True)
    del bench_peers
