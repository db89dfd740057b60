"""The `longstride` command: one entry point for training, evaluation and conversion.

    longstride train recipe=tiny [hydra overrides]           # one process; several: accelerate launch (below)
    longstride eval ruler checkpoint=DIR lengths=[4096,8192] [key=value ...]
    longstride eval ppl checkpoint=DIR lengths=[1024,2048,4096] [key=value ...]
    longstride eval compare run=outputs/tiny_extend [key=value ...]  # base + every stage, same samples
    longstride convert-gguf out=checkpoints/smollm2-135m-instruct [gguf=FILE]
    longstride export-hf checkpoint=outputs/tiny/s1_256/step_000040 out=DIR  # a sharded step checkpoint as HF
    longstride plan recipe=smollm3_3b_64k hardware=h100_80g gpus_per_node=8 nodes=1  # memory per stage (estimate)
    longstride check checkpoint=DIR seq_len=1024 cp=2 parallel.cp_impl=ring  # CP and kernels vs one device, eager
    longstride <command> --help                              # every option of that command

Several processes run the module behind a command, e.g.
    accelerate launch --config_file configs/accelerate/cpu.yaml -m longstride.recipes.train recipe=tiny
    torchrun --nproc-per-node 2 -m longstride.eval.ruler checkpoint=DIR prefill=cp
    torchrun --nproc-per-node 8 -m longstride.eval.ruler.compare run=outputs/RUN
    torchrun --nproc-per-node 4 -m longstride.recipes.check checkpoint=DIR cp=4
"""
from __future__ import annotations

import sys

USAGE = __doc__.split("\n\n")[1]


def _train(argv: list[str]) -> None:
    from longstride.recipes.train import entry

    sys.argv = ["longstride train", *argv]  # Hydra reads its overrides (and --help) from sys.argv
    entry()


def _parsed_first(command: str, parse: str, execute: str, argv: list[str]) -> None:
    """The command's options parsed by the light `parse` ("module:function", no torch), then its work by `execute`,
    whose module imports torch and transformers: --help, a typo or a bad checkpoint answers in about a second."""
    import importlib

    from longstride.overrides import run

    def function(where: str):
        module, name = where.split(":")
        return getattr(importlib.import_module(module), name)

    def main(args: list[str]):
        parsed = function(parse)(args)
        return function(execute)(parsed)

    run(command, main, argv)


def _eval(argv: list[str]) -> None:
    commands = {"ruler": ("longstride.eval.cli:parse_ruler", "longstride.eval.ruler.run:execute"),
                "ppl": ("longstride.eval.cli:parse_ppl", "longstride.eval.ppl:execute"),
                "compare": ("longstride.eval.cli:parse_compare", "longstride.eval.ruler.compare:execute")}
    if not argv or argv[0] not in commands:
        _usage(f"longstride eval: name one of {sorted(commands)}, e.g. longstride eval ruler checkpoint=DIR")
    _parsed_first(f"longstride eval {argv[0]}", *commands[argv[0]], argv[1:])


def _convert(argv: list[str]) -> None:
    from longstride.overrides import run
    from longstride.model.convert_gguf import main

    run("longstride convert-gguf", main, argv)


def _export(argv: list[str]) -> None:
    from longstride.overrides import run
    from longstride.recipes.checkpoint.export import main

    run("longstride export-hf", main, argv)


def _plan(argv: list[str]) -> None:
    _parsed_first("longstride plan", "longstride.recipes.memory.plan_options:parse_plan",
                  "longstride.recipes.memory.memplan:execute", argv)


def _check(argv: list[str]) -> None:
    _parsed_first("longstride check", "longstride.recipes.check.job:parse_args", "longstride.recipes.check.command:execute",
                  argv)


COMMANDS = {"train": _train, "eval": _eval, "convert-gguf": _convert, "export-hf": _export, "plan": _plan,
            "check": _check}


def _usage(error: str = "") -> None:
    print(f"{error}\n\n{USAGE}" if error else __doc__, file=sys.stderr if error else sys.stdout)
    sys.exit(2 if error else 0)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        _usage()
    if argv[0] not in COMMANDS:
        _usage(f"longstride: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}")
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
