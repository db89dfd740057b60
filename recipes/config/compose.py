"""The training config a command line composes: Hydra's compose over configs/ (and a --config-dir of your own), checked
against the schema. Light on purpose (Hydra, OmegaConf and the config dataclasses only): `longstride train`
composes the command line before anything else is imported, so that a typo, --help and --cfg answer in about a
second instead of after torch and transformers load.
"""
from __future__ import annotations

import os
import re

from longstride.recipes.config.schema import AddedStageError, added_stage_hint, to_schema

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def compose_training(overrides: list[str], command: str = ""):
    """The training config that `overrides` compose (Hydra's own exceptions); with `command`, a composition error
    is a one-line ValueError pointing at that command's --help, an AddedStageError for a stage added on the command
    line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from longstride.overrides import _reason

    overrides = config_dirs(overrides)
    try:
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            hydra_side, stage_docs = split_long_docs(overrides)
            return to_schema(set_long_docs(compose("config", overrides=hydra_side), stage_docs), overrides)
    except (HydraException, OmegaConfBaseException) as e:
        if not command:
            raise
        reason = _reason(e)
        hint = added_stage_hint(overrides, reason)
        if hint:
            raise AddedStageError(hint) from None
        if "@recipe." in reason:  # a recipe file's defaults (model, data, ...) placed under recipe: by its package
            raise ValueError(f"{reason}: a recipe file begins with the line `# @package _global_`, as those in "
                             "configs/recipe/ do; add it to yours") from None
        raise ValueError(f"{reason} (see {command} --help)") from None


LONG_DOCS = re.compile(r"^\+{0,2}(recipe\.stages\.[^.=]+)\.long_docs(?:\.(\w+))?=(.*)$")


def split_long_docs(overrides: list[str]) -> tuple[list[str], list]:
    """(the overrides Hydra applies, those of a stage's long_docs it cannot). A stage's long_docs is null by default
    (it takes data.long_docs), and OmegaConf can set neither a field under a null node nor a {...} group on it
    (an AssertionError or an AttributeError inside Hydra's compose): set_long_docs applies these after."""
    mine = [(m.group(1), m.group(2), m.group(3)) for o in overrides if (m := LONG_DOCS.match(o))]
    return [o for o in overrides if not LONG_DOCS.match(o)], mine


def set_long_docs(cfg, stage_docs: list):
    """A stage's long_docs overrides on the composed config: a field, or a {...} group, over the stage's own
    long_docs, or data.long_docs' where the stage has none (the fields it does not set are data.long_docs')."""
    if not stage_docs:
        return cfg
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from longstride.data.config import LongDocConfig

    parser = OverridesParser.create()
    for stage, name, text in stage_docs:
        node = OmegaConf.select(cfg, stage)
        if node is None:  # a stage the recipe does not have: Hydra's own error names it
            raise ValueError(f"{stage}: no such stage in the recipe, so its long_docs cannot be set")
        override = parser.parse_override(f"x={text}")
        if override.is_sweep_override():
            raise ValueError(f"{stage}.long_docs: a stage's long_docs cannot be swept (-m); give one value per "
                             "command, or sweep data.long_docs")
        value = override.value()
        if name is None and value is None:
            node.long_docs = None
            continue
        fields = OmegaConf.to_container(node.long_docs if node.long_docs is not None else cfg.data.long_docs)
        given = {name: value} if name else value
        if not isinstance(given, dict) or set(given) - set(fields):
            raise ValueError(f"{stage}.long_docs{'.' + name if name else ''}={text}: long_docs takes "
                             f"{sorted(fields)} (a field, or a {{...}} group of them, or null)")
        node.long_docs = LongDocConfig(**{**fields, **given})
    return cfg


def config_dirs(argv: list[str]) -> list[str]:
    """Hydra's `--config-dir DIR` (also `--config-dir=DIR`, `-cd DIR`: a folder of your own config groups, e.g.
    DIR/recipe/NAME.yaml, whose names must differ from longstride's own: check_not_shadowing) as the override that
    compose() takes."""
    out, dirs, args = [], [], iter(argv)
    for arg in args:
        if arg in ("--config-dir", "-cd"):
            dirs.append(next(args, ""))
        elif arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
        else:
            out.append(arg)
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(f"--config-dir {d!r} is not a directory; name the folder that holds your recipe/NAME.yaml")
        check_not_shadowing(d)
    paths = ",".join(f"file://{os.path.abspath(d)}" for d in dirs)
    return out + [f"hydra.searchpath=[{paths}]"] if dirs else out


def training_groups() -> list[str]:
    """The config groups config.yaml's defaults name (model, data, ..., recipe): the folders Hydra searches."""
    import yaml

    with open(os.path.join(CONFIGS, "config.yaml"), encoding="utf-8") as f:
        defaults = yaml.safe_load(f)["defaults"]
    return [next(iter(d)) for d in defaults if isinstance(d, dict) and "/" not in next(iter(d))]


def check_not_shadowing(folder: str) -> None:
    """A ValueError for a file in `folder` (a --config-dir) with the path of one of longstride's own training
    configs (recipe/tiny.yaml): Hydra searches longstride's folder first, so that file would be read in place of
    yours. Other folders there (accelerate/, hardware/: not Hydra's) are not looked at."""
    if os.path.realpath(folder) == os.path.realpath(CONFIGS):
        return
    for group in ["", *training_groups()]:
        here = os.path.join(folder, group)
        names = [f for f in (os.listdir(here) if os.path.isdir(here) else []) if f.endswith(".yaml")]
        for name in sorted(names if group else [n for n in names if n == "config.yaml"]):
            rel = os.path.join(group, name)
            if os.path.isfile(os.path.join(CONFIGS, rel)):
                mine = os.path.join(group, "my_" + name)
                raise ValueError(f"--config-dir {folder}: {rel} has the path of longstride's own configs/{rel}, and "
                                 f"Hydra reads longstride's in its place; rename yours (say {mine}) and select it "
                                 "by its new name")
