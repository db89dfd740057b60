"""The HF Trainer and TRL's SFTTrainer with longstride's packed batches and CP attention
(recipes/hf/trainer.py): on 2 gloo processes with ring and with Ulysses CP, the per-step losses and the
trained parameters equal one process's run of the same trainer and longstride's own loss and optimizer
loop on the same batches."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from longstride.data.batch import collate
from longstride.data.loader import ShardSampler
from longstride.model.loss import ChunkedLossLM
from longstride.parallel.attention import use_longstride_attention
from longstride.parallel.cp import DocLayout
from longstride.recipes.hf.trainer import LongstrideTrainerMixin, _documents, packed_dataset
from tests.conftest import REPO
from tests.forked_cli import run_module
from tests.hf_trainer_worker import BATCH, L, LR, STEPS, documents, tiny_lm


def _worker(out, procs: int, cp: int, impl: str, kind: str = "trainer", batch: int = BATCH, accum: int = 1) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    module, args = "tests.hf_trainer_worker", [str(out), str(cp), impl, kind, str(batch), str(accum)]
    if procs > 1:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(procs), "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    else:  # one process: forked from the suite's server, which imported torch and transformers once
        r = run_module(module, args, env, str(REPO), 300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


def own_loop() -> dict:
    """longstride's chunked loss over the batch's label tokens and plain SGD (linear in the gradients, so the
    parameters compare at fp32 noise; Adam would divide near-zero gradients by their own size)."""
    torch.manual_seed(0)
    model = tiny_lm()
    use_longstride_attention(model)
    lm = ChunkedLossLM(model, tile=32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = packed_dataset(documents(), L, pad_id=1)
    order = list(ShardSampler(len(data), 0, 1, seed=0))
    losses = []
    for step in range(STEPS):
        batch = collate([data[i] for i in order[step * BATCH:(step + 1) * BATCH]])
        loss = lm(batch["input_ids"], batch["labels"], batch["position_ids"], doc_layout=DocLayout(batch["doc_ids"]))
        loss = loss / (batch["labels"] != -100).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": dict(model.named_parameters())}


def test_rows_packed_elsewhere_split_at_position_restarts():
    docs = _documents({"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 0, 1, 2]})
    assert [d.tolist() for d in docs] == [[5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="must start at 0"):
        _documents({"input_ids": [5, 6], "position_ids": [1, 2]})


def test_trl_packed_rows_keep_their_documents_and_loss_masks():
    """TRL's packing gives rows of input_ids, labels (-100 on prompt tokens under completion_only_loss or
    assistant_only_loss) and seq_lengths, without position_ids: the collator cuts the documents at seq_lengths and
    trains on no prompt token, as TRL's own collator does; a key it would drop is refused."""
    from types import SimpleNamespace

    from longstride.recipes.hf.trainer import LongstrideCollator

    row = {"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, 6, 7, -100, -100, 10], "seq_lengths": [3, 3]}
    collator = LongstrideCollator(SimpleNamespace(degrees=SimpleNamespace(cp=1), method=None), pad_id=1)
    b = collator([row])
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2], "a document per seq_lengths entry"
    assert b["doc_layout"].doc_ids[0].tolist() == [0, 0, 0, 1, 1, 1]
    # aligned to the next token: 5 predicts 6, 6 predicts 7; 8 and 9 are the second document's prompt, 9 -> 10
    assert b["labels"][0].tolist() == [6, 7, -100, -100, 10, -100]
    assert b["input_ids"][0].tolist() == row["input_ids"], "the prompt tokens stay the model's input"
    padded = {**row, "input_ids": row["input_ids"] + [0, 0], "labels": row["labels"] + [-100, -100],
              "attention_mask": [1] * 6 + [0, 0]}
    assert collator([padded])["labels"].tolist() == b["labels"].tolist()
    unlabelled = {k: v for k, v in row.items() if k != "labels"}
    with pytest.raises(ValueError, match=r"\['completion_mask'\] would be dropped \(build labels from them"):
        collator([{**unlabelled, "completion_mask": [0, 1, 1, 0, 0, 1]}])
    # beside labels (TRL's completion_only_loss=False keeps the mask next to the labels it built): the labels decide
    assert collator([{**row, "completion_mask": [0, 1, 1, 0, 0, 1]}])["labels"].tolist() == b["labels"].tolist()
    with pytest.raises(ValueError, match=r"\['text'\] would be dropped"):
        collator([{**row, "text": "raw"}])
    collator.drop_unused = True  # TrainingArguments.remove_unused_columns: the Trainer's own rule
    assert collator([{**row, "text": "raw"}])["labels"].tolist() == b["labels"].tolist()
    with pytest.raises(ValueError, match=r"\['completion_mask'\] would be dropped"):
        collator([{**unlabelled, "completion_mask": [0, 1, 1, 0, 0, 1]}])
    with pytest.raises(ValueError, match="labels must be its input_ids"):
        collator([{**row, "labels": [6, 7, -100, 9, 10, -100]}])  # shifted already: not TRL's
    with pytest.raises(ValueError, match="must be positive and sum to its 6 tokens"):
        collator([{**row, "seq_lengths": [3, 2]}])


