"""Issue 23: the wrong model as the converted copy. A Gemma directory checked against a Llama
GGUF said "20 difference(s)" on one line and "2 checkpoint finding(s)" on another, and nothing said
that the copy was another model."""

import pytest

pytest.importorskip("gguf")

from conftest import run_parity

from parity_cli import api
from parity_cli.errors import InputError
from parity_cli.sources.synthetic import hf_to_gguf


def test_another_model_as_the_copy_is_bad_input_in_one_line(ckpt, tmp_path):
    """A copy of another model (issue 35: a Gemma directory against the SmolLM2 GGUF printed 7 empty heat-grid
    rows and exited 1) is exit 2 with the one line that says so, and nothing written."""
    gemma = ckpt("gemma3_text", layers=2, hidden=64, heads=4, eps=1e-6)
    llama = hf_to_gguf(ckpt("llama", layers=3, hidden=96, heads=3, eps=1e-5), tmp_path / "smol.gguf")
    out = tmp_path / "r.json"
    r = run_parity("check", gemma, "--candidate-checkpoint", llama, "--json", out)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and not out.exists(), r.stderr
    assert lines[0].startswith("parity: error: the candidate checkpoint") and "is a different model: family llama, " \
        "3 blocks" in lines[0] and "the reference: family gemma, 2 blocks" in lines[0], lines[0]
    with pytest.raises(InputError, match="is a different model"):
        api.check(str(gemma), candidate_checkpoint=str(llama))


def test_the_same_model_is_no_model_finding(ckpt, tmp_path):
    hf = ckpt("llama", layers=2, eps=1e-6, dtype="float32")
    report = api.check(str(hf), candidate_checkpoint=str(hf_to_gguf(hf, tmp_path / "ok.gguf", drop=(
        "model.layers.1.input_layernorm",))))
    assert [f["code"] for f in report.findings] == []  # a dropped norm is that layer's finding, not another model
