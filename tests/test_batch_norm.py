"""Issue 26, BatchNorm at inference, against real third-party code: torch.nn.BatchNorm1d/2d, the
BatchNorm2d modules inside transformers' ResNet, MobileNetV2 and EfficientNet (eps from the model
code, from config `layer_norm_eps`, from config `batch_norm_eps`), keras 3's BatchNormalization,
and torch's module left in training mode or loaded without its statistics.

Every expected number comes from the real module, the formula, or the checkpoint's tensors read
here with safetensors; none from the tool's own output. One tiny checkpoint per model, built once
for the module; the checks that run a candidate in the tool run it in this process (isolation
"none": process isolation is not what is tested here)."""

import copy
import fnmatch
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import NARROW_RESNET, SLOW, load_json, run_parity

from parity_cli import api
from parity_cli.backends.implementations import BUILTINS
from parity_cli.model.layers import NormLayer, discover_layers
from parity_cli.model.load import load
from parity_cli.sources.tensors import Eps

PLUGINS = Path(__file__).resolve().parent / "plugins"
KERAS = PLUGINS / "keras_batch_norm.py"
FAULTS = PLUGINS / "torch_batch_norm.py"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TORCH_EPS = torch.nn.BatchNorm2d(1).eps  # what ResNet's BatchNorm2d(C) gets from the model code: 1e-5
KERAS_DEFAULT_EPS = 1e-3  # keras.layers.BatchNormalization's documented default epsilon
ONE_PERCENT = 1 / (0.99 ** -2 - 1)  # q/eps under which eps attenuates by more than 1 % (49.2512562814)
# a bottleneck's three BatchNorms and its shortcut's (64 and 256 channels): a few layers for the runs
FEW = "encoder.stages.0.layers.0.*"


# --- helpers --------------------------------------------------------------------------------------


def _rows(t):
    """(N, C, *spatial) -> (N * positions, C): each position of a feature map is a probe row."""
    return t.movedim(1, -1).reshape(-1, t.shape[1])


def _feature_map(mean, var, eps, shape, seed=0):
    """x = running_mean + z * sqrt(running_var + eps), float64: every channel at its own scale, the
    first sample next to the running mean, the last 100 deviations out."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    z[0] *= 1e-3
    z[-1] *= 100
    view = (1, -1) + (1,) * (len(shape) - 2)
    return mean.double().view(view) + z * torch.sqrt(var.double() + eps).view(view)


def _assert_same_as_module(layer, module, x):
    """`hf` (and `torch`) bit for bit equal to the module cast to each dtype (its buffers cast with
    it); the float64 oracle within 1e-12 of the module in float64. x: a float64 feature map."""
    eps = layer.eps.value
    for dtype in DTYPES.values():
        m = copy.deepcopy(module).to(dtype).eval()
        xd = x.to(dtype)
        bias = None if layer.bias is None else layer.bias.to(dtype)
        with torch.no_grad():
            want = _rows(m(xd))
            for impl in ("hf", "torch"):
                got = BUILTINS[impl].prepare(layer, layer.weight.to(dtype), bias, eps)(_rows(xd))
                assert got.dtype == dtype and torch.equal(got, want), \
                    (layer.name, impl, dtype, float((got.double() - want.double()).abs().max()))
    m64 = copy.deepcopy(module).double().eval()
    with torch.no_grad():
        want = _rows(m64(x))
        got = BUILTINS["oracle"].prepare(layer, layer.weight, layer.bias, eps)(_rows(x))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=layer.name)


def _stored(path):
    """{BatchNorm name: {weight, bias, running_mean, running_var}} read straight from the file."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        for key in f.keys():
            name, _, leaf = key.rpartition(".")
            if leaf in ("weight", "bias", "running_mean", "running_var"):
                out.setdefault(name, {})[leaf] = f.get_tensor(key)
    return {name: t for name, t in out.items() if "running_var" in t}


def _codes(report):
    return [{d.code for d in layer.diagnoses} for layer in report.layers]


