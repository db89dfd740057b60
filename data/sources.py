"""Corpus sources as `datasets.Dataset`s with one `text` column, bad documents skipped and counted.

Sources are file-backed (arrow files in the cache dir) so that tokenisation with `datasets.map`
is cached by fingerprint and reused by later stages and later runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import datasets
import numpy as np

from longstride.data import manual, synthetic
from longstride.data.config import SourceConfig
from longstride.data.file_records import UnreadableRecord, data_files, literal_paths, read_errors, unreadable_record
from longstride.data.files import digest, excluded_files, list_files, stdlib_digest, stdlib_root, unreadable
from longstride.data.stream_split import first_row, keeps, split_rows

def _read_files(paths: list[str]):
    """Yields one row per file; undecodable or empty files are kept as rows with a `skip` reason so
    the count survives the generator cache."""
    for path in paths:
        reason = unreadable(path)
        if reason:
            yield {"text": "", "skip": reason}
            continue
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield {"text": "", "skip": "invalid_utf8"}
            continue
        yield {"text": text, "skip": "" if text.strip() else ("empty" if not text else "whitespace")}


def _files_dataset(paths: list[str], cache_dir: str, identity: str = "") -> datasets.Dataset:
    """The files' texts, cached under a name made of their paths, sizes and mtimes (an edited file is read again)
    and `identity` (the shipped corpus' digest: its files all carry mtime 0, so a new snapshot changes only it)."""
    stamps = [(st.st_mtime_ns, st.st_size) if not unreadable(p) and (st := os.stat(p)) else 0 for p in paths]
    return datasets.Dataset.from_generator(
        _read_files, gen_kwargs={"paths": paths}, cache_dir=cache_dir,
        config_name=f"files-{len(paths)}-{digest([paths, stamps, identity])}",
    )


def _marker(column: str):
    def mark(batch):
        texts = batch[column]
        skip = ["missing" if t is None else "empty" if not t else "whitespace" if not t.strip() else "" for t in texts]
        return {"text": [t or "" for t in texts], "skip": skip}

    return mark


def _mark_skips(ds: datasets.Dataset, column: str, num_proc: int) -> datasets.Dataset:
    keep = [c for c in ds.column_names if c not in ("text", "skip")]
    return ds.map(_marker(column), batched=True, num_proc=num_proc if len(ds) > 1000 else None, remove_columns=keep,
                  desc="checking documents")


def walk_files(src: SourceConfig, field: str) -> list[str]:
    """The files of a stdlib / local_dir source, in sorted order."""
    root = stdlib_root() if src.kind == "stdlib" else Path(src.path or "")
    if src.kind == "local_dir" and not root.is_dir():
        raise ValueError(f"{field}.path={src.path!r} is not a directory; point it at a local folder of text files")
    patterns = "**/*.py" if src.kind == "stdlib" else src.glob
    left_out = excluded_files(root, src.exclude, f"{field}.exclude") if src.exclude else set()
    paths = [p for p in list_files(root, patterns, unreadable=True) if p not in left_out][: src.max_docs]
    if not paths:
        raise ValueError(f"{field}: no files match {patterns!r} under {root} (less {field}.exclude={src.exclude!r}); "
                         f"change {field}.glob, .exclude or .path")
    return paths


def stream_read_error(src: SourceConfig, field: str, e: Exception) -> Optional[UnreadableRecord]:
    """What a streamed files source's reader raised on a record it cannot decode (met mid-stream), as read_errors
    words it (file:line for jsonl, from a scan of the source's files); None for other errors and other kinds."""
    decode = isinstance(e, ValueError) or type(e).__name__ == "DatasetGenerationError"  # pyarrow's ArrowInvalid too
    if src.kind != "files" or not decode:
        return None
    builder, files = data_files(src.path, field)
    return unreadable_record(files, builder, field, e)


def _hub_dataset(src: SourceConfig, **kw):
    return datasets.load_dataset(src.name, src.subset, split=src.split, **kw)


def _check_text_column(src: SourceConfig, columns: list, field: str) -> None:
    if src.text_column not in columns:
        raise ValueError(f"{field}.text_column={src.text_column!r} is not a column; the columns are {columns}")


def _first_docs_marked(ds: datasets.Dataset, src: SourceConfig, num_proc: int) -> datasets.Dataset:
    """The first max_docs rows -> {text, skip}."""
    if src.max_docs is not None:
        ds = ds.select(range(min(src.max_docs, len(ds))))
    return _mark_skips(ds, src.text_column, num_proc)


def _table(ds: datasets.Dataset, src: SourceConfig, num_proc: int, field: str) -> datasets.Dataset:
    """A tabular source's rows -> {text, skip}: its text column checked, the first max_docs kept."""
    _check_text_column(src, ds.column_names, field)
    return _first_docs_marked(ds, src, num_proc)


def _stream_table(ds: datasets.IterableDataset, src: SourceConfig, field: str) -> datasets.IterableDataset:
    columns = ds.column_names or list(next(iter(ds), {}))
    _check_text_column(src, columns, field)
    if src.max_docs is not None:
        ds = ds.take(src.max_docs)
    return ds.map(_marker(src.text_column), batched=True, remove_columns=[c for c in columns if c != "text"])


# ---- each kind's check (before compute), whole read and streamed read ----

def _needs_path(src: SourceConfig, field: str) -> None:
    if not src.path:
        raise ValueError(f"{field}.path is not set; {field}.path=... ({src.kind} sources read local paths)")


def _check_files(src: SourceConfig, field: str) -> None:
    """Before anything is built: the path names files of a format read here, and the first one's first record
    has the text column."""
    _needs_path(src, field)
    builder, files = data_files(src.path, field)
    with read_errors(files[:1], builder, field):
        head = datasets.load_dataset(builder, data_files=literal_paths(files[:1]), split="train", streaming=True)
        first = next(iter(head), None)
    if first is not None:
        _check_text_column(src, list(first), field)


def _check_hub(src: SourceConfig, field: str) -> None:
    if not src.name:
        raise ValueError(f"{field}.name is empty; name the hub dataset (this is the only kind that needs network)")


def _load_walked(src, cache_dir, num_proc, field):
    return _files_dataset(walk_files(src, field), cache_dir, stdlib_digest() if src.kind == "stdlib" else "")


def walked(src: SourceConfig) -> bool:
    """Whether a source is read from a walk of its files (stdlib, local_dir): walk_files lists them."""
    return KINDS[src.kind].stream is _stream_walked


def _listed(src: SourceConfig, field: str, paths) -> list[str]:
    """`paths` (a stage's one walk of the source's files, data/stream.py), else a walk now."""
    return walk_files(src, field) if paths is None else paths


def _stream_walked(src, cache_dir, field, world, leave_out: range = range(0), paths=None, rank: int = 0,
                   split=None, epoch: int = 0):
    """A walked source's files less the held-out ones in the epoch's order (walked_order), this rank's every
    world-th of them (or the positions `split` gives it): each rank opens only its own files."""
    paths = _listed(src, field, paths)
    kept = paths[:leave_out.start] + paths[leave_out.stop:] if leave_out else paths
    order = walked_order(len(kept), epoch)
    mine = split_rows(split, len(kept)) if split else range(rank, len(kept), max(world, 1))
    # one shard a file; the epoch's order is this one, not datasets' (set_epoch would shuffle each rank's own list)
    return datasets.IterableDataset.from_generator(_read_files, gen_kwargs={"paths": [kept[order[g]] for g in mine]})


def walked_order(count: int, epoch: int) -> list[int]:
    """The order a walked source's files are read in, in epoch `epoch`: as walked in the first, then a permutation
    seeded by the epoch, the same for every number of data-parallel ranks (they take every ranks-th of it)."""
    return list(range(count)) if not epoch else np.random.default_rng(epoch).permutation(count).tolist()


def _size(path: str):
    """A walked file's size, or why it cannot be read (a dangling link or a FIFO, which the reader counts skipped)."""
    return unreadable(path) or os.path.getsize(path)


def stream_rows_identity(src: SourceConfig, field: str, paths=None):
    """What numbers a streamed source's rows, for the data fingerprint: a stdlib or local_dir source's files (a
    file added or removed shifts every later row; `paths`: the stage's walk of them, else walked here) and a files
    source's files, each with its size (an edit that changes it); other kinds, nothing cheaper than reading them
    (their config is in the run's identity)."""
    if walked(src):  # relative: the same files under another clone or mount are the same
        root = stdlib_root() if src.kind == "stdlib" else src.path
        return digest([[os.path.relpath(p, root), _size(p)] for p in _listed(src, field, paths)])
    if src.kind == "files":
        files = data_files(src.path, field)[1]
        return digest([[f, os.path.getsize(f)] for f in files])
    return None


def filler_prefix(src: SourceConfig, sources: dict, field: str, paths=None) -> int:
    """The rows at the head of source `src` whose files a synthetic source's filler trains on (runs of lines of
    synthetic.filler_files(), which lead a stdlib source's sorted walk): none of them may be held out for
    validation. 0 unless src is a stdlib source and some synthetic source has corpus_share > 0. `paths`: the
    stage's walk of its files, else walked here."""
    if src.kind != "stdlib" or not synthetic.filler_sources(sources):
        return 0
    return synthetic.filler_rows(_listed(src, field, paths))


def _load_files(src, cache_dir, num_proc, field):
    builder, files = data_files(src.path, field)
    with read_errors(files, builder, field):
        ds = datasets.load_dataset(builder, data_files=literal_paths(files), split="train", cache_dir=cache_dir)
    _check_text_column(src, ds.column_names, field)  # outside read_errors: a wrong column is not a bad record
    with read_errors(files, builder, field):  # arrow decodes the text here: bad bytes surface now
        return _first_docs_marked(ds, src, num_proc)


def _stream_files(src, cache_dir, field, world):
    builder, files = data_files(src.path, field)
    ds = datasets.load_dataset(builder, data_files=literal_paths(files), split="train", streaming=True)
    return _stream_table(ds, src, field)


def _load_disk(src, cache_dir, num_proc, field):
    if not os.path.isdir(src.path):
        raise ValueError(f"{field}.path={src.path!r} is not a directory written by Dataset.save_to_disk")
    ds = datasets.load_from_disk(src.path)
    if isinstance(ds, datasets.DatasetDict):
        if src.split not in ds:
            raise ValueError(f"{field}.split={src.split!r} is not in {list(ds)}; pick one of those")
        ds = ds[src.split]
    elif src.split != "train":  # one Dataset has no splits: the named one would be read as all of it
        raise ValueError(f"{field}.split={src.split!r}: {src.path} holds one Dataset, not a DatasetDict of splits; "
                         f"drop {field}.split (or save the splits with DatasetDict.save_to_disk)")
    return _table(ds, src, num_proc, field)


def _stream_disk(src, cache_dir, field, world):
    return _load_disk(src, cache_dir, 1, field).to_iterable_dataset(num_shards=max(world, 1) * 8)


def _load_hub(src, cache_dir, num_proc, field):
    return _table(_hub_dataset(src, cache_dir=cache_dir), src, num_proc, field)


def _stream_hub(src, cache_dir, field, world):
    return _stream_table(_hub_dataset(src, streaming=True), src, field)


def check_manual_held_out(sources: dict) -> None:
    """Refuses a stdlib source that reads pydoc_data/topics.py beside a pymanual source: the manual's documents are
    that file's text, so the topics the pymanual source holds out for validation would be trained on."""
    manuals = [n for n, s in sources.items() if s.kind == "pymanual"]
    if not manuals:
        return
    topics = str(stdlib_root() / "pydoc_data" / "topics.py")
    for name, src in sources.items():
        if src.kind == "stdlib" and topics in walk_files(src, f"data.sources.{name}"):
            raise ValueError(f"data.sources.{name} reads pydoc_data/topics.py, the text of data.sources.{manuals[0]} "
                             "(kind pymanual), whose held-out topics it would then train on; add it to "
                             f"data.sources.{name}.exclude (e.g. exclude=\"{src.exclude + ',' if src.exclude else ''}"
                             "pydoc_data/topics.py\")")


@dataclass(frozen=True)
class Kind:
    """One kind of source: check(src, field) runs before compute; load(src, cache_dir, num_proc, field) reads
    it whole; stream(src, cache_dir, field, world) reads it lazily (data.streaming=true). Rows {text, skip}."""

    check: Callable
    load: Callable
    stream: Callable
    reads: tuple = ()  # the OPTIONAL fields it reads (every kind reads kind, weight and max_docs)


def _no_check(src, field):
    return None


# A source's fields that only some kinds read: one set away from its default on a kind that does not is refused
OPTIONAL = ("path", "glob", "exclude", "name", "subset", "split", "text_column", "synthetic")

KINDS = {  # data.sources.<name>.kind -> its Kind; a new kind is one entry here and its functions above
    "stdlib": Kind(_no_check, _load_walked, _stream_walked, ("exclude",)),
    "local_dir": Kind(_needs_path, _load_walked, _stream_walked, ("path", "glob", "exclude")),
    "files": Kind(_check_files, _load_files, _stream_files, ("path", "text_column")),
    "disk": Kind(_needs_path, _load_disk, _stream_disk, ("path", "split", "text_column")),
    "hub": Kind(_check_hub, _load_hub, _stream_hub, ("name", "subset", "split", "text_column")),
    "synthetic": Kind(synthetic.check_source, synthetic.load_synthetic, synthetic.stream_synthetic, ("synthetic",)),
    "pymanual": Kind(manual.check_source, manual.load_manual, manual.stream_manual),
}


def check_source(src: SourceConfig, field: str) -> Kind:
    """The source's Kind, after its checks; a ValueError naming the field otherwise."""
    if src.kind not in KINDS:
        raise ValueError(f"{field}.kind={src.kind!r} is unknown; use one of {list(KINDS)}")
    default = SourceConfig()
    unread = [f for f in OPTIONAL if f not in KINDS[src.kind].reads and getattr(src, f) != getattr(default, f)]
    if unread:
        reads = ", ".join(KINDS[src.kind].reads) or "none of them"
        raise ValueError(f"{', '.join(f'{field}.{f}' for f in unread)}: not read by kind={src.kind} (of "
                         f"{', '.join(OPTIONAL)} it reads {reads}); drop {'them' if len(unread) > 1 else 'it'}, or "
                         "pick the kind that reads it")
    if src.max_docs is not None and src.max_docs < 1:
        raise ValueError(f"{field}.max_docs={src.max_docs} must be >= 1 (null = every document)")
    KINDS[src.kind].check(src, field)
    return KINDS[src.kind]


def load_source(src: SourceConfig, cache_dir: str, num_proc: int = 1, field: str = "data.sources") -> datasets.Dataset:
    """Rows {text, skip} for one source; raises ValueError naming the field on bad input."""
    return check_source(src, field).load(src, cache_dir, num_proc, field)


def drop_skipped(ds: datasets.Dataset) -> tuple[datasets.Dataset, dict]:
    """Removes rows with a skip reason; returns the clean dataset and {reason: count}."""
    reasons = ds["skip"]
    counts: dict = {}
    for r in reasons:
        if r:
            counts[r] = counts.get(r, 0) + 1
    if counts:
        ds = ds.select([i for i, r in enumerate(reasons) if not r])
    return ds.remove_columns("skip"), counts


def stream_source(src: SourceConfig, cache_dir: str, field: str = "data.sources", rank: int = 0, world: int = 1,
                  leave_out: range = range(0), paths=None, split=None, epoch: int = 0) -> datasets.IterableDataset:
    """Rows {text, skip} read lazily (data.streaming=true): the rows in `leave_out` dropped (any range of a stdlib
    or local_dir source's files, a prefix of any other kind), then rank's share of the rest (a walked source's every
    world-th file, which only that rank opens; else whole shards when the shard count divides by world and nothing
    is left out, else every world-th row, which every rank reads past); with `split` (a resume re-split across
    another number of ranks, data/stream_split.py) the rows it names instead. `epoch`: a walked source's files come
    in walked_order's order for it; other kinds take the epoch by `set_epoch` on the dataset that is iterated
    (datasets reorders the shards of a stream without skip() or take() by it, before any split, and a map makes a
    new dataset at epoch 0). `paths`: a stdlib or local_dir source's files as the stage walked them once
    (walk_files), else walked here. Raises ValueError naming the field on bad input, before anything is read past
    the first row."""
    kind = check_source(src, field)
    if kind.stream is _stream_walked:  # already this rank's files
        return _stream_walked(src, cache_dir, field, world, leave_out, paths, rank, split, epoch)
    if leave_out.start:
        raise ValueError(f"{field}: a {src.kind} source can leave out only its first rows, not {leave_out}")
    ds = kind.stream(src, cache_dir, field, 1 if split else world)
    # a split's share starts at its first row where skip() already fixes the order (datasets reorders no shards)
    first = first_row(split) if split and leave_out else 0
    if leave_out:
        ds = ds.skip(leave_out.stop + first)
    if split:
        return ds.filter(keeps(split, first), with_indices=True)
    if world > 1:
        from datasets.distributed import split_dataset_by_node

        # split by shards, datasets would apply the skip to each rank's own shards (its first rows, not the
        # stream's): the held-out rows trained on and as many others never read
        strategy = "examples" if _by_rows(ds.n_shards, world, leave_out) else "shards"
        ds = split_dataset_by_node(ds, rank=rank, world_size=world, strategy=strategy)
    return ds


def _by_rows(shards: int, world: int, leave_out: range) -> bool:
    """Whether `world` ranks split a (non-walked) stream by rows, rank r taking positions r, r + world, ...: always
    with rows left out (a skip), else unless its shards divide evenly among the ranks (then whole shards each)."""
    return world == 1 or bool(leave_out) or shards % world != 0


def stream_split_by_rows(src: SourceConfig, cache_dir: str, field: str, world: int, leave_out: range) -> bool:
    """Whether stream_source gives rank r of `world` the rows at positions r, r + world, ... of the source (what a
    re-split across another number of ranks needs, data/stream_split.py) rather than whole shards."""
    if world == 1 or walked(src) or leave_out:  # without building the stream
        return True
    return _by_rows(KINDS[src.kind].stream(src, cache_dir, field, world).n_shards, world, leave_out)
