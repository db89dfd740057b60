"""longstride's packed, document-masked batches and context-parallel attention inside the HF Trainer
(and TRL's SFTTrainer, which is a Trainer).

The Trainer's own context parallelism (accelerate's ParallelismConfig) accepts SDPA with a plain causal
mask only; this module brings longstride's instead: ring, Ulysses, UPipe or Ulysses x ring over any
number of processes, each document attending to itself only, no L x L mask, no padding per document.

    from longstride.recipes.hf.trainer import LongstrideCollator, LongstrideTrainerMixin, packed_dataset, setup_cp

    args = TrainingArguments(...)                     # initialises torch.distributed under a launcher
    cp = setup_cp(cp=2, config=model.config, args=args)   # CP groups over the launched processes
    use_longstride_attention(model)                   # longstride.parallel.attention
    class Trainer(LongstrideTrainerMixin, transformers.Trainer): ...   # or (LongstrideTrainerMixin, SFTTrainer)
    trainer = Trainer(model=model, args=args, train_dataset=packed_dataset(docs, 4096, pad_id),
                      data_collator=LongstrideCollator(cp, pad_id=pad_id))
    accelerate launch --config_file configs/accelerate/cpu.yaml train_script.py    # or torchrun

What each piece does:
- `packed_dataset` packs token-id documents into rows of exactly seq_len by best-fit-decreasing (the
  recipe's own packer, data/packing.py); `LongstrideCollator` also takes rows packed elsewhere (TRL's
  `packing=True` rows: input_ids, labels with -100 on tokens without loss, seq_lengths; or position_ids
  restarting at each document).
- The collator builds the PackedBatch (document-local labels, positions, document ids), cuts this
  rank's CP share (zig-zag ring share, then its Ulysses piece) and passes the document layout to the
  model as the `doc_layout` keyword, which transformers hands to every attention call. Labels are
  already aligned to the next token (none across a document boundary), so they travel as
  `shift_labels` and the model's loss does not shift them again.
- A model that reads positions from the tokens one rank holds (longrope past its window, Llama 4's query
  temperature) is refused by the collator at the first batch split past that point (parallel/attention.py
  position_dependent), before the batch reaches the model.
- The mixin's dataloader gives every CP rank of a group the same sequences and each data-parallel
  group its own share (data/loader.ShardSampler, the recipe's sampler), instead of accelerate's split
  over all processes. It follows the TrainingArguments' data_seed (else seed), train_sampling_strategy
  ('random' or 'sequential'; grouping by length is refused: rows are packed), dataloader_drop_last,
  pin_memory, persistent_workers and prefetch_factor. One process driving several GPUs (n_gpu > 1,
  DataParallel) is refused: launch one process per GPU.
- Loss normalisation needs nothing extra: the Trainer counts the label tokens of every process
  (`average_tokens_across_devices`, on by default), each CP rank's loss is its tokens' sum over that
  global count times the process count, and DDP's gradient average then gives the gradient of the
  mean over the whole global batch, exactly as one process would; gradient accumulation divides by the
  count over all its micro-batches. What would break that is refused at the first dataloader
  (`check_loss_setup`): `average_tokens_across_devices=False` over several processes (a mean by rank),
  a model whose forward takes no loss keywords (a mean per micro-batch), and label smoothing (the Trainer's
  LabelSmoother shifts the already-aligned labels again). A `compute_loss_func` gets those aligned labels: it
  must not shift them.
- A training batch that one rank cannot read or collate (a bad row only its data-parallel group reads) ends every
  rank at that batch (the mixin's `get_batch_samples`, one small all-reduce per optimizer step), the others naming
  another rank, instead of leaving them in the next collective until the Trainer's `ddp_timeout`.
- Evaluation under CP is refused: the Trainer splits evaluation rows over every process, so the CP ranks
  of one group would hold different sequences. Evaluate with cp=1, or with the recipe's own validation loss.
"""
from __future__ import annotations

import os

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from longstride.data.batch import PackedSequences, collate, context_only, packed_item
from longstride.data.loader import ShardSampler
from longstride.data.packing import pack
from longstride.model.loss import IGNORE_INDEX, router_aux_loss
from longstride.parallel.attention import head_shape, position_dependent
from longstride.parallel.collectives import together
from longstride.parallel.config import ParallelConfig, ParallelDims
from longstride.parallel.cp import CPContext, cp_context, cp_degrees, shard_for_cp
from longstride.parallel.kernels import resolve_kernel
from longstride.parallel.pattern import config_softcap