class _TrainStub(LongstrideTrainerMixin):
    """What get_train_dataloader reads of a Trainer on one process: the packed documents, cp=1, batches of
    `batch` rows, real TrainingArguments (seed 0 unless given)."""

    def __init__(self, batch: int = 1, data=None, **args):
        from types import SimpleNamespace

        import transformers as T

        from longstride.recipes.hf.trainer import LongstrideCollator

        self.model = SimpleNamespace(config=SimpleNamespace())
        self.data_collator = LongstrideCollator(SimpleNamespace(degrees=SimpleNamespace(cp=1), method=None), 1)
        self.train_dataset = packed_dataset(documents(), L, 1) if data is None else data
        self.args = T.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, **{"seed": 0, **args})
        self._train_batch_size = batch


def test_the_mixins_train_loader_follows_the_training_arguments():
    """data_seed orders the rows (seed when unset), train_sampling_strategy='sequential' keeps their order,
    dataloader_drop_last keeps or drops a short last batch (transformers' default keeps it); grouping by length, a
    batch larger than the data with drop_last, and one process
    driving several GPUs (n_gpu > 1) are refused by name."""
    data = _TrainStub().train_dataset
    n = len(data)
    first = lambda loader: [int(i) for i in next(iter(loader))["input_ids"][:, 0]]  # noqa: E731
    by_seed = first(_TrainStub(batch=n, seed=7).get_train_dataloader())
    assert first(_TrainStub(batch=n, data_seed=7, seed=0).get_train_dataloader()) == by_seed
    assert first(_TrainStub(batch=n, seed=0).get_train_dataloader()) != by_seed
    assert [len(b["input_ids"]) for b in _TrainStub(batch=n - 1).get_train_dataloader()] == [n - 1, 1]
    assert [len(b["input_ids"]) for b in _TrainStub(batch=n - 1, dataloader_drop_last=True)
            .get_train_dataloader()] == [n - 1]
    in_order = [int(b["input_ids"][0, 0]) for b in _TrainStub(train_sampling_strategy="sequential")
                .get_train_dataloader()]
    assert in_order == [int(data[i]["input_ids"][0]) for i in range(n)]
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'"):
        _TrainStub(train_sampling_strategy="group_by_length").get_train_dataloader()
    with pytest.raises(ValueError, match=rf"{n} rows.*fewer than one batch of per_device_train_batch_size={n + 1}"):
        _TrainStub(batch=n + 1, dataloader_drop_last=True).get_train_dataloader()
    workers = _TrainStub(dataloader_num_workers=1, dataloader_persistent_workers=True, dataloader_prefetch_factor=3,
                         dataloader_pin_memory=False).get_train_dataloader()
    assert workers.num_workers == 1 and workers.persistent_workers and workers.prefetch_factor == 3
    assert not workers.pin_memory
    stub = _TrainStub()
    stub.args._n_gpu = 2  # what TrainingArguments computes on a machine of two GPUs without a launcher
    with pytest.raises(NotImplementedError, match="n_gpu=2"):
        stub.get_train_dataloader()


