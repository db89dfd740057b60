"""Bad data input: skipped and counted, or a clear error naming the field; never a crash later."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from longstride.data.config import DataConfig, SourceConfig
from longstride.data.corpus import build_corpus
from longstride.data.sources import drop_skipped, load_source
from longstride.data.tokenizer import check_tokenizer, train_bpe


@pytest.fixture(scope="module")
def tok():
    return train_bpe(["def f(x):\n    return x + 1\n" * 50, "hello world, plain prose here.\n" * 50], 300)


def test_bad_documents_are_skipped_and_counted(tmp_path, cache_dir):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("a real document\n" * 10)
    (d / "b.txt").write_text("")
    (d / "c.txt").write_text("   \n\t\n")
    (d / "d.txt").write_bytes(b"bad \xff\xfe bytes")
    ds, skipped = drop_skipped(load_source(SourceConfig(kind="local_dir", path=str(d), glob="*.txt"), str(cache_dir)))
    assert len(ds) == 1 and skipped == {"empty": 1, "whitespace": 1, "invalid_utf8": 1}


def test_jsonl_missing_text_column_names_the_columns(tmp_path, cache_dir):
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"content": f"doc {i}", "id": i}) for i in range(3)))
    with pytest.raises(ValueError, match=r"text_column='text' is not a column; the columns are \['content', 'id'\]"):
        load_source(SourceConfig(kind="files", path=str(f)), str(cache_dir))
    ds = load_source(SourceConfig(kind="files", path=str(f), text_column="content"), str(cache_dir))
    assert ds["text"] == ["doc 0", "doc 1", "doc 2"]


def test_missing_file_and_dir(tmp_path, cache_dir):
    with pytest.raises(ValueError, match="file not found"):
        load_source(SourceConfig(kind="files", path=str(tmp_path / "nope.jsonl")), str(cache_dir))
    with pytest.raises(ValueError, match="is not a directory"):
        load_source(SourceConfig(kind="local_dir", path=str(tmp_path / "nope")), str(cache_dir))


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_data_file_is_named_not_a_stop_iteration(tmp_path, cache_dir, content):
    """datasets reads a 0-byte jsonl as a bare StopIteration, a blank one as "corresponds to no data", and a blank
    one beside files with data as a cast error; each empty file is named, alone or in a glob."""
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(ValueError, match=r"data.sources.path='.*a.jsonl': .*a.jsonl is empty \(no record\); "
                                         r"remove it"):
        load_source(SourceConfig(kind="files", path=str(tmp_path / "a.jsonl")), str(cache_dir))
    (tmp_path / "b.jsonl").write_text('{"text": "one document"}\n')
    with pytest.raises(ValueError, match=r"'.*\*.jsonl': .*a.jsonl is empty"):
        load_source(SourceConfig(kind="files", path=str(tmp_path / "*.jsonl")), str(cache_dir))
    (tmp_path / "a.jsonl").unlink()
    assert len(load_source(SourceConfig(kind="files", path=str(tmp_path / "*.jsonl")), str(cache_dir))) == 1
    # text files: blank lines are documents that are skipped and counted, as before
    (tmp_path / "a.txt").write_text(content)
    (tmp_path / "b.txt").write_text("one line of text\n")
    ds, skipped = drop_skipped(load_source(SourceConfig(kind="files", path=str(tmp_path / "*.txt")), str(cache_dir)))
    assert list(ds["text"]) == ["one line of text"] and sum(skipped.values()) == content.count("\n"), skipped


def test_empty_corpus(tmp_path, cache_dir, tok):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "x.txt").write_text("  ")
    cfg = DataConfig(sources={"only": SourceConfig(kind="local_dir", path=str(d), glob="*.txt")})
    with pytest.raises(ValueError, match="no usable document"):
        build_corpus(cfg, tok, str(cache_dir))


def test_tokenizer_without_eos(tok):
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(ValueError, match="no EOS token"):
        check_tokenizer(bare, "data.tokenizer")


def test_corpus_appends_eos_and_mixes_sources(tmp_path, cache_dir, tok):
    from longstride.data.corpus import mixture_documents

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for i in range(60):
        (a / f"{i}.txt").write_text(f"source a document {i} " * (i % 7 + 1))
        (b / f"{i}.txt").write_text(f"source b {i} " * 3)
    cfg = DataConfig(sources={"a": SourceConfig(kind="local_dir", path=str(a), glob="*.txt"),
                              "b": SourceConfig(kind="local_dir", path=str(b), glob="*.txt")})
    corpus = build_corpus(cfg, tok, str(cache_dir))
    ends = corpus.tokens[corpus.doc_start + corpus.doc_len - 1]
    assert (ends == tok.eos_token_id).all()
    docs = mixture_documents(corpus, {"a": 1.0, "b": 3.0}, seed=0)
    share_b = corpus.doc_len[docs][corpus.doc_source[docs] == 1].sum() / corpus.doc_len[docs].sum()
    assert 0.72 < share_b < 0.78, share_b  # token weight 3:1, up to one document of rounding


def test_a_source_of_few_long_documents_comes_nearest_its_weight():
    """A source stops short of the document that crosses its share where that one overshoots by more than 5% and
    stopping short comes nearer: 3 books of 40K tokens at weight 0.2 of 220K tokens take one book (share 0.185),
    not the two that cross the target (0.31, as before); a source whose one document is far above its share still
    gives that document (never dropped)."""
    from longstride.data.corpus import Corpus, mixture_documents
    from longstride.data.pipeline import source_shares

    lens = np.r_[[40000] * 3, [100] * 1000]
    src = np.r_[[0] * 3, [1] * 1000].astype(np.int16)
    corpus = Corpus(np.zeros(lens.sum(), np.int32), np.cumsum(lens) - lens, lens, src, ["books", "code"])
    for seed in range(3):
        shares = source_shares(corpus, mixture_documents(corpus, {"books": 0.2, "code": 0.8}, seed))
        assert abs(shares["source_token_share"]["books"] - 0.2) < 0.02, shares
    docs = mixture_documents(corpus, {"books": 0.01, "code": 0.99}, 0)
    assert (corpus.doc_source[docs] == 0).sum() == 1


def test_links_fifos_and_loops_are_skipped_and_counted(tmp_path, cache_dir):
    import os

    d = tmp_path / "odd"
    d.mkdir()
    (d / "a.txt").write_text("a real document\n" * 10)
    (d / "dangling.txt").symlink_to(d / "missing.txt")
    (d / "loop1.txt").symlink_to(d / "loop2.txt")
    (d / "loop2.txt").symlink_to(d / "loop1.txt")
    os.mkfifo(d / "pipe.txt")  # opening it would block: it must be recognised without opening
    ds, skipped = drop_skipped(load_source(SourceConfig(kind="local_dir", path=str(d), glob="*.txt"), str(cache_dir)))
    assert len(ds) == 1 and skipped == {"broken_link": 3, "not_a_file": 1}


@pytest.mark.parametrize("bad_line, problem", [
    (b'{"text": "broken\n', "3: not JSON"),
    (b'{"text": "bad \xff bytes"}\n', "3: not UTF-8"),
    (b'{"text": {"nested": 1}}\n', "3: 'text' is a dict, on line 1 a str"),
])
def test_broken_jsonl_names_the_file_and_line(tmp_path, cache_dir, bad_line, problem):
    f = tmp_path / "c.jsonl"
    f.write_bytes(b'{"text": "one"}\n{"text": "two"}\n' + bad_line + b'{"text": "four"}\n')
    with pytest.raises(ValueError, match=re.escape(f"data.sources.path: {f}:{problem}")):
        load_source(SourceConfig(kind="files", path=str(f)), str(cache_dir), field="data.sources")


def test_exclude_leaves_files_out_of_walked_sources(tmp_path, cache_dir):
    d = tmp_path / "docs"
    (d / "keep").mkdir(parents=True)
    (d / "keep" / "a.txt").write_text("alpha text")
    (d / "held.txt").write_text("held out text")
    src = SourceConfig(kind="local_dir", path=str(d), glob="**/*.txt", exclude="held.txt")
    ds, _ = drop_skipped(load_source(src, str(cache_dir)))
    assert list(ds["text"]) == ["alpha text"]
    with pytest.raises(ValueError, match=r"data.sources: no files match .* \(less data.sources.exclude="):
        load_source(SourceConfig(kind="local_dir", path=str(d), glob="**/*.txt", exclude="**/*.txt"), str(cache_dir))


def test_pymanual_source_is_the_manuals_topics(cache_dir, monkeypatch):
    """The topics come from the shipped 3.11.7 snapshot, so another Python (the GPU machine's 3.12) trains on the
    same text: an interpreter's own pydoc_data is never read."""
    import sys

    from longstride.data.manual import manual_topics

    manual_topics.cache_clear()
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # importing it would raise
    ds, _ = drop_skipped(load_source(SourceConfig(kind="pymanual", max_docs=3), str(cache_dir)))
    topics = manual_topics()
    assert list(ds["text"]) == list(topics[:3]) and len(topics) == 79, len(topics)  # 3.11.7's 79 topics
    assert topics[0].startswith("The \"assert\" statement")


def test_the_embedded_corpus_is_the_shipped_stdlib_whatever_python_runs(tmp_path, monkeypatch):
    """The stdlib source and the synthetic filler read CPython 3.11.7's standard library from data/shipped/, not the
    running Python's (another version or a distribution's trimmed copy trains on other documents); it is unpacked
    once per cache, and a tree left incomplete (no stamp) is replaced."""
    import sysconfig

    from longstride.data import files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path / "elsewhere")})
    root = files.stdlib_root()
    assert root.parent == tmp_path / "longstride" and (root / ".complete").is_file()
    found = files.list_files(root, "**/*.py")
    assert len(found) == 1790 and str(root / "test" / "test_json" / "__init__.py") in found
    assert (root / "LICENSE.txt").read_text().startswith("A. HISTORY OF THE SOFTWARE")
    (root / "json" / "__init__.py").unlink()
    assert files.stdlib_root() == root and not (root / "json" / "__init__.py").exists()  # stamped: not unpacked again
    (root / ".complete").write_text("another archive")  # a stamp of another archive: unpacked anew
    (tmp_path / "longstride" / f"{root.name}.partial-x").mkdir()  # what a killed unpack leaves: removed
    assert files.stdlib_root() == root and (root / "json" / "__init__.py").is_file()
    assert not list(root.parent.glob("*.partial-*"))
    (root / ".complete").unlink()  # no stamp at all (an unpack cut short before it): replaced too
    (root / "json" / "__init__.py").unlink()
    assert files.stdlib_root() == root and (root / "json" / "__init__.py").is_file()


