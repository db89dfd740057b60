"""What a step checkpoint's save costs, per rank: bytes written and the process's peak host memory during
the save, for SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocab 49152; 135M parameters) with
AdamW state, on 2 gloo processes, through the training loop's own save (recipes/stage_state.py's pieces:
Parallelized.weights_saver, Parallelized.optimizer_state, recipes/checkpoint.save_checkpoint).

The save today gathers the whole model and the whole AdamW state on every rank's CPU under FSDP2 (and holds
them whole under DDP), and the main rank writes them: the "before" of issue 35's sharded checkpoints, whose
figures this benchmark is for. Peak = the largest resident set during the save minus the resident set just
before it (ru_maxrss is a high-water mark, so each rank measures in a fresh process, after one step).

    python -m benchmarks.bench_checkpoint [--fsdp both|true|false]
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile

import torch

from benchmarks.common import print_table, write_results

MIB = 2 ** 20
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _worker(rank, world, fsdp, root, out):
    from accelerate import Accelerator

    from longstride.model.build import build_model
    from longstride.model.config import ModelConfig
    from longstride.model.loss import ChunkedLossLM
    from longstride.parallel.config import WorldMesh
    from longstride.parallel.parallelize import parallelize
    from longstride.recipes.checkpoint import rng_state, save_checkpoint

    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    lm = build_model(ModelConfig(**SHAPE), rope_theta=1e5, seq_len=256, vocab_size=SHAPE["vocab_size"], eos_id=0,
                     pad_id=1, seed=0)
    model = parallelize(ChunkedLossLM(lm, 256), lm.model.layers, fsdp, acc, WorldMesh("cpu", world) if fsdp else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(2, SHAPE["vocab_size"], (1, 64))
    model.backward(model(ids, ids, torch.arange(64)[None]))
    opt.step()  # AdamW state exists, as in any step checkpoint
    torch.distributed.barrier()
    before = rss_mib()
    path = os.path.join(root, "s1", "step_000001")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_lm = model.weights_saver(lm)
    state = model.optimizer_state(opt)
    save_checkpoint(path, rank=rank, is_main=rank == 0, barrier=torch.distributed.barrier, save_model=save_lm,
                    trainer_state={"optimizer": state, "step": 1}, rank_state={"rng": rng_state()},
                    meta={"step": 1}, world_size=world)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mine = [f"rank{rank}.pt"] + (["model.safetensors", "trainer.pt", "config.json", "stage.json",
                                  "manifest.json"] if rank == 0 else [])
    written = sum(os.path.getsize(os.path.join(path, f)) for f in mine if os.path.exists(os.path.join(path, f)))
    torch.save({"rank": rank, "written_mib": written / MIB, "rss_before_mib": before, "peak_mib": peak,
                "save_peak_mib": peak - before, "params": sum(p.numel() for p in lm.parameters())},
               os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fsdp", choices=["both", "true", "false"], default="both")
    args = ap.parse_args()
    from longstride.parallel.spawn import run_gloo

    rows = []
    for fsdp in ([False, True] if args.fsdp == "both" else [args.fsdp == "true"]):
        with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
            run_gloo(_worker, 2, fsdp, root, out)
            for rank in range(2):
                r = torch.load(os.path.join(out, f"rank{rank}.pt"))
                rows.append({"wrap": "FSDP2" if fsdp else "DDP", "rank": rank, "written MiB": round(r["written_mib"], 1),
                             "RSS before MiB": round(r["rss_before_mib"]), "save peak above it MiB":
                             round(r["save_peak_mib"]), "params": r["params"]})
    print("Step-checkpoint save of SmolLM2-135M's shape with AdamW state, 2 gloo processes (measured)")
    print_table(rows, list(rows[0]))
    print("results:", write_results("bench_checkpoint", rows, {"shape": SHAPE}))


if __name__ == "__main__":
    main()