def setup_cp(cp: int, heads: int = 0, impl: str = "ring", ulysses: int = 0, upipe_heads: int = 0,
             device_type: Optional[str] = None, kernel: str = "auto", half: Optional[bool] = None,
             head_dim: int = 0, softcap: bool = False, args=None, config=None) -> CPContext:
    """This process's CP group over the launched processes (torch.distributed must be initialised, as
    TrainingArguments does under a launcher): world = dp x cp, CP groups of contiguous ranks. config: the model's
    config (model.config), from which the model's query heads (checked against the Ulysses degree), head size
    (which the flash kernels limit) and soft-capped scores (Gemma 2, which only math and flash_attn compute) are
    read; without it give them as heads, head_dim (0: unchecked) and softcap. kernel: parallel.kernel's choices;
    half: attention runs in bf16/fp16, which the flash kernels need; None reads it from `args` (the
    TrainingArguments: bf16=True / fp16=True), else from `accelerate launch --mixed_precision`. On CUDA with
    neither, it is refused: the kernel would be chosen for fp32 (not the flash kernel) without a word."""
    if config is not None:
        config_heads, config_dim = head_shape(config)
        for name, given, read in (("heads", heads, config_heads), ("head_dim", head_dim, config_dim)):
            if given and given != read:
                raise ValueError(f"setup_cp: {name}={given} but config has {read}; pass config alone")
        heads, head_dim = config_heads, config_dim
        softcap = softcap or bool(config_softcap(config.get_text_config() if hasattr(config, "get_text_config")
                                                 else config))
    if not heads:
        raise ValueError("setup_cp: pass config=model.config (or heads=, the model's query heads)")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    # accelerate launch --mixed_precision, which the Trainer's Accelerator takes too; "no" is what the launcher sets
    # whenever it is not given, which a TrainingArguments(bf16=True) overrides: it says nothing on its own
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if half is None and (args is not None or launcher in ("bf16", "fp16")):
        half = bool(args is not None and (args.bf16 or args.fp16)) or launcher in ("bf16", "fp16")
    if half is None:
        if device_type == "cuda":
            raise ValueError("setup_cp: pass args=<your TrainingArguments> (or half=True/False): whether attention "
                             "runs in bf16/fp16 picks the kernel")
        half = False
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_world(world, cp, where="setup_cp")
    degrees = cp_degrees(ParallelConfig(cp_impl=impl, ulysses=ulysses, upipe_heads=upipe_heads), cp, heads)
    return cp_context(impl, dims, degrees, device_type, resolve_kernel(kernel, device_type, ring=cp > 1, half=half,
                                                                     head_dim=head_dim, softcap=softcap))


def packed_dataset(docs: list, seq_len: int, pad_id: int, method: str = "best_fit") -> PackedSequences:
    """Token-id documents -> a Dataset of packed rows of exactly seq_len tokens (data/batch.py items)."""
    lens = np.array([len(d) for d in docs], dtype=np.int64)
    if not len(lens) or lens.min() < 1:
        raise ValueError("packed_dataset: give a non-empty list of non-empty token-id documents")
    tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
    plan, _ = pack(np.cumsum(lens) - lens, lens, seq_len, method)
    return PackedSequences(tokens, plan, pad_id)


ROW_KEYS = ("input_ids", "labels", "position_ids", "seq_lengths", "attention_mask")
LOSS_MASKS = ("completion_mask", "assistant_masks")  # they change the loss: never dropped


