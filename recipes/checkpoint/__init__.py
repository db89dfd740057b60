"""The checkpoint format (sharded step checkpoints, HF model directories, manifests), export and shipping."""
