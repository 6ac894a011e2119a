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
    order=70,
    start_seconds=6.0)  # inductor's import and a first compile
# dynamo keeps at most config.recompile_limit (8) compiled variants of one code object and then runs
# it eagerly, saying only a warning: one module class (or the one wrapper every compiled callable
# shares) at a few kinds and three dtypes in one process reaches it, and eager torch would be
# reported as inductor's. Each call raises the limit and makes hitting it an error instead.
RECOMPILE_LIMIT = 64


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
        with torch.no_grad(), _compiling():
            return compiled(x)

    return run


def _compiling():
    """Dynamo's settings for a call: compiled, never the silent eager fallback (RECOMPILE_LIMIT)."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True)


_PUBLIC: dict = {}


def public_path(layer, weight, bias, eps: float):
    """The same norm through torch.compile's public path, as a user compiles a model, written apart
    from prepare (issue 46's differential truth): `torch.compile(module)` with default options
    (inductor; shapes static first, then dynamic as torch decides) of the model's own module with
    its tensors as parameters (backends.deployed). Built once per layer, dtype and eps (parity
    prepares a candidate once per probe set)."""
    import torch

    from parity_cli.backends.deployed import Built, fingerprint, norm_module

    built = _PUBLIC.setdefault("built", Built())
    compiled = built.get(fingerprint(layer, weight, bias, eps),
                         lambda: torch.compile(norm_module(layer, weight, bias, eps)))

    def run(x):
        with torch.no_grad(), _compiling():  # one process checks many layers: compiled, or an error
            return compiled(x)

    return run
