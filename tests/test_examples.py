"""Issue 50: every `parity` command the README and the docs show is run, against checkpoints this
test writes (the placeholders `path/to/hf-model`, `my_kernels.py`, `model.gguf` made real), and
exits as the page says. The case list is data: an example added to a page without its row here
fails `test_every_example_on_a_page_has_its_case`, and a row whose example left the pages fails it
too. A command that cannot run here says why (the Hub, a GPU) and which test runs it instead."""

import re
from pathlib import Path

import pytest
from conftest import run_parity, slow_unless
from pages import blocks, samples

HUB = "needs the Hub: tests/test_remote.py runs hf:// and https:// against a local one"
# the repositories the hf:// examples name, served by a local Hub (tests/hub_server.py) with tiny checkpoints
REPOS = {"Qwen/Qwen3-8B": "qwen3", "meta-llama/Llama-3.1-405B": "llama", "ORG/NAME-GGUF": "gguf", "ORG/NAME": "llama"}

# command as the page shows it (its trailing comment dropped) -> the exit code it has on the
# checkpoints below (with the cause its last line names, where it fails), or why it is not run here
CASES = {
    "parity demo": 0,
    "parity check path/to/hf-model --candidate my_kernels.py:rms_norm --dtype bfloat16": 0,
    "parity runtimes path/to/hf-model --runtimes torch,onnxruntime,openvino --dtypes float32,bfloat16": 0,
    "parity check path/to/hf-model --candidate-checkpoint model.gguf": 0,
    # ONNX Runtime's CPU provider has no bfloat16 kernel for the norm: a bf16 checkpoint is checked at float16
    "parity check hf://Qwen/Qwen3-8B --candidate onnxruntime --dtype float16 --json parity.json --junit parity.xml "
    "--markdown parity.md": 0,
    "parity check hf://Qwen/Qwen3-8B": 0,
    "parity check path/to/hf-model": 0,
    "parity check path/to/hf-model --candidate onnxruntime --dtype float16 --json parity.json --junit parity.xml "
    "--markdown parity.md": 0,
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
    "parity check hf://meta-llama/Llama-3.1-405B@<sha>": 0,
    "parity check hf://ORG/NAME-GGUF/model-Q4_K_M.gguf": 0,
    # the copy in the bucket is the repository's own files (a local S3: tests/s3_server.py)
    "parity check hf://ORG/NAME --candidate-checkpoint s3://bucket/exports/name": 0,
    "parity check https://mirror.example/models/name/": "the host is the reader's: tests/test_remote.py runs https://",
    "parity capture model.gguf --runtime llama.cpp --prompt \"...\" -o cap.safetensors": 0,
    "parity check HF_DIR --runtime-capture cap.safetensors": 0,
    # `llama` trained at eps 1e-5, its GGUF written with 1e-6: llama.cpp's own nodes say 1e-6
    "parity check llama --runtime-capture cap_eps.safetensors": (1, "eps_mismatch"),
    # mlx_model: what mlx_lm.convert wrote from path/to/hf-model (the page's first line, run by the fixture)
    "parity check path/to/hf-model --candidate-checkpoint mlx_model": 0,
    "parity capture mlx_model --runtime mlx-lm --prompt \"...\" -o mlx-cap.safetensors": 0,
    "parity check path/to/hf-model --runtime-capture mlx-cap.safetensors": 0,
    # ct2_model: what ct2-transformers-converter wrote from path/to/hf-model (the page's line, run by the fixture)
    "parity check path/to/hf-model --candidate-checkpoint ct2_model": 0,
    # CTranslate2's CPU computes float32 only: the bfloat16 checkpoint is probed at float32
    "parity check path/to/hf-model --candidate ctranslate2 --dtype float32": 0,
    # litert-torch converts no bfloat16 module: the bfloat16 checkpoint is probed at float32
    "parity check path/to/hf-model --candidate litert --dtype float32": 0,
    # model.tflite: path/to/hf-model loaded at float32 and converted by litert_torch.convert (the fixture,
    # which runs the capture too, on tokens.txt's ids)
    "parity check path/to/hf-model --candidate-checkpoint model.tflite": 0,
    "parity capture model.tflite --runtime litert --tokens tokens.txt -o litert-cap.safetensors": 0,
    "parity check path/to/hf-model --runtime-capture litert-cap.safetensors": 0,
    # genai_model: what ONNX Runtime GenAI's builder wrote from path/to/hf-model (the page's line, run by the fixture)
    "parity check path/to/hf-model --candidate-checkpoint genai_model/model.onnx": 0,
    "parity capture genai_model/model.onnx --runtime onnxruntime --prompt \"...\" -o genai-cap.safetensors": 0,
    "parity check path/to/hf-model --runtime-capture genai-cap.safetensors": 0,
}