def test_the_mixins_dataloader_reshuffles_each_epoch_also_when_resumed_inside_one():
    """The Trainer sets the epoch on its dataloader, or on the batch sampler accelerate's skip_first_batches wraps
    when it resumes inside an epoch; the mixin's sampler takes it either way (a plain DataLoader did not: every
    epoch repeated epoch 0's order)."""
    from accelerate.data_loader import skip_first_batches

    Stub = _TrainStub

    def rows(loader):
        return [tuple(b["input_ids"][0, :8].tolist()) for b in loader]

    order = [list(ShardSampler(len(Stub().train_dataset), 0, 1, seed=0).__iter__())]
    sampler = ShardSampler(len(Stub().train_dataset), 0, 1, seed=0)
    sampler.set_epoch(1)
    order.append(list(sampler))
    assert order[0] != order[1]
    data = Stub().train_dataset
    want = [[tuple(data[i]["input_ids"][:8].tolist()) for i in o] for o in order]
    loader = Stub().get_train_dataloader()
    for epoch in (0, 1):  # as Trainer._inner_training_loop: set_epoch on the dataloader, then iterate
        loader.set_epoch(epoch)
        assert rows(loader) == want[epoch], epoch
    resumed = skip_first_batches(Stub().get_train_dataloader(), 2)  # a resume two batches into epoch 1
    resumed.batch_sampler.batch_sampler.set_epoch(1)  # what the Trainer reaches through the skip wrapper
    assert rows(resumed) == want[1][2:]


def test_the_trainer_path_refuses_a_position_dependent_model_once_cp_splits_past_its_window():
    """Phi-3's longrope picks its frequencies from the largest position a process holds: split over cp=2 past its
    64-position window, ranks would compute differently. The mixin hands the model's config to the collator, which
    refuses the first batch that long (before it reaches the model) and passes shorter ones."""
    from types import SimpleNamespace

    import transformers as T

    from longstride.recipes.hf.trainer import LongstrideCollator, LongstrideTrainerMixin
    from tests.test_cp_positions import _phi3_longrope

    class Stub(LongstrideTrainerMixin):  # what get_train_dataloader reads of a Trainer, on one process
        def __init__(self, model, collator):
            self.model, self.data_collator, self.train_dataset = model, collator, packed_dataset(documents(), L, 1)
            self.args = T.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, seed=0)
            self._train_batch_size = BATCH

    phi3 = T.Phi3ForCausalLM(_phi3_longrope())
    one = LongstrideCollator(SimpleNamespace(degrees=SimpleNamespace(cp=1)), pad_id=0)
    Stub(phi3, one).get_train_dataloader()
    assert one.model_config is phi3.config, "the mixin hands the model's config to the collator"
    two = LongstrideCollator(SimpleNamespace(degrees=SimpleNamespace(cp=2)), pad_id=0)
    two.model_config = phi3.config
    with pytest.raises(NotImplementedError, match=r"rope_type=longrope .* past 64 positions.*a 96-token stage"):
        two([{"input_ids": list(range(2, 98))}])
    two._check_split(64)  # within the window: passes
    one._check_split(4096)  # one CP rank holds the whole sequence: passes


