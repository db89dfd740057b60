"""The tokenizer: any local HF tokenizer, or a byte-level BPE trained on the corpus and cached.

Whatever it is, it is saved into every checkpoint, so `AutoTokenizer.from_pretrained(checkpoint)`
gives back exactly the tokenizer the model was trained with.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from longstride.data.batch import context_only
from longstride.model.model_dir import TOKENIZER_FILES
from longstride.whole_dir import Appeared, staged

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_bpe(texts: Iterable[str], vocab_size: int, split_digits: bool = False) -> PreTrainedTokenizerFast:
    """split_digits: every digit its own token (as Llama and Qwen do), so a number reads the same
    wherever it stands; otherwise merges make "is 7796" and ": 7180" split at different places."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, model_max_length=1 << 30)


def cached_bpe(texts: Iterable[str], vocab_size: int, cache_dir: str, key: str,
               split_digits: bool = False) -> PreTrainedTokenizerFast:
    """Train once per `key`; written to a temporary dir and renamed, so a crash leaves no half file."""
    final = os.path.join(cache_dir, "tokenizers", key)
    if not os.path.isfile(os.path.join(final, "tokenizer.json")):
        os.makedirs(os.path.dirname(final), exist_ok=True)
        try:
            with staged(final) as tmp:
                train_bpe(texts, vocab_size, split_digits).save_pretrained(tmp)
        except Appeared:  # another process finished first: theirs is identical
            pass
    return AutoTokenizer.from_pretrained(final)


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] where the tokenizer puts it before text (Llama, Gemma: models that have only ever seen text after it),
    else [] (SmolLM2, Qwen, the shipped tokenizers). Training opens every document with it, and evaluation every
    prompt, so the two agree (a piece packing cuts from an over-long document continues it, without one)."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else []


def tokenize_fn(tokenizer):
    """A batched `datasets.map` function: each document's token ids, after BOS where the tokenizer opens text with
    it (bos_prefix), with EOS appended. Rows with a `loss_from` column (synthetic sources) store the tokens that end
    at or before that character as context only (`context_only`), so they are seen but never trained on. A special
    token's text inside a document (`<|endoftext|>` in a code or web corpus) is tokenized as text
    (split_special_tokens), never as the id itself: only packing writes EOS, BOS and padding."""
    eos, start = tokenizer.eos_token_id, bos_prefix(tokenizer)

    def tokenize(batch):
        if "loss_from" not in batch:  # verbose=False: documents longer than model_max_length are packed, not fed whole
            ids = tokenizer(batch["text"], add_special_tokens=False, split_special_tokens=True,
                            verbose=False)["input_ids"]
            return {"input_ids": [start + x + [eos] for x in ids]}
        enc = tokenizer(batch["text"], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True,
                        verbose=False)
        out = []
        for x, offsets, begin in zip(enc["input_ids"], enc["offset_mapping"], batch["loss_from"]):
            out.append([context_only(t) for t in start]
                       + [t if end > begin else context_only(t) for t, (_, end) in zip(x, offsets)] + [eos])
        return {"input_ids": out}

    return tokenize


def save_tokenizer(tokenizer, directory: str, positions: int) -> None:
    """The run's tokenizer into a checkpoint, its model_max_length raised to the model's max positions where it was
    lower: a SmolLM2 tokenizer says 8192, and extended to 32K its checkpoint would still tell a downstream
    truncation=True to cut at 8K. (The run's tokenizer object keeps its own value.)"""
    before = tokenizer.model_max_length
    tokenizer.model_max_length = max(int(before or 0), int(positions))
    try:
        tokenizer.save_pretrained(directory)
    except Exception as e:
        if type(e) is not Exception:
            raise
        # the tokenizers library (Rust) reports a failed write, a full disk too, as a plain Exception: as an OSError
        # it is the failed write every checkpoint writer reports (recipes/checkpoint/format.disk_errors)
        raise OSError(f"could not write the tokenizer to {directory}: {e}") from e
    finally:
        tokenizer.model_max_length = before


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    if not os.path.isdir(path):
        raise ValueError(f"data.tokenizer={path!r} is not a directory; give a local HF tokenizer dir or null to train one")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.tokenizer={path} could not be loaded as an HF tokenizer ({str(e).splitlines()[0]}); "
                         f"give the directory holding {' or '.join(TOKENIZER_FILES)}") from None
    check_tokenizer(tok, "data.tokenizer")
    return tok


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase, legacy: bool = False) -> str:
    """"v2:" and the SHA-256 of what maps text to a document's ids: a fast tokenizer's model (vocabulary and merges),
    normalizer, pre-tokenizer and added tokens, or a slow one's vocabulary (added tokens included); and the ids
    packing writes around them: EOS after each document, BOS before it (bos_prefix), the padding id. Every step
    checkpoint stores it, and a resume under another tokenizer is refused (recipes/run/stage_state.py).
    legacy: the fingerprint without the "v2:" ids, which checkpoints written before them hold."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        what = {k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    else:
        what = sorted(tok.get_vocab().items())
    if not legacy:
        what = {"text": what, "eos": tok.eos_token_id, "bos_prefix": bos_prefix(tok), "pad": tok.pad_token_id}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode("utf-8", "surrogatepass")).hexdigest()
    return digest if legacy else f"v2:{digest}"


def check_tokenizer(tok: PreTrainedTokenizerBase, field: str) -> None:
    if tok.eos_token_id is None:
        raise ValueError(
            f"{field}: the tokenizer has no EOS token, which packing needs between documents; "
            "set tokenizer.eos_token (for example tok.add_special_tokens({'eos_token': '</s>'})) and save it"
        )
