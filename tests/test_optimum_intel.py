"""Issue 51, optimum-intel: the OpenVINO IR `OVModelForCausalLM.from_pretrained(path, export=True)`
writes (optimum-intel 2.2.0 on transformers 5.5.4, OpenVINO 2026.4.1), checked against the checkpoint
it was exported from, as a copy and inside OpenVINO on tokens.

optimum-intel cannot be installed beside the transformers the suite runs with (it needs < 5.6), so
its exports of a tiny Llama and a tiny Qwen3 are files here, written by the real exporter in a venv
of its own (tools/optimum_intel_fixture.py says how). Its IR is stateful: the KV cache is the model's
state, fed a `beam_idx` input."""

import shutil
import struct
from importlib.util import find_spec
from pathlib import Path

import pytest
from conftest import SLOW, all_pass, check_with_report, finding_codes, run_parity

pytestmark = pytest.mark.skipif(find_spec("openvino") is None, reason="needs OpenVINO: pip install openvino")

DATA = Path(__file__).resolve().parent / "data" / "optimum-intel"
EXPORTER = "optimum-intel 2.2.0 (transformers 5.5.4, OpenVINO 2026.4.1)"


# the Llama's copy in the default run; the rest (an OpenVINO compile each) in --tier slow (issue 49)
@pytest.mark.parametrize("model_type, eps, layers", [("llama", 1e-5, 5), pytest.param("qwen3", 1e-6, 9, marks=SLOW)])
def test_optimum_intels_ir_passes_as_a_copy_with_its_exporter_named(tmp_path, model_type, eps, layers):
    """Every norm (Qwen3's q_norm and k_norm too) paired by name with the checkpoint's, with the eps
    it was trained with as float32 stores it; the exporter named from the IR's own rt_info."""
    r, data = check_with_report(tmp_path, DATA / model_type / "hf", "--candidate-checkpoint",
                                DATA / model_type / "ov" / "openvino_model.xml")
    assert r.returncode == 0 and all_pass(data) and len(data["layers"]) == layers, r.stdout[-2000:] + r.stderr
    described = data["candidate"]["checkpoint"]
    assert described["format"] == "openvino" and described["exporter"] == EXPORTER
    assert described["eps"]["value"] == pytest.approx(eps, rel=1e-7)
    assert not any(layer["warnings"] for layer in data["layers"])  # paired by name, not by value


def _capture(xml, tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("1 5 9 13 17 21 2 7\n")
    cap = tmp_path / "cap.safetensors"
    # f32: the verdict of the kernels at full precision on any CPU (a CPU with AMX defaults to bf16)
    r = run_parity("capture", xml, "--runtime", "openvino", "--precision", "f32", "--tokens", tokens, "-o", cap)
    assert r.returncode == 0, r.stderr
    return cap


@SLOW
@pytest.mark.parametrize("model_type, layers", [("llama", 5), ("qwen3", 9)])
def test_optimum_intels_stateful_ir_passes_inside_openvino_on_tokens(tmp_path, model_type, layers):
    cap = _capture(DATA / model_type / "ov" / "openvino_model.xml", tmp_path)
    r, data = check_with_report(tmp_path, DATA / model_type / "hf", "--runtime-capture", cap)
    assert r.returncode == 0 and all_pass(data) and len(data["layers"]) == layers, r.stdout[-2000:] + r.stderr


@SLOW
def test_an_eps_planted_in_optimum_intels_ir_is_named_as_a_copy_and_inside_openvino(tmp_path):
    """The Llama's five norms share one float32 1e-5 constant in the .bin; written as 1e-6 (an exporter
    that hard-codes llama.cpp's old default), every layer fails with eps_mismatch both ways."""
    ov = tmp_path / "ov"
    shutil.copytree(DATA / "llama" / "ov", ov)
    weights = bytearray((ov / "openvino_model.bin").read_bytes())
    old = struct.pack("<f", 1e-5)
    assert weights.count(old) == 1
    at = weights.index(old)
    weights[at:at + 4] = struct.pack("<f", 1e-6)
    (ov / "openvino_model.bin").write_bytes(bytes(weights))
    xml = ov / "openvino_model.xml"
    for args in (("--candidate-checkpoint", xml), ("--runtime-capture", _capture(xml, tmp_path))):
        r, report = check_with_report(tmp_path, DATA / "llama" / "hf", *args)
        assert r.returncode == 1, r.stderr
        assert len(report["layers"]) == 5 and all("eps_mismatch" in codes for codes in finding_codes(report)), args


@SLOW
def test_a_lying_exporter_name_in_the_rt_info_is_cut_and_printed_as_text(tmp_path):
    """rt_info is text from the file: an optimum_intel_version of 5,000 characters of terminal markup
    is cut to its first 40 and printed as written, never interpreted; the norms still pass."""
    ov = tmp_path / "ov"
    shutil.copytree(DATA / "llama" / "ov", ov)
    xml = ov / "openvino_model.xml"
    lie = "[bold red]FAKE[/bold red]" + "x" * 5000
    text = xml.read_text()
    assert text.count('<optimum_intel_version value="2.2.0" />') == 1
    xml.write_text(text.replace('<optimum_intel_version value="2.2.0" />', f'<optimum_intel_version value="{lie}" />'))
    r, data = check_with_report(tmp_path, DATA / "llama" / "hf", "--candidate-checkpoint", xml)
    assert r.returncode == 0 and all_pass(data), r.stderr
    assert data["candidate"]["checkpoint"]["exporter"] == \
        f"optimum-intel {lie[:40]} (transformers 5.5.4, OpenVINO 2026.4.1)"
    wide = run_parity("check", DATA / "llama" / "hf", "--candidate-checkpoint", xml, env={"COLUMNS": "1000"})
    assert f"optimum-intel {lie[:40]} (" in wide.stdout  # the header line, unelided
