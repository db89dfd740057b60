"""Schema of the `data` config group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from longstride.choices import Choice


class Packing(Choice):
    best_fit = "best_fit"
    concat = "concat"


class LossOn(Choice):
    """A synthetic source's loss targets: every token, or only the questions and answers after the filler
    (the filler and the facts' first mention are context only, as completion-only SFT does)."""

    all = "all"
    qa = "qa"


@dataclass
class SyntheticConfig:
    """A `synthetic` source (data/synthetic.py): retrieval documents made from (seed, index)."""

    seed: int = 0  # give each synthetic source of a mixture its own seed
    num_docs: int = 2000
    min_words: int = 50  # filler words per document, drawn log-uniform in [min_words, max_words]
    max_words: int = 1000
    # kind -> weight (data/synthetic.py KINDS); empty = synthetic.DEFAULT_KINDS. Empty by default so that a
    # config's own dict replaces it: OmegaConf merges dicts key by key, so a default here would add its kinds
    # to every config's {copy: 1.0}
    kinds: Dict[str, float] = field(default_factory=dict)
    corpus_share: float = 0.5  # share of filler pieces taken from standard-library lines (rest: sentences)
    # share of documents whose filler is one line of 2-5 of the generator's sentences repeated (the passkey layout:
    # the facts are the only lines that differ, and the answers must overrule the filler's copy prior; corpus_share
    # does not apply to it); the other documents are the same as at 0
    repeat_share: float = 0.0
    loss_on: LossOn = LossOn.all


@dataclass
class SourceConfig:
    # stdlib: CPython 3.11.7's standard library .py files (shipped in data/shipped/; no download)
    # local_dir: every file under `path` matching `glob` (comma-separated patterns)
    # files: jsonl/json/parquet/csv/txt files (`path` may be a glob), through datasets
    # disk: a dataset written by `save_to_disk` at `path`
    # hub: a hub dataset `name` (only when you name one; needs network)
    # synthetic: retrieval documents made on the fly (see `synthetic`; no files, no download)
    # pymanual: the Python reference manual's topics (CPython 3.11.7's, from the shipped snapshot), one document each
    # (the kinds are the table data/sources.py KINDS; a wrong name fails before compute, listing them)
    kind: str = "stdlib"
    path: Optional[str] = None
    glob: str = "**/*.py,**/*.md,**/*.txt,**/*.rst"
    # stdlib / local_dir: comma-separated glob patterns (under the root) of files left out, e.g. held-out
    # documents for an evaluation
    exclude: str = ""
    name: Optional[str] = None
    subset: Optional[str] = None
    split: str = "train"
    text_column: str = "text"
    weight: float = 1.0  # share of *tokens* in the mixture
    max_docs: Optional[int] = None  # keep the first N documents (tests, quick runs)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)  # kind=synthetic only


@dataclass
class LongDocConfig:
    """Length-aware upsampling (ProLong, Qwen2.5): at least `min_share` of a long stage's tokens
    come from documents of at least `min_tokens` tokens, by repeating long documents."""

    min_tokens: int = 0  # 0 = off
    min_share: float = 0.0


@dataclass
class DataConfig:
    sources: Dict[str, SourceConfig] = field(default_factory=dict)  # name -> source; see configs/data/
    # Local HF tokenizer dir; None = train a byte-level BPE on the first source and cache it.
    tokenizer: Optional[str] = None
    vocab_size: int = 4096
    split_digits: bool = False  # trained BPE only: one token per digit (Llama, Qwen), for copying numbers
    tokenizer_train_bytes: int = 8_000_000
    packing: Packing = Packing.best_fit
    doc_masking: bool = True  # False = attend across documents (for comparison only; positions still restart)
    num_proc: int = 1
    streaming: bool = False  # read sources lazily (corpora larger than memory), pack online: data/stream.py
    stream_open_seqs: int = 64  # streaming best-fit: sequences kept open for placing documents
    num_workers: int = 0
    # validation: each stage's loss over eval_sequences x seq_len tokens of documents held out of every stage's
    # training, in the stage's mixture (data/pipeline.py holdout_documents); 0 = none
    eval_sequences: int = 8
    seed: int = 1234
    long_docs: LongDocConfig = field(default_factory=LongDocConfig)
