"""`python -m eval.ruler key=value ...`: see eval/ruler/run.py."""
from eval.cli import run
from eval.ruler.run import main

if __name__ == "__main__":
    run("eval.ruler", main)
