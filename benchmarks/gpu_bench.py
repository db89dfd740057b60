"""GPU training benchmarks (run by benchmarks/gpu_check.py): one training step's tokens/s and MFU, longstride
against plain transformers on the same packed batch; the longest context one GPU trains; document-masked
attention against dense causal and the ideal sum(d^2)/L^2.

Systems, each a real bf16 AdamW step (fp32 master weights, bf16 autocast, as `longstride train` runs), the gradients
clipped to norm 1.0:
  longstride       the model with longstride attention (torch_flash, documents masked) and the chunked loss;
                   for the longest context also tiled layers, full activation checkpointing and offload
  longstride_compiled  the same step with train.compile (model/compile.py: each layer's parts compiled, attention
                   outside the graphs); only at the lengths asked for (gpu_check --compile): each length compiles anew,
                   in the warm-up steps
  hf_sdpa_packed   plain transformers, SDPA, position ids reset per document: transformers builds the
                   document mask itself (its packed-sequence path)
  hf_sdpa_causal   plain transformers, SDPA, one causal sequence (documents not masked: the fast, wrong baseline)
  hf_flash_attention_2  plain transformers' packed flash-attn path, where flash-attn is installed
  hf_flex_packed   plain transformers with FlexAttention on the packed sequence (its document block mask;
                   compiled per shape, so only on request: gpu_check --flex)
The documents are best-fit packed from the embedded corpus (benchmarks/bench_ring.packed_doc_ids).
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from longstride.model.compile import compile_status, fresh_start
from longstride.parallel.varlen import flash_attn_available
from longstride.recipes.run.flops import peak_flops, train_flops as model_flops

SHAPES = {  # LlamaConfig fields
    "smollm2_135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama_1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}


def systems(flex: bool = False, compiled: bool = False) -> list[str]:
    return (["longstride"] + (["longstride_compiled"] if compiled else []) + ["hf_sdpa_packed", "hf_sdpa_causal"] +
            (["hf_flash_attention_2"] if flash_attn_available() else []) + (["hf_flex_packed"] if flex else []))


def doc_pairs(doc: torch.Tensor) -> int:
    lens = torch.unique_consecutive(doc[0], return_counts=True)[1].long()
    return int((lens * (lens + 1) // 2).sum())


def train_flops(shape: dict, tokens: int, pairs: int) -> float:
    """Model FLOPs of one training step of `shape` (recipes/run/flops.py, the loop's own count): its linear
    layers' weights per token, and attention over the `pairs` (query, key) pairs the mask allows, in every layer."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    linear = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * shape["vocab_size"]
    return model_flops(linear, h, tokens, layers * pairs)


@dataclass
class Step:
    """One system's model, optimizer and batch; run() does one optimizer step: longstride's through the stage loop's
    own update (recipes/run/step.optimizer_step: gradient norm, clipping to 1.0, the update; its batch copied to the
    GPU each step, as the loop's is), plain transformers' as the HF Trainer does it (its mean loss, clipping to 1.0,
    the update; its batch on the GPU already). Figures recorded before 2026-12-01 come from the step without
    clipping."""

    system: str
    model: object  # longstride: parallel/parallelize.OneDevice; plain transformers: its model
    optimizer: torch.optim.Optimizer
    batch: dict
    device: torch.device

    def run(self) -> None:
        if self.system.startswith("longstride"):
            from longstride.recipes.run.step import optimizer_step

            optimizer_step(self.model, self.optimizer, [self.batch["local"]], self.batch["count"], self.device,
                           grad_clip=1.0)
            return
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=self.batch["input_ids"], position_ids=self.batch["position_ids"],
                              labels=self.batch["input_ids"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def build_step(system: str, shape: dict, doc: torch.Tensor, device: torch.device, lean: bool = False) -> Step:
    """doc: (1, L) document ids. lean: longstride with tiled layers, full checkpointing and offload."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longstride.data.batch import packed_item
    from longstride.parallel.cp import CPContext
    from longstride.parallel.parallelize import OneDevice
    from longstride.recipes.config.schema import OptimConfig
    from longstride.recipes.run.step import StepSpec, build_optimizer, label_count
    from longstride.recipes.run.step import build_step as build_longstride_step

    L = doc.shape[1]
    cfg = LlamaConfig(**shape, max_position_embeddings=L, rope_theta=1e5)
    attn = {"hf_sdpa_packed": "sdpa", "hf_sdpa_causal": "sdpa", "hf_flash_attention_2": "flash_attention_2",
            "hf_flex_packed": "flex_attention"}
    torch.manual_seed(0)
    with torch.device(device):
        lm = LlamaForCausalLM._from_config(cfg, attn_implementation=attn.get(system, "sdpa"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (1, L), generator=g)
    lens = torch.unique_consecutive(doc[0], return_counts=True)[1]
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    pos = torch.arange(L) if system == "hf_sdpa_causal" else torch.arange(L) - starts
    batch = {"input_ids": ids.to(device), "position_ids": pos[None].to(device)}
    model = lm
    if system.startswith("longstride"):  # the training step (recipes/run/step.py), its batch: data.batch.packed_item
        if system == "longstride_compiled":  # as a stage starts (model/compile.py): its counts are this row's
            fresh_start()
        spec = StepSpec("full" if lean else "none", offload=lean and device.type == "cuda",
                        mlp_tile=4096 if lean else 0, loss_tile=8192, compile=system == "longstride_compiled")
        step = build_longstride_step(lm, spec, CPContext(kernel="torch_flash" if device.type == "cuda" else "sdpa"))
        model = OneDevice(step.module, torch.bfloat16 if device.type == "cuda" else None)
        item = packed_item([ids[0, a:a + n].numpy() for a, n in zip((lens.cumsum(0) - lens).tolist(), lens.tolist())],
                           L, pad_id=0)
        local = step.prep({k: torch.from_numpy(v)[None] for k, v in item.items()})
        batch.update(local=local, count=torch.tensor(float(label_count(local))))
    optimizer = build_optimizer(lm, OptimConfig(), lr=1e-5, device_type=device.type)  # as a stage builds it
    return Step(system, model, optimizer, batch, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of fn() (one optimizer step, or one attention forward + backward)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # the pinned host blocks of the activation offload
            torch._C._host_emptyCache()
        torch.cuda.reset_peak_memory_stats(device)


def out_of_memory(e: Exception) -> bool:
    """A CUDA or pinned-host allocation failure (cuBLAS and the host allocator raise plain RuntimeErrors)."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def throughput(shapes: list[str], lengths: list[int], device: torch.device, warmup: int = 2, reps: int = 5,
               flex: bool = False, compile_lengths: tuple = ()) -> list:
    """tokens/s and MFU of one training step per (shape, length, system), on the same packed batch; the compiled
    longstride step at `compile_lengths` only."""
    from benchmarks.bench_ring import packed_doc_ids

    rows, peak = [], peak_flops(device)
    for length in lengths:
        doc = packed_doc_ids(length, 1)[0]
        for shape_name in shapes:
            shape = SHAPES[shape_name]
            for system in systems(flex, compiled=length in compile_lengths):
                row = {"shape": shape_name, "seq_len": length, "system": system, "docs": int(doc.max()) + 1}
                try:
                    free(device)
                    step = build_step(system, shape, doc, device)
                    sec = time_steps(step.run, device, warmup, reps)
                    pairs = length * (length + 1) // 2 if system == "hf_sdpa_causal" else doc_pairs(doc)
                    flops = train_flops(shape, length, pairs)
                    row.update(step_s=sec, tokens_per_s=length / sec, peak_gib=peak_gib(device),
                               tflops=flops / sec / 1e12, mfu=flops / sec / peak if peak else None)
                    if system == "longstride_compiled":  # a fall-back to eager would be no compiled figure
                        row.update(compile_status()._asdict())
                except Exception as e:  # recorded per row: the other systems and lengths still run
                    row["error"] = "out of memory" if out_of_memory(e) else f"{type(e).__name__}: {e}"[:300]
                finally:
                    step = None
                rows.append(row)
                print(row, flush=True)
    free(device)
    return rows


def fits(system: str, shape: dict, length: int, device: torch.device, lean: bool) -> tuple[bool, float | None, str]:
    """Whether two real optimizer steps at `length` tokens fit; (fits, seconds of the second step, the error
    if it failed otherwise than by running out of memory)."""
    from benchmarks.bench_ring import packed_doc_ids

    step = None
    try:
        free(device)
        step = build_step(system, shape, packed_doc_ids(length, 1)[0], device, lean=lean)
        return True, time_steps(step.run, device, 1, 1), ""
    except Exception as e:
        return False, None, "" if out_of_memory(e) else f"{type(e).__name__}: {e}"[:300]
    finally:
        step = None
        free(device)


def longest_context(shape_name: str, device: torch.device, start: int, limit: int, budget_s: float) -> list:
    """Per system: lengths doubled from `start` until a step no longer fits (or `limit`, or the time budget
    runs out), then halved intervals between the last fit and the first failure, to 1/8 of it."""
    shape, rows = SHAPES[shape_name], []
    for system, lean in (("hf_sdpa_packed", False), ("longstride", True)):
        t0, ok, bad, trials = time.perf_counter(), 0, None, []
        length = start
        while length <= limit and time.perf_counter() - t0 < budget_s:
            fit, sec, err = fits(system, shape, length, device, lean)
            trials.append({"seq_len": length, "fits": fit, "step_s": sec, **({"error": err} if err else {})})
            print(system, trials[-1], flush=True)
            if not fit:
                bad = length
                break
            ok, length = length, length * 2
        while bad and ok and bad - ok > max(ok // 8, 1024) and time.perf_counter() - t0 < budget_s:
            mid = (ok + bad) // 2 // 1024 * 1024
            fit, sec, err = fits(system, shape, mid, device, lean)
            trials.append({"seq_len": mid, "fits": fit, "step_s": sec, **({"error": err} if err else {})})
            print(system, trials[-1], flush=True)
            ok, bad = (mid, bad) if fit else (ok, mid)
        rows.append({"shape": shape_name, "system": system + (" (tiled, checkpointed, offloaded)" if lean else ""),
                     "longest_fit": ok, "first_failure": bad,
                     # why the search stopped without a failure: the length limit, or its time budget (a lower bound)
                     "stopped_by": "failure" if bad else ("limit" if length > limit else "time budget"),
                     "trials": trials})
    return rows


def doc_attention_timing(length: int, device: torch.device, reps: int = 10, min_docs: int = 1) -> list:
    """Forward + backward of the 1B shape's attention (32:8 heads, head dim 64, bf16) on packed documents vs
    one causal sequence of the same length; the ideal time ratio is the ratio of causal pairs."""
    from benchmarks.bench_ring import packed_doc_ids
    from longstride.parallel.kernels import doc_attention

    kernel = "torch_flash" if device.type == "cuda" else "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, L, h, 64, generator=g).to(device, dtype).transpose(1, 2)
                     for L, h in ((length, 32), (length, 8), (length, 8), (length, 32)))
    rows = []
    for i, doc in enumerate(packed_doc_ids(length, 3, min_docs=min_docs)):
        doc = doc.to(device)
        x = [t.detach().requires_grad_(True) for t in (q, k, v)]

        def run(ids):
            doc_attention(*x, ids, 64 ** -0.5, kernel).backward(dout)

        masked = time_steps(lambda: run(doc), device, 2, reps)
        causal = time_steps(lambda: run(None), device, 2, reps)
        ideal = doc_pairs(doc.cpu()) / (length * (length + 1) / 2)
        rows.append({"seq_len": length, "sequence": i, "docs": int(doc.max()) + 1, "kernel": kernel,
                     "masked_ms": masked * 1e3, "causal_ms": causal * 1e3, "time_ratio": masked / causal,
                     "ideal_ratio": ideal, "vs_ideal": masked / causal / ideal})
        print(rows[-1], flush=True)
    return rows