def shown() -> dict[str, str]:
    """{command: page} for every line of a fenced shell or untyped block that runs `parity`."""
    found = {}
    for page, lang, body in blocks():
        if lang not in ("", "sh", "console"):
            continue
        for line in body.splitlines():
            for part in line.strip().removeprefix("$ ").split(" && "):
                if part.startswith("parity "):
                    found[re.sub(r"\s+#.*$", "", part).strip()] = page
    return found


def test_every_example_on_a_page_has_its_case():
    pages = shown()
    assert len(pages) >= 15
    assert set(pages) == set(CASES), {"no case": sorted(set(pages) - set(CASES)),
                                      "no longer shown": sorted(set(CASES) - set(pages))}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A local Hub serving REPOS: a Qwen3 and a Llama checkpoint, and a repository holding a GGUF."""
    from parity_cli.sources.synthetic import hf_to_gguf, write_checkpoint
    from tests.hub_server import HubServer

    root = tmp_path_factory.mktemp("hub")
    with HubServer() as server:
        shas = {}
        for repo, kind in REPOS.items():
            folder = root / repo.replace("/", "--")
            if kind == "gguf":
                folder.mkdir()
                hf_to_gguf(write_checkpoint(root / "gguf-source", "llama", layers=2, eps=1e-5), folder / "model-Q4_K_M.gguf")
            else:
                write_checkpoint(folder, kind, layers=2, hidden=64, heads=4)
            shas[repo] = server.add_repo(repo, folder)
        yield server, shas, root


@pytest.fixture(scope="module")
def bucket(hub):
    """A local S3 holding a copy of ORG/NAME under s3://bucket/exports/name."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.s3_server import S3Server

    _, _, root = hub
    with S3Server() as server:
        server.put_tree("bucket", "exports/name", root / "ORG--NAME")
        yield server


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The placeholders made real: a whole Llama llama.cpp can run, its eps 1e-6 (path/to/hf-model),
    its GGUF conversion (model.gguf), and my_kernels.py with a correct RMSNorm as a function and as
    a module."""
    from parity_cli.sources.synthetic import hf_to_gguf, write_runnable

    root = tmp_path_factory.mktemp("examples")
    hf = write_runnable(root / "path" / "to" / "hf-model", "llama", layers=2, hidden=64, eps=1e-6, dtype="bfloat16",
                        tokenizer=True)
    hf_to_gguf(hf, root / "model.gguf", full=True)
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


def _shown(start: str) -> str:
    """The one line a page shows that starts so (an exporter's command, which a fixture runs)."""
    (line,) = {line for _, _, body in blocks() for line in body.splitlines() if line.startswith(start)}
    return line


@pytest.fixture(scope="module")
def mlx_model(workspace):
    """mlx_model: path/to/hf-model as `mlx_lm.convert --hf-path path/to/hf-model --mlx-path mlx_model`
    writes it (its Python API), and the capture of it the page's third line makes (run once)."""
    pytest.importorskip("mlx_lm", reason="needs mlx-lm: pip install -e '.[mlx]'")
    from mlx_lm import convert

    shown = _shown("mlx_lm.convert ")
    assert shown == "mlx_lm.convert --hf-path path/to/hf-model --mlx-path mlx_model", shown
    convert(str(workspace / "path" / "to" / "hf-model"), mlx_path=str(workspace / "mlx_model"))
    command = next(c for c in CASES if c.startswith("parity capture mlx_model "))
    return {command: _run(command, workspace)}


@pytest.fixture(scope="module")
def ct2_model(workspace):
    """ct2_model: path/to/hf-model as `ct2-transformers-converter --model path/to/hf-model --output_dir
    ct2_model` writes it (the converter's Python API, TransformersConverter)."""
    pytest.importorskip("ctranslate2", reason="needs CTranslate2: pip install ctranslate2")
    from ctranslate2.converters import TransformersConverter

    shown = _shown("ct2-transformers-converter ")
    assert shown == "ct2-transformers-converter --model path/to/hf-model --output_dir ct2_model", shown
    TransformersConverter(str(workspace / "path" / "to" / "hf-model")).convert(str(workspace / "ct2_model"))
    return workspace / "ct2_model"


@pytest.fixture(scope="module")
def model_tflite(workspace):
    """model.tflite: path/to/hf-model as the page converts it: loaded at float32 (litert-torch converts
    no bfloat16 module), token ids in and logits out, litert_torch.convert, .export."""
    pytest.importorskip("litert_torch", reason="needs litert-torch: see docs/export-litert.md")
    import warnings

    import litert_torch
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workspace / "path" / "to" / "hf-model", dtype=torch.float32).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        litert_torch.convert(Logits().eval(), (torch.zeros(1, 8, dtype=torch.long),)).export(
            str(workspace / "model.tflite"))
    (workspace / "tokens.txt").write_text("1 5 9 13 17 21 2 7\n")
    command = next(c for c in CASES if c.startswith("parity capture model.tflite "))
    return {command: _run(command, workspace)}


