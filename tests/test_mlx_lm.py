"""Issue 51, MLX-LM: what `mlx_lm.convert --hf-path DIR` writes, checked two ways against the source
checkpoint. As a conversion (`parity check SRC --candidate-checkpoint MLX_DIR`: eps, gains, kind,
with mlx-lm named as the exporter from its safetensors' metadata) and inside mlx-lm itself
(`parity capture MLX_DIR --runtime mlx-lm`: the directory loaded by `mlx_lm.load` and run on
tokens; `parity check SRC --runtime-capture FILE` judges every norm module's rows, eps and gain).

The sources are tiny whole models written by transformers at bfloat16, as checkpoints are
published, with a word-level tokenizer mlx_lm.convert loads beside them; Gemma 3 has six layers,
mlx-lm's default sliding-window pattern (it indexes its cache by that pattern and ignores
`layer_types`). The faults are planted into the artifact mlx-lm wrote, as a faulty converter
would write them: the eps in its config.json, Gemma's + 1 folded into the stored gains."""

import json
import shutil

import numpy as np
import pytest
from conftest import all_pass, capture_inside, check_with_report, finding_codes, run_parity

pytest.importorskip("mlx_lm", reason="needs mlx-lm: pip install mlx-lm (pip install -e '.[mlx]')")

