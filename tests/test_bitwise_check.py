"""tests/bitwise.py's comparison (the refactor check, run by hand on two trees): a layout whose runs failed or
recorded nothing on both sides is FAILED, never "identical"."""
from __future__ import annotations

import json

from tests.bitwise import compare


def _sides(tmp_path, before: dict, after: dict):
    for name, summary in (("before", before), ("after", after)):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    return tmp_path / "before", tmp_path / "after"


def test_a_failed_or_empty_layout_is_never_identical(tmp_path, capsys):
    ran = {"s1/metrics.jsonl": [{"step": 1, "loss": 2.5}], "s1/final/weights": "ab12"}
    assert compare(*_sides(tmp_path / "same", {"ring": ran}, {"ring": dict(ran)}))
    assert "ring                   identical" in capsys.readouterr().out
    for broken in ({"exit": 1}, {}, {"s1/metrics.jsonl": []}):
        case = tmp_path / str(len(list(tmp_path.iterdir())))
        assert not compare(*_sides(case, {"ring": broken}, {"ring": broken}))
        assert "ring                   FAILED: no complete record on both sides" in capsys.readouterr().out
    assert not compare(*_sides(tmp_path / "changed", {"ring": ran}, {"ring": {**ran, "s1/final/weights": "cd34"}}))
    assert "DIFFERENT: s1/final/weights" in capsys.readouterr().out
