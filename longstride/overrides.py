"""key=value command lines for the commands other than training (eval ruler, eval ppl, convert-gguf),
parsed like training's: Hydra's override grammar composed onto the command's dataclass schema, so a
mistyped key or choice fails naming it (and listing the choices), and `--help` prints every option
with its default and the comment beside it in the schema."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
import re
import sys
import tempfile
import typing
from enum import Enum
from typing import Callable, Optional

from hydra import compose, initialize
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def _comments(schema: type) -> dict[str, str]:
    """field name -> the comment on its line in the dataclass source ("" when none)."""
    try:
        source = inspect.getsource(schema)
    except (OSError, TypeError):
        return {}
    found = {}
    for line in source.splitlines():
        m = re.match(r"\s+(\w+):[^#]*(?:#\s*(.*))?$", line)
        if m:
            found.setdefault(m.group(1), m.group(2) or "")
    return found


def _options(schema: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) of every leaf field, nested dataclasses as dotted keys."""
    hints, notes, rows = typing.get_type_hints(schema), _comments(schema), []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            rows += _options(kind, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "???")
        note = notes.get(f.name, "")
        if isinstance(kind, type) and issubclass(kind, Enum):
            note = f"one of {' | '.join(m.value for m in kind)}" + (f"; {note}" if note else "")
        rows.append((f"{prefix}{f.name}", _value(default), note))
    return rows


def _value(x) -> str:
    """A default as it is typed on the command line."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_value(v) for v in x) + "]"
    return str(x)


def help_text(schema: type, command: str, doc: str) -> str:
    rows = _options(schema)
    width = min(44, max(len(f"{k}={d}") for k, d, _ in rows))
    lines = [f"usage: {command} key=value ...   (Hydra's override grammar, as for `longstride train`)", "",
             doc.strip(), "", "options (key=default):"]
    for k, d, n in rows:
        opt = f"{k}={d}"
        lines.append(f"  {opt:<{width}}  {n}".rstrip() if len(opt) <= width or not n else f"  {opt}\n  {'':<{width}}  {n}")
    return "\n".join(lines)


def module_doc(module: str) -> str:
    """A module's docstring read from its source, without importing it: a command's --help text lives in the module
    that does its work, which imports torch and transformers (seconds), while the options are parsed without them."""
    with open(importlib.util.find_spec(module).origin) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def parse_own(schema: type, argv: list[str], command: str, doc: str = ""):
    """For a command that also takes training overrides (check, plan): the arguments naming `schema`'s fields (and
    --help) parsed onto it, the rest kept as given in its `overrides` list."""
    names = {f.name for f in dataclasses.fields(schema)} - {"overrides"}
    mine = [a for a in argv if a.split("=", 1)[0].lstrip("+") in names or a in ("-h", "--help")]
    cfg = parse(schema, mine, command, doc)
    cfg.overrides = [a for a in argv if a not in mine]
    return cfg


def parse(schema: type, argv: list[str], command: str, doc: str = ""):
    """argv (key=value ...) composed onto `schema` -> an instance of it. --help prints the options and exits."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(schema, command, doc))
        sys.exit(0)
    name = f"{schema.__module__}.{schema.__qualname__}"
    ConfigStore.instance().store(name=name, node=schema)
    hint = _shape_hint(schema, argv)
    if " is a list here" in hint:  # before compose: OmegaConf asserts on a dotted key into a list left null
        raise ValueError(hint[2:] + f" (see {command} --help)")
    try:
        with initialize(version_base="1.3", config_path=None):
            cfg = OmegaConf.to_object(compose(config_name=name, overrides=list(argv)))
    except (HydraException, OmegaConfBaseException, ValueError) as e:  # ValueError: a list index that is a name
        raise ValueError(_reason(e) + hint + f" (see {command} --help)") from None
    threads = getattr(cfg, "threads", None)  # the eval commands' torch.set_num_threads
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads} must be >= 1 (null = torch's default)")
    return cfg


def _shape_hint(schema: type, argv: list[str]) -> str:
    """Where an override gives a list field a dotted key (yarn.factor=2 to eval compare's yarn list) or a group a
    single value (yarn=2 to eval ruler's yarn group), how that command spells it; "" otherwise."""
    hints = typing.get_type_hints(schema)
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        top, dotted = key.split(".", 1)[0], "." in key
        kind = hints.get(top)
        if kind is None:
            continue
        if typing.get_origin(kind) is typing.Union:  # Optional[X]: X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if dotted and typing.get_origin(kind) in (list, typing.List) and not key.split(".", 1)[1].isdigit():
            return f"; {key}: {top} is a list here: {top}=[{value}]"
        if not dotted and dataclasses.is_dataclass(kind) and not value.startswith("{"):
            names = [f.name for f in dataclasses.fields(kind)]
            return f"; {top} is a group here: {top}.{names[0]}={value} (its fields: {', '.join(names)})"
    return ""


def _reason(e: BaseException) -> str:
    """One line: Hydra's first line and the schema's reason (which names the key and the valid choices)."""
    lines = [str(e).splitlines()[0].rstrip(".:")]
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        lines.append(str(cause).strip().splitlines()[0])
    # a value in a config file (not an override, whose line names it): OmegaConf's key is on a later line
    key = next((k for k in (getattr(x, "full_key", None) for x in (cause, e)) if k), None)
    if key and key not in lines[0] and key not in lines[-1]:
        lines[-1] += f" (at {key})"
    return ": ".join(lines)


def run(command: str, main: Callable[[list[str]], object], argv: Optional[list[str]] = None) -> None:
    """main(argv) with bad input (ValueError) and what is refused (NotImplementedError) shown as one line, exit
    status 2; the same types raised by a fault in longstride's own code keep their traceback (bad_input.py)."""
    from longstride.bad_input import is_bad_input
    from longstride.process import skip_exit_collection

    skip_exit_collection()
    try:
        main(sys.argv[1:] if argv is None else argv)
    except (ValueError, NotImplementedError) as e:
        if not is_bad_input(e):
            raise
        print(f"{command}: {e}", file=sys.stderr)
        sys.exit(2)


def writable_dir(path: str, field: str = "out", shown: Optional[str] = None) -> str:
    """`path`, a command's results folder: its nearest existing folder written to once (a probe file, removed;
    nothing is created), so that an out=
    under a file, or where the user may not write, fails while parsing, naming `field` (as `shown`, where it names
    a file in `path`), not after the compute."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the nearest existing folder: nothing is created here
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"{field}={shown or path!r}: results cannot be written there ({e.strerror or e}); give a "
                         "folder you can write to") from None
    return path
