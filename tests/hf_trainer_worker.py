"""Trains the tiny model a few steps with the HF Trainer and longstride's collator, CP attention and
dataloader; run by tests/test_hf_trainer.py, on one process or under torchrun. Writes each step's global
loss (all processes' loss terms summed) and the final parameters to the file given as argv[1].

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.hf_trainer_worker OUT CP IMPL [KIND
        [PER_DEVICE_BATCH ACCUMULATION]]    (KIND: trainer, trainer_gc[_reentrant] (the Trainer's
        activation checkpointing), sft, or bad_row (a fault: a row only rank 1 reads is cut short))
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

STEPS, BATCH, L, LR = 3, 2, 96, 0.3


def documents() -> list[list[int]]:
    """Seeded token-id documents of mixed lengths (several per packed row, one longer than a row)."""
    g = torch.Generator().manual_seed(11)
    lens = [30, 1, 50, 15, 120, 7, 40, 60, 33, 21, 90, 5, 44, 38, 64, 17, 29, 70]
    return [torch.randint(2, 50, (n,), generator=g).tolist() for n in lens]


def tiny_lm():
    from longstride.model.build import build_model
    from longstride.model.config import ModelConfig

    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2)
    return build_model(cfg, rope_theta=1e4, seq_len=L, vocab_size=50, eos_id=0, pad_id=1, seed=5)


def sft_parts(packed):
    """TRL's SFTTrainer: its config, the same packed rows as a datasets.Dataset of already-tokenized input_ids
    and position_ids without padding (what TRL's own padding-free packing produces; the collator pads), and
    a tokenizer (SFTTrainer wants one; it tokenizes nothing here)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from longstride.data.tokenizer import train_bpe

    p, rows = packed.plan, []
    for i in range(len(p)):
        segs = range(int(p.seq_ptr[i]), int(p.seq_ptr[i + 1]))
        rows.append({"input_ids": [t for j in segs for t in packed.tokens[p.seg_start[j]:p.seg_start[j] + p.seg_len[j]]],
                     "position_ids": [t for j in segs for t in range(int(p.seg_len[j]))]})
    ds = datasets.Dataset.from_list([{k: [int(t) for t in v] for k, v in r.items()} for r in rows])
    tok = train_bpe(["a tiny corpus for a tokenizer that tokenizes nothing here"] * 4, 300)
    return SFTTrainer, SFTConfig, ds, {"processing_class": tok}


class BadRow(torch.utils.data.Dataset):
    """`rows` with row `bad` one token short."""

    def __init__(self, rows, bad: int):
        self.rows, self.bad = rows, bad

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        return {**row, "input_ids": row["input_ids"][:-1]} if i == self.bad else row


def bad_index(n: int, batch: int) -> int:
    """The first row of data-parallel rank 1's second batch of two (the mixin's sampler, seed 0)."""
    from longstride.data.loader import ShardSampler

    return list(ShardSampler(n, 1, 2, seed=0))[batch]


def train(out: str, cp: int, impl: str, kind: str = "trainer", batch: int = BATCH, accum: int = 1) -> None:
    from transformers import Trainer, TrainingArguments

    from longstride.parallel.attention import use_longstride_attention
    from longstride.recipes.hf.trainer import LongstrideCollator, LongstrideTrainerMixin, packed_dataset, setup_cp

    losses, micro, forwards = [], [], [0]
    data = packed_dataset(documents(), L, pad_id=1)
    base, config, extra = Trainer, TrainingArguments, {}
    if kind.startswith("trainer_gc"):  # the Trainer's own activation checkpointing of each decoder layer
        name = "activation_checkpointing" if "activation_checkpointing" in config.__dataclass_fields__ \
            else "gradient_checkpointing"  # (transformers < 5.2x)
        extra["args_kwargs"] = {name: True, f"{name}_kwargs": {"use_reentrant": kind.endswith("reentrant")}}
    if kind == "bad_row":  # the first row of rank 1's second batch is cut short: its collator refuses that batch
        data = BadRow(data, bad_index(len(data), batch))
    if kind == "sft":
        base, config, data, extra = sft_parts(data)
        # fp32 like the Trainer runs (SFTConfig turns bf16 on by default)
        extra["args_kwargs"] = {"dataset_kwargs": {"skip_prepare_dataset": True}, "max_length": None, "bf16": False}

    class Recorder(LongstrideTrainerMixin, base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            forwards[0] += 1
            term = loss.detach().clone() / self.accelerator.num_processes  # this process's share of the mean
            if dist.is_initialized():
                dist.all_reduce(term)
            micro.append(term.item())
            if len(micro) == accum:  # an optimizer step's micro-batches: their terms sum to the step's loss
                losses.append(sum(micro))
                micro.clear()
            return loss

    args = config(output_dir=out + ".run", per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                  max_steps=STEPS, learning_rate=LR,
                  lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, optim="sgd", use_cpu=True,
                  report_to="none", save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
                  **extra.pop("args_kwargs", {}))
    model = tiny_lm()
    use_longstride_attention(model)
    cpx = setup_cp(cp, model.config.num_attention_heads, impl, kernel="sdpa")
    trainer = Recorder(model=model, args=args, train_dataset=data,
                       data_collator=LongstrideCollator(cpx, pad_id=1), **extra)
    from longstride.model.loss import decoder_layers

    calls = [0] * len(decoder_layers(model))  # each layer's attention forwards: twice a micro-batch when recomputed
    for j, layer in enumerate(decoder_layers(model)):
        layer.self_attn.register_forward_pre_hook(lambda *_, j=j: calls.__setitem__(j, calls[j] + 1))
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the fault run: each rank's error, then out without destructors
        print(f"rank {dist.get_rank()} raised {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(3)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"losses": losses, "attention_calls": calls, "forwards": forwards[0],
                    "params": {k: v.detach().clone() for k, v in model.named_parameters()}}, out)
    if dist.is_initialized():
        # every rank has finished (rank 0 has written); then exit without running destructors: freeing DDP's reducer
        # joins gloo's worker thread while holding the GIL that thread waits for (a hang under load with dp=2),
        # and gloo's threads torn down at exit can abort a rank
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:5], *map(int, sys.argv[5:7]))
