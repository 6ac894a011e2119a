"""A verdict covers exactly what it compared (issue 35): a norm of the checkpoint that no layer
checks is counted on the verdict line, listed in checkpoint.unchecked with why, written to JUnit
as a skipped case and to Markdown, and `--fail-on unchecked` fails on it. DistilBERT saved from its
masked-LM class, as the published checkpoints are: its head's `vocab_layer_norm` is checked (the
family is derived again from the class config.json names), and a norm-like tensor an adapter added,
which nothing builds, is the one not checked."""

import json
import xml.etree.ElementTree as ET

import pytest
from conftest import run_parity

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def distilbert_mlm(tmp_path_factory):
    """(path, the model's LayerNorm names): DistilBertForMaskedLM as it saves itself, plus an
    adapter's LayerNorm stored beside it (adapter.LayerNorm.weight/bias) that no class builds."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=128, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                              max_position_embeddings=64)
    model = DistilBertForMaskedLM(config)
    path = tmp_path_factory.mktemp("distilbert") / "mlm"
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors.update({"adapter.LayerNorm.weight": torch.ones(32), "adapter.LayerNorm.bias": torch.zeros(32)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    norms = [n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    return path, norms


def test_the_masked_lm_head_s_norm_is_checked_from_the_class_the_config_names(distilbert_mlm, tmp_path):
    path, norms = distilbert_mlm
    out = tmp_path / "r.json"
    r = run_parity("check", path, "--candidate", "transformers", "--json", out)
    data = json.loads(out.read_text())
    checked = {layer["name"] for layer in data["layers"]}
    assert "vocab_layer_norm" in norms and set(norms) <= checked, sorted(set(norms) - checked)
    assert data["checkpoint"]["family_source"].startswith("derived at run time: DistilBertForMaskedLM (the class "
                                                          "config.json names)"), data["checkpoint"]["family_source"]
    assert r.returncode == 0, r.stdout


def test_a_norm_no_layer_checks_is_said_and_gates_on_request(distilbert_mlm, tmp_path):
    path, norms = distilbert_mlm
    out = {k: tmp_path / f"r.{k}" for k in ("json", "xml", "md")}
    r = run_parity("check", path, "--json", out["json"], "--junit", out["xml"], "--markdown", out["md"])
    assert r.returncode == 0, r.stderr
    data = json.loads(out["json"].read_text())
    total = len(norms) + 1
    assert data["summary"]["layers"] == len(norms) and data["summary"]["unchecked"] == 1
    (missed,) = data["checkpoint"]["unchecked"]
    assert missed["name"] == "adapter.LayerNorm" and "matches no pattern" in missed["why"]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: ") and f"1 of {total} norms not checked (adapter.LayerNorm: " in last, last
    suite = ET.parse(out["xml"]).getroot().find("testsuite")
    assert suite.get("tests") == str(total) and suite.get("skipped") == "1" and suite.get("failures") == "0"
    skipped = [c for c in suite.findall("testcase") if c.find("skipped") is not None]
    assert [c.get("name") for c in skipped] == ["adapter.LayerNorm"]
    assert f"not checked: 1 of {total} norms" in out["md"].read_text()
    r = run_parity("check", path, "--fail-on", "unchecked", "-q")
    assert r.returncode == 1 and r.stdout.startswith("FAIL: --fail-on unchecked"), r.stdout


def test_layer_norms_saved_as_gamma_and_beta_are_checked(tmp_path):
    """transformers 5 saves ESM's encoder LayerNorms as `.gamma`/`.beta` (4 of its 6 norms): the family
    derived at run time reads the names the file holds, so all 6 are checked, each with its own beta as
    bias, and an eps fault shows on every one (they were 'not checked', and the check passed on 2)."""
    import torch
    from safetensors import safe_open
    from transformers import EsmConfig, EsmForMaskedLM

    from parity_cli import api

    torch.manual_seed(0)
    config = EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, pad_token_id=1, mask_token_id=32, max_position_embeddings=64)
    model = EsmForMaskedLM(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(torch.rand(32) + 0.5)
                module.bias.copy_(torch.rand(32) - 0.5)
    path = tmp_path / "esm"
    model.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        stored = {k: fh.get_tensor(k) for k in fh.keys()}
    assert sum(k.endswith(".gamma") for k in stored) == 4  # what the file holds
    report = api.check(path, candidate="transformers", dtype="float32", isolation="none")
    assert report.passed and len(report.layers) == 6 and report.header["checkpoint"]["unchecked"] == []
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load

    ckpt, family, eps = load(path)
    for layer in discover_layers(ckpt, family, eps).layers:
        bias = stored.get(f"{layer.name}.beta", stored.get(f"{layer.name}.bias"))
        assert layer.bias is not None and torch.equal(layer.bias, bias), layer.name
    faulty = api.check(path, dtype="float32", isolation="none", candidate_eps=1e-5)
    assert not faulty.passed and all(layer.status == "fail" for layer in faulty.layers)


def test_the_unchecked_count_counts_modules_not_patterns(tmp_path):
    """Issue 47: hrm_text's weightless RMSNorms (no size of their own) cannot be checked; two of its
    [[unsupported]] entries are patterns standing for a norm a layer. The verdict line counts the
    modules the model itself builds (its named_modules, read by write_tiny_checkpoint), not the entries."""
    from parity_cli import api
    from parity_cli.model.derive import write_tiny_checkpoint

    truth = write_tiny_checkpoint("hrm_text", tmp_path / "hrm")
    built = {n["module"] for n in truth["norms"]}
    data = api.check(tmp_path / "hrm", strata=["normal"]).to_dict()
    checked = {layer["name"] for layer in data["layers"]}
    unchecked = {entry["name"] for entry in data["checkpoint"]["unchecked"]}
    assert checked | unchecked == built and not checked & unchecked, (built - checked - unchecked, unchecked - built)
    r = run_parity("check", tmp_path / "hrm", "--strata", "normal", "-q")
    assert r.returncode == 0
    assert f"; {len(built) - len(checked)} of {len(built)} norms not checked (" in r.stdout, r.stdout
