"""The launch lines the shipped recipes' headers write, run as written: the overrides they give validate on the
hardware they name (a header's advice that validation refuses is a broken front door)."""
from __future__ import annotations

import pytest

from longstride.recipes.config.plan import validate
from tests.conftest import compose_cfg


def test_the_extend_recipes_header_overrides_plan_on_one_gpu_and_on_a_node(tmp_path):
    """configs/recipe/extend_pretrained.yaml's header says how to run it from a longer-trained checkpoint and on 8
    GPUs: its defaults plan on one process and are refused on 8 naming the value to set; the header's overrides
    plan there, as written."""
    import re

    from tests.conftest import REPO, micro_checkpoint

    micro_checkpoint(tmp_path / "ckpt", 384, 1024)
    text = (REPO / "configs" / "recipe" / "extend_pretrained.yaml").read_text().split("# Launch:")[0]
    longer, node = (re.findall(r"recipe\.stages\.\S+=\S+", part) for part in text.split("# Hardware:"))
    assert len(longer) == 6 and len(node) == 2, (longer, node)
    base = ["recipe=extend_pretrained", f"model.checkpoint={tmp_path / 'ckpt'}", f"data.tokenizer={tmp_path / 'ckpt'}"]
    validate(compose_cfg(base), 1)
    with pytest.raises(ValueError, match=r"x2.batch_tokens=8192 is not a multiple of dp 8 .* = 16384 .*; set "
                                         r"recipe.stages.x2.batch_tokens=16384, or raise recipe.stages.x2.cp"):
        validate(compose_cfg(base), 8, "cuda", assume_gpu=True)
    validate(compose_cfg(base + node), 8, "cuda", assume_gpu=True)
    validate(compose_cfg(base + longer), 1, "cuda", assume_gpu=True)


def test_the_real_recipes_streaming_launch_validates_as_its_header_writes_it(tmp_path):
    """smollm3_3b_64k's header names the two overrides a corpus larger than memory needs (it was refused twice
    over: long-document upsampling, and data=files' two loader workers)."""
    import json
    import re

    from tests.conftest import REPO, micro_checkpoint

    micro_checkpoint(tmp_path / "tok", 384, 64)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    header = (REPO / "configs" / "recipe" / "smollm3_3b_64k.yaml").read_text().split("defaults:")[0]
    streaming = re.search(r"add (data\.streaming=true .*?) \(", header).group(1).split()
    cfg = compose_cfg(["recipe=smollm3_3b_64k", f"data.tokenizer={tmp_path / 'tok'}",
                       f"data.sources.main.path={tmp_path / 'corpus' / '*.jsonl'}", *streaming])
    assert cfg.data.streaming and streaming == ["data.streaming=true", "data.long_docs.min_tokens=0"]
    validate(cfg, 8, "cuda", assume_gpu=True)