@pytest.fixture(scope="module")
def genai_model(workspace):
    """genai_model: path/to/hf-model as the page's builder line writes it, and the capture of it the
    page's third line makes (run once)."""
    import shlex

    pytest.importorskip("onnxruntime_genai", reason="needs onnxruntime-genai: pip install onnxruntime-genai")
    from exporters import ort_genai_build

    shown = _shown("python -m onnxruntime_genai.models.builder ")
    ort_genai_build(*[workspace / a if a.startswith(("path/", "genai_model")) else a
                      for a in shlex.split(shown)[3:]], "-c", workspace / "genai-cache")
    command = next(c for c in CASES if c.startswith("parity capture genai_model/"))
    return {command: _run(command, workspace)}


@pytest.fixture(scope="module")
def captures(workspace):
    """What the capture examples read: cap.safetensors (model.gguf run in llama.cpp, by the page's own
    command), and cap_eps.safetensors: `llama`, a Llama trained at eps 1e-5, converted with the eps
    written as 1e-6, run in llama.cpp. {command: its result} for the capture command."""
    from parity_cli.sources.synthetic import hf_to_gguf, write_runnable

    pytest.importorskip("xllamacpp", reason="needs llama.cpp: pip install --no-deps xllamacpp")
    llama = write_runnable(workspace / "llama", "llama", layers=2, hidden=64, eps=1e-5)
    eps_gguf = hf_to_gguf(llama, workspace / "llama-eps.gguf", full=True, eps=1e-6)
    r = run_parity("capture", eps_gguf, "--runtime", "llama.cpp", "--prompt", PROMPT, "-o", "cap_eps.safetensors",
                   cwd=workspace)
    assert r.returncode == 0, r.stderr
    command = next(c for c in CASES if c.startswith("parity capture "))
    return {command: _run(command, workspace)}


# placeholders a page leaves to the reader -> what stands for them here: the HF directory model.gguf
# was converted from, and words the tiny GGUF's vocabulary has
PROMPT = " ".join(f"w{i % 40}" for i in range(16))
PLACEHOLDERS = {"HF_DIR": "path/to/hf-model", '"..."': f'"{PROMPT}"'}
COLUMNS = "80"  # the width the pages' sample outputs were printed at


