"""What a checkpoint's save costs, per rank: bytes written and the process's peak host memory during
the save (a step checkpoint; a stage's final HF directory, whose FSDP2 weights stream in files of at most
1 GiB, and 128 MiB to show the bound), for SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocab 49152; 135M parameters) with
AdamW state, on 2 gloo processes, through the training loop's own save (recipes/run/stage_state.py's pieces:
Parallelized.save_state, the config and tokenizer's writer, recipes/checkpoint/format.writing_checkpoint).

Each rank writes its own shard of the model and AdamW state (parallel/shards.py: FSDP2's shards; DCP splits
DDP's replicas between the ranks), nothing is gathered. The figures of the save before it (the whole model
and AdamW state gathered and written by the main rank, at commit 5f46692) are kept in
results/bench_checkpoint_gathered.json (measured then as the high-water mark of the resident set above the
set before the save, which the training step's own high-water mark floors at about 200 MiB). Peak now = the
largest resident set sampled every millisecond during the save minus the set just before it (after one step,
the gradients freed and the freed heap returned to the OS), each rank in a fresh process.

    python -m benchmarks.bench_checkpoint [--fsdp both|true|false]

--background times blocking and background (train.async_save) step checkpoints of the same model side by side:
how long each save holds training, how long the two training steps after it take (a background save's writes
run beside them) against the same steps with no save, by when it is sealed, and the resident set when the save
returns above the set before the saves (a background save's copy of the rank's state, held until it is written).

    python -m benchmarks.bench_checkpoint --background [--reps 5] [--fsdp ...]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import threading
import time

import torch

from benchmarks.common import print_table, write_results

MIB = 2 ** 20
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


class Sampler(threading.Thread):
    """The largest resident set seen while it runs, sampled every millisecond."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = rss_mib(), threading.Event()
        self.start()

    def run(self):
        while not self.done.wait(0.001):
            self.peak = max(self.peak, rss_mib())

    def stop(self) -> float:
        self.done.set()
        self.join()
        return max(self.peak, rss_mib())


def _build(rank, world, fsdp):
    """(model, parallelized step, AdamW with state after one step, the step's input ids) on this rank."""
    from longstride.model.build import build_model
    from longstride.model.config import ModelConfig
    from longstride.parallel.config import WorldMesh
    from longstride.parallel.parallelize import parallelize
    from longstride.parallel.spawn import rank_accelerator
    from longstride.recipes.config.schema import OptimConfig
    from longstride.recipes.run.step import StepSpec, build_optimizer, build_step

    torch.set_num_threads(1)
    acc = rank_accelerator(rank, world)  # DDP really wraps the model when fsdp is off
    lm = build_model(ModelConfig(**SHAPE), rope_theta=1e5, seq_len=256, vocab_size=SHAPE["vocab_size"], eos_id=0,
                     pad_id=1, seed=0)
    step = build_step(lm, StepSpec(loss_tile=256))  # the training step's model and optimizer (recipes/run/step.py)
    model = parallelize(step.module, lm.model.layers, fsdp, acc, WorldMesh("cpu", world) if fsdp else None)
    opt = build_optimizer(lm, OptimConfig(), lr=1e-4)  # over the parameters FSDP2 sharded in place, as a stage
    ids = torch.randint(2, SHAPE["vocab_size"], (1, 64))
    model.backward(model(ids, ids, torch.arange(64)[None]))
    opt.step()  # AdamW state exists, as in any step checkpoint
    opt.zero_grad(set_to_none=True)
    return lm, model, opt, ids


def _worker(rank, world, fsdp, kind, root, out):
    from longstride.recipes.checkpoint.format import rng_state, writing_checkpoint

    lm, model, opt, ids = _build(rank, world, fsdp)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the OS, so the RSS before is what is held
    torch.distributed.barrier()
    before = rss_mib()
    sampler = Sampler()
    if kind == "step":
        path = os.path.join(root, "s1", "step_000001")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with writing_checkpoint(path, rank=rank, is_main=rank == 0,
                                trainer_state={"step": 1}, rank_state={"rng": rng_state()}, meta={"step": 1},
                                world_size=world) as d:
            model.save_state(d, opt)
            if rank == 0:
                lm.config.save_pretrained(d)
    else:  # a stage's final: the HF directory, written by the main rank (FSDP2: streamed, files of `kind` MiB)
        path = os.path.join(root, "s1", "final")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with writing_checkpoint(path, rank=rank, is_main=rank == 0,
                                trainer_state=None, rank_state=None, meta={"step": 1}, world_size=world) as d:
            model.save_weights(lm, d, rank == 0, kind * MIB)
    peak = sampler.stop()
    mine = [f for f in os.listdir(path) if f == f"rank{rank}.pt" or f == f"__{rank}_0.distcp" or
            (rank == 0 and not f.startswith("__") and not f.startswith("rank"))]
    written = sum(os.path.getsize(os.path.join(path, f)) for f in mine)
    torch.save({"rank": rank, "written_mib": written / MIB, "rss_before_mib": before, "peak_mib": peak,
                "save_peak_mib": peak - before, "params": sum(p.numel() for p in lm.parameters())},
               os.path.join(out, f"rank{rank}.pt"))