def test_trainer_settings_that_would_change_the_loss_are_refused():
    """average_tokens_across_devices=False over several processes, label smoothing (transformers' LabelSmoother
    shifts the aligned labels again: measured 3.8906 against 3.9419 at a smoothing of 1e-9) and a forward without
    loss keywords are refused at the first dataloader, as is evaluation under CP; the defaults pass."""
    from types import SimpleNamespace

    import transformers as T

    from longstride.recipes.hf.trainer import LongstrideCollator, LongstrideTrainerMixin, check_loss_setup

    args = T.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    check_loss_setup(args, 2, True, None)
    with pytest.raises(ValueError, match="average_tokens_across_devices=False over 2 processes"):
        check_loss_setup(T.TrainingArguments("unused", report_to=[], average_tokens_across_devices=False), 2, True,
                         None)
    check_loss_setup(T.TrainingArguments("unused", report_to=[], average_tokens_across_devices=False), 1, True, None)
    with pytest.raises(NotImplementedError, match="label_smoothing_factor=1e-09: the Trainer's LabelSmoother"):
        check_loss_setup(T.TrainingArguments("unused", report_to=[], label_smoothing_factor=1e-9), 1, True, None)
    with pytest.raises(NotImplementedError, match="forward takes no loss keywords"):
        check_loss_setup(args, 1, False, None)
    check_loss_setup(args, 1, False, lambda outputs, labels, num_items_in_batch=None: 0)

    class Stub(LongstrideTrainerMixin):  # cp=1 evaluation: test_evaluation_keeps_the_documents_...
        def __init__(self, cp: int):
            self.data_collator = LongstrideCollator(SimpleNamespace(degrees=SimpleNamespace(cp=cp)), pad_id=0)

    with pytest.raises(NotImplementedError, match="evaluation with cp=2: the Trainer splits its rows"):
        Stub(2).get_eval_dataloader()
    planned = Stub(2)  # evaluation scheduled: refused before training, not eval_steps into it
    planned.args = T.TrainingArguments("unused", report_to=[], use_cpu=True, eval_strategy="steps", eval_steps=5)
    with pytest.raises(NotImplementedError, match=r"eval_strategy='steps': set it to 'no'"):
        planned.get_train_dataloader()


def test_setup_cp_reads_the_precision_from_the_training_arguments(monkeypatch):
    """TrainingArguments(bf16=True) does not tell accelerate's environment; setup_cp takes them, and on CUDA
    without either it refuses rather than pick the kernel for fp32."""
    import transformers as T

    from longstride.recipes.hf import trainer

    seen = []
    real = trainer.resolve_kernel
    trainer.resolve_kernel = lambda kernel, device, ring, half, head_dim, softcap: seen.append(half) or real(
        kernel, device, ring=ring, half=half, head_dim=head_dim, softcap=softcap)
    try:
        trainer.setup_cp(1, 4, device_type="cpu",
                         args=T.TrainingArguments("unused", report_to=[], use_cpu=True, bf16=True))
        trainer.setup_cp(1, 4, device_type="cpu", args=T.TrainingArguments("unused", report_to=[], use_cpu=True))
        with pytest.raises(ValueError, match="setup_cp: pass args=<your TrainingArguments>"):
            trainer.setup_cp(1, 4, device_type="cuda")
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch sets it whenever it is not given
        with pytest.raises(ValueError, match="setup_cp: pass args=<your TrainingArguments>"):
            trainer.setup_cp(1, 4, device_type="cuda")
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # accelerate launch --mixed_precision bf16
        trainer.setup_cp(1, 4, device_type="cpu", args=T.TrainingArguments("unused", report_to=[], use_cpu=True))
    finally:
        trainer.resolve_kernel = real
    assert seen == [True, False, True]


def test_setup_cp_reads_heads_head_size_and_soft_cap_from_the_config():
    """setup_cp(config=model.config): Gemma 2's soft-capped scores pick the math kernel on CPU (the CPU flash op has
    no cap, and a Trainer user who forgot softcap=True failed at the first forward); a plain model keeps sdpa;
    heads that contradict the config, or neither, are refused."""
    import transformers as T

    from longstride.recipes.hf.trainer import setup_cp

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=64)
    assert setup_cp(1, config=T.Gemma2Config(**small), device_type="cpu").kernel == "math"
    assert setup_cp(1, config=T.LlamaConfig(**small), device_type="cpu").kernel == "sdpa"
    with pytest.raises(ValueError, match="setup_cp: heads=8 but config has 4; pass config alone"):
        setup_cp(1, 8, config=T.LlamaConfig(**small), device_type="cpu")
    with pytest.raises(ValueError, match="setup_cp: head_dim=16 but config has 8"):
        setup_cp(1, head_dim=16, config=T.LlamaConfig(**small), device_type="cpu")
    with pytest.raises(ValueError, match="pass config=model.config"):
        setup_cp(1, device_type="cpu")