def test_a_file_rewritten_under_its_old_mtime_is_read_again(tmp_path, cache_dir):
    """The walked-files cache is keyed by size as well as mtime (the shipped corpus' files all carry mtime 0, and
    a copy tool may keep mtimes), so new text under an old mtime is not served from the cache."""
    d = tmp_path / "docs"
    d.mkdir()
    f = d / "a.txt"
    f.write_text("alpha")
    stamp = os.stat(f).st_mtime_ns
    src = SourceConfig(kind="local_dir", path=str(d), glob="*.txt")
    assert load_source(src, str(cache_dir))["text"] == ["alpha"]
    f.write_text("zeta and more")
    os.utime(f, ns=(stamp, stamp))
    assert load_source(src, str(cache_dir))["text"] == ["zeta and more"]


def test_the_trained_tokenizer_is_cached_by_its_training_texts(tmp_path, cache_dir):
    """The same source config over edited files trains a new BPE (the old one had none of the new words' merges);
    the same texts reuse the cached one."""
    from longstride.data.corpus import build_tokenizer

    d = tmp_path / "docs"
    d.mkdir()
    cfg = DataConfig(sources={"only": SourceConfig(kind="local_dir", path=str(d), glob="*.txt")}, vocab_size=300)
    (d / "a.txt").write_text("alpha beta gamma " * 200)
    first = build_tokenizer(cfg, str(cache_dir))
    assert build_tokenizer(cfg, str(cache_dir)).name_or_path == first.name_or_path, "the same texts: cached"
    (d / "a.txt").write_text("zeta omega sigma " * 200)
    second = build_tokenizer(cfg, str(cache_dir))
    assert second.name_or_path != first.name_or_path
    assert len(second("zeta omega")["input_ids"]) < len(first("zeta omega")["input_ids"])


