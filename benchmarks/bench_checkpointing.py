"""Activation checkpointing modes compared on one training step: what each keeps and what its backward costs.

One sequence of L tokens through SmolLM2-135M's layer shape (576 hidden, 1536 MLP, 9/3 heads; fewer layers, so the
step is quick on a CPU), built as a training stage builds its step (recipes/run/step.py: longstride's attention,
chunked loss, lean RMSNorm, no tiles), on one process:
  none               nothing recomputed
  full               each layer keeps its input; backward recomputes the layer
  selective          each layer also keeps its matmuls' outputs and attention's output and lse (model/selective.py);
                     backward recomputes the elementwise ops only
  selective_matmuls  the policy selective had before: the matmuls' outputs kept, attention's forward recomputed
                     (under context parallelism too: its kernels and a ring's K/V exchange); here for comparison
  full_half          (--modes) full checkpointing of the first half of the layers only (model.checkpoint_layers),
                     the others keeping everything
Time: forward + backward (no optimizer), the modes interleaved round by round, median per mode and its ratio to none,
and the median of each round's ratio to none in that round (vs_none_paired: steadier where the machine is shared).
Memory: the bytes selective checkpointing's cache holds, counted as the policy keeps them (measured), and every
mode's activations per token from model/memory.estimate (fp32 and under bf16 autocast; the estimate's selective
figure is the measured cache plus the layer input, tests/test_memory_estimate.py). On a GPU (the device window's
`checkpointing` step) the step runs under bf16 autocast over fp32 weights, as one GPU trains, all 30 layers at 16K
by default, and each mode's peak is measured too (CUDA max_memory_allocated above what the step starts with, the
gradients included there: its activations and autocast's bf16 copies of the weights). With --cp N the step runs under
ring attention over N gloo processes on CPU (one thread each), where selective_matmuls also recomputes the ring's
K/V exchange; rank 0's times and cache (per local token). --cp-impl ulysses or upipe (N dividing the 9 heads: 3)
attends through Ulysses' all-to-alls instead, which each mode's row counts (calls and bytes a rank sends, forward
and backward, measured in its warm-up step).

    python -m benchmarks.bench_checkpointing [--length 2048 --layers 8 --reps 7]   # CPU, fp32
    python -m benchmarks.bench_checkpointing --out DIR/checkpointing.json           # on a GPU: 16K, 30 layers
    python -m benchmarks.bench_checkpointing --cp 2 [--length 8192 --layers 4]    # ring attention, 2 gloo ranks
    python -m benchmarks.bench_checkpointing --cp 3 --cp-impl ulysses             # Ulysses over 3 gloo ranks
    # writes benchmarks/results/bench_checkpointing.json (CPU) unless --out; --smoke: 256 tokens, 2 layers
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch

from benchmarks.common import KeptOutputs, write_json
from longstride.model import checkpointing, selective
from longstride.model.config import ModelConfig

OUT = os.path.join(os.path.dirname(__file__), "results", "bench_checkpointing.json")
MODES = ("none", "full", "selective", "selective_matmuls")
EXTRA = ("full_half",)  # --modes: full checkpointing of the first half of the layers (model.checkpoint_layers)


_RECORDED: list = []  # storage -> bytes of the outputs selective's cache keeps, while a dict is put here
_POLICY = checkpointing._selective_policy


def _record(op, outs: list) -> None:
    if _RECORDED:
        _RECORDED[0].update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in outs})  # once


_recording = KeptOutputs(_POLICY, _record)


def _ac(mode: str) -> str:
    """The checkpoint_mode a benchmark mode runs."""
    return "selective" if mode.startswith("selective") else "full" if mode.startswith("full") else mode


def _checkpoint_layers(mode: str, layers: int):
    """The layers a benchmark mode checkpoints: the first half for full_half, else every one (None)."""
    return layers // 2 if mode == "full_half" else None


def build(mode: str, layers: int, length: int, device: str, cp=None, compile_: bool = False):
    """(step module, its local batch) for `mode`, as recipes/run/step.py builds a stage's step; cp: this rank's
    CPContext (ring attention), None on one process; compile_: train.compile (benchmarks/bench_compile.py)."""
    from longstride.data.batch import collate, packed_item
    from longstride.model.build import build_model
    from longstride.parallel.cp import CPContext
    from longstride.parallel.kernels import resolve_kernel
    from longstride.recipes.run.step import StepSpec, build_step

    cfg = ModelConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, nope_interval=0)
    lm = build_model(cfg, rope_theta=1e5, seq_len=length, vocab_size=49152, eos_id=0, pad_id=1, seed=0).to(device)
    checkpointing._selective_policy = _recording  # bound when checkpointing is switched on
    try:
        # the kernel a one-device stage takes: torch's flash attention on CUDA (bf16 under autocast), sdpa on CPU
        kernel = resolve_kernel("auto", device, ring=False, half=device == "cuda", head_dim=cfg.hidden_size // 9)
        step = build_step(lm, StepSpec(_ac(mode), loss_tile=1024, checkpoint_layers=_checkpoint_layers(mode, layers),
                                       compile=compile_), cp or CPContext(kernel=kernel))
    finally:
        checkpointing._selective_policy = _POLICY
    ids = torch.randint(2, 49152, (1, length), generator=torch.Generator().manual_seed(0))
    return step, step.prep(collate([packed_item([ids[0].numpy()], length, pad_id=1)])), lm


class _Exchanges:
    """Counts Ulysses' all-to-alls (calls, bytes this rank sends) while `phase` names where they are counted."""

    def __init__(self):
        from longstride.parallel import ulysses

        self.counts, self.phase, exchange = {}, None, ulysses.all_to_all_single

        def counted(recv, send, *args, **kwargs):
            if self.phase is not None:
                n, b = self.counts.get(self.phase, (0, 0))
                self.counts[self.phase] = (n + 1, b + send.numel() * send.element_size())
            return exchange(recv, send, *args, **kwargs)

        ulysses.all_to_all_single = counted


