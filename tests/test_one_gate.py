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


def _forced(ckpt):
    return ckpt("llama", layers=2, eps=1e-6, dtype="float32")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_wrong_family_forced_is_refused_by_every_command(ckpt, command):
    """--family gemma on a llama checkpoint: the oracle and the candidate would both compute 1 + w, so a
    PASS would say nothing of this model; every command refuses it in the same one line."""
    r = run_parity(*COMMANDS[command][:1], _forced(ckpt), *COMMANDS[command][1:], "--family", "gemma")
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert "--family gemma contradicts model_type 'llama' in config.json (family llama): gemma's gain is 1 + w, " \
           "llama's 0 + w" in line and line.endswith("--family-force checks it so anyway"), line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_wrong_family_confirmed_is_on_every_verdict_line(ckpt, command):
    r = run_parity(*COMMANDS[command][:1], _forced(ckpt), *COMMANDS[command][1:], "--family", "gemma",
                   "--family-force")
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.splitlines()[-1]
    assert last.startswith("PASS: ") and last.endswith(
        " (family gemma forced over model_type 'llama', which it contradicts)"), last


HOSTILE = {"nan": 1, "inf": 1, "empty": 0, "forced": 0}  # the one exit code every command gives


@pytest.mark.parametrize("how", list(HOSTILE))
def test_every_command_gives_one_verdict_in_80_columns(ckpt, how):
    """The same hostile checkpoint through check, fused and runtimes at COLUMNS=80: one exit code, one
    verdict word, and a last line that fits (issue 47: check's was 92-108 characters with a finding)."""
    words = set()
    for command, (name, *rest) in COMMANDS.items():
        path = _forced(ckpt) if how == "forced" else _hostile(ckpt, how)
        extra = ("--family", "gemma", "--family-force") if how == "forced" else ()
        r = run_parity(name, path, *rest, *extra, env={"COLUMNS": "80"})
        assert r.returncode == HOSTILE[how], (command, r.stdout + r.stderr)
        last = r.stdout.splitlines()[-1]
        assert len(last) <= 80, (command, last)
        words.add(last.partition(":")[0])
    assert words == {"FAIL" if HOSTILE[how] else "PASS"}


def test_a_checkpoint_whose_every_gain_has_no_width_is_one_line_from_every_command(ckpt):
    """Nothing to check at all: every command refuses it in the same one line (runtimes never prints
    "PASS: all 0 runtime checks"), naming the first gain and how many more."""
    import torch
    from safetensors.torch import load_file, save_file

    path = ckpt("llama", layers=2, eps=1e-6, dtype="float32")
    tensors = load_file(path / "model.safetensors")
    norms = [k for k in tensors if k.endswith("norm.weight")]
    for k in norms:
        tensors[k] = tensors[k][:0].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    said = set()
    for name, *rest in COMMANDS.values():
        r = run_parity(name, path, *rest)
        assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
        (line,) = r.stderr.splitlines()
        said.add(line)
    assert len(norms) == 5 and torch.Size([0]) == tensors[norms[0]].shape
    (line,) = said
    assert line.startswith(f"parity: error: {path}: no checkable norm layer (") and line.endswith(
        f"shape [0] is not a gain vector (or a heads x dim matrix); not checked; +{len(norms) - 1} more)"), line
