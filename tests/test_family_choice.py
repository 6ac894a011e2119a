"""Issue 27 (part): `--family` takes a model type as well as a family's name (`--family bert` is
the layer_norm family, which lists bert among its model_types; a type no hand-written family
lists is its derived family, configs/families/derived/<type>.toml), and the report says which
family was chosen and how (checkpoint.family_from). An unknown name is one line naming the
families, exit 2, before torch is imported."""

import dataclasses
import json

import pytest
import tomllib
from conftest import ROOT, load_json, run_parity

from parity_cli import preflight
from parity_cli.errors import InputError
from parity_cli.model import families
from parity_cli.sources.synthetic import write_checkpoint

FAMILIES = ROOT / "configs" / "families"
FAST = ("--strata", "tiny,constant", "-q")


def _written_owner(model_type: str) -> str | None:
    """Which hand-written family file lists `model_type`, read from the TOML files themselves."""
    for path in sorted(FAMILIES.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        if model_type in data["model_types"]:
            return data["name"]
    return None


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A BERT checkpoint with its tensors at the top level (no `bert.` prefix), which the
    roberta family's patterns (roots "roberta." and "") also match."""
    return write_checkpoint(tmp_path_factory.mktemp("f") / "bert", "bert", layers=1, hidden=16, heads=2, eps=1e-12,
                            root="")


def test_bert_is_in_a_hand_written_family_file():
    # the premise of `--family bert`, from the file: layer_norm lists it, and no other written family does
    assert _written_owner("bert") == "layer_norm"
    assert not (FAMILIES / "derived" / "bert.toml").exists()
    assert (FAMILIES / "derived" / "roberta.toml").exists() and _written_owner("roberta") is None


@pytest.mark.parametrize("given,family,phrase", [
    ("bert", "layer_norm", "--family bert: a model type of layer_norm"),
    ("layer_norm", "layer_norm", "--family layer_norm"),
    ("roberta", "roberta", "--family roberta: a model type, its derived family"),
    (None, "layer_norm", "model_type 'bert' in config.json"),
])
def test_check_reports_the_family_and_how_it_was_chosen(bert, tmp_path, given, family, phrase):
    out = tmp_path / "r.json"
    r = run_parity("check", bert, *(["--family", given] if given else []), *FAST, "--json", out)
    assert r.returncode == 0, r.stderr
    ck = load_json(out)["checkpoint"]
    assert (ck["family"], ck["family_from"], ck["family_forced"]) == (family, phrase, given is not None)
    assert ck["model_type"] == "bert"  # the checkpoint's own type is kept beside the forced family


def test_the_report_with_family_from_is_schema_valid(bert, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from parity_cli.resources import schema_path

    out = tmp_path / "r.json"
    assert run_parity("check", bert, "--family", "bert", *FAST, "--json", out).returncode == 0
    jsonschema.validate(load_json(out), json.loads(schema_path().read_text()))


def test_a_model_type_forces_the_same_family_as_its_name(bert, tmp_path):
    """--family bert and --family layer_norm are the same check: the same layers and numbers."""
    reports = []
    for given in ("bert", "layer_norm"):
        out = tmp_path / f"{given}.json"
        assert run_parity("check", bert, "--family", given, *FAST, "--json", out).returncode == 0
        reports.append(load_json(out))
    assert [l["name"] for l in reports[0]["layers"]] == [l["name"] for l in reports[1]["layers"]]
    assert [l["strata"] for l in reports[0]["layers"]] == [l["strata"] for l in reports[1]["layers"]]


def test_inspect_takes_a_model_type_and_says_so(bert, tmp_path):
    out = tmp_path / "i.json"
    r = run_parity("inspect", bert, "--family", "bert", "--json", out)
    assert r.returncode == 0, r.stderr
    ck = load_json(out)["checkpoint"]
    assert (ck["family"], ck["family_from"]) == ("layer_norm", "--family bert: a model type of layer_norm")


def test_a_forced_model_type_on_another_layout(ckpt, tmp_path):
    """A LLaMA checkpoint forced to bert's family is read with layer_norm's semantics (its
    `model.norm` pattern), the config's own type recorded beside it; the contradiction (a LayerNorm
    where llama's are RMSNorms) needs --family-force (issue 47)."""
    out = tmp_path / "r.json"
    path = ckpt("llama", layers=1, hidden=16, heads=2)
    refused = run_parity("check", path, "--family", "bert", *FAST)
    assert refused.returncode == 2 and "layer_norm normalises as a layer_norm, llama as a rms_norm" in refused.stderr
    r = run_parity("check", path, "--family", "bert", "--family-force", *FAST, "--json", out)
    assert r.returncode == 0, r.stderr
    ck = load_json(out)["checkpoint"]
    assert (ck["family"], ck["model_type"], ck["family_from"]) == (
        "layer_norm", "llama", "--family bert: a model type of layer_norm")


@pytest.mark.parametrize("command", ["check", "inspect"])
def test_an_unknown_family_is_one_line_naming_the_families(bert, command):
    r = run_parity(command, bert, "--family", "berty")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    written = sorted(p.stem for p in FAMILIES.glob("*.toml"))
    derived = len(list((FAMILIES / "derived").glob("*.toml")))
    assert "'berty'" in lines[0] and ", ".join(written) in lines[0] and f"{derived} derived" in lines[0]


def test_the_preflight_takes_model_types_and_refuses_the_rest(bert):
    for given in ("bert", "gpt2", "layer_norm", "roberta", "albert"):
        preflight.check_inputs(bert, family=given)
        preflight.inspect_inputs(bert, family=given)
    with pytest.raises(InputError, match="unknown family 'berty'"):
        preflight.check_inputs(bert, family="berty")


def test_family_choice_phrases():
    layer_norm = families.family_by_name("layer_norm")
    assert families.family_choice(None, layer_norm, "gpt2", "gguf") == "model_type 'gpt2' in the GGUF metadata"
    assert families.family_choice(None, layer_norm, "gpt2", "gguf", "gpt2") == "model_type 'gpt2' in the GGUF metadata"
    assert families.family_choice(None, layer_norm, "granitemoehybrid", "gguf", "granitehybrid") == (
        "GGUF architecture 'granitehybrid', read as model_type 'granitemoehybrid'")
    assert families.family_choice("gpt2", layer_norm, "llama") == "--family gpt2: a model type of layer_norm"
    # `llama` is both a family and a type it lists: named as the family
    assert families.family_choice("llama", families.family_by_name("llama"), "qwen2") == "--family llama"
    # derived as the check ran (no file claims the type): the phrase says so
    live = dataclasses.replace(families.family_by_name("roberta"), source="m/config.json (transformers 5: X)")
    assert families.family_choice(None, live, "smollm9") == ("model_type 'smollm9' in config.json; no family "
                                                             "file claims it, derived from its transformers classes")


def test_help_says_family_takes_a_model_type():
    for command in ("check", "inspect"):
        r = run_parity(command, "--help")
        assert "model type" in " ".join(r.stdout.split()), r.stdout