def _timed_worker(rank, world, fsdp, background, reps, root, out):
    """train.async_save's cost, on the loop's own pieces (stage_state.save_stage's): for each of `reps` step
    checkpoints, the seconds the save holds training (entering the save to its return), the seconds of the two
    training steps that follow it (a background save's writes run beside them), and the seconds by which it is
    sealed (a background save: BackgroundSave.wait returning after those two steps, so at least held + the steps;
    a blocking save: its return); the resident set when the
    save returns above the set before the first save (a background save's copy of the state, held until its
    writes end); the same two steps timed with no save before them."""
    from longstride.recipes.checkpoint.background import BackgroundSave
    from longstride.recipes.checkpoint.format import rng_state, step_name, writing_checkpoint

    lm, model, opt, ids = _build(rank, world, fsdp)

    def train_step():
        model.backward(model(ids, ids, torch.arange(ids.shape[1])[None]))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def two_steps() -> float:
        t = time.perf_counter()
        train_step()
        train_step()
        return time.perf_counter() - t

    saves, rows, quiet = BackgroundSave() if background else None, [], []
    two_steps()  # warm
    quiet.append(two_steps())
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    torch.distributed.barrier()
    before = rss_mib()
    for i in range(1, reps + 1):
        path = os.path.join(root, "s1", step_name(i))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with writing_checkpoint(path, rank=rank, is_main=rank == 0,
                                trainer_state={"step": i}, rank_state={"rng": rng_state()}, meta={"step": i},
                                world_size=world, keep_last=2, background=saves) as d:
            shards = model.save_state(d, opt, background=background)
            if background:
                saves.track(shards, t0)
            if rank == 0:
                lm.config.save_pretrained(d)
        held, copy = time.perf_counter() - t0, rss_mib() - before
        steps = two_steps()
        if background:
            saves.wait()
        rows.append({"held_s": held, "steps_after_s": steps, "copy_mib": copy,
                     "sealed_s": time.perf_counter() - t0 if background else held})
        torch.distributed.barrier()
        quiet.append(two_steps())
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    hashing = None if background else hash_times(os.path.join(root, "s1", step_name(reps)), rank)
    torch.save({"rows": rows, "quiet": quiet, "hashing": hashing}, os.path.join(out, f"rank{rank}.pt"))


def hash_times(path: str, rank: int) -> dict:
    """The manifest's checksums of the written checkpoint `path`, timed two ways in the same run, from a barrier
    to the last rank's return: the main rank hashing every file while the others wait (the save before
    shared_digests), and every rank hashing its share (recipes/checkpoint/format.shared_digests)."""
    from longstride.model.manifest import listed_files, sha256
    from longstride.recipes.checkpoint.format import shared_digests

    def timed(fn) -> float:
        torch.distributed.barrier()
        t = time.perf_counter()
        fn()
        torch.distributed.barrier()
        return time.perf_counter() - t

    alone = timed(lambda: [sha256(os.path.join(path, n)) for n in listed_files(path)] if rank == 0 else None)
    return {"alone_s": alone, "shared_s": timed(lambda: shared_digests(path, path)),
            "mib": sum(listed_files(path).values()) / MIB}


def timed(reps: int, fsdps: list[bool]) -> None:
    """--background: blocking and background step checkpoints side by side (medians over `reps` saves)."""
    from statistics import median

    from longstride.parallel.spawn import run_gloo

    rows = []
    for fsdp in fsdps:
        for background in (False, True):
            with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
                run_gloo(_timed_worker, 2, fsdp, background, reps, root, out)
                for rank in range(2):
                    r = torch.load(os.path.join(out, f"rank{rank}.pt"))
                    med = lambda k: round(median(x[k] for x in r["rows"]), 3)  # noqa: E731
                    rows.append({"save": "background" if background else "blocking",
                                 "wrap": "FSDP2" if fsdp else "DDP", "rank": rank,
                                 "training held s": med("held_s"), "2 steps after it s": med("steps_after_s"),
                                 "2 steps, no save s": round(median(r["quiet"]), 3),
                                 "sealed by s": med("sealed_s"),
                                 "held at the return MiB": round(median(x["copy_mib"] for x in r["rows"])),
                                 **({"checksums, main rank alone s": round(r["hashing"]["alone_s"], 3),
                                     "checksums, shared s": round(r["hashing"]["shared_s"], 3)}
                                    if r["hashing"] else {})})
    print(f"Step checkpoints of SmolLM2-135M's shape with AdamW state, 2 gloo processes, medians of {reps} saves "
          "(measured)")
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))
    print("results:", write_results("bench_checkpoint_background", rows, {"shape": SHAPE, "reps": reps}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fsdp", choices=["both", "true", "false"], default="both")
    ap.add_argument("--background", action="store_true", help="time blocking and background (train.async_save) "
                    "step checkpoints instead")
    ap.add_argument("--reps", type=int, default=5, help="with --background: step checkpoints timed per mode")
    args = ap.parse_args()
    fsdps = [False, True] if args.fsdp == "both" else [args.fsdp == "true"]
    if args.background:
        return timed(args.reps, fsdps)
    from longstride.parallel.spawn import run_gloo

    rows = []
    for fsdp in fsdps:
        for kind in ["step", 1024, 128]:
            if kind == 128 and not fsdp:
                continue  # DDP's final is save_pretrained of the main rank's replica: no files to budget
            with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
                run_gloo(_worker, 2, fsdp, kind, root, out)
                for rank in range(2):
                    r = torch.load(os.path.join(out, f"rank{rank}.pt"))
                    rows.append({"save": "step (shards)" if kind == "step" else f"final (files <= {kind} MiB)",
                                 "wrap": "FSDP2" if fsdp else "DDP", "rank": rank,
                                 "written MiB": round(r["written_mib"], 1),
                                 "RSS before MiB": round(r["rss_before_mib"]),
                                 "save peak above it MiB": round(r["save_peak_mib"]), "params": r["params"]})
    print("Checkpoint saves of SmolLM2-135M's shape with AdamW state, 2 gloo processes (measured)")
    print_table(rows, list(rows[0]))
    print("results:", write_results("bench_checkpoint", rows, {"shape": SHAPE}))


if __name__ == "__main__":
    main()
