"""The HF Trainer / TRL adapter: longstride's packed batches and context parallelism inside transformers' Trainer."""
