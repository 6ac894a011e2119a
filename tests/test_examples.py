"""Issue 50: every `parity` command the README and the docs show is run, against checkpoints this
test writes (the placeholders `path/to/hf-model`, `my_kernels.py`, `model.gguf` made real), and
exits as the page says. The case list is data: an example added to a page without its row here
fails `test_every_example_on_a_page_has_its_case`, and a row whose example left the pages fails it
too. A command that cannot run here says why (the Hub, a GPU) and which test runs it instead."""

import re
from pathlib import Path

import pytest
from conftest import run_parity

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
HUB = "needs the Hub: tests/test_remote.py runs hf:// and https:// against a local one"

# command as the page shows it (its trailing comment dropped) -> the exit code it has on the
# checkpoints below (with the cause its last line names, where it fails), or why it is not run here
CASES = {
    "parity demo": 0,
    "parity check path/to/hf-model --candidate my_kernels.py:rms_norm --dtype bfloat16": 0,
    "parity runtimes path/to/hf-model --runtimes torch,onnxruntime,openvino --dtypes float32,bfloat16": 0,
    "parity check path/to/hf-model --candidate-checkpoint model.gguf": 0,
    "parity check hf://Qwen/Qwen3-8B --candidate onnxruntime --json parity.json --junit parity.xml --markdown parity.md":
        HUB,
    "parity check hf://Qwen/Qwen3-8B": HUB,
    "parity check path/to/hf-model": 0,
    "parity check path/to/hf-model --candidate hf --dtype float16 --json report.json": 0,
    "parity check path/to/hf-model --candidate my_kernels.py:FusedRMSNorm --device cuda --grad":
        "needs a CUDA device (tests marked cuda run it where one is)",
    # the model says 1e-6: a runtime that hard-codes 1e-5 is an eps_mismatch, explained
    "parity check path/to/hf-model --candidate-eps 1e-5 --explain": (1, "eps_mismatch"),
    # bitwise at bfloat16: F.rms_norm multiplies by the gain before its one cast, Llama's class casts
    # the normalised row to bfloat16 first (the hf transcription is bitwise transformers')
    "parity check path/to/hf-model --candidate torch --reference hf --reference-dtype bfloat16 --exact":
        (1, "cast_order"),
    "parity check model.gguf --plot errors.svg": 0,
    "parity check hf://meta-llama/Llama-3.1-405B@<sha>": HUB,
    "parity check hf://ORG/NAME-GGUF/model-Q4_K_M.gguf": HUB,
    "parity check hf://ORG/NAME --candidate-checkpoint s3://bucket/exports/name": HUB,
    "parity check https://mirror.example/models/name/": HUB,
    "parity capture model.gguf --runtime llama.cpp --prompt \"...\" -o cap.safetensors":
        "needs a runnable GGUF model: tests/test_capture.py and tests/test_runtime_capture.py capture in llama.cpp",
    "parity check HF_DIR --runtime-capture cap.safetensors":
        "reads the capture above: tests/test_runtime_capture.py checks one",
    "parity check llama --runtime-capture cap_eps.safetensors": "reads a capture: tests/test_runtime_capture.py",
}


def shown() -> dict[str, str]:
    """{command: page} for every line of a fenced shell or untyped block that runs `parity`."""
    found = {}
    for page in PAGES:
        for lang, body in ((m.group(1).strip(), m.group(2)) for m in FENCE.finditer(page.read_text(encoding="utf-8"))):
            if lang not in ("", "sh", "console"):
                continue
            for line in body.splitlines():
                line = line.strip().removeprefix("$ ")
                for part in line.split(" && "):
                    if part.startswith("parity "):
                        found[re.sub(r"\s+#.*$", "", part).strip()] = page.relative_to(ROOT).as_posix()
    return found


def test_every_example_on_a_page_has_its_case():
    pages = shown()
    assert len(pages) >= 15
    assert set(pages) == set(CASES), {"no case": sorted(set(pages) - set(CASES)),
                                      "no longer shown": sorted(set(CASES) - set(pages))}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The placeholders made real: a Llama checkpoint whose eps is 1e-6, its GGUF conversion, and
    my_kernels.py with a correct RMSNorm as a function and as a module."""
    from parity_cli.sources.synthetic import hf_to_gguf, write_checkpoint

    root = tmp_path_factory.mktemp("examples")
    hf = write_checkpoint(root / "path" / "to" / "hf-model", "llama", layers=2, hidden=64, heads=4, eps=1e-6)
    hf_to_gguf(hf, root / "model.gguf")
    (root / "my_kernels.py").write_text(
        "import torch\n\n\n"
        "def rms_norm(x, weight, eps):\n"
        "    h = x.float()\n"
        "    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight\n\n\n"
        "class FusedRMSNorm(torch.nn.Module):\n"
        "    def __init__(self, weight, eps):\n"
        "        super().__init__()\n"
        "        self.weight, self.eps = torch.nn.Parameter(weight), eps\n\n"
        "    def forward(self, x):\n"
        "        return rms_norm(x, self.weight, self.eps)\n")
    return root


@pytest.mark.parametrize("command", sorted(CASES))
def test_the_example_runs_as_its_page_says(command, workspace):
    expected = CASES[command]
    if isinstance(expected, str):
        pytest.skip(expected)
    import shlex

    code, cause = expected if isinstance(expected, tuple) else (expected, None)
    r = run_parity(*shlex.split(command)[1:], cwd=workspace)
    assert r.returncode == code, (command, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    if cause:
        verdict = [line for line in r.stdout.splitlines() if line.startswith("FAIL: ")]
        assert verdict and cause in verdict[-1], r.stdout[-2000:]