def _documents(row: dict, drop_unused: bool = False) -> list[np.ndarray]:
    """A row packed elsewhere -> its documents, token ids stored as the recipe stores them (data/batch.py:
    a token that is no loss target as context_only(id)). Documents are cut at `seq_lengths` (TRL's packing) or
    where `position_ids` restart at 0 (one document when the row has neither); `labels`, as HF and TRL build
    them (the token itself where it is a loss target, -100 where not: prompts under completion_only_loss or
    assistant_only_loss), mark the tokens without loss; `attention_mask` zeros may only pad the row's end. Another
    key is dropped with `drop_unused` (TrainingArguments.remove_unused_columns, as the Trainer drops a dataset's
    unused columns: text, id, ...), else refused; a loss-mask column is refused unless the row has `labels`, which
    then decide the loss (TRL keeps completion_mask beside labels it built with completion_only_loss=False, and
    its own collator then ignores the mask)."""
    ignored = set(LOSS_MASKS) if "labels" in row else set()  # the labels decide the loss
    unread = sorted(k for k in set(row) - set(ROW_KEYS) - ignored if not drop_unused or k in LOSS_MASKS)
    if unread:
        hint = " (build labels from them: -100 where a token is no loss target, as SFTTrainer's dataset " \
               "preparation does)" if set(LOSS_MASKS) & set(unread) else ""
        raise ValueError(f"LongstrideCollator: a packed row's {unread} would be dropped{hint}; it reads "
                         f"{list(ROW_KEYS)}")
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    n = len(ids)
    if row.get("attention_mask") is not None:
        mask = np.asarray(row["attention_mask"]).astype(bool)
        n = int(mask.sum())
        if not mask[:n].all():
            raise ValueError("LongstrideCollator: a packed row's attention_mask has zeros before its end; only "
                             "right padding is dropped (documents are given by seq_lengths or position_ids)")
    if row.get("labels") is not None:
        labels = np.asarray(row["labels"], dtype=np.int64)
        target = labels[:n] != IGNORE_INDEX
        if labels.shape != ids.shape or np.any(labels[:n][target] != ids[:n][target]):
            raise ValueError("LongstrideCollator: a packed row's labels must be its input_ids (unshifted, as HF and "
                             "TRL build them) with -100 where a token is no loss target")
        ids = np.where(labels != IGNORE_INDEX, ids, context_only(ids))
    ids = ids[:n]  # right padding dropped: the collator pads the batch as one trailing padding document
    cuts = None
    if row.get("seq_lengths") is not None:
        lens = np.asarray(row["seq_lengths"], dtype=np.int64)
        if lens.sum() != n or (lens < 1).any():
            raise ValueError(f"LongstrideCollator: a packed row's seq_lengths {lens.tolist()} must be positive and "
                             f"sum to its {n} tokens")
        cuts = np.cumsum(lens)[:-1]
    if row.get("position_ids") is not None:
        starts = np.flatnonzero(np.asarray(row["position_ids"])[:n] == 0)
        if not len(starts) or starts[0] != 0:
            raise ValueError("a packed row's position_ids must start at 0 and restart at 0 at every document")
        if cuts is not None and not np.array_equal(starts[1:], cuts):
            raise ValueError("LongstrideCollator: a packed row's position_ids and seq_lengths cut its documents "
                             "differently")
        cuts = starts[1:]
    return [ids] if cuts is None else np.split(ids, cuts)