def _matches_own_loop(runs: dict, ref: dict) -> None:
    """Every run's per-step losses and trained parameters equal the longstride loop's, to fp32 noise."""
    for name, run in runs.items():
        assert len(run["losses"]) == STEPS, name
        for step, (got, want) in enumerate(zip(run["losses"], ref["losses"])):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name} step {step}: loss {got} vs longstride loop {want}"
        worst = max(((run["params"][k] - p).abs().max() / p.abs().max()).item() for k, p in ref["params"].items())
        assert worst <= 1e-5, f"{name}: trained parameters differ from the longstride loop's by {worst:.2e}"


@pytest.mark.parametrize("impl,kind", [("ring", "trainer"), ("ulysses", "trainer"), ("ring", "sft")])
def test_trainer_with_cp_equals_one_process_and_longstride_loop(impl, kind, tmp_path):
    one = _worker(tmp_path / "one.pt", 1, 1, "ring", kind)
    two = _worker(tmp_path / "two.pt", 2, 2, impl, kind)
    ref = own_loop()
    _matches_own_loop({f"one-process {kind}": one, f"{kind} with {impl} cp=2": two}, ref)
    # each layer's attention runs once a micro-batch, twice under TRL's SFTConfig (activation checkpointing on by
    # default there): the count the checkpointing test below reads
    runs = 2 if kind == "sft" else 1
    assert two["forwards"] > 0 and two["attention_calls"] == [runs * two["forwards"]] * 2, two["attention_calls"]
    init = dict(tiny_lm().named_parameters())
    moved = max(((ref["params"][k] - p).abs().max() / p.abs().max()).item() for k, p in init.items())
    assert moved > 1e-2, f"the parameters were trained (largest relative change {moved:.2e})"


@pytest.mark.parametrize("impl,kind", [("ulysses", "trainer_gc"), ("ring", "trainer_gc_reentrant")])
def test_the_trainers_activation_checkpointing_under_cp_equals_the_longstride_loop(impl, kind, tmp_path):
    """TrainingArguments' activation checkpointing (transformers' own, each decoder layer recomputed in backward,
    non-reentrant or reentrant) over longstride's CP attention: the same losses and parameters."""
    run = _worker(tmp_path / "gc.pt", 2, 2, impl, kind)
    # every decoder layer's attention ran again in each micro-batch's backward
    assert run["forwards"] > 0 and run["attention_calls"] == [2 * run["forwards"]] * 2, run["attention_calls"]
    _matches_own_loop({f"{kind} with {impl} cp=2": run}, own_loop())


