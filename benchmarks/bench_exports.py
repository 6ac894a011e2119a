"""The export paths against `--candidate torch` on the same checkpoint, measured in the same run: a
model of SmolLM2-135M's shape (random weights, bfloat16, a word-level tokenizer), converted by
`mlx_lm.convert`, by CTranslate2's TransformersConverter and by ONNX Runtime GenAI's builder (fp32,
cpu); then each conversion check (`--candidate-checkpoint`), CTranslate2's kernels and LiteRT's
converted program as candidates (float32, beside torch at float32), the captures inside mlx-lm and
inside ONNX Runtime (16 tokens) and the checks of those captures.

    python benchmarks/bench_exports.py [--repeat 3] [--tokens 16]

Needs transformers, mlx-lm (pip install -e '.[mlx]'), ctranslate2, onnxruntime-genai and litert-torch.
Each command runs in a fresh interpreter (its cost includes the imports); medians of --repeat runs
are printed, with each run's time."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_commands, print_against, smollm2_shaped, token_bench_args  # noqa: E402


def build(root: Path) -> tuple[Path, Path, Path, Path]:
    from ctranslate2.converters import TransformersConverter
    from mlx_lm import convert

    hf = smollm2_shaped(root / "hf", "bfloat16")
    convert(str(hf), mlx_path=str(root / "mlx"))
    TransformersConverter(str(hf)).convert(str(root / "ct2"))
    genai = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-o",
                            str(root / "genai"), "-p", "fp32", "-e", "cpu", "-c", str(root / "genai-cache")],
                           capture_output=True, text=True)
    if genai.returncode:
        raise SystemExit(f"the ONNX Runtime GenAI builder failed: {genai.stderr[-400:]}")
    return hf, root / "mlx", root / "ct2", root / "genai" / "model.onnx"


def main() -> None:
    a, prompt = token_bench_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf, mlx, ct2, genai = build(root)
        cap, genai_cap = root / "cap.safetensors", root / "genai-cap.safetensors"
        rows = {
            "check HF dir --candidate torch": ["check", str(hf), "--candidate", "torch", "-q"],
            "check HF dir --candidate-checkpoint MLX": ["check", str(hf), "--candidate-checkpoint", str(mlx), "-q"],
            "capture MLX --runtime mlx-lm": ["capture", str(mlx), "--runtime", "mlx-lm", "--prompt", prompt,
                                             "--max-tokens", str(a.tokens), "-o", str(cap)],
            "check HF dir --runtime-capture": ["check", str(hf), "--runtime-capture", str(cap), "-q"],
            "check HF dir --candidate-checkpoint CT2": ["check", str(hf), "--candidate-checkpoint", str(ct2), "-q"],
            "check HF dir --candidate torch --dtype float32": ["check", str(hf), "--candidate", "torch", "--dtype",
                                                               "float32", "-q"],
            "check HF dir --candidate ctranslate2 --dtype float32": ["check", str(hf), "--candidate", "ctranslate2",
                                                                     "--dtype", "float32", "-q"],
            "check HF dir --candidate litert --dtype float32": ["check", str(hf), "--candidate", "litert", "--dtype",
                                                                "float32", "-q"],
            "check HF dir --candidate-checkpoint GenAI": ["check", str(hf), "--candidate-checkpoint", str(genai), "-q"],
            "capture GenAI --runtime onnxruntime": ["capture", str(genai), "--runtime", "onnxruntime", "--prompt",
                                                    prompt, "--max-tokens", str(a.tokens), "-o", str(genai_cap)],
            "check HF dir --runtime-capture (GenAI)": ["check", str(hf), "--runtime-capture", str(genai_cap), "-q"],
        }
        times = interleaved_commands(rows, a.repeat)
        print(f"SmolLM2-135M shape (30 layers, 61 norms, bfloat16), {a.tokens} tokens, median of {a.repeat}:")
        print_against(times, "check HF dir --candidate torch")


if __name__ == "__main__":
    main()
