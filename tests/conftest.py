"""Shared fixtures: a micro recipe on a slice of the embedded corpus, composed like the CLI does."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

torch.set_num_threads(1)
# ... and one thread in every process a test starts (training runs, launches, benchmarks' children), unless the caller
# says otherwise: two xdist workers on 2 cores already fill the machine, and a second thread per process only spins
# (a 3-stage micro run: 19.7 CPU-s with torch's default 2 threads, 14.5 with one, and no slower)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# offline in this process too: the fork server that starts run_cli's training runs (tests/forked_cli.py) imports
# huggingface_hub and datasets with this environment, and they read these switches only then
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.hookimpl(trylast=True)  # after -k / -m deselection, so that the shares are sized on what runs
def pytest_collection_modifyitems(config, items):
    """Longest tests first on every xdist worker (tests/schedule.py)."""
    from tests.schedule import reorder

    reorder(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def micro_overrides(root: Path, cache: Path) -> list[str]:
    """A 3-stage recipe small enough for tests: 64 -> 128 -> 256 tokens on 60 stdlib files."""
    return [
        "recipe=tiny", "logger.wandb_mode=disabled", "logger.progress_bar=false",
        f"paths.output_root={root}", f"paths.cache_dir={cache}",
        "data.sources.stdlib.max_docs=60", "data.vocab_size=384", "data.tokenizer_train_bytes=200000",
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.nope_interval=2",
        "model.loss_tile_tokens=100",
        "recipe.stages.s1_256.seq_len=64", "recipe.stages.s1_256.steps=6", "recipe.stages.s1_256.batch_tokens=512",
        "recipe.stages.s1_256.micro_batch_size=4", "recipe.stages.s1_256.warmup_steps=1",
        "recipe.stages.s1_256.save_every=3",
        "recipe.stages.s2_2k.seq_len=128", "recipe.stages.s2_2k.steps=4", "recipe.stages.s2_2k.batch_tokens=512",
        "recipe.stages.s2_2k.warmup_steps=1", "recipe.stages.s2_2k.save_every=2", "recipe.stages.s2_2k.cp=1",
        "recipe.stages.s3_4k.seq_len=256", "recipe.stages.s3_4k.steps=4", "recipe.stages.s3_4k.batch_tokens=512",
        "recipe.stages.s3_4k.warmup_steps=1", "recipe.stages.s3_4k.save_every=2", "recipe.stages.s3_4k.cp=1",
    ]


def compose_cfg(overrides: list[str]):
    from longstride.recipes.config.compose import compose_training

    return compose_training(overrides)


@pytest.fixture(scope="session")
def ruler_checkpoint(tmp_path_factory) -> Path:
    """The RULER tests' micro checkpoint (tests/test_ruler.py, tests/test_ruler_samples.py): its BPE has seen RULER's
    noise sentences."""
    from longstride.eval.ruler.words import NOISE

    d = tmp_path_factory.mktemp("ruler_ckpt")
    micro_checkpoint(d, 1000, 2048, extra_texts=(NOISE,) * 20)
    return d


@pytest.fixture(scope="session")
def squad(tmp_path_factory) -> str:
    """A SQuAD-format dev file: one article of 60 paragraphs, each with an answerable and an unanswerable question."""
    from longstride.eval.ruler.words import common_words

    paras = [{"context": f"The {w} of the harbour is called Port {w.title()} since {1800 + i}.",
              "qas": [{"question": f"What is the {w} of the harbour called?",
                       "answers": [{"text": f"Port {w.title()}"}], "is_impossible": False},
                      {"question": "Unanswerable?", "answers": [], "is_impossible": True}]}
             for i, w in enumerate(common_words()[:60])]
    path = tmp_path_factory.mktemp("qa") / "squad.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": paras}]}))
    return str(path)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def micro(tmp_path, cache_dir) -> list[str]:
    return micro_overrides(tmp_path / "out", cache_dir)


@pytest.fixture(scope="session")
def s1_reference(tmp_path_factory, cache_dir) -> Path:
    """The micro recipe's stage s1_256 trained in one process, uninterrupted (run_cli): the run whose losses the
    multi-process, re-split and resumed runs of the suite must equal. Its stage folder; tests only read it."""
    root = tmp_path_factory.mktemp("s1_reference")
    r = run_cli(micro_overrides(root, cache_dir) + ["stage=s1_256"])
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "tiny" / "s1_256"


def rerun_from_step_3(micro: list[str], root: Path, key: str, first: list[str], again: list[str]):
    """Stage s1 of the micro recipe (`micro` writing under `root`/out) run with `first`, then resumed from its
    step_000003 with `again`: (the metric `key` by step after the first run, after the resumed run, the resumed
    run's process). Each run's exit status is asserted 0."""
    s1 = root / "out" / "tiny" / "s1_256"
    r = run_cli(micro + ["stage=s1_256", *first])
    assert r.returncode == 0, r.stderr[-3000:]
    before = {step: m[key] for step, m in read_metrics(s1).items() if key in m}
    r = run_cli(micro + ["stage=s1_256", *again, f"train.resume_from={s1}/step_000003"])
    assert r.returncode == 0, r.stderr[-3000:]
    return before, {step: m[key] for step, m in read_metrics(s1).items() if key in m}, r


def crash_after(step: int) -> dict:
    """The environment of recipes/run/stage.py's test hook: SIGKILL after optimizer step `step` of a stage."""
    return {"LONGSTRIDE_TEST_CRASH_AT_STEP": str(step)}


_PORTS = itertools.count()


def accelerate_launch(processes: int = 2) -> list[str]:
    """`accelerate launch` with the CPU config (2 processes unless told) on a port of this pytest worker's
    own: the config's fixed port would collide when tests run side by side (pytest -n 2). Each xdist worker
    takes ports from its own block of 100 below the kernel's ephemeral range (so no other process's
    connection is handed one), a new one per launch, skipping any that is taken."""
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    for _ in range(100):
        port = 29600 + 100 * (worker % 30) + next(_PORTS) % 100
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(CONFIGS / "accelerate/cpu.yaml"), "--num_processes", str(processes),
                "--main_process_port", str(port)]
    raise RuntimeError(f"no free port in 29600 + 100 x {worker % 30} .. + 99")


