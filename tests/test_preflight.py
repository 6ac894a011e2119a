"""Issue 15: bad input is refused before torch is imported, in one line naming what is wrong;
a missing optional package is bad input, not a failed layer."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from conftest import ROOT, plugin, run_parity

from parity_cli import preflight
from parity_cli.backends import implementations as impls
from parity_cli.errors import InputError
from parity_cli.model.load import open_checkpoint


def refused(*args, **kwargs) -> str:
    with pytest.raises(InputError) as info:
        preflight.check_inputs(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def hide(monkeypatch, *names):
    """importlib.util.find_spec as on a machine without these packages."""
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        return None if name in names else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture
def good(ckpt):
    return ckpt("llama", layers=1)


def test_a_good_check_passes(good):
    # weak-ok: a validator's whole contract on good input is to refuse nothing; its refusals are asserted below
    preflight.check_inputs(good, candidate=plugin("rms_norm"), reference="hf", dtype="bf16",
                           reference_dtype="torch.float32", device="cuda:1", reference_device="cpu",
                           family="llama", strata="zero, tiny")
    preflight.inspect_inputs(good)


# --- checkpoints ----------------------------------------------------------------------------------

def test_missing_checkpoint(tmp_path):
    missing = tmp_path / "no-model"
    assert refused(missing) == f"{missing}: no such file or directory"


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert refused(tmp_path) == f"{tmp_path}: no config.json in the checkpoint directory"


def test_missing_candidate_checkpoint(good, tmp_path):
    missing = tmp_path / "model.gguf"
    assert refused(good, candidate_checkpoint=missing) == f"{missing}: no such file or directory"


def _layouts(root: Path, good: Path) -> dict:
    """Bad checkpoints of every kind open_checkpoint tells apart."""
    out = {}
    out["empty dir"] = root / "empty"
    out["empty dir"].mkdir()
    out["config only"] = root / "config-only"
    out["config only"].mkdir()
    (out["config only"] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out["pickle weights"] = root / "pickled"
    out["pickle weights"].mkdir()
    (out["pickle weights"] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out["pickle weights"] / "pytorch_model.bin").write_bytes(b"\x80\x04")
    out["pickle file"] = root / "model.pt"
    out["pickle file"].write_bytes(b"\x80\x04")
    out["text file"] = root / "notes.txt"
    out["text file"].write_text("hello")
    out["config is a dir"] = root / "config-dir"
    (out["config is a dir"] / "config.json").mkdir(parents=True)
    out["config not JSON"] = root / "bad-config"
    out["config not JSON"].mkdir()
    (out["config not JSON"] / "config.json").write_text("{")
    out["truncated header"] = root / "truncated"
    out["truncated header"].mkdir()
    (out["truncated header"] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out["truncated header"] / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:20])
    return out


def test_every_bad_layout_is_refused_as_open_checkpoint_refuses_it(tmp_path, good):
    layouts = _layouts(tmp_path, good)
    for kind, path in layouts.items():
        with pytest.raises(InputError) as later:
            open_checkpoint(path)
        assert refused(path) == str(later.value), kind
        assert str(path) in str(later.value), kind
    # the words themselves, for the kinds a user meets most
    assert "no config.json" in refused(layouts["empty dir"])
    assert "no model.safetensors" in refused(layouts["config only"])
    assert "pickle" in refused(layouts["pickle weights"]) and "pickle" in refused(layouts["pickle file"])
    assert "not a checkpoint" in refused(layouts["text file"])


def test_a_type_no_family_claims_without_transformers_is_refused_before_torch(tmp_path, ckpt, monkeypatch):
    """Without transformers no family can be derived: said before torch, with both ways out."""
    path = ckpt("llama", layers=1, config_extra={"model_type": "not_a_model"})
    hide(monkeypatch, "transformers")
    message = refused(path)
    assert message.startswith(f"{path / 'config.json'}: model_type 'not_a_model' has no family file")
    assert "pip install transformers" in message and "--family" in message and "llama" in message
    preflight.check_inputs(path, family="llama")  # --family is the way out the message names


def test_a_type_transformers_does_not_know_is_one_line_naming_the_way_out(ckpt):
    """With transformers the type can only be looked up after torch loads (transformers imports
    it): the load refuses it, in one line naming --family and the families to force."""
    from parity_cli import api

    path = ckpt("llama", layers=1, config_extra={"model_type": "not_a_model"})
    pytest.importorskip("transformers")
    preflight.check_inputs(path)  # findable: whether transformers knows the type is the load's to say
    with pytest.raises(InputError) as info:
        api.load(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path / 'config.json'}: model_type 'not_a_model' is not known to transformers")
    assert "--family" in message and "llama" in message.split("known:")[1]


def test_gguf_without_the_gguf_package(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(20))
    preflight.check_inputs(path)  # recognised; its metadata is read later, by gguf
    hide(monkeypatch, "gguf")
    message = refused(path)
    assert message.startswith(f"{path}: reading GGUF needs the gguf package: pip install gguf")
    assert "'.[gguf]'" in message


# --- options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8", "float8_e4m3fn", "int8", "", "torch."])
def test_bad_dtype(good, name):
    assert refused(good, dtype=name).startswith(f"--dtype: unknown dtype '{name}'")
    assert refused(good, reference_dtype=name).startswith(f"--reference-dtype: unknown dtype '{name}'")


@pytest.mark.parametrize("name", ["float32", "BF16", "half", "double", "torch.float16", "Torch.BFloat16"])
def test_dtype_aliases_pass(good, name):
    from parity_cli.options import dtype_name

    preflight.check_inputs(good, dtype=name, reference_dtype=name)  # refuses nothing, and reads the alias as:
    assert dtype_name(name) == {"float32": "float32", "BF16": "bfloat16", "half": "float16", "double": "float64",
                                "torch.float16": "float16", "Torch.BFloat16": "bfloat16"}[name]


BAD_DEVICES = ["gpu", "cuda:", "cuda:-1", "cuda:01", "cuda:x", " cpu", "cuda:0 ", "CUDA", "cuda:٣", "mps", "cpu,cuda"]
GOOD_DEVICES = ["cpu", "cuda", "cuda:0", "cuda:12", "cpu:0"]


@pytest.mark.parametrize("device", BAD_DEVICES)
def test_bad_device_syntax(good, device):
    assert refused(good, device=device) == f"--device: '{device}' is not a device (cpu, cuda, cuda:N)"
    assert refused(good, reference_device=device).startswith(f"--reference-device: '{device}'")


def test_device_syntax_agrees_with_torch():
    """Nothing torch (and api.check_device) would take is refused; nothing passes that torch refuses
    or that is not a CPU or CUDA device."""
    import torch

    for device in GOOD_DEVICES:
        assert torch.device(device).type in ("cpu", "cuda")
        preflight.device_input(device)
    for device in BAD_DEVICES:
        try:
            kind = torch.device(device).type
        except (RuntimeError, ValueError):
            kind = None
        assert kind not in ("cpu", "cuda"), device


def test_unknown_family(good):
    message = refused(good, family="lama")
    assert message.startswith("unknown family 'lama' (neither a family nor a model_type one claims); did you mean "
                              "'llama'")  # the closest names first, then every family
    assert "llama" in message.split("known families:")[1].split(", ")


@pytest.mark.parametrize("strata", ["zero,bogus", ["zero", "bogus"]])
def test_unknown_stratum(good, strata):
    assert refused(good, strata=strata).startswith("--strata: unknown stratum 'bogus'; known: zero,")


def test_baseline_and_report(tmp_path, good):
    missing = tmp_path / "old.json"
    assert refused(good, baseline=missing) == f"{missing}: cannot read the baseline: No such file or directory"
    assert refused(good, baseline=tmp_path).startswith(f"{tmp_path}: the baseline is not a regular file")
    with pytest.raises(InputError, match="the report is not a regular file"):
        preflight.report_input(tmp_path)
    missing.write_text("{}")
    preflight.report_input(missing)  # a regular file: what it holds is load_report's to judge


# --- implementations --------------------------------------------------------------------------------

def test_missing_plugin_file(good, tmp_path):
    spec = f"{tmp_path / 'kernels.py'}:FusedRMSNorm"
    assert refused(good, candidate=spec) == f"implementation '{spec}': no such file {tmp_path / 'kernels.py'}"
    assert "no such file" in refused(good, reference=f"{tmp_path}:f")  # a directory is no file


def test_unknown_candidate_name(good):
    message = refused(good, candidate="flash")
    assert message.startswith("unknown implementation 'flash'; known: oracle, torch, hf, transformers")
    with pytest.raises(InputError) as later:
        impls.resolve("flash")
    assert message == str(later.value)


def test_missing_module(good):
    spec = "no_such_module_for_preflight.kernels:rms"
    assert refused(good, candidate=spec).endswith("No module named 'no_such_module_for_preflight'")
    with pytest.raises(InputError) as later:
        impls.resolve(spec)
    assert refused(good, reference=spec) == str(later.value)


def test_module_in_the_working_directory_is_found(good, tmp_path, monkeypatch):
    # `parity` (a console script) has no '' on sys.path; _load_attr adds the working directory
    (tmp_path / "my_preflight_kernels.py").write_text("def rms(x, w, eps):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    preflight.check_inputs(good, candidate="my_preflight_kernels:rms")


def test_missing_transformers_names_the_option_and_the_install(good, monkeypatch):
    hide(monkeypatch, "transformers")
    for option in ("candidate", "reference"):
        message = refused(good, **{option: "transformers"})
        assert message.startswith(f"--{option} transformers needs the transformers package: pip install transformers")
    # the extra named is the one pyproject.toml declares, and it installs transformers
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "'.[transformers]'" in message
    assert any(req.startswith("transformers") for req in extras["transformers"])


def test_missing_transformers_is_input_error_at_resolve(good, monkeypatch):
    """A library caller gets the same refusal once, before any layer, not an error per layer."""
    from parity_cli import api

    hide(monkeypatch, "transformers")
    for call in (lambda: impls.resolve("transformers"), lambda: impls.precheck("transformers")):
        with pytest.raises(InputError, match="needs the transformers package: pip install transformers"):
            call()
    with pytest.raises(InputError, match="'transformers' needs the transformers package"):
        api.check(good, candidate="transformers", isolation="none")
    with pytest.raises(InputError, match="'transformers' needs the transformers package"):
        api.check(good, reference="transformers")
    monkeypatch.undo()
    assert impls.resolve("transformers").name == "transformers"


def test_plugin_whose_import_fails_is_one_line_exit_2(good, tmp_path):
    """Only running a plugin shows its imports fail: preflight lets it through, the load says it."""
    kernels = tmp_path / "kernels.py"
    kernels.write_text("import no_such_package_for_preflight\n\ndef rms(x, w, eps):\n    return x\n")
    preflight.check_inputs(good, candidate=f"{kernels}:rms")
    with pytest.raises(InputError, match="No module named 'no_such_package_for_preflight'"):
        impls.resolve(f"{kernels}:rms")
    r = run_parity("check", good, "--candidate", f"{kernels}:rms", "-q")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "No module named 'no_such_package_for_preflight'" in r.stderr


# --- torch stays out ----------------------------------------------------------------------------------

BLOCKED = textwrap.dedent("""
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("torch", "numpy"):
                raise ImportError(f"preflight imported {name}")
            return None

    sys.meta_path.insert(0, Block())
    from parity_cli import preflight
    from parity_cli.errors import InputError

    good, plugin, missing = sys.argv[1:]
    preflight.check_inputs(good, candidate=plugin, reference="transformers", candidate_checkpoint=good,
                           dtype="bf16", device="cuda:0", family="llama", strata="zero,tiny")
    preflight.inspect_inputs(good)
    try:
        preflight.check_inputs(missing)
    except InputError as exc:
        print(exc)
    print(sorted(m for m in ("torch", "numpy", "safetensors", "transformers") if m in sys.modules))
""")


def test_preflight_never_imports_torch(good, tmp_path):
    missing = tmp_path / "typo"
    r = subprocess.run([sys.executable, "-c", BLOCKED, str(good), plugin("rms_norm"), str(missing)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{missing}: no such file or directory", "[]"]


def test_numpy_is_a_dependency_and_torch_imports_without_warning():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("numpy>=") for d in deps)
    r = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "NumPy" not in r.stderr, r.stderr