_EXCHANGES: list = []  # an _Exchanges while one counts


def run_step(step, local, mode: str, device: str, cached: dict | None = None) -> tuple[float, int | None]:
    """(seconds, CUDA peak bytes above the start or None on CPU) of one forward + backward; cached: collects the
    bytes selective's cache holds (and the Ulysses exchanges counted, under the key "exchanges")."""
    from longstride.recipes.run.step import loss_sum

    kept = selective.ATTENTION_OPS
    selective.ATTENTION_OPS = set() if mode == "selective_matmuls" else kept  # read at each op
    _RECORDED[:] = [cached] if cached is not None else []
    cuda = device == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        counter = _EXCHANGES[0] if _EXCHANGES and cached is not None else None
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            if counter:
                counter.counts, counter.phase = {}, "forward"
            loss = loss_sum(step.module, local, device)
        if counter:
            counter.phase = "backward"
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if counter:
            cached["exchanges"] = {k: {"calls": n, "bytes": b} for k, (n, b) in counter.counts.items()}
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - start if cuda else None
    finally:
        if _EXCHANGES:
            _EXCHANGES[0].phase = None
        selective.ATTENTION_OPS = kept
        _RECORDED.clear()


def measure(args, device: str, cp=None) -> tuple:
    """Each mode's step times and CUDA peaks over args.reps interleaved rounds, what selective's cache holds a local
    token a layer, and the model's config and layer_parts. cp: this rank's CPContext; each step starts together on
    every rank."""
    import torch.distributed as dist

    from longstride.model.memory import layer_parts

    sync = dist.barrier if cp is not None else (lambda: None)
    built = {m: build(m, args.layers, args.length, device, cp) for m in args.modes}
    cache, peak, exchanges = {}, {m: [] for m in args.modes}, {}
    for m in args.modes:  # a first step each (warm-up), counting what selective's cache holds
        got = {}
        sync()
        run_step(*built[m][:2], m, device, got)
        exchanges[m] = got.pop("exchanges", None)
        tokens = built[m][1][0]["input_ids"].numel()
        cache[m] = sum(got.values()) / tokens / args.layers if m.startswith("selective") else None
        built[m][2].zero_grad(set_to_none=False)  # the gradients stay allocated: a step's peak is above them
    times = {m: [] for m in args.modes}
    for _ in range(args.reps):
        for m in args.modes:
            sync()
            seconds, top = run_step(*built[m][:2], m, device)
            times[m].append(seconds)
            peak[m].append(top)
            built[m][2].zero_grad(set_to_none=False)
    lm = built["none"][2]
    return times, peak, cache, lm.config, layer_parts(lm, lean_norms=True), exchanges