@pytest.mark.parametrize("procs,cp,accum", [(1, 1, 2), (2, 1, 1), (2, 2, 2)])
def test_trainer_over_accumulation_or_data_parallel_ranks_equals_the_longstride_loop(procs, cp, accum, tmp_path):
    """The same global batch of BATCH rows split another way: one row a micro-batch, over gradient accumulation,
    over data-parallel ranks (each its share of the sampler's order) or both beside CP. The rows' label counts
    differ, so a mean per micro-batch or per rank would give other losses and parameters."""
    run = _worker(tmp_path / "run.pt", procs, cp, "ring", batch=BATCH * cp // procs // accum, accum=accum)
    _matches_own_loop({f"{procs} processes, cp={cp}, accumulation {accum}": run}, own_loop())


def test_evaluation_keeps_the_documents_whatever_remove_unused_columns_says(tmp_path):
    """Trainer.evaluate on packed_dataset rows: the Trainer's column removal (remove_unused_columns=True, its
    default) dropped doc_ids before the collator saw them and the eval failed; the mixin's eval loader leaves the
    columns to the collator, so both settings give the documents' own loss: longstride's chunked loss under each
    row's document masks, batch by batch as the Trainer averages it (within 1e-5; one document a row, without the
    masks, is more than ten times that away)."""
    from transformers import Trainer, TrainingArguments

    from longstride.recipes.hf.trainer import LongstrideCollator, LongstrideTrainerMixin, setup_cp

    class T(LongstrideTrainerMixin, Trainer):
        pass

    data = packed_dataset(documents(), L, pad_id=1)
    losses = []
    for remove in (True, False):
        model = tiny_lm()
        use_longstride_attention(model)
        args = TrainingArguments(output_dir=str(tmp_path / str(remove)), per_device_eval_batch_size=2, use_cpu=True,
                                 report_to="none", remove_unused_columns=remove, disable_tqdm=True)
        trainer = T(model=model, args=args, eval_dataset=data,
                    data_collator=LongstrideCollator(setup_cp(1, model.config.num_attention_heads, "ring"), pad_id=1))
        losses.append(trainer.evaluate()["eval_loss"])

    lm = ChunkedLossLM(tiny_lm(), tile=32)
    use_longstride_attention(lm.lm)

    @torch.no_grad()
    def mean_loss(own_documents: bool) -> float:
        """Each batch of 2 rows' loss per label token, averaged over rows (the Trainer repeats a batch's loss for
        each of its rows)."""
        total = 0.0
        for s in range(0, len(data), 2):
            b = collate([data[i] for i in range(s, min(s + 2, len(data)))])
            docs = b["doc_ids"] if own_documents else torch.zeros_like(b["doc_ids"])
            loss = lm(b["input_ids"], b["labels"], b["position_ids"], doc_layout=DocLayout(docs))
            total += len(b["input_ids"]) * (loss / (b["labels"] != -100).sum()).item()
        return total / len(data)

    own, one_each = mean_loss(True), mean_loss(False)
    assert abs(one_each - own) > 10 * 1e-5 * own, (own, one_each)  # ten times the tolerance below
    assert losses == pytest.approx([own, own], rel=1e-5), (losses, own)


def test_loader_workers_under_cp_are_refused():
    """The collator's DocLayout carries the CP communicators, which a worker process cannot hand back."""
    from types import SimpleNamespace

    from longstride.recipes.hf.trainer import LongstrideCollator, LongstrideTrainerMixin

    class Stub(LongstrideTrainerMixin):
        def __init__(self, workers):
            self.data_collator = LongstrideCollator(SimpleNamespace(degrees=SimpleNamespace(cp=2), method="ring"), 1)
            self.args = SimpleNamespace(dataloader_num_workers=workers)

    Stub(0)._refuse_workers_under_cp()
    with pytest.raises(ValueError, match="dataloader_num_workers=2 with context parallelism"):
        Stub(2)._refuse_workers_under_cp()


@pytest.mark.timeout(200)
def test_a_batch_only_one_rank_cannot_collate_ends_every_rank(tmp_path):
    """A bad row read by one data-parallel rank failed that rank's collator inside the Trainer's loop while the
    other rank went on to the next collective, to wait there for the launcher's kill or the timeout (transformers'
    ddp_timeout, 30 minutes; here, gloo on one host, to fail with a reset connection once the failed rank exited).
    The mixin's get_batch_samples now ends every rank at that batch, the others naming another rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                        "tests.hf_trainer_worker", str(tmp_path / "out.pt"), "1", "ring", "bad_row"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode != 0
    assert "rank 1 raised ValueError: LongstrideCollator: packed_dataset rows of different lengths" in r.stderr, \
        r.stderr[-3000:]
    assert "rank 0 raised ValueError: LongstrideTrainerMixin: another rank failed to read or collate its training " \
        "batch (its log says why)" in r.stderr, r.stderr[-3000:]
