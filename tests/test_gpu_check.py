"""The GPU check's script on CPU (--smoke: tiny shapes and lengths), so that the one command a GPU run
depends on does not rot between GPU sessions: every part it can run here writes its JSON with real rows."""
from __future__ import annotations

import json

import torch

from benchmarks import gpu_check


def test_gpu_check_refuses_to_run_without_cuda_unless_smoke(capsys):
    if torch.cuda.is_available():
        return
    assert gpu_check.main(["--only", "attention"]) == 2
    assert "needs one" in capsys.readouterr().out


def test_gpu_check_smoke_writes_every_part(tmp_path):
    assert gpu_check.main(["--smoke", "--only", "throughput,attention,ruler", "--out", str(tmp_path),
                           "--checkpoint", str(tmp_path / "absent")]) == 0
    tp = json.loads((tmp_path / "throughput.json").read_text())
    assert tp["machine"]["torch"] == torch.__version__ and tp["kernel"]
    assert {r["system"] for r in tp["rows"]} >= {"longstride", "hf_sdpa_packed", "hf_sdpa_causal"}
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in tp["rows"])
    att = json.loads((tmp_path / "doc_attention.json").read_text())
    assert all(r["masked_ms"] > 0 and 0 < r["ideal_ratio"] <= 1 for r in att["rows"])
    ruler = json.loads((tmp_path / "ruler.json").read_text())
    assert ruler["rows"] == [] and "no checkpoint" in ruler["skipped"]
