"""Out-of-range values, inputs that do not fit the model, contradictions and settings no stage reads: each named at
validation, before compute, with the field and the fix (recipes/config/plan.py)."""
from __future__ import annotations

import re

import pytest

from longstride.recipes.config.plan import validate
from tests.conftest import compose_cfg


# --- out-of-range values, inputs that do not fit the model, contradictions: named at validation, before compute
@pytest.mark.parametrize("override, message", [
    ("recipe.stages.s1_256.micro_batch_size=0", "recipe.stages.s1_256.micro_batch_size=0 must be >= 1"),
    ("recipe.stages.s2_2k.lr=-0.001", "recipe.stages.s2_2k.lr=-0.001 must be > 0"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers in [0, 1)"),
    ("model.loss_tile_tokens=0", "model.loss_tile_tokens=0 must be >= 1"),
    ("data.eval_sequences=-1", "data.eval_sequences=-1 must be >= 0"),
    ("recipe.stages.s1_256.save_every=-1", "recipe.stages.s1_256.save_every=-1 must be >= 0"),
    ("recipe.stages.s3_4k.min_lr_ratio=5", "recipe.stages.s3_4k.min_lr_ratio=5.0 must be in [0, 1]"),
    ("model.num_hidden_layers=0", "model.num_hidden_layers=0 must be >= 1"),
    ("recipe.stages.s1_256.seq_len=0", "recipe.stages.s1_256.seq_len=0 must be >= 2 tokens"),
    ("recipe.stages.s1_256.batch_tokens=0", "recipe.stages.s1_256.batch_tokens=0 must be >= 1"),
    ("+recipe.stages.s2_2k.mixture={stdlib:-1.0}", "recipe.stages.s2_2k.mixture={'stdlib': -1.0} must be source "
                                                   "weights >= 0 with a positive sum"),
    ("+recipe.stages.s2_2k.mixture.stdlib=0.0", "must be source weights >= 0 with a positive sum"),
    ("data.sources.stdlib.weight=0", "data.sources.stdlib.weight=0.0 must be > 0"),  # refused after the BPE before
    ("data.streaming=true data.sources.stdlib.weight=-1", "data.sources.stdlib.weight=-1.0 must be >= 0"),
    ("logger.log_every=0", "logger.log_every=0 must be >= 1"),
    ("data.num_workers=-1", "data.num_workers=-1 must be >= 0"),
    ("data.vocab_size=10", "data.vocab_size=10 must be > 256"),
    ("model.nope_layers=[2]", "model.nope_layers=[2] must be 0-based layer indices in 0..1 (the last layer is 1)"),
    ("model.nope_interval=-1", "model.nope_interval=-1 must be >= 0"),
    ("model.head_dim=7", "model.head_dim=7 must be null (hidden_size / num_attention_heads) or an even number"),
    ("model.vocab_size=100", "model.vocab_size=100 must be null (the tokenizer's size) or >= data.vocab_size 384"),
    ("data.long_docs={min_tokens:100,min_share:1.5}", "data.long_docs.min_share=1.5 must be in [0, 1)"),
    ("model.yarn.factor=0.5", "model.yarn.factor=0.5 must be > 1"),
    ("data.tokenizer_train_bytes=0", "data.tokenizer_train_bytes=0 must be >= 1"),
    ("data.seed=-1", "data.seed=-1 must be >= 0"),
    # the micro model is 32 wide: 6 heads would be 5.33 wide, 16 heads 2-wide is fine, 32 heads 1-wide is odd
    ("model.num_attention_heads=6", "model.num_attention_heads=6 must be a divisor of model.hidden_size=32 leaving "
                                    "an even head size"),
    ("model.num_attention_heads=32", "model.num_attention_heads=32 must be a divisor of model.hidden_size=32"),
    ("model.rms_norm_eps=-1", "model.rms_norm_eps=-1.0 must be > 0"),
    ("model.initializer_range=-1", "model.initializer_range=-1.0 must be > 0"),
    ("model.yarn.original_max_position_embeddings=-5",
     "model.yarn.original_max_position_embeddings=-5 must be null (the trained length), or >= 1 tokens together "
     "with model.yarn.factor"),
    ("model.checkpoint=/nonexistent", "model.checkpoint=/nonexistent is read only with model.arch=checkpoint"),
    ("recipe.stages.s2_2k.schedule=wsd recipe.stages.s2_2k.warmup_steps=3 recipe.stages.s2_2k.decay_fraction=0.5",
     "recipe.stages.s2_2k.warmup_steps=3 runs into the wsd decay, which starts at step 2 of 4"),
    ("recipe.stages.s2_2k.decay_fraction=0.5", "recipe.stages.s2_2k.decay_fraction=0.5 is read only by schedule: "
                                               "wsd, and this stage's schedule is cosine"),
    ("model.offload_activations=true model.checkpoint_mode=selective recipe.stages.s2_2k.activation_checkpointing="
     "false recipe.stages.s3_4k.activation_checkpointing=false", "model.offload_activations=true, "
     "model.checkpoint_mode=selective: read with activation checkpointing, and no stage runs it"),
    ("parallel.balance=docs data.doc_masking=false", "parallel.balance=docs balances the work of document-masked "
                                                     "attention, and data.doc_masking=false attends across documents"),
    ("parallel.balance=docs parallel.cp_impl=ulysses", "parallel.balance=docs deals a ring's chunks, and no stage of "
                                                       "recipe tiny runs a ring (parallel.cp_impl=ulysses)"),
    ("parallel.balance_chunks=4", "parallel.balance_chunks=4 is read by balance=docs, and no stage balances by "
                                  "documents"),
    ("data.stream_open_seqs=8", "data.stream_open_seqs=8 is read by streamed packing, and data.streaming=false"),
    ("recipe.stages.s2_2k.schedule=constant recipe.stages.s2_2k.min_lr_ratio=0.0",
     "recipe.stages.s2_2k.min_lr_ratio=0.0: schedule: constant keeps the lr at its peak and has no floor"),
])
def test_out_of_range_values_are_named_before_compute(micro, override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(compose_cfg(micro + override.split()), 1)
