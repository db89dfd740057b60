"""The eval commands' command lines (`longstride eval ruler | ppl | compare`): their options (dataclass schemas),
parsed with longstride/overrides.py and checked from files alone, so that `--help`, a mistyped key or a bad
checkpoint answers before torch and transformers are imported (a second, not six). The commands' work, which
imports them: eval/ruler/run.py, eval/ppl.py, eval/ruler/compare.py; each one's docstring is its --help text."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from longstride.choices import Choice, WandbMode, check_wandb
from longstride.eval.ruler.tasks import ALL_TASKS, TASKS
from longstride.model.config import YarnConfig
from longstride.model.model_dir import TOKENIZER_FILES, check_checkpoint_dir, check_checkpoint_weights, has_tokenizer
from longstride.overrides import module_doc, parse, writable_dir


class Dtype(Choice):  # eval/load.py's DTYPES maps each to its torch dtype
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Prefill(Choice):
    local = "local"
    cp = "cp"


@dataclass
class QAFiles:
    squad: Optional[str] = None  # SQuAD dev json (qa_1)
    hotpotqa: Optional[str] = None  # HotpotQA dev-distractor json (qa_2)


@dataclass
class RulerConfig:
    checkpoint: Optional[str] = None
    lengths: List[int] = field(default_factory=lambda: [1024, 2048, 4096])
    tasks: List[str] = field(default_factory=lambda: list(TASKS))  # RULER's; synth_kv, synth_multikey, synth_chain: in-format
    num_samples: int = 8  # per task and length
    seed: int = 42
    chat: bool = True  # use the tokenizer's chat template when it has one
    yarn: YarnConfig = field(default_factory=YarnConfig)
    rope_layer_types: Optional[List[str]] = None  # YaRN's layer types where RoPE is per type (model/rope.py)
    extrapolate: bool = False  # run lengths past the model's max positions anyway (to measure the drop)
    haystack: Optional[str] = None  # prose for essay haystacks: a dir or file of .txt/.md/.rst; None = Python manual
    qa: QAFiles = field(default_factory=QAFiles)
    batch_size: int = 0  # answers decoded together (each prompt prefilled alone); 0 = as many as batch_tokens allows
    stop_when_scored: bool = True  # end an answer once its score is decided (same score; false: run to EOS/budget)
    draft: int = 4  # prompt-lookup tokens verified per decode step (same answers, fewer forwards); 0: one a step
    batch_tokens: int = 131072  # with batch_size=0: rows x (longest prompt + budget x (1 + draft)) within this (the KV cache)
    prefill_chunk: int = 8192  # prompt tokens per prefill forward (a later chunk attends to the cached ones)
    prefill: Prefill = Prefill.local  # cp: with several processes, ring-attention prefill over all of them
    dtype: Dtype = Dtype.float32
    threshold: float = 85.6  # effective-length threshold (RULER: Llama-2-7B at 4K)
    out: Optional[str] = None  # results folder; None = outputs/eval/<checkpoint path>
    wandb: WandbMode = WandbMode.disabled
    wandb_project: str = "longstride-eval"
    threads: Optional[int] = None



@dataclass
class PplConfig:
    checkpoint: Optional[str] = None
    lengths: List[int] = field(default_factory=lambda: [1024, 2048, 4096])
    yarn: YarnConfig = field(default_factory=YarnConfig)
    rope_layer_types: Optional[List[str]] = None  # YaRN's layer types where RoPE is per type (model/rope.py)
    docs_dir: Optional[str] = None  # None = the shipped CPython 3.11.7 standard library snapshot (data/shipped/)
    glob: str = "**/*.py"
    max_docs: int = 8  # documents per length
    out: Optional[str] = None  # results folder; None = outputs/eval/<checkpoint path>
    tile: int = 1024
    threads: Optional[int] = None
    # float32: comparable with CPU runs; bfloat16 halves a long-context eval's memory on a GPU (the loss stays fp32)
    dtype: Dtype = Dtype.float32



@dataclass
class CompareConfig:
    run: Optional[str] = None  # a training run's folder (outputs/<recipe>): its base model, then each stage's final/
    checkpoints: List[str] = field(default_factory=list)  # or these HF model dirs, in order (the first is the base)
    tasks: List[str] = field(default_factory=lambda: ["niah_single_1", "synth_kv"])
    lengths: List[int] = field(default_factory=list)  # empty: 256 and powers of 2 up to 2x the last trained length
    # YaRN factors at eval time, on the last checkpoint; null: [2, 4] where its RoPE takes YaRN, else none (a note:
    # Llama 3.1's llama3 scaling, say); []: no YaRN rows
    yarn: Optional[List[float]] = None
    yarn_lengths: List[int] = field(default_factory=list)  # empty: 2x and 4x the last checkpoint's trained length
    rope_layer_types: Optional[List[str]] = None  # YaRN's layer types where RoPE is per type (model/rope.py)
    plain_rows: bool = True  # false: only the YaRN rows (the checkpoints without YaRN are measured elsewhere)
    num_samples: int = 20  # per task and length, the same for every checkpoint
    seed: int = 42
    chat: bool = True
    haystack: Optional[str] = None  # prose for essay haystacks (see eval ruler); None = Python manual
    qa: QAFiles = field(default_factory=QAFiles)  # local SQuAD / HotpotQA files for qa_1 / qa_2
    batch_size: int = 0  # answers decoded together; 0 = as many as batch_tokens allows
    stop_when_scored: bool = True  # end an answer once its score is decided (same score, shorter answer)
    draft: int = 4  # prompt-lookup tokens verified per decode step (same answers, fewer forwards); 0: one a step
    batch_tokens: int = 131072  # rows x (longest prompt + budget x (1 + draft)) decoded together (the KV cache)
    prefill_chunk: int = 8192  # prompt tokens per prefill forward
    dtype: Dtype = Dtype.float32
    threads: Optional[int] = None
    out: Optional[str] = None  # None = outputs/eval/compare-<run folder name, or last checkpoint's: s3_4k-final>



def parse_overrides(schema: type, argv: list[str], command: str, module: str, example: str):
    """argv (key=value ...) into an instance of `schema` (--help: `module`'s docstring and the options), whose
    `checkpoint` must be an HF model dir with readable weights and a tokenizer, and whose results folder (`out`, or
    default_out) one can write to."""
    cfg = parse(schema, argv, command, module_doc(module))
    if not cfg.checkpoint:
        raise ValueError(f"checkpoint=<dir> is required ({example})")
    check_checkpoint_dir(cfg.checkpoint, "checkpoint")
    check_checkpoint_weights(cfg.checkpoint, "checkpoint")
    writable_dir(cfg.out or default_out(cfg.checkpoint))
    return cfg


def results_stem(command: str, yarn_factor, dtype="float32") -> str:
    """The name an eval command's files share: ruler / ppl, _yarnF with YaRN, _DTYPE when not float32 (beside, not
    over, a float32 run's files): ruler_yarn2_bfloat16.json. Scripts that read the files build the name here."""
    return (command + (f"_yarn{float(yarn_factor):g}" if yarn_factor else "")
            + ("" if str(dtype) == "float32" else f"_{dtype}"))


def default_out(checkpoint: str) -> str:
    """Where results go without out=: outputs/eval/<checkpoint path, '/' as '-'> (the path relative to
    the working directory without a leading outputs/, or its last three parts), never inside the
    checkpoint, which may be uploaded as it is."""
    path = os.path.abspath(checkpoint)
    real = os.path.realpath(path)  # a checkpoint reached through a link is still the folder the cwd is in
    if os.path.commonpath([real, os.path.realpath(os.getcwd())]) == real:
        raise ValueError(f"out: the working directory is inside checkpoint={checkpoint!r}, so the default out "
                         "(outputs/eval/...) would write into the checkpoint; give out=DIR, or run from outside it")
    rel = os.path.relpath(path)
    parts = rel.split(os.sep) if not rel.startswith("..") else path.split(os.sep)[-3:]
    if len(parts) > 1 and parts[0] == "outputs":
        parts = parts[1:]
    return os.path.join("outputs", "eval", "-".join(p for p in parts if p))


def require_tokenizer(checkpoint: str, name: str = "checkpoint") -> None:
    if not has_tokenizer(checkpoint):
        raise ValueError(f"{name}={checkpoint!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save the "
                         f"tokenizer into it with tokenizer.save_pretrained(dir)")


def check_generation(cfg) -> None:
    """The sampling and generation fields `eval ruler` and `eval compare` share: the task names (a typo would run
    an evaluation without the task), the numbers and the QA files."""
    unknown = [n for n in dict.fromkeys(cfg.tasks) if n not in ALL_TASKS]
    if unknown:
        raise ValueError(f"tasks: {unknown} {'is no task' if len(unknown) == 1 else 'are no tasks'}; known tasks: "
                         f"{', '.join(ALL_TASKS)}")
    if cfg.num_samples < 1 or cfg.batch_size < 0 or cfg.prefill_chunk < 1 or cfg.batch_tokens < 1:
        raise ValueError("num_samples, prefill_chunk and batch_tokens must be >= 1, batch_size >= 0 (0: by batch_tokens)")
    if cfg.draft < 0:
        raise ValueError(f"draft={cfg.draft}: the prompt-lookup tokens verified per decode step are >= 0 (0: none)")
    for kind in ("squad", "hotpotqa"):
        path = getattr(cfg.qa, kind)
        if path and not os.path.isfile(path):
            raise ValueError(f"qa.{kind}={path!r} does not exist; give the local {kind} dev json or leave it unset")


DECODE_BATCHING = ("batch_size", "batch_tokens", "draft", "prefill_chunk")  # what prefill=local reads, cp does not


def parse_ruler(argv: list[str]) -> RulerConfig:
    cfg = parse_overrides(RulerConfig, argv, "longstride eval ruler", "longstride.eval.ruler.run",
                          "an HF model dir, e.g. outputs/tiny/s3_4k/final; for a GGUF file convert it once with "
                          "longstride convert-gguf")
    require_tokenizer(cfg.checkpoint)
    if not cfg.lengths or any(L < 16 for L in cfg.lengths):
        raise ValueError(f"lengths={cfg.lengths}: give token lengths >= 16, e.g. lengths=[4096,8192]")
    check_generation(cfg)
    check_wandb(cfg.wandb, "wandb")
    given = sorted({a.split("=", 1)[0].lstrip("+~") for a in argv} & set(DECODE_BATCHING))
    if cfg.prefill == "cp" and given:
        raise ValueError("prefill=cp prefills each prompt whole, split over the processes, and decodes the samples "
                         f"one at a time without prompt lookup: {', '.join(given)} "
                         f"{'is' if len(given) == 1 else 'are'} not read there; drop it, or use prefill=local (samples split over the processes)")
    if cfg.prefill == "cp" and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError("prefill=cp splits each prompt over several processes: launch with "
                         "torchrun --nproc-per-node N -m longstride.eval.ruler ... (or use prefill=local)")
    return cfg


def parse_ppl(argv: list[str]) -> PplConfig:
    cfg = parse_overrides(PplConfig, argv, "longstride eval ppl", "longstride.eval.ppl",
                          "an HF model dir, e.g. outputs/tiny/s3_4k/final")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every process would run it all, on one GPU, into one file
        raise ValueError("longstride eval ppl runs in one process: launch it with python -m longstride.eval.ppl "
                         "(or longstride eval ppl), not torchrun / accelerate launch")
    if not cfg.lengths or any(L < 8 for L in cfg.lengths):  # the last quarter needs a token with a label
        raise ValueError(f"lengths={cfg.lengths}: give token lengths >= 8, e.g. lengths=[1024,2048]")
    for name, value in (("tile", cfg.tile), ("max_docs", cfg.max_docs)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if cfg.docs_dir is not None and not os.path.isdir(cfg.docs_dir):
        raise ValueError(f"docs_dir={cfg.docs_dir!r} is not a directory; give a folder of text files "
                         "(default: the Python standard library)")
    return cfg


def parse_compare(argv: list[str]) -> CompareConfig:
    cfg = parse(CompareConfig, argv, "longstride eval compare", module_doc("longstride.eval.ruler.compare"))
    named = compared_checkpoints(cfg)
    for i, (_, ckpt) in enumerate(named):
        field_name = f"checkpoints[{i}]" if cfg.checkpoints else "run's checkpoint"
        check_checkpoint_dir(ckpt, field_name)
        check_checkpoint_weights(ckpt, field_name)
        require_tokenizer(ckpt, field_name)
    if not cfg.plain_rows and cfg.yarn == []:
        raise ValueError("plain_rows=false leaves only the YaRN rows: give yarn=[2,...] too")
    if any(L < 16 for L in cfg.lengths + cfg.yarn_lengths) or any(f <= 1 for f in cfg.yarn or []):
        raise ValueError("lengths and yarn_lengths are token counts >= 16; yarn factors are > 1, e.g. yarn=[2,4]")
    check_generation(cfg)
    writable_dir(compare_out(cfg, named))
    return cfg


def compared_checkpoints(cfg: CompareConfig) -> list[tuple[str, str]]:
    """(label, HF model dir) of each checkpoint `eval compare` scores, in order (parse_compare checks them)."""
    if bool(cfg.run) == bool(cfg.checkpoints):
        raise ValueError("give run=DIR (a training run's folder, e.g. outputs/tiny_extend) or checkpoints=[A,B,...], "
                         "not both")
    return run_checkpoints(cfg.run) if cfg.run else [(checkpoint_label(c), c) for c in cfg.checkpoints]


def compare_name(cfg: CompareConfig, named: list[tuple[str, str]]) -> str:
    """The run folder's name, or the last checkpoint's last two path parts (s3_4k-final)."""
    return os.path.basename(os.path.normpath(cfg.run)) if cfg.run else \
        "-".join(os.path.normpath(named[-1][1]).split(os.sep)[-2:])


def compare_out(cfg: CompareConfig, named: list[tuple[str, str]]) -> str:
    return cfg.out or os.path.join("outputs", "eval", f"compare-{compare_name(cfg, named)}")


def run_checkpoints(run: str) -> list[tuple[str, str]]:
    """(label, dir) of a training run: the model it started from (model.checkpoint), then each stage's
    final checkpoint in recipe order. A missing stage is an error naming it."""
    from omegaconf import OmegaConf

    path = os.path.join(run, "config.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"run={run!r} has no config.yaml: give the folder a training run wrote (outputs/<recipe>)")
    cfg = OmegaConf.load(path)
    out = []
    if cfg.model.get("arch") == "checkpoint" and cfg.model.get("checkpoint"):
        out.append((f"base ({os.path.basename(os.path.normpath(cfg.model.checkpoint))})", cfg.model.checkpoint))
    for stage in cfg.recipe.stages:
        final = os.path.join(run, stage, "final")
        if not os.path.isfile(os.path.join(final, "config.json")):
            raise ValueError(f"run={run!r}: stage {stage} has no final checkpoint ({final}); finish the run first "
                             f"(the same training command resumes it)")
        out.append((stage, final))
    return out


def checkpoint_label(checkpoint: str) -> str:
    """A checkpoint's row label: its folder's name, or its stage's for a stage's final/
    (outputs/<recipe>/s2_2k/final -> s2_2k)."""
    parts = os.path.normpath(checkpoint).split(os.sep)
    return parts[-2] if parts[-1] == "final" and len(parts) > 1 else parts[-1]