def test_the_stage_logs_each_sources_share_of_its_tokens(tmp_path, cache_dir, tok):
    """source_token_share follows the mixture's weights, and shows how long-document upsampling moves them."""
    from longstride.data.config import LongDocConfig
    from longstride.data.pipeline import stage_sequences

    for name, words in (("short", 20), ("long", 400)):
        d = tmp_path / name
        d.mkdir()
        for i in range(40):
            (d / f"{i}.txt").write_text(" ".join(f"{name}{i}w{j}" for j in range(words)))
    cfg = DataConfig(sources={n: SourceConfig(kind="local_dir", path=str(tmp_path / n), glob="*.txt")
                              for n in ("short", "long")})
    corpus = build_corpus(cfg, tok, str(cache_dir))
    _, stats = stage_sequences(cfg, corpus, 512, tok.pad_token_id, {"short": 0.75, "long": 0.25})
    assert stats["source_token_share"]["short"] == pytest.approx(0.75, abs=0.02), stats
    _, up = stage_sequences(cfg, corpus, 512, tok.pad_token_id, {"short": 0.75, "long": 0.25},
                            LongDocConfig(min_tokens=300, min_share=0.6))
    assert up["source_token_share"]["long"] >= 0.55, up  # the long source's documents repeated past its weight


def test_documents_open_with_bos_where_the_tokenizer_opens_text_with_it():
    """Training tokenizes without special tokens and appends EOS; a tokenizer that puts BOS before text (Llama,
    Gemma) gets it at every document's start too, as evaluation puts it before every prompt (eval/ppl.py), so a
    BOS model is not extended on text it never saw. In a synthetic row BOS is context (never a target either way:
    the EOS before it has no label). A tokenizer without BOS (the shipped one, SmolLM2) is unchanged."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from longstride.data.batch import context_only
    from longstride.data.tokenizer import bos_prefix, tokenize_fn
    from longstride.recipes.config.schema import SHIPPED

    tok = AutoTokenizer.from_pretrained(os.path.join(SHIPPED, "tiny_base_256"))
    plain = tokenize_fn(tok)({"text": ["hello world"]})["input_ids"][0]
    assert bos_prefix(tok) == [] and plain == tok("hello world")["input_ids"] + [tok.eos_token_id]
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert tok("hello world")["input_ids"] == [bos] + plain[:-1]  # what the model saw in pretraining
    assert tokenize_fn(tok)({"text": ["hello world"]})["input_ids"][0] == [bos] + plain
    synthetic = tokenize_fn(tok)({"text": ["q: 1 a: 2"], "loss_from": [5]})["input_ids"][0]
    assert synthetic[0] == context_only(bos) and bos_prefix(tok) == [bos]


def test_a_checkpoints_tokenizer_says_the_models_max_positions(tmp_path):
    """A tokenizer whose model_max_length is below the extended model's positions (SmolLM2's says 8192) is saved
    with the model's, so a downstream truncation=True does not cut the extended context; a higher one is kept, and
    the run's own tokenizer object is unchanged. Tokenizing a document past the limit warns nothing."""
    from transformers import AutoTokenizer

    from longstride.data.tokenizer import save_tokenizer, tokenize_fn
    from longstride.recipes.config.schema import SHIPPED

    tok = AutoTokenizer.from_pretrained(os.path.join(SHIPPED, "tiny_base_256"))
    tok.model_max_length = 64
    save_tokenizer(tok, str(tmp_path / "a"), 4096)
    assert AutoTokenizer.from_pretrained(tmp_path / "a").model_max_length == 4096 and tok.model_max_length == 64
    tok.model_max_length = 10**6
    save_tokenizer(tok, str(tmp_path / "b"), 4096)
    assert AutoTokenizer.from_pretrained(tmp_path / "b").model_max_length == 10**6
    tok.model_max_length = 64
    assert len(tokenize_fn(tok)({"text": ["word " * 500]})["input_ids"][0]) > 64
    assert not tok.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum")