def _run(command: str, cwd: Path, env: dict | None = None):
    import shlex

    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    return run_parity(*shlex.split(command)[1:], cwd=cwd, env={"COLUMNS": COLUMNS, **(env or {})})


# a runtime whose first conversion in a process costs seconds (issue 49: run in `--tier slow`)
SLOW_RUNTIMES = ("litert", "tflite", "executorch", "vllm", "mlx")


@pytest.mark.parametrize("command", [pytest.param(c, marks=slow_unless(not any(r in c for r in SLOW_RUNTIMES)))
                                     for c in sorted(CASES)], ids=lambda command: command[:90])
def test_the_example_runs_as_its_page_says(command, workspace, request):
    """Exits as the page says; where a page shows what it prints, it prints that."""
    expected = CASES[command]
    if isinstance(expected, str):
        pytest.skip(expected)
    code, cause = expected if isinstance(expected, tuple) else (expected, None)
    env = None
    if "hf://" in command:
        server, shas, root = request.getfixturevalue("hub")
        command = command.replace("<sha>", shas["meta-llama/Llama-3.1-405B"])
        env = {"HF_ENDPOINT": server.url, "PARITY_CACHE": str(root / "cache"), "HF_HOME": str(root / "hf"),
               "HF_TOKEN": "", "HF_HUB_OFFLINE": ""}
    if "s3://" in command:
        env = {**env, **request.getfixturevalue("bucket").env()}
    if "ct2_model" in command:
        request.getfixturevalue("ct2_model")
    if "genai" in command:
        made = request.getfixturevalue("genai_model")
        r = made.get(command) or _run(command, workspace, env)
    elif "mlx" in command:
        made = request.getfixturevalue("mlx_model")
        r = made.get(command) or _run(command, workspace, env)
    elif "model.tflite" in command or "litert-cap" in command:
        made = request.getfixturevalue("model_tflite")
        r = made.get(command) or _run(command, workspace, env)
    elif "capture" in command:
        made = request.getfixturevalue("captures")
        r = made.get(command) or _run(command, workspace)
    else:
        r = _run(command, workspace, env)
    assert r.returncode == code, (command, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    if cause:
        verdict = [line for line in r.stdout.splitlines() if line.startswith("FAIL: ")]
        assert verdict and cause in verdict[-1], r.stdout[-2000:]
    if command in samples():
        page, shown = samples()[command]
        assert_shows(r.stdout, shown.removeprefix(f"$ {command}\n"), page)


NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?x?")


def _shape(line: str) -> str:
    return NUMBER.sub("#", line.rstrip())


def assert_shows(printed: str, shown: str, page: str) -> None:
    """Every line a page shows is a line printed, in that order; a `...` line stands for lines left
    out. Figures are compared as figures (a CPU with other kernels prints other last digits: the
    tests that own them check them); the verdict lines (PASS:/FAIL:) word for word."""
    out = printed.splitlines()
    runs = [[]]
    for line in shown.splitlines():
        if line.strip() == "...":
            runs.append([])
        else:
            runs[-1].append(line)
    at = 0
    for run in filter(None, runs):
        want = [_shape(line) for line in run]
        found = next((i for i in range(at, len(out) - len(run) + 1)
                      if [_shape(line) for line in out[i:i + len(run)]] == want), None)
        assert found is not None, f"{page} shows lines this run does not print:\n" + "\n".join(run) + \
            "\n--- it printed:\n" + printed
        for line, real in zip(run, out[found:found + len(run)]):
            if line.startswith(("PASS:", "FAIL:")):
                assert line.rstrip() == real.rstrip(), (page, line, real)
        at = found + len(run)


def _kernel_test_failure() -> str:
    """What pytest shows of the kernel-tests page's test when the kernel hard-codes eps 1e-5: the
    AssertionError assert_norm_parity raises, each line after pytest's `E       `."""
    import sys
    import tempfile

    import torch

    from parity_cli.testing import assert_norm_parity

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "my_kernels.py").write_text(
            "import torch\n\n\ndef fused_rms_norm(x, weight, eps):\n"
            "    h = x.float()\n"
            "    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight\n")
        sys.path.insert(0, folder)
        try:
            from my_kernels import fused_rms_norm
        finally:
            sys.path.remove(folder)
            sys.modules.pop("my_kernels", None)
    with pytest.raises(AssertionError) as raised:
        assert_norm_parity(fused_rms_norm, family="llama", hidden_size=4096, eps=1e-6, dtype=torch.bfloat16)
    first, *rest = str(raised.value).splitlines()
    return "\n".join([f"E       AssertionError: {first}", *(f"E       {line}" for line in rest)])


