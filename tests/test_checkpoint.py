import json

import pytest
import torch

from parity_cli import api
from parity_cli.errors import InputError
from parity_cli.model.families import family_by_name, load_families
from parity_cli.model.layers import discover_layers


def layer_names(path, **kw):
    ckpt, fam, eps = api.load(path, **kw)
    return [l.name for l in discover_layers(ckpt, fam, eps).layers], fam, eps


@pytest.mark.parametrize("model_type,per_layer,family", [
    ("llama", 2, "llama"), ("mistral", 2, "llama"), ("qwen2", 2, "llama"), ("qwen3", 4, "llama"),
    ("gemma", 2, "gemma"), ("gemma2", 4, "gemma"), ("gemma3", 6, "gemma"), ("gemma3_text", 6, "gemma"),
])
def test_discovers_every_norm(ckpt, model_type, per_layer, family):
    L = 3
    names, fam, _ = layer_names(ckpt(model_type, layers=L))
    assert fam.name == family
    assert len(names) == per_layer * L + 1  # per-layer norms plus the final model.norm
    assert names[-1] == "model.norm"
    assert names[:per_layer] == sorted(names[:per_layer])


def test_qk_norms_run_over_head_dim(ckpt):
    path = ckpt("qwen3", hidden=64, heads=4)
    c, fam, eps = api.load(path)
    dims = {l.name: l.dim for l in discover_layers(c, fam, eps).layers}
    assert dims["model.layers.0.self_attn.q_norm"] == 16 and dims["model.layers.0.input_layernorm"] == 64


def test_multimodal_prefix(ckpt):
    names, _, _ = layer_names(ckpt("gemma3", layers=1, root="language_model.model."))
    assert "language_model.model.layers.0.self_attn.q_norm" in names and len(names) == 7


def test_eps_provenance(ckpt):
    _, _, eps = layer_names(ckpt("llama", eps=1e-5))
    assert (eps.value, eps.source) == (1e-5, "config:rms_norm_eps")
    _, _, eps = layer_names(ckpt("llama", eps=None))
    assert (eps.value, eps.source) == (1e-6, "family-default")
    _, _, eps = layer_names(ckpt("llama", eps=1e-5), eps=3e-6)
    assert (eps.value, eps.source) == (3e-6, "override")
    _, _, eps = layer_names(ckpt("gemma3", eps=None, config_extra={"text_config": {"rms_norm_eps": 2e-6}}))
    assert (eps.value, eps.source) == (2e-6, "config:text_config.rms_norm_eps")


def test_family_forced_and_unknown_model_type(ckpt):
    path = ckpt("llama", config_extra={"model_type": "mystery"})
    with pytest.raises(InputError) as err:
        api.load(path)
    msg = str(err.value)
    assert "mystery" in msg and "llama" in msg and "gemma" in msg and "config.json" in msg
    _, fam, _ = layer_names(path, family="llama")
    assert fam.name == "llama"


def test_sharded_checkpoint_reads_only_norm_tensors(ckpt, monkeypatch):
    import os

    path = ckpt("llama", layers=2, shards=3, hidden=64, dtype="bfloat16")
    assert (path / "model.safetensors.index.json").exists()
    reads = []
    real = os.pread

    def spy(fd, n, offset):
        reads.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", spy)
    names, _, _ = layer_names(path)
    assert len(names) == 5
    # each shard's header (its 8-byte length, then the JSON), then exactly the 5 norm weights
    # (2 per layer + model.norm) of 64 bf16 values: nothing else
    import struct

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    holding = sorted({index[name] for name in index if name.endswith("norm.weight")})  # shards holding a norm
    headers = [struct.unpack("<Q", (path / shard).read_bytes()[:8])[0] for shard in holding]
    assert sorted(reads) == sorted([8] * len(holding) + headers + [64 * 2] * 5)


def test_weights_are_read_as_stored(ckpt):
    w = torch.linspace(-0.5, 0.5, 64, dtype=torch.float64).to(torch.bfloat16)
    path = ckpt("gemma", layers=1, weights={"model.norm.weight": w})
    c, fam, eps = api.load(path)
    layer = [l for l in discover_layers(c, fam, eps).layers if l.name == "model.norm"][0]
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, w)
    assert layer.gain_offset == 1.0


def test_family_files_are_data():
    fams = load_families()
    assert {"llama", "gemma"} <= set(fams)
    assert family_by_name("gemma").gain_offset == 1.0 and family_by_name("llama").gain_offset == 0.0
    assert family_by_name("gemma").order == "gemma" and family_by_name("llama").order == "llama"


@pytest.mark.parametrize("damage,needle", [
    ("missing", "no such file"),
    ("no_config", "no config.json"),
    ("bad_json", "invalid JSON"),
    ("truncated", "truncated"),
    ("missing_shard", "does not exist"),
    ("pickle_only", "never unpickled"),
    ("bad_eps", "rms_norm_eps"),
])
def test_bad_checkpoints_are_input_errors(ckpt, tmp_path, damage, needle):
    path = ckpt("llama", shards=2 if damage == "missing_shard" else 1)
    if damage == "missing":
        path = tmp_path / "nope"
    elif damage == "no_config":
        (path / "config.json").unlink()
    elif damage == "bad_json":
        (path / "config.json").write_text("{not json")
    elif damage == "truncated":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "missing_shard":
        next(path.glob("model-00002-*.safetensors")).unlink()
    elif damage == "pickle_only":
        (path / "model.safetensors").unlink()
        (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    elif damage == "bad_eps":
        cfg = json.loads((path / "config.json").read_text())
        cfg["rms_norm_eps"] = "1e-6"
        (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=needle) as err:
        c, fam, eps = api.load(path)
        discover_layers(c, fam, eps)
    assert "\n" not in str(err.value)
