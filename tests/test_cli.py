"""The command line itself: bad input exits with a message naming the field, before any work."""
from __future__ import annotations

from tests.conftest import run_cli


def test_cli_bad_input_is_a_message_not_a_traceback(tmp_path):
    r = run_cli(["recipe=tiny", f"paths.output_root={tmp_path}", "recipe.stages.s2_2k.rope_theta=-1"])
    assert r.returncode == 2
    assert "recipe.stages.s2_2k.rope_theta=-1.0 must be positive" in r.stderr
    assert "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir()), "nothing is written before validation passes"