class LongstrideCollator:
    """Packed rows -> this rank's share of a PackedBatch, as model keyword arguments (see the module
    docstring). Rows are data/batch.py items (from `packed_dataset`) or dicts with input_ids and
    optionally position_ids; rows of other lengths are padded (as a trailing padding document) to the
    longest, rounded up to a multiple of 2 x the CP size, which the zig-zag layout needs."""

    def __init__(self, cp: CPContext, pad_id: int, doc_masking: bool = True):
        self.cp, self.pad_id, self.doc_masking = cp, pad_id, doc_masking
        self.model_config = None  # set by LongstrideTrainerMixin: what the split lengths are checked against
        self.drop_unused = False  # set by LongstrideTrainerMixin from TrainingArguments.remove_unused_columns
        self._checked = 0  # the longest split length checked so far

    def __call__(self, rows: list[dict]) -> dict:
        if all("doc_ids" in r for r in rows):  # packed_dataset's items, one length: labels already aligned
            if len({len(r["input_ids"]) for r in rows}) != 1:
                raise ValueError("LongstrideCollator: packed_dataset rows of different lengths; pack them to one "
                                 "seq_len")
            batch = collate(rows)
        else:
            docs = [_documents(r, self.drop_unused) for r in rows]
            step = 2 * self.cp.degrees.cp
            L = -(-max(sum(len(d) for d in row) for row in docs) // step) * step
            batch = collate([packed_item(row, L, self.pad_id) for row in docs])
        self._check_split(batch["input_ids"].shape[-1])
        local, layout = shard_for_cp(batch, self.doc_masking, self.cp)
        return {"input_ids": local["input_ids"], "position_ids": local["position_ids"], "labels": local["labels"],
                "shift_labels": local["labels"], "doc_layout": layout}

    def _check_split(self, length: int) -> None:
        """Refuses a model that reads positions from the tokens one rank holds (parallel/attention.py
        position_dependent: longrope past its window, Llama 4's query temperature) once a batch of `length`
        tokens is split over CP ranks, before that batch reaches the model; the recipe checks this at validation,
        where the Trainer path first sees a length here."""
        if self.cp.degrees.cp <= 1 or self.model_config is None or length <= self._checked:
            return
        found = position_dependent(self.model_config, length)
        if found:
            raise NotImplementedError(f"LongstrideCollator: {'; '.join(found)}. Refused rather than computed "
                                      "differently on each rank")
        self._checked = length


class LongstrideTrainerMixin:
    """Put it first in the bases of a transformers.Trainer (or trl.SFTTrainer) subclass; the trainer's
    data_collator must be a LongstrideCollator. Training batches: every CP rank of a group gets the same
    rows, each data-parallel group its own seeded share per epoch."""

    def get_train_dataloader(self):
        collator = self._collator()
        self._refuse_cp_eval("evaluation", planned=True)
        world = dist.get_world_size() if dist.is_initialized() else 1
        model = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model
        config = model.config
        check_loss_setup(self.args, world, getattr(self, "model_accepts_loss_kwargs", True),
                         getattr(self, "compute_loss_func", None), config, collator.cp.degrees.cp)
        rank = dist.get_rank() if dist.is_initialized() else 0
        dims = ParallelDims.from_world(world, collator.cp.degrees.cp, where="LongstrideCollator")
        collator.model_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        collator.drop_unused = bool(getattr(self.args, "remove_unused_columns", False))
        self._refuse_workers_under_cp()
        if not hasattr(self.train_dataset, "__len__"):
            raise ValueError(f"LongstrideTrainerMixin: train_dataset is a {type(self.train_dataset).__name__} without "
                             "a length; every CP rank of a group reads the same rows by index, so give an indexable "
                             "dataset (packed_dataset, a datasets.Dataset), or stream with longstride's own recipe")
        args = self.args
        strategy = train_sampling(args)
        seed = args.data_seed if args.data_seed is not None else args.seed
        sampler = ShardSampler(len(self.train_dataset), dims.dp_rank(rank), dims.dp, seed,
                               shuffle=strategy == "random")
        batches = EpochBatchSampler(sampler, self._train_batch_size, drop_last=args.dataloader_drop_last)
        if not len(batches):
            raise ValueError(f"LongstrideTrainerMixin: train_dataset has {len(self.train_dataset)} rows, "
                             f"{len(sampler)} for each of {dims.dp} data-parallel ranks, fewer than one batch of "
                             f"per_device_train_batch_size={self._train_batch_size} (dataloader_drop_last=True); give "
                             "more rows or a smaller batch")
        workers = args.dataloader_num_workers
        extra = {"persistent_workers": args.dataloader_persistent_workers,
                 "prefetch_factor": args.dataloader_prefetch_factor} if workers else {}
        return EpochDataLoader(self.train_dataset, batch_sampler=batches, collate_fn=collator, num_workers=workers,
                               pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(), **extra)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The Trainer's, each rank's batches read first: one that fails on one rank (a bad row only its
        data-parallel group reads) ends every rank here, the others naming another rank, instead of leaving them
        in the next collective (the token count, the gradients) until the timeout."""
        def read() -> list:
            batches = []
            for _ in range(num_batches):
                batch = next(epoch_iterator, None)
                if batch is None:
                    break
                batches.append(batch)
            return batches

        batches = together(read, lambda: ValueError("LongstrideTrainerMixin: another rank failed to read or collate "
                                                     "its training batch (its log says why)"))
        return super().get_batch_samples(iter(batches), num_batches, device)

    def get_eval_dataloader(self, eval_dataset=None):
        self._refuse_cp_eval("evaluation")
        if isinstance(eval_dataset, str) or eval_dataset is None:
            named = self.eval_dataset if eval_dataset is None else self.eval_dataset[eval_dataset]
        else:
            named = eval_dataset
        return self._plain_loader(named)

    def get_test_dataloader(self, test_dataset):
        self._refuse_cp_eval("prediction")
        return self._plain_loader(test_dataset)

    def _plain_loader(self, dataset):
        """Evaluation rows in order through the collator, sharded over processes by accelerate, without the
        Trainer's column removal: it dropped the columns that carry the documents (seq_lengths, position_ids,
        doc_ids) before the collator saw them, so evaluation ran each row as one document, or failed on
        packed_dataset's rows. The collator drops what the model does not take (remove_unused_columns)."""
        from torch.utils.data import DataLoader

        collator = self._collator()
        collator.drop_unused = bool(getattr(self.args, "remove_unused_columns", False))
        self._refuse_workers_under_cp()
        loader = DataLoader(dataset, batch_size=self.args.eval_batch_size, collate_fn=collator, shuffle=False,
                            num_workers=self.args.dataloader_num_workers, drop_last=self.args.dataloader_drop_last)
        return self.accelerator.prepare(loader)

    def _refuse_workers_under_cp(self) -> None:
        """Loader worker processes under CP would hand back each batch's DocLayout, whose communicators cannot
        be pickled: the main process then waited forever."""
        workers = self.args.dataloader_num_workers
        if workers and self._collator().cp.degrees.cp > 1:
            raise ValueError(f"TrainingArguments.dataloader_num_workers={workers} with context parallelism: the "
                             "collator cuts each rank's share in the loader's workers, and its process groups "
                             "cannot travel back to the main process; set dataloader_num_workers=0")

    def _collator(self) -> LongstrideCollator:
        if not isinstance(self.data_collator, LongstrideCollator):
            raise ValueError("LongstrideTrainerMixin needs data_collator=LongstrideCollator(cp, pad_id=...)")
        return self.data_collator

    def _refuse_cp_eval(self, what: str, planned: bool = False) -> None:
        """Evaluation under CP is refused: when it is asked for, and (planned) before training starts when the
        TrainingArguments schedule it, rather than eval_steps into training."""
        cp = self._collator().cp.degrees.cp
        if cp <= 1:
            return
        where = ""
        if planned:
            strategy = getattr(self.args.eval_strategy, "value", self.args.eval_strategy)
            if strategy == "no" and not self.args.load_best_model_at_end:
                return
            where = f" (TrainingArguments.eval_strategy={strategy!r}: set it to 'no')"
        raise NotImplementedError(f"LongstrideTrainerMixin: {what} with cp={cp}{where}: the Trainer splits its rows "
                                  "over every process, so the CP ranks of one group would hold different sequences; "
                                  "evaluate with cp=1, or use the recipe's own validation loss")