PROMPT = " ".join(f"w{i % 40}" for i in range(24))
SOURCES = {"llama": dict(layers=2, eps=1e-5), "gemma3_text": dict(layers=6, eps=1e-6)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{model type: (source HF directory, what mlx_lm.convert wrote from it)}."""
    from mlx_lm import convert

    from parity_cli.sources.synthetic import write_runnable

    root = tmp_path_factory.mktemp("mlx-lm")
    out = {}
    for model_type, kwargs in SOURCES.items():
        src = write_runnable(root / model_type, model_type, hidden=64, dtype="bfloat16", tokenizer=True, **kwargs)
        convert(str(src), mlx_path=str(root / f"{model_type}-mlx"))
        out[model_type] = (src, root / f"{model_type}-mlx")
    return out


@pytest.mark.parametrize("model_type", list(SOURCES))
def test_a_faithful_conversion_passes_and_names_mlx_lm(made, model_type, tmp_path):
    src, mlx_dir = made[model_type]
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", mlx_dir)
    assert r.returncode == 0 and all_pass(data), r.stdout[-2000:] + r.stderr
    copy = data["candidate"]["checkpoint"]
    assert copy["exporter"] == "mlx-lm" and copy["findings"] == 0
    assert len(data["layers"]) == {"llama": 2 * 2 + 1, "gemma3_text": 6 * 6 + 1}[model_type]
    assert "(mlx-lm, safetensors" in r.stdout


def test_a_faithful_llama_passes_inside_mlx_lm(made, tmp_path):
    """Every norm module mlx-lm runs, at bfloat16 (the checkpoint's dtype, which mlx_lm.convert keeps)."""
    src, mlx_dir = made["llama"]
    cap = capture_inside("mlx-lm", mlx_dir, tmp_path, PROMPT)
    r, data = check_with_report(tmp_path, src, "--runtime-capture", cap)
    assert r.returncode == 0 and all_pass(data) and len(data["layers"]) == 5, r.stdout[-3000:]
    meta = data["candidate"]["checkpoint"]["runtime"]
    assert meta["name"] == "mlx-lm" and meta["computes_in"] == ["bfloat16"] and meta["version"].startswith("mlx-lm ")


def test_mlx_lms_bfloat16_gemma_multiplies_by_one_plus_w_rounded_to_bfloat16(made, tmp_path):
    """mlx-lm's Gemma norms compute `mx.fast.rms_norm(x, 1.0 + self.weight, eps)`: at bfloat16 the
    sum 1 + w is rounded to bfloat16, where transformers' Gemma3RMSNorm forms it in float32. The rows
    stay inside the bfloat16 allowance; the gains mlx-lm multiplies by are not the model's, and the
    capture says so on every layer."""
    src, mlx_dir = made["gemma3_text"]
    cap = capture_inside("mlx-lm", mlx_dir, tmp_path, PROMPT)
    r, data = check_with_report(tmp_path, src, "--runtime-capture", cap)
    assert r.returncode == 1
    codes = finding_codes(data)
    assert all(layer == {"channel_gain_mismatch", "checkpoint_weight_mismatch"} for layer in codes), codes
    strata = [s for layer in data["layers"] for s in layer["strata"]]
    assert len(strata) == 6 * 6 + 1 and all(s["name"] == "captured" and s["violations"] == 0 for s in strata)


def test_the_bfloat16_gain_rounding_is_mlx_lms_own():
    """The same fact outside parity, through mlx-lm's own class and MLX alone: Gemma 3's RMSNorm with
    a bfloat16 weight multiplies by 1.0 + weight formed in bfloat16 (on most channels of these gains
    it is not 1 + w: w ~ 0.1 randn needs more bits beside the 1 than bfloat16 has), and on about a
    third of the outputs that gives another bfloat16 value than the same kernel given 1 + w in float32."""
    import mlx.core as mx
    from mlx_lm.models.gemma3_text import RMSNorm

    rng = np.random.default_rng(0)
    w = mx.array(rng.normal(0, 0.1, 64).astype(np.float32)).astype(mx.bfloat16)
    x = mx.array(rng.normal(size=(64, 64)).astype(np.float32)).astype(mx.bfloat16)
    norm = RMSNorm(64, eps=1e-6)
    norm.weight = w
    y = np.array(norm(x).astype(mx.float32))
    w32 = np.array(w.astype(mx.float32))
    gain = np.array((1.0 + w).astype(mx.float32))  # what the class forms
    assert (gain != 1.0 + w32).mean() > 0.5
    assert np.array_equal(y, np.array(mx.fast.rms_norm(x, mx.array(gain).astype(mx.bfloat16), 1e-6).astype(mx.float32)))
    wide = mx.fast.rms_norm(x.astype(mx.float32), mx.array(1.0 + w32), 1e-6).astype(mx.bfloat16)
    assert (y != np.array(wide.astype(mx.float32))).mean() > 0.1


@pytest.fixture
def planted(made, tmp_path):
    """A copy of what mlx_lm.convert wrote, a fault planted into it: `eps` in config.json, or `+1`
    folded into Gemma's stored gains (mlx-lm adds its own 1 at run time)."""
    import mlx.core as mx

    def plant(model_type, fault):
        copy = tmp_path / f"{model_type}-{fault}"
        shutil.copytree(made[model_type][1], copy)
        if fault == "eps":
            config = json.loads((copy / "config.json").read_text())
            (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
        else:
            for shard in copy.glob("*.safetensors"):
                tensors = mx.load(str(shard))
                folded = {k: (1.0 + v if k.endswith("norm.weight") else v) for k, v in tensors.items()}
                mx.save_safetensors(str(shard), folded, metadata={"format": "mlx"})
        return copy

    return plant


@pytest.mark.parametrize("model_type, fault, code", [
    ("llama", "eps", "eps_mismatch"),
    ("gemma3_text", "+1", "weight_offset_mismatch"),
])
def test_a_fault_planted_in_the_mlx_artifact_is_named_in_the_copy_and_inside_mlx_lm(made, planted, model_type,
                                                                                    fault, code, tmp_path):
    src = made[model_type][0]
    copy = planted(model_type, fault)
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy)
    assert r.returncode == 1 and all(code in codes for codes in finding_codes(data)), finding_codes(data)
    r, data = check_with_report(tmp_path, src, "--runtime-capture", capture_inside("mlx-lm", copy, tmp_path, PROMPT))
    assert r.returncode == 1 and all(code in codes for codes in finding_codes(data)), finding_codes(data)
    if fault == "eps":  # read from mlx-lm's own modules, not estimated
        diagnosis = next(d for d in data["layers"][0]["diagnoses"] if d["code"] == "eps_mismatch")
        assert diagnosis["estimated_eps"] == pytest.approx(1e-6) and diagnosis["read_from_copy"] is True


def test_a_directory_mlx_lm_cannot_load_is_one_line(tmp_path):
    """A model type mlx-lm has no class for: its own error, in one line, and no file written."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model", "rms_norm_eps": 1e-5}))
    save_file({"model.norm.weight": torch.ones(8)}, tmp_path / "model.safetensors")
    r = run_parity("capture", tmp_path, "--runtime", "mlx-lm", "--prompt", PROMPT, "-o", tmp_path / "c.safetensors")
    lines = r.stderr.splitlines()  # a capture's stage lines (`parity capture: ...`), then the error
    assert r.returncode == 2 and all(line.startswith("parity capture: ") for line in lines[:-1]), r.stderr
    assert lines[-1].startswith("parity: error: ") and "mlx-lm could not load it" in lines[-1], r.stderr
    assert "no_such_model" in lines[-1] and "Traceback" not in r.stderr
    assert not (tmp_path / "c.safetensors").exists()


def test_code_a_directory_names_for_mlx_lm_to_import_never_runs(made, tmp_path):
    """mlx-lm builds a model from `model_file` in its config when it is trusted: parity never trusts
    it. The module, which would write a file, is not run; the capture is one line naming mlx-lm's
    refusal, and nothing is written."""
    copy = tmp_path / "custom"
    shutil.copytree(made["llama"][1], copy)
    marker = tmp_path / "ran"
    (copy / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_file": "evil.py"}))
    r = run_parity("capture", copy, "--runtime", "mlx-lm", "--prompt", PROMPT, "-o", tmp_path / "c.safetensors")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and all(line.startswith("parity capture: ") for line in lines[:-1]), r.stderr
    assert lines[-1].startswith("parity: error: ") and "custom module ('evil.py')" in lines[-1], r.stderr
    assert not marker.exists() and not (tmp_path / "c.safetensors").exists()