# outputs shown that are not a `parity` command's: what prints them
OWN_SAMPLES = {"pytest, a kernel with eps hard-coded to 1e-5": _kernel_test_failure}


@pytest.mark.parametrize("said_by", list(OWN_SAMPLES))
def test_an_output_a_page_shows_is_what_its_code_prints(said_by):
    page, shown = samples()[said_by]
    assert_shows(OWN_SAMPLES[said_by](), shown, page)


def test_every_output_a_page_shows_is_checked_against_its_command():
    """A sample is tied to a command this file runs (a case that is not skipped) or to a check of its
    own below."""
    for said_by, (page, _) in samples().items():
        runs = isinstance(CASES.get(said_by), (int, tuple)) or said_by in OWN_SAMPLES
        assert runs, f"{page}: the output shown for {said_by!r} is not checked by a test"


def test_the_exact_example_fails_because_the_two_cast_orders_differ_bitwise():
    """Why the --exact case above expects exit 1 with cast_order, derived from torch alone: at bfloat16
    F.rms_norm is the normalised row times the gain in float32, cast once (Gemma's order), bitwise;
    Llama's class casts the normalised row first and multiplies at bfloat16, and the two differ on a
    share of the elements."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=gen).bfloat16()
    w = (0.1 + 0.5 * torch.rand(64, generator=gen)).bfloat16()
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    f = torch.nn.functional.rms_norm(x, (64,), w, 1e-6)
    assert torch.equal(f, (normed * w.float()).bfloat16())
    assert (f != normed.bfloat16() * w).double().mean() > 0.05

# --- the Python blocks: runtime facts shown outside parity, and the kernel author's API -----------

VLLM_GLOB = ".venv/lib/python3.11/site-packages/vllm/"  # the pages' venv; here, the installed package's folder
HARNESS = r'''
import ast, builtins, json, sys
source = sys.stdin.read()
tree = ast.parse(source)
for i, node in enumerate(tree.body):  # every top-level expression's value is kept, as a notebook shows it
    if isinstance(node, ast.Expr):
        tree.body[i] = ast.Expr(ast.Call(ast.Name("_keep", ast.Load()), [node.value], []))
ast.fix_missing_locations(tree)
values = []
def plain(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (tuple, list)):
        return [plain(x) for x in v]
    return v if isinstance(v, (int, float, str, type(None))) else repr(v)
def _keep(v):
    if v is not None:
        values.append(plain(v))
builtins.print = lambda *args, **kw: values.append([plain(a) for a in args])
exec(compile(tree, "example", "exec"), {"_keep": _keep, "__name__": "__example__"})
sys.stdout.write("\nVALUES " + json.dumps(values, allow_nan=True))
'''


def _vllm_fact_rounding(values):
    """docs/runtimes.md: vLLM's AVX2 rms_norm at bfloat16 truncates (0.99992 of elements) where a
    round to nearest would agree on about half (0.501)."""
    rounded, truncated = values
    assert 0.4 < rounded < 0.6 and truncated > 0.999


def _mlx_fact_three_roundings(values):
    """docs/runtimes.md: MLX's bfloat16 layer_norm is the affine rounded three times (all but a few
    elements in 10^5, where its float32 statistics tip a rounding), not once (0.63 of them)."""
    ((three, once),) = values
    assert three > 0.9999 and 0.5 < once < 0.75


def _executorch_fact_256(values):
    """docs/runtimes.md: ExecuTorch's half LayerNorm is right at 255 elements (0.002) and off by
    whole units from 256 (4 to 13)."""
    (n1, err1), (n2, err2) = values
    assert (n1, n2) == (255, 256) and err1 < 0.01 and err2 > 0.5


def _vllm_fact_overflow(values):
    """docs/fused.md: vLLM's float16 fused_add_rms_norm keeps the overflowed sum (inf) in the residual
    and normalises by it: the [0, 0] element inf and the next 0.0002, where the oracle's normed value
    at [0, 0] is 8.0."""
    ((residual, normed),) = values
    assert residual[0] == float("inf") and residual[1] == 2.0
    assert normed[0] == float("inf") and abs(normed[1] - 0.0002) < 0.0001


PY_CASES = {  # a block's first line -> what its values must be, or why it is not run here
    "import glob, torch\ntorch.ops.load_library(glob.glob(\".venv/lib/python3.11/site-packages/vllm/_C_AVX2*.so\")[0])\nx, w":
        _vllm_fact_rounding,
    "import numpy as np, mlx.core as mx, torch": _mlx_fact_three_roundings,
    "import torch; from torch.export import export; from executorch.exir import to_edge_transform_and_lower":
        _executorch_fact_256,
    "import torch\nfrom parity_cli.testing import assert_norm_parity\n\ndef fused_add_rms_norm": None,  # it asserts itself
    "import glob, torch\ntorch.ops.load_library(glob.glob(\".venv/lib/python3.11/site-packages/vllm/_C_AVX2*.so\")[0])\nx = torch.ones":
        _vllm_fact_overflow,
    "import torch\nfrom parity_cli.testing import assert_norm_parity\nfrom my_kernels import fused_rms_norm":
        "run by tests/test_testing_api.py::test_readme_example_runs_and_catches_the_fault, with the example kernels",
    "import pytest\nfrom parity_cli.testing import norm_cases":
        "a fragment (MY_KERNELS is the reader's): tests/test_pytest_plugin.py runs norm_cases with the fixture",
}


def python_blocks() -> dict[str, str]:
    """{the key of PY_CASES it matches (else its first line): the block} for every ```python block."""
    found = {}
    for _, lang, body in blocks():
        if lang == "python":
            found[next((k for k in PY_CASES if body.startswith(k)), body.splitlines()[0])] = body
    return found


def test_every_python_block_has_its_case():
    assert set(python_blocks()) == set(PY_CASES)


@pytest.mark.parametrize("key", [pytest.param(k, marks=slow_unless(not any(r in python_blocks().get(k, "")
                                                                          for r in SLOW_RUNTIMES)))
                                 for k in PY_CASES], ids=lambda k: k.splitlines()[-1][:40])
def test_the_python_block_shows_what_its_page_says(key):
    """Each block in a fresh interpreter (a vLLM library loaded twice in one process is refused),
    its values read back as JSON and held to what the page says of them."""
    import importlib.util
    import json
    import subprocess
    import sys

    check = PY_CASES[key]
    if isinstance(check, str):
        pytest.skip(check)
    body = python_blocks()[key]
    for package in ("vllm", "mlx", "executorch"):
        if package in body and importlib.util.find_spec(package) is None:
            pytest.skip(f"needs {package}")
    if VLLM_GLOB in body:
        body = body.replace(VLLM_GLOB, str(Path(importlib.util.find_spec("vllm").submodule_search_locations[0])) + "/")
    r = subprocess.run([sys.executable, "-c", HARNESS], input=body, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    values = json.loads(r.stdout.rpartition("\nVALUES ")[2])
    if check is not None:
        check(values)