def test_files_globs_reach_nested_folders_and_compressed_text_formats(tmp_path, cache_dir):
    """`**` in a files source's path matches folders at any depth, as a local_dir glob does (it matched exactly one
    level: the other files' documents were left out without a word), in memory and streamed; corpus.jsonl.gz reads
    as jsonl (it was refused as an unknown extension '.gz')."""
    import gzip

    from longstride.data.sources import stream_source

    for rel in ("top.jsonl", "a/x.jsonl", "a/b/y.jsonl"):
        f = tmp_path / "nested" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"text": rel}) + "\n")
    src = SourceConfig(kind="files", path=str(tmp_path / "nested" / "**" / "*.jsonl"))
    want = ["a/b/y.jsonl", "a/x.jsonl", "top.jsonl"]
    assert sorted(load_source(src, str(cache_dir))["text"]) == want
    assert sorted(row["text"] for row in stream_source(src, str(cache_dir))) == want
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(3)))
    assert load_source(SourceConfig(kind="files", path=str(gz)), str(cache_dir))["text"] == ["doc 0", "doc 1", "doc 2"]
    with pytest.raises(ValueError, match=r"unsupported extension '.gz'"):
        (tmp_path / "c.parquet.gz").write_bytes(b"x")
        load_source(SourceConfig(kind="files", path=str(tmp_path / "c.parquet.gz")), str(cache_dir))