def train_sampling(args) -> str:
    """TrainingArguments.train_sampling_strategy ("random" or "sequential"; transformers before it had the
    group_by_length flag). Grouping or rebalancing by length is refused: the rows are packed sequences."""
    strategy, field = getattr(args, "train_sampling_strategy", None), "train_sampling_strategy"
    if strategy is None:
        grouped = getattr(args, "group_by_length", False)
        strategy, field = ("group_by_length", "group_by_length") if grouped else ("random", field)
    if strategy not in ("random", "sequential"):
        shown = "group_by_length=True" if field == "group_by_length" else f"{field}={strategy!r}"
        raise ValueError(f"TrainingArguments.{shown}: LongstrideCollator's rows are packed sequences with no lengths "
                         "to group by; sample them 'random' or 'sequential'")
    return strategy


class EpochBatchSampler(torch.utils.data.BatchSampler):
    """Batches of a ShardSampler whose epoch the Trainer can set: the Trainer calls set_epoch on its dataloader,
    or, resuming inside an epoch (accelerate's skip_first_batches wraps this sampler), on the wrapped batch
    sampler; a plain DataLoader has neither, and every epoch repeated epoch 0's order."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class EpochDataLoader(torch.utils.data.DataLoader):
    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def check_loss_setup(args, world: int, accepts_loss_kwargs: bool, compute_loss_func, config=None, cp: int = 1) -> None:
    """Refuses the Trainer settings under which its loss is not the token mean over the global batch (see the
    module docstring), or which would differ under CP: args is the TrainingArguments, config the model's config."""
    why = router_aux_loss(config) if config is not None else None
    if why:  # the Trainer multiplies the model's whole loss, aux term included, by the process count
        raise NotImplementedError(f"the model: {why}")
    if cp > 1 and args.neftune_noise_alpha:
        raise NotImplementedError(f"TrainingArguments.neftune_noise_alpha={args.neftune_noise_alpha} under cp={cp}: "
                                  "NEFTune scales its noise by the sequence length each rank sees (1/cp of the row), "
                                  "so it would be sqrt(cp) times larger; set it to None or train with cp=1")
    if args.n_gpu > 1:
        raise NotImplementedError(f"TrainingArguments.n_gpu={args.n_gpu}: one process driving several GPUs "
                                  "(torch.nn.DataParallel) would copy each batch's document layout whole to every "
                                  "replica; launch one process per GPU (torchrun or accelerate launch)")
    if world > 1 and not args.average_tokens_across_devices:
        raise ValueError(f"TrainingArguments.average_tokens_across_devices=False over {world} processes averages each "
                         "process's mean loss (CP ranks hold different numbers of label tokens): set it to True")
    if args.label_smoothing_factor:
        raise NotImplementedError(f"TrainingArguments.label_smoothing_factor={args.label_smoothing_factor}: the "
                                  "Trainer's LabelSmoother shifts the labels, which LongstrideCollator has already "
                                  "aligned to the next token; set it to 0")
    if not accepts_loss_kwargs and compute_loss_func is None:
        raise NotImplementedError("the model's forward takes no loss keywords (num_items_in_batch), so the Trainer's "
                                  "loss would be a mean per micro-batch and per process, not over the global batch; "
                                  "pass compute_loss_func to the Trainer, or use a model whose forward takes **kwargs")
