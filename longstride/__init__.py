"""longstride: long-context pretraining recipes for PyTorch and Hugging Face.

The repository's folders are this package's subpackages: longstride.recipes (stage runner),
longstride.model, longstride.data, longstride.parallel (ring / Ulysses / UPipe attention),
longstride.eval (RULER, perplexity) and longstride.configs (the Hydra configs). One console
script, `longstride`, runs them (longstride/cli.py).
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("longstride")
except PackageNotFoundError:  # imported from a checkout that was never pip-installed
    __version__ = "0+unknown"
