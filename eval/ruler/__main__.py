"""`python -m longstride.eval.ruler key=value ...` (the module `longstride eval ruler` runs; torchrun takes it):
see eval/ruler/run.py."""
from longstride.overrides import run
from longstride.eval.ruler.run import main

if __name__ == "__main__":
    run("eval.ruler", main)
