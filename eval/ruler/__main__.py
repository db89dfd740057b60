"""`python -m eval.ruler key=value ...`: see eval/ruler/run.py."""
import sys

from eval.ruler.run import main

if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as e:
        print(f"eval.ruler: {e}", file=sys.stderr)
        sys.exit(2)