def _real_model(path):
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModel.from_pretrained(path).eval()


# --- checkpoints, one per module ------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """The derived tiny ResNet (running variances 1e-6..10: some channels well under eps = 1e-5)."""
    pytest.importorskip("transformers", reason="needs transformers")
    from parity_cli.model.derive import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("resnet")
    write_tiny_checkpoint("resnet", path, config=NARROW_RESNET)
    return path


@pytest.fixture(scope="module")
def mobilenet_v2(tmp_path_factory):
    """The derived tiny MobileNetV2, its config's layer_norm_eps (the BatchNorms' eps) set to 1e-4
    instead of the class default 1e-3: the eps must come from the config."""
    pytest.importorskip("transformers", reason="needs transformers")
    from parity_cli.model.derive import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("mobilenet_v2")
    write_tiny_checkpoint("mobilenet_v2", path)
    config = json.loads((path / "config.json").read_text())
    config["layer_norm_eps"] = 1e-4
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def efficientnet(tmp_path_factory):
    """A tiny EfficientNet built here (write_tiny_checkpoint refuses the class's defaults as too
    big), batch_norm_eps = 1e-3 in its config, running statistics as a trained model has them
    (some variances under eps)."""
    pytest.importorskip("transformers", reason="needs transformers")
    from transformers import EfficientNetConfig, EfficientNetModel

    path = tmp_path_factory.mktemp("efficientnet")
    config = EfficientNetConfig(image_size=32, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=64,
                                num_hidden_layers=4, batch_norm_eps=1e-3)
    torch.manual_seed(0)
    model = EfficientNetModel(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                c = module.num_features
                module.weight.copy_(torch.rand(c, generator=gen) * 0.5 + 0.1)
                module.bias.copy_(torch.rand(c, generator=gen) * 0.4 - 0.2)
                module.running_mean.copy_(torch.randn(c, generator=gen) * 0.5)
                module.running_var.copy_(torch.exp(torch.rand(c, generator=gen) * math.log(1e7)) * 1e-6)
    model.save_pretrained(path)
    return path


# --- 1. the oracle and `hf` against the real module classes -----------------------------------------


def test_oracle_is_the_formula_by_hand():
    """(x - mean) / sqrt(var + eps) * w + b, worked out by hand for three channels: a zero
    variance (eps alone under the root), a variance equal to eps, and a variance of 4."""
    eps = 1e-5
    f64 = {"dtype": torch.float64}
    layer = NormLayer(name="bn", kind="batch_norm", dim=3, order="native", gain_offset=0.0, eps=Eps(eps, "test"),
                      weight=torch.tensor([2.0, 0.5, 1.0], **f64), bias=torch.tensor([0.0, 1.0, -3.0], **f64),
                      running_mean=torch.tensor([1.0, 0.0, 2.0], **f64), running_var=torch.tensor([0.0, eps, 4.0], **f64))
    x = torch.tensor([[1.0 + 2 ** -10, 0.002, 8.0]], **f64)
    want = [2 ** -10 / math.sqrt(eps) * 2.0, 0.002 / math.sqrt(2 * eps) * 0.5 + 1.0, 6.0 / math.sqrt(4 + eps) - 3.0]
    got = BUILTINS["oracle"].prepare(layer, layer.weight, layer.bias, eps)(x)
    torch.testing.assert_close(got, torch.tensor([want], **f64), rtol=1e-14, atol=0)


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
@pytest.mark.parametrize("cls,shape", [(torch.nn.BatchNorm1d, (5, 48, 7)), (torch.nn.BatchNorm2d, (3, 48, 3, 4))])
def test_hf_and_oracle_match_torch_batch_norm_modules(cls, shape, eps):
    """torch.nn.BatchNorm1d/2d in eval mode with random running statistics, a few channels with
    running_var 0, eps / 100, eps and 2 eps, fed a real feature map (positions as rows for `hf`)."""
    c = shape[1]
    gen = torch.Generator().manual_seed(c)
    weight = torch.rand(c, generator=gen) * 0.5 + 0.1
    weight[5] = -weight[5]
    bias = torch.rand(c, generator=gen) * 0.4 - 0.2
    mean = torch.randn(c, generator=gen) * 2
    var = 10 ** (torch.rand(c, generator=gen) * 9 - 8)  # 1e-8 .. 10
    var[:4] = torch.tensor([0.0, eps / 100, eps, 2 * eps])
    module = cls(c, eps=eps).eval()
    module.load_state_dict({"weight": weight, "bias": bias, "running_mean": mean, "running_var": var,
                            "num_batches_tracked": torch.tensor(100)})
    layer = NormLayer(name="bn", kind="batch_norm", dim=c, order="native", gain_offset=0.0, eps=Eps(eps, "test"),
                      weight=weight, bias=bias, running_mean=mean, running_var=var,
                      hf_class=f"torch.nn.{cls.__name__}")
    x = _feature_map(mean, var, eps, shape)
    _assert_same_as_module(layer, module, x)
    # the comparison sees eps: the same module with another eps is not the same function here
    other = copy.deepcopy(module)
    other.eps = eps * 2
    with torch.no_grad():
        assert not torch.equal(other(x.float()), module(x.float()))


@pytest.mark.parametrize("model,eps_key", [("resnet", None), ("mobilenet_v2", "layer_norm_eps"),
                                           ("efficientnet", "batch_norm_eps")])
def test_hf_and_oracle_match_the_batch_norms_inside_transformers_models(request, model, eps_key):
    """Every BatchNorm module of the real transformers model, loaded from the checkpoint with
    from_pretrained: the tool finds each of them (and no other), with the module's eps (the model
    code's, or the config key's) and its stored tensors, and `hf` equals the module bit for bit at
    float32, bfloat16 and float16 on a real feature map; the oracle equals it in float64."""
    path = request.getfixturevalue(model)
    real = _real_model(path)
    modules = {n: m for n, m in real.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    ckpt, family, eps = load(path)
    layers = {layer.name: layer for layer in discover_layers(ckpt, family, eps).layers}
    assert modules and set(layers) == set(modules)
    if eps_key is not None:
        assert {m.eps for m in modules.values()} == {json.loads((path / "config.json").read_text())[eps_key]}
    for name, layer in layers.items():
        module = modules[name]
        assert layer.kind == "batch_norm" and layer.dim == module.num_features
        assert layer.eps.value == module.eps, name
        if eps_key is not None:
            assert layer.eps.source == f"config:{eps_key}", (name, layer.eps)
        for attr in ("weight", "bias", "running_mean", "running_var"):
            assert torch.equal(getattr(layer, attr), getattr(module, attr)), (name, attr)
        x = _feature_map(module.running_mean, module.running_var, module.eps, (2, module.num_features, 2, 3))
        _assert_same_as_module(layer, module, x)
    # the checkpoint has channels where eps matters (running_var / eps under 49.25)
    assert any(float(m.running_var.min()) < ONE_PERCENT * m.eps for m in modules.values())


# --- 2. parity check on the tiny ResNet with the built-ins ------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("candidate", ["torch", "hf", "transformers"])
def test_check_passes_with_the_builtins_and_reports_running_var_over_eps(resnet, tmp_path, candidate, dtype):
    """`parity check` passes; every layer is a batch_norm with eps 1e-5 whose statistics are the
    checkpoint's running_var read here: min / eps, its channel, the channels under 49.25 eps. At
    a half dtype a model holds its buffers at that dtype, so the variances are rounded to it first.
    The whole model once (torch, float32), a bottleneck for the rest."""
    whole = candidate == "torch" and dtype == "float32"
    out = tmp_path / "report.json"
    r = run_parity("check", resnet, "--candidate", candidate, "--dtype", dtype, "--isolation", "none",
                   "--json", out, *([] if whole else ["--layers", FEW]))
    assert r.returncode == 0, (r.stdout, r.stderr)
    report = load_json(out)
    stored = _stored(resnet)
    expected = sorted(n for n in stored if whole or fnmatch.fnmatchcase(n, FEW))
    assert len(expected) == (53 if whole else 4)  # the stem's, 16 bottlenecks' 3, 4 shortcuts'
    assert sorted(layer["name"] for layer in report["layers"]) == expected
    attenuated = 0
    for layer in report["layers"]:
        assert layer["kind"] == "batch_norm" and layer["status"] == "pass", layer["name"]
        assert layer["eps"]["value"] == TORCH_EPS
        var = stored[layer["name"]]["running_var"].to(DTYPES[dtype]).to(torch.float64)
        stats = layer["statistics"]
        assert stats["running_var_over_eps"]["min"] == pytest.approx(float(var.min()) / TORCH_EPS, rel=1e-12)
        assert stats["running_var_over_eps"]["running_var"] == pytest.approx(float(var.min()), rel=1e-12)
        assert float(var[stats["running_var_over_eps"]["channel"]]) == float(var.min())
        assert stats["channels"] == var.numel() == layer["dim"]
        assert stats["channels_attenuated_over_1pct"] == int((var < ONE_PERCENT * TORCH_EPS).sum())
        attenuated += stats["channels_attenuated_over_1pct"]
    assert attenuated > 0  # the probes met channels where eps matters


def test_layers_selects_what_is_checked_not_what_the_family_claims(resnet, tmp_path):
    """Without --layers nothing of the checkpoint is unmatched; with it, the other BatchNorms'
    running statistics still belong to the family (as their weights do) and must not be listed."""
    out = tmp_path / "report.json"
    r = run_parity("check", resnet, "--layers", "embedder.*", "--isolation", "none", "--json", out)
    assert r.returncode == 0, (r.stdout, r.stderr)
    report = load_json(out)
    assert report["checkpoint"]["unmatched"] == [], report["checkpoint"]["unmatched"][:3]
    assert not [w for w in report["warnings"] if "match no pattern" in w]


# --- 3. keras 3's BatchNormalization as the candidate ----------------------------------------------

# keras is imported by each worker that runs one (seconds): these run in `--tier slow`, and
# test_diagnosis_matrix's keras LayerNormalization in the default run (issue 49)
needs_keras = pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs keras")
# keras' torch backend converts through np.array(x) without numpy 2's copy keyword: its own noise
quiet_keras = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")


@SLOW
@needs_keras
@quiet_keras
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keras_default_epsilon_is_eps_mismatch(resnet, dtype):
    """keras' BatchNormalization with its default epsilon on the torch-trained ResNet (eps 1e-5):
    parity fails every layer and names eps_mismatch at keras' epsilon, within 3 %."""
    report = api.check(resnet, candidate=f"{KERAS}:batch_norm_default", dtype=dtype, isolation="none", layers=FEW)
    import keras  # imported by the plugin, on the torch backend

    assert keras.layers.BatchNormalization().epsilon == pytest.approx(KERAS_DEFAULT_EPS)
    assert not report.passed
    assert _codes(report) == [{"eps_mismatch"}] * 4, _codes(report)
    stored = _stored(resnet)
    for layer in report.layers:
        (diagnosis,) = layer.diagnoses
        ev = diagnosis.evidence
        assert ev["estimated_eps"] == pytest.approx(KERAS_DEFAULT_EPS, rel=0.03), ev
        assert ev["raw_estimate"] == pytest.approx(KERAS_DEFAULT_EPS, rel=0.03), ev
        assert ev["configured_eps"] == TORCH_EPS
        var = stored[layer.name]["running_var"].to(DTYPES[dtype]).double()
        assert ev["smallest_running_var_over_eps"] == pytest.approx(float(var.min()) / TORCH_EPS, rel=1e-12)


@SLOW
@needs_keras
@quiet_keras
def test_keras_with_the_checkpoint_eps_passes(resnet):
    report = api.check(resnet, candidate=f"{KERAS}:batch_norm", dtype="float32", isolation="none", layers=FEW)
    assert report.passed and len(report.layers) == 4
    assert _codes(report) == [set()] * 4


@SLOW
@needs_keras
@quiet_keras
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keras_called_with_training_true_is_batch_statistics(resnet, dtype):
    """Issue 35: keras' BatchNormalization called with training=True was batch_statistics on 2 of 6
    layers and unexplained on 4. keras 3 forms the batch variance as E[x^2] - E[x]^2 in float32
    (keras/src/backend/torch/nn.py moments), which cancels where a channel's mean is large against
    its spread; the hypothesis now includes that form, so every layer is named."""
    report = api.check(resnet, candidate=f"{KERAS}:batch_norm_training", dtype=dtype, isolation="none", layers=FEW)
    assert not report.passed
    assert _codes(report) == [{"batch_statistics"}] * 4, _codes(report)


@pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax (and jax); not in the test lock")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flax_with_batch_statistics_is_batch_statistics(resnet, dtype):
    """Issue 35: flax's BatchNorm with use_running_average=False was unexplained. Its float32 fast
    variance, in XLA's summation order, is within the bound any float32 order keeps (run here with
    flax 0.12.8 and jax 0.10.2 from the package index)."""
    report = api.check(resnet, candidate=f"{PLUGINS / 'flax_batch_norm.py'}:batch_statistics", dtype=dtype,
                       isolation="none", layers=FEW)
    assert not report.passed
    assert _codes(report) == [{"batch_statistics"}] * 4, _codes(report)


# --- 4. planted faults with torch's own module --------------------------------------------------------


@pytest.mark.parametrize("fn,dtype,code", [
    ("left_in_training_mode", "float32", "batch_statistics"),
    ("left_in_training_mode", "bfloat16", "batch_statistics"),
    ("statistics_not_loaded", "float32", "running_statistics_missing"),
    ("statistics_not_loaded", "float16", "running_statistics_missing"),
])
def test_torch_module_faults_are_named(resnet, fn, dtype, code):
    report = api.check(resnet, candidate=f"{FAULTS}:{fn}", dtype=dtype, isolation="none", layers=FEW)
    assert not report.passed
    assert _codes(report) == [{code}] * 4, _codes(report)


@pytest.mark.parametrize("candidate,dtype", [
    (f"{FAULTS}:eval_mode", "float32"),
    (f"{FAULTS}:eval_mode", "bfloat16"),
    ("torch.nn:BatchNorm2d", "float16"),  # the module class, filled and put in eval mode by the tool
    ("torch.nn:BatchNorm1d", "float32"),
])
def test_a_correct_torch_module_passes_without_a_diagnosis(resnet, candidate, dtype):
    report = api.check(resnet, candidate=candidate, dtype=dtype, isolation="none", layers=FEW)
    assert report.passed and len(report.layers) == 4
    assert _codes(report) == [set()] * 4


# --- 5. bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["missing", "negative"])
def test_bad_running_var_is_one_line_exit_2_and_no_report(resnet, tmp_path, fault):
    """A copy of two of the ResNet's BatchNorms whose second has no running_var (or one negative
    variance): one line naming the checkpoint and the tensor, exit 2, no report written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((resnet / "config.json").read_text())
    target = "encoder.stages.0.layers.0.layer.0.normalization"
    tensors = {}
    with safe_open(str(resnet / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith(("embedder.embedder.normalization.", target + ".")):
                tensors[key] = f.get_tensor(key)
    if fault == "missing":
        del tensors[f"{target}.running_var"]
    else:
        tensors[f"{target}.running_var"][3] = -1e-6
    save_file(tensors, str(bad / "model.safetensors"))
    out = tmp_path / "report.json"
    r = run_parity("check", bad, "--json", out, "--isolation", "none")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parity: error: "), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr and r.stdout == ""
    assert str(bad) in lines[0] and f"{target}.running_var" in lines[0], lines[0]
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))