def test_a_files_source_is_checked_before_anything_is_built(tmp_path):
    """A files source whose path matches nothing, or whose first record lacks the text column, fails validation
    (training's checks before the model and the data are built), streamed or not; the data=files group streams
    without further overrides (it set two loader workers, which streaming refuses)."""
    from longstride.recipes.config.plan import validate
    from tests.conftest import compose_cfg

    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"content": f"doc {i}"}) for i in range(3)))
    base = ["data=files", f"paths.output_root={tmp_path / 'out'}", "recipe.stages.s2_2k.cp=1",
            "recipe.stages.s3_4k.cp=1"]
    for streaming in ("false", "true"):
        with pytest.raises(ValueError, match=r"data.sources.main.path='/no/such/\*.parquet': file not found"):
            validate(compose_cfg(base + ["data.sources.main.path=/no/such/*.parquet",
                                         f"data.streaming={streaming}"]), 1)
        with pytest.raises(ValueError, match=r"data.sources.main.text_column='text' is not a column; the columns are "
                                             r"\['content'\]"):
            validate(compose_cfg(base + [f"data.sources.main.path={f}", f"data.streaming={streaming}"]), 1)
        validate(compose_cfg(base + [f"data.sources.main.path={f}", "data.sources.main.text_column=content",
                                     f"data.streaming={streaming}"]), 1)


def test_a_from_scratch_model_names_the_tokenizers_bos():
    """Documents open with the tokenizer's BOS where it has one (Llama-style); the model config a stage builds from
    scratch names that id as its BOS (it named EOS, so generate() from an empty prompt began with EOS), and EOS
    where the tokenizer has no BOS."""
    from longstride.model.build import stage_config
    from longstride.model.config import ModelConfig

    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    assert stage_config(cfg, 1e4, 64, vocab_size=100, eos_id=1, pad_id=0, bos_id=2).bos_token_id == 2
    assert stage_config(cfg, 1e4, 64, vocab_size=100, eos_id=1, pad_id=0).bos_token_id == 1


def test_a_record_is_named_only_where_the_reader_fails_and_across_files(tmp_path, cache_dir):
    """A key that holds ints and floats reads (one number column) and is not blamed; a key whose type changes in a
    later file is named with both places; a .zst file without the zstandard package says what to install; a file
    named with [ ] is a path, not a glob."""
    from longstride.data.file_records import first_bad_record

    (tmp_path / "kt").mkdir()
    (tmp_path / "kt" / "1.jsonl").write_text('{"text": "a", "score": 1}\n{"text": "b", "score": 1.5}\n')
    (tmp_path / "kt" / "2.jsonl").write_text('{"text": "c", "score": "high"}\n')
    files = [str(tmp_path / "kt" / "1.jsonl"), str(tmp_path / "kt" / "2.jsonl")]
    assert first_bad_record(files[:1], "json") == ""
    assert first_bad_record(files, "json") == f"{files[1]}:1: 'score' is a str, on {files[0]}:1 a number"
    with pytest.raises(ValueError, match=re.escape(f"{files[1]}:1: 'score' is a str")):
        load_source(SourceConfig(kind="files", path=str(tmp_path / "kt" / "*.jsonl")), str(cache_dir))
    import importlib.util
    if importlib.util.find_spec("zstandard") is None:
        (tmp_path / "d.jsonl.zst").write_bytes(b"(\xb5/\xfd")
        with pytest.raises(ValueError, match=r"\.zst files cannot be decompressed here; pip install zstandard"):
            load_source(SourceConfig(kind="files", path=str(tmp_path / "d.jsonl.zst")), str(cache_dir))
    odd = tmp_path / "part[1].jsonl"
    odd.write_text('{"text": "bracketed"}\n')
    assert load_source(SourceConfig(kind="files", path=str(odd)), str(cache_dir))["text"] == ["bracketed"]