def _degrees(args):
    """--cp's degrees for --cp-impl over the model's 9 query heads (UPipe: 3 a stage)."""
    from longstride.parallel.config import CPDegrees, ParallelConfig
    from longstride.parallel.cp import cp_degrees

    if args.cp == 1:
        return CPDegrees()
    return cp_degrees(ParallelConfig(cp_impl=args.cp_impl, upipe_heads=3 if args.cp_impl == "upipe" else 0), args.cp,
                      heads=9)


def _cp_rank(rank: int, world: int, args, path: str) -> None:
    """One gloo rank of --cp: --cp-impl attention over `world` CPU processes, one thread each; rank 0 saves what it
    measured (each rank's step ends with the ring's last exchange, so their times agree)."""
    from longstride.parallel.config import ParallelDims
    from longstride.parallel.cp import cp_context

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cp = cp_context(args.cp_impl, ParallelDims(world, 1, world), _degrees(args), "cpu", "sdpa")
    if args.cp_impl != "ring":
        _EXCHANGES[:] = [_Exchanges()]
    got = measure(args, "cpu", cp)
    if rank == 0:
        torch.save(got, path)


def main(argv=None) -> dict:
    from longstride.model.memory import estimate, ulysses_keeps

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, help="default 16384 on a GPU, 2048 on CPU")
    ap.add_argument("--layers", type=int, help="default 30 on a GPU, 8 on CPU")
    ap.add_argument("--reps", type=int, help="default 5 on a GPU, 7 on CPU")
    ap.add_argument("--cp", type=int, default=1, help="ring attention over this many gloo processes (on CPU)")
    ap.add_argument("--cp-impl", default="ring", choices=("ring", "ulysses", "upipe"),
                    help="with --cp: the CP method (ulysses and upipe: --cp 3, which divides the 9 heads; upipe runs "
                         "3 heads a stage)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES + EXTRA}")
    ap.add_argument("--smoke", action="store_true", help="256 tokens, 2 layers, 1 round")
    ap.add_argument("--out", default=None, help=f"default {OUT} (with --cp N: bench_checkpointing_cpN.json)")
    args = ap.parse_args(argv)
    args.modes = tuple(args.modes.split(","))
    if not {"none", "selective", "selective_matmuls"} <= set(args.modes) or not set(args.modes) <= {*MODES, *EXTRA}:
        ap.error(f"--modes: none, selective and selective_matmuls (the ratios' references) and any of {MODES + EXTRA}")
    gpu = torch.cuda.is_available() and args.cp == 1
    device = "cuda" if gpu else "cpu"
    for name, on_gpu, on_cpu, smoke in (("length", 16384, 2048, 256), ("layers", 30, 8, 2), ("reps", 5, 7, 1)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else on_gpu if gpu else on_cpu)
    if args.cp_impl != "ring":
        if args.cp != 3:
            ap.error(f"--cp-impl {args.cp_impl}: --cp 3 (the Ulysses degree must divide the 9 query heads)")
        args.length -= args.length % 6 if args.smoke else 0  # 2 chunks, each split over the 3 ranks
    impl = "" if args.cp_impl == "ring" else f"_{args.cp_impl}"
    args.out = args.out or (OUT.replace(".json", f"_cp{args.cp}{impl}.json") if args.cp > 1 else OUT)
    if args.cp > 1:
        from longstride.parallel.spawn import run_gloo

        with tempfile.TemporaryDirectory() as d:
            run_gloo(_cp_rank, args.cp, args, os.path.join(d, "rank0.pt"))
            times, peak, cache, config, parts, exchanges = torch.load(os.path.join(d, "rank0.pt"),
                                                                      weights_only=False)
    else:
        if not gpu:
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1)
        times, peak, cache, config, parts, exchanges = measure(args, device)
    H, ulysses = config.hidden_size, _degrees(args).plain_ulysses(config.num_attention_heads)
    rows = []
    for m in args.modes:
        med = statistics.median(times[m])
        # each round runs every mode back to back: its ratio to none in the same round is steadier on a shared machine
        paired = statistics.median(t / n for t, n in zip(times[m], times["none"]))
        row = {"mode": m, "step_s_median": round(med, 3), "vs_none": round(med / statistics.median(times["none"]), 3),
               "vs_none_paired": round(paired, 3), "step_s": [round(t, 3) for t in times[m]],
               "cache_bytes_per_token_layer_measured": cache[m]}  # None: no cache in that mode
        if exchanges[m] is not None:
            row["all_to_alls_per_step_measured"] = exchanges[m]  # rank 0's, sent bytes
        if cache[m] is not None:
            row["cache_per_token_layer_measured_H"] = round(cache[m] / 4 / H, 2)
        if gpu:
            # above the step's start (the gradients allocated before it): activations, autocast's bf16 weight copies
            row["peak_gib_measured"] = round(max(peak[m]) / 2 ** 30, 3)
        heads = config.num_attention_heads
        for name, b, autocast in (("fp32", 4, False), ("bf16_autocast", 2, True)):
            # per layer: full_half's mean over its checkpointed and whole layers
            est = estimate(config, 1, 1, _ac(m), 0, 1024, act_bytes=b, parts=parts, autocast=autocast,
                           ac_layers=_checkpoint_layers(m, args.layers),
                           ulysses=ulysses)["layers_bytes_per_token"] / args.layers
            if m == "selective_matmuls":  # without attention's output and log-sum-exp, or Ulysses' exchange
                est -= b * H + 4 * heads + ulysses_keeps(config, b, ulysses)  # (heads x head size = H in this model)
            row[f"layer_bytes_per_token_{name}_estimate_H"] = round(est / 4 / H, 2)
        rows.append(row)
    from longstride.parallel.kernels import resolve_kernel

    result = {"kernel": resolve_kernel("auto", device, ring=False, half=gpu),
              "what": "one forward + backward of SmolLM2-135M's layer shape, 1 sequence, "
                      + ("bf16 autocast over fp32 weights" if gpu else "CPU fp32")
                      + (f", {args.cp_impl} attention over {args.cp} gloo processes (one thread each; rank 0's times; "
                         "cache per local token)" if args.cp > 1 else ""), "cp": args.cp, "cp_impl": args.cp_impl,
              "device": torch.cuda.get_device_name(0) if gpu else "cpu", "cuda": torch.version.cuda,
              "length": args.length, "layers": args.layers, "reps": args.reps, "torch": torch.__version__,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "cache_note": "selective's cache is counted in the warm-up step, under the same autocast",
              "memory_note": "cache_*_measured: what selective's cache holds a token a layer, each storage once; "
                             "layer_bytes_per_token_*_estimate_H: what each layer keeps for backward, in fp32 values "
                             "of the hidden width (model/memory.estimate; selective's = its cache + the layer input)",
              # what keeping attention's output saves: each round's selective time over its selective_matmuls time
              "selective_vs_selective_matmuls_paired": round(statistics.median(
                  a / b for a, b in zip(times["selective"], times["selective_matmuls"])), 3),
              "rows": rows}
    for r in rows:
        print(r)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