def run_cli(overrides: list[str], env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m longstride.recipes.train *overrides` as its own process, forked from a server that has imported
    the training modules (tests/forked_cli.py)."""
    from tests.forked_cli import run_module

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           **(env_extra or {})}
    return run_module("longstride.recipes.train", overrides, env, str(REPO), timeout)


def micro_checkpoint(directory: Path, vocab_size: int, seq_len: int, extra_texts: tuple = ()):
    """A 2-layer SmolLM3 with a BPE trained on 40 stdlib files (plus extra_texts), saved as an HF dir."""
    from longstride.data.files import list_files, stdlib_root
    from longstride.data.tokenizer import train_bpe
    from longstride.model.build import build_model
    from longstride.model.config import ModelConfig

    texts = [open(p, encoding="utf-8").read() for p in list_files(stdlib_root(), "**/*.py")[:40]]
    tok = train_bpe(texts + list(extra_texts), vocab_size)
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2, initializer_range=0.3)
    model = build_model(cfg, rope_theta=1e4, seq_len=seq_len, vocab_size=len(tok), eos_id=tok.eos_token_id,
                        pad_id=tok.pad_token_id)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return tok


def report(path: str, fn, done=str) -> None:
    """For one rank of a spawned test: writes to `path` what fn() came to, done(its value) or "ExceptionType:
    message", for the test to compare across the ranks."""
    try:
        said = done(fn())
    except Exception as e:  # noqa: BLE001 - what each rank raised is the test's subject
        said = f"{type(e).__name__}: {e}"
    with open(path, "w") as f:
        f.write(said)


def read_metrics(stage_dir: Path) -> dict[int, dict]:
    """Records merged per step; a resumed run's records replace the killed run's for the same step."""
    out: dict[int, dict] = {}
    for line in (stage_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
    return out
