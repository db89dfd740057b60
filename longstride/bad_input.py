"""How a command tells bad input from a bug in what it ran.

Commands show a ValueError (bad input: a field, a file) and a NotImplementedError (a combination refused) as one
line and exit 2. Python raises the same types for its own faults (`a, b = [1, 2, 3]`, `int("x")`), and a one-line
message for one of those, in longstride's code, hides the bug and where it is: such an error keeps its traceback.
"""
from __future__ import annotations

import linecache
import re


def is_bad_input(e: BaseException) -> bool:
    """False for an error Python raised inside longstride's own code (its innermost frame is longstride's and is
    not a `raise` statement); True for what longstride raises on purpose and for a library's own message about the
    input it was handed."""
    tb = e.__traceback__
    if tb is None:
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    if module != "longstride" and not module.startswith("longstride."):
        return True
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    return not line or re.match(r"\s*raise\b", line) is not None  # no source (a .pyc-only install): as before
