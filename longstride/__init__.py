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

# From a plain checkout (no pip install), the subpackages are the repository's top-level folders:
# longstride.parallel is ./parallel. An installed package carries them inside it instead.
import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "parallel")) and _os.path.isfile(_os.path.join(_root, "parallel", "ring.py")):
    __path__.append(_root)  # noqa: F821 (a package's own __path__)
del _here, _root
