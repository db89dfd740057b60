"""Every causal LM architecture of the installed transformers is computed exactly or refused by longstride's attention
(benchmarks/model_matrix.py, tiny random models against their own eager attention on one device): none is accepted
and wrong. Run on whatever transformers CI installs, so a new release's models are checked when it lands."""
from __future__ import annotations

import json


def test_no_causal_lm_of_transformers_is_accepted_and_computed_wrong(tmp_path, capsys):
    from benchmarks import model_matrix

    out = tmp_path / "matrix.json"
    model_matrix.main(["--out", str(out)])
    models = json.loads(out.read_text())["models"]
    bad = {t: e for t, e in models.items() if e["status"] in ("WRONG", "error")}
    assert not bad, json.dumps(bad, indent=1)[:4000]
    exact = [t for t, e in models.items() if e["status"] == "exact"]
    assert len(exact) >= 50 and {"llama", "mistral", "gemma2", "qwen3"} <= set(exact), sorted(exact)
    assert models["bloom"]["status"] == "refused"  # attention in its own code: named, never computed
    if "dory" in models:  # its head's learned logit_scale, which the chunked loss would leave untrained
        assert models["dory"]["status"] == "refused" and "logit_scale" in models["dory"]["detail"]
