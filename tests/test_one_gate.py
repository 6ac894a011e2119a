"""Issue 47, a PASS that is not true: every command gives one verdict on the same hostile
checkpoint. `parity check`, `parity fused` and `parity runtimes` read a non-finite gain as the
checkpoint's fault (nonfinite_weight, exit 1), say a norm they did not check on the verdict line,
and refuse a gain no kernel can take in one line (exit 2), never "PASS: all 0"."""

import pytest
from conftest import run_parity

COMMANDS = {"check": ("check",), "fused": ("fused",),
            "runtimes": ("runtimes", "--runtimes", "torch,onnxruntime", "--dtypes", "float32")}


def _hostile(ckpt, how):
    import torch
    from safetensors.torch import load_file, save_file

    path = ckpt("llama", layers=2, eps=1e-6, dtype="float32")
    tensors = load_file(path / "model.safetensors")
    w = tensors["model.norm.weight"]
    tensors["model.norm.weight"] = {"nan": torch.full_like(w, float("nan")), "inf": w.index_fill(0, torch.tensor([3]),
                                    float("inf")), "empty": w[:0].clone(), "int8": w.to(torch.int8)}[how]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("how, count", [("nan", 64), ("inf", 1)])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_non_finite_gain_fails_every_command(ckpt, command, how, count):
    r = run_parity(*COMMANDS[command][:1], _hostile(ckpt, how), *COMMANDS[command][1:])
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.splitlines()[-1]
    if command == "runtimes":  # each cell is a check: its cause is the checkpoint's, numbered below the table
        assert last == "FAIL: 2 of 2 runtime checks: torch float32, onnxruntime float32"
        assert "[1] 1 of 5 layers: nonfinite_weight" in r.stdout
    else:
        assert last.startswith("FAIL: 1 of 5 layers: nonfinite_weight"), last
    if command == "fused":  # its causes are printed whole above the verdict
        assert f"{count} non-finite value(s) in the stored weight model.norm.weight" in r.stdout


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_gain_of_no_width_is_said_unchecked_by_every_command(ckpt, command):
    r = run_parity(*COMMANDS[command][:1], _hostile(ckpt, "empty"), *COMMANDS[command][1:])
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.splitlines()[-1]
    assert last.startswith("PASS") and last.endswith(
        "; 1 of 5 norms not checked (model.norm: matches no pattern of family llama)"), last


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_int8_gain_is_one_line_from_every_command(ckpt, command):
    r = run_parity(*COMMANDS[command][:1], _hostile(ckpt, "int8"), *COMMANDS[command][1:])
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert "tensor 'model.norm.weight' is stored as 'I8'; a norm weight must be F64, F32, F16, BF16" in line
