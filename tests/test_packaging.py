"""The package as pip builds it: the wheel holds every module, config and shipped file of the checkout, and
installed on its own (no checkout on the path, another working directory) it composes the main job's recipe
with the shipped base model and tokenizer, and trains a stage through `python -m longstride.recipes.train`."""
from __future__ import annotations

import json
import os
import shutil
import site as sitelib
import subprocess
import sys
import zipfile

from tests.conftest import REPO, micro_overrides

# the checkout's folders and the package each installs as (pyproject.toml's [tool.setuptools.package-dir])
FOLDERS = {"longstride": "longstride", "recipes": "longstride/recipes", "model": "longstride/model",
           "data": "longstride/data", "parallel": "longstride/parallel", "eval": "longstride/eval",
           "configs": "longstride/configs"}
SOURCES = ["pyproject.toml", "README.md", *FOLDERS]  # what the build reads: nothing else of the checkout is copied


def expected_files() -> set[str]:
    """What the wheel must hold: every module, every file of configs/ (the launchers' too), the shipped models and
    corpus."""
    want = set()
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*"):
            rel = path.relative_to(REPO / folder)
            if "__pycache__" in rel.parts or not path.is_file():
                continue
            shipped = folder in ("model", "data") and rel.parts[0] == "shipped"
            if path.suffix == ".py" or folder == "configs" or shipped:
                want.add(f"{package}/{rel.as_posix()}")
    return want


def test_the_wheel_installs_on_its_own_and_trains_from_another_directory(tmp_path):
    src, dist, site, elsewhere = (tmp_path / d for d in ("src", "dist", "site", "elsewhere"))
    src.mkdir()
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info beside the sources
        (shutil.copy if (REPO / name).is_file() else shutil.copytree)(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-c", "import setuptools.build_meta as b, sys; b.build_wheel(sys.argv[1])",
                            str(dist)], cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected_files() - names)
    assert not missing, f"{len(missing)} files of the checkout are not in the wheel: {missing[:20]}"
    assert {"longstride/model/shipped/tiny_base_256/model.safetensors",
            "longstride/data/shipped/cpython-3.11.7-lib.tar.xz"} <= names

    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    elsewhere.mkdir()
    # -S: no site-packages .pth files, so a development install's finder cannot supply what the wheel lacks; the
    # dependencies come from site-packages on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sitelib.getsitepackages()]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    probe = subprocess.run([sys.executable, "-S", "-c", """
import json, sys
from transformers import AutoConfig
import longstride.recipes.train
from longstride.data.tokenizer import load_tokenizer
from longstride.recipes.config.compose import compose_training
cfg = compose_training(["recipe=tiny_extend"])
tok = load_tokenizer(cfg.data.tokenizer)
print(json.dumps({"modules": sorted({m.__file__ for n, m in sys.modules.items() if n.split(".")[0] == "longstride"
                                     and getattr(m, "__file__", None)}),
                  "checkpoint": cfg.model.checkpoint, "vocab": len(tok),
                  "layers": AutoConfig.from_pretrained(cfg.model.checkpoint).num_hidden_layers}))
"""], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    outside = [m for m in got["modules"] if not m.startswith(str(site))]
    assert len(got["modules"]) > 20 and not outside, outside  # the installed copy only, never the checkout
    assert got["checkpoint"] == str(site / "longstride" / "model" / "shipped" / "tiny_base_256")
    assert got["vocab"] == 4096 and got["layers"] == 4

    micro = micro_overrides(tmp_path / "out", tmp_path / "cache")
    train = subprocess.run([sys.executable, "-S", "-m", "longstride.recipes.train", *micro, "stage=s1_256"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "out" / "tiny" / "s1_256" / "final" / "model.safetensors").is_file()
    assert not any(elsewhere.iterdir()), "nothing written to the working directory beyond paths.output_root"
