"""`python -m longstride.recipes.check` (what torchrun and accelerate launch): the `longstride check` command."""
from longstride.overrides import run
from longstride.recipes.check.command import main

run("longstride check", main)
