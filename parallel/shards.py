"""Sharded training state with torch.distributed.checkpoint (DCP): the model and optimizer of a parallelized
run, each rank writing its own file, nothing gathered onto one process.

Under FSDP2 a rank writes the shards it holds; under DDP the replicas are the same on every rank and DCP's
save plan gives each tensor to one rank, so the bytes are split between ranks too. The files record every
tensor's global shape and each chunk's offsets, so a load re-shards: any number of processes, any dp x cp
split, FSDP2 or DDP, reads a checkpoint written by any other.

Loading runs no code from the checkpoint: DCP unpickles its `.metadata` with plain pickle and its non-tensor
items with `weights_only=False`; here the metadata goes through an unpickler that only builds DCP's own
record classes (and torch's sizes, dtypes and layouts), and the non-tensor items (the optimizer's hyper-
parameters) load with `weights_only=True`. A refused file raises UnsafeCheckpoint naming it and the type.
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
from concurrent.futures import Future
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from longstride.model.model_dir import STEP_METADATA

# one process has no process group to use, and is meant to have none
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
_RECORDS = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_RECORDS, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A sharded checkpoint file holding something other than DCP's records, tensors and plain data."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        """Exact (module, name) pairs only: no dotted names (pickle would walk them to any attribute of any
        module the allowed one imports), and torch's dtypes by their own names."""
        allowed = "." not in name and ((module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise UnsafeCheckpoint(f"checkpoint file {self.path} holds a '{module}.{name}' object, not DCP's "
                                   "records and plain data; it was not loaded (loading it could run code)")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled through an allowlist."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(str(self.path), STEP_METADATA)
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load plan with every non-tensor item read with weights_only=True."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            where = self.metadata.storage_data[read_item.storage_index].relative_path
            raise UnsafeCheckpoint(f"checkpoint file {os.path.join(self.directory, where)} holds an item "
                                   f"{read_item.dest_index.fqn!r} that is not tensors and plain data "
                                   f"({str(e).splitlines()[0]}); it was not loaded") from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def tied_names(module: torch.nn.Module) -> set[str]:
    """State-dict names that repeat a parameter under another name (an LM head tied to the embedding): saved
    once, under the first name, as save_pretrained does."""
    first = {name for name, _ in module.named_parameters()}
    return {name for name, _ in module.named_parameters(remove_duplicate=False) if name not in first}


def _state(module: torch.nn.Module, optimizer) -> dict:
    """The model's and optimizer's state dicts as the run holds them (sharded DTensors under FSDP2), keyed by
    parameter name (DDP's `module.` prefix dropped), tied repeats left out."""
    tied = {n.removeprefix("module.") for n in tied_names(module)}
    model = {k: v for k, v in get_model_state_dict(module).items() if k not in tied}
    return {"model": model, "optim": get_optimizer_state_dict(module, optimizer)}


def save_shards(directory: str, module: torch.nn.Module, optimizer, background: bool = False) -> Optional[Future]:
    """Collective: every rank writes its file(s) of the model and optimizer state into `directory` (which
    exists), rank 0 the metadata. No tensor is gathered onto another rank. background: the state is copied to
    host memory here (a new copy each save) and written by a thread of DCP's (its collectives on a process group
    of their own, save_group); the returned future completes on every rank once every rank's files are written,
    synced and the metadata written, and raises what failed as an OSError."""
    writer = FileSystemWriter(directory, single_file_per_rank=True)
    if background:
        return _failures_as_oserror(dcp.async_save(_state(module, optimizer), storage_writer=writer,
                                                   process_group=save_group()))
    try:
        dcp.save(_state(module, optimizer), storage_writer=writer)
    except CheckpointException as e:  # a BaseException: make it an error the caller's handler sees
        raise OSError(first_failure(e)) from None
    return None


def _failures_as_oserror(saving: Future) -> Future:
    """`saving`'s outcome, a CheckpointException (a BaseException) made an OSError as save_shards raises it."""
    done: Future = Future()

    def settle(f: Future) -> None:
        try:
            done.set_result(f.result())
        except CheckpointException as e:
            done.set_exception(OSError(first_failure(e)))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `done`
            done.set_exception(e)

    saving.add_done_callback(settle)
    return done


@functools.cache
def save_group():
    """The process group a background save's collectives run on (None: one process, none to run): gloo, so they
    run beside training's own collectives (NCCL or gloo) without sharing a queue with them, waiting as long as the
    world's group (parallel/config.world_group_timeout). Collective the first time: every rank's first background
    save makes it."""
    import torch.distributed as dist

    from longstride.parallel.config import world_group_timeout

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=world_group_timeout())


def load_shards(directory: str, module: torch.nn.Module, optimizer) -> None:
    """Collective: fills the model's parameters and the optimizer's state from `directory`, re-sharding to this
    run's layout. The metadata is checked (allowlist) on every rank before any collective starts."""
    SafeReader(directory).read_metadata()
    state = _state(module, optimizer)
    members = [list(g["params"]) for g in state["optim"]["param_groups"]]  # this run's groups, by parameter name
    try:
        dcp.load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner(directory))
    except CheckpointException as e:  # a key or shape the checkpoint lacks, a refused item: raised on every rank
        unsafe = any(isinstance(exc, UnsafeCheckpoint) for exc, _ in e.failures.values())
        raise (UnsafeCheckpoint if unsafe else OSError)(first_failure(e)) from None
    # not strict: the tied repeats are not in `state` (DCP has already refused any other key it lacks)
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(module, optimizer, _regrouped(state["optim"], members))


def _regrouped(optim: dict, members: list[list[str]]) -> dict:
    """A loaded optimizer state whose parameter groups hold this run's members (each group's saved hyperparameters
    kept, in order): a checkpoint grouped otherwise (an older rule for what weight decay skips) would hand a group
    to the wrong parameters. Each parameter's own state is keyed by its name and comes back whatever its group."""
    saved = optim["param_groups"]
    if len(saved) != len(members) or all(list(g["params"]) == m for g, m in zip(saved, members)):
        return optim
    return {**optim, "param_groups": [{**g, "params": m} for g, m in zip(saved, members)]}


def load_model_shards(directory: str, model: torch.nn.Module, prefix: str = "lm.") -> None:
    """One process, no process group: the model's weights (names under `prefix` in the checkpoint) read from a
    sharded checkpoint into `model`, whole; for converting a step checkpoint to an HF directory."""
    SafeReader(directory).read_metadata()
    tied = tied_names(model)
    state = {"model": {prefix + k: v for k, v in model.state_dict().items() if k not in tied}}
    dcp.load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner(directory), no_dist=True)


def first_failure(e: CheckpointException) -> str:
    """The first rank's error of a DCP collective, as one line."""
    for rank, (exc, _) in sorted(e.failures.items()):
        return f"rank {rank}: {exc}"
    return str(e)

