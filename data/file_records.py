"""A files source's data files: the paths its path or glob names, their format (a compressed text format too),
opening them, and naming the record a reader fails on (file:line for jsonl). data/sources.py reads them through
`datasets`; this module never does.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from pathlib import Path

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # datasets decompresses these by extension (text formats: corpus.jsonl.gz)


def _extension(path: str) -> str:
    """A file's format extension, a compression suffix after it skipped: .jsonl for corpus.jsonl.gz."""
    suffixes = [x.lower() for x in Path(path).suffixes]
    if len(suffixes) > 1 and suffixes[-1] in COMPRESSED and suffixes[-2] in set(FILE_BUILDERS) - {".parquet"}:
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


def literal_paths(files: list[str]) -> list[str]:
    """File names as datasets takes them: it expands globs, so a [ ] in a name is escaped."""
    return [glob.escape(f) for f in files]


def _open_bytes(path: str):
    """A data file opened for reading bytes, decompressed when its name ends in a compression suffix."""
    import fsspec

    return fsspec.open(path, "rb", compression="infer").open()


def data_files(path: str, field: str) -> tuple[str, list[str]]:
    """(datasets builder, files) of a `files` source's `path`: a file, or a glob (`**` matches folders at any
    depth, as in a local_dir source's glob)."""
    pattern = any(ch in path for ch in "*?[") and not os.path.isfile(path)  # a file may be named a[1].jsonl
    files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f)) if pattern else [path]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise ValueError(f"{field}.path={path!r}: file not found ({missing or 'no match'}); check the path")
    ext = _extension(files[0])
    if ext not in FILE_BUILDERS:
        raise ValueError(f"{field}.path: unsupported extension {ext!r}; use one of {sorted(FILE_BUILDERS)}, "
                         f"text formats also compressed ({', '.join(COMPRESSED)})")
    from fsspec.utils import infer_compression

    unread = sorted({Path(f).suffix for f in files
                     if Path(f).suffix.lower() in COMPRESSED and not infer_compression(f)})
    if unread:  # fsspec knows .zst only with the zstandard package installed
        raise ValueError(f"{field}.path: {', '.join(unread)} files cannot be decompressed here; pip install zstandard")
    # datasets' json reader fails on an empty file (a bare StopIteration, "no data", a cast error beside others);
    # its text reader counts blank lines as skipped documents
    blank = [f for f in files if FILE_BUILDERS[ext] == "json" and _blank(f, field)]
    if blank:
        raise ValueError(f"{field}.path={path!r}: {', '.join(blank[:3])}{' ...' if len(blank) > 3 else ''} "
                         f"{'is' if len(blank) == 1 else 'are'} empty (no record); remove "
                         f"{'it' if len(blank) == 1 else 'them'} or point the path at files with data")
    return FILE_BUILDERS[ext], files


def _blank(path: str, field: str) -> bool:
    """A file of whitespace only (read until its first other byte, a byte-order mark aside)."""
    try:
        with _open_bytes(path) as f:
            while chunk := f.read(1 << 16):
                if chunk.lstrip(b"\xef\xbb\xbf").strip():
                    return False
    except OSError as e:
        raise ValueError(f"{field}.path: {path} cannot be read ({e.strerror}); check its permissions") from None
    return True


@contextlib.contextmanager
def read_errors(files: list[str], builder: str, field: str):
    """A reader's failure inside datasets as a ValueError naming the file and line (jsonl) or the files."""
    try:
        yield
    except Exception as e:
        raise unreadable_record(files, builder, field, e) from e


class UnreadableRecord(ValueError):
    """A data file's record its reader cannot decode."""


def unreadable_record(files: list[str], builder: str, field: str, e: Exception) -> UnreadableRecord:
    first = str(e).splitlines()[0] if str(e) else ""
    where = first_bad_record(files, builder)
    if where:
        return UnreadableRecord(f"{field}.path: {where} could not be read ({type(e).__name__}: {first}); fix or "
                                "remove that record")
    named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return UnreadableRecord(f"{field}.path: {named} could not be read ({type(e).__name__}: {first})")


def first_bad_record(files: list[str], builder: str) -> str:
    """'file:line: problem' of the first line of a jsonl / json-lines file that is not UTF-8, not a JSON
    object, or gives a key another type than where it first appears, in any of the files; '' when none is found
    (or not jsonl)."""
    if builder != "json":
        return ""
    keys: dict = {}  # each key's type where it first appears (one schema over every file, as datasets reads them)
    for path in files:
        with _open_bytes(path) as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    return f"{path}:{number}: not UTF-8"
                except ValueError as e:
                    return f"{path}:{number}: not JSON ({e})"
                if not isinstance(record, dict):
                    return f"{path}:{number}: not a JSON object"
                for k, v in record.items():
                    if v is None:
                        continue
                    kind = "number" if type(v) in (int, float) else type(v).__name__  # an int column takes floats
                    first_kind, first_path, first_line = keys.setdefault(k, (kind, path, number))
                    if kind != first_kind:
                        at = f"line {first_line}" if first_path == path else f"{first_path}:{first_line}"
                        return f"{path}:{number}: {k!r} is a {kind}, on {at} a {first_kind}"
    return ""
