"""Issue 23: the wrong model as the converted copy. A Gemma directory checked against a Llama
GGUF said "20 difference(s)" on one line and "2 checkpoint finding(s)" on another, and nothing said
that the copy was another model."""

import pytest

pytest.importorskip("gguf")
from click.testing import CliRunner

from parity_cli import api
from parity_cli.cli import cli
from parity_cli.sources.synthetic import hf_to_gguf


def test_another_model_as_the_copy_is_said_first_and_counts_agree(ckpt, tmp_path):
    import re

    gemma = ckpt("gemma3_text", layers=2, hidden=64, heads=4, eps=1e-6)
    llama = hf_to_gguf(ckpt("llama", layers=3, hidden=96, heads=3, eps=1e-5), tmp_path / "smol.gguf")
    r = CliRunner().invoke(cli, ["check", str(gemma), "--candidate-checkpoint", str(llama)], env={"COLUMNS": "400"},
                           prog_name="parity")
    lines = r.output.splitlines()
    assert lines[0].startswith("FAIL: the candidate checkpoint") and "is a different model: family llama, 3 blocks" \
        in lines[0] and "the reference: family gemma, 2 blocks" in lines[0], lines[0]
    verdict = int(re.search(r"(\d+) checkpoint finding\(s\)", lines[0]).group(1))
    copy_line = next(line for line in lines if line.startswith("candidate checkpoint "))
    assert int(re.search(r"(\d+) difference\(s\)", copy_line).group(1)) == verdict
    report = api.check(str(gemma), candidate_checkpoint=str(llama))
    # 13 gemma norms: 8 the copy lacks, 5 whose shape (96) differs, each also with eps 1e-5 against 1e-6;
    # 2 norms only in the copy (its third block); and the model finding itself
    assert verdict == 8 + 5 * 2 + 2 + 1
    assert report.findings[0]["code"] == "checkpoint_model_mismatch"
    assert not any(l.error for l in report.layers)  # a layer of another shape is not run to fail


def test_the_same_model_is_no_model_finding(ckpt, tmp_path):
    hf = ckpt("llama", layers=2, eps=1e-6, dtype="float32")
    report = api.check(str(hf), candidate_checkpoint=str(hf_to_gguf(hf, tmp_path / "ok.gguf", drop=(
        "model.layers.1.input_layernorm",))))
    assert [f["code"] for f in report.findings] == []  # a dropped norm is that layer's finding, not another model
