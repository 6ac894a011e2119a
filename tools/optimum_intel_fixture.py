"""Writes tests/data/optimum-intel/: a tiny Llama and a tiny Qwen3 (parity's synthetic.write_runnable,
bfloat16) and the OpenVINO IR optimum-intel exports from each, as a user runs it:
`OVModelForCausalLM.from_pretrained(path, export=True).save_pretrained(out)`.

optimum-intel 2.2.0 needs transformers < 5.6 and the test environment's lock holds 5.25, so the export
runs in an interpreter of its own, given as --python:

    python -m venv /tmp/oi && /tmp/oi/bin/pip install torch==2.13.0 "optimum-intel[openvino]==2.2.0" \\
        "transformers<5.6" && /tmp/oi/bin/pip uninstall -y torchvision
    python tools/optimum_intel_fixture.py --python /tmp/oi/bin/python

(torchvision comes in built for another torch, and transformers' AutoProcessor, which optimum.intel
imports, then fails on torchvision::nms.) tests/test_optimum_intel.py reads what this writes."""

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "optimum-intel"
MODELS = {"llama": 1e-5, "qwen3": 1e-6}
EXPORT = """
import sys
from optimum.intel import OVModelForCausalLM
OVModelForCausalLM.from_pretrained(sys.argv[1], export=True).save_pretrained(sys.argv[2])
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="an interpreter with optimum-intel installed")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from parity_cli.sources.synthetic import write_runnable

    with tempfile.TemporaryDirectory() as tmp:
        for model_type, eps in MODELS.items():
            src = write_runnable(Path(tmp) / model_type, model_type, layers=2, hidden=64, eps=eps, dtype="bfloat16",
                                 tokenizer=True)
            subprocess.run([args.python, "-c", EXPORT, str(src), str(Path(tmp) / f"{model_type}-ov")], check=True)
            hf, ov = OUT / model_type / "hf", OUT / model_type / "ov"
            shutil.rmtree(OUT / model_type, ignore_errors=True)
            hf.mkdir(parents=True)
            ov.mkdir(parents=True)
            for name in ("config.json", "model.safetensors"):
                shutil.copy(src / name, hf / name)
            for name in ("openvino_model.xml", "openvino_model.bin"):
                shutil.copy(Path(tmp) / f"{model_type}-ov" / name, ov / name)
            print(f"{OUT / model_type}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
