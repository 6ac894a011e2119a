"""The `torch.compile` built-in: the family's norm as PyTorch 2's compiler builds it, inductor's
generated kernel (C++ with OpenMP on CPU, Triton on CUDA), as transformers and vLLM compile a
model: the family's own transformers module class where it has one (its forward traced by dynamo,
its parameters graph inputs), else the `hf` transcription of its numerics, compiled with
dynamic=True so that the probes' batch sizes share one kernel.

Inductor keeps the dtype a graph asks for, but computes a half-precision reduction (the mean
square, the mean) in float32 inside the fused kernel and may fuse the casts a module writes
between its ops: the numerics can differ from eager's, which is what this candidate checks.
The first compile of a width and dtype costs seconds (about 30 s cold on 2 cores here, 5 s
for another width in the same process); inductor's on-disk cache serves the next process."""

from __future__ import annotations

from parity_cli.backends import Runtime

NAME = "torch.compile"
RUNTIME = Runtime(
    "torch.compile", "the family's module class (else the hf transcription) compiled by torch.compile with inductor "
    "(generated C++ on CPU, Triton on CUDA), dynamic shapes; seconds to compile each width and dtype", package="torch",
    install="pip install torch", distributions=("torch",), public="torch.compile of the module, default options",
    order=70)
_COMPILED: dict = {}


def check_layer(layer, dtype: str | None = None) -> None:
    """Inductor compiles whatever the module computes: every kind and dtype."""


def describe(device: str = "cpu") -> dict:
    import torch

    return {"runtime": f"torch {torch.__version__}", "backend": "inductor",
            "kernel": "Triton (generated)" if device.startswith("cuda") else "C++/OpenMP (generated)",
            "computes_in": "the graph's dtypes; a half-precision reduction in float32 inside the fused kernel",
            "dynamic": True}


def prepare(layer, weight, bias, eps: float, eager):
    """`eager`: the family's norm as a function of x (the transformers module, or the hf
    transcription), compiled here with inductor."""
    import torch

    compiled = torch.compile(eager, backend="inductor", dynamic=True, fullgraph=False)

    def run(x):
        with torch.no_grad():
            return compiled(x)

    return run