@pytest.mark.parametrize("pattern", ["tests", "tests/**", "tests/*"])
def test_an_exclude_naming_a_folder_leaves_out_its_files_and_one_matching_nothing_is_refused(tmp_path, cache_dir,
                                                                                             pattern):
    """`exclude=tests/**` or `tests` gave Python's glob the folder alone, which the walk dropped: nothing was left out
    and the held-out files were trained on. A folder's files are left out now; a pattern matching no file (a typo)
    or an absolute one is refused, naming the field."""
    d = tmp_path / "docs"
    (d / "tests" / "deep").mkdir(parents=True)
    (d / "a.txt").write_text("alpha text")
    (d / "tests" / "t.txt").write_text("held out")
    (d / "tests" / "deep" / "u.txt").write_text("held out too")
    src = SourceConfig(kind="local_dir", path=str(d), glob="**/*.txt", exclude=pattern)
    ds, _ = drop_skipped(load_source(src, str(cache_dir)))
    assert list(ds["text"]) == ["alpha text"], "tests/* matches the folder deep too: its files are left out"
    for bad, why in (("test/*", "matches no file under"), (f"{d}/tests/*", "is no glob relative to")):
        with pytest.raises(ValueError, match=re.escape(f"data.sources.exclude='{bad}': '{bad}' {why}")):
            load_source(SourceConfig(kind="local_dir", path=str(d), glob="**/*.txt", exclude=bad), str(cache_dir))


def test_a_disk_source_split_is_refused_on_a_single_dataset(tmp_path, cache_dir):
    """split=validation on a folder holding one Dataset (no splits) read the whole dataset as if it were that
    split; now refused naming the field. A DatasetDict's split is read; one it lacks is named."""
    import datasets

    datasets.Dataset.from_dict({"text": ["alpha", "beta"]}).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]}),
                          "validation": datasets.Dataset.from_dict({"text": ["v"]})}).save_to_disk(str(tmp_path / "two"))
    one = SourceConfig(kind="disk", path=str(tmp_path / "one"))
    assert sorted(drop_skipped(load_source(one, str(cache_dir)))[0]["text"]) == ["alpha", "beta"]
    with pytest.raises(ValueError, match=r"data.sources.split='validation': .* holds one Dataset, not a DatasetDict"):
        load_source(SourceConfig(kind="disk", path=str(tmp_path / "one"), split="validation"), str(cache_dir))
    two = SourceConfig(kind="disk", path=str(tmp_path / "two"), split="validation")
    assert list(drop_skipped(load_source(two, str(cache_dir)))[0]["text"]) == ["v"]


def test_a_special_token_s_text_inside_a_document_stays_text():
    """`<|endoftext|>` written inside a document (code and web corpora quote it) became the EOS id mid-document: a
    document boundary the packer never made. It is tokenized as text now, in plain and in synthetic rows; only
    packing writes EOS."""
    import os

    from transformers import AutoTokenizer

    from longstride.data.tokenizer import tokenize_fn
    from longstride.recipes.config.schema import SHIPPED

    tok = AutoTokenizer.from_pretrained(os.path.join(SHIPPED, "tiny_base_256"))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for batch in ({"text": ["foo <|endoftext|> bar <|pad|>"]},
                  {"text": ["q: <|endoftext|> a: <|pad|>"], "loss_from": [3]}):
        ids = tokenize_fn(tok)(batch)["input_ids"][0]
        assert ids[-1] == eos and eos not in ids[:-1] and pad not in ids, ids
        assert tok.decode([t if t >= 0 else -t - 1 for t in ids[:-1]]) == batch["text"][0]
